#!/usr/bin/env python3
"""Symmetric against asymmetric strategies on an EMULATED heterogeneous
cluster: two nodes of 4 ranks, the second at slowdown 3 (docs/execution.md),
the reference model scaled to 8 layers, sequence 256, global batch 8.

Prints each strategy's median emulated step time (virtual clocks: CPU time x
slowdown, communication over the cluster's links), its ratio to the best
symmetric one, and each rank's virtual compute per step. All figures are of
the emulated cluster, not of this machine.

Also the peak tensor memory of the busiest rank (and the largest per-rank
peak of activations above the parameters and optimizer states), and with --repeat N the
largest change of any rank's virtual compute between N runs of the same
strategy (the emulation's stability).

usage: bench/emulated_step.py [--hspmd build/src/cli/hspmd] [--steps 4] [--trace-dir DIR]
                              [--repeat N] [--only NAME,...] [--seq-len 256] [--smoke]
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

CLUSTER = {"catalog": {"gpu": {"tflops": 100, "memory_gib": 80, "intra_node_gbps": 100,
                               "inter_node_gbps": 25}},
           "nodes": [{"type": "gpu", "ranks": [0, 3]},
                     {"type": "gpu", "ranks": [4, 7], "slowdown": 3.0}]}


def pipeline(mbs, micro, stages, recompute=False):
    return {"micro_batch_size": mbs, "micro_batches": micro,
            "stages": [{"ranks": r, "layers": l, **({"recompute": True} if recompute else {})}
                       for r, l in stages]}


# Symmetric: what Megatron would run (equal pipelines, equal stages).
# Asymmetric: the fast node's pipeline takes 3x the micro-batches (its
# ranks are 3x faster), so both pipelines finish together.
STRATEGIES = {
    "symmetric DP2 x PP2 x TP2": {"pipelines": [
        pipeline(1, 4, [([0, 1], [0, 3]), ([2, 3], [4, 7])]),
        pipeline(1, 4, [([4, 5], [0, 3]), ([6, 7], [4, 7])])]},
    "symmetric DP2 x TP4": {"pipelines": [
        pipeline(1, 4, [([0, 1, 2, 3], [0, 7])]),
        pipeline(1, 4, [([4, 5, 6, 7], [0, 7])])]},
    "asymmetric TP4 pipelines 6:2": {"pipelines": [
        pipeline(1, 6, [([0, 1, 2, 3], [0, 7])]),
        pipeline(1, 2, [([4, 5, 6, 7], [0, 7])])]},
    "asymmetric PP2 x TP2 6:2": {"pipelines": [
        pipeline(1, 6, [([0, 1], [0, 3]), ([2, 3], [4, 7])]),
        pipeline(1, 2, [([4, 5], [0, 3]), ([6, 7], [4, 7])])]},
    # The same with activation recomputation on every stage: less activation
    # memory on the first stages (1F1B keeps two micro-batches alive there),
    # one more forward per micro-batch.
    "asymmetric PP2 x TP2 6:2 recompute": {"pipelines": [
        pipeline(1, 6, [([0, 1], [0, 3]), ([2, 3], [4, 7])], recompute=True),
        pipeline(1, 2, [([4, 5], [0, 3]), ([6, 7], [4, 7])], recompute=True)]},
}

SMOKE_ONLY = ["symmetric DP2 x TP4", "asymmetric PP2 x TP2 6:2 recompute"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", default=os.path.join(ROOT, "build/src/cli/hspmd"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--trace-dir", default="")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--only", default="", help="comma-separated strategy names")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--smoke", action="store_true",
                    help="sequence 32, 2 steps, one symmetric and the recomputing asymmetric strategy: the same "
                         "runs, checked to give figures (the CTest bench_smoke_emulated_step)")
    args = ap.parse_args()
    if args.smoke:
        ap.set_defaults(seq_len=32, steps=2, only=",".join(SMOKE_ONLY))
        args = ap.parse_args()
    if args.steps < 2:
        sys.exit("--steps must be at least 2 (the first step is left out)")
    tmp = tempfile.mkdtemp(prefix="hspmd_emulated_")
    cfg = json.load(open(os.path.join(HERE, "configs/reference.json")))
    cfg["num_hidden_layers"] = 8
    model = os.path.join(tmp, "model.json")
    json.dump(cfg, open(model, "w"))
    cluster = os.path.join(tmp, "cluster.json")
    json.dump(CLUSTER, open(cluster, "w"))
    data = os.path.join(tmp, "data.bin")
    rng = random.Random(0)
    with open(data, "wb") as f:
        f.write(b"".join(struct.pack("<I", rng.randrange(cfg["vocab_size"])) for _ in range(100000)))
    results, runs = {}, {}
    names = args.only.split(",") if args.only else list(STRATEGIES)
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        sys.exit(f"unknown strategies {unknown}; known: {list(STRATEGIES)}")
    for name in [n for _ in range(args.repeat) for n in names]:
        strategy = STRATEGIES[name]
        spath = os.path.join(tmp, "strategy.json")
        json.dump(strategy, open(spath, "w"))
        log = os.path.join(tmp, "log.jsonl")
        cmd = [args.hspmd, "train", "--model", model, "--data", data, "--seq-len", str(args.seq_len),
               "--steps", str(args.steps), "--threads", "1", "--quiet", "--strategy", spath,
               "--nproc", "8", "--cluster", cluster, "--log", log]
        if args.trace_dir:
            cmd += ["--trace", os.path.join(args.trace_dir, name.replace(" ", "_") + ".json")]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"{name}: {r.stderr}")
        recs = [json.loads(line) for line in open(log)][1:]  # step 0 warms up
        results[name] = (statistics.median(x["emulated_step_time_s"] for x in recs),
                         [statistics.median(x["emulated_compute_s"][k] for x in recs) for k in range(8)],
                         max(statistics.median(x["peak_memory_bytes"][k] for x in recs)
                             for k in range(8)) / 2**20,
                         max(statistics.median(x["peak_activation_bytes"][k] for x in recs)
                             for k in range(8)) / 2**20)
        runs.setdefault(name, []).append(results[name][1])
    sym = [t for n, (t, _, _, _) in results.items() if n.startswith("symmetric")]
    best_sym = min(sym) if sym else float("nan")
    slowdown = [1.0] * 4 + [3.0] * 4
    print("EMULATED cluster: ranks 0-3 slowdown 1, ranks 4-7 slowdown 3; reference model, 8 layers")
    for name, (t, compute, peak, act) in results.items():
        # Ideal: the strategy's work (compute at slowdown 1) over the total speed.
        work = sum(c / k for c, k in zip(compute, slowdown))
        ideal = work / sum(1 / k for k in slowdown)
        print(f"{name:36s} emulated step {t:.3f}s  vs best symmetric {best_sym / t:.2f}x  "
              f"ideal {ideal:.3f}s ({ideal / t:.0%} of it)  peak {peak:.1f} MiB (activations {act:.1f})  "
              f"compute per rank {[round(c, 3) for c in compute]}")
    if args.repeat > 1:
        for name, rs in runs.items():
            spread = max((max(r[k] for r in rs) - min(r[k] for r in rs)) / min(r[k] for r in rs)
                         for k in range(8))
            print(f"{name:36s} virtual compute over {len(rs)} runs: largest per-rank change "
                  f"{spread:.1%}")


if __name__ == "__main__":
    main()
