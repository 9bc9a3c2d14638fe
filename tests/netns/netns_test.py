"""Test hosts on one machine (scripts/netns_cluster.sh, docs/multi_host.md).

Three network namespaces with their own host names and addresses on a
bridge; `hspmd train --hostfile` runs 8 ranks on them (3, 3 and 2) through
mpirun and the clusters's rsh agent:

* plans with pipelines, TP and CP inside and across hosts equal one process
  (losses and final weights);
* the records' cross-host bytes (TCP stream bytes and segments the ranks'
  sockets report) plus one Ethernet, IPv4 and TCP header (66 bytes) a segment
  equal what the hosts' interfaces sent, within 5%, after the baseline: the
  same job one step long (launch, wire-up, setup, teardown) and the
  interfaces' idle traffic;
* the launcher's guarantees across hosts: a rank killed on host hspmd-h1 is
  named with its host in one line (exit 1), so is one stopped (SIGSTOP)
  under the watchdog (`--timeout 3`), SIGTERM to the launcher ends every
  rank on every host (exit 143), `--max-restarts` restarts it
  (train from the checkpoint; launch from the script's start), too many ranks
  for the slots is a one-line error, and no process is left on any host;
* `up` that fails half way removes what it made, and `down` leaves no
  namespace, bridge, veth, directory or process behind.

Exit 77 (skipped) where this machine cannot make network namespaces."""
import argparse
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

MODEL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 64,
         "eos_token_id": 0}
HOSTS = 3
FRAME_HEADER = 66  # Ethernet 14 + IPv4 20 + TCP 20 + timestamps option 12


def pipeline(mbs, micro, stages):
    return {"micro_batch_size": mbs, "micro_batches": micro,
            "stages": [{"ranks": r, "layers": l, **({"cp": c} if c > 1 else {})} for r, l, c in stages]}


# 8 ranks on hosts h0 (ranks 0-2), h1 (3-5), h2 (6, 7); global batch 8.
PLANS = {
    # Two pipelines: TP2 in h0 then TP2 across h0/h1; CP2 in h1 then TP2 in
    # h2 (stage boundaries and the data-parallel sync cross hosts).
    "pp_tp_cp": {"schedule": "1f1b", "pipelines": [
        pipeline(2, 2, [([0, 1], [0, 1], 1), ([2, 3], [2, 3], 1)]),
        pipeline(2, 2, [([4, 5], [0, 1], 2), ([6, 7], [2, 3], 1)])]},
    # TP4 across h0/h1; a pipeline into CP2 across h1/h2; one rank alone.
    "tp4_cp_across": {"schedule": "gpipe", "pipelines": [
        pipeline(2, 2, [([0, 1, 2, 3], [0, 3], 1)]),
        pipeline(1, 2, [([4], [0, 1], 1), ([5, 6], [2, 3], 2)]),
        pipeline(2, 1, [([7], [0, 3], 1)])]},
}


class Failed(Exception):
    pass


def sh(cmd, check=True, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)
    if check and r.returncode:
        raise Failed(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr.strip()}")
    return r


def our_names():
    """The namespaces and links of ours that exist."""
    ns = [l.split()[0] for l in sh(["ip", "netns", "list"]).stdout.splitlines() if l.startswith("hspmd-h")]
    links = [l.split(":")[1].strip().split("@")[0] for l in sh(["ip", "-o", "link", "show"]).stdout.splitlines()
             if l.split(":")[1].strip().startswith("hspmd-")]
    return ns, links


def ns_pids(k):
    return [int(p) for p in sh(["ip", "netns", "pids", f"hspmd-h{k}"], check=False).stdout.split()]


def nothing_left(netns_dir, what):
    ns, links = our_names()
    if ns or links or os.path.exists(netns_dir):
        raise Failed(f"{what}: left behind namespaces {ns}, links {links}, dir {os.path.exists(netns_dir)}")
    print(f"ok   {what}: no namespace, bridge, veth or directory left")


def counters():
    """Bytes and packets each host's interface sent (inside its namespace)."""
    out = []
    for k in range(HOSTS):
        text = sh(["ip", "netns", "exec", f"hspmd-h{k}", "cat", "/sys/class/net/hnet0/statistics/tx_bytes",
                   "/sys/class/net/hnet0/statistics/tx_packets"]).stdout.split()
        out.append((int(text[0]), int(text[1])))
    return out


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, meta in header.items():
        if name != "__metadata__":
            b, e = meta["data_offsets"]
            out[name] = struct.unpack("<%df" % ((e - b) // 4), data[b:e])
    return out


def records(path):
    with open(path) as f:
        return [json.loads(l) for l in f]


class Cluster:
    def __init__(self, args, tmp, netem):
        self.script, self.hspmd, self.tmp = args.script, args.hspmd, tmp
        # Host 2's link slower; host 1's delayed where the kernel has netem.
        self.shape = {0: ("1gbit", "0"), 1: ("1gbit", "1ms" if netem else "0"), 2: ("200mbit", "0")}
        self.dir = os.path.join(tmp, "netns")
        self.env = {**os.environ, "HSPMD_NETNS_DIR": self.dir}

    def run(self, cmd, check=True):
        return sh([self.script] + cmd, check=check, env=self.env)

    def up(self):
        shape = os.path.join(self.tmp, "shape.conf")
        with open(shape, "w") as f:
            f.write("# host rate delay\n* 1gbit 0\n" + "".join(f"{k} {r} {d}\n" for k, (r, d) in self.shape.items()))
        self.run(["up", str(HOSTS), "--slots", "3", "--shape", shape])
        for line in open(os.path.join(self.dir, "env")):
            if line.startswith("export "):
                key, value = line[len("export "):].strip().split("=", 1)
                self.env[key] = value.strip('"')
        self.hostfile = os.path.join(self.dir, "hostfile")

    def down(self):
        self.run(["down"], check=False)


def check_hosts(c):
    for k in range(HOSTS):
        out = c.run(["rsh", f"hspmd-h{k}", "hostname; ip -4 -o addr show hnet0; ip route"]).stdout
        if not out.startswith(f"hspmd-h{k}\n") or f"10.213.7.{k + 1}/24" not in out or "default" in out:
            raise Failed(f"host {k}: unexpected name, address or routes:\n{out}")
        unreachable = sh(["ip", "netns", "exec", f"hspmd-h{k}", "ip", "route", "get", "1.1.1.1"], check=False)
        if unreachable.returncode == 0:
            raise Failed(f"host {k} has a route out: {unreachable.stdout}")
        rate, delay = c.shape[k]
        shown = (sh(["ip", "netns", "exec", f"hspmd-h{k}", "tc", "qdisc", "show", "dev", "hnet0"]).stdout +
                 sh(["tc", "qdisc", "show", "dev", f"hspmd-v{k}"]).stdout).lower()
        want = rate.replace("bit", "") + "bit"
        if shown.count(f"rate {want}") != 2 or (delay != "0" and shown.count(f"delay {delay}") != 2):
            raise Failed(f"host {k}: expected rate {rate} and delay {delay} both ways, tc shows:\n{shown}")
    print(f"ok   {HOSTS} hosts: own names and addresses, no route out of the bridge's subnet, links shaped "
          f"({', '.join(f'{r} {d}' for r, d in c.shape.values())})")


def train_cmd(c, tmp, steps, extra):
    return [c.hspmd, "train", "--model", os.path.join(tmp, "model.json"), "--data", os.path.join(tmp, "data.bin"),
            "--steps", str(steps), "--lr", "3e-3", "--eps", "1e-5", "--weight-decay", "0.1", "--clip-grad", "0.5",
            "--threads", "1", "--quiet", "--seq-len", "16", "--global-batch", "8"] + extra


def on_hosts(c, tmp, name, steps, extra=()):
    log = os.path.join(tmp, f"{name}.jsonl")
    cmd = train_cmd(c, tmp, steps, ["--strategy", os.path.join(tmp, name.split(".")[0] + ".json"),
                                    "--hostfile", c.hostfile, "--nproc", "8", "--log", log] + list(extra))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=c.env)
    return r, log


def check_plans(c, tmp):
    ref_log, ref_w = os.path.join(tmp, "one.jsonl"), os.path.join(tmp, "one.safetensors")
    sh(train_cmd(c, tmp, 3, ["--micro-batches", "4", "--log", ref_log, "--save", ref_w]))
    want, want_w = [r["loss"] for r in records(ref_log)], read_safetensors(ref_w)
    for name in PLANS:
        weights = os.path.join(tmp, name + ".safetensors")
        r, log = on_hosts(c, tmp, name, 3, ["--save", weights])
        if r.returncode:
            raise Failed(f"{name} on 3 hosts failed: {r.stderr}")
        got = records(log)
        rel = max(abs(a - g["loss"]) / abs(a) for a, g in zip(want, got))
        got_w = read_safetensors(weights)
        werr = max(max(abs(a - b) for a, b in zip(got_w[k], v)) / max(1e-12, max(abs(b) for b in v))
                   for k, v in want_w.items())
        crossing = [len(g.get("cross_host_bytes_sent", [])) for g in got]
        if len(got) != len(want) or rel > 1e-5 or werr > 1e-4 or crossing != [8] * len(got):
            raise Failed(f"{name}: loss rel err {rel:.2e}, weights err {werr:.2e}, cross-host fields {crossing}")
        print(f"ok   {name:14s} 8 ranks on 3 hosts = one process: loss rel err {rel:.2e}, weights {werr:.2e}")


def wire_job(c, tmp, steps):
    before, t0 = counters(), time.time()
    r, log = on_hosts(c, tmp, f"pp_tp_cp.wire{steps}", steps)
    after, seconds = counters(), time.time() - t0
    if r.returncode:
        raise Failed(f"wire job of {steps} steps failed: {r.stderr}")
    recs = records(log)
    sent = sum(sum(x["cross_host_bytes_sent"]) for x in recs)
    segments = sum(sum(x["cross_host_segments"]) for x in recs)
    wire = sum(a[0] - b[0] for a, b in zip(after, before))
    packets = sum(a[1] - b[1] for a, b in zip(after, before))
    return sent, segments, wire, packets, seconds


def check_wire(c, tmp):
    """The 6-step job's interface bytes minus its baseline (the 1-step job,
    and the idle interfaces' rate over the longer job's extra seconds)
    against its records' bytes beyond the baseline's, framed."""
    idle0, t0 = counters(), time.time()
    time.sleep(1.0)
    idle = sum(a[0] - b[0] for a, b in zip(counters(), idle0)) / (time.time() - t0)
    base = wire_job(c, tmp, 1)
    full = wire_job(c, tmp, 6)
    sent, segments, wire, packets, seconds = (f - b for f, b in zip(full, base))
    wire -= idle * max(0.0, seconds)
    expected = sent + FRAME_HEADER * segments
    err = abs(wire - expected) / expected
    print(f"     idle: {idle:.0f} bytes/s; 5 steps beyond the baseline: records {sent} stream bytes in {segments} "
          f"segments -> {expected} bytes framed; interfaces {wire:.0f} bytes in {packets} frames")
    if sent <= 0 or err > 0.05:
        raise Failed(f"interface bytes {wire} vs records' {expected}: {err:.2%} apart (> 5%)")
    print(f"ok   bytes on the wire: interfaces = records + 66 B a segment within {err:.2%}")


def rank_pid_on(k, word):
    """A process on host k whose command line holds `word` (a rank)."""
    for pid in ns_pids(k):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if any(word.encode() in a for a in cmdline) and b"orted" not in cmdline[0]:
            return pid
    return None


def kill_rank_when(c, proc, k, word, ready, deadline_s=60, sig=signal.SIGKILL):
    """Sends `sig` to a rank on host k once ready() holds; returns its pid."""
    end = time.time() + deadline_s
    while time.time() < end and proc.poll() is None:
        pid = rank_pid_on(k, word)
        if pid and ready():
            os.kill(pid, sig)
            return pid
        time.sleep(0.05)
    raise Failed(f"no rank on host hspmd-h{k} to kill (job exited {proc.poll()})")


def no_process_left(what):
    time.sleep(0.5)
    left = {k: ns_pids(k) for k in range(HOSTS)}
    if any(left.values()):
        raise Failed(f"{what}: processes left on the hosts: {left}")


def check_kill(c, tmp):
    log = os.path.join(tmp, "kill.jsonl")
    cmd = train_cmd(c, tmp, 100000, ["--strategy", os.path.join(tmp, "pp_tp_cp.json"), "--hostfile", c.hostfile,
                                     "--log", log])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=c.env)
    kill_rank_when(c, proc, 1, "train", lambda: os.path.exists(log) and os.path.getsize(log) > 0)
    _, err = proc.communicate(timeout=60)
    lines = [l for l in err.splitlines() if "error" in l]
    if proc.returncode != 1 or len(lines) != 1 or "on host hspmd-h1 was killed by signal 9" not in lines[0]:
        raise Failed(f"a rank killed on hspmd-h1: exit {proc.returncode}, stderr:\n{err}")
    no_process_left("a killed rank")
    print(f"ok   {lines[0]} (exit 1, nothing left on the hosts)")


def check_sigterm(c, tmp):
    # Without --nproc the job takes every slot: 9 ranks, the plan's 8 and an idle one.
    log = os.path.join(tmp, "term.jsonl")
    cmd = train_cmd(c, tmp, 100000, ["--strategy", os.path.join(tmp, "pp_tp_cp.json"), "--hostfile", c.hostfile,
                                     "--log", log])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=c.env)
    end = time.time() + 60
    while not (os.path.exists(log) and os.path.getsize(log) > 0) and time.time() < end and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    lines = [l for l in err.splitlines() if "error" in l]
    if proc.returncode != 128 + signal.SIGTERM or lines != ["hspmd: error: [launch] SIGTERM: ended the job's 9 ranks"]:
        raise Failed(f"SIGTERM to the launcher: exit {proc.returncode}, stderr:\n{err}")
    no_process_left("SIGTERM to the launcher")
    print(f"ok   {lines[0]} (exit 143, nothing left on the hosts)")


def check_watchdog(c, tmp):
    log = os.path.join(tmp, "stop.jsonl")
    cmd = train_cmd(c, tmp, 100000, ["--strategy", os.path.join(tmp, "pp_tp_cp.json"), "--hostfile", c.hostfile,
                                     "--log", log, "--timeout", "3"])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=c.env)
    pid = kill_rank_when(c, proc, 1, "train", lambda: os.path.exists(log) and os.path.getsize(log) > 0,
                         sig=signal.SIGSTOP)
    _, err = proc.communicate(timeout=60)
    lines = [l for l in err.splitlines() if "error" in l]
    if proc.returncode != 1 or len(lines) != 1 or "[watchdog] rank" not in lines[0] or \
            f"on host hspmd-h1 (pid {pid}) stopped responding" not in lines[0]:
        raise Failed(f"a rank stopped on hspmd-h1 under --timeout 3: exit {proc.returncode}, stderr:\n{err}")
    no_process_left("a stopped rank")
    print(f"ok   {lines[0]} (exit 1, nothing left)")


def check_restart(c, tmp):
    ref = os.path.join(tmp, "one6.jsonl")
    sh(train_cmd(c, tmp, 6, ["--micro-batches", "4", "--log", ref]))
    want = [r["loss"] for r in records(ref)]
    log, ckpt = os.path.join(tmp, "restart.jsonl"), os.path.join(tmp, "ckpt")
    cmd = train_cmd(c, tmp, 6, ["--strategy", os.path.join(tmp, "pp_tp_cp.json"), "--hostfile", c.hostfile,
                                "--log", log, "--checkpoint", ckpt, "--save-every", "1", "--max-restarts", "1"])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=c.env)
    kill_rank_when(c, proc, 2, "train", lambda: os.path.exists(log) and len(open(log).readlines()) >= 2)
    _, err = proc.communicate(timeout=120)
    recs = records(log)
    steps = [r["loss"] for r in recs if "loss" in r]
    restarted = [r for r in recs if r.get("event") == "restart"]
    rel = max(abs(a - b) / abs(a) for a, b in zip(want, steps)) if len(steps) == len(want) else 1
    if proc.returncode != 0 or len(restarted) != 1 or "on host hspmd-h2" not in restarted[0]["reason"] or rel > 1e-5:
        raise Failed(f"--max-restarts across hosts: exit {proc.returncode}, {len(steps)} steps, rel {rel}, "
                     f"restarts {restarted}, stderr:\n{err}")
    no_process_left("a restarted job")
    print(f"ok   --max-restarts: '{restarted[0]['reason']}', restarted from step "
          f"{restarted[0]['from_step']}, 6 steps = one process (rel {rel:.1e})")


def check_launch(c, tmp):
    script = os.path.join(tmp, "rank.sh")
    marker = os.path.join(tmp, "killed-once")
    with open(script, "w") as f:
        f.write(f'hostname >> {tmp}/launch-hosts\n'
                f'if [ "$OMPI_COMM_WORLD_RANK" = 7 ] && mkdir {marker} 2>/dev/null; then kill -9 $$; fi\n'
                'sleep 1\n')
    cmd = [c.hspmd, "launch", "--hostfile", c.hostfile, "--nproc", "8", "--max-restarts", "1",
           "--python", "/bin/sh", script]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=c.env)
    hosts = sorted(open(os.path.join(tmp, "launch-hosts")).read().split())
    # The restart's warning names the rank and host from mpirun's notice;
    # mpirun sometimes exits (128 + 9) before printing it (about 1 run in 10
    # here), and the launcher then says "a rank was killed by signal 9": both
    # are one line, the restart and its result are the same.
    named = "rank 7 on host hspmd-h2 was killed by signal 9" in r.stderr or \
        "a rank was killed by signal 9" in r.stderr
    warnings = [l for l in r.stderr.splitlines() if l.strip()]
    if r.returncode != 0 or not named or len(warnings) != 1 or \
            "restarting from the start" not in r.stderr or len(set(hosts)) != HOSTS:
        raise Failed(f"launch --hostfile --max-restarts: exit {r.returncode}, hosts {hosts}, stderr:\n{r.stderr}")
    no_process_left("hspmd launch")
    print("ok   hspmd launch --hostfile: rank 7 on hspmd-h2 killed, restarted once, exit 0")


def check_errors(c, tmp):
    bad = [(train_cmd(c, tmp, 1, ["--strategy", os.path.join(tmp, "pp_tp_cp.json"), "--hostfile", c.hostfile,
                                  "--nproc", "10"]), "--nproc 10 exceeds the 9 slots of --hostfile"),
           ([c.hspmd, "launch", "--hostfile", c.hostfile, "--nproc", "10", "x.py"],
            "--nproc 10 exceeds the 9 slots of --hostfile"),
           (train_cmd(c, tmp, 1, ["--strategy", os.path.join(tmp, "pp_tp_cp.json"), "--hostfile",
                                  os.path.join(tmp, "bad_hostfile")]), "bad_hostfile:2: slots=x is not a positive")]
    with open(os.path.join(tmp, "bad_hostfile"), "w") as f:
        f.write("# hosts\nhspmd-h0 slots=x\n")
    with open(os.path.join(tmp, "odd_hostfile"), "w") as f:  # comments, max_slots, no slots, a name twice
        f.write("# the cluster\nhspmd-h0 slots=2 max_slots=4  # head\n\nhspmd-h1\nhspmd-h0 slots=1\n")
    bad.append(([c.hspmd, "launch", "--hostfile", os.path.join(tmp, "odd_hostfile"), "--nproc", "5", "x.py"],
                "--nproc 5 exceeds the 4 slots of --hostfile " + os.path.join(tmp, "odd_hostfile") +
                " (hspmd-h0 3, hspmd-h1 1)"))
    for cmd, message in bad:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=c.env)
        if r.returncode != 1 or len(r.stderr.strip().splitlines()) != 1 or message not in r.stderr:
            raise Failed(f"{' '.join(cmd[1:3])}: exit {r.returncode}, expected one line with '{message}': "
                         f"{r.stderr}")
    print("ok   too many ranks for the slots, a malformed hostfile: one line each, exit 1")


def check_failed_up(c, tmp):
    shape = os.path.join(tmp, "bad_shape.conf")
    with open(shape, "w") as f:
        f.write("* 1gbit 0\n2 0bit 0   # tc refuses a rate of 0: host 2 fails after hosts 0 and 1 are made\n")
    r = c.run(["up", str(HOSTS), "--shape", shape], check=False)
    if r.returncode == 0 or "host 2" not in r.stderr:
        raise Failed(f"up with a bad shape for host 2: exit {r.returncode}: {r.stderr}")
    nothing_left(c.dir, "a failed up")


def write_inputs(tmp):
    json.dump(MODEL, open(os.path.join(tmp, "model.json"), "w"))
    rng = random.Random(7)
    with open(os.path.join(tmp, "data.bin"), "wb") as f:
        f.write(b"".join(struct.pack("<I", rng.randrange(64)) for _ in range(8192)))
    for name, plan in PLANS.items():
        json.dump(plan, open(os.path.join(tmp, name + ".json"), "w"))


def can_make_namespaces(tmp):
    """"" when this machine can make test hosts, else why not; and whether
    its kernel has netem (a link delay)."""
    if os.geteuid() != 0:
        return "not root", False
    for tool in ("ip", "tc", "nsenter", "unshare", "hostname"):
        if subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode:
            return f"{tool} is not installed (scripts/install_deps.sh)", False
    probe, uts = f"hspmdp{os.getpid() % 100000}", os.path.join(tmp, "probe.uts")
    open(uts, "w").close()
    steps = [(["ip", "netns", "add", probe], "a network namespace"),
             (["ip", "link", "add", probe, "type", "bridge"], "a bridge"),
             (["ip", "link", "add", probe + "a", "type", "veth", "peer", "name", probe + "b"], "a veth pair"),
             (["unshare", f"--uts={uts}", "true"], "a UTS namespace kept by a bind mount")]
    why = ""
    for cmd, what in steps:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            why = f"cannot make {what}: {r.stderr.strip()}"
            break
    netem = not why and subprocess.run(["tc", "qdisc", "add", "dev", probe + "a", "root", "netem", "delay", "1ms"],
                                       capture_output=True).returncode == 0
    subprocess.run(["umount", uts], capture_output=True)
    for cmd in (["ip", "link", "del", probe + "a"], ["ip", "link", "del", probe], ["ip", "netns", "del", probe]):
        subprocess.run(cmd, capture_output=True)
    return why, netem


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", required=True)
    ap.add_argument("--script", required=True, help="scripts/netns_cluster.sh")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="hspmd_netns_")
    why, netem = can_make_namespaces(tmp)
    if why:
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"SKIP: this machine cannot make test hosts: {why}")
        return 77
    write_inputs(tmp)
    c = Cluster(args, tmp, netem)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # still runs `down` below
    c.down()  # a cluster a killed run left behind
    t0 = time.time()
    try:
        check_failed_up(c, tmp)
        c.up()
        check_hosts(c)
        check_errors(c, tmp)
        check_plans(c, tmp)
        check_wire(c, tmp)
        check_kill(c, tmp)
        check_watchdog(c, tmp)
        check_sigterm(c, tmp)
        check_restart(c, tmp)
        check_launch(c, tmp)
        sleeper = subprocess.Popen(["ip", "netns", "exec", "hspmd-h1", "sleep", "600"])
        time.sleep(0.2)
    except Failed as e:
        c.down()
        print(f"FAIL: {e}")
        return 1
    finally:
        c.down()
    sleeper.wait(timeout=10)  # ended by down
    nothing_left(c.dir, "down")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"netns_cluster: all checks passed in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
