#!/usr/bin/env python3
"""Supervision of `hspmd train --nproc N` (docs/execution.md, "Supervision";
docs/reliability.md), with examples/models/llama-tiny-8l.json on 2 ranks:

* --part signals: SIGTERM / SIGINT to the launcher end mpirun and every rank
  within seconds (exit 128+S, one line); SIGKILL to the launcher ends the
  ranks too (their watcher sees the launcher's FIFO hang up); a rank killed
  with SIGKILL is named with its signal; without --threads each rank gets
  max(1, cores / N) threads;
* --part watchdog: a rank stopped with SIGSTOP ends the job after --timeout
  with one line naming the rank;
* --part lock: a second run writing the same --log (or --checkpoint) as a
  live run is refused with one line, and the first run's log stays valid
  JSON lines.

usage: launcher_test.py --hspmd PATH --repo PATH --part signals|watchdog|lock
"""
import argparse
import json
import os
import random
import signal
import struct
import subprocess
import sys
import tempfile
import time

STRATEGY = {"pipelines": [{"micro_batch_size": 1, "micro_batches": 1, "stages": [{"ranks": [r], "layers": [0, 7]}]}
                          for r in range(2)]}


def job_pids(marker):
    """pid -> role ('mpirun', 'rank R' or 'launcher') of the processes whose command line holds marker."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            if not any(marker.encode() in a for a in cmd):
                continue
            stat = open(f"/proc/{pid}/stat").read()
            if stat[stat.rindex(")") + 2] == "Z":
                continue
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        rank = [e for e in env if e.startswith(b"OMPI_COMM_WORLD_RANK=")]
        if os.path.basename(cmd[0].decode()) == "mpirun":
            out[int(pid)] = "mpirun"
        elif rank:
            out[int(pid)] = "rank " + rank[0].split(b"=")[1].decode()
            out[int(pid), "cmd"] = [a.decode() for a in cmd]
        else:
            out[int(pid)] = "launcher"
    return out


def roles(pids):
    return {k: v for k, v in pids.items() if not isinstance(k, tuple)}


def wait_for(cond, timeout, step=0.2):
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return True
        time.sleep(step)
    return cond()


def log_lines(path):
    try:
        return open(path).read().splitlines()
    except OSError:
        return []


class Job:
    def __init__(self, a, tmp):
        self.a, self.tmp = a, tmp
        self.model = os.path.join(a.repo, "examples", "models", "llama-tiny-8l.json")
        self.data = os.path.join(tmp, "data.bin")
        rng = random.Random(3)
        with open(self.data, "wb") as f:
            f.write(b"".join(struct.pack("<I", rng.randrange(256)) for _ in range(20000)))
        self.strategy = os.path.join(tmp, "dp2.json")
        json.dump(STRATEGY, open(self.strategy, "w"))
        self.failures = []

    def cmd(self, log, extra=(), nproc=2):
        c = [self.a.hspmd, "train", "--model", self.model, "--data", self.data, "--seq-len", "32",
             "--steps", "100000", "--lr", "1e-3", "--quiet", "--log", log]
        if nproc:
            c += ["--strategy", self.strategy, "--nproc", str(nproc)]
        else:
            c += ["--global-batch", "2", "--threads", "1"]
        return c + list(extra)

    def start(self, log, extra=(), nproc=2):
        p = subprocess.Popen(self.cmd(log, extra, nproc), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
        if not wait_for(lambda: len(log_lines(log)) >= 2 or p.poll() is not None, 120):
            self.check("job started", False, "no 2 log lines in 120 s")
        if p.poll() is not None:
            self.check("job started", False, "exited early: " + p.stderr.read()[-2000:])
        return p

    def check(self, label, ok, detail=""):
        print(f"{label:52s} {'ok' if ok else 'FAIL'} {detail}", flush=True)
        if not ok:
            self.failures.append(label)

    def ends(self, label, p, timeout=20):
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.check(label + ": the launcher exits", False, f"still running after {timeout} s")
            p.kill()
            p.wait()
        return p.returncode, p.stderr.read()

    def all_gone(self, label, timeout=20):
        gone = wait_for(lambda: not roles(job_pids(self.tmp)), timeout)
        left = roles(job_pids(self.tmp))
        self.check(label + ": no process of the job is left", gone, str(sorted(left.values())))
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def part_signals(j):
    cores = os.cpu_count() or 1
    for sig, name in [(signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "SIGINT")]:
        log = os.path.join(j.tmp, name + ".jsonl")
        p = j.start(log)
        pids = job_pids(j.tmp)
        ranks = [pid for pid, role in roles(pids).items() if role.startswith("rank")]
        j.check(f"{name}: 2 ranks running", len(ranks) == 2, str(sorted(roles(pids).values())))
        if sig == signal.SIGTERM and ranks:
            cmd = pids[ranks[0], "cmd"]
            got = cmd[cmd.index("--threads") + 1] if "--threads" in cmd else None
            j.check("threads per rank default to cores / N", got == str(max(1, cores // 2)),
                    f"--threads {got}, cores {cores}")
        p.send_signal(sig)
        rc, err = j.ends(name, p)
        lines = [l for l in err.splitlines() if l.strip()]
        j.check(f"{name}: exit {128 + sig} with one line naming it",
                rc == 128 + sig and len(lines) == 1 and name in lines[0], f"rc {rc}: {err.strip()[:300]!r}")
        j.all_gone(name)

    log = os.path.join(j.tmp, "sigkill.jsonl")
    p = j.start(log)
    p.kill()
    p.wait()
    j.all_gone("SIGKILL to the launcher")

    log = os.path.join(j.tmp, "rankkill.jsonl")
    p = j.start(log)
    rank1 = [pid for pid, role in roles(job_pids(j.tmp)).items() if role == "rank 1"]
    j.check("rank 1 found", len(rank1) == 1)
    for pid in rank1:
        os.kill(pid, signal.SIGKILL)
    rc, err = j.ends("rank 1 killed", p)
    lines = [l for l in err.splitlines() if l.strip()]
    j.check("rank 1 killed: one line naming the rank and signal",
            rc != 0 and len(lines) == 1 and "rank 1" in lines[0] and "signal 9" in lines[0],
            f"rc {rc}: {err.strip()[:300]!r}")
    j.all_gone("rank 1 killed")


def part_watchdog(j):
    log = os.path.join(j.tmp, "stop.jsonl")
    p = j.start(log, ["--timeout", "8"])
    rank1 = [pid for pid, role in roles(job_pids(j.tmp)).items() if role == "rank 1"]
    j.check("rank 1 found", len(rank1) == 1)
    t0 = time.time()
    for pid in rank1:
        os.kill(pid, signal.SIGSTOP)
    rc, err = j.ends("SIGSTOP on rank 1", p, timeout=50)
    took = time.time() - t0
    lines = [l for l in err.splitlines() if l.strip()]
    j.check("SIGSTOP on rank 1: one line naming rank 1",
            rc != 0 and len(lines) == 1 and "[watchdog]" in lines[0] and "rank 1" in lines[0],
            f"rc {rc} after {took:.1f} s: {err.strip()[:300]!r}")
    # The heartbeat ticks every 0.2 s: its last tick before the SIGSTOP may
    # be that much older than the signal.
    j.check("SIGSTOP on rank 1: ended after the timeout", 7.5 <= took <= 45, f"{took:.1f} s")
    j.all_gone("SIGSTOP on rank 1")


def part_lock(j):
    log = os.path.join(j.tmp, "shared.jsonl")
    ckpt = os.path.join(j.tmp, "ckpt")
    first = j.start(log, ["--checkpoint", ckpt, "--save-every", "100000"], nproc=0)
    before = len(log_lines(log))
    other = os.path.join(j.tmp, "other.jsonl")
    for label, cmd, needle in [
            ("single process, same --log", j.cmd(log, nproc=0), "--log"),
            ("--nproc 2, same --log", j.cmd(log, ["--timeout", "60"]), "--log"),
            ("same --checkpoint", j.cmd(other, ["--checkpoint", ckpt], nproc=0), "--checkpoint")]:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        lines = [l for l in r.stderr.splitlines() if l.strip()]
        j.check(label + ": refused with one line", r.returncode != 0 and len(lines) == 1 and
                needle in lines[0] and "another" in lines[0], f"rc {r.returncode}: {r.stderr.strip()[:300]!r}")
    j.check("the refused run wrote no --log of its own", not os.path.exists(other))
    j.check("the first run goes on", first.poll() is None and
            wait_for(lambda: len(log_lines(log)) > before + 1, 30))
    first.terminate()
    first.wait(timeout=30)
    bad = []
    for line in log_lines(log):
        try:
            json.loads(line)
        except ValueError:
            bad.append(line)
    j.check("every line of the shared log is JSON", not bad, repr(bad[:2]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", required=True)
    ap.add_argument("--repo", required=True)
    ap.add_argument("--part", required=True, choices=["signals", "watchdog", "lock"])
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="hspmd-launcher-") as tmp:
        j = Job(a, tmp)
        try:
            {"signals": part_signals, "watchdog": part_watchdog, "lock": part_lock}[a.part](j)
        finally:
            for pid in roles(job_pids(tmp)):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
    if j.failures:
        sys.exit("FAILED: " + ", ".join(j.failures))
    print("PASS")


if __name__ == "__main__":
    main()
