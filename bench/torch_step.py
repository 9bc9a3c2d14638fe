#!/usr/bin/python3
"""Times PyTorch training steps of the reference Llama (tests/oracle/llama_ref.py).

Random init (normal std 0.02, norms ones), random tokens, forward + backward +
AdamW step; 2 warm-up steps, then --steps timed ones. Prints one JSON line:
{"impl": "pytorch", "threads", "step_time_s_median", "tokens_per_s", "peak_rss_mb", ...}

  /usr/bin/python3 bench/torch_step.py [--model cfg.json] --seq-len 256 \
      --global-batch 8 --threads 1 --steps 5

Without --model the reference config is used (vocab 4096, hidden 256, 8 heads,
4 KV heads, intermediate 688, 4 layers).
"""

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "oracle"))
import llama_ref  # noqa: E402

REFERENCE_CONFIG = {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 688,
                    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
                    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}
WARMUP_STEPS = 2


def load_model_config(path):
    if path:
        return llama_ref.load_config(path)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(REFERENCE_CONFIG, f)
    try:
        return llama_ref.load_config(f.name)
    finally:
        os.unlink(f.name)


def main():
    ap = argparse.ArgumentParser(description="time PyTorch Llama training steps")
    ap.add_argument("--model", help="HF config.json (default: the reference config)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5, help="timed steps after 2 warm-up steps")
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--autocast", action="store_true", help="torch.autocast('cpu', torch.bfloat16) around the forward")
    args = ap.parse_args()
    llama_ref.AUTOCAST = args.autocast
    # Under an oneDNN cap below AVX-512 (the capped leg's emulation of an
    # AVX2 CPU) torch takes the path it takes on such a CPU: no oneDNN.
    llama_ref.follow_onednn_cap()

    torch.set_num_threads(args.threads)
    cfg = load_model_config(args.model)
    named = {k: v.requires_grad_(True) for k, v in llama_ref.random_params(cfg, args.seed).items()}
    opt = llama_ref.make_optimizer(named, args.lr, args.weight_decay, 0.9, 0.95, 1e-8)
    gen = torch.Generator().manual_seed(args.seed + 1)
    shape = (args.global_batch, args.seq_len + 1)

    times = []
    for step in range(WARMUP_STEPS + args.steps):
        tokens = torch.randint(0, cfg["vocab_size"], shape, generator=gen, dtype=torch.int64)
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        start = time.perf_counter()
        loss, _ = llama_ref.train_step(named, cfg, opt, inputs, targets, args.micro_batches, 0.0)
        elapsed = time.perf_counter() - start
        if step >= WARMUP_STEPS:
            times.append(elapsed)

    median = statistics.median(times)
    print(json.dumps({
        "impl": "pytorch",
        "precision": "autocast-bf16" if args.autocast else "fp32",
        "threads": args.threads,
        "seq_len": args.seq_len,
        "global_batch": args.global_batch,
        "steps": args.steps,
        "step_time_s_median": median,
        "tokens_per_s": args.global_batch * args.seq_len / median,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "final_loss": loss,
        "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()
