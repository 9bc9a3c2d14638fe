#!/usr/bin/env python3
"""Peak memory of bench/gpu_step.py's training step, measured on a machine
without a GPU.

hspmd's device allocator counts the bytes in use (state, activations,
gradients) the same way on the device test double `cpu:1` as on CUDA, and
the step's graph is the same. A model of L layers needs
    peak(L) = fixed + L * per_layer
(the peak is at the end of the forward, when every layer's activations are
alive), so two short runs, with 1 and 2 layers of the benchmark's shape and
its sequence and micro-batch, give both terms; the table extrapolates to the
model's own layer count. One step each (its peak is the first step's).

    python3 bench/step_memory.py                # TinyLlama-1.1B shape, S 4096, mb 4, bf16
    python3 bench/step_memory.py --device cuda  # the same on a GPU (its allocator)

The same two steps also give the step's memory traffic: each runs with
`--op-times`, whose per-op-type bytes (every op's input and output arrays
as stored) the two runs split the same way into per layer and fixed. On a
GPU the memory-bound ops take about those bytes over the card's bandwidth
(docs/cuda.md, "Memory traffic of the benchmark step"); the GEMMs' and
attention's bytes are listed too but their time is their flops'.

Prints two RESULT lines and the traffic table. A run takes a few minutes on 2 CPU cores (the
shape is the real one: 16384 tokens through a 2048-wide layer and a
32000-word head) and about 12 GiB of host memory for 2 layers.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import gpu_step  # noqa: E402  (the benchmark's config and token helpers)


def peak_of(a, cfg, layers, tmp, data):
    cfg = gpu_step.run_config(cfg, layers, None, a.seq)
    path = os.path.join(tmp, f"config{layers}.json")
    json.dump(cfg, open(path, "w"))
    log = os.path.join(tmp, f"log{layers}.jsonl")
    op_times = os.path.join(tmp, f"op_times{layers}_{a.precision}.json")
    cmd = [a.hspmd, "train", "--model", path, "--data", data, "--seq-len", str(a.seq),
           "--global-batch", str(a.mb), "--steps", "1", "--precision", a.precision,
           "--device", a.device, "--log", log, "--op-times", op_times, "--quiet"]
    if not a.device.startswith("cuda"):
        cmd += ["--threads", str(a.threads)]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"step_memory: {' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()[-500:]}")
    rec = json.loads(open(log).read().splitlines()[-1])
    print(f"[step_memory] {layers} layer(s): peak {rec['peak_memory_bytes'][0] / 2**30:.3f} GiB "
          f"in {time.time() - t0:.0f} s", file=sys.stderr)
    traffic = {o["type"]: (o["calls"], o["bytes"]) for o in json.load(open(op_times))["ops"]}
    return rec["peak_memory_bytes"][0], traffic


# Views that copy nothing (their bytes are another op's).
NO_TRAFFIC = {"reshape"}
COMPUTE_BOUND = {"matmul", "attention", "attention_grad"}


def traffic_table(t1, t2, layers):
    """Per op type: calls and bytes per layer and fixed (2-layer minus 1-layer run)."""
    rows = []
    for op in sorted(set(t1) | set(t2)):
        if op in NO_TRAFFIC:
            continue
        c1, b1 = t1.get(op, (0, 0))
        c2, b2 = t2.get(op, (0, 0))
        rows.append({"op": op, "calls_per_layer": c2 - c1, "bytes_per_layer": b2 - b1, "fixed_bytes": b1 - (b2 - b1),
                     "step_bytes": b1 + (layers - 1) * (b2 - b1)})
    return sorted(rows, key=lambda r: -r["step_bytes"])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="Hugging Face config.json (default: the TinyLlama-1.1B shape)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--mb", type=int, default=4)
    ap.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--device", default="cpu:1", help="cpu:1 (the device double, default) or cuda[:N]")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hspmd", default=os.path.join(ROOT, "build", "src", "cli", "hspmd"))
    ap.add_argument("--json", help="also write the result here")
    ap.add_argument("--compare-fp32", action="store_true",
                    help="also measure fp32; exit 1 unless bf16 keeps less per layer (the CTest's check)")
    ap.add_argument("--check-folded", action="store_true",
                    help="exit 1 unless a layer's only adds are its two residual adds (the backward folds "
                         "every gradient accumulation into a GEMM or the norm's backward; the CTest's check)")
    a = ap.parse_args()
    base = json.load(open(a.model)) if a.model else dict(gpu_step.TINYLLAMA)
    layers = base["num_hidden_layers"]
    with tempfile.TemporaryDirectory(prefix="step_memory-") as tmp:
        data = os.path.join(tmp, "tokens.bin")
        gpu_step.write_tokens(data, base["vocab_size"], a.mb * a.seq + 1, 1)
        (p1, t1), (p2, t2) = peak_of(a, base, 1, tmp, data), peak_of(a, base, 2, tmp, data)
        if a.compare_fp32:
            a32 = argparse.Namespace(**{**vars(a), "precision": "fp32"})
            (f1, _), (f2, _) = peak_of(a32, base, 1, tmp, data), peak_of(a32, base, 2, tmp, data)
    table = traffic_table(t1, t2, layers)
    print(f"\n{'op':22s} {'calls/layer':>11s} {'GB/layer':>9s} {'GB fixed':>9s} {'GB/step':>9s}")
    for r in table:
        print(f"{r['op']:22s} {r['calls_per_layer']:11d} {r['bytes_per_layer'] / 1e9:9.3f} "
              f"{r['fixed_bytes'] / 1e9:9.3f} {r['step_bytes'] / 1e9:9.2f}")
    memory_bound = [r for r in table if r["op"] not in COMPUTE_BOUND]
    mb_layer = sum(r["bytes_per_layer"] for r in memory_bound)
    mb_step = sum(r["step_bytes"] for r in memory_bound)
    print(f"memory-bound ops: {mb_layer / 1e9:.3f} GB per layer, {mb_step / 1e9:.1f} GB per step "
          f"(the optimizer and the gradient norm, outside ops, come on top)")
    per_layer = p2 - p1
    total = p1 + (layers - 1) * per_layer
    result = {"bench": "step_memory", "device": a.device, "precision": a.precision, "seq": a.seq, "mb": a.mb,
              "layers": layers, "peak_1_layer_bytes": p1, "peak_2_layers_bytes": p2,
              "per_layer_bytes": per_layer, "fixed_bytes": p1 - per_layer, "predicted_peak_bytes": total,
              "traffic": table, "memory_bound_bytes_per_layer": mb_layer, "memory_bound_bytes_per_step": mb_step}
    print(f"RESULT probe=step_memory device={a.device} precision={a.precision} seq={a.seq} mb={a.mb} "
          f"layers={layers} per_layer_gib={per_layer / 2**30:.3f} fixed_gib={(p1 - per_layer) / 2**30:.3f} "
          f"predicted_peak_gib={total / 2**30:.2f}")
    print(f"RESULT probe=step_traffic device={a.device} precision={a.precision} "
          f"memory_bound_gb_per_layer={mb_layer / 1e9:.3f} memory_bound_gb_per_step={mb_step / 1e9:.1f}")
    if a.json:
        json.dump(result, open(a.json, "w"), indent=1)
    if a.check_folded:
        # The residual adds: `add`, and `add_rms_norm` (the post-attention
        # add and its norm in one op).
        adds = sum(r["calls_per_layer"] for r in table if r["op"] in ("add", "add_rms_norm"))
        print(f"RESULT probe=step_traffic_adds adds_per_layer={adds}")
        if adds != 2:
            print(f"FAIL: {adds} adds per layer; expected the 2 residual adds, every gradient sum folded")
            return 1
    if a.compare_fp32:
        ratio = per_layer / (f2 - f1)
        print(f"RESULT probe=step_memory_vs_fp32 per_layer_ratio={ratio:.3f}")
        if not 0 < per_layer < f2 - f1:
            print(f"FAIL: a bf16 layer adds {per_layer} bytes to the peak, an fp32 one {f2 - f1}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
