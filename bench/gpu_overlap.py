#!/usr/bin/env python3
"""The overlapped gradient synchronization, measured: data parallelism over
two ranks sharing one GPU (`hspmd train --device cuda:0 --nproc 2`, the
staged MPI communicator, docs/comm.md), bf16, the TinyLlama-1.1B shape by
default, trained with `--overlap` and with `--no-overlap` in one call. Per
mode: the median step and the exposed gradient synchronization (the step
records' `grad_sync_s`: the slowest rank's, median over the steps after the
first), and whether the two modes' losses and gradient norms are the same
bit for bit.

  python3 bench/gpu_overlap.py [--hspmd build/src/cli/hspmd] [--device cuda:0] [--seq-len 2048]
  python3 bench/gpu_overlap.py --device cpu:1 --model bench/configs/reference.json --seq-len 64 --steps 3 \
      --no-speed-check   # the harness on the device test double

The PyTorch peer runs in the same call where torch imports (--peer): the
same model (bench/gpu_step.py's) as two ranks of DistributedDataParallel
over gloo on the same device (NCCL refuses two ranks on one GPU; gloo stages
CUDA tensors through the host, as hspmd's staged communicator does), with
DDP's overlapped buckets, and again with every gradient all-reduced after
the backward.

Prints a table and `RESULT probe=gpu_overlap ...` lines; status PASS when
the losses are identical and the overlap exposes less synchronization than
the synchronization after the schedule. Writes --json. Exits 77 (skipped)
when --device is a GPU and none is visible, 1 on a failure.
"""
import argparse
import contextlib
import json
import os
import random
import socket
import statistics
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from gpu_step import TINYLLAMA, read_tokens, torch_llama  # noqa: E402  (the GPU step benchmark's model)


def ddp_worker(a):
    """One rank of the PyTorch peer: DistributedDataParallel over gloo (NCCL
    refuses two ranks on one GPU; gloo stages CUDA tensors through the host,
    as hspmd's staged communicator does), fp32 masters, bf16 autocast, AdamW.
    `--peer-mode ddp`: DDP's bucketed all-reduce overlapped with the backward
    (bucket_cap_mb 25, its default); `after`: no DDP, each gradient
    all-reduced after the backward. Rank 0 writes its step times, losses and
    the after-backward all-reduce times to a.out."""
    import time
    import torch
    import torch.distributed as dist

    cfg = json.load(open(a.config))
    dev = torch.device(a.torch_device)
    if dev.type == "cpu":
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(dev)
    dist.init_process_group("gloo", rank=a.rank, world_size=2)
    model, _ = torch_llama(cfg, a.seq_len, 0)
    model = model.to(dev)
    net = torch.nn.parallel.DistributedDataParallel(model) if a.peer_mode == "ddp" else model
    fused = {"fused": True} if dev.type == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, **fused)
    tokens = torch.tensor(read_tokens(a.data), dtype=torch.int64)
    s, mb, m = a.seq_len, a.micro_batch_size, a.micro_batches

    def rows(step, micro):  # this rank's rows of the global batch, as hspmd's DP 2 reads them
        first = (step * 2 + a.rank) * m * mb + micro * mb
        t = torch.stack([tokens[i * s:i * s + s + 1] for i in range(first, first + mb)]).to(dev)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    times, losses, after = [], [], []
    for step in range(a.steps):
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        total = 0.0
        for micro in range(m):
            ids, targets = rows(step, micro)
            ctx = net.no_sync() if a.peer_mode == "ddp" and micro + 1 < m else contextlib.nullcontext()
            with ctx:
                with torch.autocast(dev.type, dtype=torch.bfloat16):
                    loss = net(ids, targets) / m
                loss.backward()
            total += float(loss.detach())
        if a.peer_mode == "after":
            sync()
            t1 = time.perf_counter()
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad.div_(2)
            sync()
            after.append(time.perf_counter() - t1)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(total)
    if a.rank == 0:
        json.dump({"step_times_s": times, "losses": losses, "after_backward_sync_s": after,
                   "torch": torch.__version__}, open(a.out, "w"))
    dist.destroy_process_group()
    return 0


def run_peer(a, model, data, tmp, mode):
    """The two ranks of the PyTorch peer in `mode`; its result, or an error string."""
    with socket.socket() as probe:  # a port free now, for the ranks' rendezvous
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    out = os.path.join(tmp, f"peer_{mode}.json")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
    # The torch processes may need another library path than hspmd's (pip's
    # CUDA libraries against the toolkit's): scripts/gpu_check.sh sets it.
    if "GPU_STEP_TORCH_LD_LIBRARY_PATH" in env:
        env["LD_LIBRARY_PATH"] = env["GPU_STEP_TORCH_LD_LIBRARY_PATH"]
    procs = [subprocess.Popen([a.peer_python, os.path.abspath(__file__), "--ddp-worker", "--rank", str(r),
                               "--peer-mode", mode, "--config", model, "--data", data, "--out", out,
                               "--torch-device", a.torch_device, "--seq-len", str(a.seq_len),
                               "--micro-batch-size", str(a.micro_batch_size),
                               "--micro-batches", str(a.micro_batches), "--steps", str(a.steps)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(2)]
    errs = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            return f"timed out after {a.timeout} s"
        if p.returncode:
            errs.append(err.strip()[-300:])
    if errs:
        return errs[0]
    return json.load(open(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", default=os.path.join(ROOT, "build/src/cli/hspmd"))
    ap.add_argument("--model", default="", help="Hugging Face config.json (default: the TinyLlama-1.1B shape)")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch-size", type=int, default=1,
                    help="per rank (1: both ranks of the 1.1B shape fit an 80 GB H100 with f32 activations)")
    ap.add_argument("--micro-batches", type=int, default=1,
                    help="per rank (only the last micro-batch's backward can overlap: 1 lets the whole backward)")
    ap.add_argument("--grad-reduce-dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=300, help="seconds per run")
    ap.add_argument("--json", default="")
    ap.add_argument("--peer", default="auto", choices=["auto", "on", "off"],
                    help="the PyTorch DDP peer (gloo) in the same call: auto runs it when torch imports")
    ap.add_argument("--peer-python", default=sys.executable, help="the Python with PyTorch for the peer")
    ap.add_argument("--torch-device", default="", help="the peer's device (default: --device; cpu for cpu:1)")
    # A peer rank (internal): python3 gpu_overlap.py --ddp-worker ...
    ap.add_argument("--ddp-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--peer-mode", default="ddp", help=argparse.SUPPRESS)
    ap.add_argument("--config", default="", help=argparse.SUPPRESS)
    ap.add_argument("--data", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--no-speed-check", action="store_true",
                    help="PASS without the exposed-time comparison (the harness on the CPU, whose times mean "
                         "nothing for a device)")
    a = ap.parse_args()
    if not a.torch_device:
        a.torch_device = "cpu" if a.device.startswith("cpu") else a.device
    if a.ddp_worker:
        return ddp_worker(a)
    if a.steps < 2:
        sys.exit("--steps must be at least 2 (the first step is warm-up)")
    tmp = tempfile.mkdtemp(prefix="hspmd_gpu_overlap_")
    cfg = json.load(open(a.model)) if a.model else dict(TINYLLAMA)
    cfg["max_position_embeddings"] = max(cfg.get("max_position_embeddings", 0), a.seq_len)
    model = os.path.join(tmp, "config.json")
    json.dump(cfg, open(model, "w"))
    data = os.path.join(tmp, "data.bin")
    rng = random.Random(0)
    tokens = 2 * a.micro_batch_size * a.micro_batches * a.seq_len * (a.steps + 1) + 1
    with open(data, "wb") as f:
        f.write(b"".join(struct.pack("<I", rng.randrange(cfg["vocab_size"])) for _ in range(tokens)))
    pipe = lambda r: {"micro_batch_size": a.micro_batch_size, "micro_batches": a.micro_batches,
                      "stages": [{"ranks": [r], "layers": [0, cfg["num_hidden_layers"] - 1]}]}
    strategy = os.path.join(tmp, "dp2.json")
    json.dump({"pipelines": [pipe(0), pipe(1)]}, open(strategy, "w"))
    print(f"DP 2 on {a.device}, {a.precision} (gradients reduced in {a.grad_reduce_dtype}), hidden {cfg['hidden_size']} x {cfg['num_hidden_layers']} layers, "
          f"seq {a.seq_len}, {a.micro_batches} micro-batches of {a.micro_batch_size} per rank, {a.steps} steps")
    out, failed = {}, False
    for mode in ("overlap", "no-overlap"):
        log = os.path.join(tmp, mode + ".jsonl")
        cmd = [a.hspmd, "train", "--model", model, "--data", data, "--strategy", strategy, "--nproc", "2",
               "--seq-len", str(a.seq_len), "--steps", str(a.steps), "--precision", a.precision,
               "--device", a.device, "--threads", "1", "--quiet", "--log", log, "--" + mode]
        if a.precision == "bf16":
            cmd += ["--grad-reduce-dtype", a.grad_reduce_dtype]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
            rc, err = r.returncode, r.stderr.strip()
        except subprocess.TimeoutExpired:
            rc, err = 124, f"timed out after {a.timeout} s"
        if rc and ("no CUDA device" in err or "no CUDA backend" in err):
            print(f"SKIP gpu_overlap: {err}")
            return 77
        if rc:
            print(f"RESULT probe=gpu_overlap case={mode} error=\"{err[-300:]}\" status=FAIL")
            failed = True
            continue
        recs = [json.loads(line) for line in open(log) if '"loss"' in line]
        out[mode] = {
            "losses": [x["loss"] for x in recs], "grad_norms": [x["grad_norm"] for x in recs],
            "median_step_s": statistics.median(x["step_time_s"] for x in recs[1:]),
            "exposed_grad_sync_s": statistics.median(max(x["grad_sync_s"]) for x in recs[1:]),
            "overlapped_grads": min(sum(x.get("grad_sync_overlapped", [0])) for x in recs),
        }
    if len(out) < 2:
        return 1
    on, off = out["overlap"], out["no-overlap"]
    same = on["losses"] == off["losses"] and on["grad_norms"] == off["grad_norms"]
    lower = on["exposed_grad_sync_s"] < off["exposed_grad_sync_s"]
    # The PyTorch peer in the same call: DDP (overlapped buckets) and the
    # same ranks all-reducing after the backward.
    peers = {}
    probe_env = dict(os.environ)
    if "GPU_STEP_TORCH_LD_LIBRARY_PATH" in probe_env:
        probe_env["LD_LIBRARY_PATH"] = probe_env["GPU_STEP_TORCH_LD_LIBRARY_PATH"]
    want_peer = a.peer == "on" or (a.peer == "auto" and subprocess.run(
        [a.peer_python, "-c", "import torch.distributed as d; assert d.is_available()"],
        capture_output=True, env=probe_env).returncode == 0)
    if want_peer:
        for mode in ("ddp", "after"):
            got = run_peer(a, model, data, tmp, mode)
            if isinstance(got, str):
                print(f"RESULT probe=gpu_overlap case=torch_{mode} error=\"{got}\" status=FAIL")
                failed = True
                continue
            times = got["step_times_s"][1:]
            peers[mode] = {"median_step_s": statistics.median(times), "torch": got["torch"],
                           "exposed_grad_sync_s": statistics.median(got["after_backward_sync_s"][1:])
                           if got["after_backward_sync_s"] else None, "losses": got["losses"]}
    print(f"{'system':28s} {'median step':>12s} {'exposed sync':>13s} {'share':>6s}")
    for mode, m in out.items():
        print(f"{'hspmd --' + mode:28s} {m['median_step_s']:11.4f}s {m['exposed_grad_sync_s']:12.4f}s "
              f"{m['exposed_grad_sync_s'] / m['median_step_s']:6.1%}")
    names = {"ddp": "torch DDP (gloo, overlapped)", "after": "torch, all-reduce after"}
    for mode, m in peers.items():
        sync = m["exposed_grad_sync_s"]
        print(f"{names[mode]:28s} {m['median_step_s']:11.4f}s "
              + (f"{sync:12.4f}s {sync / m['median_step_s']:6.1%}" if sync is not None else f"{'-':>13s}"))
    if "ddp" in peers:
        speed = peers["ddp"]["median_step_s"] / on["median_step_s"]
        print(f"hspmd --overlap runs at {speed:.2f}x torch DDP's speed (median steps; torch {peers['ddp']['torch']})")
        print(f"RESULT probe=gpu_overlap case=torch_ddp median_ms={peers['ddp']['median_step_s'] * 1e3:.1f} "
              f"hspmd_speedup={speed:.3f} status=PASS")
    print(f"losses and gradient norms {'bit-identical' if same else 'DIFFER'}; "
          f"{on['overlapped_grads']} gradients handed over during the last backward; exposed sync "
          f"{on['exposed_grad_sync_s'] / off['exposed_grad_sync_s']:.2f}x of the sync after the schedule")
    ok = same and (lower or a.no_speed_check) and on["overlapped_grads"] > 0 and not failed
    print(f"RESULT probe=gpu_overlap case=dp2_{a.precision} step_on_ms={on['median_step_s'] * 1e3:.1f} "
          f"step_off_ms={off['median_step_s'] * 1e3:.1f} exposed_on_ms={on['exposed_grad_sync_s'] * 1e3:.1f} "
          f"exposed_off_ms={off['exposed_grad_sync_s'] * 1e3:.1f} same_losses={int(same)} "
          f"status={'PASS' if ok else 'FAIL'}")
    if a.json:
        json.dump({"device": a.device, "precision": a.precision, "grad_reduce_dtype": a.grad_reduce_dtype,
                   "seq_len": a.seq_len, "config": cfg,
                   "micro_batch_size": a.micro_batch_size, "micro_batches": a.micro_batches, "modes": out,
                   "same_losses": same, "torch_peer": peers}, open(a.json, "w"), indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
