#!/usr/bin/env python3
"""Load balance of context parallelism: one stage of cp ranks (ring attention
with zigzag halves, docs/attention.md) on the reference config with 2
layers and long sequences, under the emulated clock (uniform cluster), so
each rank's virtual compute is its own CPU time whatever the core count.
Prints each rank's median virtual compute per step and the spread
(max / min - 1); causal attention over contiguous chunks would give the
last rank about 2 x cp - 1 times the first one's attention work.

usage: bench/cp_balance.py [--hspmd build/src/cli/hspmd] [--seq-len 2048] [--steps 3] [--smoke]
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", default=os.path.join(ROOT, "build/src/cli/hspmd"))
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true",
                    help="sequence 64, 2 steps: the same runs (cp 2 and 4), checked to give figures (the CTest "
                         "bench_smoke_cp_balance)")
    args = ap.parse_args()
    if args.smoke:
        ap.set_defaults(seq_len=64, steps=2)
        args = ap.parse_args()
    if args.steps < 2:
        sys.exit("--steps must be at least 2 (the first step is left out)")
    tmp = tempfile.mkdtemp(prefix="hspmd_cp_")
    cfg = json.load(open(os.path.join(HERE, "configs/reference.json")))
    cfg["num_hidden_layers"] = 2
    cfg["max_position_embeddings"] = max(cfg["max_position_embeddings"], args.seq_len)
    model = os.path.join(tmp, "model.json")
    json.dump(cfg, open(model, "w"))
    data = os.path.join(tmp, "data.bin")
    rng = random.Random(0)
    with open(data, "wb") as f:
        f.write(b"".join(struct.pack("<I", rng.randrange(cfg["vocab_size"]))
                         for _ in range(8 * args.seq_len + 1)))
    print(f"EMULATED virtual compute per rank and step (median of steps 2-{args.steps}), "
          f"reference model with 2 layers, sequence {args.seq_len}")
    for cp in (2, 4):
        strategy = {"pipelines": [{"micro_batch_size": 1, "micro_batches": 2, "stages": [
            {"ranks": list(range(cp)), "layers": [0, 1], "cp": cp}]}]}
        spath, log = os.path.join(tmp, "cp.json"), os.path.join(tmp, "cp.jsonl")
        json.dump(strategy, open(spath, "w"))
        trace = os.path.join(tmp, "trace.json")  # --trace turns the clock on (uniform cluster)
        r = subprocess.run([args.hspmd, "train", "--model", model, "--data", data, "--seq-len",
                            str(args.seq_len), "--steps", str(args.steps), "--threads", "1", "--quiet",
                            "--strategy", spath, "--nproc", str(cp), "--log", log, "--trace", trace],
                           capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"cp={cp}: {r.stderr}")
        recs = [json.loads(line) for line in open(log)][1:]
        compute = [statistics.median(x["emulated_compute_s"][k] for x in recs) for k in range(cp)]
        print(f"cp={cp}: {[round(c, 3) for c in compute]} s, spread {max(compute) / min(compute) - 1:.1%}")


if __name__ == "__main__":
    main()
