#!/usr/bin/python3
"""Oracle test: hspmd's mixture-of-experts families against Hugging Face's.

The reference is transformers' own MixtralForCausalLM and
Qwen2MoeForCausalLM (the pinned 4.47 of scripts/setup_oracle_venv.sh), eager
attention, float32, built from a config.json that transformers' config class
writes and hspmd reads. Weights are drawn here (numpy, seed per case; the
routers' weights large enough that no token sits near a tie between two
experts, where two correct implementations could route it differently) and
given to both. Five AdamW steps of hspmd's loss (each micro-batch's summed
token cross-entropy over the global batch's target count), plus, where the
config sets output_router_logits, router_aux_loss_coef times HF's own
load_balancing_loss_func over the router logits of the whole global batch
(every micro-batch's, concatenated): what hspmd computes (docs/moe.md).

Cases: configs this file writes, not ones hspmd was tuned on; expert counts
3-6, top-1/2/3, normalized and plain top-k weights, a shared expert, dense and
sparse layers mixed (decoder_sparse_step, mlp_only_layers), with and without
the auxiliary loss, one and two micro-batches.

Checks per case: every step's loss and gradient norm, every step-0 gradient,
the final weights; tolerances as hf_oracle_test.py's f32 variant (fixed levels
1e-5 / 1e-4 / 1e-4 / 1e-3, or twice how far HF f32 lands from HF float64).
Before comparing, the test proves it can fail: for each case, models a wrong
port would build (top-k one less, the other normalization, no auxiliary loss)
must differ from the right one's step 0 by at least
10x the tolerance.

Exit 77 (skipped) when the venv or transformers is missing.

usage: hf_moe_oracle_test.py --hspmd PATH [--venv DIR] [--case NAME] [--device cpu|cpu:1|cuda]
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

SKIP = 77
HERE = os.path.dirname(os.path.abspath(__file__))

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--hspmd", required=True)
ap.add_argument("--venv")
ap.add_argument("--case", help="run only this case")
ap.add_argument("--device", default="cpu")
ap.add_argument("--keep", help="keep the run's files in this directory")
ARGS = ap.parse_args()


def skip(why):
    print(f"SKIPPED: {why}", flush=True)
    sys.exit(SKIP)


venv = os.environ.get("HSPMD_ORACLE_VENV") or ARGS.venv
if venv and os.path.realpath(sys.prefix) != os.path.realpath(venv):
    py = os.path.join(os.path.abspath(venv), "bin", "python3")
    if not os.access(py, os.X_OK):
        skip(f"no oracle venv at {venv} (bash scripts/setup_oracle_venv.sh creates it; it needs PyPI)")
    if os.environ.get("HSPMD_HF_ORACLE_REEXEC"):
        sys.exit(f"{py} does not run inside {venv}")
    os.environ["HSPMD_HF_ORACLE_REEXEC"] = "1"
    os.execv(py, [py, os.path.abspath(__file__), *sys.argv[1:]])

os.environ.setdefault("HF_HUB_OFFLINE", "1")
try:
    import numpy as np
    import torch
    import torch.nn.functional as F
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
except ImportError as e:
    skip(f"torch or transformers is not importable by {sys.executable} ({e})")

sys.path.insert(0, HERE)
import llama_ref  # noqa: E402  (safetensors I/O, hspmd's sampling)

SEQ, BATCH, STEPS = 32, 4, 5
LR, WD, BETAS, EPS = 1e-2, 0.1, (0.9, 0.95), 1e-6
BASE = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, eos_token_id=256, bos_token_id=257,
            hidden_act="silu", initializer_range=0.02, attention_dropout=0.0, rms_norm_eps=1e-5,
            rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="float32")
CASES = {
    # Mixtral: top-2 of 4, renormalized; no auxiliary loss.
    "mixtral_top2": dict(cls="MixtralConfig", arch="MixtralForCausalLM", micro=1, router_std=0.6,
                         fields=dict(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                                     output_router_logits=False)),
    # Mixtral: top-1 of 3 with the auxiliary loss over two micro-batches.
    "mixtral_top1_aux": dict(cls="MixtralConfig", arch="MixtralForCausalLM", micro=2, router_std=0.6,
                             fields=dict(intermediate_size=80, num_local_experts=3, num_experts_per_tok=1,
                                         output_router_logits=True, router_aux_loss_coef=0.05,
                                         sliding_window=None)),
    # Qwen2-MoE: top-3 of 6 without renormalization, a shared expert, layer 1
    # dense (mlp_only_layers), the auxiliary loss, tied embeddings.
    "qwen2_moe_top3_aux": dict(cls="Qwen2MoeConfig", arch="Qwen2MoeForCausalLM", micro=2, router_std=0.25,
                               fields=dict(intermediate_size=112, moe_intermediate_size=48,
                                           shared_expert_intermediate_size=72, num_experts=6,
                                           num_experts_per_tok=3, norm_topk_prob=False,
                                           decoder_sparse_step=1, mlp_only_layers=[1],
                                           output_router_logits=True, router_aux_loss_coef=0.03,
                                           tie_word_embeddings=True, use_sliding_window=False)),
    # Qwen2-MoE: top-2 of 5, renormalized, only layer 1 sparse (decoder_sparse_step 2).
    "qwen2_moe_step2": dict(cls="Qwen2MoeConfig", arch="Qwen2MoeForCausalLM", micro=1, router_std=0.25,
                            fields=dict(intermediate_size=96, moe_intermediate_size=40,
                                        shared_expert_intermediate_size=56, num_experts=5,
                                        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=2,
                                        output_router_logits=False, use_sliding_window=False)),
}


def write_config(path, case, **override):
    spec = CASES[case]
    cfg = getattr(transformers, spec["cls"])(architectures=[spec["arch"]], **{**BASE, **spec["fields"], **override})
    cfg.to_json_file(path, use_diff=True)
    return path


def build(config_path):
    cfg = AutoConfig.from_pretrained(os.path.dirname(config_path))
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", torch_dtype=torch.float32)
    model.train()
    return model


def draw_weights(model, rng, router_std):
    out = {}
    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        if name.endswith("norm.weight"):
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            w = rng.standard_normal(shape)
        elif name.endswith(".gate.weight"):  # the routers: decisive enough that no token sits near a tie
            w = router_std * rng.standard_normal(shape)
        else:
            w = 0.08 * rng.standard_normal(shape)
        out[name] = w.astype(np.float32)
    return out


def load(model, weights):
    state = {k: torch.from_numpy(np.array(v, np.float32)) for k, v in weights.items()}
    r = model.load_state_dict(state, strict=False)
    allowed = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if set(r.missing_keys) - allowed or r.unexpected_keys:
        sys.exit(f"FAIL: HF load_state_dict: missing {r.missing_keys}, unexpected {r.unexpected_keys}")
    return model


def step_loss(model, inputs, targets, micro):
    """hspmd's loss over the global batch (plus the auxiliary loss over all of
    it, as one forward of the whole batch would compute it); backward once."""
    cfg = model.config
    aux_on = bool(cfg.output_router_logits) and cfg.router_aux_loss_coef != 0
    count = targets.numel()
    mb = inputs.shape[0] // micro
    loss, routers = 0, []
    for m in range(micro):
        rows = slice(m * mb, (m + 1) * mb)
        out = model(input_ids=inputs[rows], use_cache=False, output_router_logits=aux_on)
        logits = out.logits.to(model.lm_head.weight.dtype)
        loss = loss + F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets[rows].reshape(-1),
                                      reduction="sum") / count
        if aux_on:
            routers.append(out.router_logits)
    if aux_on:
        layers = tuple(torch.cat([r[i] for r in routers], 0) for i in range(len(routers[0])))
        experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
        loss = loss + cfg.router_aux_loss_coef * load_balancing_loss_func(layers, experts, cfg.num_experts_per_tok)
    loss.backward()
    return float(loss.detach())


def hf_train(config_path, weights, tokens, micro, prefix, dtype=torch.float32):
    model = load(build(config_path), weights).to(dtype)
    named = dict(model.named_parameters())
    opt = llama_ref.make_optimizer(named, LR, WD, BETAS[0], BETAS[1], EPS)
    log = []
    for step in range(STEPS):
        inputs, targets = llama_ref.batch_at(tokens, step, SEQ, BATCH)
        opt.zero_grad(set_to_none=True)
        loss = step_loss(model, inputs, targets, micro)
        norm = llama_ref.grad_norm(named)
        if step == 0:
            grads = {k: p.grad.detach().double().numpy().copy() for k, p in named.items()}
        opt.step()
        log.append(dict(loss=loss, grad_norm=norm))
    final = {k: p.detach().double().numpy().copy() for k, p in named.items()}
    return log, grads, final


def err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))


def worst(h, t):
    return max((err(h[n], t[n]), n) for n in t)


def wrong_configs(case, tmp):
    """(what, config path) of models a wrong port would build."""
    f = CASES[case]["fields"]
    out = []

    def variant(what, **override):
        d = os.path.join(tmp, "wrong-" + what.replace(" ", "_"))
        os.makedirs(d, exist_ok=True)
        out.append((what, write_config(os.path.join(d, "config.json"), case, **override)))

    if f["num_experts_per_tok"] > 1:
        variant("top-k one less", num_experts_per_tok=f["num_experts_per_tok"] - 1)
    if "norm_topk_prob" in f:
        variant("other normalization", norm_topk_prob=not f["norm_topk_prob"])
    if f.get("output_router_logits"):
        variant("no auxiliary loss", output_router_logits=False)
    return out


def run_case(case, tmp):
    spec = CASES[case]
    p = lambda n: os.path.join(tmp, n)  # noqa: E731
    config = write_config(p("config.json"), case)
    rng = np.random.default_rng(sum(map(ord, case)))
    weights = draw_weights(build(config), rng, spec["router_std"])
    # Learnable data (each token mostly decides the next: the loss falls in 5
    # steps) over 64 ids, each seen often: no embedding row hangs on one or
    # two tiny gradients, which AdamW's first steps turn into full-size
    # updates in either implementation's rounding.
    tokens = np.zeros(BATCH * SEQ * (STEPS + 1) + 1, np.uint32)
    noise = rng.integers(0, 3, size=tokens.size)
    for i in range(1, tokens.size):
        tokens[i] = (tokens[i - 1] * 7 + 3 + noise[i]) % 64
    tokens.tofile(p("data.bin"))
    tokens = llama_ref.load_tokens(p("data.bin"))
    llama_ref.write_safetensors(p("init.safetensors"), weights)

    t_log, t_grads, t_final = hf_train(config, weights, tokens, spec["micro"], p("t"))
    e_log, e_grads, e_final = hf_train(config, weights, tokens, spec["micro"], p("e"), torch.float64)
    if ARGS.keep:
        for name, arrays in (("t_final", t_final), ("e_final", e_final), ("t_grads", t_grads), ("e_grads", e_grads)):
            llama_ref.write_safetensors(p(name + ".safetensors"), arrays)
    noise = dict(loss0=abs(e_log[0]["loss"] - t_log[0]["loss"]) / abs(t_log[0]["loss"]),
                 loss=max(max(abs(a[k] - b[k]) / abs(b[k]) for k in ("loss", "grad_norm"))
                          for a, b in zip(e_log, t_log)),
                 grads=worst(e_grads, t_grads)[0], final=worst(e_final, t_final)[0])
    tol = {k: max(v, 2 * noise[k]) for k, v in dict(loss0=1e-5, loss=1e-4, grads=1e-4, final=1e-3).items()}
    print(f"[{case}] tolerances: " + ", ".join(f"{k} {v:.2e}" for k, v in tol.items()))

    # The reference can fail: wrong models differ at step 0 by >= 10x the tolerance.
    inputs, targets = llama_ref.batch_at(tokens, 0, SEQ, BATCH)
    for what, cfg in wrong_configs(case, p("")):
        model = load(build(cfg), weights)
        loss = step_loss(model, inputs, targets, spec["micro"])
        grads = {k: v.grad.detach().double().numpy() for k, v in model.named_parameters()}
        margin = max(abs(loss - t_log[0]["loss"]) / abs(t_log[0]["loss"]) / tol["loss0"],
                     worst(grads, t_grads)[0] / tol["grads"])
        print(f"[{case}] wrong model ({what}): {margin:.0f}x the tolerance")
        if margin < 10:
            sys.exit(f"FAIL: [{case}] the test could not tell '{what}' from the right model")

    cmd = [ARGS.hspmd, "train", "--model", config, "--data", p("data.bin"), "--init", p("init.safetensors"),
           "--threads", "1", "--seq-len", str(SEQ), "--global-batch", str(BATCH), "--steps", str(STEPS),
           "--micro-batches", str(spec["micro"]), "--lr", str(LR), "--weight-decay", str(WD),
           "--beta1", str(BETAS[0]), "--beta2", str(BETAS[1]), "--eps", str(EPS), "--device", ARGS.device,
           "--quiet", "--log", p("h.jsonl"), "--dump-grads", p("h_grads.safetensors"),
           "--save", p("h_final.safetensors")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"FAIL: [{case}] {' '.join(cmd)}\n{r.stdout}{r.stderr}")
    h_log = [json.loads(line) for line in open(p("h.jsonl"))]
    failures = []
    if len(h_log) != STEPS:
        failures.append(f"{len(h_log)} logged steps, not {STEPS}")
    for s, (a, b) in enumerate(zip(h_log, t_log)):
        rel = abs(a["loss"] - b["loss"]) / abs(b["loss"])
        nrel = abs(a["grad_norm"] - b["grad_norm"]) / abs(b["grad_norm"])
        print(f"[{case}] step {s} loss hspmd {a['loss']:.8f} HF {b['loss']:.8f} rel {rel:.2e}; "
              f"grad norm rel {nrel:.2e}")
        if rel > (tol["loss0"] if s == 0 else tol["loss"]):
            failures.append(f"step {s} loss differs by {rel:.2e}")
        if nrel > tol["loss"]:
            failures.append(f"step {s} gradient norm differs by {nrel:.2e}")
    for what, ref in (("grads", t_grads), ("final", t_final)):
        h = llama_ref.read_safetensors(p(f"h_{what}.safetensors"))
        if sorted(h) != sorted(ref):
            failures.append(f"{what}: tensor names differ: {sorted(set(h) ^ set(ref))}")
            continue
        e, n = worst(h, ref)
        print(f"[{case}] {what}: worst normalized error {e:.2e} ({n})")
        if e > tol[what]:
            failures.append(f"{what}: {n} differs by {e:.2e} (> {tol[what]:.2e})")
    if h_log and h_log[-1]["loss"] >= h_log[0]["loss"]:
        failures.append(f"loss did not decrease over {STEPS} steps")
    if failures:
        sys.exit(f"FAIL: [{case}] " + "; ".join(failures))
    print(f"[{case}] PASS")


def main():
    torch.set_num_threads(1)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    note = llama_ref.follow_onednn_cap()
    if note:
        print(note)
    transformers.logging.set_verbosity_error()
    cases = [ARGS.case] if ARGS.case else list(CASES)
    for case in cases:
        with tempfile.TemporaryDirectory() as tmp:
            if ARGS.keep:
                tmp = os.path.join(os.path.abspath(ARGS.keep), case)
                os.makedirs(tmp, exist_ok=True)
            run_case(case, tmp)
    print("PASS")


if __name__ == "__main__":
    main()
