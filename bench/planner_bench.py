#!/usr/bin/env python3
"""The planner's cost model against the EMULATED cluster (docs/planner.md).

Profiles examples/models/llama-tiny-8l.json on this machine (`hspmd
profile`, one kernel thread), then for each of a set of strategies on an
8-rank cluster of three device speeds (slowdown 1, 1.5 and 2.5; links scaled
down so that transfers matter at this model size):

  predicted_s   `hspmd plan cost` (profile x slowdown, alpha-beta links,
                simulated schedule)
  emulated_s    `hspmd train --cluster ... --threads 1 --clock cpu`: the
                median over steps 1 .. steps-1 of emulated_step_time_s
  error         predicted / emulated - 1

and the median and largest |error|. With --search it also runs `hspmd plan
search` on the same cluster for each --search-batch, trains the strategy it returns and
the best hand-written one of the table, and prints both emulated step times.

usage: bench/planner_bench.py [--hspmd build/src/cli/hspmd] [--steps 4]
           [--profile P.json] [--only NAME,...] [--search] [--search-batch 8,30]
           [--json out.json] [--smoke]
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
MODEL = os.path.join(ROOT, "examples/models/llama-tiny-8l.json")
SEQ = 64

CLUSTER = {"catalog": {"cpu": {"tflops": 1, "memory_gib": 1, "intra_node_gbps": 2, "inter_node_gbps": 0.5}},
           "nodes": [{"type": "cpu", "ranks": [0, 3]},
                     {"type": "cpu", "ranks": [4, 5], "slowdown": 1.5},
                     {"type": "cpu", "ranks": [6, 7], "slowdown": 2.5}]}


def st(ranks, first, last, **kw):
    d = {"ranks": ranks, "layers": [first, last]}
    d.update(kw)
    return d


def pipe(mb, stages, bs=1):
    return {"micro_batch_size": bs, "micro_batches": mb, "stages": stages}


def strategies():
    S = {}
    S["dp8"] = {"pipelines": [pipe(1, [st([r], 0, 7)]) for r in range(8)]}
    S["dp8_uneven_batch"] = {"pipelines": [pipe(2 if r < 4 else 1, [st([r], 0, 7)]) for r in range(8)]}
    S["tp2_dp4"] = {"pipelines": [pipe(2, [st([2 * i, 2 * i + 1], 0, 7)]) for i in range(4)]}
    S["tp4_and_tp2"] = {"pipelines": [pipe(4, [st([0, 1, 2, 3], 0, 7)]), pipe(2, [st([4, 5], 0, 3), st([6, 7], 4, 7)])]}
    S["pp4_dp2"] = {"pipelines": [pipe(4, [st([0], 0, 1), st([1], 2, 3), st([4], 4, 5), st([6], 6, 7)]),
                                  pipe(4, [st([2], 0, 1), st([3], 2, 3), st([5], 4, 5), st([7], 6, 7)])]}
    S["pp4_gpipe"] = dict(S["pp4_dp2"], schedule="gpipe")
    S["pp_uneven_layers"] = {"pipelines": [pipe(4, [st([6], 0, 1), st([4], 2, 4), st([0], 5, 7)]),
                                           pipe(4, [st([7], 0, 1), st([5], 2, 4), st([1], 5, 7)]),
                                           pipe(2, [st([2, 3], 0, 7)])]}
    S["pp_recompute"] = {"pipelines": [pipe(4, [st([0, 1], 0, 3, recompute=True), st([4, 5], 4, 7, recompute=True)]),
                                       pipe(4, [st([2, 3], 0, 3, recompute=True), st([6, 7], 4, 7, recompute=True)])]}
    S["tiny_hetero_8"] = json.load(open(os.path.join(ROOT, "examples/strategies/tiny_hetero_8.json")))
    S["tiny_zero_8"] = json.load(open(os.path.join(ROOT, "examples/strategies/tiny_zero_8.json")))
    S["tiny_cp_8"] = json.load(open(os.path.join(ROOT, "examples/strategies/tiny_cp_8.json")))
    S["zero_tp2_pp2"] = {"zero": True, "pipelines": [pipe(3, [st([0, 1], 0, 4), st([4, 5], 5, 7)]),
                                                     pipe(3, [st([2, 3], 0, 4), st([6, 7], 5, 7)])]}
    S["cp2_dp"] = {"pipelines": [pipe(2, [st([0, 1], 0, 7, cp=2)]), pipe(2, [st([2, 3], 0, 7, cp=2)]),
                                 pipe(1, [st([4, 5], 0, 7, cp=2)]), pipe(1, [st([6, 7], 0, 7, cp=2)])]}
    S["bs2_hetero"] = {"pipelines": [pipe(2, [st([0, 1], 0, 7)], bs=2), pipe(1, [st([2, 3], 0, 7)], bs=2),
                                     pipe(2, [st([4], 0, 3), st([6], 4, 7)], bs=1),
                                     pipe(2, [st([5], 0, 3), st([7], 4, 7)], bs=1)]}
    # Proportional data parallelism: one rank per replica, the work by speed
    # (ranks 0-3 at 1, 4-5 at 1.5, 6-7 at 2.5: 5 : 3 : 2), as micro-batch
    # sizes or as micro-batch counts; and TP 2 on the fast node beside
    # speed-weighted single ranks.
    S["dp8_proportional_bs"] = {"pipelines": [pipe(1, [st([r], 0, 7)], bs=5 if r < 4 else 3 if r < 6 else 2)
                                              for r in range(8)]}
    S["dp8_proportional_mb"] = {"pipelines": [pipe(5 if r < 4 else 3 if r < 6 else 2, [st([r], 0, 7)])
                                              for r in range(8)]}
    S["tp2_fast_dp_slow"] = {"pipelines": [pipe(5, [st([0, 1], 0, 7)], bs=2), pipe(5, [st([2, 3], 0, 7)], bs=2)] +
                                          [pipe(3 if r < 6 else 2, [st([r], 0, 7)]) for r in range(4, 8)]}
    for s in S.values():
        s.setdefault("schedule", "1f1b")
        s.setdefault("zero", False)
        s.pop("description", None)
    return S


def run(cmd, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if p.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{p.stderr[-2000:]}")
    return p.stdout


def emulate(hspmd, tmp, name, strategy_path, data, cluster, steps):
    log = os.path.join(tmp, name + ".jsonl")
    world = 8
    s = json.load(open(strategy_path))
    batch = sum(p["micro_batch_size"] * p["micro_batches"] for p in s["pipelines"])
    run([hspmd, "train", "--model", MODEL, "--data", data, "--seq-len", str(SEQ), "--global-batch", str(batch),
         "--steps", str(steps), "--strategy", strategy_path, "--cluster", cluster, "--nproc", str(world),
         "--threads", "1", "--quiet", "--log", log])
    rows = [json.loads(l) for l in open(log)]
    return statistics.median(r["emulated_step_time_s"] for r in rows[1:])


def predict(hspmd, strategy_path, cluster, profile):
    out = run([hspmd, "plan", "cost", "--model", MODEL, "--cluster", cluster, "--strategy", strategy_path,
               "--seq-len", str(SEQ), "--profile", profile, "--json"])
    return json.loads(out)["predicted_step_s"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", default=os.path.join(ROOT, "build/src/cli/hspmd"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--profile", default="")
    ap.add_argument("--only", default="")
    ap.add_argument("--search", action="store_true")
    ap.add_argument("--search-batch", default="8,30", help="global batches to search (comma-separated)")
    ap.add_argument("--json", default="")
    ap.add_argument("--smoke", action="store_true",
                    help="a one-repetition profile of tp 1 and 2 (cp 1, s 32 and 64), 2 steps of dp8 and tp2_dp4, "
                         "the search at batch 8 (tp 1 and 2) and its run: the same calls (the CTest "
                         "bench_smoke_planner_bench)")
    args = ap.parse_args()
    if args.smoke:
        ap.set_defaults(steps=2, only="dp8,tp2_dp4", search=True, search_batch="8")
        args = ap.parse_args()
    if args.steps < 2:
        sys.exit("--steps must be at least 2 (the first step is left out)")
    unknown = [n for n in args.only.split(",") if n and n not in strategies()]
    if unknown:
        sys.exit(f"unknown strategies {unknown}; known: {list(strategies())}")
    tmp = tempfile.mkdtemp(prefix="hspmd_planner_bench_")
    data = os.path.join(tmp, "data.bin")
    rng = random.Random(1)
    with open(data, "wb") as f:
        f.write(b"".join(struct.pack("<I", rng.randrange(256)) for _ in range(65536)))
    cluster = os.path.join(tmp, "cluster.json")
    json.dump(CLUSTER, open(cluster, "w"))
    profile = args.profile
    if not profile:
        profile = os.path.join(tmp, "profile.json")
        grid = (["--tp", "1,2", "--cp", "1", "--seq-lens", "32,64", "--repetitions", "1"] if args.smoke else
                ["--tp", "1,2,4", "--cp", "1,2", "--seq-lens", "32,64,128"])
        run([args.hspmd, "profile", "--model", MODEL] + grid +
            ["--micro-batch-sizes", "1,2", "--threads", "1", "--emulated-ranks", "8", "-o", profile])
    rows = []
    only = set(args.only.split(",")) if args.only else None
    print(f"{'strategy':20s} {'predicted_s':>12s} {'emulated_s':>12s} {'error':>8s}")
    for name, s in strategies().items():
        if only and name not in only:
            continue
        path = os.path.join(tmp, name + ".json")
        json.dump(s, open(path, "w"))
        pred = predict(args.hspmd, path, cluster, profile)
        emu = emulate(args.hspmd, tmp, name, path, data, cluster, args.steps)
        rows.append({"strategy": name, "predicted_s": pred, "emulated_s": emu, "error": pred / emu - 1})
        print(f"{name:20s} {pred:12.5f} {emu:12.5f} {100 * (pred / emu - 1):+7.1f}%", flush=True)
    if not rows:
        sys.exit("no strategy was run")
    errs = [abs(r["error"]) for r in rows]
    print(f"\n{len(rows)} strategies: median |error| {100 * statistics.median(errs):.1f}%, "
          f"largest {100 * max(errs):.1f}%, within 15%: {sum(e <= 0.15 for e in errs)}/{len(errs)}")
    out = {"rows": rows}
    if args.search:
        out["search"] = []
        for batch in (int(x) for x in args.search_batch.split(",")):
            found = os.path.join(tmp, f"searched_{batch}.json")
            res = json.loads(run([args.hspmd, "plan", "search", "--model", MODEL, "--cluster", cluster,
                                  "--global-batch", str(batch), "--seq-len", str(SEQ), "--profile", profile,
                                  "-o", found, "--json"] + (["--tp", "1,2"] if args.smoke else [])))
            emu = emulate(args.hspmd, tmp, f"searched_{batch}", found, data, cluster, args.steps)
            hand = [r for r in rows if sum(p["micro_batch_size"] * p["micro_batches"]
                                           for p in strategies()[r["strategy"]]["pipelines"]) == batch]
            best = min(hand, key=lambda r: r["emulated_s"]) if hand else None
            print(f"\nsearch (global batch {batch}): predicted {res['predicted_step_s']:.5f} s, emulated {emu:.5f} s "
                  f"({100 * (res['predicted_step_s'] / emu - 1):+.1f}%), {res['search_s']:.3f} s of search; "
                  f"{json.dumps(res['strategy'])}")
            if best:
                print(f"best hand-written strategy of batch {batch}: {best['strategy']}, emulated "
                      f"{best['emulated_s']:.5f} s (searched / hand-written = {emu / best['emulated_s']:.3f})")
            out["search"].append({"global_batch": batch, "predicted_s": res["predicted_step_s"], "emulated_s": emu,
                                  "search_s": res["search_s"], "strategy": res["strategy"],
                                  "best_hand_written": best})
    if args.json:
        json.dump(out, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
