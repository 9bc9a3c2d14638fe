"""`hspmd profile` (docs/profiling.md) on examples/models/llama-tiny-8l.json
with a small grid: it finishes well within 30 s, writes every part of every
(tp, cp) entry with a sample per (s, b), the optimizer fit, the per-op fits
with their '*' fallback and the layer memory, and prints the table; bad
options (a --device that cannot be used included) fail with one line naming
the rule and a non-zero exit. The GPU path: tests/gpu/profile_cuda_test.py."""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

PARTS = ["embed_fwd", "embed_bwd", "block_fwd", "block_bwd", "head_fwd", "head_bwd"]


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return p.returncode, p.stderr


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", required=True)
    ap.add_argument("--repo", required=True)
    a = ap.parse_args()
    model = os.path.join(a.repo, "examples", "models", "llama-tiny-8l.json")
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "tiny.profile.json")
        t0 = time.time()
        rc, err = run([a.hspmd, "profile", "--model", model, "--tp", "1,2", "--seq-lens", "16,32,64",
                       "--micro-batch-sizes", "1,2", "--repetitions", "3", "--threads", "1", "-o", out])
        elapsed = time.time() - t0
        if rc != 0:
            sys.exit("hspmd profile failed: " + err)
        print(err)
        print("profiled in %.1f s" % elapsed)
        if elapsed > 30:
            failures.append("profiling took %.1f s (> 30 s)" % elapsed)
        p = json.load(open(out))
        if [(e["tp"], e["cp"]) for e in p["entries"]] != [(1, 1), (2, 1)]:
            failures.append("entries: %s" % [(e["tp"], e["cp"]) for e in p["entries"]])
        for e in p["entries"]:
            for part in PARTS:
                f = e["parts"].get(part)
                if f is None or len(f["samples"]) != 6:
                    failures.append("tp %d: part %s missing or without 6 samples" % (e["tp"], part))
                elif not f["max_rel_error"] >= 0:
                    failures.append("tp %d %s: no fit error" % (e["tp"], part))
            if e["parts"]["block_fwd"]["samples"][-1]["seconds"] <= 0:
                failures.append("tp %d: block_fwd not timed" % e["tp"])
        for key in ["*", "matmul", "attention", "attention_grad", "rms_norm", "cross_entropy"]:
            if key not in p["ops"]:
                failures.append("ops: no fit for %s" % key)
        if len(p["optimizer"]["samples"]) != 3 or not p["optimizer"]["per_param_s"] > 0:
            failures.append("optimizer: %s" % p["optimizer"])
        if [m["tp"] for m in p["memory"]] != [1, 2] or not all(m["activation_bytes_per_token"] > 0 for m in p["memory"]):
            failures.append("memory: %s" % p["memory"])
        if p["config"]["hidden_size"] != 64 or p["threads"] != 1 or p["repetitions"] != 3:
            failures.append("header: %s" % {k: p[k] for k in ["config", "threads", "repetitions"]})
        if "block_fwd" not in err or "max err" not in err:
            failures.append("no table on stderr")

        bad = {
            "tp not dividing the heads": (["--tp", "3"], "[profile] --tp 3 does not divide num_attention_heads = 8"),
            "tp not dividing the KV heads": (["--tp", "1,8"], "[profile] --tp 8 does not divide num_key_value_heads = 4"),
            "a bad list": (["--tp", "1,x"], "[profile] --tp: 'x' in '1,x' is not an integer"),
            "a trailing comma": (["--seq-lens", "16,"], "[profile] --seq-lens: '16,' is not a list"),
            "a zero": (["--micro-batch-sizes", "0"], "[profile] --micro-batch-sizes: 0 must be positive"),
            "a length the split cannot cut": (["--cp", "2", "--seq-lens", "18"],
                                              "[profile] --seq-lens: 18 is not a multiple of 4"),
            "a missing model": (["--model", os.path.join(tmp, "none.json")], "[profile] --model"),
            # The output check every command shares (check_outputs, src/cli/flags.h).
            "a missing directory": (["-o", os.path.join(tmp, "no", "p.json")], "[flags] --output"),
            "an unknown device": (["--device", "tpu"], "[flags] --device: 'tpu' (expected cpu, cuda or cuda:N)"),
            # No machine has 100 GPUs: refused as absent here and on a GPU machine.
            "a device that does not exist": (["--device", "cuda:99"], "[device] cuda:99: "),
        }
        for what, (flags, want) in bad.items():
            cmd = [a.hspmd, "profile"] + flags
            if "--model" not in flags:
                cmd += ["--model", model]
            if "-o" not in flags:
                cmd += ["-o", os.path.join(tmp, "bad.json")]
            rc, err = run(cmd)
            lines = err.strip().splitlines()
            if rc == 0 or len(lines) != 1 or want not in lines[0]:
                failures.append("%s: rc %d, stderr %r (want one line with %r)" % (what, rc, err, want))
    if failures:
        print("\n".join("FAIL: " + f for f in failures))
        sys.exit(1)
    print("profile CLI: OK")


if __name__ == "__main__":
    main()
