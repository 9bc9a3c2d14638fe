#!/usr/bin/env python3
"""The README's main job in small: tokenize the bundled corpus, train the tiny
example Llama for a few dozen steps, and check that the loss falls.

usage: loss_falls_test.py --hspmd PATH --repo DIR
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", required=True)
    ap.add_argument("--repo", required=True)
    a = ap.parse_args()
    cfg = os.path.join(a.repo, "examples/tiny-llama/config.json")
    corpus = sorted(glob.glob(os.path.join(a.repo, "data/corpus/*.txt")))
    if not corpus:
        sys.exit("no corpus files under data/corpus")
    with tempfile.TemporaryDirectory() as tmp:
        data, log = os.path.join(tmp, "corpus.bin"), os.path.join(tmp, "log.jsonl")
        subprocess.run([a.hspmd, "tokenize", "--model", cfg, "--output", data, *corpus], check=True)
        subprocess.run([a.hspmd, "train", "--model", cfg, "--data", data, "--seq-len", "64",
                        "--global-batch", "8", "--steps", "40", "--lr", "3e-3",
                        "--warmup-steps", "5", "--threads", "1", "--quiet", "--log", log],
                       check=True)
        rows = [json.loads(l) for l in open(log)]
    keys = {"step", "loss", "tokens", "step_time_s", "tokens_per_s", "lr", "grad_norm"}
    missing = [(i, sorted(keys - set(r))) for i, r in enumerate(rows) if not keys <= set(r)]
    if len(rows) != 40 or missing:
        sys.exit(f"log has {len(rows)} rows (want 40); rows missing fields: {missing[:3]}")
    first = sum(r["loss"] for r in rows[:5]) / 5
    last = sum(r["loss"] for r in rows[-5:]) / 5
    print(f"mean loss of the first 5 steps {first:.3f}, of the last 5 {last:.3f}")
    if not last < first - 0.5:
        sys.exit("FAIL: the loss did not fall by 0.5 nats")
    print("PASS")


if __name__ == "__main__":
    main()
