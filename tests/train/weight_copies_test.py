#!/usr/bin/env python3
"""The weights' bf16 copies written by AdamW (docs/precision.md, "The
weights' bf16 copies"): under bf16 compute the update rewrites each cast
weight's bf16 copy in its own pass and the next step takes it instead of
casting the weight again. With HSPMD_WEIGHT_COPIES=graph every step casts
the weights itself, as before. Both must train the same model bit for bit
(losses, gradient norms, saved weights), while the last step's op table
holds one cast per cast weight fewer; on the CPU, on the device double
(the GPU's graph and its step without host waits), with a tied head and
with a mixture of experts, and, with --mpi, under an asymmetric
tensor-parallel pipeline plan with and without ZeRO (ZeRO's parameters
are gathered after the update: no copy is written there), under expert
parallelism, and over token-budget steps whose strategy switches at every
step (with and without bucket switching). A value of HSPMD_WEIGHT_COPIES
other than the two is refused in one line."""
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
        base = [a.hspmd, "train", "--steps", "4", "--threads", "1", "--quiet"]
        fixed = ["--data", at("tokens.bin"), "--seq-len", "32", "--global-batch", "4"]  # unless a run gives --data

        def train(label, mode, extra, env=None, ranks=1):
            e = dict(os.environ, HSPMD_WEIGHT_COPIES=mode, **(env or {}))
            out = at(f"{label}.{mode}")
            if "--model" not in extra:
                extra = extra + ["--model", model]
            if "--data" not in extra:
                extra = extra + fixed
            p = subprocess.run(base + extra + ["--log", out + ".jsonl", "--save", out + ".safetensors",
                                               "--op-times", out + ".ops.json"],
                               capture_output=True, text=True, timeout=120, env=e)
            if p.returncode != 0:
                check(False, f"{label} ({mode}) trains: rc={p.returncode} {p.stderr[-400:]!r}")
                return None
            records = [r for r in map(json.loads, open(out + ".jsonl")) if "loss" in r]  # not switch events
            ops = out + ".ops.json" + (".rank0" if ranks > 1 else "")
            casts = sum(o["calls"] for o in json.load(open(ops))["ops"] if o["type"] == "cast")
            return ([(r["loss"], r["grad_norm"]) for r in records], open(out + ".safetensors", "rb").read(), casts,
                    [r.get("strategy") for r in records])

        # Both modes' runs compared; the optimizer's run (losses, weights,
        # casts, strategies) or None.
        def compare(label, extra, env=None, ranks=1, fewer=weight_casts):
            opt = train(label, "optimizer", extra, env, ranks)
            graph = train(label, "graph", extra, env, ranks)
            if opt is None or graph is None:
                return None
            check(opt[0] == graph[0] and len(opt[0]) == 4,
                  f"{label}: the same losses and gradient norms bit for bit ({opt[0][-1]} / {graph[0][-1]})")
            check(opt[1] == graph[1], f"{label}: the same saved weights bit for bit")
            if fewer == "some":  # a count this test does not derive (experts' weights): at least one fewer
                check(graph[2] > opt[2], f"{label}: the last step casts {graph[2]} times with the graph's casts, "
                                         f"{opt[2]} with the optimizer's copies (fewer expected)")
            elif fewer is not None:  # None: the last step's graph depends on the step's buckets
                check(graph[2] - opt[2] == fewer,
                      f"{label}: the last step casts {graph[2]} times with the graph's casts, {opt[2]} with the "
                      f"optimizer's copies ({fewer} fewer expected)")
            return opt

        compare("cpu bf16", ["--precision", "bf16"])
        compare("device double bf16", ["--precision", "bf16", "--device", "cpu:1"], {"HSPMD_ATTENTION_IO": "bf16"})
        compare("cpu f32 (no copies)", [], fewer=0)
        json.dump(dict(c, tie_word_embeddings=True), open(at("tied.json"), "w"))
        compare("cpu bf16, tied head", ["--precision", "bf16", "--model", at("tied.json")])
        # A mixture of experts (the routers far from ties, as in tests/exec's equivalence cases).
        json.dump(dict(c, model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=4,
                       num_experts_per_tok=2, router_aux_loss_coef=0.02, output_router_logits=True,
                       initializer_range=0.1), open(at("mixtral.json"), "w"))
        compare("cpu bf16, mixtral", ["--precision", "bf16", "--model", at("mixtral.json")], fewer="some")

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
            json.dump({"expert_parallel": 2, "pipelines": [
                {"micro_batch_size": 2, "micro_batches": 1, "stages": [{"ranks": [r], "layers": [0, layers - 1]}]}
                for r in range(2)]}, open(at("ep2.json"), "w"))
            compare("2 ranks, mixtral, expert parallel 2",
                    ["--precision", "bf16", "--model", at("mixtral.json"), "--strategy", at("ep2.json"), "--nproc", "2"],
                    ranks=2, fewer="some")
            # Token-budget steps over two strategies (short pieces on four
            # one-rank pipelines; the long ones on a CP2 pair beside two
            # short pipelines), the plan chosen per step or switched per
            # length bucket inside a step: each switch moves the state, and
            # the copies of the plan before it must not be taken.
            short4 = {"max_seq_len": 16, "pipelines": [
                {"stages": [{"ranks": [r], "layers": [0, layers - 1]}]} for r in range(4)]}
            long_short = {"pipelines": [
                {"max_seq_len": 32, "stages": [{"ranks": [0, 1], "layers": [0, layers - 1], "cp": 2}]},
                {"max_seq_len": 12, "micro_batch_tokens": 24, "stages": [{"ranks": [2], "layers": [0, layers - 1]}]},
                {"max_seq_len": 12, "micro_batch_tokens": 24, "stages": [{"ranks": [3], "layers": [0, layers - 1]}]}]}
            json.dump(short4, open(at("short4.json"), "w"))
            json.dump(long_short, open(at("long_short.json"), "w"))
            # 96-token steps alternating between 12 documents of 8 tokens and
            # 3 of 32 (each ending with eos): short4 is chosen for the first
            # kind and long_short for the second, a switch at every step.
            with open(at("docs.bin"), "wb") as f:
                t = 1
                for block in range(40):
                    count, length = (12, 7) if block % 2 == 0 else (3, 31)
                    for _ in range(count):
                        doc = [(t + 37 * i) % 250 + 1 for i in range(length)]
                        t += 37 * length
                        f.write(b"".join(struct.pack("<I", x) for x in doc + [c["eos_token_id"]]))
            tokens = ["--precision", "bf16", "--data", at("docs.bin"), "--batch-tokens", "96", "--max-seq-len", "32",
                      "--strategies", at("short4.json") + "," + at("long_short.json"), "--nproc", "4"]
            for label, extra in (("4 ranks, token budgets over two strategies", []),
                                 ("4 ranks, token budgets, bucket switching", ["--bucket-switching"])):
                run = compare(label, tokens + extra, ranks=4, fewer=None)
                if run is not None:
                    check(run[3] == [0, 1, 0, 1], f"{label}: the strategy alternates at every step ({run[3]})")

        p = subprocess.run(base + fixed + ["--model", model, "--precision", "bf16"], capture_output=True, text=True, timeout=120,
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
