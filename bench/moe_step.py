#!/usr/bin/env python3
"""Mixture-of-experts training step: hspmd against Hugging Face's Mixtral.

The same Mixtral config, batch, sequence length, initial weights and data
are given to `hspmd train` (one process) and to transformers'
MixtralForCausalLM (eager, f32, under the oracle venv of
scripts/setup_oracle_venv.sh: torch + the pinned transformers). Each trains
for --steps AdamW steps with the same thread count. The two run one after
the other, alternating, --repeats times. The script prints:
- the median step time of each (after --warmup steps);
- tokens/s;
- the ratio hspmd / HF (below 1: hspmd is faster);
- the first steps' losses, side by side, as a check that both train the same
  model;
- the machine.
The last line is one JSON object.

HF's sparse block loops over the experts with index_select/index_add; hspmd
sorts each rank's (token, slot) rows by expert once and runs one GEMM per
expert (docs/moe.md).

usage: bench/moe_step.py --hspmd build/src/cli/hspmd [--venv .venv-oracle] [--hidden 256] [--layers 4]
                         [--experts 8] [--top-k 2] [--seq-len 256] [--batch 4] [--steps 6] [--warmup 2]
                         [--threads 2] [--repeats 2] [--smoke]
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
SKIP = 77

HF_RUNNER = r'''
import json, math, sys, time
import numpy as np, torch, torch.nn.functional as F
sys.path.insert(0, sys.argv[1])
import llama_ref
from transformers import AutoConfig, AutoModelForCausalLM
d, steps, seq, batch, threads = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
torch.set_num_threads(threads)
cfg = AutoConfig.from_pretrained(d)
model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", torch_dtype=torch.float32)
w = llama_ref.read_safetensors(d + "/init.safetensors")
model.load_state_dict({k: torch.from_numpy(v) for k, v in w.items()}, strict=True)
model.train()
named = dict(model.named_parameters())
opt = llama_ref.make_optimizer(named, 1e-3, 0.1, 0.9, 0.95, 1e-8)
tokens = llama_ref.load_tokens(d + "/data.bin")
out = []
for step in range(steps):
    t0 = time.perf_counter()
    inputs, targets = llama_ref.batch_at(tokens, step, seq, batch)
    opt.zero_grad(set_to_none=True)
    logits = model(input_ids=inputs, use_cache=False).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    opt.step()
    out.append({"loss": float(loss), "step_time_s": time.perf_counter() - t0})
print(json.dumps(out))
'''


def machine():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f", {os.cpu_count()} cores"
    except OSError:
        pass
    return "unknown CPU"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hspmd", required=True)
    ap.add_argument("--venv", default=os.path.join(ROOT, ".venv-oracle"))
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, 2 steps (the suite's smoke test)")
    args = ap.parse_args()
    if args.smoke:
        args.hidden, args.layers, args.experts, args.seq_len, args.batch = 64, 2, 4, 32, 2
        args.steps, args.warmup, args.repeats, args.threads = 2, 1, 1, 1
    py = os.path.join(args.venv, "bin", "python3")
    probe = subprocess.run([py, "-c", "import transformers, torch"], capture_output=True, text=True) \
        if os.access(py, os.X_OK) else None
    if probe is None or probe.returncode != 0:
        print(f"SKIPPED: no venv with torch and transformers at {args.venv} (bash scripts/setup_oracle_venv.sh)")
        sys.exit(SKIP)
    if args.steps <= args.warmup:
        sys.exit("--steps must exceed --warmup")
    tmp = tempfile.mkdtemp(prefix="hspmd_moe_bench_")
    h = args.hidden
    cfg = dict(model_type="mixtral", architectures=["MixtralForCausalLM"], vocab_size=1024, hidden_size=h,
               intermediate_size=2 * h, num_hidden_layers=args.layers, num_attention_heads=max(1, h // 64),
               num_key_value_heads=max(1, h // 128), max_position_embeddings=max(2048, args.seq_len),
               num_local_experts=args.experts, num_experts_per_tok=args.top_k, rms_norm_eps=1e-5,
               rope_theta=1e6, tie_word_embeddings=False, hidden_act="silu", output_router_logits=False,
               eos_token_id=2, bos_token_id=1, initializer_range=0.02, sliding_window=None,
               attention_dropout=0.0, torch_dtype="float32")
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f)
    # Initial weights from hspmd (one step at lr 1e-30: below f32 resolution), data.
    import random
    rng = random.Random(5)
    n = args.batch * args.seq_len * (args.steps + 1) + 1
    with open(os.path.join(tmp, "data.bin"), "wb") as f:
        f.write(b"".join(rng.randrange(1000).to_bytes(4, "little") for _ in range(n)))
    common = [args.hspmd, "train", "--model", os.path.join(tmp, "config.json"), "--data", os.path.join(tmp, "data.bin"),
              "--seq-len", str(args.seq_len), "--global-batch", str(args.batch), "--threads", str(args.threads),
              "--quiet", "--weight-decay", "0.1", "--beta2", "0.95", "--eps", "1e-8"]
    r = subprocess.run(common + ["--steps", "1", "--lr", "1e-30", "--save", os.path.join(tmp, "init.safetensors")],
                       capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"hspmd failed: {r.stderr}")
    results = {"hspmd": [], "hf": []}
    losses = {}
    for rep in range(args.repeats):
        log = os.path.join(tmp, f"h{rep}.jsonl")
        r = subprocess.run(common + ["--steps", str(args.steps), "--lr", "1e-3", "--init",
                                     os.path.join(tmp, "init.safetensors"), "--log", log],
                           capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"hspmd failed: {r.stderr}")
        recs = [json.loads(line) for line in open(log)]
        results["hspmd"] += [x["step_time_s"] for x in recs[args.warmup:]]
        losses["hspmd"] = [x["loss"] for x in recs]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), HF_HUB_OFFLINE="1")
        r = subprocess.run([py, "-c", HF_RUNNER, os.path.join(ROOT, "tests", "oracle"), tmp, str(args.steps),
                            str(args.seq_len), str(args.batch), str(args.threads)],
                           capture_output=True, text=True, env=env)
        if r.returncode:
            sys.exit(f"HF failed: {r.stderr[-2000:]}")
        recs = json.loads(r.stdout.strip().splitlines()[-1])
        results["hf"] += [x["step_time_s"] for x in recs[args.warmup:]]
        losses["hf"] = [x["loss"] for x in recs]
    tokens = args.batch * args.seq_len
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"machine: {machine()}; {args.threads} threads; Mixtral hidden {h}, {args.layers} layers, "
          f"{args.experts} experts top-{args.top_k}, seq {args.seq_len} x batch {args.batch} (f32)")
    for k, name in (("hspmd", "hspmd"), ("hf", "HF transformers (eager)")):
        print(f"  {name:26s} median step {med[k] * 1e3:9.1f} ms  {tokens / med[k]:9.0f} tokens/s  "
              f"({len(results[k])} steps)")
    print(f"  hspmd / HF step time: {med['hspmd'] / med['hf']:.3f}")
    print("  losses hspmd " + " ".join(f"{x:.5f}" for x in losses["hspmd"][:3]) +
          " | HF " + " ".join(f"{x:.5f}" for x in losses["hf"][:3]))
    print(json.dumps({"machine": machine(), "threads": args.threads, "hspmd_step_s": med["hspmd"],
                      "hf_step_s": med["hf"], "ratio": med["hspmd"] / med["hf"],
                      "losses": losses}))


if __name__ == "__main__":
    main()
