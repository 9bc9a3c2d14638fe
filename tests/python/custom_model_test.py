"""A model defined in Python (examples/python/custom_gpt.py: hspmd.models.Builder,
not a registered family) trained by hspmd.Trainer against a PyTorch
reference written here: same initial weights (safetensors), same token
batches, AdamW steps. One process: every step's loss within 1e-5 relative,
the final weights within 1e-4 (tied and untied head). With --mpirun: a TP 2
plan and a PP 2 plan (1F1B, two micro-batches) on 2 MPI ranks equal the
one-process run to the same tolerances.

usage: custom_model_test.py [--mpirun PATH]"""
import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile

import numpy
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "python", "custom_gpt.py")
sys.path.insert(0, os.path.dirname(EXAMPLE))
import custom_gpt  # noqa: E402

VOCAB, HIDDEN, HEADS, FFN, LAYERS, POSITIONS, EPS = 64, 32, 4, 48, 2, 64, 1e-5
SEQ, BATCH, STEPS, LR, DECAY = 16, 4, 4, 1e-3, 0.1
TP2 = {"pipelines": [{"micro_batch_size": 4, "micro_batches": 1, "stages": [{"ranks": [0, 1], "layers": [0, 1]}]}]}
PP2 = {"schedule": "1f1b", "pipelines": [{"micro_batch_size": 2, "micro_batches": 2, "stages": [
    {"ranks": [0], "layers": [0, 0]}, {"ranks": [1], "layers": [1, 1]}]}]}


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        raw = numpy.ascontiguousarray(tensors[name], dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def initial_weights(model, rng):
    """Random weights for every parameter: norms near 1, biases non-zero."""
    out = {}
    for name, shape, _ in model.parameters():
        w = rng.standard_normal(shape).astype(numpy.float32)
        out[name] = (1 + 0.1 * w) if "ln_" in name else 0.1 * w
    return out


# ---- the PyTorch reference ----

def rms_norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def reference_loss(p, ids, targets, tied):
    B, S = ids.shape
    D = HIDDEN // HEADS
    h = p["transformer.wte.weight"][ids] + p["transformer.wpe.weight"][torch.arange(S)][None]
    mask = torch.ones(S, S, dtype=torch.bool).tril()
    for i in range(LAYERS):
        L = f"transformer.h.{i}."
        n = rms_norm(h, p[L + "ln_1.weight"])
        q, k, v = (torch.nn.functional.linear(n, p[L + f"attn.{c}_proj.weight"], p.get(L + f"attn.{c}_proj.bias"))
                   .view(B, S, HEADS, D).transpose(1, 2) for c in "qkv")
        scores = (q @ k.transpose(-1, -2)) / D ** 0.5
        a = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v
        h = h + a.transpose(1, 2).reshape(B, S, HIDDEN) @ p[L + "attn.c_proj.weight"].T
        n = rms_norm(h, p[L + "ln_2.weight"])
        m = torch.nn.functional.silu(n @ p[L + "mlp.gate.weight"].T) * (n @ p[L + "mlp.up.weight"].T)
        h = h + m @ p[L + "mlp.down.weight"].T
    head = p["transformer.wte.weight"] if tied else p["lm_head.weight"]
    logits = rms_norm(h, p["transformer.ln_f.weight"]) @ head.T
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def reference_train(weights, tokens, tied):
    p = {k: torch.tensor(v, requires_grad=True) for k, v in weights.items()}
    groups = [{"params": [t for t in p.values() if t.dim() >= 2], "weight_decay": DECAY},
              {"params": [t for t in p.values() if t.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8)
    samples = (len(tokens) - 1) // SEQ
    losses = []
    for step in range(STEPS):
        rows = [tokens[(j % samples) * SEQ:(j % samples) * SEQ + SEQ + 1] for j in range(step * BATCH, step * BATCH + BATCH)]
        batch = torch.from_numpy(numpy.stack(rows).astype(numpy.int64))
        opt.zero_grad()
        loss = reference_loss(p, batch[:, :-1], batch[:, 1:], tied)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().numpy() for k, v in p.items()}


# ---- hspmd ----

def run_example(d, tag, weights_path, data, tied, strategy=None, mpirun=None):
    records, out = os.path.join(d, tag + ".json"), os.path.join(d, tag + ".npz")
    cmd = [sys.executable, EXAMPLE, "--data", data, "--init", weights_path, "--records", records, "--weights", out,
           "--seq-len", str(SEQ), "--steps", str(STEPS), "--lr", str(LR), "--global-batch", str(BATCH)]
    cmd += ["--tied"] if tied else []
    if strategy is not None:
        cmd = [mpirun, "--oversubscribe", "--allow-run-as-root", "-np", "2", "-x", "PYTHONPATH"] + cmd
        cmd += ["--strategy", json.dumps(strategy)]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    with open(records) as f:
        losses = [r["loss"] for r in json.load(f)]
    weights = numpy.load(out)
    return losses, {k: weights[k] for k in weights.files}


def compare(what, losses, weights, want_losses, want_weights):
    assert len(losses) == len(want_losses) == STEPS, (what, losses)
    for step, (got, want) in enumerate(zip(losses, want_losses)):
        assert abs(got - want) <= 1e-5 * abs(want), f"{what}: step {step} loss {got!r}, want {want!r}"
    assert sorted(weights) == sorted(want_weights), f"{what}: names {sorted(weights)} vs {sorted(want_weights)}"
    for name, want in want_weights.items():
        err = float(numpy.abs(weights[name] - want).max())
        assert err <= 1e-4, f"{what}: {name} differs by {err:.3g} (> 1e-4)"
    print(f"ok: {what}: {STEPS} losses within 1e-5 relative, {len(weights)} weights within 1e-4")


def check_api():
    """The model goes where a from_hf model goes; a bad program is one hspmd.Error naming the op."""
    import hspmd
    model = custom_gpt.gpt().build()
    assert model.model_type == "hspmd_custom", model
    plan = hspmd.compile_plan(model, TP2, 2, seq_len=SEQ)
    assert str(plan.tensors["transformer.h.0.attn.q_proj.weight"]).startswith("hdim -1: [0,1] {split(0):2}")
    assert "transformer.wpe.out  [forward] local_slice" in plan.explain(rank=0)
    cost = hspmd.plan_cost(model, TP2, os.path.join(ROOT, "examples", "clusters", "24h20.json"), seq_len=SEQ)
    assert cost, cost
    b = custom_gpt.gpt()
    b._parts["block"]._ops[8]["shape"] = ["B", "S", 5, 8]  # a reshape that cannot hold its input
    try:
        b.build()
        raise AssertionError("a bad program was accepted")
    except hspmd.Error as e:
        message = str(e)
    assert "program: block op 8 (reshape -> " in message and "of layer 0" in message, message
    print("ok: compile_plan, explain and plan_cost take the custom model; a bad reshape:", message)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mpirun", help="also check TP 2 and PP 2 on 2 MPI ranks")
    a = ap.parse_args()
    check_api()
    rng = numpy.random.default_rng(5)
    with tempfile.TemporaryDirectory() as d:
        data = os.path.join(d, "tokens.bin")
        tokens = rng.integers(0, VOCAB, size=40 * SEQ + 1).astype("<u4")
        tokens.tofile(data)
        for tied in (False, True):
            model = custom_gpt.gpt(VOCAB, HIDDEN, HEADS, FFN, LAYERS, POSITIONS, tied=tied, eps=EPS).build()
            weights = initial_weights(model, rng)
            init = os.path.join(d, f"init_{tied}.safetensors")
            write_safetensors(init, weights)
            ref_losses, ref_weights = reference_train(weights, tokens, tied)
            tag = "tied" if tied else "untied"
            one = run_example(d, "one_" + tag, init, data, tied)
            compare(f"one process ({tag}) vs PyTorch", *one, ref_losses, ref_weights)
            if a.mpirun and not tied:
                for name, strategy in (("TP 2", TP2), ("PP 2", PP2)):
                    compare(f"{name} on 2 ranks ({tag}) vs one process",
                            *run_example(d, name.replace(" ", ""), init, data, tied, strategy, a.mpirun), *one)


if __name__ == "__main__":
    main()
