#!/usr/bin/env python3
"""Distributed training-step benchmark: `hspmd train --strategy --nproc N`
against the single-process step, on the reference config, plus the bytes each
rank sent per step next to the resolver's prediction.

Every rank runs one thread. This VM has 2 cores, so plans with more than 2
ranks are oversubscribed: their wall-clock step times measure contention on
this machine, not the plan (the emulated cluster of a later issue measures
plans independently of the core count). The byte columns do not depend on it.

usage: bench/dist_step.py [--hspmd build/src/cli/hspmd] [--steps 6] [--seq-len 256] [--only NAME,...] [--smoke]
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


def pipeline(mbs, micro, stages):
    return {"micro_batch_size": mbs, "micro_batches": micro,
            "stages": [{"ranks": r, "layers": l} for r, l in stages]}


# Global batch 8 everywhere, as the single-process step.
PLANS = {
    "DP=2": (2, {"pipelines": [pipeline(2, 2, [([0], [0, 3])]), pipeline(2, 2, [([1], [0, 3])])]}),
    "TP=2": (2, {"pipelines": [pipeline(2, 4, [([0, 1], [0, 3])])]}),
    # Context parallelism: ring attention over the two ranks (zigzag halves).
    "CP=2": (2, {"pipelines": [{"micro_batch_size": 2, "micro_batches": 4,
                                "stages": [{"ranks": [0, 1], "layers": [0, 3], "cp": 2}]}]}),
    "7 ranks TP 4/2/1": (7, {"pipelines": [pipeline(2, 2, [([0, 1, 2, 3], [0, 3])]),
                                           pipeline(1, 2, [([4, 5], [0, 3])]),
                                           pipeline(2, 1, [([6], [0, 3])])]}),
    "7 ranks TP 4/2/1 ZeRO": (7, {"zero": True, "pipelines": [
        pipeline(2, 2, [([0, 1, 2, 3], [0, 3])]), pipeline(1, 2, [([4, 5], [0, 3])]),
        pipeline(2, 1, [([6], [0, 3])])]}),
}


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stderr}")


def records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", default=os.path.join(ROOT, "build/src/cli/hspmd"))
    ap.add_argument("--model", default=os.path.join(HERE, "configs/reference.json"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--only", default="", help="comma list of plan names (default: all)")
    ap.add_argument("--smoke", action="store_true",
                    help="sequence 32, 2 steps, every plan: the same runs, and exit 1 when a rank's bytes differ "
                         "from the prediction (the CTest bench_smoke_dist_step)")
    args = ap.parse_args()
    if args.smoke:
        ap.set_defaults(seq_len=32, steps=2)
        args = ap.parse_args()
    if args.steps < 2:
        sys.exit("--steps must be at least 2 (the first step is left out)")
    tmp = tempfile.mkdtemp(prefix="hspmd_bench_")
    vocab = json.load(open(args.model))["vocab_size"]
    data = os.path.join(tmp, "data.bin")
    rng = random.Random(0)
    with open(data, "wb") as f:
        f.write(b"".join(struct.pack("<I", rng.randrange(vocab)) for _ in range(200000)))
    common = [args.hspmd, "train", "--model", args.model, "--data", data, "--seq-len",
              str(args.seq_len), "--steps", str(args.steps), "--threads", "1", "--quiet"]
    single = os.path.join(tmp, "single.jsonl")
    run(common + ["--global-batch", "8", "--log", single])
    # The first step warms caches and allocators: medians of the others.
    base = statistics.median(r["step_time_s"] for r in records(single)[1:])
    print(f"{'plan':24s} {'ranks':>5s} {'median step':>12s} {'vs 1 process':>13s}  MiB sent per rank "
          f"inside Reshards / the resolver's prediction [+ inside ops / the ops' prediction]")
    print(f"{'single process':24s} {1:5d} {base:11.3f}s {1.0:12.2f}x")
    mismatched = []
    names = [n for n in args.only.split(",") if n] or list(PLANS)
    for name in names:
        world, strategy = PLANS[name]
        spath = os.path.join(tmp, "plan.json")
        json.dump(strategy, open(spath, "w"))
        log = os.path.join(tmp, "dist.jsonl")
        run(common + ["--strategy", spath, "--nproc", str(world), "--log", log])
        recs = records(log)
        step = statistics.median(r["step_time_s"] for r in recs[1:])
        last = recs[-1]
        same = all(r["reshard_bytes_sent"] == r["predicted_reshard_bytes"] and
                   r["op_bytes_sent"] == r["predicted_op_bytes"] for r in recs)
        per_rank = ", ".join(f"{m / 2**20:.2f}/{p / 2**20:.2f}" + (f" + {om / 2**20:.2f}/{op / 2**20:.2f}" if om else "")
                             for m, p, om, op in zip(last["reshard_bytes_sent"], last["predicted_reshard_bytes"],
                                                     last["op_bytes_sent"], last["predicted_op_bytes"]))
        print(f"{name:24s} {world:5d} {step:11.3f}s {base / step:12.2f}x  [{per_rank}] MiB "
              f"{'(all steps equal)' if same else '(MISMATCH)'}")
        if not same:
            mismatched.append(name)
    if mismatched and args.smoke:
        sys.exit(f"bytes differ from the prediction: {', '.join(mismatched)}")


if __name__ == "__main__":
    main()
