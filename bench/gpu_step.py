#!/usr/bin/env python3
"""One training step on one GPU: hspmd against PyTorch eager and torch.compile.

For a Hugging Face Llama / Qwen2 / Mistral config.json (default: the
TinyLlama-1.1B shape at sequence 4096), times in one call, on the same GPU,
one process after the other:

  hspmd     `hspmd train --device cuda --precision bf16`, its --log records
  eager     PyTorch: fp32 master weights, torch.autocast(bfloat16), SDPA
            causal attention (GQA), fused AdamW
  compiled  the same model under torch.compile

with the same random tokens (a uint32 token file, sample i = tokens[i*S :
i*S+S+1], step k takes samples k*B .. k*B+B-1), the same AdamW settings
(lr 3e-4, betas 0.9/0.95, eps 1e-8, no weight decay) and a fresh random
initialization each. Per system: the step time (the wall time of the timed
steps, after --warmup untimed ones, between two device synchronisations,
divided by their number), tokens/s, MFU, peak GPU memory and the first
step's loss; then hspmd over compiled. Output: a table on stdout and a JSON
file (--json).

  MFU = tokens/s * (6 N + 6 L H S) / peak.  N: the parameters that enter a
  matmul (all but the input embedding table, unless it is tied to the LM
  head; norm weights and biases counted too); L layers, H hidden, S
  sequence: attention's score and value products, causal (half the square),
  forward and backward. Peak: 989.4 TFLOP/s (dense bf16 of an H100 / H200)
  for a GPU whose name says H100 or H200, else --peak-tflops (without it
  MFU is left out).

Every system is timed the same way: the wall time of the --steps timed steps
between two points where the host has waited for the device, divided by
--steps (--warmup is at least 1, so the first point follows a step). PyTorch:
torch.cuda.synchronize() after the last warm-up step and after the last timed
one, nothing read back in between (the losses stay on the device until the
end). hspmd: the `unix_time` stamps of its --log records of the last warm-up
step and of the last timed step; each record is written after the step has
read its gradient norm back (a host wait for the device) and launched the
optimizer, so the span holds --steps whole steps of device work (shifted by
the optimizer's kernels, the same at both ends). Each record's own
`step_time_s` is kept in the JSON (`record_step_times_s`) for reference. Peak memory: hspmd's
`peak_memory_bytes` (its device allocator's peak bytes in use during a step:
the state, activations, gradients; not the CUDA context, cuBLAS / cuDNN
workspaces of their own, nor cached free blocks); PyTorch's
torch.cuda.max_memory_allocated() over the timed steps (its caching
allocator's bytes in use; max_memory_reserved is in the JSON too).

  bench/gpu_step.py                              # TinyLlama shape, S 4096, B 4
  bench/gpu_step.py --layers 2 --seq 1024 --mb 2 --steps 5   # tens of seconds
  bench/gpu_step.py --model path/to/config.json --json out.json
  /usr/bin/python3 bench/gpu_step.py --cpu-smoke # the harness on the CPU

Then the loss check (docs/benchmarks.md, "Loss check"; --no-loss-check
skips it): a model that trains fast but wrong is not a result. PyTorch
writes its initial weights (Hugging Face names, F32 safetensors) and
trains from them --loss-steps steps (default 30) on the bytes of
data/corpus twice, in bf16 autocast and in fp32 (no TF32); hspmd trains
from the same weights (--init) on the same token file, same AdamW, warmup
+ cosine schedule, weight decay and clipping. hspmd's loss at step k must
stay within max(--loss-floor x PyTorch bf16's loss, --loss-multiple x the
largest |PyTorch bf16 - PyTorch fp32| of steps 0..k) of PyTorch bf16's:
a multiple of bf16's own noise. Self-test: hspmd once more with
HSPMD_DEBUG_BREAK_ATTENTION=1 (a test-only switch, src/ops/attention.cc:
each query sees only its own key) must FAIL that check, else the check
is reported FAIL. The shape is smaller than the timed one by default
(--loss-layers 4, --loss-seq 1024, --loss-mb 2: the timed width and
vocabulary); RESULT lines case=loss_check and case=loss_check_self_test,
the curves and bounds in the JSON ("loss_check"). Exit 1 when either fails.

--cpu-smoke runs the same harness on the CPU (the tiny example model,
`hspmd train --device cpu`, PyTorch's CPU autocast; the compiled row is
skipped where torch has no torch.compile) and checks its own results: the
CTest gpu_step_bench_harness_on_cpu; there the loss check runs at the tiny
model's shape, S 32, B 2, and must pass with its self-test. Its times say
nothing about GPUs.

Exit codes: 0 every system measured (or skipped for a reason printed) and
the loss check and its self-test passed (or were skipped), 1 a system
failed or timed out (its row says how) or the loss check or its self-test
failed, 77 GPU mode without a CUDA device (CTest: skipped), 2 bad
arguments.
"""
import argparse
import array
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
H100_H200_BF16_TFLOPS = 989.4
SYSTEMS = ("hspmd", "eager", "compiled")

# TinyLlama-1.1B's shape; max_position_embeddings raised from its 2048 to
# the benchmark's sequence (written into the run's config, see run_config).
TINYLLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632,
    "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}


# ----------------------------------------------------------------- config --
def run_config(base, layers=None, hidden=None, seq=None):
    """The config the run trains: `base` with the small-shape overrides.
    --hidden keeps the head dim and the query/KV head ratio and scales the
    FFN by the same factor (rounded up to a multiple of 32)."""
    cfg = dict(base)
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    head_dim = cfg["hidden_size"] // heads
    if cfg.get("head_dim") not in (None, head_dim):
        sys.exit(f"gpu_step: head_dim {cfg['head_dim']} != hidden_size / num_attention_heads: not supported")
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    if hidden is not None and hidden != cfg["hidden_size"]:
        if hidden % head_dim:
            sys.exit(f"gpu_step: --hidden {hidden} is not a multiple of the head dim {head_dim}")
        group = heads // kv
        new_heads = hidden // head_dim
        if new_heads % group:
            sys.exit(f"gpu_step: --hidden {hidden} gives {new_heads} heads, not a multiple of the "
                     f"{group} query heads per KV head")
        ffn = cfg["intermediate_size"] * hidden / cfg["hidden_size"]
        cfg.update(hidden_size=hidden, num_attention_heads=new_heads, num_key_value_heads=new_heads // group,
                   intermediate_size=int(math.ceil(ffn / 32) * 32))
    if seq is not None and cfg.get("max_position_embeddings", 0) < seq:
        cfg["max_position_embeddings"] = seq
    return cfg


def sliding_window(cfg):
    """Mistral's window (absent: 4096, null: none); 0 = no window."""
    if cfg.get("model_type") != "mistral":
        return 0
    return cfg.get("sliding_window", 4096) or 0


def param_counts(cfg):
    """(all parameters, those entering a matmul: see the MFU note above)."""
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or nh
    d = h // nh
    bias = (nh + 2 * kv) * d if cfg.get("model_type") == "qwen2" else 0
    layer = h * nh * d * 2 + h * kv * d * 2 + bias + 3 * h * f + 2 * h
    tied = bool(cfg.get("tie_word_embeddings", False))
    total = cfg["num_hidden_layers"] * layer + h + v * h * (1 if tied else 2)
    return total, total - (0 if tied else v * h)


def flops_per_token(cfg, seq):
    _, n = param_counts(cfg)
    return 6 * n + 6 * cfg["num_hidden_layers"] * cfg["hidden_size"] * seq


def write_tokens(path, vocab, count, seed):
    rng = random.Random(seed)
    a = array.array("I", (rng.randrange(vocab) for _ in range(count)))
    if sys.byteorder != "little":
        a.byteswap()
    with open(path, "wb") as f:
        a.tofile(f)


def read_tokens(path):
    a = array.array("I")
    with open(path, "rb") as f:
        a.frombytes(f.read())
    if sys.byteorder != "little":
        a.byteswap()
    return a


# ------------------------------------------------------ PyTorch worker --
def torch_llama(cfg, seq, seed):
    """The PyTorch peer's model (Llama / Qwen2 / Mistral shapes from a Hugging
    Face config): RMSNorm in f32, RoPE, SDPA causal attention with GQA where
    torch has it, SwiGLU, weights N(0, 0.02) drawn after torch.manual_seed(seed).
    Also bench/gpu_overlap.py's data-parallel peer."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or nh
    d, eps, window = h // nh, cfg.get("rms_norm_eps", 1e-6), sliding_window(cfg)
    bias = cfg.get("model_type") == "qwen2"
    sdpa = getattr(F, "scaled_dot_product_attention", None)

    def rms_norm(x, w):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)) * w

    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm = torch.nn.Parameter(torch.ones(h))
            self.post_attention_layernorm = torch.nn.Parameter(torch.ones(h))
            self.q = torch.nn.Linear(h, nh * d, bias=bias)
            self.k = torch.nn.Linear(h, kv * d, bias=bias)
            self.v = torch.nn.Linear(h, kv * d, bias=bias)
            self.o = torch.nn.Linear(nh * d, h, bias=False)
            self.gate = torch.nn.Linear(h, cfg["intermediate_size"], bias=False)
            self.up = torch.nn.Linear(h, cfg["intermediate_size"], bias=False)
            self.down = torch.nn.Linear(cfg["intermediate_size"], h, bias=False)

        def attend(self, q, k, v, s):
            causal = window == 0 or window >= s
            if sdpa is not None and causal:
                try:
                    return sdpa(q, k, v, is_causal=True, enable_gqa=True)
                except TypeError:  # torch < 2.5: no enable_gqa
                    pass
            k = k.repeat_interleave(nh // kv, dim=1)
            v = v.repeat_interleave(nh // kv, dim=1)
            if sdpa is not None and causal:
                return sdpa(q, k, v, is_causal=True)
            i = torch.arange(s, device=q.device)
            mask = i[None, :] <= i[:, None]
            if window:
                mask &= i[None, :] > i[:, None] - window
            if sdpa is not None:
                return sdpa(q, k, v, attn_mask=mask)
            scores = (q @ k.transpose(-1, -2)).float() / math.sqrt(d)
            return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).to(v.dtype) @ v

        def forward(self, x, cos, sin):
            b, s, _ = x.shape
            y = rms_norm(x, self.input_layernorm)
            q = self.q(y).view(b, s, nh, d).transpose(1, 2)
            k = self.k(y).view(b, s, kv, d).transpose(1, 2)
            v = self.v(y).view(b, s, kv, d).transpose(1, 2)
            q = (q.float() * cos + rotate_half(q.float()) * sin).to(v.dtype)
            k = (k.float() * cos + rotate_half(k.float()) * sin).to(v.dtype)
            att = self.attend(q, k, v, s).transpose(1, 2).reshape(b, s, nh * d)
            x = x + self.o(att)
            y = rms_norm(x, self.post_attention_layernorm)
            return x + self.down(F.silu(self.gate(y)) * self.up(y))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(cfg["vocab_size"], h)
            self.layers = torch.nn.ModuleList(Block() for _ in range(cfg["num_hidden_layers"]))
            self.norm = torch.nn.Parameter(torch.ones(h))
            self.head = torch.nn.Linear(h, cfg["vocab_size"], bias=False)
            if cfg.get("tie_word_embeddings"):
                self.head.weight = self.embed.weight
            inv = 1.0 / (cfg.get("rope_theta", 10000.0) ** (torch.arange(0, d, 2).float() / d))
            ang = torch.outer(torch.arange(seq).float(), inv)
            ang = torch.cat((ang, ang), dim=-1)
            self.register_buffer("cos", ang.cos(), persistent=False)
            self.register_buffer("sin", ang.sin(), persistent=False)

        def forward(self, ids, targets):
            x = self.embed(ids)
            for layer in self.layers:
                x = layer(x, self.cos, self.sin)
            logits = self.head(rms_norm(x, self.norm))
            return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))

    model = Model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
            elif "bias" in name:
                p.zero_()
    return model, ("sdpa" if sdpa is not None else "matmul-softmax")


def torch_worker(a):
    """One PyTorch system in this process; writes its result JSON to a.out."""
    import torch

    cfg = json.load(open(a.config))
    dev = torch.device(a.device)
    if dev.type == "cpu":
        torch.set_num_threads(a.threads)
    result = {"system": a.worker, "torch": torch.__version__}
    if a.worker == "compiled" and not hasattr(torch, "compile"):
        result.update(status="SKIP", reason=f"torch {torch.__version__} has no torch.compile")
        json.dump(result, open(a.out, "w"))
        return 0
    model, attention = torch_llama(cfg, a.seq, a.seed)
    model = model.to(dev)
    fused = {"fused": True} if dev.type == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, **fused)
    step_fn = torch.compile(model) if a.worker == "compiled" else model
    tokens = torch.tensor(read_tokens(a.data), dtype=torch.int64)
    s, bsz = a.seq, a.mb

    def batch(k):
        return batch_at(tokens, s, bsz, k, dev)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def train(ids, targets):
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = step_fn(ids, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    t_warm = time.perf_counter()
    losses = [float(train(*batch(k))) for k in range(a.warmup)]
    warmup_s = time.perf_counter() - t_warm  # torch.compile's compilation is in it
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    batches = [batch(k) for k in range(a.warmup, a.warmup + a.steps)]  # on the device before the clock starts
    sync()
    t0 = time.perf_counter()
    timed = [train(*b) for b in batches]  # no host read in between
    sync()
    span = time.perf_counter() - t0
    losses += [float(v) for v in timed]
    result.update(status="PASS", span_s=span, timed_steps=a.steps, losses=losses,
                  attention=attention, warmup_s=warmup_s,
                  optimizer="AdamW fused" if fused else "AdamW")
    if dev.type == "cuda":
        result.update(device=torch.cuda.get_device_name(dev),
                      peak_memory_bytes=torch.cuda.max_memory_allocated(dev),
                      peak_reserved_bytes=torch.cuda.max_memory_reserved(dev))
    json.dump(result, open(a.out, "w"))
    return 0


# ------------------------------------------------ loss check (worker) --
def hf_name(name):
    """The Hugging Face Llama name of a torch_llama parameter (what hspmd's
    --init expects, docs/models.md)."""
    parts = name.split(".")
    if parts[0] == "embed":
        return "model.embed_tokens.weight"
    if parts[0] == "norm":
        return "model.norm.weight"
    if parts[0] == "head":
        return "lm_head.weight"
    i, local = parts[1], parts[2]
    if local in ("input_layernorm", "post_attention_layernorm"):
        return f"model.layers.{i}.{local}.weight"
    module = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
              "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}[local]
    return f"model.layers.{i}.{module}.{parts[3]}"


def write_safetensors(path, tensors):
    """{name: tensor} as F32 safetensors (needs neither the safetensors
    package nor numpy: an 8-byte little-endian header length, the JSON
    header, padded to 8 bytes, then the raw little-endian data, copied out
    of each CPU tensor's memory in pieces)."""
    import ctypes
    if sys.byteorder != "little":
        raise RuntimeError("write_safetensors: a big-endian host")
    header, offset, arrays = {}, 0, []
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").float().contiguous()
        n = t.numel() * 4
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        arrays.append(t)
        offset += n
    header["__metadata__"] = {"format": "pt", "written_by": "bench/gpu_step.py loss check"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        piece = 1 << 26  # bytes per write
        for t in arrays:
            n = t.numel() * 4
            for at in range(0, n, piece):
                f.write(ctypes.string_at(t.data_ptr() + at, min(piece, n - at)))


def lr_at(a, step):
    """hspmd's schedule (LrSchedule::at, tests/oracle/llama_ref.py lr_at):
    linear warmup lr * (step + 1) / warmup, then cosine to --loss-min-lr at
    the last step."""
    if step < a.loss_warmup:
        return a.loss_lr * (step + 1) / a.loss_warmup
    span = a.loss_steps - a.loss_warmup
    progress = 1.0 if span <= 0 else min(max((step - a.loss_warmup) / span, 0.0), 1.0)
    return a.loss_min_lr + 0.5 * (a.loss_lr - a.loss_min_lr) * (1.0 + math.cos(math.pi * progress))


def loss_worker(a):
    """The loss check's PyTorch side in this process: builds torch_llama
    (seed --seed), writes its initial weights to a.init_out (Hugging Face
    names, F32), then trains from them --loss-steps steps twice, in bf16
    autocast and in fp32 (TF32 off), with hspmd's AdamW, schedule and
    clipping; writes both loss curves to a.out."""
    import torch

    cfg = json.load(open(a.config))
    dev = torch.device(a.device)
    if dev.type == "cpu":
        torch.set_num_threads(a.threads)
    else:  # the fp32 reference must be fp32: no TF32 in its GEMMs or convolutions
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    t0 = time.perf_counter()
    model, attention = torch_llama(cfg, a.seq, a.seed)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}  # a tied head appears once, as embed
    write_safetensors(a.init_out, {hf_name(n): t for n, t in init.items()})
    init_s = time.perf_counter() - t0
    model = model.to(dev)
    tokens = torch.tensor(read_tokens(a.data), dtype=torch.int64)
    s, bsz = a.seq, a.mb

    def batch(k):
        return batch_at(tokens, s, bsz, k, dev)

    result = {"system": "torch", "torch": torch.__version__, "attention": attention, "init_s": init_s}
    for mode in ("bf16", "fp32"):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(init[n])
        params = list(model.named_parameters())
        opt = torch.optim.AdamW(
            [{"params": [p for _, p in params if p.dim() >= 2], "weight_decay": a.loss_weight_decay},
             {"params": [p for _, p in params if p.dim() < 2], "weight_decay": 0.0}],
            lr=a.loss_lr, betas=(0.9, 0.95), eps=1e-8)
        losses, norms = [], []
        t1 = time.perf_counter()
        for k in range(a.loss_steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(a, k)
            ids, targets = batch(k)
            if mode == "bf16":
                with torch.autocast(dev.type, dtype=torch.bfloat16):
                    loss = model(ids, targets)
            else:
                loss = model(ids, targets)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.loss_clip if a.loss_clip > 0 else float("inf"))
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
            norms.append(float(norm))
        result[mode] = {"losses": losses, "grad_norms": norms, "seconds": time.perf_counter() - t1}
        del opt
    json.dump(result, open(a.out, "w"))
    return 0


# ------------------------------------------------------------- harness --
CHILDREN = []  # the system running now: its process group goes when this process is stopped


def stop_children(signum, frame):
    for p in CHILDREN:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    sys.exit(128 + signum)


def batch_at(tokens, s, bsz, k, dev):
    """Step k's inputs and targets: samples k*bsz .. k*bsz+bsz-1, sample i =
    tokens[i*s : i*s+s+1], on `dev` (the layout hspmd train reads)."""
    import torch
    rows = [tokens[i * s:i * s + s + 1] for i in range(k * bsz, k * bsz + bsz)]
    t = torch.stack(rows).to(dev)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def run_limited(cmd, timeout, env=None, tail=2000):
    """(return code or 'TIMEOUT', stderr's last `tail` characters, None: all);
    the whole process group is killed at the limit (torch.compile's workers
    too)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    CHILDREN.append(p)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return "TIMEOUT", (err or "")[-(tail or 0):]
    finally:
        CHILDREN.remove(p)
    return p.returncode, (err or "")[-(tail or 0):]


def last_line(text):
    lines = [l for l in text.strip().splitlines() if l.strip()]
    return lines[-1][:300] if lines else ""


def run_hspmd(a, cfg_path, data, tmp, device):
    log, op_times = os.path.join(tmp, "hspmd.jsonl"), os.path.join(tmp, "hspmd_op_times.json")
    # One step more than timed: the last one times each op (--op-times, its
    # events would perturb a timed step) and says where the time goes.
    cmd = [a.hspmd, "train", "--model", cfg_path, "--data", data, "--seq-len", str(a.seq),
           "--global-batch", str(a.mb), "--steps", str(a.warmup + a.steps + 1), "--precision", "bf16",
           "--lr", "3e-4", "--beta1", "0.9", "--beta2", "0.95", "--eps", "1e-8", "--seed", str(a.seed),
           "--device", device, "--log", log, "--op-times", op_times, "--quiet"]
    if device == "cpu":
        cmd += ["--threads", str(a.threads)]
    if a.cuda_graphs and device != "cpu":  # the timed steps replayed (docs/cuda.md, "CUDA graphs")
        cmd += ["--cuda-graphs"]
    rc, err = run_limited(cmd, a.timeout)
    row = {"system": "hspmd", "command": " ".join(cmd)}
    if rc != 0:
        no_device = "no CUDA device" in err or "no CUDA backend" in err
        row.update(status="TIMEOUT" if rc == "TIMEOUT" else ("NO_DEVICE" if no_device else "FAIL"),
                   reason=last_line(err))
        return row
    recs = [json.loads(l) for l in open(log) if l.strip()]
    timed = [r for r in recs if a.warmup <= r["step"] < a.warmup + a.steps]
    if len(timed) != a.steps or len(recs) != a.warmup + a.steps + 1:
        row.update(status="FAIL", reason=f"{len(recs)} step records, expected {a.warmup + a.steps + 1}")
        return row
    # The span: from the last warm-up step's record to the last timed one's
    # (both written after a host wait for the device; see the module's doc).
    first, last = next(r for r in recs if r["step"] == a.warmup - 1), timed[-1]
    if "unix_time" not in first or "unix_time" not in last or last["unix_time"] <= first["unix_time"]:
        row.update(status="FAIL", reason="the step records lack increasing unix_time stamps")
        return row
    row.update(status="PASS", span_s=last["unix_time"] - first["unix_time"], timed_steps=a.steps,
               record_step_times_s=[r["step_time_s"] for r in timed],
               losses=[r["loss"] for r in recs[:a.warmup + a.steps]], tokens_per_step=timed[0]["tokens"])
    # How long the host took to queue each timed step (hspmd's queued_s:
    # the step's start to its first wait for the device, after the update
    # is queued): far below the step time, the device never waited for the
    # host inside the step, and a CUDA graph of the step could gain only
    # the gap at the step's boundary (docs/cuda.md).
    if a.cuda_graphs:  # how many timed steps were replays of the captured graph (the rest ran op by op)
        row["replayed_steps"] = sum(r.get("cuda_graph") == "replayed" for r in timed)
    queued = [r["queued_s"] for r in timed if r.get("queued_s")]
    if len(queued) == len(timed):
        row["queued_s"] = queued
    if os.path.exists(op_times):
        row["op_times"] = json.load(open(op_times))
    # Attention calls cuDNN did not take (hspmd's own, much slower kernels
    # ran them): the speed is then not the fused attention's.
    fallbacks = max((max(r.get("attention_fallbacks", [0])) for r in recs), default=0)
    if fallbacks:
        row["attention_fallbacks"] = fallbacks
        row["attention_fallback_reason"] = next(
            (l.strip() for l in err.splitlines() if "fell back from cuDNN" in l), "")
    if "peak_memory_bytes" in timed[0]:
        row["peak_memory_bytes"] = max(max(r["peak_memory_bytes"]) for r in timed)
        row["peak_activation_bytes"] = max(max(r["peak_activation_bytes"]) for r in timed)
    return row


def run_torch(a, system, cfg_path, data, tmp, device):
    out = os.path.join(tmp, system + ".json")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", system, "--config", cfg_path, "--data", data,
           "--seq", str(a.seq), "--mb", str(a.mb), "--warmup", str(a.warmup), "--steps", str(a.steps),
           "--seed", str(a.seed), "--device", device, "--threads", str(a.threads), "--out", out]
    env = dict(os.environ)
    # The torch processes may need another library path than hspmd's (pip's
    # CUDA libraries against the toolkit's): scripts/gpu_check.sh sets it.
    if "GPU_STEP_TORCH_LD_LIBRARY_PATH" in env:
        env["LD_LIBRARY_PATH"] = env["GPU_STEP_TORCH_LD_LIBRARY_PATH"]
    rc, err = run_limited(cmd, a.timeout, env)
    if rc != 0 or not os.path.exists(out):
        return {"system": system, "status": "TIMEOUT" if rc == "TIMEOUT" else "FAIL", "reason": last_line(err)}
    return json.load(open(out))


# ------------------------------------------------ loss check (harness) --
BREAK_ENV = "HSPMD_DEBUG_BREAK_ATTENTION"  # src/ops/attention.cc: test-only, attention made wrong
LOSS_MULTIPLE = 6.0  # the bound's defaults: docs/benchmarks.md, "Loss check"
LOSS_FLOOR = 2.0 ** -11  # times the loss: an eighth of bf16's unit roundoff 2^-8


def corpus_tokens(count):
    """`count` byte-level token ids (0-255): the bytes of data/corpus/*.txt in
    name order, wrapped around as often as needed."""
    folder = os.path.join(ROOT, "data", "corpus")
    text = b"".join(open(os.path.join(folder, n), "rb").read()
                    for n in sorted(os.listdir(folder)) if n.endswith(".txt"))
    if not text:
        raise RuntimeError(f"no corpus text in {folder}")
    reps = -(-count // len(text))
    return array.array("I", list((text * reps)[:count]))


def loss_bound(a, loss, envelope):
    """The bound on |hspmd - PyTorch bf16| at a step (docs/benchmarks.md,
    "Loss check"): --loss-multiple times `envelope`, the largest |PyTorch
    bf16 - PyTorch fp32| of the steps so far, and at least the floor,
    --loss-floor times PyTorch bf16's loss `loss` (it holds in the first
    steps, where the two PyTorch runs have not yet drifted apart)."""
    return max(a.loss_floor * abs(loss), a.loss_multiple * envelope)


def judge_losses(a, bf16, fp32, got):
    """Step by step: {'status', 'steps': [...], 'worst': {...}, 'first_fail'}."""
    if len(got) != a.loss_steps or any(not math.isfinite(x) for x in got):
        return {"status": "FAIL", "reason": f"{len(got)} losses (expected {a.loss_steps}) or a non-finite one",
                "steps": [], "worst": None, "first_fail": None}
    steps, envelope, worst, first_fail = [], 0.0, None, None
    for k, (b, f, h) in enumerate(zip(bf16, fp32, got)):
        envelope = max(envelope, abs(b - f))
        bound = loss_bound(a, b, envelope)
        dev = abs(h - b)
        row = {"step": k, "fp32": f, "bf16": b, "got": h, "bf16_fp32_gap": abs(b - f), "envelope": envelope,
               "bound": bound, "deviation": dev, "ratio": dev / bound}
        steps.append(row)
        if worst is None or row["ratio"] > worst["ratio"]:
            worst = row
        if first_fail is None and dev > bound:
            first_fail = k
    return {"status": "PASS" if first_fail is None else "FAIL", "steps": steps, "worst": worst,
            "first_fail": first_fail}


def run_hspmd_losses(a, cfg_path, data, init, tmp, device, name, env=None):
    """hspmd trains the loss check's steps from `init`; (losses, row)."""
    log = os.path.join(tmp, f"loss_{name}.jsonl")
    cmd = [a.hspmd, "train", "--model", cfg_path, "--data", data, "--seq-len", str(a.loss_seq),
           "--global-batch", str(a.loss_mb), "--steps", str(a.loss_steps), "--precision", "bf16",
           "--lr", repr(a.loss_lr), "--min-lr", repr(a.loss_min_lr), "--lr-schedule", "cosine",
           "--warmup-steps", str(a.loss_warmup), "--weight-decay", repr(a.loss_weight_decay),
           "--beta1", "0.9", "--beta2", "0.95", "--eps", "1e-8", "--clip-grad", repr(a.loss_clip),
           "--init", init, "--device", device, "--log", log, "--quiet"]
    if device == "cpu":
        cmd += ["--threads", str(a.threads)]
    full_env = dict(os.environ)  # an exported HSPMD_DEBUG_BREAK_ATTENTION breaks the checked run too
    full_env.update(env or {})
    t0 = time.time()
    rc, err = run_limited(cmd, a.timeout, full_env, tail=None)
    row = {"run": name, "command": " ".join([f"{k}={v}" for k, v in (env or {}).items()] + cmd),
           "wall_s": time.time() - t0}
    if rc != 0:
        row.update(status="TIMEOUT" if rc == "TIMEOUT" else "FAIL", reason=last_line(err))
        return None, row
    recs = [json.loads(l) for l in open(log) if l.strip()]
    row.update(status="DONE", grad_norms=[r.get("grad_norm") for r in recs])
    if env and BREAK_ENV in env and BREAK_ENV not in err:
        row.update(status="FAIL", reason=f"hspmd did not announce {BREAK_ENV} on stderr (switch not read?)")
        return None, row
    return [r["loss"] for r in recs], row


def loss_check(a, base, device, tmp, info):
    """The loss check and its self-check: {'check': row, 'self_test': row, ...}."""
    t0 = time.time()
    cfg = run_config(base, a.loss_layers, a.hidden, a.loss_seq)
    report = {"config": cfg, "seq": a.loss_seq, "mb": a.loss_mb, "steps": a.loss_steps,
              "layers": cfg["num_hidden_layers"], "data": "data/corpus/*.txt bytes (byte-level ids 0-255)",
              "optimizer": {"lr": a.loss_lr, "min_lr": a.loss_min_lr, "schedule": "cosine",
                            "warmup_steps": a.loss_warmup, "weight_decay": a.loss_weight_decay,
                            "betas": [0.9, 0.95], "eps": 1e-8, "clip_grad": a.loss_clip},
              "bound": {"multiple": a.loss_multiple, "floor_per_nat": a.loss_floor,
                        "rule": "|hspmd_k - bf16_k| <= max(floor_per_nat * bf16_k, "
                                "multiple * max_{j<=k} |bf16_j - fp32_j|)"},
              "break": f"{BREAK_ENV}={a.loss_break}"}
    skip = None
    if cfg["vocab_size"] < 256:
        skip = f"vocab {cfg['vocab_size']} < 256: byte-level ids do not fit"
    elif not info.get("torch", True) and device == "cuda":
        skip = f"no torch in {sys.executable}"
    if skip:
        report["check"] = {"status": "SKIP", "reason": skip}
        report["self_test"] = {"status": "SKIP", "reason": skip}
        return report
    cfg_path, data = os.path.join(tmp, "loss_config.json"), os.path.join(tmp, "loss_tokens.bin")
    init, out = os.path.join(tmp, "loss_init.safetensors"), os.path.join(tmp, "loss_torch.json")
    json.dump(cfg, open(cfg_path, "w"), indent=1)
    tokens = corpus_tokens(a.loss_steps * a.loss_mb * a.loss_seq + 1)
    if sys.byteorder != "little":
        tokens.byteswap()
    with open(data, "wb") as f:
        tokens.tofile(f)
    # PyTorch first: it writes the shared initial weights.
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "loss", "--config", cfg_path, "--data", data,
           "--seq", str(a.loss_seq), "--mb", str(a.loss_mb), "--seed", str(a.seed), "--device", device,
           "--threads", str(a.threads), "--out", out, "--init-out", init]
    cmd += [f"--loss-{k}={getattr(a, 'loss_' + k.replace('-', '_'))!r}"
            for k in ("steps", "lr", "min-lr", "warmup", "weight-decay", "clip")]
    env = dict(os.environ)
    if "GPU_STEP_TORCH_LD_LIBRARY_PATH" in env:
        env["LD_LIBRARY_PATH"] = env["GPU_STEP_TORCH_LD_LIBRARY_PATH"]
    t1 = time.time()
    rc, err = run_limited(cmd, a.timeout, env)
    report["torch_wall_s"] = time.time() - t1
    print(f"[gpu_step] loss check: PyTorch bf16 + fp32 in {report['torch_wall_s']:.0f} s", file=sys.stderr, flush=True)
    if rc != 0 or not os.path.exists(out):
        why = f"PyTorch reference {'timed out' if rc == 'TIMEOUT' else 'failed'}: {last_line(err)}"
        report["check"] = {"status": "TIMEOUT" if rc == "TIMEOUT" else "FAIL", "reason": why}
        report["self_test"] = {"status": "FAIL", "reason": "no reference"}
        return report
    ref = json.load(open(out))
    report["torch"] = ref
    bf16, fp32 = ref["bf16"]["losses"], ref["fp32"]["losses"]
    if any(len(c) != a.loss_steps or not all(math.isfinite(x) for x in c) for c in (bf16, fp32)):
        report["check"] = {"status": "FAIL", "reason": "the PyTorch reference's losses are incomplete or not finite"}
        report["self_test"] = {"status": "FAIL", "reason": "no reference"}
        return report
    runs = {}
    for name, extra in (("hspmd", None), ("broken", {BREAK_ENV: str(a.loss_break)})):
        losses, row = run_hspmd_losses(a, cfg_path, data, init, tmp, device, name, extra)
        print(f"[gpu_step] loss check: hspmd{' with ' + BREAK_ENV if extra else ''} in {row['wall_s']:.0f} s",
              file=sys.stderr, flush=True)
        if losses is not None:
            row.update(losses=losses, **judge_losses(a, bf16, fp32, losses))
        runs[name] = row
    report["hspmd"], report["broken"] = runs["hspmd"], runs["broken"]
    h, b = runs["hspmd"], runs["broken"]
    if "losses" not in h or h["worst"] is None:
        report["check"] = {"status": "TIMEOUT" if h["status"] == "TIMEOUT" else "FAIL",
                           "reason": f"hspmd: {h.get('reason', '')}"}
    else:
        w = h["worst"]
        report["check"] = {"status": h["status"], "max_ratio": w["ratio"], "worst_step": w["step"],
                           "worst_deviation": w["deviation"], "worst_bound": w["bound"], "first_fail": h["first_fail"]}
        if h["status"] == "FAIL":
            report["check"]["reason"] = (f"hspmd's loss left PyTorch bf16's at step {h['first_fail']}: "
                                         f"|{h['steps'][h['first_fail']]['got']:.5f} - "
                                         f"{h['steps'][h['first_fail']]['bf16']:.5f}| > "
                                         f"{h['steps'][h['first_fail']]['bound']:.5f}")
    # The self-check: the deliberately broken attention must FAIL the check.
    if "losses" not in b or b["worst"] is None:
        report["self_test"] = {"status": "FAIL", "reason": f"the broken run gave no (finite) losses: "
                                                           f"{b.get('reason', '')}"}
    elif b["status"] == "FAIL":
        report["self_test"] = {"status": "PASS", "broken_first_fail": b["first_fail"],
                               "broken_max_ratio": b["worst"]["ratio"]}
    else:
        report["self_test"] = {"status": "FAIL", "broken_max_ratio": b["worst"]["ratio"],
                               "reason": f"the check passed hspmd with {BREAK_ENV}={a.loss_break} (worst ratio "
                                         f"{b['worst']['ratio']:.2f}): it cannot tell this wrong attention"}
    report["wall_s"] = time.time() - t0
    return report


def print_loss_check(lc, a):
    timed = lc.get("timed_shape", {})
    c, st = lc["check"], lc["self_test"]
    cfg = lc["config"]
    print(f"loss check: hidden {cfg['hidden_size']} layers {cfg['num_hidden_layers']} heads "
          f"{cfg['num_attention_heads']}/{cfg.get('num_key_value_heads')} vocab {cfg['vocab_size']}; seq {lc['seq']} x "
          f"micro-batch {lc['mb']}, {lc['steps']} steps on the bytes of data/corpus; one shared init; "
          f"AdamW lr {a.loss_lr:g} (warmup {a.loss_warmup}, cosine to {a.loss_min_lr:g}), weight decay "
          f"{a.loss_weight_decay:g}, clip {a.loss_clip:g}")
    if timed and (timed["layers"], timed["seq"], timed["mb"]) != (lc["layers"], lc["seq"], lc["mb"]):
        print(f"  (not the timed shape: that is {timed['layers']} layers, seq {timed['seq']} x micro-batch "
              f"{timed['mb']}; --loss-layers, --loss-seq, --loss-mb choose this one)")
    print(f"  bound at step k: max({a.loss_floor:.3g} x PyTorch bf16's loss, {a.loss_multiple:g} x the largest "
          f"|PyTorch bf16 - PyTorch fp32| of steps 0..k); self-test: hspmd with {BREAK_ENV}={a.loss_break} must "
          f"fail it")
    h, b = lc.get("hspmd", {}), lc.get("broken", {})
    if h.get("steps"):
        print(f"  {'step':>4s} {'fp32':>8s} {'bf16':>8s} {'hspmd':>8s} {'|h-bf16|':>9s} {'bound':>8s} "
              f"{'broken':>8s} {'|b-bf16|':>9s}")
        bs = b.get("steps") or []
        for k, r in enumerate(h["steps"]):
            br = bs[k] if k < len(bs) else None
            print(f"  {k:4d} {r['fp32']:8.4f} {r['bf16']:8.4f} {r['got']:8.4f} {r['deviation']:9.5f} {r['bound']:8.5f} "
                  f"{fmt(br and br['got'], '8.4f'):>8s} {fmt(br and br['deviation'], '9.5f'):>9s}"
                  f"{'  <- over' if r['deviation'] > r['bound'] else ''}"
                  f"{'  (broken over)' if br and br['deviation'] > br['bound'] else ''}")
    if c["status"] in ("PASS", "FAIL") and "max_ratio" in c:
        print(f"RESULT probe=gpu_step case={case(a, 'loss_check')} steps={lc['steps']} layers={lc['layers']} seq={lc['seq']} "
              f"mb={lc['mb']} max_ratio={c['max_ratio']:.3f} worst_step={c['worst_step']} "
              f"worst_dev={c['worst_deviation']:.5f} worst_bound={c['worst_bound']:.5f} "
              f"wall_s={lc.get('wall_s', 0):.0f} status={c['status']}")
    else:
        print(f"RESULT probe=gpu_step case={case(a, 'loss_check')} reason=\"{c.get('reason', '')[:120]}\" status={c['status']}")
    if st["status"] == "PASS":
        print(f"RESULT probe=gpu_step case={case(a, 'loss_check_self_test')} break={BREAK_ENV}={a.loss_break} "
              f"broken_first_fail={st['broken_first_fail']} broken_max_ratio={st['broken_max_ratio']:.3f} status=PASS")
    else:
        print(f"RESULT probe=gpu_step case={case(a, 'loss_check_self_test')} break={BREAK_ENV}={a.loss_break} "
              f"reason=\"{st.get('reason', '')[:120]}\" status={st['status']}")
    if c["status"] == "FAIL":
        print(f"FAIL: loss check: {c.get('reason', '')}")
    if st["status"] == "FAIL":
        print(f"FAIL: loss check's self-test: {st.get('reason', '')}")


def summarize(row, cfg, a, peak_tflops):
    """Adds the step time (the timed span over its steps), tokens/s, MFU to a
    measured row."""
    if row.get("status") != "PASS":
        return row
    tokens = a.seq * a.mb
    if row.get("tokens_per_step", tokens) != tokens:
        row.update(status="FAIL", reason=f"{row['tokens_per_step']} tokens per step, expected {tokens}")
        return row
    if row.get("timed_steps") != a.steps or not row.get("span_s", 0) > 0:
        row.update(status="FAIL", reason=f"no timed span of {a.steps} steps")
        return row
    step = row["span_s"] / a.steps
    row["step_time_s"] = step
    row["tokens_per_s"] = tokens / step
    row["mfu"] = row["tokens_per_s"] * flops_per_token(cfg, a.seq) / (peak_tflops * 1e12) if peak_tflops else None
    return row


def gpu_info(a):
    """{'available': bool, 'name': str} from a child process (this one keeps
    no CUDA context); without torch, from nvidia-smi."""
    code = ("import json, torch; ok = torch.cuda.is_available(); "
            "print(json.dumps({'available': ok, 'name': torch.cuda.get_device_name(0) if ok else ''}))")
    env = dict(os.environ)
    if "GPU_STEP_TORCH_LD_LIBRARY_PATH" in env:
        env["LD_LIBRARY_PATH"] = env["GPU_STEP_TORCH_LD_LIBRARY_PATH"]
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        if r.returncode == 0:
            return dict(json.loads(r.stdout.strip().splitlines()[-1]), torch=True)
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        pass
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=60)
        name = r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else ""
    except (OSError, subprocess.TimeoutExpired):
        name = ""
    return {"available": bool(name), "name": name, "torch": False}


def fmt(v, spec, missing="-"):
    return missing if v is None else format(v, spec)


def case(a, name):
    """A RESULT line's case: `name`, after --label's prefix where one is given
    (scripts/gpu_check.sh runs several shapes into one log)."""
    return f"{a.label}_{name}" if a.label else name


def print_table(rows, report, a):
    print(f"{report['model_type']} hidden {report['config']['hidden_size']} layers "
          f"{report['config']['num_hidden_layers']} heads {report['config']['num_attention_heads']}/"
          f"{report['config'].get('num_key_value_heads')} ffn {report['config']['intermediate_size']} vocab "
          f"{report['config']['vocab_size']}; seq {report['seq']} x micro-batch {report['mb']} = "
          f"{report['tokens_per_step']} tokens/step, bf16; {report['warmup']} warm-up + {report['steps']} timed steps")
    print(f"device: {report['device']}; {report['gflop_per_token']:.4g} GFLOP/token (N = {report['n_matmul']:,}); "
          f"peak {fmt(report['peak_tflops'], '.1f', 'unknown')} TFLOP/s")
    print(f"{'system':9s} {'status':8s} {'step ms':>9s} {'tokens/s':>10s} {'MFU %':>6s} {'peak GiB':>9s} "
          f"{'loss0':>7s}")
    for r in rows:
        mem = r.get("peak_memory_bytes")
        print(f"{r['system']:9s} {r['status']:8s} {fmt(r.get('step_time_s') and 1e3 * r['step_time_s'], '9.1f'):>9s} "
              f"{fmt(r.get('tokens_per_s'), '10.0f'):>10s} {fmt(r.get('mfu') and 100 * r['mfu'], '6.1f'):>6s} "
              f"{fmt(mem and mem / 2**30, '9.2f'):>9s} {fmt((r.get('losses') or [None])[0], '7.3f'):>7s}"
              f"{'  ' + r['reason'] if r.get('reason') else ''}")
    # One machine-readable line per system, as the GPU probes print
    # (docs/gpu.md); tflops= (the model's FLOP/s achieved) marks it as a
    # measurement for gpu_check.sh's summary.
    for r in rows:
        mem = r.get("peak_memory_bytes")
        fields = (f" step_ms={1e3 * r['step_time_s']:.2f} tokens_per_s={r['tokens_per_s']:.0f}"
                  f" tflops={r['tokens_per_s'] * report['gflop_per_token'] / 1e3:.1f}"
                  f" mfu_pct={fmt(r.get('mfu') and 100 * r['mfu'], '.1f')} peak_gib={fmt(mem and mem / 2**30, '.2f')}"
                  if r["status"] == "PASS" else f" reason=\"{r.get('reason', '')[:120]}\"")
        print(f"RESULT probe=gpu_step case={case(a, r['system'])}{fields} status={r['status']}")
    for r in rows:
        if r.get("attention_fallbacks"):
            print(f"WARNING: {r['system']}: {r['attention_fallbacks']} attention calls fell back from cuDNN's fused "
                  f"attention: {r.get('attention_fallback_reason') or 'see its stderr'}")
            print(f"RESULT probe=gpu_step case={case(a, 'attention_fallbacks')} count={r['attention_fallbacks']} status=WARN")
    for r in rows:
        if r.get("queued_s") and r.get("record_step_times_s"):
            q = statistics.median(r["queued_s"])
            st = statistics.median(r["record_step_times_s"])
            # The host's time between two steps' records (the log line, the
            # next step's checks before its clock starts): the span's part
            # that no record's step time covers, per step.
            outside = (r["span_s"] - sum(r["record_step_times_s"])) / len(r["record_step_times_s"])
            print(f"RESULT probe=gpu_step case={case(a, 'hspmd_host_queue')} queued_ms={1e3 * q:.2f} "
                  f"step_ms={1e3 * st:.2f} queued_share={q / st:.3f} between_steps_ms={1e3 * outside:.3f} "
                  f"status=INFO")
            if a.cpu_smoke:
                continue  # the CPU runs each kernel as it is queued: the two are one time
            print(f"hspmd's host queued a step in {1e3 * q:.1f} ms of its {1e3 * st:.1f} ms (median; the device "
                  f"ran the rest without waiting for the host inside the step)" if q < 0.8 * st else
                  f"hspmd's host queued a step in {1e3 * q:.1f} ms of its {1e3 * st:.1f} ms (median): the host, "
                  f"not the device, may bound the step")
    ops = next((r.get("op_times") for r in rows if r["system"] == "hspmd" and r.get("op_times")), None)
    if ops:
        print(f"where hspmd's step goes (one extra step, each op between two events; "
              f"ops {1e3 * ops['ops_total_s']:.1f} ms of {1e3 * ops['step_time_s']:.1f} ms):")
        for o in ops["ops"][:12]:
            print(f"  {o['type']:22s} {o['calls']:5d} calls {1e3 * o['seconds']:9.2f} ms "
                  f"{100 * o['share_of_step']:5.1f}%")
        print(f"  {'(outside ops)':22s} {'':11s} {1e3 * ops['outside_ops_s']:9.2f} ms "
              f"{100 * ops['outside_ops_s'] / ops['step_time_s']:5.1f}%")
    ratio = report.get("hspmd_over_compiled")
    if ratio:
        print(f"RESULT probe=gpu_step case={case(a, 'hspmd_over_compiled')} step_time_x={ratio['step_time']:.3f} "
              f"tokens_per_s_x={ratio['tokens_per_s']:.3f} status=INFO")
        print(f"hspmd / compiled: step time {ratio['step_time']:.2f}x (above 1: hspmd slower), "
              f"tokens/s {ratio['tokens_per_s']:.2f}x" +
              (f", peak memory {ratio['peak_memory']:.2f}x" if ratio.get("peak_memory") else ""))
    else:
        print("hspmd / compiled: not available (a row is missing)")


def smoke_checks(rows, report, a):
    """--cpu-smoke: what the harness must have produced."""
    bad = []
    by = {r["system"]: r for r in rows}
    ln_v = math.log(report["config"]["vocab_size"])
    for name in ("hspmd", "eager"):
        r = by.get(name, {})
        if r.get("status") != "PASS":
            bad.append(f"{name}: status {r.get('status')} {r.get('reason', '')}")
            continue
        if r.get("timed_steps") != a.steps or not r.get("span_s", 0) > 0:
            bad.append(f"{name}: timed span {r.get('span_s')} over {r.get('timed_steps')} steps")
        if abs(r["tokens_per_s"] * r["step_time_s"] - a.seq * a.mb) > 1e-6 * a.seq * a.mb:
            bad.append(f"{name}: tokens/s inconsistent with the step time")
        if not (r["mfu"] and r["mfu"] > 0):
            bad.append(f"{name}: no MFU")
        if len(r["losses"]) != a.warmup + a.steps or abs(r["losses"][0] - ln_v) > 0.25 * ln_v:
            bad.append(f"{name}: losses {r['losses']} (a random model starts near ln V = {ln_v:.2f})")
    if not by.get("hspmd", {}).get("peak_memory_bytes", 0) > 0:
        bad.append("hspmd: no peak_memory_bytes in its records")
    queued, times = by.get("hspmd", {}).get("queued_s") or [], by.get("hspmd", {}).get("record_step_times_s") or []
    if not (len(queued) == a.steps and all(0 < q <= t for q, t in zip(queued, times))):
        bad.append(f"hspmd: queued_s {queued} (the one-process step's time to its one wait, within its step time)")
    ops = by.get("hspmd", {}).get("op_times") or {}
    if not ("matmul" in [o["type"] for o in ops.get("ops", [])] and 0 < ops["ops_total_s"] <= ops["step_time_s"]):
        bad.append("hspmd: no op times (--op-times) for its extra step")
    if by.get("compiled", {}).get("status") not in ("PASS", "SKIP"):
        bad.append(f"compiled: {by.get('compiled')}")
    back = json.load(open(a.json))
    if not a.no_loss_check:
        # The loss check ran on the CPU too: hspmd within its bound, the
        # broken attention outside it, both curves and the bound in the JSON.
        lc = back.get("loss_check", {})
        for key, what in (("check", "loss check"), ("self_test", "loss check's self-test")):
            got = lc.get(key) or {}
            if got.get("status") != "PASS":
                bad.append(f"{what}: status {got.get('status')} (above)")
        for run in ("hspmd", "broken"):
            if len((lc.get(run) or {}).get("steps", [])) != a.loss_steps:
                bad.append(f"loss check: the JSON lacks the {run} run's {a.loss_steps} steps")
        ref = lc.get("torch") or {}
        if any(len((ref.get(m) or {}).get("losses", [])) != a.loss_steps for m in ("bf16", "fp32")):
            bad.append("loss check: the JSON lacks PyTorch's bf16 and fp32 curves")
    if [r["system"] for r in back["rows"]] != list(SYSTEMS):
        bad.append("the JSON file does not hold the three rows")
    if back["gflop_per_token"] <= 0 or back["tokens_per_step"] != a.seq * a.mb:
        bad.append("the JSON file's header is wrong")
    return bad


def find_hspmd():
    for p in (os.path.join(ROOT, "build", "src", "cli", "hspmd"), os.path.join(ROOT, "build-gpu-full", "src", "cli", "hspmd")):
        if os.access(p, os.X_OK):
            return p
    return "hspmd"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="Hugging Face config.json (default: the TinyLlama-1.1B shape)")
    ap.add_argument("--layers", type=int, help="override num_hidden_layers")
    ap.add_argument("--hidden", type=int, help="override hidden_size (heads and FFN follow)")
    ap.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    ap.add_argument("--mb", type=int, default=4, help="micro-batch = global batch (default 4)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first, at least 1 (default 3)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma list of hspmd,eager,compiled")
    ap.add_argument("--hspmd", default=None, help="the hspmd executable (default: build/src/cli/hspmd)")
    ap.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak (default: 989.4 on H100/H200)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per system (default 900)")
    ap.add_argument("--json", help="write the results here (default: gpu_step.json in the temporary dir)")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="hspmd records its step as a CUDA graph after 2 warm-up steps and replays it (needs "
                         "--warmup 3 or more for the timed steps to be replays; ignored with --cpu-smoke)")
    ap.add_argument("--label", default="", help="prefix of the RESULT lines' case names (e.g. the shape's name)")
    ap.add_argument("--cpu-smoke", action="store_true", help="the harness on the CPU with a tiny model")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (--cpu-smoke)")
    lc = ap.add_argument_group("loss check (docs/benchmarks.md, \"Loss check\")")
    lc.add_argument("--no-loss-check", action="store_true", help="skip the loss check and its self-test")
    lc.add_argument("--loss-steps", type=int, default=30, help="steps of the loss check (default 30)")
    lc.add_argument("--loss-seq", type=int, help="its sequence length (default 1024; --cpu-smoke 32)")
    lc.add_argument("--loss-mb", type=int, default=2, help="its micro-batch = global batch (default 2)")
    lc.add_argument("--loss-layers", type=int,
                    help="its layers (default: 4, or the timed model's if fewer; --cpu-smoke: the tiny model's 4)")
    lc.add_argument("--loss-lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    lc.add_argument("--loss-min-lr", type=float, default=1e-4, help="the cosine's final rate (default 1e-4)")
    lc.add_argument("--loss-warmup", type=int, default=5, help="linear warmup steps (default 5)")
    lc.add_argument("--loss-weight-decay", type=float, default=0.1, help="AdamW decay of matrices (default 0.1)")
    lc.add_argument("--loss-clip", type=float, default=1.0, help="gradient-norm clipping, 0 = off (default 1)")
    lc.add_argument("--loss-multiple", type=float, default=LOSS_MULTIPLE,
                    help=f"bound: this many times the bf16-fp32 gap (default {LOSS_MULTIPLE:g})")
    lc.add_argument("--loss-floor", type=float, default=LOSS_FLOOR,
                    help=f"bound: at least this times the loss (default 2^-11 = {LOSS_FLOOR:.3g})")
    lc.add_argument("--loss-break", type=int, default=1,
                    help=f"the self-test's {BREAK_ENV} value: attention sees only the last W keys (default 1)")
    # Internal: one PyTorch system in a child process.
    ap.add_argument("--worker", choices=["eager", "compiled", "loss"], help=argparse.SUPPRESS)
    ap.add_argument("--init-out", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker == "loss":
        return loss_worker(a)
    if a.worker:
        return torch_worker(a)

    systems = [s for s in a.systems.split(",") if s]
    if any(s not in SYSTEMS for s in systems) or not systems:
        ap.error(f"--systems {a.systems}: expected a comma list of {','.join(SYSTEMS)}")
    if min(a.seq, a.mb, a.steps, a.warmup) < 1:
        ap.error("--seq, --mb, --steps and --warmup must be positive (the timed span starts after a warm-up step)")
    if min(a.loss_steps, a.loss_mb, a.loss_seq or 1, a.loss_break) < 1 or (a.loss_layers or 1) < 1 or \
            a.loss_warmup < 0 or a.loss_multiple <= 0 or a.loss_floor < 0:
        ap.error("--loss-steps, --loss-mb, --loss-seq, --loss-layers, --loss-break and --loss-multiple must be "
                 "positive, --loss-warmup and --loss-floor not negative")
    a.hspmd = a.hspmd or find_hspmd()
    # A `timeout` around this script stops it with SIGTERM: the system running
    # then (in its own session) must not keep the GPU.
    signal.signal(signal.SIGTERM, stop_children)
    if a.cpu_smoke:
        device = "cpu"
        base = json.load(open(a.model or os.path.join(ROOT, "examples", "tiny-llama", "config.json")))
        if "--seq" not in sys.argv:
            a.seq = 64
        if "--mb" not in sys.argv:
            a.mb = 2
        if "--warmup" not in sys.argv:
            a.warmup = 1
        if "--steps" not in sys.argv:
            a.steps = 2
        a.loss_seq = a.loss_seq or 32
        peak = a.peak_tflops or 1.0  # nominal: exercises the MFU arithmetic only
        info = {"available": False, "name": "cpu (smoke: times say nothing about GPUs)"}
    else:
        device = "cuda"
        base = json.load(open(a.model)) if a.model else dict(TINYLLAMA)
        info = gpu_info(a)
        if not info["available"]:
            print("SKIP: no CUDA device visible (gpu_step needs one; --cpu-smoke runs the harness on the CPU)")
            return 77
        peak = a.peak_tflops or (H100_H200_BF16_TFLOPS if any(g in info["name"] for g in ("H100", "H200")) else None)
    cfg = run_config(base, a.layers, a.hidden, a.seq)
    total, n_matmul = param_counts(cfg)
    a.loss_seq = a.loss_seq or 1024
    a.loss_layers = a.loss_layers or min(4, cfg["num_hidden_layers"])
    with tempfile.TemporaryDirectory(prefix="gpu_step-") as tmp:
        a.json = a.json or os.path.join(tmp, "gpu_step.json")
        cfg_path = os.path.join(tmp, "config.json")
        json.dump(cfg, open(cfg_path, "w"), indent=1)
        data = os.path.join(tmp, "tokens.bin")
        write_tokens(data, cfg["vocab_size"], (a.warmup + a.steps) * a.mb * a.seq + 1, a.seed + 1)
        # The loss check first: a wrong model matters more than a timing, and
        # its verdict is printed before the timed runs can use up the time.
        lcheck = None
        if os.environ.get(BREAK_ENV, "0") not in ("", "0"):
            print(f"WARNING: {BREAK_ENV}={os.environ[BREAK_ENV]} is set: every hspmd run here computes a "
                  f"deliberately wrong attention (a test-only switch)", file=sys.stderr, flush=True)
        if not a.no_loss_check:
            lcheck = loss_check(a, base, device, tmp, info)
            lcheck["timed_shape"] = {"layers": cfg["num_hidden_layers"], "seq": a.seq, "mb": a.mb}
            print_loss_check(lcheck, a)
            sys.stdout.flush()
        else:
            print(f"RESULT probe=gpu_step case={case(a, 'loss_check')} reason=\"--no-loss-check\" status=SKIP")
        rows = []
        for s in SYSTEMS:
            if s not in systems:
                rows.append({"system": s, "status": "SKIP", "reason": "not in --systems"})
                continue
            t0 = time.time()
            if s == "hspmd":
                row = run_hspmd(a, cfg_path, data, tmp, device)
            elif not info.get("torch", True) and device == "cuda":
                row = {"system": s, "status": "SKIP", "reason": f"no torch in {sys.executable}"}
            else:
                row = run_torch(a, s, cfg_path, data, tmp, device)
            row["wall_s"] = time.time() - t0
            rows.append(summarize(row, cfg, a, peak))
            print(f"[gpu_step] {s}: {row['status']} in {row['wall_s']:.0f} s", file=sys.stderr, flush=True)
        if device == "cuda" and rows[0]["status"] == "NO_DEVICE":
            print("SKIP: " + rows[0]["reason"])
            return 77
        report = {
            "bench": "gpu_step", "unix_time": time.time(), "device": info["name"],
            "model": a.model or "TinyLlama-1.1B shape (built in)", "model_type": cfg.get("model_type", "llama"),
            "config": cfg, "seq": a.seq, "mb": a.mb, "warmup": a.warmup, "steps": a.steps,
            "tokens_per_step": a.seq * a.mb, "n_params": total, "n_matmul": n_matmul,
            "gflop_per_token": flops_per_token(cfg, a.seq) / 1e9, "peak_tflops": peak,
            "peak_is_nominal": a.cpu_smoke and not a.peak_tflops, "rows": rows,
            "loss_check": lcheck or {"check": {"status": "SKIP", "reason": "--no-loss-check"},
                                     "self_test": {"status": "SKIP", "reason": "--no-loss-check"}},
        }
        by = {r["system"]: r for r in rows}
        h, c = by["hspmd"], by["compiled"]
        if h.get("status") == "PASS" and c.get("status") == "PASS":
            report["hspmd_over_compiled"] = {
                "step_time": h["step_time_s"] / c["step_time_s"],
                "tokens_per_s": h["tokens_per_s"] / c["tokens_per_s"],
                "peak_memory": (h["peak_memory_bytes"] / c["peak_memory_bytes"]
                                if h.get("peak_memory_bytes") and c.get("peak_memory_bytes") else None)}
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
        print_table(rows, report, a)
        print(f"json: {a.json}" + (" (removed with the temporary directory: pass --json)" if a.json.startswith(tmp) else ""))
        if a.cpu_smoke:
            bad = smoke_checks(rows, report, a)
            for b in bad:
                print("FAIL: " + b)
            if bad:
                return 1
            print("gpu_step harness on the CPU: OK")
        bad_loss = lcheck is not None and any(lcheck[k]["status"] in ("FAIL", "TIMEOUT") for k in ("check", "self_test"))
        return 1 if bad_loss or any(r["status"] in ("FAIL", "TIMEOUT") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
