#!/usr/bin/env python3
"""The weights' bf16 copies written by AdamW (docs/precision.md, "The
weights' bf16 copies"): under bf16 compute the update rewrites each cast
weight's bf16 copy in its own pass and the next step takes it instead of
casting the weight again. With HSPMD_WEIGHT_COPIES=graph every step casts
the weights itself, as before. Both must train the same model bit for bit
(losses, gradient norms, saved weights), while the last step's op table
holds one cast per cast weight fewer; on the CPU, on the device double
(the GPU's graph and its step without host waits) and, with --mpi, under
an asymmetric tensor-parallel pipeline plan with and without ZeRO (ZeRO's
parameters are gathered after the update: no copy is written there). A
value of HSPMD_WEIGHT_COPIES other than the two is refused in one line."""
import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile

FAILURES = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        FAILURES.append(what)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", required=True)
    ap.add_argument("--repo", required=True)
    ap.add_argument("--mpi", action="store_true", help="also four ranks")
    a = ap.parse_args()
    model = os.path.join(a.repo, "examples", "tiny-llama", "config.json")
    c = json.load(open(model))
    # One cast per GEMM weight: q, k, v, o, gate, up, down per layer, and
    # the LM head (the embedding table's cast when the two are tied).
    weight_casts = 7 * c["num_hidden_layers"] + 1
    with tempfile.TemporaryDirectory(prefix="weight_copies-") as tmp:
        at = lambda name: os.path.join(tmp, name)  # noqa: E731
        with open(at("tokens.bin"), "wb") as f:  # 8192 u32 tokens below the vocabulary (320)
            f.write(b"".join(struct.pack("<I", (i * 37) % 300) for i in range(8192)))
        base = [a.hspmd, "train", "--data", at("tokens.bin"), "--seq-len", "32",
                "--global-batch", "4", "--steps", "4", "--threads", "1", "--quiet"]

        def train(label, mode, extra, env=None, ranks=1):
            e = dict(os.environ, HSPMD_WEIGHT_COPIES=mode, **(env or {}))
            out = at(f"{label}.{mode}")
            if "--model" not in extra:
                extra = extra + ["--model", model]
            p = subprocess.run(base + extra + ["--log", out + ".jsonl", "--save", out + ".safetensors",
                                               "--op-times", out + ".ops.json"],
                               capture_output=True, text=True, timeout=120, env=e)
            if p.returncode != 0:
                check(False, f"{label} ({mode}) trains: rc={p.returncode} {p.stderr[-400:]!r}")
                return None
            records = [json.loads(line) for line in open(out + ".jsonl")]
            ops = out + ".ops.json" + (".rank0" if ranks > 1 else "")
            casts = sum(o["calls"] for o in json.load(open(ops))["ops"] if o["type"] == "cast")
            return ([(r["loss"], r["grad_norm"]) for r in records], open(out + ".safetensors", "rb").read(), casts)

        def compare(label, extra, env=None, ranks=1, fewer=weight_casts):
            opt = train(label, "optimizer", extra, env, ranks)
            graph = train(label, "graph", extra, env, ranks)
            if opt is None or graph is None:
                return
            check(opt[0] == graph[0] and len(opt[0]) == 4,
                  f"{label}: the same losses and gradient norms bit for bit ({opt[0][-1]} / {graph[0][-1]})")
            check(opt[1] == graph[1], f"{label}: the same saved weights bit for bit")
            check(graph[2] - opt[2] == fewer,
                  f"{label}: the last step casts {graph[2]} times with the graph's casts, {opt[2]} with the "
                  f"optimizer's copies ({fewer} fewer expected)")

        compare("cpu bf16", ["--precision", "bf16"])
        compare("device double bf16", ["--precision", "bf16", "--device", "cpu:1"], {"HSPMD_ATTENTION_IO": "bf16"})
        compare("cpu f32 (no copies)", [], fewer=0)
        json.dump(dict(c, tie_word_embeddings=True), open(at("tied.json"), "w"))
        compare("cpu bf16, tied head", ["--precision", "bf16", "--model", at("tied.json")])

        if a.mpi:
            layers = c["num_hidden_layers"]
            for zero in (False, True):
                plan = {"schedule": "1f1b", "zero": zero, "pipelines": [
                    {"micro_batch_size": 1, "micro_batches": 2,
                     "stages": [{"ranks": [0, 1], "layers": [0, layers // 2 - 1]},
                                {"ranks": [2], "layers": [layers // 2, layers - 1]}]},
                    {"micro_batch_size": 2, "micro_batches": 1,
                     "stages": [{"ranks": [3], "layers": [0, layers - 1]}]}]}
                name = f"plan_zero{int(zero)}.json"
                json.dump(plan, open(at(name), "w"))
                # Rank 0 holds the first half of the layers' weights (TP
                # shards), no LM head; with ZeRO nothing is written.
                compare(f"4 ranks, tp2 + pp2 beside dp, zero {str(zero).lower()}",
                        ["--precision", "bf16", "--strategy", at(name), "--nproc", "4"], ranks=4,
                        fewer=0 if zero else 7 * (layers // 2))

        p = subprocess.run(base + ["--model", model, "--precision", "bf16"], capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, HSPMD_WEIGHT_COPIES="sometimes"))
        errors = [line for line in p.stderr.splitlines() if line.startswith("hspmd: error:")]
        check(p.returncode != 0 and len(errors) == 1 and "HSPMD_WEIGHT_COPIES" in errors[0] and
              '"sometimes"' in errors[0] and "step 1/" not in p.stderr,
              f"HSPMD_WEIGHT_COPIES=sometimes is refused in one line: {p.stderr.strip()[-300:]!r}")
    if FAILURES:
        print(f"{len(FAILURES)} check(s) failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
