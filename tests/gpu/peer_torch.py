#!/usr/bin/env python3
"""peer_torch: the GPU probes' timing shapes through PyTorch, as a peer to
compare against (same GPU, same shapes, same median-of-cudaEvents method).

 - bf16 matmul 8192^3 (Y = X W^T) and the MLP shape (4096 tokens, 4096 ->
   11008): F.linear, F.linear + bias + tanh-GELU eager, and torch.compile'd
   (in a child process with a time limit, since compiling may be slow);
 - F.scaled_dot_product_attention, causal, enable_gqa=True, forward and
   backward, at probe_cudnn_sdpa's shapes, with the default backend choice and
   with the cuDNN and flash backends forced (UNSUPPORTED where refused).

Prints one `RESULT probe=peer_torch ...` line per result. Exit 0 when nothing
failed, 1 when a check failed, 77 (skip) without torch or a CUDA device.
"""
import os
import signal
import statistics
import subprocess
import sys
import time

COMPILE_TIMEOUT_S = float(os.environ.get("PEER_TORCH_COMPILE_TIMEOUT", "75"))
failures = 0


def result(case, status, **kv):
    global failures
    if status == "FAIL":
        failures += 1
    fields = " ".join(f"{k}={v}" for k, v in kv.items())
    print(f"RESULT probe=peer_torch case={case} {fields} status={status}", flush=True)


def short(exc):
    msg = f"{type(exc).__name__}: {exc}".replace('"', "'").replace("\n", " ")
    return '"' + msg[:240] + '"'


def bench(torch, fn, warm=20, reps=50):
    """Median milliseconds of fn() over reps runs after warm runs."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    evs = []
    for _ in range(reps):
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        evs.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in evs)


def rel_err(torch, out, ref):
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return (torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref)).item()


def mlp_inputs(torch):
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    w = (torch.randn(11008, 4096, device="cuda", dtype=torch.float32, generator=g) / 64).bfloat16()
    b = (torch.randn(11008, device="cuda", dtype=torch.float32, generator=g) * 0.5).bfloat16()
    return x, w, b


def tflops(flops, ms):
    return f"{flops / (ms * 1e-3) / 1e12:.1f}"


def matmuls(torch, F):
    g = torch.Generator(device="cuda").manual_seed(0)
    n = 8192
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=g)
    y = F.linear(x, w)
    ref = F.linear(x.float(), w.float())  # fp32, TF32 off
    err = rel_err(torch, y, ref)
    del ref
    ms = bench(torch, lambda: F.linear(x, w))
    result("bf16_8192cube", "PASS" if err <= 1e-2 else "FAIL", M=n, N=n, K=n, rel_err=f"{err:.2e}",
           median_ms=f"{ms:.4f}", tflops=tflops(2 * n**3, ms))
    del x, w, y

    x, w, b = mlp_inputs(torch)
    fl = 2 * 4096 * 11008 * 4096
    ms = bench(torch, lambda: F.linear(x, w))
    result("mlp_fwd", "INFO", M=4096, N=11008, K=4096, median_ms=f"{ms:.4f}", tflops=tflops(fl, ms))

    def fwd():
        return F.gelu(F.linear(x, w, b), approximate="tanh")

    y = fwd()
    ref = F.gelu(F.linear(x.float(), w.float(), b.float()), approximate="tanh")
    err = rel_err(torch, y, ref)
    del ref
    ms = bench(torch, fwd)
    result("mlp_linear_bias_gelu_eager", "PASS" if err <= 1e-2 else "FAIL", M=4096, N=11008, K=4096,
           rel_err=f"{err:.2e}", median_ms=f"{ms:.4f}", tflops=tflops(fl, ms))


def compiled_child():
    """Run in a child process: torch.compile the MLP layer, time it."""
    import torch
    import torch.nn.functional as F
    torch.backends.cuda.matmul.allow_tf32 = False
    x, w, b = mlp_inputs(torch)

    def fwd(x, w, b):
        return F.gelu(F.linear(x, w, b), approximate="tanh")

    t0 = time.time()
    cf = torch.compile(fwd)
    y = cf(x, w, b)
    torch.cuda.synchronize()
    compile_s = time.time() - t0
    ref = fwd(x.float(), w.float(), b.float())
    err = rel_err(torch, y, ref)
    del ref
    ms = bench(torch, lambda: cf(x, w, b))
    fl = 2 * 4096 * 11008 * 4096
    result("mlp_linear_bias_gelu_compiled", "PASS" if err <= 1e-2 else "FAIL", M=4096, N=11008, K=4096,
           rel_err=f"{err:.2e}", compile_s=f"{compile_s:.1f}", median_ms=f"{ms:.4f}", tflops=tflops(fl, ms))
    return 1 if failures else 0


def compiled():
    # Own process group (killed whole on timeout), and inductor compiling in
    # process: no worker pool left behind to load the machine afterwards.
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS="1")
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--compile-child"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=COMPILE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
        p.communicate()
        result("mlp_linear_bias_gelu_compiled", "TIMEOUT", limit_s=int(COMPILE_TIMEOUT_S))
        return
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    for ln in lines:
        print(ln, flush=True)
        if ln.endswith("status=FAIL"):
            global failures
            failures += 1
    if not lines:
        tail = (stderr or stdout).strip().splitlines()[-1:] or ["no output"]
        result("mlp_linear_bias_gelu_compiled", "UNSUPPORTED", rc=p.returncode, msg=short(RuntimeError(tail[0])))


def sdpa(torch, F):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    shapes = [  # name, B, Hq, Hkv, S, D, reference check
        ("d128_s1024", 2, 8, 2, 1024, 128, True),
        ("d64_s1024", 2, 8, 2, 1024, 64, True),
        ("perf_d128_s4096", 2, 32, 8, 4096, 128, False),
    ]
    backends = [("default", None), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                ("flash", SDPBackend.FLASH_ATTENTION)]
    for name, B, Hq, Hkv, S, D, check in shapes:
        g = torch.Generator(device="cuda").manual_seed(2)
        q = torch.randn(B, Hq, S, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        k = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        v = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        do = torch.randn(B, Hq, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
        ref = None
        if check:  # fp32 math reference, K/V heads repeated for the groups
            qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
            rep = Hq // Hkv
            with sdpa_kernel([SDPBackend.MATH]):
                of = F.scaled_dot_product_attention(qf, kf.repeat_interleave(rep, 1),
                                                    vf.repeat_interleave(rep, 1), is_causal=True)
            gq, gk, gv = torch.autograd.grad(of, (qf, kf, vf), do.float())
            ref = (of.detach(), gq, gk, gv)
        fl = 4 * B * Hq * S * S * D / 2
        shape = dict(B=B, Hq=Hq, Hkv=Hkv, S=S, D=D)
        for bname, backend in backends:
            case = f"sdpa_{name}_{bname}"
            try:
                ctx = sdpa_kernel([backend]) if backend is not None else _nullctx()
                with ctx:
                    def fwd():
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                    out = fwd()
                    grads = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
                    fwd_ms = bench(torch, fwd)
                    bwd_ms = bench(torch, lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True))
                errs = {}
                ok = True
                if ref is not None:
                    for key, a, r in zip(("err", "dq_err", "dk_err", "dv_err"), (out,) + tuple(grads), ref):
                        e = rel_err(torch, a.detach(), r)
                        errs[key] = f"{e:.2e}"
                        ok = ok and e <= 2e-2
                result(case, "PASS" if ok else "FAIL", **shape, **errs,
                       fwd_ms=f"{fwd_ms:.4f}", fwd_tflops=tflops(fl, fwd_ms),
                       bwd_ms=f"{bwd_ms:.4f}", bwd_tflops=tflops(2.5 * fl, bwd_ms))
                del out, grads
            except Exception as exc:  # a backend that refuses the shape or GQA
                result(case, "UNSUPPORTED", **shape, msg=short(exc))
        del q, k, v, do, ref
        torch.cuda.empty_cache()


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def main():
    if "--compile-child" in sys.argv:
        return compiled_child()
    try:
        import torch
        import torch.nn.functional as F
    except Exception as exc:
        print(f"SKIP probe=peer_torch reason={short(exc)}", flush=True)
        return 77
    if not torch.cuda.is_available():
        print('SKIP probe=peer_torch reason="torch.cuda.is_available() is False"', flush=True)
        return 77
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    print(f"INFO probe=peer_torch torch={torch.__version__} cuda={torch.version.cuda} "
          f"cudnn={torch.backends.cudnn.version()} device=\"{torch.cuda.get_device_name(0)}\"", flush=True)
    for part in (matmuls, sdpa):
        try:
            part(torch, F)
        except Exception as exc:
            result(part.__name__, "FAIL", msg=short(exc))
        torch.cuda.empty_cache()
    compiled()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
