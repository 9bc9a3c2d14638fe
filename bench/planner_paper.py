#!/usr/bin/env python3
"""The planner at the paper's scale (docs/planner.md, docs/benchmarks.md).

For the six heterogeneous cases of the paper's appendix (32B and 70B on 16
H800 + 16/24/32 H20, global batch 64, sequence 4096, ZeRO-1) it runs `hspmd
plan search` and prints its search time and predicted step time beside the
predicted step time, under the same cost model (`hspmd plan cost`, roofline
devices), of the paper's own strategy (examples/strategies/hetero_*.json)
and of Megatron's symmetric strategy from the paper's table of baselines
(DPxTPxPP, bs, ranks in order, layers split evenly, ZeRO-1).

Then the re-plans of the elastic traces: C1 -> C2 (32 H20, rank 31 lost),
C4 -> C5 (16 H800 + 32 H20, ranks 40-47 lost), C5 -> C6 (rank 15 lost),
C6 -> C7 (ranks 8-15 lost), each `plan search --from <previous> --unavailable
...`, with its time.

usage: bench/planner_paper.py [--hspmd build/src/cli/hspmd] [--repeat 3] [--smoke]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
EX = os.path.join(ROOT, "examples")

# (model, H20 count, Megatron's (dp, tp, pp, bs)) from the paper's table of
# baseline strategies on the heterogeneous clusters.
CASES = [("32b", 16, (2, 4, 4, 2)), ("32b", 24, (2, 4, 5, 2)), ("32b", 32, (4, 4, 3, 2)),
         ("70b", 16, (1, 8, 4, 1)), ("70b", 24, (1, 8, 5, 1)), ("70b", 32, (1, 8, 6, 1))]
LAYERS = {"32b": 60, "70b": 80}
# (trace step, cluster, previous strategy, lost ranks, the paper's next strategy)
REPLANS = [("C1 -> C2", "32h20.json", "elastic_c1_32h20.json", "31", "elastic_c2_31h20.json"),
           ("C4 -> C5", "16h800_32h20.json", "elastic_c4_16h800_32h20.json", "40-47", "elastic_c5_16h800_24h20.json"),
           ("C5 -> C6", "16h800_24h20.json", "elastic_c5_16h800_24h20.json", "15", "elastic_c6_15h800_24h20.json"),
           ("C6 -> C7", "16h800_24h20.json", "elastic_c6_15h800_24h20.json", "8-15", "elastic_c7_8h800_24h20.json")]


def megatron(dp, tp, pp, bs, layers, batch=64):
    per = [layers // pp + (1 if k < layers % pp else 0) for k in range(pp)]
    pipes, r = [], 0
    for _ in range(dp):
        stages, first = [], 0
        for k in range(pp):
            stages.append({"ranks": list(range(r, r + tp)), "layers": [first, first + per[k] - 1]})
            r += tp
            first += per[k]
        pipes.append({"micro_batch_size": bs, "micro_batches": batch // (dp * bs), "stages": stages})
    return {"schedule": "1f1b", "zero": True, "pipelines": pipes}


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{p.stderr[-2000:]}")
    return json.loads(p.stdout)


def cost(hspmd, model, cluster, strategy):
    return run([hspmd, "plan", "cost", "--model", model, "--cluster", cluster, "--strategy", strategy,
                "--seq-len", "4096", "--json"])["predicted_step_s"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", default=os.path.join(ROOT, "build/src/cli/hspmd"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--smoke", action="store_true",
                    help="one run of the first case and the first re-plan: the same calls (the CTest "
                         "bench_smoke_planner_paper)")
    args = ap.parse_args()
    if args.smoke:
        ap.set_defaults(repeat=1)
        args = ap.parse_args()
    cases, replans = (CASES[:1], REPLANS[:1]) if args.smoke else (CASES, REPLANS)
    tmp = tempfile.mkdtemp(prefix="hspmd_planner_paper_")
    print(f"{'case':22s} {'search_s':>9s} {'searched':>10s} {'paper':>10s} {'megatron':>10s} "
          f"{'paper/searched':>15s} {'megatron/searched':>18s}")
    for name, h20, (dp, tp, pp, bs) in cases:
        model = os.path.join(EX, "models", f"llama-{name}.json")
        cluster = os.path.join(EX, "clusters", f"16h800_{h20}h20.json")
        out = os.path.join(tmp, f"{name}_{h20}.json")
        times, res = [], None
        for _ in range(args.repeat):
            res = run([args.hspmd, "plan", "search", "--model", model, "--cluster", cluster, "--global-batch", "64",
                       "--seq-len", "4096", "--zero", "-o", out, "--json"])
            times.append(res["search_s"])
        paper = cost(args.hspmd, model, cluster, os.path.join(EX, "strategies", f"hetero_{name}_16h800_{h20}h20.json"))
        meg_path = os.path.join(tmp, f"megatron_{name}_{h20}.json")
        json.dump(megatron(dp, tp, pp, bs, LAYERS[name]), open(meg_path, "w"))
        meg = cost(args.hspmd, model, cluster, meg_path)
        found = res["predicted_step_s"]
        print(f"{name.upper()} 16 H800 + {h20} H20   {statistics.median(times):9.3f} {found:10.3f} {paper:10.3f} "
              f"{meg:10.3f} {paper / found:15.3f} {meg / found:18.3f}", flush=True)
        print("    searched: " + " / ".join(
            f"{p['micro_batches']}x bs{p['micro_batch_size']}: " + " ".join(
                f"R{s['ranks'][0]}-{s['ranks'][-1]} L{s['layers'][0]}-{s['layers'][1]}" + (" rc" if s.get("recompute") else "")
                for s in p["stages"]) for p in res["strategy"]["pipelines"]))
    print(f"\n{'re-plan':10s} {'search_s':>9s} {'replanned':>10s} {'paper':>10s} {'paper/replanned':>16s}")
    for name, cluster, prev, lost, nxt in replans:
        model = os.path.join(EX, "models", "llama-32b.json")
        times, res = [], None
        for _ in range(args.repeat):
            res = run([args.hspmd, "plan", "search", "--model", model, "--cluster", os.path.join(EX, "clusters", cluster),
                       "--global-batch", "64", "--seq-len", "4096", "--from", os.path.join(EX, "strategies", prev),
                       "--unavailable", lost, "--json"])
            times.append(res["search_s"])
        paper = cost(args.hspmd, model, os.path.join(EX, "clusters", cluster), os.path.join(EX, "strategies", nxt))
        print(f"{name:10s} {statistics.median(times):9.3f} {res['predicted_step_s']:10.3f} {paper:10.3f} "
              f"{paper / res['predicted_step_s']:16.3f}", flush=True)


if __name__ == "__main__":
    main()
