#!/usr/bin/env python3
"""Plan switching on an EMULATED two-node cluster (docs/switching.md): the
8-layer tiny model trains under a heterogeneous plan (examples/strategies/
tiny_hetero_8.json: TP2 x PP2 beside TP1 x PP3, rank 7 idle), switches at
step 1 to a symmetric ZeRO plan (two TP2 x PP2 pipelines on all 8 ranks) and
at step 2 back. For each switch algorithm (naive, per-tensor, fused) it
prints, per switch, the median over --repeat runs of:

  emulated_s   the emulated cluster's switch time (virtual clocks: packing
               as compute, transfers over the cluster's links, rounds synced)
  wall_s       this machine's wall time of the transfer (8 ranks on its cores)
  MB moved     bytes sent by all ranks (measured = predicted is checked)
  extra/bound  the largest per-rank peak of memory above max(old, new state)
               during the switch, against the switch plan's stated bound

and the ratio of each algorithm's emulated time to fused, and the switch
plan's own prediction (`hspmd plan switch`, links only) beside it.

usage: bench/switch_bench.py [--hspmd build/src/cli/hspmd] [--repeat 3] [--bucket-mb 0] [--smoke]
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

# Links scaled down 100x from 100/25 GB/s: the tiny model's state is a few MB
# where the paper's is tens of GB, so at real bandwidths packing (CPU time)
# would hide the transfers that the algorithms differ in.
CLUSTER = {"catalog": {"gpu": {"tflops": 100, "memory_gib": 80, "intra_node_gbps": 1,
                               "inter_node_gbps": 0.25}},
           "nodes": [{"type": "gpu", "ranks": [0, 3]}, {"type": "gpu", "ranks": [4, 7]}]}
SYMMETRIC = {"schedule": "1f1b", "zero": True, "pipelines": [
    {"micro_batch_size": 1, "micro_batches": 3, "stages": [{"ranks": [0, 1], "layers": [0, 3]},
                                                          {"ranks": [4, 5], "layers": [4, 7]}]},
    {"micro_batch_size": 1, "micro_batches": 3, "stages": [{"ranks": [2, 3], "layers": [0, 3]},
                                                          {"ranks": [6, 7], "layers": [4, 7]}]}]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", default=os.path.join(ROOT, "build/src/cli/hspmd"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=0)
    ap.add_argument("--smoke", action="store_true",
                    help="one run per algorithm: the same runs and checks (bytes = predicted) (the CTest "
                         "bench_smoke_switch_bench)")
    args = ap.parse_args()
    if args.smoke:
        ap.set_defaults(repeat=1)
        args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="hspmd_switch_bench_")
    data = os.path.join(tmp, "data.bin")
    rng = random.Random(1)
    with open(data, "wb") as f:
        f.write(b"".join(struct.pack("<I", rng.randrange(256)) for _ in range(65536)))
    cluster, sym = os.path.join(tmp, "cluster.json"), os.path.join(tmp, "sym.json")
    json.dump(CLUSTER, open(cluster, "w"))
    json.dump(SYMMETRIC, open(sym, "w"))
    hetero = os.path.join(ROOT, "examples/strategies/tiny_hetero_8.json")
    predicted = {}
    for k, (a, b) in enumerate([(hetero, sym), (sym, hetero)]):
        r = subprocess.run([args.hspmd, "plan", "switch", "--model",
                            os.path.join(ROOT, "examples/models/llama-tiny-8l.json"), "--from", a, "--to", b,
                            "--world", "8", "--cluster", cluster, "--seq-len", "64", "--algorithm", "all",
                            "--bucket-mb", str(args.bucket_mb), "--json"], capture_output=True, text=True)
        if r.returncode:
            sys.exit("plan switch: " + r.stderr.strip())
        j = json.loads(r.stdout)
        predicted[k] = {name: alg["predicted_s"] for name, alg in j["algorithms"].items()}
        predicted[k]["lower_bound"] = j["lower_bound_s"]
    results = {}
    for algorithm in ["naive", "per-tensor", "fused"]:
        runs = []
        for _ in range(args.repeat):
            log = os.path.join(tmp, f"{algorithm}.jsonl")
            cmd = [args.hspmd, "train", "--model", os.path.join(ROOT, "examples/models/llama-tiny-8l.json"),
                   "--data", data, "--seq-len", "64", "--steps", "3", "--threads", "1", "--quiet",
                   "--strategy", hetero, "--switch", f"1:{sym}", "--switch", f"2:{hetero}",
                   "--switch-algorithm", algorithm, "--switch-bucket-mb", str(args.bucket_mb),
                   "--cluster", cluster, "--nproc", "8", "--log", log]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                sys.exit(f"{algorithm}: {r.stderr.strip()[-500:]}")
            runs.append([json.loads(l) for l in open(log) if '"event"' in l])
        results[algorithm] = runs
    print(f"{'algorithm':11s} {'switch':14s} {'emulated_s':>11s} {'wall_s':>8s} {'MB moved':>9s} "
          f"{'rounds':>6s} {'extra/bound MB':>15s} {'vs fused':>8s} {'predicted_s':>11s}")
    for k, label in enumerate(["hetero -> sym", "sym -> hetero"]):
        fused = statistics.median(run[k]["emulated_switch_s"] for run in results["fused"])
        for algorithm, runs in results.items():
            recs = [run[k] for run in runs]
            if not all(r["bytes_sent"] == r["predicted_bytes"] for r in recs):
                sys.exit(f"{algorithm}, {label}: bytes sent differ from the prediction")
            emu = statistics.median(r["emulated_switch_s"] for r in recs)
            wall = statistics.median(r["switch_s"] for r in recs)
            moved = sum(recs[0]["bytes_sent"]) / 1e6
            extra = max(max(r["peak_extra_bytes"]) for r in recs) / 1e6
            bound = max(recs[0]["extra_bytes_bound"]) / 1e6
            print(f"{algorithm:11s} {label:14s} {emu:11.6f} {wall:8.4f} {moved:9.2f} {recs[0]['rounds']:6d} "
                  f"{extra:7.2f}/{bound:<7.2f} {emu / fused:8.2f} {predicted[k][algorithm]:11.6f}")
        print(f"{'lower bound':11s} {label:14s} {'':11s} {'':8s} {'':9s} {'':6s} {'':15s} {'':8s} "
              f"{predicted[k]['lower_bound']:11.6f}")


if __name__ == "__main__":
    main()
