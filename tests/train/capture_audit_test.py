#!/usr/bin/env python3
"""The capture path of --cuda-graphs on the CPU (docs/cuda.md, "CUDA
graphs"): HSPMD_CAPTURE_AUDIT=1 sends step 2 of a one-process run through
the code that records the step on a GPU (its batch made into device feeds
first, the allocator's private pool, the clip's control and AdamW's factors
through device arrays) with every host wait refused (RecordingScope), then
the run goes on op by op. The run must train the same model bit for bit as
without the audit (losses, gradient norms, saved weights), its step 2 must
say "audited", and a run that cannot be captured must say why in a note
and train as usual. On the CPU (fp32, two micro-batches, clipping, a
schedule whose learning rate changes every step), on the device double
(the GPU's bf16 graph) and with a Qwen2-style model (projection biases in
the GEMM, a tied head). A value of HSPMD_CAPTURE_AUDIT other than 0 and 1
is refused in one line."""
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
    a = ap.parse_args()
    model = os.path.join(a.repo, "examples", "tiny-llama", "config.json")
    with tempfile.TemporaryDirectory(prefix="capture_audit-") as tmp:
        at = lambda name: os.path.join(tmp, name)  # noqa: E731
        with open(at("tokens.bin"), "wb") as f:  # u32 tokens below the vocabulary (320)
            f.write(b"".join(struct.pack("<I", (i * 37) % 300) for i in range(8192)))
        qwen = dict(json.load(open(model)), model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                    tie_word_embeddings=True)
        json.dump(qwen, open(at("qwen2.json"), "w"))
        base = [a.hspmd, "train", "--data", at("tokens.bin"), "--steps", "5", "--threads", "1",
                "--quiet", "--lr-schedule", "cosine", "--warmup-steps", "2", "--clip-grad", "0.5"]

        def train(label, audit, extra, env=None):
            e = dict(os.environ, **(env or {}))
            e.pop("HSPMD_CAPTURE_AUDIT", None)
            if audit is not None:
                e["HSPMD_CAPTURE_AUDIT"] = audit
            out = at(f"{label}.{audit}")
            if "--model" not in extra:
                extra = extra + ["--model", model]
            if "--batch-tokens" not in extra:
                extra = extra + ["--seq-len", "32"]
            p = subprocess.run(base + extra + ["--log", out + ".jsonl", "--save", out + ".safetensors"],
                               capture_output=True, text=True, timeout=120, env=e)
            if p.returncode != 0:
                return p, None, None
            records = [json.loads(line) for line in open(out + ".jsonl") if '"loss"' in line]
            return p, records, open(out + ".safetensors", "rb").read()

        def audited(label, extra, env=None):
            p0, plain, w0 = train(label, None, extra, env)
            p1, audit, w1 = train(label, "1", extra, env)
            if plain is None or audit is None:
                check(False, f"{label}: trains: {(p0.stderr + p1.stderr)[-400:]!r}")
                return
            same = [(r["loss"], r["grad_norm"]) for r in plain] == [(r["loss"], r["grad_norm"]) for r in audit]
            check(same and w0 == w1, f"{label}: the audited run equals the plain one bit for bit "
                                     f"(losses, gradient norms, weights)")
            kinds = [r.get("cuda_graph") for r in audit]
            check(kinds == ["eager", "eager", "audited", "eager", "eager"], f"{label}: step 2 audited: {kinds}")
            check("went through the capture path with no host wait" in p1.stderr,
                  f"{label}: the note says the step recorded cleanly: {p1.stderr.strip()[-200:]!r}")
            check(all("cuda_graph" not in r for r in plain), f"{label}: no cuda_graph field without the audit")

        audited("cpu_fp32_two_micro_batches", ["--global-batch", "4", "--micro-batches", "2"])
        audited("device_double_bf16", ["--global-batch", "4", "--precision", "bf16", "--device", "cpu:1"],
                env={"HSPMD_ATTENTION_IO": "bf16"})
        audited("qwen2_bias_tied_bf16", ["--global-batch", "2", "--precision", "bf16", "--model", at("qwen2.json")])

        # A run that cannot be captured says why and trains as usual.
        p, records, _ = train("token_budget", "1", ["--batch-tokens", "64", "--max-seq-len", "32"])
        check(records is not None and "token-budget steps change their shapes" in p.stderr and
              all(r.get("cuda_graph") in (None, "eager") for r in records),
              f"token-budget steps: not captured, with the reason: {p.stderr.strip()[-200:]!r}")
        # A value other than 0 and 1: one line, before step 0.
        p, records, _ = train("bad_value", "yes", ["--global-batch", "2"])
        lines = p.stderr.strip().splitlines()
        check(p.returncode != 0 and len(lines) == 1 and "HSPMD_CAPTURE_AUDIT must be 1 or 0" in lines[0],
              f"HSPMD_CAPTURE_AUDIT=yes is refused in one line: {p.stderr.strip()!r}")
    print(f"capture_audit: {len(FAILURES)} failure(s)")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
