#!/usr/bin/env python3
"""`hspmd profile --device cuda` (docs/cuda.md, docs/profiling.md) on the tiny
example Llama: the parts, the optimizer and every op are timed on the GPU
with CUDA events, fp32 and bf16, tp 1 and 2 (one rank of the group, its
collectives shadowed through host memory). Checks sanity only: the run
succeeds, every part has a positive finite time at every (s, b), the op fits
and the optimizer fit exist, the layer memory is positive, the profile names
the device and is not marked as measured under load. No speed is asserted
(bf16 need not beat fp32 at this size).

Exits 77 (CTest: skipped) when no CUDA device is visible or the build has no
CUDA backend. --device cpu runs the same checks against the CPU profile (the
harness itself, on machines without a GPU).

usage: profile_cuda_test.py --hspmd build/src/cli/hspmd --repo . [--device cuda]
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

PARTS = ["embed_fwd", "embed_bwd", "block_fwd", "block_bwd", "head_fwd", "head_bwd"]
SEQ_LENS, BATCHES = [64, 128], [1, 2]
FAIL = []


def result(case, ok, detail=""):
    print(f"RESULT probe=profile_cuda case={case} {detail} status={'PASS' if ok else 'FAIL'}", flush=True)
    if not ok:
        FAIL.append(case)


def positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def check_profile(p, precision, device):
    bad = []
    if p.get("precision") != precision:
        bad.append(f"precision {p.get('precision')}")
    if device != "cpu" and not str(p.get("device", "")).startswith("cuda"):
        bad.append(f"device {p.get('device')!r}")
    if [(e["tp"], e["cp"]) for e in p["entries"]] != [(1, 1), (2, 1)]:
        bad.append(f"entries {[(e['tp'], e['cp']) for e in p['entries']]}")
    for e in p["entries"]:
        for part in PARTS:
            samples = e["parts"].get(part, {}).get("samples", [])
            if len(samples) != len(SEQ_LENS) * len(BATCHES):
                bad.append(f"tp {e['tp']} {part}: {len(samples)} samples")
            # The embedding's extra ops may be tiny, never negative or NaN;
            # a block and the head always compute.
            need = positive if part.startswith(("block", "head")) else (lambda x: math.isfinite(x) and x >= 0)
            bad += [f"tp {e['tp']} {part} s {x['s']} b {x['b']}: {x['seconds']}" for x in samples
                    if not need(x["seconds"])]
    for key in ["*", "matmul", "attention", "attention_grad", "rms_norm", "cross_entropy"]:
        if key not in p["ops"]:
            bad.append(f"no op fit for {key}")
    opt = p["optimizer"]
    if len(opt["samples"]) != 3 or not all(positive(s[1] if isinstance(s, list) else s["seconds"])
                                           for s in opt["samples"]):
        bad.append(f"optimizer samples {opt['samples']}")
    if not all(positive(m["activation_bytes_per_token"]) and positive(m["param_bytes"]) for m in p["memory"]):
        bad.append(f"memory {p['memory']}")
    if device != "cpu" and p.get("measurement", {}).get("under_load"):  # a busy CPU may say so
        bad.append("marked as measured under load")
    return bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", required=True)
    ap.add_argument("--repo", required=True)
    ap.add_argument("--device", default="cuda", help="the device under test (cpu: checks this script itself)")
    a = ap.parse_args()
    model = os.path.join(a.repo, "examples", "tiny-llama", "config.json")
    with tempfile.TemporaryDirectory() as tmp:
        for precision in ("fp32", "bf16"):
            out = os.path.join(tmp, precision + ".profile.json")
            cmd = [a.hspmd, "profile", "--model", model, "--device", a.device, "--tp", "1,2",
                   "--seq-lens", ",".join(map(str, SEQ_LENS)), "--micro-batch-sizes", ",".join(map(str, BATCHES)),
                   "--repetitions", "3", "--precision", precision, "-o", out]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if r.returncode and ("no CUDA device" in r.stderr or "no CUDA backend" in r.stderr):
                print("RESULT probe=profile_cuda case=device status=SKIP (" + r.stderr.strip() + ")")
                return 77
            if r.returncode:
                result(precision, False, f"error=\"{r.stderr.strip()[-300:]}\"")
                continue
            p = json.load(open(out))
            bad = check_profile(p, precision, a.device)
            block = p["entries"][0]["parts"]["block_fwd"]["samples"][-1]["seconds"]
            result(precision, not bad and "block_fwd" in r.stderr,
                   f"block_fwd_s={block:.3e} device={p.get('device', '?').replace(' ', '_')}" +
                   (f" problems=\"{'; '.join(bad)[:400]}\"" if bad else ""))
    return 1 if FAIL else 0


if __name__ == "__main__":
    sys.exit(main())
