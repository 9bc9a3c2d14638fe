#!/usr/bin/env python3
"""GEMM peak of kernels::matmul's backends: runs bench/gemm_bench (C++) once
per thread count and prints one markdown table per thread count (median
GFLOP/s; columns: fp32 OpenBLAS, fp32 oneDNN, bf16 oneDNN with bf16 operands,
bf16 oneDNN with f32 operands rounded per call, bf16 emulated on OpenBLAS),
with the CPU model and the backends the kernels picked.

usage: bench/gemm_bench.py [--exe build/bench/gemm_bench] [--threads 1 2] [--reps 15]
                           [--shapes all|model] [--interleave] [--json out.jsonl] [--smoke]
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

COLUMNS = [
    ("fp32_openblas", "fp32 OpenBLAS"),
    ("fp32_onednn", "fp32 oneDNN"),
    ("bf16_onednn", "bf16 oneDNN"),
    ("bf16_onednn_f32in", "bf16 oneDNN, f32 in"),
    ("bf16_emulated", "bf16 emulated"),
]


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def run(exe, threads, reps, shapes, interleave):
    cmd = [exe, "--threads", str(threads), "--reps", str(reps), "--shapes", shapes,
           "--interleave", "1" if interleave else "0"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stderr[-2000:]}")
    out = r.stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    info = next(r for r in rows if r.get("info"))
    return info, [r for r in rows if not r.get("info")]


def table(rows):
    cols = [c for c in COLUMNS if any(c[0] in r for r in rows)]
    head = "| shape | M | N | K | " + " | ".join(title for _, title in cols) + " |"
    lines = [head, "|---|--:|--:|--:|" + "--:|" * len(cols)]
    for r in rows:
        best = max(r.get(key, 0.0) for key, _ in cols if key.startswith("fp32"))
        cells = []
        for key, _ in cols:
            v = r.get(key)
            cell = "n/a" if v is None else f"{v:.1f}"
            if key.startswith("fp32") and v == best and len([k for k, _ in cols if k.startswith("fp32")]) > 1:
                cell = f"**{cell}**"
            cells.append(cell)
        lines.append(f"| {r['shape']} | {r['m']} | {r['n']} | {r['k']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--exe", default=os.path.join(ROOT, "build", "bench", "gemm_bench"))
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--shapes", default="all", choices=["all", "model"])
    p.add_argument("--interleave", action="store_true",
                   help="alternate the backends call by call (default: each alone, after warm-up)")
    p.add_argument("--json", help="also write every row as JSON lines here")
    p.add_argument("--smoke", action="store_true",
                   help="1 thread, 1 timed call per backend, the model's shapes (gemm_bench still warms each "
                        "backend up for 0.3 s: about 25 s); exit 1 unless every shape has a positive figure per "
                        "backend (the CTest bench_smoke_gemm_bench)")
    a = p.parse_args()
    if a.smoke:
        p.set_defaults(threads=[1], reps=1, shapes="model")
        a = p.parse_args()
    if not os.path.exists(a.exe):
        sys.exit(f"gemm_bench.py: no executable {a.exe} (build the gemm_bench target)")
    print(f"CPU: {cpu_model()}")
    all_rows = []
    for t in a.threads:
        info, rows = run(a.exe, t, a.reps, a.shapes, a.interleave)
        all_rows += rows
        print(f"\n{t} thread(s); backends: {info['backends']}\n")
        print(table(rows))
    bad = [r["shape"] for r in all_rows if not any(k in r for k, _ in COLUMNS)
           or any(r.get(k, 1.0) <= 0 for k, _ in COLUMNS)]
    if not all_rows or bad:
        sys.exit(f"gemm_bench.py: no rows, or rows without a positive figure: {bad}")
    if a.json:
        with open(a.json, "w") as f:
            for r in all_rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
