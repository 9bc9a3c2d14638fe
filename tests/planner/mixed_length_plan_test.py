"""`hspmd plan search --lengths` (docs/planner.md "Mixed lengths") on a
4-rank cluster of two speeds whose memory cap keeps a 32-token piece off a
single rank (without recomputation), with mostly short documents and a few
long ones: the strategies validate, the top bucket accepts L, the short
bucket's pipelines are narrower than those taking pieces of L (never one
rank alone), and `hspmd train
--strategies <the outputs>` equals the single-process run (losses 1e-5
relative per step, weights 1e-4). Also the one-line errors."""
import argparse
import glob
import json
import os
import random
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "exec"))
from equivalence_test import MODEL  # noqa: E402
from switch_test import max_weight_error  # noqa: E402
from mixed_length_test import trainer  # noqa: E402

L, T, STEPS, CAP_GIB = 32, 96, 4, 0.00093


def make_docs(path, seed=5, n=12000):
    """Mostly short documents, a few long ones (ids 1..63, eos 0)."""
    rng = random.Random(seed)
    toks = []
    while len(toks) < n:
        u = rng.random()
        k = rng.randint(2, 10) if u < 0.9 else rng.randint(11, 15) if u < 0.98 else rng.randint(17, 80)
        toks += [rng.randrange(1, 64) for _ in range(k - 1)] + [0]
    with open(path, "wb") as f:
        f.write(b"".join(struct.pack("<I", t) for t in toks))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", required=True)
    a = ap.parse_args()
    failures = []

    def check(label, ok, detail=""):
        print(f"{label:44s} {detail} {'ok' if ok else 'FAIL'}")
        if not ok:
            failures.append(label)

    with tempfile.TemporaryDirectory() as tmp:
        model, data = os.path.join(tmp, "model.json"), os.path.join(tmp, "docs.bin")
        cluster, prof, out = os.path.join(tmp, "cluster.json"), os.path.join(tmp, "prof.json"), os.path.join(tmp, "s")
        os.mkdir(out)
        json.dump(MODEL, open(model, "w"))
        make_docs(data)
        dev = {"tflops": 2, "memory_gib": 1, "intra_node_gbps": 10, "inter_node_gbps": 2}
        json.dump({"catalog": {"fast": dev, "slow": dev},
                   "nodes": [{"type": "fast", "ranks": [0, 1], "memory_cap_gib": CAP_GIB},
                             {"type": "slow", "ranks": [2, 3], "slowdown": 2.0, "memory_cap_gib": CAP_GIB}]},
                  open(cluster, "w"))
        # A profile gives the cost model this executor's fp32 memory.
        subprocess.run([a.hspmd, "profile", "--model", model, "--tp", "1,2", "--cp", "1,2", "--seq-lens", "8,16,32",
                        "--micro-batch-sizes", "1", "-o", prof], check=True, capture_output=True, timeout=300)
        # Its timings are set to fixed values of the measured magnitude (per
        # token work split over tp x cp, a fixed overhead per call), so that
        # the plan does not depend on how loaded the machine was.
        fixed = {"embed_fwd": (4e-9, 2e-6), "embed_bwd": (6e-9, 2e-6), "block_fwd": (1.4e-6, 2e-5),
                 "block_bwd": (1.1e-6, 4e-5), "head_fwd": (1.3e-7, 4e-6), "head_bwd": (1.5e-7, 6e-6)}
        pj = json.load(open(prof))
        for e in pj["entries"]:
            for part, (c, d) in fixed.items():
                e["parts"][part].update({"a": 0.0, "c": c / (e["tp"] * e["cp"]), "d": d})
        json.dump(pj, open(prof, "w"))
        plan = [a.hspmd, "plan", "search", "--model", model, "--cluster", cluster, "--lengths", data,
                "--batch-tokens", str(T), "--max-seq-len", str(L), "--profile", prof, "--no-recompute"]
        r = subprocess.run(plan + ["--strategies-out", out, "--json"], capture_output=True, text=True, timeout=300)
        if r.returncode:
            sys.exit("plan search --lengths failed: " + r.stderr)
        rep = json.loads(r.stdout)
        buckets = rep["buckets"]
        files = sorted(glob.glob(os.path.join(out, "*.json")), key=lambda p: int(p.split("_")[-1][:-5]))
        check("one strategy per bucket", len(buckets) >= 2 and len(files) == len(buckets) == len(rep["written"]),
              f"max lengths {[b['max_seq_len'] for b in buckets]}")
        check("the top bucket covers L", buckets[-1]["max_seq_len"] == L and all(
            max(p["max_seq_len"] for p in b["strategy"]["pipelines"]) == b["max_seq_len"] for b in buckets))
        check("a planning time and predictions", rep["planning_s"] >= 0 and all(
            b["predicted_step_s"] > 0 and b["dp_step_s"] > 0 for b in buckets))
        for f in files:
            v = subprocess.run([a.hspmd, "plan", "cost", "--model", model, "--cluster", cluster, "--strategy", f,
                                "--seq-len", "8", "--profile", prof, "--json"], capture_output=True, text=True)
            check("validates: " + os.path.basename(f), v.returncode == 0, v.stderr.strip()[:160])
        # Tailored by length: the short bucket's pipelines are narrower than
        # the pipelines that take the longest pieces, which the cap keeps off
        # a single rank holding every layer.
        top = buckets[-1]["strategy"]["pipelines"]
        width = lambda p: sum(len(s["ranks"]) for s in p["stages"])  # noqa: E731
        long_ranks = [width(p) for p in top if p["max_seq_len"] == L]
        short_ranks = [width(p) for p in buckets[0]["strategy"]["pipelines"]]
        check("short-bucket pipelines are narrower", long_ranks and min(short_ranks) < min(long_ranks),
              f"short bucket {short_ranks}, long pieces' pipelines {long_ranks}")
        check("a long piece never on one rank alone", all(w >= 2 for w in long_ranks), f"{long_ranks}")
        # Failed devices (the elastic re-plan of token-budget steps): no
        # pipeline on them, every bucket still planned.
        r = subprocess.run(plan + ["--unavailable", "1", "--json"], capture_output=True, text=True, timeout=300)
        left = json.loads(r.stdout)["buckets"] if r.returncode == 0 else []
        used = {x for b in left for p in b["strategy"]["pipelines"] for s in p["stages"] for x in s["ranks"]}
        check("--unavailable 1 leaves rank 1 out", left and 1 not in used and left[-1]["max_seq_len"] == L,
              f"ranks used {sorted(used)}" if left else r.stderr.strip()[:150])

        base = [a.hspmd, "train", "--model", model, "--data", data, "--steps", str(STEPS), "--lr", "3e-3",
                "--eps", "1e-5", "--weight-decay", "0.1", "--clip-grad", "0.5", "--threads", "1", "--quiet",
                "--batch-tokens", str(T), "--max-seq-len", str(L)]

        run_train = trainer(tmp, base)

        def train(name, extra):
            rc, err, recs, weights = run_train(name, extra)
            if rc:
                sys.exit(f"{name} run failed: {err[-600:]}")
            return [x for x in recs if "loss" in x], weights

        want, want_w = train("single", [])
        got, got_w = train("planned", ["--strategies", ",".join(files), "--nproc", "4", "--cluster", cluster,
                                       "--profile", prof])
        rel = max((abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(want, got)), default=float("inf"))
        werr = max_weight_error(want_w, got_w)
        check("trains as one process", len(got) == STEPS and rel <= 1e-5 and werr <= 1e-4,
              f"loss rel err {rel:.2e}, weights err {werr:.2e}, strategies {[y.get('strategy') for y in got]}")

        # One-line errors.
        def err(extra, want_text, args=None):
            r = subprocess.run((args or plan) + extra, capture_output=True, text=True)
            lines = [x for x in r.stderr.splitlines() if x.strip()]
            check("error: " + want_text, r.returncode != 0 and len(lines) == 1 and want_text in r.stderr,
                  lines[0][:150] if lines else "")
        err(["--buckets", "0"], "[flags] --buckets must be >= 1")
        err(["--unavailable", "0-3"], "[search] no available rank")
        err([], "[search] --batch-tokens 16 is smaller than --max-seq-len 32",
            [x if x != str(T) else "16" for x in plan])
        tiny = os.path.join(tmp, "tiny.json")
        c = json.load(open(cluster))
        for n in c["nodes"]:
            n["memory_cap_gib"] = 0.0001
        json.dump(c, open(tiny, "w"))
        err([], "[search] no pipeline holds a micro-batch of", [x if x != cluster else tiny for x in plan])
    if failures:
        sys.exit(f"{len(failures)} failure(s): {failures}")
    print("all mixed-length planning cases passed")


if __name__ == "__main__":
    main()
