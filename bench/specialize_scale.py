#!/usr/bin/env python3
"""One rank's specialization at scale (docs/benchmarks.md, "One rank's
specialization at 4096 ranks"): writes the 70B strategy and cluster of P
pipelines x 8 stages x TP8 (P*64 ranks, ZeRO-1, 10 layers per stage), compiles
the plan, then times with /usr/bin/time -v, per world size:

  explain   hspmd plan explain PLAN --rank R
  exec      hspmd_specialize PLAN --rank R: rank R's ExecGraph plus what the
            trainer does to specialize (its dry run and pipeline discovery)

and prints one row per (world, what): the process's wall seconds and max RSS
(/usr/bin/time -v, loading the plan included); for exec also the seconds of
the specialization alone (graph + dry run + discovery, after the plan is
loaded) and the MB it still holds at the end beyond the loaded plan.

usage: bench/specialize_scale.py [--build build] [--pipelines 1,8,64] [--rank 0] [--keep DIR] [--smoke]
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODEL = os.path.join(ROOT, "examples", "models", "llama-70b.json")
STAGES, TP, LAYERS = 8, 8, 80


def strategy(pipelines):
    per_stage = LAYERS // STAGES
    out = []
    for p in range(pipelines):
        stages = []
        for s in range(STAGES):
            first = (p * STAGES + s) * TP
            stages.append({"ranks": list(range(first, first + TP)),
                           "layers": [s * per_stage, (s + 1) * per_stage - 1]})
        out.append({"micro_batch_size": 1, "micro_batches": 8, "stages": stages})
    return {"description": f"bench/specialize_scale.py: {pipelines} pipelines x {STAGES} stages x TP{TP}, ZeRO-1",
            "schedule": "1f1b", "zero": pipelines > 1, "pipelines": out}


def cluster(world):
    return {"catalog": {"H800": {"tflops": 990, "memory_gib": 79.65, "intra_node_gbps": 400,
                                 "inter_node_gbps": 25}},
            "nodes": [{"type": "H800", "ranks": [n, n + 7]} for n in range(0, world, 8)]}


def timed(cmd):
    """Runs cmd under /usr/bin/time -v: (seconds, max RSS in MB, stdout)."""
    r = subprocess.run(["/usr/bin/time", "-v"] + cmd, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stderr}")
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", r.stderr).group(1)
    seconds = sum(float(x) * 60 ** i for i, x in enumerate(reversed(wall.split(":"))))
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1))
    return seconds, rss_kb / 1024, r.stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--pipelines", default="1,8,64")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--keep", help="write the files here instead of a temporary directory")
    ap.add_argument("--smoke", action="store_true",
                    help="one pipeline (64 ranks): the same compile, explain and hspmd_specialize calls (the "
                         "CTest bench_smoke_specialize_scale)")
    a = ap.parse_args()
    if a.smoke:
        ap.set_defaults(pipelines="1")
        a = ap.parse_args()
    hspmd = os.path.join(a.build, "src", "cli", "hspmd")
    specialize = os.path.join(a.build, "bench", "hspmd_specialize")
    with tempfile.TemporaryDirectory() as tmp:
        d = a.keep or tmp
        os.makedirs(d, exist_ok=True)
        print(f"{'ranks':>6} {'what':<8} {'wall s':>7} {'max RSS MB':>10} {'specialize s':>12} {'held MB':>8}")
        for p in (int(x) for x in a.pipelines.split(",")):
            world = p * STAGES * TP
            s_path, c_path, plan = (os.path.join(d, f"{n}_{world}.json") for n in ("strategy", "cluster", "plan"))
            with open(s_path, "w") as f:
                json.dump(strategy(p), f, indent=1)
            with open(c_path, "w") as f:
                json.dump(cluster(world), f, indent=1)
            r = subprocess.run([hspmd, "plan", "compile", "--model", MODEL, "--strategy", s_path,
                                "--world", str(world), "-o", plan], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
            if r.returncode:
                sys.exit(f"plan compile ({world} ranks) failed:\n{r.stderr[-2000:]}")
            for what, cmd in (("explain", [hspmd, "plan", "explain", plan, "--rank", str(a.rank),
                                           "--cluster", c_path]),
                              ("exec", [specialize, plan, "--rank", str(a.rank), "--cluster", c_path])):
                sec, rss, out = timed(cmd)
                spec = held = "-"
                if what == "exec":
                    j = json.loads(out)
                    spec = f"{j['exec_graph_s'] + j['dry_run_s'] + j['pipelines_s']:.2f}"
                    held = f"{j['rss_mb'] - j['plan_rss_mb']:.0f}"
                print(f"{world:>6} {what:<8} {sec:>7.2f} {rss:>10.0f} {spec:>12} {held:>8}", flush=True)


if __name__ == "__main__":
    main()
