#!/usr/bin/env python3
"""A lost rank, online re-plan against stop-and-restart (docs/benchmarks.md).

The 8-layer tiny model (examples/models/llama-tiny-8l.json) trains on 8
emulated ranks of two device speeds (--cluster: ranks 4-7 run at half speed)
under a two-pipeline strategy (TP2 x PP2 on the fast ranks beside a TP2 /
TP1 / TP1 pipeline on the slow ones), with a checkpoint after every step.
Rank 3 is lost before step 4. Measured, per repetition, is the wall-clock
time from the event to the end of the next finished step, both on the one
clock of the log records' `unix_time` (written by rank 0 as it logs):

  online    `--events E.json` with [{"step": 4, "fail": [3]}]: the run
            re-plans without rank 3 and switches to it; the time runs from
            step 3's record (the event takes effect right after it) to step
            4's. Beside it, the run's own timers for the parts
            (planning_s + specialize_s + switch_s + step 4's step_time_s);
  restart   rank 3 SIGKILLed once the checkpoint of step 4 is committed,
            under --max-restarts 1: the time runs from the SIGKILL (this
            script's clock, the same machine's) to the first step record the
            restarted job writes. Beside it, the launcher's restart record:
            recovery_s (from the death as its 20 ms poll of the ranks' pids
            sees it) = detect_s (the death until the failed attempt is gone)
            + relaunch_s (mpirun, setup, loading the checkpoint, the step).

Beside them, the median step time of an undisturbed run of the same job.
Figures are medians over --repeat runs.

usage: bench/restart_vs_online.py [--hspmd build/src/cli/hspmd] [--repeat 3] [--json OUT] [--smoke]
"""
import argparse
import json
import os
import random
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

STEPS = 8
SMOKE_STEPS = 6
CLUSTER = {"catalog": {t: {"tflops": 100, "memory_gib": 80, "intra_node_gbps": 100, "inter_node_gbps": 25}
                       for t in ("fast", "slow")},
           "nodes": [{"type": "fast", "ranks": [0, 3]}, {"type": "slow", "ranks": [4, 7], "slowdown": 2.0}]}
STRATEGY = {"schedule": "1f1b", "pipelines": [
    {"micro_batch_size": 1, "micro_batches": 5, "stages": [{"ranks": [0, 1], "layers": [0, 3]},
                                                          {"ranks": [2, 3], "layers": [4, 7]}]},
    {"micro_batch_size": 1, "micro_batches": 3, "stages": [{"ranks": [4, 5], "layers": [0, 3]},
                                                          {"ranks": [6], "layers": [4, 5]},
                                                          {"ranks": [7], "layers": [6, 7]}]}]}
EVENTS = [{"step": 4, "fail": [3]}]


def records(path):
    out = []
    for line in open(path).read().splitlines() if os.path.exists(path) else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return out


def rank_pid(marker, rank):
    """The pid of MPI rank `rank` among the processes whose command line holds marker."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if marker.encode() not in open(f"/proc/{pid}/cmdline", "rb").read():
                continue
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if f"OMPI_COMM_WORLD_RANK={rank}".encode() in env:
            return int(pid)
    return None


def committed_step(ckpt):
    try:
        return json.load(open(os.path.join(ckpt, "index.json")))["step"]
    except (OSError, ValueError, KeyError):
        return -1


class Bench:
    def __init__(self, hspmd, tmp):
        self.hspmd, self.tmp = hspmd, tmp
        self.data = self.path("data.bin")
        rng = random.Random(1)
        with open(self.data, "wb") as f:
            f.write(b"".join(struct.pack("<I", rng.randrange(256)) for _ in range(65536)))
        for name, obj in [("cluster.json", CLUSTER), ("strategy.json", STRATEGY), ("events.json", EVENTS)]:
            json.dump(obj, open(self.path(name), "w"))

    def path(self, name):
        return os.path.join(self.tmp, name)

    def cmd(self, name, extra=()):
        return [self.hspmd, "train", "--model", os.path.join(ROOT, "examples/models/llama-tiny-8l.json"),
                "--data", self.data, "--seq-len", "32", "--steps", str(STEPS), "--lr", "1e-3", "--quiet",
                "--threads", "1", "--strategy", self.path("strategy.json"), "--nproc", "8",
                "--cluster", self.path("cluster.json"), "--log", self.path(name + ".jsonl"),
                "--checkpoint", self.path(name + ".ckpt"), "--save-every", "1"] + list(extra)

    def run(self, name, extra=()):
        r = subprocess.run(self.cmd(name, extra), capture_output=True, text=True, timeout=600)
        if r.returncode:
            sys.exit(f"{name}: exit {r.returncode}: {r.stderr.strip()[-1000:]}")
        return records(self.path(name + ".jsonl"))

    def plain(self, k):
        recs = self.run(f"plain{k}")
        return {"step_s": statistics.median(r["step_time_s"] for r in recs if "event" not in r and r["step"] > 0)}

    def online(self, k):
        recs = self.run(f"online{k}", ["--events", self.path("events.json")])
        rec = next(r for r in recs if r.get("event") == "reconfigure")
        step = next(r for r in recs if r.get("step") == rec["step"] and "event" not in r)
        before = next(r for r in recs if r.get("step") == rec["step"] - 1 and "event" not in r)
        parts = {key: rec[key] for key in ("planning_s", "specialize_s", "switch_s")}
        return {**parts, "step_s": step["step_time_s"], "parts_s": sum(parts.values()) + step["step_time_s"],
                "wall_s": step["unix_time"] - before["unix_time"]}

    def restart(self, k):
        name = f"restart{k}"
        ckpt = self.path(name + ".ckpt")
        p = subprocess.Popen(self.cmd(name, ["--max-restarts", "1"]), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
        end = time.time() + 600
        while committed_step(ckpt) < EVENTS[0]["step"] and p.poll() is None and time.time() < end:
            time.sleep(0.005)
        pid = rank_pid(self.path("strategy.json"), EVENTS[0]["fail"][0])
        if pid is None or p.poll() is not None:
            p.kill()
            sys.exit(f"{name}: rank 3 not found running once step 4's checkpoint was committed")
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        _, err = p.communicate(timeout=600)
        if p.returncode:
            sys.exit(f"{name}: exit {p.returncode}: {err.strip()[-1000:]}")
        rec = next(r for r in records(self.path(name + ".jsonl")) if r.get("event") == "restart")
        out = {key: rec[key] for key in ("from_step", "detect_s", "recovery_s")}
        out["relaunch_s"] = out["recovery_s"] - out["detect_s"]  # the new attempt's start to its first step
        after = [r["unix_time"] for r in records(self.path(name + ".jsonl"))
                 if "event" not in r and "loss" in r and r.get("unix_time", 0) > killed_at]
        out["wall_s"] = min(after) - killed_at
        return out


def median(rows, key):
    return statistics.median(r[key] for r in rows)


def main():
    global STEPS
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", default=os.path.join(ROOT, "build/src/cli/hspmd"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", help="write every run's figures here")
    ap.add_argument("--smoke", action="store_true",
                    help=f"one run of each kind, {SMOKE_STEPS} steps (the event still before step 4): the same "
                         "runs, the kill and the restart (the CTest bench_smoke_restart_vs_online)")
    a = ap.parse_args()
    if a.smoke:
        ap.set_defaults(repeat=1)
        a = ap.parse_args()
        STEPS = SMOKE_STEPS
    with tempfile.TemporaryDirectory(prefix="hspmd_restart_bench_") as tmp:
        b = Bench(a.hspmd, tmp)
        rows = {"plain": [], "online": [], "restart": []}
        for k in range(a.repeat):
            for kind in rows:
                rows[kind].append(getattr(b, kind)(k))
                print(kind, k, json.dumps(rows[kind][-1]), flush=True)
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)
    on, re = rows["online"], rows["restart"]
    print(f"\nmedians of {a.repeat} runs, wall-clock seconds (rank 3 lost before step 4 of {STEPS})")
    print(f"undisturbed step:              {median(rows['plain'], 'step_s'):.3f}")
    print("event to the end of the next finished step, wall clock (log records' unix_time):")
    print(f"online (--events):             {median(on, 'wall_s'):.3f}  (its timers: planning "
          f"{median(on, 'planning_s'):.3f} + specialize {median(on, 'specialize_s'):.3f} + switch "
          f"{median(on, 'switch_s'):.3f} + step 4 {median(on, 'step_s'):.3f} = {median(on, 'parts_s'):.3f})")
    print(f"restart (--max-restarts 1):    {median(re, 'wall_s'):.3f}  (the launcher's recovery_s "
          f"{median(re, 'recovery_s'):.3f} = detect {median(re, 'detect_s'):.3f} + relaunch to the first step "
          f"{median(re, 'relaunch_s'):.3f}; from_step {sorted(set(r['from_step'] for r in re))})")


if __name__ == "__main__":
    main()
