#!/usr/bin/env python3
"""Mixed lengths on the EMULATED cluster (docs/mixed_length.md): real tokens
per emulated second of

  fixed    the planner's best fixed strategy for sequences of L
           (`hspmd plan search --global-batch T/L --seq-len L`), trained with
           --pack-documents (Megatron-like: documents packed into windows of L)
  dynamic  token-budget steps of T tokens (--batch-tokens T --max-seq-len L)
           over the strategies of `hspmd plan search --lengths` (one per
           maximum-length bucket), chosen per step (--strategies)
  buckets  the same steps and strategies with --bucket-switching (the
           HotSPa-like baseline: bucket by bucket inside each step)

side by side in one run, on 8 emulated ranks of two speeds (ranks 4-7 at
half speed) whose memory caps hold a piece of L only with TP or CP >= 2
(--cap-gib), under the model clock (`--clock model`: emulated times from a
profile of this machine, deterministic). The documents are synthetic and
heavy-tailed like the paper's corpus (most far below L, a few above it):
the bundled code corpus is long-heavy at this scale (docs/data.md).

usage: bench/mixed_length_bench.py [--hspmd build/src/cli/hspmd] [--steps 12] [--buckets 3] [--batch-tokens 2048] [--cap-gib 0.011]
"""
import argparse
import json
import os
import random
import statistics
import struct
import subprocess
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODEL = os.path.join(ROOT, "examples", "models", "llama-tiny-8l.json")
L = 256
CLUSTER = {"catalog": {t: {"tflops": 100, "memory_gib": 80, "intra_node_gbps": 100, "inter_node_gbps": 25}
                       for t in ("fast", "slow")},
           "nodes": [{"type": "fast", "ranks": [0, 3]}, {"type": "slow", "ranks": [4, 7], "slowdown": 2.0}]}


def make_docs(path, n=400000, seed=5):
    """90% of documents 8-48 tokens, 8% 48-160, 2% 160-700 (cut into pieces of L)."""
    rng = random.Random(seed)
    toks = []
    while len(toks) < n:
        u = rng.random()
        k = rng.randint(8, 48) if u < 0.9 else rng.randint(48, 160) if u < 0.98 else rng.randint(160, 700)
        toks += [rng.randrange(1, 256) for _ in range(k - 1)] + [0]
    with open(path, "wb") as f:
        f.write(b"".join(struct.pack("<I", t) for t in toks))


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if r.returncode:
        raise SystemExit("failed: " + " ".join(cmd) + "\n" + r.stderr[-2000:])
    return r.stdout


def throughput(log):
    steps = [json.loads(l) for l in open(log)]
    steps = [s for s in steps if "loss" in s and s["step"] > 0]
    tokens = sum(s["tokens"] for s in steps)
    emulated = sum(s["emulated_step_time_s"] for s in steps)
    return tokens / emulated, statistics.median(s["emulated_step_time_s"] for s in steps), \
        statistics.median(s["tokens"] for s in steps)


def main():  # noqa: C901
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", default=os.path.join(ROOT, "build", "src", "cli", "hspmd"))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--buckets", type=int, default=3)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--cap-gib", type=float, default=0.011,
                    help="memory cap per rank: 0.011 holds 128 tokens on one rank, 256 only with TP or CP >= 2")
    a = ap.parse_args()
    T = a.batch_tokens
    hs = a.hspmd
    with tempfile.TemporaryDirectory() as tmp:
        p = lambda name: os.path.join(tmp, name)  # noqa: E731
        make_docs(p("docs.bin"))
        cluster = json.loads(json.dumps(CLUSTER))
        if a.cap_gib > 0:
            for node in cluster["nodes"]:
                node["memory_cap_gib"] = a.cap_gib
        json.dump(cluster, open(p("cluster.json"), "w"))
        t0 = time.perf_counter()
        run([hs, "profile", "--model", MODEL, "--tp", "1,2,4", "--cp", "1,2", "--seq-lens", "32,64,128,256",
             "--micro-batch-sizes", "1,2,4,8", "--repetitions", "3", "-o", p("profile.json")])
        profile_s = time.perf_counter() - t0
        common = ["--model", MODEL, "--cluster", p("cluster.json"), "--profile", p("profile.json")]
        # fixed: the planner's best strategy for windows of L, documents packed
        t0 = time.perf_counter()
        fixed = json.loads(run([hs, "plan", "search"] + common + ["--global-batch", str(T // L), "--seq-len", str(L),
                                                                 "-o", p("fixed.json"), "--json"]))
        fixed_plan_s = time.perf_counter() - t0
        # dynamic: one strategy per bucket from the length statistics
        os.mkdir(p("buckets"))
        t0 = time.perf_counter()
        dyn = json.loads(run([hs, "plan", "search"] + common + ["--lengths", p("docs.bin"), "--batch-tokens", str(T),
                                                               "--max-seq-len", str(L), "--strategies-out",
                                                               p("buckets"), "--buckets", str(a.buckets), "--json"]))
        dyn_plan_s = time.perf_counter() - t0
        buckets = sorted((os.path.join(p("buckets"), f) for f in os.listdir(p("buckets"))),
                         key=lambda f: int(f.split("_")[-1][:-5]))
        train = [hs, "train", "--data", p("docs.bin"), "--steps", str(a.steps), "--nproc", "8", "--threads", "1",
                 "--quiet", "--clock", "model"] + common
        run(train + ["--strategy", p("fixed.json"), "--pack-documents", "--seq-len", str(L), "--global-batch",
                     str(T // L), "--log", p("fixed.jsonl")])
        run(train + ["--strategies", ",".join(buckets), "--batch-tokens", str(T), "--max-seq-len", str(L),
                     "--log", p("dynamic.jsonl")])
        run(train + ["--strategies", ",".join(buckets), "--batch-tokens", str(T), "--max-seq-len", str(L),
                     "--bucket-switching", "--log", p("buckets.jsonl")])
        f_tps, f_step, f_tok = throughput(p("fixed.jsonl"))
        d_tps, d_step, d_tok = throughput(p("dynamic.jsonl"))
        b_tps, b_step, b_tok = throughput(p("buckets.jsonl"))
        picks = [json.loads(l).get("strategy") for l in open(p("dynamic.jsonl")) if '"loss"' in l]
        print(f"tiny 8-layer model, L {L}, {T} tokens per step, 8 emulated ranks (4 at half speed), "
              f"{a.steps} steps (the first left out), model clock; profile {profile_s:.1f} s")
        print(f"fixed strategy: {json.dumps(fixed['strategy'] if 'strategy' in fixed else fixed)[:300]}")
        print(f"bucket strategies: {[os.path.basename(b) for b in buckets]}; per-step choice {picks}")
        print(f"{'mode':8s} {'tokens/emulated s':>18s} {'median step s':>14s} {'median tokens':>14s} {'plan s':>7s}")
        print(f"{'fixed':8s} {f_tps:18.0f} {f_step:14.5f} {f_tok:14.0f} {fixed_plan_s:7.2f}")
        print(f"{'dynamic':8s} {d_tps:18.0f} {d_step:14.5f} {d_tok:14.0f} {dyn_plan_s:7.2f}")
        print(f"{'buckets':8s} {b_tps:18.0f} {b_step:14.5f} {b_tok:14.0f} {dyn_plan_s:7.2f}")
        print(f"dynamic / fixed: {d_tps / f_tps:.2f}x; dynamic / buckets: {d_tps / b_tps:.2f}x")


if __name__ == "__main__":
    main()
