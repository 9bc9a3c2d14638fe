#!/usr/bin/python3
"""Independent PyTorch reference of a Hugging Face-style Llama, for oracle tests.

Plain torch (no transformers): reads a HF config.json subset, reads/writes
safetensors with its own numpy code, runs LlamaForCausalLM's forward in float32
and trains with torch.optim.AdamW (weight decay only on tensors with >= 2 dims).

Run with /usr/bin/python3 (Debian's python3-torch). Example:

  /usr/bin/python3 tests/oracle/llama_ref.py --model cfg.json --init w.safetensors \
      --data tokens.bin --seq-len 64 --global-batch 4 --steps 3 --lr 1e-3 \
      --weight-decay 0.1 --beta1 0.9 --beta2 0.95 --eps 1e-8 --micro-batches 2 \
      --clip-grad 1.0 --threads 1 --dump-grads grads.safetensors \
      --log ref.jsonl --save final.safetensors

`--pack-documents` trains on packed documents (docs/data.md), written here
from the rule in the doc, not from hspmd's code: each step's loss runs every
document piece through the model on its own and averages over all counted
targets of the global batch.

`--self-test` runs a tiny end-to-end check in a temporary directory.
"""

import argparse
import json
import math
import os
import struct
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

IGNORE_INDEX = -100

# ----------------------------------------------------------------------------
# Config


def load_config(path):
    """Reads the HF config.json subset; unknown fields are ignored."""
    with open(path) as f:
        raw = json.load(f)
    required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads"]
    missing = [k for k in required if k not in raw]
    if missing:
        raise ValueError(f"[model] {path}: missing fields {missing}")
    cfg = {k: int(raw[k]) for k in required}
    cfg["num_key_value_heads"] = int(raw.get("num_key_value_heads", cfg["num_attention_heads"]))
    cfg["rms_norm_eps"] = float(raw.get("rms_norm_eps", 1e-6))
    cfg["rope_theta"] = float(raw.get("rope_theta", 10000.0))
    cfg["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings", False))
    eos = raw.get("eos_token_id", 2)  # hspmd's default; a list means its first element
    cfg["eos_token_id"] = int(eos[0] if isinstance(eos, list) else eos)
    check_config(cfg)
    return cfg


def check_config(cfg):
    hq, hkv, h = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    if h % hq or hq % hkv or (h // hq) % 2:
        raise ValueError(f"[model] bad head layout: hidden={h} heads={hq} kv_heads={hkv}")


def param_shapes(cfg):
    """HF parameter names -> shapes, in a stable order."""
    h, v, i = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    d = h // cfg["num_attention_heads"]
    hq_d, hkv_d = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (v, h)}
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}."
        shapes[p + "self_attn.q_proj.weight"] = (hq_d, h)
        shapes[p + "self_attn.k_proj.weight"] = (hkv_d, h)
        shapes[p + "self_attn.v_proj.weight"] = (hkv_d, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, hq_d)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    return shapes


# ----------------------------------------------------------------------------
# safetensors (own reader/writer)

_NP_DTYPES = {"F32": np.float32, "F16": np.float16, "I32": np.int32, "I64": np.int64}


def read_safetensors(path):
    """Returns {name: float32 np.ndarray} (BF16/F16 widened to f32)."""
    with open(path, "rb") as f:
        blob = f.read()
    (hlen,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + hlen].decode("utf-8"))
    base = 8 + hlen
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw = blob[base + begin:base + end]
        shape = tuple(info["shape"])
        if info["dtype"] == "BF16":
            bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            arr = bits.view(np.float32)
        elif info["dtype"] in _NP_DTYPES:
            arr = np.frombuffer(raw, dtype=np.dtype(_NP_DTYPES[info["dtype"]]).newbyteorder("<"))
            arr = arr.astype(np.float32)
        else:
            raise ValueError(f"[weights] {path}: tensor '{name}' has unsupported dtype {info['dtype']}")
        out[name] = arr.reshape(shape).copy()
    return out


def _f32_to_bf16_bits(a):
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(a.astype(np.float32))
    rounded[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded


def write_safetensors(path, tensors, dtype="F32"):
    """Writes {name: array-like} as F32 or BF16, names sorted, header 8-aligned."""
    header, chunks, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name]
        a = t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
        a = np.ascontiguousarray(a, dtype=np.float32)
        raw = _f32_to_bf16_bits(a).astype("<u2").tobytes() if dtype == "BF16" else a.astype("<f4").tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    hbytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hbytes += b" " * (-len(hbytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hbytes)))
        f.write(hbytes)
        for c in chunks:
            f.write(c)


# Names used by tests/oracle/oracle_test.py.
load_safetensors = read_safetensors
save_safetensors = write_safetensors


# ----------------------------------------------------------------------------
# Model


def random_params(cfg, seed=0, std=0.02):
    """Normal(0, std) matrices, ones for norm weights."""
    gen = torch.Generator().manual_seed(seed)
    params = {}
    for name, shape in param_shapes(cfg).items():
        if len(shape) == 1:
            params[name] = torch.ones(shape, dtype=torch.float32)
        else:
            params[name] = torch.randn(shape, generator=gen, dtype=torch.float32) * std
    return params


def load_params(cfg, path):
    """Loads HF-named weights; checks names and shapes. Ignores a tied lm_head."""
    data = read_safetensors(path)
    params = {}
    for name, shape in param_shapes(cfg).items():
        if name not in data:
            raise ValueError(f"[weights] {path}: missing tensor '{name}'")
        if tuple(data[name].shape) != tuple(shape):
            raise ValueError(f"[weights] {path}: '{name}' has shape {list(data[name].shape)}, "
                             f"expected {list(shape)}")
        params[name] = torch.from_numpy(data[name])
    return params


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_cos_sin(seq_len, head_dim, theta, dtype=torch.float32):
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    pos = torch.arange(seq_len, dtype=dtype)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()  # [S, D]


def attention(x, p, prefix, cfg, cos, sin):
    b, s, _ = x.shape
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg["hidden_size"] // hq
    q = F.linear(x, p[prefix + "q_proj.weight"]).view(b, s, hq, d).transpose(1, 2)
    k = F.linear(x, p[prefix + "k_proj.weight"]).view(b, s, hkv, d).transpose(1, 2)
    v = F.linear(x, p[prefix + "v_proj.weight"]).view(b, s, hkv, d).transpose(1, 2)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    k = k.repeat_interleave(hq // hkv, dim=1)  # query head h uses kv head h // (hq/hkv)
    v = v.repeat_interleave(hq // hkv, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(d)
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(causal, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v)
    out = out.transpose(1, 2).reshape(b, s, hq * d)
    return F.linear(out, p[prefix + "o_proj.weight"])


def mlp(x, p, prefix):
    gate = F.silu(F.linear(x, p[prefix + "gate_proj.weight"]))
    return F.linear(gate * F.linear(x, p[prefix + "up_proj.weight"]), p[prefix + "down_proj.weight"])


def forward(params, cfg, input_ids):
    """input_ids [B, S] int64 -> logits [B, S, V] (LlamaForCausalLM), in the
    dtype of the parameters (float32 normally; float64 for a high-precision run)."""
    eps = cfg["rms_norm_eps"]
    d = cfg["hidden_size"] // cfg["num_attention_heads"]
    embed = params["model.embed_tokens.weight"]
    cos, sin = rope_cos_sin(input_ids.shape[1], d, cfg["rope_theta"], embed.dtype)
    x = F.embedding(input_ids, embed)
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}."
        x = x + attention(rms_norm(x, params[p + "input_layernorm.weight"], eps), params,
                          p + "self_attn.", cfg, cos, sin)
        x = x + mlp(rms_norm(x, params[p + "post_attention_layernorm.weight"], eps), params,
                    p + "mlp.")
    x = rms_norm(x, params["model.norm.weight"], eps)
    head = params["model.embed_tokens.weight" if cfg["tie_word_embeddings"] else "lm_head.weight"]
    return F.linear(x, head)


# torch.autocast("cpu", torch.bfloat16) around the forward (--autocast): the
# mixed-precision peer of `hspmd train --precision bf16`.
AUTOCAST = False


# ----------------------------------------------------------------------------
# bf16 GEMMs of the reference, the same on every CPU
#
# Autocast's GEMMs multiply bf16 operands, sum in f32 and round the result to
# bf16 (oneDNN on CPUs with AVX-512, cuBLAS on GPUs). Torch 1.13 asks oneDNN
# only where cpuid lists avx512bw/vl/dq; on a CPU without AVX-512 it takes its
# own bf16 GEMM, which sums in bf16: 5e-2 from the exact product at K 512
# against 2.6e-3 (measured here with oneDNN off). Such a reference is 20x
# noisier than the thing it checks, and the oracles derive their tolerances
# from its noise (hf_oracle_test.py: 1.5x HF f32 vs HF autocast), so on such
# a CPU they widened until a wrong model passed. Where the probe below finds
# bf16 sums, autocast's F.linear and torch.matmul (every GEMM of llama_ref
# and of HF's Llama, Qwen2 and Mistral) compute in f32 on the bf16-rounded
# operands and round the result once: autocast's contract, whatever the CPU.


def onednn_isa_cap():
    """The ISA oneDNN is capped at (ONEDNN_MAX_CPU_ISA, else DNNL_MAX_CPU_ISA),
    upper case, or None."""
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        v = os.environ.get(var, "").strip().upper()
        if v:
            return v
    return None


def follow_onednn_cap():
    """Under an oneDNN cap below AVX-512 (`ONEDNN_MAX_CPU_ISA=AVX2`, which
    emulates an AVX2-only CPU, docs/precision.md), torch takes the path it
    takes on such a CPU: no oneDNN for bf16. Torch reads cpuid, not the cap,
    so it would still ask the capped oneDNN for a bf16 matmul, which refuses
    ("could not create a primitive descriptor iterator"). Returns a note or ''."""
    cap = onednn_isa_cap()
    if cap is None or cap.startswith("AVX512") or cap in ("ALL", "DEFAULT"):
        return ""
    torch.backends.mkldnn.enabled = False
    return f"oneDNN capped at {cap}: torch without oneDNN, as on a CPU without AVX-512"


def bf16_matmul_sums_in_f32():
    """Whether torch's bf16 matmul sums in f32: its result equals the exact
    product rounded to bf16 (all but near-ties; bf16 sums leave about 5%)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(32, 512, generator=g).to(torch.bfloat16)
    b = torch.randn(512, 48, generator=g).to(torch.bfloat16)
    exact = (a.double() @ b.double()).to(torch.bfloat16)
    return float((torch.matmul(a, b) == exact).float().mean()) > 0.9


_F32_SUMS = None


def autocast_gemms_sum_in_f32():
    """Makes autocast's bf16 GEMMs sum in f32 where torch's own do not (see
    above); idempotent. Returns one line saying what the reference's bf16
    GEMMs are."""
    global _F32_SUMS
    note = follow_onednn_cap()
    if _F32_SUMS is None:
        _F32_SUMS = not bf16_matmul_sums_in_f32()
        if _F32_SUMS:
            linear, matmul = F.linear, torch.matmul

            def bf16_autocast():
                return torch.is_autocast_cpu_enabled() and torch.get_autocast_cpu_dtype() == torch.bfloat16

            def widened(t):  # autocast's cast, then exact in f32
                return None if t is None else t.to(torch.bfloat16).float()

            def f32_sum_linear(x, w, bias=None):
                if not bf16_autocast():
                    return linear(x, w, bias)
                with torch.autocast("cpu", enabled=False):
                    return linear(widened(x), widened(w), widened(bias)).to(torch.bfloat16)

            def f32_sum_matmul(a, b, *args, **kwargs):
                if not bf16_autocast():
                    return matmul(a, b, *args, **kwargs)
                with torch.autocast("cpu", enabled=False):
                    return matmul(widened(a), widened(b), *args, **kwargs).to(torch.bfloat16)

            F.linear, torch.matmul = f32_sum_linear, f32_sum_matmul
    what = ("torch's bf16 GEMMs sum in bf16 here: autocast's GEMMs computed in f32 on bf16 operands, "
            "rounded once" if _F32_SUMS else "torch's bf16 GEMMs sum in f32")
    return "reference bf16 GEMMs: " + what + (f" ({note})" if note else "")


def loss_sum(params, cfg, inputs, targets):
    """Summed cross-entropy over non-ignored targets (the loss in float32 under autocast)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=AUTOCAST):
        logits = forward(params, cfg, inputs)
    logits = logits.to(params["model.norm.weight"].dtype)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


# ----------------------------------------------------------------------------
# Data


def load_tokens(path):
    return np.fromfile(path, dtype="<u4").astype(np.int64)


def batch_at(tokens, step, seq_len, batch):
    """Fixed-length samples (s*B + j) mod num_samples -> (inputs, targets) [B, L]."""
    num_samples = (len(tokens) - 1) // seq_len
    if num_samples < 1:
        raise ValueError(f"[data] {len(tokens)} tokens is too few for seq_len {seq_len}")
    rows = []
    for j in range(batch):
        i = (step * batch + j) % num_samples
        rows.append(tokens[i * seq_len:i * seq_len + seq_len + 1])
    arr = torch.from_numpy(np.stack(rows))
    return arr[:, :-1].contiguous(), arr[:, 1:].contiguous()


def split_documents(tokens, eos):
    """Cuts the stream after each eos (the eos ends its document); tokens after
    the last eos form a last document."""
    docs, start = [], 0
    for i in np.flatnonzero(tokens == eos):
        docs.append(tokens[start:i + 1])
        start = i + 1
    if start < len(tokens):
        docs.append(tokens[start:])
    return docs


def pack_documents(tokens, seq_len, eos):
    """docs/data.md packing -> list of samples, each a list of pieces (int64 arrays).

    A document longer than seq_len is cut into pieces of seq_len tokens (the
    last one shorter); pieces are packed in file order, next-fit: a piece
    joins the current sample when the sample then holds at most seq_len
    tokens, otherwise it opens the next sample."""
    if seq_len <= 0:
        raise ValueError(f"[data] seq_len {seq_len} must be positive")
    samples, used = [], None
    for doc in split_documents(np.asarray(tokens, np.int64), eos):
        for b in range(0, len(doc), seq_len):
            piece = doc[b:b + seq_len]
            if used is None or used + len(piece) > seq_len:
                samples.append([])
                used = 0
            samples[-1].append(piece)
            used += len(piece)
    if not samples:
        raise ValueError("[data] no tokens to pack")
    return samples


def packed_batch_at(samples, step, batch):
    """Packed samples (s*B + j) mod num_samples, j = 0..B-1."""
    return [samples[(step * batch + j) % len(samples)] for j in range(batch)]


def piece_loss_sum(params, cfg, piece):
    """Summed cross-entropy of a piece run on its own (positions 0..n-1, causal
    attention over the piece): its n-1 next-token targets; the last token has none."""
    if len(piece) < 2:
        return None
    ids = torch.from_numpy(np.asarray(piece, np.int64))
    targets = torch.cat([ids[1:], torch.tensor([IGNORE_INDEX], dtype=torch.int64)])
    return loss_sum(params, cfg, ids[None, :], targets[None, :])


# ----------------------------------------------------------------------------
# Training


def make_optimizer(named, lr, wd, beta1, beta2, eps):
    """AdamW with two groups: weight decay on tensors with >= 2 dims only."""
    decay = [t for t in named.values() if t.dim() >= 2]
    no_decay = [t for t in named.values() if t.dim() < 2]
    groups = [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(beta1, beta2), eps=eps)


def lr_at(args, step):
    """Same rule as hspmd::LrSchedule::at with total_steps = --steps."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    if args.lr_schedule != "cosine":
        return args.lr
    span = args.steps - args.warmup_steps
    progress = 1.0 if span <= 0 else min(max((step - args.warmup_steps) / span, 0.0), 1.0)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1.0 + math.cos(math.pi * progress))


def grad_norm(named):
    total = 0.0
    for t in named.values():
        if t.grad is not None:
            total += float(t.grad.double().pow(2).sum())
    return math.sqrt(total)


def finish_step(named, opt, clip, on_grads):
    """The end of a step: gradient norm, the caller's look at the gradients,
    clipping, the optimizer. Returns the norm before clipping."""
    norm = grad_norm(named)
    if on_grads:
        on_grads(named)
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(list(named.values()), clip)
    opt.step()
    return norm


def train_step(named, cfg, opt, inputs, targets, micro_batches, clip, on_grads=None):
    """One optimizer step with gradient accumulation; returns (loss, grad_norm).

    Each micro-batch's summed loss is divided by the global batch's target
    count, so the accumulated gradient is that of the global mean loss.
    `on_grads(named)` sees the raw gradients before clipping."""
    batch = inputs.shape[0]
    if batch % micro_batches:
        raise ValueError(f"[flags] --micro-batches {micro_batches} does not divide batch {batch}")
    count = int((targets != IGNORE_INDEX).sum())
    mb = batch // micro_batches
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for m in range(micro_batches):
        rows = slice(m * mb, (m + 1) * mb)
        part = loss_sum(named, cfg, inputs[rows], targets[rows]) / max(count, 1)
        part.backward()
        total += float(part.detach())
    return total, finish_step(named, opt, clip, on_grads)


def train_step_packed(named, cfg, opt, samples, micro_batches, clip, on_grads=None):
    """train_step for packed documents: `samples` is the global batch (a list of
    samples, each a list of pieces). Micro-batch m takes samples m*B/M ..; every
    piece's summed loss is divided by the global count of targets (at least 1)."""
    batch = len(samples)
    if batch % micro_batches:
        raise ValueError(f"[flags] --micro-batches {micro_batches} does not divide batch {batch}")
    count = sum(max(len(p) - 1, 0) for s in samples for p in s)
    mb = batch // micro_batches
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for m in range(micro_batches):
        parts = [piece_loss_sum(named, cfg, p) for s in samples[m * mb:(m + 1) * mb] for p in s]
        parts = [x for x in parts if x is not None]
        if not parts:
            continue
        part = torch.stack(parts).sum() / max(count, 1)
        part.backward()
        total += float(part.detach())
    for t in named.values():  # a step with no counted target still steps (zero gradients)
        if t.grad is None:
            t.grad = torch.zeros_like(t)
    return total, finish_step(named, opt, clip, on_grads)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--model", help="HF config.json")
    ap.add_argument("--init", help="initial weights (.safetensors); random if absent")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random init")
    ap.add_argument("--data", help="token file (little-endian uint32)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--pack-documents", action="store_true",
                    help="pack whole documents (cut at eos) into samples (docs/data.md)")
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--lr-schedule", choices=["constant", "warmup", "cosine"], default="constant")
    ap.add_argument("--warmup-steps", type=int, default=0)
    ap.add_argument("--min-lr", type=float, default=0.0)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.95)
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--clip-grad", type=float, default=0.0, help="0 = off")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                    help="compute dtype; float64 gives a high-precision target (files stay F32)")
    ap.add_argument("--autocast", action="store_true",
                    help="bf16 mixed precision: the forward under torch.autocast('cpu', torch.bfloat16)")
    ap.add_argument("--dump-grads", help="write step-0 gradients (pre-clip, HF names)")
    ap.add_argument("--log", help="JSONL: one object per step (step, loss, lr, grad_norm)")
    ap.add_argument("--save", help="write final weights (.safetensors, F32)")
    ap.add_argument("--self-test", action="store_true")
    args = ap.parse_args(argv)
    if not args.self_test and (args.model is None or args.data is None):
        ap.error("--model and --data are required")
    return args


def run(args):
    global AUTOCAST
    AUTOCAST = args.autocast
    torch.set_num_threads(args.threads)
    note = autocast_gemms_sum_in_f32() if AUTOCAST else follow_onednn_cap()
    if note:
        print(note, file=sys.stderr)
    cfg = load_config(args.model)
    params = load_params(cfg, args.init) if args.init else random_params(cfg, args.seed)
    dtype = getattr(torch, args.dtype)
    named = {k: v.to(dtype).clone().requires_grad_(True) for k, v in params.items()}
    opt = make_optimizer(named, args.lr, args.weight_decay, args.beta1, args.beta2, args.eps)
    tokens = load_tokens(args.data)
    packed = pack_documents(tokens, args.seq_len, cfg["eos_token_id"]) if args.pack_documents else None

    def dump(named_params):
        write_safetensors(args.dump_grads, {k: v.grad for k, v in named_params.items()})

    log = open(args.log, "w") if args.log else None
    losses = []
    for step in range(args.steps):
        lr = lr_at(args, step)
        for g in opt.param_groups:
            g["lr"] = lr
        on_grads = dump if (step == 0 and args.dump_grads) else None
        if packed is not None:
            samples = packed_batch_at(packed, step, args.global_batch)
            loss, norm = train_step_packed(named, cfg, opt, samples, args.micro_batches,
                                           args.clip_grad, on_grads)
            n_tokens = sum(len(p) for s in samples for p in s)
        else:
            inputs, targets = batch_at(tokens, step, args.seq_len, args.global_batch)
            loss, norm = train_step(named, cfg, opt, inputs, targets, args.micro_batches,
                                    args.clip_grad, on_grads)
            n_tokens = args.global_batch * args.seq_len
        losses.append(loss)
        record = {"step": step, "loss": loss, "lr": lr, "grad_norm": norm, "tokens": n_tokens}
        print(json.dumps(record), file=sys.stderr)
        if log:
            log.write(json.dumps(record) + "\n")
            log.flush()
    if log:
        log.close()
    if args.save:
        write_safetensors(args.save, {k: v.detach() for k, v in named.items()})
    return losses


# ----------------------------------------------------------------------------
# Self-test


TINY_CONFIG = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 176,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}


def self_test():
    """Tiny end-to-end run: loss ~ ln(V) at step 0, then decreasing; I/O round trips."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path = os.path.join(tmp, "config.json")
        with open(cfg_path, "w") as f:
            json.dump(TINY_CONFIG, f)
        cfg = load_config(cfg_path)
        params = random_params(cfg, seed=1)
        init = os.path.join(tmp, "init.safetensors")
        write_safetensors(init, params)
        back = read_safetensors(init)
        assert all(np.array_equal(back[k], params[k].numpy()) for k in params), "F32 round trip"
        bf = os.path.join(tmp, "bf16.safetensors")
        write_safetensors(bf, params, dtype="BF16")
        back = read_safetensors(bf)
        for k in params:
            assert np.allclose(back[k], params[k].numpy(), rtol=1e-2, atol=1e-6), "BF16 round trip"
        data = os.path.join(tmp, "tokens.bin")
        rng = np.random.default_rng(0)
        # 4 samples of 32 = one global batch, so every step sees the same data
        # (plus 5 spare tokens that never form a sample) and the loss must fall.
        rng.integers(0, cfg["vocab_size"], size=4 * 32 + 6, dtype=np.uint32).astype("<u4").tofile(data)
        tokens = load_tokens(data)
        x0, y0 = batch_at(tokens, 0, 32, 4)
        x1, _ = batch_at(tokens, 1, 32, 4)
        assert torch.equal(x0, x1) and torch.equal(x0[1, 1:], y0[1, :-1]), "sampling"
        assert int(x0[2, 0]) == int(tokens[64]) and int(y0[3, -1]) == int(tokens[128])
        common = ["--model", cfg_path, "--init", init, "--data", data, "--seq-len", "32",
                  "--global-batch", "4", "--lr", "1e-2", "--weight-decay", "0.1"]
        log = os.path.join(tmp, "log.jsonl")
        grads = os.path.join(tmp, "grads.safetensors")
        final = os.path.join(tmp, "final.safetensors")
        losses = run(parse_args(common + ["--steps", "3", "--log", log, "--dump-grads", grads,
                                          "--save", final, "--micro-batches", "2",
                                          "--clip-grad", "1.0"]))
        ln_v = math.log(cfg["vocab_size"])
        assert abs(losses[0] - ln_v) < 0.1, f"step-0 loss {losses[0]} vs ln(V) {ln_v}"
        assert losses[1] < losses[0] and losses[2] < losses[1], f"loss not decreasing: {losses}"
        assert len(open(log).read().splitlines()) == 3
        assert set(read_safetensors(grads)) == set(param_shapes(cfg))
        assert set(read_safetensors(final)) == set(param_shapes(cfg))
        # Gradient accumulation must not change the step-0 loss or gradients.
        grads1 = os.path.join(tmp, "grads1.safetensors")
        one = run(parse_args(common + ["--steps", "1", "--dump-grads", grads1]))
        assert abs(one[0] - losses[0]) < 1e-5, (one[0], losses[0])
        g1, g2 = read_safetensors(grads1), read_safetensors(grads)
        for k in g1:
            assert np.allclose(g1[k], g2[k], rtol=1e-4, atol=1e-7), f"accumulated grad {k}"
        # Causality: changing the last input token leaves earlier logits alone.
        with torch.no_grad():
            a = forward(params, cfg, x0)
            x_mod = x0.clone()
            x_mod[:, -1] = (x_mod[:, -1] + 1) % cfg["vocab_size"]
            b = forward(params, cfg, x_mod)
        assert torch.allclose(a[:, :-1], b[:, :-1], atol=1e-6) and not torch.allclose(a[:, -1], b[:, -1])
        # Tied embeddings: no lm_head, logits use the embedding matrix.
        tied = dict(cfg, tie_word_embeddings=True)
        tied_params = {k: v for k, v in params.items() if k != "lm_head.weight"}
        assert set(tied_params) == set(param_shapes(tied))
        with torch.no_grad():
            assert forward(tied_params, tied, x0).shape == (4, 32, cfg["vocab_size"])
        # Packed documents (docs/data.md), hand-checked: eos 9, L 4. Documents
        # [1 9] [2 3 4 5 6 9] [9] [3 3 3 9] [7 8] (the last without eos);
        # pieces [1 9] [2 3 4 5] [6 9] [9] [3 3 3 9] [7 8]; next-fit samples below.
        stream = np.array([1, 9, 2, 3, 4, 5, 6, 9, 9, 3, 3, 3, 9, 7, 8])
        got = [[p.tolist() for p in s] for s in pack_documents(stream, 4, 9)]
        want = [[[1, 9]], [[2, 3, 4, 5]], [[6, 9], [9]], [[3, 3, 3, 9]], [[7, 8]]]
        assert got == want, f"packing {got}"
        assert [[p.tolist() for p in s] for s in pack_documents(stream, 2, 9)] == \
            [[[1, 9]], [[2, 3]], [[4, 5]], [[6, 9]], [[9]], [[3, 3]], [[3, 9]], [[7, 8]]]
        assert [len(s) for s in pack_documents(np.array([5, 5, 9, 9, 9]), 8, 9)] == [3]
        batch = packed_batch_at(pack_documents(stream, 4, 9), 1, 3)  # samples 3, 4, 0
        assert [[p.tolist() for p in s] for s in batch] == [[[3, 3, 3, 9]], [[7, 8]], [[1, 9]]]
        assert piece_loss_sum(params, cfg, np.array([9])) is None
        # A piece's loss is that of its own causal run: same as the fixed-length
        # loss of a window holding exactly its tokens.
        with torch.no_grad():
            w = tokens[:33]
            a = float(piece_loss_sum(params, cfg, w))
            b = float(loss_sum(params, cfg, torch.from_numpy(w[None, :-1]), torch.from_numpy(w[None, 1:])))
        assert abs(a - b) < 1e-4 * abs(b), (a, b)
        # A packed run: the normalizer is the global count, so micro-batching
        # leaves the step-0 loss and gradients alone.
        pdata = os.path.join(tmp, "docs.bin")
        docs = [np.append(rng.integers(3, 256, size=int(n) - 1), cfg["eos_token_id"])
                for n in rng.integers(1, 80, size=12)]
        np.concatenate(docs).astype("<u4").tofile(pdata)
        pcommon = ["--model", cfg_path, "--init", init, "--data", pdata, "--seq-len", "32",
                   "--global-batch", "4", "--pack-documents", "--steps", "1"]
        pg1, pg2 = os.path.join(tmp, "pg1.safetensors"), os.path.join(tmp, "pg2.safetensors")
        p1 = run(parse_args(pcommon + ["--dump-grads", pg1]))
        p2 = run(parse_args(pcommon + ["--dump-grads", pg2, "--micro-batches", "2"]))
        assert abs(p1[0] - p2[0]) < 1e-5 and abs(p1[0] - ln_v) < 0.1, (p1, p2)
        g1, g2 = read_safetensors(pg1), read_safetensors(pg2)
        for k in g1:
            assert np.allclose(g1[k], g2[k], rtol=1e-4, atol=1e-7), f"packed accumulated grad {k}"
        print(f"self-test ok: ln(V)={ln_v:.4f} losses={[round(x, 4) for x in losses]}")


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.self_test:
        self_test()
    else:
        run(args)


if __name__ == "__main__":
    main()
