#!/usr/bin/env python3
"""Oracle test: hspmd against an independent PyTorch Llama (llama_ref.py).

Same config, same safetensors weights, same token file and sampling. Checks
the step-0 loss (1e-5 relative), every step-0 parameter gradient (1e-4,
max error normalized by the tensor's max magnitude), the losses of all steps
after AdamW updates (1e-4 relative) and the final weights (1e-3 normalized).

`packed` trains with --pack-documents on variable-length documents; the
reference packs them itself (docs/data.md) and runs each document piece on
its own, so it shares neither hspmd's packing nor its position-based
attention mask, padding or micro-batch widths. It also checks the logged
real-token counts.

`autocast` trains hspmd with --precision bf16 against the reference under
torch.autocast("cpu", torch.bfloat16) (tied embeddings, two micro-batches):
bf16-level tolerances, step-0 loss 1e-2 and every step's loss 2e-2 relative;
the step-0 gradients at 5e-2. The final weights: Adam turns tiny gradient
differences into full-size updates whose signs are rounding noise, so no
single element is compared; the updates (w_final - w_init) as a whole are,
against full-f32 PyTorch's: ||dh - df|| / ||df|| must stay within twice
what autocast's own updates give (both round differently: autocast keeps
bf16 outputs of every matmul, hspmd f32 ones), at least 5e-2 and at most
0.5 (a missing update gives 1).

usage: oracle_test.py --hspmd PATH [--variant base|tied|bf16|packed|autocast]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import llama_ref  # noqa: E402

CONFIG = {
    "vocab_size": 300, "hidden_size": 64, "intermediate_size": 176,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
    "tie_word_embeddings": False, "eos_token_id": 256,
}


def param_shapes(c):
    h, d = c["hidden_size"], c["hidden_size"] // c["num_attention_heads"]
    q, kv, f = c["num_attention_heads"] * d, c["num_key_value_heads"] * d, c["intermediate_size"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f), p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,)})
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (c["vocab_size"], h)
    return shapes


def normalized_error(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(np.abs(b).max(), 1e-12)
    return float(np.abs(a - b).max() / scale)


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"command failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return r


def packed_documents_data(rng, eos, seq_len, batch, steps):
    """Documents of 1 .. 2.5 x seq_len tokens (ids 0..255, each ending with eos),
    including a lone eos, documents of exactly seq_len and 2 x seq_len tokens and a
    last one without eos; few enough that the steps wrap around the packed samples."""
    long_docs = rng.integers(1, int(2.5 * seq_len) + 1, size=5)
    short_docs = rng.integers(1, seq_len // 2 + 1, size=10)  # so that samples hold several
    lengths = [int(n) for n in rng.permutation(np.concatenate([long_docs, short_docs]))]
    lengths[3:3] = [1, seq_len, 2 * seq_len, seq_len + 1]
    docs = [np.append(rng.integers(0, 256, size=n - 1), eos) for n in lengths]
    docs.append(rng.integers(0, 256, size=5))  # tokens after the last eos
    tokens = np.concatenate(docs).astype(np.uint32)
    samples = llama_ref.pack_documents(tokens, seq_len, eos)
    pieces = sum(len(s) for s in samples)
    print(f"packed data: {tokens.size} tokens, {len(lengths) + 1} documents, {pieces} pieces, "
          f"{len(samples)} samples of {[sum(len(x) for x in s) for s in samples]} tokens")
    assert len(samples) < batch * steps, "the steps should wrap around the packed samples"
    assert sum(len(s) > 1 for s in samples) >= 3, "samples should hold several pieces"
    return tokens


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", required=True)
    ap.add_argument("--variant", default="base", choices=["base", "tied", "bf16", "packed", "autocast"])
    args = ap.parse_args()

    cfg = dict(CONFIG)
    train = ["--seq-len", "32", "--global-batch", "4", "--steps", "5", "--lr", "1e-2",
             "--weight-decay", "0.1", "--beta1", "0.9", "--beta2", "0.95", "--eps", "1e-6"]
    if args.variant == "tied":
        cfg["tie_word_embeddings"] = True
        train += ["--micro-batches", "2", "--clip-grad", "0.5"]
    if args.variant == "packed":
        train += ["--pack-documents", "--micro-batches", "2"]
    autocast = args.variant == "autocast"
    if autocast:
        cfg["tie_word_embeddings"] = True
        train += ["--micro-batches", "2"]
    # (step-0 loss, later losses, step-0 gradients, final weights)
    tols = (1e-2, 2e-2, 5e-2, 5e-2) if autocast else (1e-5, 1e-4, 1e-4, 1e-3)

    rng = np.random.default_rng(1234)
    weights = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith("norm.weight"):
            weights[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            weights[name] = (0.08 * rng.standard_normal(shape)).astype(np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        p = lambda n: os.path.join(tmp, n)  # noqa: E731
        with open(p("config.json"), "w") as f:
            json.dump(cfg, f)
        if args.variant == "packed":
            tokens = packed_documents_data(rng, cfg["eos_token_id"], seq_len=32, batch=4, steps=5)
        else:
            # Text-like data: mostly bytes, with EOS separators.
            tokens = rng.integers(0, 256, size=4 * 32 * 6 + 1).astype(np.uint32)
            tokens[rng.integers(0, tokens.size, size=20)] = cfg["eos_token_id"]
        tokens.tofile(p("data.bin"))
        llama_ref.save_safetensors(p("init.safetensors"), weights,
                                   dtype="BF16" if args.variant == "bf16" else "F32")

        common = ["--model", p("config.json"), "--data", p("data.bin"),
                  "--init", p("init.safetensors"), "--threads", "1"] + train
        run([args.hspmd, "train", *common, *(["--precision", "bf16"] if autocast else []),
             "--quiet", "--log", p("h.jsonl"),
             "--dump-grads", p("h_grads.safetensors"), "--save", p("h_final.safetensors")])
        ref = run([sys.executable, os.path.join(HERE, "llama_ref.py"), *common,
                   *(["--autocast"] if autocast else []), "--log", p("t.jsonl"),
                   "--dump-grads", p("t_grads.safetensors"), "--save", p("t_final.safetensors")])
        if ref.stderr.strip():
            print(ref.stderr.strip())  # what the reference's bf16 GEMMs are (llama_ref.py)

        if autocast:  # how far full f32 lands from autocast: the scale of bf16's own noise
            run([sys.executable, os.path.join(HERE, "llama_ref.py"), *common,
                 "--dump-grads", p("f_grads.safetensors"), "--save", p("f_final.safetensors")])
        h_loss = [json.loads(l)["loss"] for l in open(p("h.jsonl"))]
        t_loss = [json.loads(l)["loss"] for l in open(p("t.jsonl"))]
        failures = []
        if len(h_loss) != 5 or len(t_loss) != 5:
            failures.append(f"expected 5 logged steps, got {len(h_loss)} and {len(t_loss)}")
        rel0 = abs(h_loss[0] - t_loss[0]) / abs(t_loss[0])
        print(f"step-0 loss hspmd {h_loss[0]:.8f} torch {t_loss[0]:.8f} rel {rel0:.2e}")
        if rel0 > tols[0]:
            failures.append(f"step-0 loss differs by {rel0:.2e} (> {tols[0]})")
        for s, (a, b) in enumerate(zip(h_loss, t_loss)):
            rel = abs(a - b) / abs(b)
            print(f"step {s} loss hspmd {a:.8f} torch {b:.8f} rel {rel:.2e}")
            if rel > tols[1]:
                failures.append(f"step {s} loss differs by {rel:.2e} (> {tols[1]})")
        # Final weights: Adam divides by sqrt(v) + eps, so elements with tiny gradients
        # amplify f32 rounding; 1e-3 is what float32 vs float64 torch itself reaches
        # (packed: torch f32 vs f64 ~1.0e-3 on embed_tokens, hspmd vs torch f32 ~5e-4).
        for what, tol in (("grads", tols[2]), ("final", tols[3])):
            h = llama_ref.load_safetensors(p(f"h_{what}.safetensors"))
            t = llama_ref.load_safetensors(p(f"t_{what}.safetensors"))
            if sorted(h) != sorted(t):
                failures.append(f"{what}: tensor names differ: {sorted(set(h) ^ set(t))}")
                continue
            worst = max((normalized_error(h[n], t[n]), n) for n in t)
            print(f"{what}: worst normalized error {worst[0]:.2e} ({worst[1]})")
            if autocast and what == "final":
                # Adam moves elements with tiny gradients by a full step whose sign
                # is rounding noise, so an element's final value says little; the
                # updates as a whole do: w_final - w_init against the f32 run's,
                # ||dh - df|| / ||df|| over every tensor (a missing update gives 1).
                f = llama_ref.load_safetensors(p("f_final.safetensors"))
                w0 = weights if not cfg["tie_word_embeddings"] else {n: weights[n] for n in t}
                def update_error(x):
                    num = sum(float(np.sum((np.asarray(x[n], np.float64) - np.asarray(f[n], np.float64)) ** 2))
                              for n in t)
                    den = sum(float(np.sum((np.asarray(f[n], np.float64) - np.asarray(w0[n], np.float64)) ** 2))
                              for n in t)
                    return (num / den) ** 0.5
                mine, theirs = update_error(h), update_error(t)
                # Both are bf16 approximations of the f32 run: hspmd may differ from it
                # by up to twice what autocast does, and never by half the update.
                limit = min(0.5, max(0.05, 2 * theirs))
                print(f"final: updates vs the f32 run: hspmd {mine:.3e}, torch autocast {theirs:.3e} "
                      f"(limit {limit:.3e})")
                if mine > limit:
                    failures.append(f"final: the updates differ from the f32 run's by {mine:.2e} (> {limit:.2e})")
                continue
            if autocast:
                f = llama_ref.load_safetensors(p(f"f_{what}.safetensors"))
                noise = max((normalized_error(f[n], t[n]), n) for n in t)
                print(f"{what}: torch f32 vs torch autocast: worst {noise[0]:.2e} ({noise[1]})")
                tol = max(tol, 1.5 * noise[0])
            if worst[0] > tol:
                failures.append(f"{what}: {worst[1]} differs by {worst[0]:.2e} (> {tol})")
        if args.variant == "packed":
            h_tok = [json.loads(l)["tokens"] for l in open(p("h.jsonl"))]
            t_tok = [json.loads(l)["tokens"] for l in open(p("t.jsonl"))]
            print(f"real tokens per step: hspmd {h_tok} torch {t_tok}")
            if h_tok != t_tok:
                failures.append(f"logged tokens differ: hspmd {h_tok}, torch {t_tok}")
        if h_loss[-1] >= h_loss[0]:
            failures.append("loss did not decrease over 5 steps")
        if failures:
            sys.exit("FAIL: " + "; ".join(failures))
        print("PASS")


if __name__ == "__main__":
    main()
