#!/usr/bin/env python3
"""Side-by-side training-step benchmark: hspmd against PyTorch eager.

Runs one process per (implementation, thread count) on the same config, batch
and sequence length, alternating implementations, and prints a table with the
median step time, tokens/s, model GFLOP/s, peak RSS and the hspmd/PyTorch
ratios. Model FLOPs per step: 6 * tokens * (matmul parameters incl. the LM
head) + 12 * layers * heads * head_dim * seq_len * tokens (attention scores
and values, forward and backward, full matrix, as in the PaLM/Megatron
accounting; the same count is used for both implementations).

Precisions: fp32 (both in f32) and bf16 (hspmd --precision bf16 against
PyTorch under torch.autocast("cpu", torch.bfloat16)).

usage: bench/train_step.py [--hspmd-step build/bench/hspmd_step] [--model bench/configs/reference.json]
                           [--seq-len 256] [--global-batch 8] [--steps 5] [--threads 1 2] [--repeats 1]
                           [--precisions fp32 bf16]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEBIAN_PYTHON = "/usr/bin/python3"


def model_flops(cfg, seq, batch):
    h, f, v, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    nh = cfg["num_attention_heads"]
    d = h // nh
    kv = cfg.get("num_key_value_heads") or nh
    per_layer = h * nh * d * 2 + h * kv * d * 2 + 3 * h * f
    matmul_params = L * per_layer + v * h
    tokens = seq * batch
    return 6 * tokens * matmul_params + 12 * L * nh * d * seq * tokens


def run(cmd, env):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd-step", default=os.path.join(ROOT, "build/bench/hspmd_step"))
    ap.add_argument("--model", default=os.path.join(HERE, "configs/reference.json"))
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=1, help="processes per implementation")
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    a = ap.parse_args()
    cfg = json.load(open(a.model))
    flops = model_flops(cfg, a.seq_len, a.global_batch)
    common = ["--model", a.model, "--seq-len", str(a.seq_len), "--global-batch", str(a.global_batch),
              "--steps", str(a.steps)]
    print(f"config {os.path.basename(a.model)}, seq {a.seq_len}, batch {a.global_batch}, "
          f"{a.steps} timed steps after 2 warm-up steps, {flops / 1e9:.1f} model GFLOP per step")
    print(f"{'impl':8s} {'prec':>5s} {'thr':>3s} {'step s':>8s} {'tokens/s':>9s} {'GFLOP/s':>8s} {'peak RSS MB':>11s}")
    for t in a.threads:
        # Same environment for both: passive OpenMP waiting (hspmd sets it
        # itself; PyTorch also mixes OpenMP with OpenBLAS's threads).
        env = dict(os.environ, OMP_NUM_THREADS=str(t), OPENBLAS_NUM_THREADS=str(t),
                   OMP_WAIT_POLICY="PASSIVE")
        for prec in a.precisions:
            res = {"hspmd": [], "pytorch": []}
            for _ in range(a.repeats):
                res["hspmd"].append(run([a.hspmd_step, *common, "--threads", str(t), "--precision", prec], env))
                res["pytorch"].append(run([DEBIAN_PYTHON, os.path.join(HERE, "torch_step.py"), *common,
                                           "--threads", str(t), *(["--autocast"] if prec == "bf16" else [])], env))
            summary = {}
            for impl, rows in res.items():
                step = statistics.median(r["step_time_s_median"] for r in rows)
                rss = max(r["peak_rss_mb"] for r in rows)
                summary[impl] = (step, rss)
                print(f"{impl:8s} {prec:>5s} {t:3d} {step:8.4f} {a.seq_len * a.global_batch / step:9.0f} "
                      f"{flops / step / 1e9:8.1f} {rss:11.0f}")
            (hs, hr), (ps, pr) = summary["hspmd"], summary["pytorch"]
            print(f"ratio    {prec:>5s} {t:3d}  hspmd/pytorch tokens/s {ps / hs:.2f}x, peak RSS {hr / pr:.2f}x")


if __name__ == "__main__":
    main()
