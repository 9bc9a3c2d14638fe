#!/usr/bin/python3
"""Oracle test: hspmd against Hugging Face transformers' own model classes.

The reference is `AutoModelForCausalLM.from_config(config)` of the pinned
transformers (scripts/setup_oracle_venv.sh: LlamaForCausalLM,
Qwen2ForCausalLM, MistralForCausalLM), eager attention, float32. The
config.json is written by transformers' own config class (`to_json_file`,
as `save_pretrained` writes it: `architectures`, `model_type` and every
field of the class), and hspmd reads that same file. The weights are drawn
here (numpy, seed 1234; non-zero random q/k/v biases for qwen2) and written
as one safetensors file that hspmd takes with --init and the HF model with
`load_state_dict` (every parameter must load: the result is independent of
torch's RNG). Data, sampling and checks are those of oracle_test.py: sample
i of a step is tokens[i*L : i*L+L+1] (llama_ref.batch_at), step-0 loss,
every step-0 gradient (--dump-grads, before clipping), every step's loss and
gradient norm, the final weights (--save).

The loss is hspmd's (docs/training.md), computed by hand from HF's logits:
the sum of the token cross-entropies of each micro-batch divided by the
number of target tokens of the global batch, backward per micro-batch, so
the accumulated gradient is that of the global mean. (HF's `labels=`
argument is not used: it shifts inside the L input tokens, so it would drop
each sample's last target, and it averages per call.) The optimizer is
torch.optim.AdamW with weight decay on tensors of >= 2 dims only (matrices:
embeddings, projections, LM head; not norm weights nor the qwen2 biases),
hspmd's learning-rate schedule (llama_ref.lr_at) and
torch.nn.utils.clip_grad_norm_ on the global norm.

Families (--family):
  llama    the tiny Llama of oracle_test.py, untied, with 2 micro-batches,
           clipping at 0.5 and a warmup + cosine schedule. Passes against
           the current hspmd: it proves the harness.
  qwen2    model_type qwen2: q/k/v biases, tied embeddings, rope_theta 1e6,
           rms_norm_eps 1e-6, 2 micro-batches. `use_sliding_window: false`
           with `sliding_window: 8` in the file (numbers as in the Hub's
           Qwen2 configs): Qwen2Config then has no window at all.
  mistral  model_type mistral, sliding_window 8 at sequence length 32:
           query i sees keys i - 8 < j <= i.

--variant f32 (default): each check's tolerance is the larger of oracle_test.py's
f32 level (step-0 loss 1e-5 relative, later losses and gradient norms 1e-4,
step-0 gradients 1e-4, final weights 1e-3, as max error over the tensor's
max magnitude) and 2x how far this run's HF f32 lands from the same HF
training in float64: two f32 implementations that each land that far from
exact arithmetic are at most twice that apart. (Adam turns tiny gradient
differences of rarely seen embedding rows into full-size updates: with the
sliding window, f32 vs f64 reaches about 1.2e-3 on the final weights.)

--variant bf16: `hspmd train --precision bf16` against the HF model under
torch.autocast("cpu", torch.bfloat16), as oracle_test.py's autocast variant:
each check's tolerance is the larger of a bf16 level (u = 2^-8, bf16's unit
roundoff: losses 2.5u and 5u, gradients and weights 13u, oracle_test.py's
1e-2, 2e-2, 5e-2) and 1.5 x how far this run's full-f32 HF lands from HF
autocast (the size of bf16's own noise on this model and data, measured,
not assumed from one machine; autocast's GEMMs sum in f32 on every CPU,
llama_ref.autocast_gemms_sum_in_f32, so that noise is bf16's rounding and
not torch 1.13's bf16 sums on a CPU without AVX-512). Where hspmd's attention backward read O
rounded to bf16 (its step records' attention_rounds_output: cuDNN on a GPU,
HSPMD_ATTENTION_IO=bf16 anywhere), the step-0 gradients and final weights
are checked per tensor, each against at least 2x how far HF autocast
lands when its attention's backward forms softmax's row sums from the
stored bf16 O as a fused attention does (FusedAttentionBackward): that
rounding moves the gradients that flow through the scores (q_proj and
k_proj; in Qwen2's last layer by 7-26% of their size, the key bias's the
most), which HF's own backward cancels.

Before it compares, the test proves that it can fail: (1) a perturbation scan
over a one-layer copy of the model checks which positions each input token
reaches (causal; for mistral exactly i - W < j <= i), and (2) for each wrong
model a port might build (mistral: window W-1, W+1, none; qwen2: each bias
zeroed, rope_theta 1e4, the window of the file applied) the HF step-0 loss or
gradients must differ from the right model's by at least 10x this variant's
tolerance (per tensor where the tolerances are per tensor).

Exit status 77 (CTest SKIP_RETURN_CODE) with one line saying why when the
reference cannot run: no venv with transformers (run
scripts/setup_oracle_venv.sh; it needs PyPI), or hspmd refuses the family
with exactly its "[config] ...: model_type '<family>' is not supported"
message (the family is not built yet). Any other failure fails.

usage: hf_oracle_test.py --hspmd PATH --family llama|qwen2|mistral
                         [--variant f32|bf16] [--venv DIR]
"""
import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile

SKIP = 77
HERE = os.path.dirname(os.path.abspath(__file__))


def skip(why):
    print(f"SKIPPED: {why}", flush=True)
    sys.exit(SKIP)


def enter_venv(venv):
    """Re-executes this script with the venv's python unless it already runs there."""
    if not venv:
        return
    venv = os.path.abspath(venv)
    if os.path.realpath(sys.prefix) == os.path.realpath(venv):
        return
    py = os.path.join(venv, "bin", "python3")
    if not os.access(py, os.X_OK):
        skip(f"no oracle venv at {venv} (bash scripts/setup_oracle_venv.sh creates it; it needs PyPI)")
    if os.environ.get("HSPMD_HF_ORACLE_REEXEC"):
        sys.exit(f"{py} does not run inside {venv} (sys.prefix {sys.prefix})")
    os.environ["HSPMD_HF_ORACLE_REEXEC"] = "1"
    os.execv(py, [py, os.path.abspath(__file__), *sys.argv[1:]])


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hspmd", required=True)
    ap.add_argument("--family", required=True, choices=["llama", "qwen2", "mistral"])
    ap.add_argument("--variant", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--venv", help="run under this venv's python, skip when it is absent "
                    "(HSPMD_ORACLE_VENV overrides it, as for scripts/setup_oracle_venv.sh)")
    ap.add_argument("--keep", help="keep the run's files in this directory")
    ap.add_argument("--device", default="cpu",
                    help="hspmd's device (cuda: the CUDA backend against the CPU reference; cpu:1: the device "
                         "test double)")
    return ap.parse_args()


ARGS = parse_args()
enter_venv(os.environ.get("HSPMD_ORACLE_VENV") or ARGS.venv)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only; nothing from the Hub
try:
    import numpy as np  # noqa: E402
    import torch  # noqa: E402
    import torch.nn.functional as F  # noqa: E402
except ImportError as e:
    skip(f"numpy or torch is not importable by {sys.executable} ({e}); "
         "bash scripts/setup_oracle_venv.sh installs them")

try:
    import transformers  # noqa: E402
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
except ImportError as e:
    skip(f"transformers is not importable by {sys.executable} ({e}); "
         "bash scripts/setup_oracle_venv.sh installs it")

sys.path.insert(0, HERE)
import llama_ref  # noqa: E402  (safetensors I/O, hspmd's sampling and schedule)

SEQ, BATCH, STEPS, WINDOW = 32, 4, 5, 8
TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            eos_token_id=256, bos_token_id=257, hidden_act="silu", initializer_range=0.02,
            attention_dropout=0.0, torch_dtype="float32")
FAMILIES = {
    "llama": dict(cls="LlamaConfig", arch="LlamaForCausalLM",
                  fields=dict(rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False),
                  train=["--micro-batches", "2", "--clip-grad", "0.5", "--lr-schedule", "cosine",
                         "--warmup-steps", "2", "--min-lr", "1e-3"]),
    "qwen2": dict(cls="Qwen2Config", arch="Qwen2ForCausalLM",
                  fields=dict(rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
                              use_sliding_window=False, sliding_window=WINDOW, max_window_layers=2),
                  train=["--micro-batches", "2"]),
    "mistral": dict(cls="MistralConfig", arch="MistralForCausalLM",
                    fields=dict(rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                                sliding_window=WINDOW),
                    train=[]),
}
COMMON_TRAIN = ["--seq-len", str(SEQ), "--global-batch", str(BATCH), "--steps", str(STEPS),
                "--lr", "1e-2", "--weight-decay", "0.1", "--beta1", "0.9", "--beta2", "0.95",
                "--eps", "1e-6"]
U_BF16 = 2.0 ** -8
# bf16 with a bf16 attention output: a tensor's tolerance is at least this
# times how far HF lands with a fused attention's backward (FusedAttentionBackward).
# hspmd's rounding and that run's are two draws of the same noise, so one
# draw bounds the other only up to a factor: on Qwen2's layer-1 key bias
# hspmd landed 0.63x the emulated distance on the CPU (torch 1.13) and 1.50x
# on the H200 (cuDNN, torch 2.11 as the reference): 2x.
FUSED_FACTOR = 2.0
# ...and such a widened tolerance must still fail a missing gradient (error
# 1) by this margin.
MISSING_MARGIN = 1.5


def train_flags(family):
    """The train flags as a dict for the HF loop (defaults as in `hspmd train --help`)."""
    argv = COMMON_TRAIN + FAMILIES[family]["train"]
    opts = dict(micro_batches=1, clip_grad=0.0, lr_schedule="constant", warmup_steps=0, min_lr=0.0)
    for k, v in zip(argv[::2], argv[1::2]):
        key = k[2:].replace("-", "_")
        opts[key] = v if key == "lr_schedule" else (int(v) if v.isdigit() else float(v))
    return argparse.Namespace(**opts)


def write_config(path, family, **override):
    """config.json as transformers writes it (`save_pretrained` -> to_json_file, use_diff)."""
    spec = FAMILIES[family]
    fields = {**TINY, **spec["fields"], **override}
    cfg = getattr(transformers, spec["cls"])(architectures=[spec["arch"]], **fields)
    cfg.to_json_file(path, use_diff=True)
    if family == "qwen2" and "sliding_window" in fields:
        # Qwen2Config stores sliding_window=None when use_sliding_window is false,
        # so it writes null; the Hub's Qwen2 files carry the number with
        # use_sliding_window false. Keep the number: the window must stay off.
        with open(path) as f:
            raw = json.load(f)
        raw["sliding_window"] = fields["sliding_window"]
        with open(path, "w") as f:
            json.dump(raw, f, indent=2, sort_keys=True)
    return path


def build_model(config_path, layers=None):
    cfg = AutoConfig.from_pretrained(os.path.dirname(config_path))
    if layers is not None:
        cfg.num_hidden_layers = layers
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", torch_dtype=torch.float32)
    assert model.config._attn_implementation == "eager", model.config._attn_implementation
    model.train()
    return model


def load_weights(model, weights, partial=False):
    """Copies HF-named weights into the model; every parameter must be given
    (a tied lm_head is the embedding), nothing unknown (unless partial)."""
    state = {k: torch.from_numpy(np.array(v, np.float32)) for k, v in weights.items()}
    if partial:
        state = {k: v for k, v in state.items() if k in model.state_dict()}
    r = model.load_state_dict(state, strict=False)
    tied = model.config.tie_word_embeddings
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight, "lm_head is not tied"
    allowed = {"lm_head.weight"} if tied else set()
    if set(r.missing_keys) - allowed or r.unexpected_keys:
        sys.exit(f"FAIL: HF load_state_dict: missing {r.missing_keys}, unexpected {r.unexpected_keys}")
    return model


def draw_weights(model, rng):
    """HF parameter names (a tied lm_head once, as the embedding) -> float32 arrays."""
    weights = {}
    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        if name.endswith("norm.weight"):
            weights[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif name.endswith(".bias"):  # large enough that a port without them fails
            weights[name] = (1.0 * rng.standard_normal(shape)).astype(np.float32)
        else:
            weights[name] = (0.08 * rng.standard_normal(shape)).astype(np.float32)
    return weights


def mean_loss_parts(model, inputs, targets, micro_batches, autocast):
    """hspmd's loss: per micro-batch sum of token losses / targets of the global
    batch, backward per part; returns the summed float loss."""
    count = targets.numel()
    mb = inputs.shape[0] // micro_batches
    total = 0.0
    for m in range(micro_batches):
        rows = slice(m * mb, (m + 1) * mb)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=inputs[rows], use_cache=False).logits
        logits = logits.to(model.lm_head.weight.dtype)  # f32 (f64 for the exact run)
        part = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                               targets[rows].reshape(-1), reduction="sum") / count
        part.backward()
        total += float(part.detach())
    return total


class FusedAttentionBackward:
    """Inside it, HF's eager attention (P = softmax(S) in f32, O = P @ V, as
    its Llama, Qwen2 and Mistral classes compute it) takes the backward of a
    fused attention (cuDNN's, FlashAttention's): the row sums D_i of
    softmax's backward, dS = P * (dP - D), formed as dO_i . O_i from the O
    the forward stored (bf16 under autocast) instead of as sum_j P_ij dP_ij
    from the same dP they are subtracted from. In exact arithmetic the two
    are equal; rounded, only the second cancels, so every gradient that
    flows through the scores (q_proj and k_proj, weights and biases) carries
    the first's rounding of O: a GPU's bf16 graph computes it so
    (docs/precision.md). Done with tensor hooks on S, P and O (found by
    wrapping torch.nn.functional.softmax and the torch.matmul after it), so
    HF's own code runs unchanged."""

    def __enter__(self):
        self.softmax, self.matmul = torch.nn.functional.softmax, torch.matmul
        pending = []

        def softmax(s, *args, **kwargs):
            p = self.softmax(s, *args, **kwargs)
            if torch.is_grad_enabled() and s.requires_grad:
                pending.append((s, p))
            return p

        def matmul(a, b, *args, **kwargs):
            out = self.matmul(a, b, *args, **kwargs)
            if pending and out.requires_grad:  # O = P @ V, the matmul right after the softmax
                s, p = pending.pop()
                rows = {}
                o, pd = out.detach(), p.detach()
                out.register_hook(lambda g: rows.__setitem__("fused", (g.float() * o.float()).sum(-1)))
                p.register_hook(lambda g: rows.__setitem__("hf", (pd * g.float()).sum(-1)))
                s.register_hook(lambda g: g + (pd * (rows["hf"] - rows["fused"]).unsqueeze(-1)).to(g.dtype))
            return out

        torch.nn.functional.softmax, torch.matmul = softmax, matmul
        return self

    def __exit__(self, *exc):
        torch.nn.functional.softmax, torch.matmul = self.softmax, self.matmul
        return False


def hf_train(config_path, weights, tokens, opts, autocast, out_prefix, dtype=torch.float32, fused=False):
    """Trains the HF model as `hspmd train` does; writes <prefix>.jsonl,
    <prefix>_grads.safetensors (step 0, before clipping), <prefix>_final.safetensors
    (F32 files; dtype float64 gives the near-exact run; fused: attention's
    backward as a fused attention forms it, FusedAttentionBackward)."""
    if fused:
        with FusedAttentionBackward():
            return hf_train(config_path, weights, tokens, opts, autocast, out_prefix, dtype)
    model = load_weights(build_model(config_path), weights).to(dtype)
    named = dict(model.named_parameters())  # a tied lm_head appears once, as the embedding
    groups = [{"params": [p for p in named.values() if p.dim() >= 2], "weight_decay": opts.weight_decay},
              {"params": [p for p in named.values() if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=opts.lr, betas=(opts.beta1, opts.beta2), eps=opts.eps)
    sched = argparse.Namespace(lr=opts.lr, min_lr=opts.min_lr, lr_schedule=opts.lr_schedule,
                               warmup_steps=opts.warmup_steps, steps=opts.steps)
    with open(out_prefix + ".jsonl", "w") as log:
        for step in range(opts.steps):
            lr = llama_ref.lr_at(sched, step)
            for g in opt.param_groups:
                g["lr"] = lr
            inputs, targets = llama_ref.batch_at(tokens, step, opts.seq_len, opts.global_batch)
            opt.zero_grad(set_to_none=True)
            loss = mean_loss_parts(model, inputs, targets, opts.micro_batches, autocast)
            norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in named.values()))
            if step == 0:
                llama_ref.write_safetensors(out_prefix + "_grads.safetensors",
                                            {k: p.grad for k, p in named.items()})
            if opts.clip_grad > 0:
                torch.nn.utils.clip_grad_norm_(list(named.values()), opts.clip_grad)
            opt.step()
            log.write(json.dumps({"step": step, "loss": loss, "lr": lr, "grad_norm": norm}) + "\n")
    llama_ref.write_safetensors(out_prefix + "_final.safetensors",
                                {k: p.detach() for k, p in named.items()})


def step0_loss_grads(config_path, weights, inputs, targets, micro_batches, autocast):
    model = load_weights(build_model(config_path), weights)
    loss = mean_loss_parts(model, inputs, targets, micro_batches, autocast)
    return loss, {k: p.grad.detach().numpy().copy() for k, p in model.named_parameters()}


def normalized_error(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))


def worst_error(h, t):
    return max((normalized_error(h[n], t[n]), n) for n in t)


def worst_ratio(h, t, tols):
    """The largest normalized error over its tensor's tolerance, and that tensor."""
    return max((normalized_error(h[n], t[n]) / tols[n], n) for n in t)


def reach_scan(config_path, weights, family):
    """One-layer copy of the model: which outputs each input position changes.
    Llama and qwen2 (window off): i >= p. Mistral: p <= i < p + W, i.e. query i
    sees keys i - W < j <= i."""
    model = load_weights(build_model(config_path, layers=1), weights, partial=True)
    model.eval()
    rng = np.random.default_rng(7)
    ids = torch.from_numpy(rng.integers(0, 256, size=(1, SEQ)).astype(np.int64))
    with torch.no_grad():
        base = model(input_ids=ids, use_cache=False).logits[0]
        scale = float(base.abs().max())
        for p in range(SEQ):
            moved = ids.clone()
            moved[0, p] = (moved[0, p] + 101) % 256
            diff = (model(input_ids=moved, use_cache=False).logits[0] - base).abs().amax(-1)
            reached = [i for i in range(SEQ) if float(diff[i]) > 1e-5 * scale]
            want = [i for i in range(SEQ) if i >= p and (family != "mistral" or i < p + WINDOW)]
            if reached != want:
                sys.exit(f"FAIL: HF reference: token {p} reaches outputs {reached}, expected {want}")
    what = f"i - {WINDOW} < j <= i" if family == "mistral" else "j <= i"
    print(f"reach scan (1 layer): query i sees keys {what}, as expected")


def wrong_models(family, right, tmp, weights):
    """(description, config path, weights) of models a wrong port would build;
    `right` is the right config.json."""
    os.makedirs(tmp, exist_ok=True)
    out = []
    if family == "mistral":
        for w in (WINDOW - 1, WINDOW + 1, None):
            d = os.path.join(tmp, f"w{w}")
            os.makedirs(d)
            out.append((f"sliding_window {w}", write_config(os.path.join(d, "config.json"), family,
                                                            sliding_window=w), weights))
    if family == "qwen2":
        for proj in ("q", "k", "v"):
            zeroed = {k: (np.zeros_like(v) if k.endswith(f"{proj}_proj.bias") else v)
                      for k, v in weights.items()}
            out.append((f"{proj}_proj biases zero", right, zeroed))
        d = os.path.join(tmp, "theta")
        os.makedirs(d)
        out.append(("rope_theta 1e4", write_config(os.path.join(d, "config.json"), family,
                                                   rope_theta=1e4), weights))
        d = os.path.join(tmp, "window")
        os.makedirs(d)
        out.append((f"sliding window {WINDOW} applied",
                    write_config(os.path.join(d, "config.json"), family, use_sliding_window=True,
                                 max_window_layers=0), weights))
    return out


def run_hspmd(cmd, family):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode == 0:
        return
    refused = re.search(r"\[config\] [^\n]*: model_type '" + family + r"' is not supported[^\n]*",
                        r.stderr)
    if family != "llama" and refused:
        skip(f"hspmd does not build model_type '{family}' yet ({refused.group(0)})")
    if "no CUDA device" in r.stderr or "no CUDA backend" in r.stderr:
        skip(f"hspmd cannot use {ARGS.device} here ({r.stderr.strip()})")
    sys.exit(f"FAIL: command failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")


def main():
    family, bf16 = ARGS.family, ARGS.variant == "bf16"
    torch.set_num_threads(1)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, python {sys.executable}")
    # Autocast's GEMMs sum in f32 on every CPU (llama_ref.py): the noise the
    # bf16 tolerances are derived from is bf16 rounding, not torch's bf16 sums.
    note = llama_ref.autocast_gemms_sum_in_f32() if bf16 else llama_ref.follow_onednn_cap()
    if note:
        print(note)
    opts = train_flags(family)
    with tempfile.TemporaryDirectory() as tmp:
        if ARGS.keep:
            tmp = os.path.abspath(ARGS.keep)
            os.makedirs(tmp, exist_ok=True)
        p = lambda n: os.path.join(tmp, n)  # noqa: E731
        config_path = write_config(p("config.json"), family)
        rng = np.random.default_rng(1234)
        weights = draw_weights(build_model(config_path), rng)
        tokens = rng.integers(0, 256, size=BATCH * SEQ * (STEPS + 1) + 1).astype(np.uint32)
        tokens[rng.integers(0, tokens.size, size=20)] = TINY["eos_token_id"]
        tokens.tofile(p("data.bin"))
        tokens = llama_ref.load_tokens(p("data.bin"))
        llama_ref.save_safetensors(p("init.safetensors"), weights)

        # The reference: HF in f32 (under autocast for bf16), and a second HF run
        # that measures the reference's own rounding: float64 for f32, f32 for bf16.
        hf_train(config_path, weights, tokens, opts, bf16, p("t"))
        hf_train(config_path, weights, tokens, opts, False, p("e"),
                 dtype=torch.float32 if bf16 else torch.float64)
        t_log = [json.loads(line) for line in open(p("t.jsonl"))]
        e_log = [json.loads(line) for line in open(p("e.jsonl"))]
        t = {w: llama_ref.load_safetensors(p(f"t_{w}.safetensors")) for w in ("grads", "final")}
        noise = {
            "loss0": abs(e_log[0]["loss"] - t_log[0]["loss"]) / abs(t_log[0]["loss"]),
            "loss": max(max(abs(a[k] - b[k]) / abs(b[k]) for k in ("loss", "grad_norm"))
                        for a, b in zip(e_log, t_log)),
        }
        where = {}
        for w in ("grads", "final"):
            noise[w], where[w] = worst_error(llama_ref.load_safetensors(p(f"e_{w}.safetensors")), t[w])

        # Tolerances (step-0 loss, later losses and grad norms, step-0 grads, final
        # weights): a fixed level or what the reference's own rounding gives, the larger.
        if bf16:  # hspmd must land within 1.5x of how far HF f32 lands from HF autocast
            tol, factor, versus = dict(loss0=2.5 * U_BF16, loss=5 * U_BF16, grads=13 * U_BF16,
                                       final=13 * U_BF16), 1.5, "HF f32 vs HF autocast"
        else:  # two f32 implementations, each this far from exact: at most twice that apart
            tol, factor, versus = dict(loss0=1e-5, loss=1e-4, grads=1e-4, final=1e-3), 2.0, \
                "HF f32 vs HF f64"
        for k in tol:
            at = f" ({where[k]})" if k in where else ""
            print(f"{versus} ({k}): {noise[k]:.2e}{at}; fixed level {tol[k]:.2e}")
            tol[k] = max(tol[k], factor * noise[k])
        print("tolerances: " + ", ".join(f"{k} {v:.2e}" for k, v in tol.items()))

        common = ["--model", config_path, "--data", p("data.bin"), "--init", p("init.safetensors"),
                  "--threads", "1"] + COMMON_TRAIN + FAMILIES[family]["train"]
        run_hspmd([ARGS.hspmd, "train", *common, "--device", ARGS.device, *(["--precision", "bf16"] if bf16 else []),
                   "--quiet", "--log", p("h.jsonl"), "--dump-grads", p("h_grads.safetensors"),
                   "--save", p("h_final.safetensors")], family)
        h_log = [json.loads(line) for line in open(p("h.jsonl"))]

        # Per tensor tolerances of the step-0 gradients and the final weights:
        # the ones above, and where hspmd's attention backward read O rounded
        # to bf16 (its step records say "attention_rounds_output": true: a GPU
        # whose attention is cuDNN's, or HSPMD_ATTENTION_IO=bf16 anywhere), at
        # least FUSED_FACTOR x how far HF itself lands when its attention's backward
        # forms its row sums from the stored bf16 O as a fused attention does
        # (FusedAttentionBackward): that rounding moves the gradients that flow
        # through the scores (q_proj, k_proj) by a measured amount that the f32
        # vs autocast noise does not hold (docs/models.md).
        tols = {w: {n: tol[w] for n in t[w]} for w in ("grads", "final")}
        rounds_o = bf16 and any(r.get("attention_rounds_output") for r in h_log)
        if rounds_o:
            hf_train(config_path, weights, tokens, opts, True, p("f"), fused=True)
            for w in ("grads", "final"):
                f = llama_ref.load_safetensors(p(f"f_{w}.safetensors"))
                for n in t[w]:
                    fused = normalized_error(f[n], t[w][n])
                    if FUSED_FACTOR * fused > tol[w]:
                        tols[w][n] = FUSED_FACTOR * fused
                        print(f"HF autocast with a fused attention's backward vs HF autocast ({w}, {n}): "
                              f"{fused:.2e}; tolerance {tols[w][n]:.2e}")
            # Still able to fail there: a gradient of such a tensor that is
            # missing (zero) reads 1.
            for n, v in tols["grads"].items():
                if v > tol["grads"] and v * MISSING_MARGIN >= 1:
                    sys.exit(f"FAIL: the fused attention's rounding leaves {n}'s gradient a tolerance of "
                             f"{v:.2e}: a missing gradient (1) would pass within {MISSING_MARGIN}x")

        # The reference can fail: reach scan and wrong models.
        reach_scan(config_path, weights, family)
        inputs, targets = llama_ref.batch_at(tokens, 0, SEQ, BATCH)
        right = (t_log[0]["loss"], t["grads"])
        transformers.logging.set_verbosity_error()  # its warnings about the wrong models
        for what, cfg, w in wrong_models(family, config_path, p("wrong"), weights):
            loss, grads = step0_loss_grads(cfg, w, inputs, targets, opts.micro_batches, bf16)
            rel = abs(loss - right[0]) / abs(right[0])
            gratio, gname = worst_ratio(grads, right[1], tols["grads"])
            gerr = normalized_error(grads[gname], right[1][gname])
            margin = max(rel / tol["loss0"], gratio)
            print(f"wrong model ({what}): step-0 loss off by {rel:.2e}, gradients by {gerr:.2e} ({gname}): "
                  f"{margin:.0f}x the tolerance")
            if margin < 10:
                sys.exit(f"FAIL: the test could not tell '{what}' from the right model "
                         f"({margin:.1f}x the tolerance)")

        transformers.logging.set_verbosity_warning()

        failures = []
        if len(h_log) != STEPS or len(t_log) != STEPS:
            sys.exit(f"FAIL: expected {STEPS} logged steps, got {len(h_log)} and {len(t_log)}")
        for s, (a, b) in enumerate(zip(h_log, t_log)):
            rel = abs(a["loss"] - b["loss"]) / abs(b["loss"])
            nrel = abs(a["grad_norm"] - b["grad_norm"]) / abs(b["grad_norm"])
            print(f"step {s} loss hspmd {a['loss']:.8f} HF {b['loss']:.8f} rel {rel:.2e}; "
                  f"grad norm hspmd {a['grad_norm']:.6f} HF {b['grad_norm']:.6f} rel {nrel:.2e}")
            limit = tol["loss0"] if s == 0 else tol["loss"]
            if rel > limit:
                failures.append(f"step {s} loss differs by {rel:.2e} (> {limit:.2e})")
            if nrel > tol["loss"]:
                failures.append(f"step {s} gradient norm differs by {nrel:.2e} (> {tol['loss']:.2e})")
        if opts.clip_grad > 0 and not any(b["grad_norm"] > opts.clip_grad for b in t_log):
            failures.append(f"--clip-grad {opts.clip_grad} never clipped: the check is idle")
        for what in ("grads", "final"):
            h = llama_ref.load_safetensors(p(f"h_{what}.safetensors"))
            if sorted(h) != sorted(t[what]):
                failures.append(f"{what}: tensor names differ: {sorted(set(h) ^ set(t[what]))}")
                continue
            worst = worst_error(h, t[what])
            print(f"{what}: worst normalized error {worst[0]:.2e} ({worst[1]})")
            ratio, name = worst_ratio(h, t[what], tols[what])
            if ratio > 1 or name != worst[1]:
                print(f"{what}: nearest its tolerance {name}: {normalized_error(h[name], t[what][name]):.2e} "
                      f"({ratio:.2f}x its tolerance {tols[what][name]:.2e})")
            for n in sorted(t[what]):
                e = normalized_error(h[n], t[what][n])
                if e > tols[what][n]:
                    failures.append(f"{what}: {n} differs by {e:.2e} (> {tols[what][n]:.2e})")
        if h_log[-1]["loss"] >= h_log[0]["loss"]:
            failures.append(f"loss did not decrease over {STEPS} steps")
        if failures:
            sys.exit("FAIL: " + "; ".join(failures))
        print("PASS")


if __name__ == "__main__":
    main()
