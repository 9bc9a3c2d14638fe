#!/usr/bin/env python3
"""Checkpoint cost in the step (docs/checkpoint.md, "Writing in the
background"): a 2-rank data-parallel run of a ~30M-parameter Llama writes a
sharded training checkpoint after every step, three ways, side by side in
one run:

  none    no checkpoint (the baseline)
  sync    --checkpoint-sync: the step writes and fsyncs its shards
  async   the default: the shards are copied, a background thread writes
          them while the next steps run, rank 0 commits once all are done

For each it prints the median job wall time over --repeat runs and the
checkpoint's cost per step: (job - none job) / steps, and that against
the synchronous write. `step_time_s` of the log does not show it: a step's
record is written before its checkpoint.

usage: bench/checkpoint_async.py [--hspmd build/src/cli/hspmd] [--repeat 3] [--steps 6] [--seq-len 128] [--smoke]
"""
import argparse
import json
import os
import random
import shutil
import statistics
import struct
import subprocess
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

MODEL = {"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8,
         "num_attention_heads": 8, "num_key_value_heads": 4, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
         "max_position_embeddings": 256, "tie_word_embeddings": False, "eos_token_id": 0}
# --smoke: a model of a few hundred thousand parameters at sequence 32, 2 steps, one run per mode.
SMOKE_MODEL = dict(MODEL, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
SMOKE = {"repeat": 1, "steps": 2, "seq_len": 32}


def strategy_for(layers):
    """Data parallelism over 2 ranks, each the whole model, 2 micro-batches of 1."""
    return {"schedule": "1f1b", "pipelines": [
        {"micro_batch_size": 1, "micro_batches": 2, "stages": [{"ranks": [r], "layers": [0, layers - 1]}]}
        for r in range(2)]}


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", default=os.path.join(ROOT, "build", "src", "cli", "hspmd"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny model (2 layers, hidden 64), sequence 32, 2 steps, one run per mode: the same "
                         "calls (the CTest bench_smoke_checkpoint_async)")
    a = ap.parse_args()
    if a.smoke:
        ap.set_defaults(**SMOKE)
        a = ap.parse_args()
    spec = SMOKE_MODEL if a.smoke else MODEL
    with tempfile.TemporaryDirectory() as tmp:
        model, strategy, data = (os.path.join(tmp, n) for n in ("model.json", "strategy.json", "data.bin"))
        json.dump(spec, open(model, "w"))
        json.dump(strategy_for(spec["num_hidden_layers"]), open(strategy, "w"))
        rng = random.Random(1)
        with open(data, "wb") as f:
            f.write(b"".join(struct.pack("<I", rng.randrange(spec["vocab_size"])) for _ in range(1 << 16)))
        base = [a.hspmd, "train", "--model", model, "--data", data, "--seq-len", str(a.seq_len), "--steps", str(a.steps),
                "--strategy", strategy, "--nproc", "2", "--threads", "1", "--quiet"]
        modes = {"none": [], "sync": ["--save-every", "1", "--checkpoint-sync"], "async": ["--save-every", "1"]}
        walls = {m: [] for m in modes}
        size = 0
        for rep in range(a.repeat):
            for m, extra in modes.items():  # interleaved: the machine's load hits every mode alike
                log, ckpt = os.path.join(tmp, m + ".jsonl"), os.path.join(tmp, m + "_ckpt")
                shutil.rmtree(ckpt, ignore_errors=True)
                if os.path.exists(log):
                    os.remove(log)
                cmd = base + ["--log", log] + (["--checkpoint", ckpt] + extra if extra else [])
                t0 = time.perf_counter()
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode:
                    raise SystemExit(f"failed ({m}): {' '.join(cmd)}\n{r.stderr[-2000:]}")
                walls[m].append(time.perf_counter() - t0)
                if m == "async":
                    index = json.load(open(os.path.join(ckpt, "index.json")))
                    assert index["step"] == a.steps, index["step"]
                    size = dir_bytes(ckpt)
        print(f"2 ranks, {spec['num_hidden_layers']} layers x hidden {spec['hidden_size']}, vocab "
              f"{spec['vocab_size']}; checkpoint {size / 1e6:.0f} MB (weights + Adam moments, f32); "
              f"{a.repeat} runs x {a.steps} steps")
        print(f"{'mode':6s} {'median job s':>13s} {'checkpoint s/step':>18s} {'x sync':>7s}")
        job = {m: statistics.median(walls[m]) for m in modes}
        per = {m: (job[m] - job["none"]) / a.steps for m in modes}
        for m in modes:
            ratio = f"{per[m] / per['sync']:7.2f}" if m != "none" and per["sync"] > 0 else ""
            print(f"{m:6s} {job[m]:13.2f} {per[m]:18.3f} {ratio}")

if __name__ == "__main__":
    main()
