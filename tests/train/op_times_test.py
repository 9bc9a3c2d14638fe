#!/usr/bin/env python3
"""`hspmd train --op-times FILE` (docs/profiling.md, "Op times of a training
step"): the last step's ops summed by type, on the CPU, on the device double
and on two ranks (one file per rank); the sums add up to at most the step;
the matmuls' flops are the model's GEMM count exactly, every op moved bytes
and its rate is bytes over seconds;
a directory given as the file is refused in one line before training."""
import argparse
import json
import os
import subprocess
import sys
import struct
import tempfile


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", required=True)
    ap.add_argument("--repo", required=True)
    ap.add_argument("--mpi", action="store_true", help="also two ranks")
    a = ap.parse_args()
    model = os.path.join(a.repo, "examples", "tiny-llama", "config.json")
    failures = []
    with tempfile.TemporaryDirectory(prefix="op_times-") as tmp:
        data = os.path.join(tmp, "tokens.bin")
        with open(data, "wb") as f:  # 4096 u32 tokens below the vocabulary (320)
            f.write(b"".join(struct.pack("<I", (i * 37) % 300) for i in range(4096)))
        base = [a.hspmd, "train", "--model", model, "--data", data, "--seq-len", "32", "--global-batch", "4",
                "--steps", "3", "--threads", "1", "--quiet"]

        # The step's matmul flops: 2 (forward) + 4 (backward) per weight and
        # token over every GEMM weight (the LM head included), for each rank's
        # share of the 4 x 32 tokens.
        c = json.load(open(model))
        H, F, L, V = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
        D = H // c["num_attention_heads"]
        gemm_weights = L * (2 * H * H + 2 * H * c["num_key_value_heads"] * D + 3 * H * F) + V * H

        def check(label, path, device, rank=0, tokens=4 * 32):
            j = json.load(open(path))
            ops = {o["type"]: o for o in j["ops"]}
            total = sum(o["seconds"] for o in j["ops"])
            mm = ops.get("matmul", {})
            counted = (mm.get("flops") == 6 * gemm_weights * tokens and
                       all(o["bytes"] > 0 for o in j["ops"] if o["type"] != "fill_like") and
                       all(abs(o["gb_per_s"] * o["seconds"] * 1e9 - o["bytes"]) <= 1e-6 * o["bytes"]
                           for o in j["ops"] if o["seconds"] > 0))
            if not counted:
                print(f"{label}: matmul flops {mm.get('flops')} (expected {6 * gemm_weights * tokens}), "
                      f"bytes {[(o['type'], o['bytes'], o['gb_per_s']) for o in j['ops']]}")
            ok = (counted and j["step"] == 2 and j["device"] == device and j["rank"] == rank and
                  "matmul" in ops and "attention_grad" in ops and ops["matmul"]["calls"] > 0 and
                  all(o["seconds"] >= 0 for o in j["ops"]) and abs(total - j["ops_total_s"]) < 1e-9 and
                  0 < j["ops_total_s"] <= j["step_time_s"] and
                  [o["seconds"] for o in j["ops"]] == sorted((o["seconds"] for o in j["ops"]), reverse=True))
            print(f"{label:12s} {len(ops)} op types, ops {j['ops_total_s']:.4f} s of a {j['step_time_s']:.4f} s step, "
                  f"matmul {ops['matmul']['calls']} calls: {'ok' if ok else 'FAIL'}")
            if not ok:
                failures.append(label)

        for device in ("cpu", "cpu:1"):
            out = os.path.join(tmp, f"ops_{device.replace(':', '_')}.json")
            r = subprocess.run(base + ["--device", device, "--op-times", out], capture_output=True, text=True)
            if r.returncode:
                failures.append(f"{device}: exit {r.returncode}: {r.stderr.strip()[-300:]}")
                continue
            check(device, out, "cpu:0" if device == "cpu" else device)
        if a.mpi:
            strategy = os.path.join(tmp, "dp2.json")
            json.dump({"pipelines": [{"micro_batch_size": 2, "micro_batches": 1,
                                      "stages": [{"ranks": [r], "layers": [0, 3]}]} for r in (0, 1)]},
                      open(strategy, "w"))
            out = os.path.join(tmp, "ops_dp2.json")
            r = subprocess.run([x for x in base if x not in ("--global-batch", "4")] +
                               ["--strategy", strategy, "--nproc", "2", "--op-times", out],
                               capture_output=True, text=True)
            if r.returncode:
                failures.append(f"dp2: exit {r.returncode}: {r.stderr.strip()[-300:]}")
            else:
                for rank in (0, 1):
                    check(f"dp2 rank {rank}", f"{out}.rank{rank}", "cpu:0", rank, tokens=2 * 32)
        r = subprocess.run(base + ["--op-times", tmp], capture_output=True, text=True)
        lines = [l for l in r.stderr.splitlines() if l.strip()]
        ok = r.returncode != 0 and len(lines) == 1 and "--op-times" in lines[0]
        print(f"a directory as --op-times: {'ok' if ok else 'FAIL: ' + r.stderr[-300:]}")
        if not ok:
            failures.append("directory")
    if failures:
        sys.exit("FAILED: " + "; ".join(failures))


if __name__ == "__main__":
    main()
