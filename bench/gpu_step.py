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
initialization each. Per system: the median step time over the timed steps
(after --warmup untimed ones), tokens/s, MFU, peak GPU memory and the first
step's loss; then hspmd over compiled. Output: a table on stdout and a JSON
file (--json).

  MFU = tokens/s * (6 N + 6 L H S) / peak.  N: the parameters that enter a
  matmul (all but the input embedding table, unless it is tied to the LM
  head; norm weights and biases counted too); L layers, H hidden, S
  sequence: attention's score and value products, causal (half the square),
  forward and backward. Peak: 989.4 TFLOP/s (dense bf16 of an H100 / H200)
  for a GPU whose name says H100 or H200, else --peak-tflops (without it
  MFU is left out).

Step times are wall-clock: hspmd's `step_time_s` (from the step's start to
its record: the loss and gradient norm are read back, so the device has
finished the backward; the optimizer's kernels may end in the next step's
time); PyTorch's from torch.cuda.synchronize() to torch.cuda.synchronize()
around forward, backward, optimizer step and zero_grad. Peak memory: hspmd's
`peak_memory_bytes` (its device allocator's peak bytes in use during a step:
the state, activations, gradients; not the CUDA context, cuBLAS / cuDNN
workspaces of their own, nor cached free blocks); PyTorch's
torch.cuda.max_memory_allocated() over the timed steps (its caching
allocator's bytes in use; max_memory_reserved is in the JSON too).

  bench/gpu_step.py                              # TinyLlama shape, S 4096, B 4
  bench/gpu_step.py --layers 2 --seq 1024 --mb 2 --steps 5   # tens of seconds
  bench/gpu_step.py --model path/to/config.json --json out.json
  /usr/bin/python3 bench/gpu_step.py --cpu-smoke # the harness on the CPU

--cpu-smoke runs the same harness on the CPU (the tiny example model,
`hspmd train --device cpu`, PyTorch's CPU autocast; the compiled row is
skipped where torch has no torch.compile) and checks its own results: the
CTest gpu_step_bench_harness_on_cpu. Its times say nothing about GPUs.

Exit codes: 0 every system measured (or skipped for a reason printed), 1 a
system failed or timed out (its row says how), 77 GPU mode without a CUDA
device (CTest: skipped), 2 bad arguments.
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
        rows = [tokens[i * s:i * s + s + 1] for i in range(k * bsz, k * bsz + bsz)]
        t = torch.stack(rows).to(dev)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    times, losses = [], []
    for k in range(a.warmup + a.steps):
        ids, targets = batch(k)
        if k == a.warmup and dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        sync()
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = step_fn(ids, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if k >= a.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    result.update(status="PASS", step_times_s=times, losses=losses,
                  attention=attention,
                  optimizer="AdamW fused" if fused else "AdamW")
    if dev.type == "cuda":
        result.update(device=torch.cuda.get_device_name(dev),
                      peak_memory_bytes=torch.cuda.max_memory_allocated(dev),
                      peak_reserved_bytes=torch.cuda.max_memory_reserved(dev))
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


def run_limited(cmd, timeout, env=None):
    """(return code or 'TIMEOUT', stderr tail); the whole process group is
    killed at the limit (torch.compile's workers too)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    CHILDREN.append(p)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return "TIMEOUT", (err or "")[-2000:]
    finally:
        CHILDREN.remove(p)
    return p.returncode, (err or "")[-2000:]


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
    row.update(status="PASS", step_times_s=[r["step_time_s"] for r in timed],
               losses=[r["loss"] for r in recs[:a.warmup + a.steps]], tokens_per_step=timed[0]["tokens"])
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


def summarize(row, cfg, a, peak_tflops):
    """Adds median step time, tokens/s, MFU to a measured row."""
    if row.get("status") != "PASS":
        return row
    tokens = a.seq * a.mb
    if row.get("tokens_per_step", tokens) != tokens:
        row.update(status="FAIL", reason=f"{row['tokens_per_step']} tokens per step, expected {tokens}")
        return row
    step = statistics.median(row["step_times_s"])
    row["step_time_s_median"] = step
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


def print_table(rows, report):
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
        print(f"{r['system']:9s} {r['status']:8s} {fmt(r.get('step_time_s_median') and 1e3 * r['step_time_s_median'], '9.1f'):>9s} "
              f"{fmt(r.get('tokens_per_s'), '10.0f'):>10s} {fmt(r.get('mfu') and 100 * r['mfu'], '6.1f'):>6s} "
              f"{fmt(mem and mem / 2**30, '9.2f'):>9s} {fmt((r.get('losses') or [None])[0], '7.3f'):>7s}"
              f"{'  ' + r['reason'] if r.get('reason') else ''}")
    for r in rows:  # one machine-readable line per system, as the GPU probes print (docs/gpu.md)
        mem = r.get("peak_memory_bytes")
        fields = (f" median_ms={1e3 * r['step_time_s_median']:.2f} tokens_per_s={r['tokens_per_s']:.0f}"
                  f" mfu_pct={fmt(r.get('mfu') and 100 * r['mfu'], '.1f')} peak_gib={fmt(mem and mem / 2**30, '.2f')}"
                  if r["status"] == "PASS" else f" reason=\"{r.get('reason', '')[:120]}\"")
        print(f"RESULT probe=gpu_step case={r['system']}{fields} status={r['status']}")
    for r in rows:
        if r.get("attention_fallbacks"):
            print(f"WARNING: {r['system']}: {r['attention_fallbacks']} attention calls fell back from cuDNN's fused "
                  f"attention: {r.get('attention_fallback_reason') or 'see its stderr'}")
            print(f"RESULT probe=gpu_step case=attention_fallbacks count={r['attention_fallbacks']} status=WARN")
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
        print(f"RESULT probe=gpu_step case=hspmd_over_compiled step_time_x={ratio['step_time']:.3f} "
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
        if len(r["step_times_s"]) != a.steps or not all(t > 0 for t in r["step_times_s"]):
            bad.append(f"{name}: step times {r['step_times_s']}")
        if abs(r["tokens_per_s"] * r["step_time_s_median"] - a.seq * a.mb) > 1e-6 * a.seq * a.mb:
            bad.append(f"{name}: tokens/s inconsistent with the step time")
        if not (r["mfu"] and r["mfu"] > 0):
            bad.append(f"{name}: no MFU")
        if len(r["losses"]) != a.warmup + a.steps or abs(r["losses"][0] - ln_v) > 0.25 * ln_v:
            bad.append(f"{name}: losses {r['losses']} (a random model starts near ln V = {ln_v:.2f})")
    if not by.get("hspmd", {}).get("peak_memory_bytes", 0) > 0:
        bad.append("hspmd: no peak_memory_bytes in its records")
    ops = by.get("hspmd", {}).get("op_times") or {}
    if not ("matmul" in [o["type"] for o in ops.get("ops", [])] and 0 < ops["ops_total_s"] <= ops["step_time_s"]):
        bad.append("hspmd: no op times (--op-times) for its extra step")
    if by.get("compiled", {}).get("status") not in ("PASS", "SKIP"):
        bad.append(f"compiled: {by.get('compiled')}")
    back = json.load(open(a.json))
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
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma list of hspmd,eager,compiled")
    ap.add_argument("--hspmd", default=None, help="the hspmd executable (default: build/src/cli/hspmd)")
    ap.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak (default: 989.4 on H100/H200)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per system (default 900)")
    ap.add_argument("--json", help="write the results here (default: gpu_step.json in the temporary dir)")
    ap.add_argument("--cpu-smoke", action="store_true", help="the harness on the CPU with a tiny model")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (--cpu-smoke)")
    # Internal: one PyTorch system in a child process.
    ap.add_argument("--worker", choices=["eager", "compiled"], help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return torch_worker(a)

    systems = [s for s in a.systems.split(",") if s]
    if any(s not in SYSTEMS for s in systems) or not systems:
        ap.error(f"--systems {a.systems}: expected a comma list of {','.join(SYSTEMS)}")
    if min(a.seq, a.mb, a.steps) < 1 or a.warmup < 0:
        ap.error("--seq, --mb and --steps must be positive, --warmup not negative")
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
    with tempfile.TemporaryDirectory(prefix="gpu_step-") as tmp:
        a.json = a.json or os.path.join(tmp, "gpu_step.json")
        cfg_path = os.path.join(tmp, "config.json")
        json.dump(cfg, open(cfg_path, "w"), indent=1)
        data = os.path.join(tmp, "tokens.bin")
        write_tokens(data, cfg["vocab_size"], (a.warmup + a.steps) * a.mb * a.seq + 1, a.seed + 1)
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
        }
        by = {r["system"]: r for r in rows}
        h, c = by["hspmd"], by["compiled"]
        if h.get("status") == "PASS" and c.get("status") == "PASS":
            report["hspmd_over_compiled"] = {
                "step_time": h["step_time_s_median"] / c["step_time_s_median"],
                "tokens_per_s": h["tokens_per_s"] / c["tokens_per_s"],
                "peak_memory": (h["peak_memory_bytes"] / c["peak_memory_bytes"]
                                if h.get("peak_memory_bytes") and c.get("peak_memory_bytes") else None)}
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
        print_table(rows, report)
        print(f"json: {a.json}" + (" (removed with the temporary directory: pass --json)" if a.json.startswith(tmp) else ""))
        if a.cpu_smoke:
            bad = smoke_checks(rows, report, a)
            for b in bad:
                print("FAIL: " + b)
            if bad:
                return 1
            print("gpu_step harness on the CPU: OK")
        return 1 if any(r["status"] in ("FAIL", "TIMEOUT") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
