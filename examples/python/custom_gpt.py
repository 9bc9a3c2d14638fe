#!/usr/bin/env python3
"""A GPT-style model of one's own, written from one device's point of view
with hspmd.models.Builder and trained with hspmd.Trainer: a learned position
table (a parameter), pre-norm blocks with RMSNorm, multi-head causal
attention with q and v biases, a SwiGLU MLP, a tied or untied LM head. No
family of hspmd defines it: the program is the model (docs/python.md,
"Custom models").

    PYTHONPATH=build/python python3 examples/python/custom_gpt.py --data tokens.bin
    PYTHONPATH=build/python mpirun -np 2 python3 examples/python/custom_gpt.py --data tokens.bin \\
        --strategy '{"pipelines": [{"micro_batch_size": 4, "micro_batches": 1, "stages": [{"ranks": [0, 1], "layers": [0, 1]}]}]}'

tokens.bin: uint32 token ids below --vocab (e.g. `hspmd tokenize` output for a
matching vocabulary). Layouts are given only at the marked Reshard points;
deduction derives the rest, so the same program runs under any strategy."""
import argparse
import json

import numpy

import hspmd


def gpt(vocab=64, hidden=32, heads=4, ffn=48, layers=2, max_positions=64, tied=False, eps=1e-5):
    """The Builder of the model; parameter names follow GPT-2's where they can."""
    D = hidden // heads
    b = hspmd.models.Builder(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_layers=layers,
                             num_attention_heads=heads, max_position_embeddings=max_positions,
                             tie_word_embeddings=False)
    wte = b.parameter("transformer.wte.weight", ["vocab", hidden], role="vocabulary", part="embedding")
    wpe = b.parameter("transformer.wpe.weight", [max_positions, hidden], part="embedding")
    with b.embedding() as e:
        # The token embedding is vocabulary-parallel (partial sums under TP),
        # the position rows are whole: both become the sequence-split
        # residual stream at their marks before they are added.
        tok = e.mark(e.embedding(wte, e.input_ids), "embedding_output", "transformer.wte.out")
        pos = e.mark(e.positions, "positions", "transformer.wpe.positions")
        pe = e.mark(e.embedding(wpe, pos), "embedding_output", "transformer.wpe.out")
        e.output(tok + pe)

    L = "transformer.h.{i}."
    with b.block() as blk:
        ln_1 = blk.parameter(L + "ln_1.weight", [hidden], init="ones")
        proj = {n: blk.parameter(L + f"attn.{n}_proj.weight", [hidden, hidden], role="column") for n in "qkv"}
        # Biases on q and v: a k bias shifts every score of a query alike, so
        # softmax ignores it (its gradient is zero up to rounding).
        bias = {n: blk.parameter(L + f"attn.{n}_proj.bias", [hidden], role="column", init="zeros") for n in "qv"}
        c_proj = blk.parameter(L + "attn.c_proj.weight", [hidden, hidden], role="row")
        ln_2 = blk.parameter(L + "ln_2.weight", [hidden], init="ones")
        gate = blk.parameter(L + "mlp.gate.weight", [ffn, hidden], role="column")
        up = blk.parameter(L + "mlp.up.weight", [ffn, hidden], role="column")
        down = blk.parameter(L + "mlp.down.weight", [hidden, ffn], role="row")

        x = blk.mark(blk.input, "block_input", L + "input")
        pos = blk.mark(blk.positions, "positions", L + "positions")
        n = blk.mark(blk.rms_norm(x, ln_1, eps=eps), "sublayer_input", L + "attn_input")
        qkv = {c: blk.linear(n, proj[c]) for c in "qkv"}
        qkv = {c: (blk.add_bias(t, bias[c]) if c in bias else t).reshape("B", "S", heads, D) for c, t in qkv.items()}
        a = blk.attention(qkv["q"], qkv["k"], qkv["v"], documents=pos).reshape("B", "S", hidden)
        h = x + blk.mark(blk.linear(a, c_proj), "sublayer_output", L + "attn_output")
        n = blk.mark(blk.rms_norm(h, ln_2, eps=eps), "sublayer_input", L + "mlp_input")
        m = blk.linear(blk.swiglu(blk.linear(n, gate), blk.linear(n, up)), down)
        blk.output(h + blk.mark(m, "sublayer_output", L + "mlp_output"))

    with b.head() as hd:
        ln_f = hd.parameter("transformer.ln_f.weight", [hidden], init="ones")
        n = hd.mark(hd.rms_norm(hd.input, ln_f, eps=eps), "head_input", "lm_head.input")
        if tied:
            w = hd.mark(wte, "tied_head", "lm_head.tied")
        else:
            w = hd.parameter("lm_head.weight", ["vocab", hidden], role="vocabulary")
        hd.output(hd.cross_entropy(hd.linear(n, w), hd.targets, hd.normalizer))
    return b


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--strategy", help="strategy JSON (text or file); none: one process")
    ap.add_argument("--tied", action="store_true")
    ap.add_argument("--init", help="initial weights (safetensors, the model's names)")
    ap.add_argument("--global-batch", type=int, default=4, help="without --strategy")
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--records", help="write the step records here (JSON list, rank 0)")
    ap.add_argument("--weights", help="write the final weights here (numpy .npz, rank 0)")
    a = ap.parse_args()

    model = gpt(tied=a.tied).build()
    strategy = hspmd.Strategy.from_json(a.strategy) if a.strategy else None
    batch = {} if strategy else {"global_batch": a.global_batch, "micro_batches": 1}
    trainer = hspmd.Trainer(model, strategy, a.data, seq_len=a.seq_len, steps=a.steps, lr=a.lr,
                            weight_decay=0.1, seed=0, threads=1, **batch,
                            **({"init": a.init} if a.init else {}))
    records = [trainer.step() for _ in range(a.steps)]
    weights = trainer.state_dict()
    trainer.finish()
    if trainer.rank == 0:
        for r in records:
            print(f"step {r['step']}: loss {r['loss']:.6f}")
        if a.records:
            with open(a.records, "w") as f:
                json.dump(records, f)
        if a.weights:
            numpy.savez(a.weights, **weights)


if __name__ == "__main__":
    main()
