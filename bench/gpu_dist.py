#!/usr/bin/env python3
"""Distributed training step on a device: the plans of bench/dist_step.py
with every rank on one GPU (`hspmd train --device cuda:0 --nproc N`: the
ranks share it through the staged MPI communicator, docs/comm.md), against
one process on the same GPU. Per plan: the median step, its ratio to one
process, the exposed gradient synchronization (`grad_sync_s`, the slowest
rank's, median over the steps) and its share of the step, and whether every
rank's Reshard and op bytes equal the predictions.

Ranks sharing one GPU time-slice it, so a plan's step measures the plan's
extra work and communication on one device, not a speed-up; the exposed
synchronization is what overlapping it would hide (docs/comm.md, "Overlap").

  python3 bench/gpu_dist.py [--hspmd build/src/cli/hspmd] [--device cuda:0] [--precision bf16]
  python3 bench/gpu_dist.py --device cpu:1 --steps 3 --seq-len 32   # the harness on the device test double

Prints a table and one `RESULT probe=gpu_dist case=<plan> ... status=PASS|FAIL`
line per plan; writes --json. Exits 77 (skipped) when --device is a GPU and
none is visible, 1 when a plan fails or its bytes differ from the prediction.
"""
import argparse
import json
import os
import random
import statistics
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from dist_step import PLANS  # noqa: E402  (the same plans as the CPU benchmark)


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    return r.returncode, r.stderr.strip()


def records(path):
    with open(path) as f:
        return [json.loads(line) for line in f if '"loss"' in line]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", default=os.path.join(ROOT, "build/src/cli/hspmd"))
    ap.add_argument("--model", default=os.path.join(HERE, "configs/reference.json"))
    ap.add_argument("--device", default="cuda:0", help="every rank's device (cpu:1: the device test double)")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--only", default="", help="comma list of plan names (default: all of dist_step.py's)")
    ap.add_argument("--json", default="", help="write the rows here")
    a = ap.parse_args()
    if a.steps < 2:
        sys.exit("--steps must be at least 2 (the first step is warm-up)")
    tmp = tempfile.mkdtemp(prefix="hspmd_gpu_dist_")
    vocab = json.load(open(a.model))["vocab_size"]
    data = os.path.join(tmp, "data.bin")
    rng = random.Random(0)
    with open(data, "wb") as f:
        f.write(b"".join(struct.pack("<I", rng.randrange(vocab)) for _ in range(200000)))
    common = [a.hspmd, "train", "--model", a.model, "--data", data, "--seq-len", str(a.seq_len), "--steps",
              str(a.steps), "--threads", "1", "--quiet", "--device", a.device, "--precision", a.precision]
    single = os.path.join(tmp, "single.jsonl")
    rc, err = run(common + ["--global-batch", "8", "--log", single])
    if rc and ("no CUDA device" in err or "no CUDA backend" in err):
        print(f"SKIP gpu_dist: {err}")
        return 77
    if rc:
        print(f"RESULT probe=gpu_dist case=single error=\"{err[-200:]}\" status=FAIL")
        return 1
    base = statistics.median(r["step_time_s"] for r in records(single)[1:])  # the first step warms up
    print(f"device {a.device}, {a.precision}, seq {a.seq_len}, {a.steps} steps (medians of steps 1..)")
    print(f"{'plan':24s} {'ranks':>5s} {'median step':>12s} {'vs 1 process':>13s} {'exposed sync':>13s} "
          f"{'share':>6s}  bytes")
    print(f"{'single process':24s} {1:5d} {base:11.4f}s {1.0:12.2f}x")
    rows, failed = [], 0
    names = [n for n in a.only.split(",") if n] or list(PLANS)
    for name in names:
        world, strategy = PLANS[name]
        spath, log = os.path.join(tmp, "plan.json"), os.path.join(tmp, "dist.jsonl")
        json.dump(strategy, open(spath, "w"))
        rc, err = run(common + ["--strategy", spath, "--nproc", str(world), "--log", log])
        case = name.replace(" ", "_").replace("/", "-").replace("=", "")
        if rc:
            print(f"RESULT probe=gpu_dist case={case} error=\"{err[-200:]}\" status=FAIL")
            failed += 1
            continue
        recs = records(log)
        step = statistics.median(r["step_time_s"] for r in recs[1:])
        sync = statistics.median(max(r["grad_sync_s"]) for r in recs[1:])
        same = all(r["reshard_bytes_sent"] == r["predicted_reshard_bytes"] and
                   r["op_bytes_sent"] == r["predicted_op_bytes"] for r in recs)
        failed += 0 if same else 1
        print(f"{name:24s} {world:5d} {step:11.4f}s {base / step:12.2f}x {sync:12.4f}s {sync / step:6.1%}  "
              f"{'= predicted' if same else 'MISMATCH'}")
        print(f"RESULT probe=gpu_dist case={case} ranks={world} median_ms={step * 1e3:.2f} "
              f"sync_ms={sync * 1e3:.2f} vs_single={base / step:.3f} status={'PASS' if same else 'FAIL'}")
        rows.append({"plan": name, "ranks": world, "median_step_s": step, "single_step_s": base,
                     "exposed_grad_sync_s": sync, "bytes_equal_predicted": same})
    if a.json:
        json.dump({"device": a.device, "precision": a.precision, "seq_len": a.seq_len, "rows": rows},
                  open(a.json, "w"), indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
