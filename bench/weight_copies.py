#!/usr/bin/env python3
"""The weights' bf16 copies written by AdamW against the graph's per-step
casts (docs/precision.md, "The weights' bf16 copies"), side by side in one
run: `hspmd train --precision bf16` under HSPMD_WEIGHT_COPIES=optimizer
(the default) and =graph, alternating, --repeats times each. Prints each
mode's median step time over the steps after the first (the first step
casts in both modes) and the ratio, and checks that both trained the same
losses bit for bit.

The default shape is weight-bound on purpose (few tokens a step, a wide
model: the casts' bytes are a visible part of the step); at a GPU
benchmark's shapes the saving is about 0.4% of the step (docs/benchmarks.md).

usage: bench/weight_copies.py [--hspmd build/src/cli/hspmd] [--hidden 1024] [--layers 4]
                              [--seq-len 64] [--global-batch 1] [--steps 6] [--repeats 3] [--threads 2]
       bench/weight_copies.py --smoke     # a tiny model, 2 steps, 1 run: the harness only
"""
import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", default=os.path.join(ROOT, "build", "src", "cli", "hspmd"))
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="a tiny model, 2 steps, 1 run (the suite's smoke test)")
    a = ap.parse_args()
    if a.smoke:
        a.hidden, a.layers, a.vocab, a.seq_len, a.steps, a.repeats, a.threads = 128, 2, 512, 16, 2, 1, 1
    if a.steps < 2:
        sys.exit("bench/weight_copies.py: --steps must be at least 2 (the first step casts in both modes)")
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": a.vocab,
           "hidden_size": a.hidden, "intermediate_size": a.hidden * 11 // 4 // 64 * 64,
           "num_hidden_layers": a.layers, "num_attention_heads": a.hidden // 64,
           "num_key_value_heads": max(1, a.hidden // 256), "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "max_position_embeddings": 4096, "tie_word_embeddings": False, "eos_token_id": 0}
    times = {"optimizer": [], "graph": []}
    losses = {}
    with tempfile.TemporaryDirectory(prefix="weight_copies-") as tmp:
        model = os.path.join(tmp, "config.json")
        json.dump(cfg, open(model, "w"))
        data = os.path.join(tmp, "tokens.bin")
        n = (a.steps + 1) * a.global_batch * (a.seq_len + 1)
        with open(data, "wb") as f:
            f.write(b"".join(struct.pack("<I", 1 + (i * 7919) % (a.vocab - 1)) for i in range(n)))
        for rep in range(a.repeats):
            for mode in ("optimizer", "graph"):
                log = os.path.join(tmp, f"{mode}{rep}.jsonl")
                p = subprocess.run([a.hspmd, "train", "--model", model, "--data", data, "--precision", "bf16",
                                    "--seq-len", str(a.seq_len), "--global-batch", str(a.global_batch),
                                    "--steps", str(a.steps), "--threads", str(a.threads), "--quiet",
                                    "--log", log], capture_output=True, text=True,
                                   env=dict(os.environ, HSPMD_WEIGHT_COPIES=mode))
                if p.returncode != 0:
                    sys.exit(f"hspmd train ({mode}) failed: {p.stderr.strip()[-400:]}")
                rows = [json.loads(line) for line in open(log)]
                times[mode] += [r["step_time_s"] for r in rows[1:]]
                losses.setdefault(mode, [r["loss"] for r in rows])
    params = a.layers * (2 * a.hidden * a.hidden + 2 * a.hidden * cfg["num_key_value_heads"] * 64 +
                         3 * a.hidden * cfg["intermediate_size"]) + a.vocab * a.hidden
    med = {m: statistics.median(t) for m, t in times.items()}
    print(f"model: hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}: {params / 1e6:.1f} M GEMM weights; "
          f"S {a.seq_len}, B {a.global_batch}, {a.threads} threads, bf16; "
          f"{len(times['optimizer'])} steps per mode ({a.repeats} runs, the first step of each left out)")
    for m in ("optimizer", "graph"):
        print(f"  HSPMD_WEIGHT_COPIES={m:9s} median step {med[m] * 1e3:8.2f} ms")
    print(f"  graph / optimizer: {med['graph'] / med['optimizer']:.3f}x")
    same = losses["optimizer"] == losses["graph"]
    print(f"  losses bit for bit the same: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
