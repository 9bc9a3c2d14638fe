"""Measured links (docs/cluster.md "Measured links", docs/multi_host.md).

Three test hosts (scripts/netns_cluster.sh, namespaces hlk-h*, apart from
netns_test.py's hspmd-h*) of 2 slots, every link shaped to 100mbit but host
2's to 10mbit:

* `hspmd profile --links --hostfile` measures every host pair and each host
  inside: the two fast pairs near 100mbit, the slow ones near 10mbit (ratio
  within [0.07, 0.14]), inside a host far faster; it refuses to write over
  its hostfile; plan cost reads a bad links file as a one-line error;
* `plan search --links` over the measured links picks a plan that leaves the
  slow link off the critical path (no rank of host 2) and keeps each stage
  (its TP collectives, the bottom tier) inside one host, where `plan search`
  over the cluster file's uniform links picks one across all three hosts;
* trained on the hosts, the first is >= 1.3x faster per step (median of the
  steps after the first two) than the second, and `plan cost --links`
  predicts both step times within TOLERANCE (15%).

Exit 77 (skipped) where this machine cannot make network namespaces."""
import argparse
import json
import os
import random
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from netns_test import Failed, can_make_namespaces, sh  # noqa: E402

PREFIX, SUBNET = "hlk", "10.213.9"
FAST_MBIT, SLOW_MBIT = 50, 5
# Communication, not the 2 cores, dominates: a small model whose gradient
# sync (3 pipelines, over host 2's link) or pipeline boundaries cross links.
MODEL = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 128, "eos_token_id": 0}
SEQ, BATCH, STEPS = 128, 24, 10
# GPipe: a pipeline's forward messages, then its backward ones. (Under 1F1B they
# cross the link both ways at once, which the cost model bills one after the
# other.)
SCHEDULE = "gpipe"
# The cost model against the measured step times, within 15% (the issue's
# goal). Both plans' steps are their links' traffic: the uniform plan's
# gradient sync over host 2's link (a ring since the MPI backend asks Open
# MPI for one, docs/comm.md), the routed plan's stage boundary.
TOLERANCE = 0.15
CLUSTER = {"catalog": {"cpu": {"tflops": 0.05, "memory_gib": 4, "intra_node_gbps": 1,
                               "inter_node_gbps": FAST_MBIT / 8000}},
           "nodes": [{"type": "cpu", "ranks": [2 * k, 2 * k + 1]} for k in range(3)]}


class Cluster:
    """Three test hosts of 2 slots named PREFIX-hK (heartbeat_test.py uses its own)."""
    def __init__(self, script, tmp, prefix=PREFIX, subnet=SUBNET, shape=f"* {FAST_MBIT}mbit 0\n2 {SLOW_MBIT}mbit 0\n"):
        self.script, self.dir = script, os.path.join(tmp, "netns")
        self.env = dict(os.environ, HSPMD_NETNS_PREFIX=prefix, HSPMD_NETNS_SUBNET=subnet, HSPMD_NETNS_DIR=self.dir)
        self.shape = os.path.join(tmp, "shape.conf")
        with open(self.shape, "w") as f:
            f.write(shape)

    def up(self):
        sh([self.script, "up", "3", "--slots", "2", "--shape", self.shape], env=self.env)
        # What the env file exports (the rsh agent, TCP on the subnet), read into ours.
        out = sh(["bash", "-c", f"source {self.dir}/env && env -0"], env=self.env).stdout
        self.env = dict(kv.split("=", 1) for kv in out.split("\0") if "=" in kv)
        self.hostfile = os.path.join(self.dir, "hostfile")

    def down(self):
        subprocess.run([self.script, "down"], env=self.env, capture_output=True, timeout=120)

    def run(self, cmd, check=True):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=self.env)
        if check and r.returncode:
            raise Failed(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr.strip()}")
        return r


def check_links(c, hspmd, tmp):
    links = os.path.join(tmp, "links.json")
    t0 = time.time()
    c.run([hspmd, "profile", "--links", "--hostfile", c.hostfile, "-o", links, "--repetitions", "3"])
    table = json.load(open(links))
    if table["hosts"] != [f"{PREFIX}-h{k}" for k in range(3)]:
        raise Failed(f"profile --links: hosts {table['hosts']}")
    got = {tuple(l["hosts"]): l for l in table["links"]}
    if sorted(got) != [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (2, 2)]:
        raise Failed(f"profile --links: pairs {sorted(got)}")
    mbs = {k: l["gbps"] * 1e3 for k, l in got.items()}
    fast = mbs[(0, 1)]
    if not FAST_MBIT / 8 * 0.8 <= fast <= FAST_MBIT / 8 * 1.05:
        raise Failed(f"profile --links: hosts 0-1 at {fast:.3g} MB/s, shaped to {FAST_MBIT / 8} MB/s")
    for slow in ((0, 2), (1, 2)):
        if not 0.07 <= mbs[slow] / fast <= 0.14:
            raise Failed(f"profile --links: hosts {slow} at {mbs[slow]:.3g} MB/s against {fast:.3g} (ratio 0.1)")
    for k in range(3):
        if mbs[(k, k)] < 10 * fast:
            raise Failed(f"profile --links: inside host {k} only {mbs[(k, k)]:.3g} MB/s")
    if any(l["latency_us"] < 0 for l in got.values()):
        raise Failed("profile --links: a negative latency")
    print(f"ok   profile --links in {time.time() - t0:.1f} s: " +
          ", ".join(f"{a}-{b} {mbs[(a, b)]:.3g} MB/s {got[(a, b)]['latency_us']:.0f} us" for a, b in sorted(got)))
    return links


def check_errors(c, hspmd, tmp, links):
    before = open(c.hostfile).read()
    r = c.run([hspmd, "profile", "--links", "--hostfile", c.hostfile, "-o", c.hostfile], check=False)
    if r.returncode != 1 or "--output" not in r.stderr or open(c.hostfile).read() != before:
        raise Failed(f"profile --links -o HOSTFILE: exit {r.returncode}: {r.stderr.strip()}")
    bad = os.path.join(tmp, "bad_links.json")
    table = json.load(open(links))
    table["links"][1]["gbps"] = 0
    json.dump(table, open(bad, "w"))
    r = c.run([hspmd, "plan", "cost", "--model", os.path.join(tmp, "model.json"), "--cluster",
               os.path.join(tmp, "cluster.json"), "--strategy", os.path.join(tmp, "uniform.json"), "--seq-len",
               str(SEQ), "--links", bad], check=False)
    if r.returncode != 1 or "[links]" not in r.stderr or "gbps" not in r.stderr or r.stderr.count("\n") != 1:
        raise Failed(f"plan cost with a bad links file: exit {r.returncode}: {r.stderr.strip()}")
    print(f"ok   refused: {r.stderr.strip()}")


def hosts_of(plan):
    return {r // 2 for p in plan["pipelines"] for s in p["stages"] for r in s["ranks"]}


def search(c, hspmd, tmp, name, extra):
    out = os.path.join(tmp, name + ".json")
    c.run([hspmd, "plan", "search", "--model", os.path.join(tmp, "model.json"), "--cluster",
           os.path.join(tmp, "cluster.json"), "--profile", os.path.join(tmp, "profile.json"), "--global-batch",
           str(BATCH), "--seq-len", str(SEQ), "--time-limit", "20", "--schedule", SCHEDULE, "-o", out] + extra)
    return out, json.load(open(out))


def predicted(c, hspmd, tmp, plan, links):
    r = c.run([hspmd, "plan", "cost", "--model", os.path.join(tmp, "model.json"), "--cluster",
               os.path.join(tmp, "cluster.json"), "--profile", os.path.join(tmp, "profile.json"), "--strategy", plan,
               "--seq-len", str(SEQ), "--links", links, "--json"])
    return json.loads(r.stdout)["predicted_step_s"]


def measured(c, hspmd, tmp, plan, name):
    log = os.path.join(tmp, name + ".log")
    c.run([hspmd, "train", "--model", os.path.join(tmp, "model.json"), "--data", os.path.join(tmp, "data.bin"),
           "--seq-len", str(SEQ), "--global-batch", str(BATCH), "--steps", str(STEPS), "--strategy", plan,
           "--hostfile", c.hostfile, "--nproc", "6", "--threads", "1", "--quiet", "--log", log])
    times = [json.loads(l)["step_time_s"] for l in open(log) if '"step_time_s"' in l]
    return statistics.median(times[2:])


def check_plans(c, hspmd, tmp, links):
    uniform, uplan = search(c, hspmd, tmp, "uniform", [])
    routed, rplan = search(c, hspmd, tmp, "routed", ["--links", links])
    if 2 not in hosts_of(uplan):
        raise Failed(f"plan search over uniform links left host 2 out: {uplan}")
    if 2 in hosts_of(rplan):
        raise Failed(f"plan search --links put work on host 2 behind the slow link: {rplan}")
    # The two tiers: a stage's ranks (its bottom tier: the TP collectives of
    # every layer) inside one host, the pipeline's boundaries (the top tier)
    # across hosts.
    split = [s["ranks"] for p in rplan["pipelines"] for s in p["stages"] if len({r // 2 for r in s["ranks"]}) > 1]
    if split:
        raise Failed(f"plan search --links put a stage across hosts: {split}")
    rows = []
    for name, plan in (("uniform", uniform), ("routed", routed)):
        p, m = predicted(c, hspmd, tmp, plan, links), measured(c, hspmd, tmp, plan, name)
        rows.append((name, p, m))
        print(f"     {name}: predicted {p:.4f} s, measured {m:.4f} s ({100 * (p / m - 1):+.1f}%)")
    speedup = rows[0][2] / rows[1][2]
    if speedup < 1.3:
        raise Failed(f"the routed plan is only {speedup:.2f}x faster than the uniform one")
    for name, p, m in rows:
        if abs(p / m - 1) > TOLERANCE:
            raise Failed(f"{name}: predicted {p:.4f} s, measured {m:.4f} s: beyond {100 * TOLERANCE:.0f}%")
    print(f"ok   plan search --links avoids host 2: {speedup:.2f}x faster per step; predictions within "
          f"{100 * TOLERANCE:.0f}%")


def write_inputs(hspmd, tmp):
    json.dump(MODEL, open(os.path.join(tmp, "model.json"), "w"))
    json.dump(CLUSTER, open(os.path.join(tmp, "cluster.json"), "w"))
    json.dump({"pipelines": [{"micro_batch_size": 1, "micro_batches": BATCH, "stages": [
        {"ranks": [0, 1], "layers": [0, 1]}]}]}, open(os.path.join(tmp, "uniform.json"), "w"))
    rng = random.Random(7)
    with open(os.path.join(tmp, "data.bin"), "wb") as f:
        f.write(b"".join(struct.pack("<I", rng.randrange(MODEL["vocab_size"])) for _ in range(65536)))
    # Compute from a profile of this machine (the roofline knows no CPU).
    sh([hspmd, "profile", "--model", os.path.join(tmp, "model.json"), "--tp", "1,2", "--seq-lens", str(SEQ),
        "--micro-batch-sizes", "1,2,4,8", "-o", os.path.join(tmp, "profile.json")])


def run_on_cluster(name, prefix, tmp, make_cluster, checks):
    """Skips (77) where namespaces cannot be made; else brings the cluster
    up, runs checks(c), and always takes it down, failing when down leaves
    a namespace or the cluster's directory behind."""
    why, _ = can_make_namespaces(tmp)
    if why:
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"SKIP: this machine cannot make test hosts: {why}")
        return 77
    c = make_cluster()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # still runs `down` below
    c.down()  # a cluster a killed run left behind
    t0 = time.time()
    try:
        checks(c)
    except Failed as e:
        print(f"FAIL: {e}")
        return 1
    finally:
        c.down()
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    if f"{prefix}-h" in left or os.path.exists(c.dir):
        print(f"FAIL: down left {left.strip()}")
        return 1
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"{name}: all checks passed in {time.time() - t0:.0f} s")
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", required=True)
    ap.add_argument("--script", required=True, help="scripts/netns_cluster.sh")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="hspmd_links_")

    def checks(c):
        write_inputs(args.hspmd, tmp)
        c.up()
        links = check_links(c, args.hspmd, tmp)
        check_errors(c, args.hspmd, tmp, links)
        check_plans(c, args.hspmd, tmp, links)

    return run_on_cluster("netns_links", PREFIX, tmp, lambda: Cluster(args.script, tmp), checks)


if __name__ == "__main__":
    sys.exit(main())
