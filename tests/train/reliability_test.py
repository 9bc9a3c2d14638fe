#!/usr/bin/env python3
"""Reliability of `hspmd train` and `hspmd tokenize` (docs/reliability.md),
single-process runs of examples/models/llama-tiny-8l.json:

* non-finite float flags and non-finite --init weights are refused before
  step 0, in one line naming the flag or the tensor;
* a run whose loss turns non-finite (--lr 1e20) stops with one line naming
  the step, exit non-zero, and leaves an earlier --save untouched; with
  --skip-nonfinite-steps N it skips such steps (no update, "skipped" in the
  log) and stops at the (N+1)-th; weights made non-finite by the last
  update (--lr 1e39) are written neither to --save nor to a checkpoint;
* every output is checked before step 0 (a path under /proc, an existing
  directory, a --checkpoint that is a file); a write error on --log
  (/dev/full) fails the run;
* --save, --dump-grads and tokenize --output refuse a FIFO or a symbolic
  link to /dev/null, which stays a character device;
* with --mpi, a two-rank pipeline stops at the same step on both ranks in
  one line, or skips it on both.

usage: reliability_test.py --hspmd PATH --repo DIR [--mpi]
"""
import argparse
import json
import math
import os
import random
import stat
import struct
import subprocess
import sys
import tempfile

FAILURES = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        FAILURES.append(what)


def run(cmd):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def one_line_error(p, *parts):
    """Exit non-zero, stderr one error line holding every part."""
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    errors = [l for l in lines if l.startswith("hspmd: error:")]
    return (p.returncode != 0 and len(errors) == 1 and all(x in errors[0] for x in parts)), p.stderr.strip()


def expect_error(what, p, *parts, before_step0=False):
    ok, err = one_line_error(p, *parts)
    if before_step0 and "step 1/" in p.stderr:
        ok = False
    check(ok, f"{what}: rc={p.returncode} stderr={err[-400:]!r}")


def safetensors_floats(path):
    """{name: list of floats} of an F32 safetensors file."""
    with open(path, "rb") as f:
        blob = f.read()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, end = e["data_offsets"]
        out[name] = struct.unpack(f"<{(end - b) // 4}f", blob[8 + n + b:8 + n + end])
    return out, 8 + n, header


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", required=True)
    ap.add_argument("--repo", required=True)
    ap.add_argument("--mpi", action="store_true")
    a = ap.parse_args()
    model = os.path.join(a.repo, "examples/models/llama-tiny-8l.json")
    with tempfile.TemporaryDirectory() as tmp:
        at = lambda name: os.path.join(tmp, name)
        rng = random.Random(5)
        with open(at("data.bin"), "wb") as f:
            f.write(b"".join(struct.pack("<I", rng.randrange(256)) for _ in range(8192)))
        common = [a.hspmd, "train", "--model", model, "--data", at("data.bin"), "--seq-len", "32", "--threads", "1"]
        base = common + ["--global-batch", "2"]

        def train(*extra, steps=2):
            return run(base + ["--steps", str(steps), *extra])

        # A good run: its weights serve as --init below and as the "earlier --save".
        p = train("--quiet", "--save", at("good.safetensors"))
        check(p.returncode == 0, f"a plain run trains: {p.stderr[-300:]!r}")
        good = open(at("good.safetensors"), "rb").read()

        # 3. Non-finite training.
        for flag, value in [("--lr", "inf"), ("--lr", "nan"), ("--min-lr", "nan"), ("--weight-decay", "nan"),
                            ("--eps", "inf"), ("--clip-grad", "nan"), ("--beta2", "-inf")]:
            expect_error(f"{flag} {value} is refused", train(flag, value), flag, before_step0=True)
        tensors, data_start, header = safetensors_floats(at("good.safetensors"))
        name = "model.layers.3.mlp.up_proj.weight"
        bad = bytearray(good)
        struct.pack_into("<f", bad, data_start + header[name]["data_offsets"][0] + 4 * 7, math.nan)
        open(at("nan.safetensors"), "wb").write(bad)
        expect_error("--init with a NaN names the tensor", train("--init", at("nan.safetensors")),
                     "[init]", name, "nan", "element 7", before_step0=True)
        struct.pack_into("<f", bad, data_start + header[name]["data_offsets"][0] + 4 * 7, math.inf)
        open(at("inf.safetensors"), "wb").write(bad)
        expect_error("--init with an infinity names the tensor", train("--init", at("inf.safetensors")),
                     name, "inf")

        # An earlier --save file at the path this run saves to (not its --init:
        # an output that is an input is refused).
        open(at("earlier.safetensors"), "wb").write(good)
        blown = ["--init", at("good.safetensors"), "--lr", "1e20", "--quiet"]
        p = train(*blown, "--save", at("earlier.safetensors"), "--log", at("blown.jsonl"), steps=6)
        expect_error("--lr 1e20 stops at a non-finite step", p, "[train] step 1: loss nan", "not finite")
        check(open(at("earlier.safetensors"), "rb").read() == good, "the earlier --save is untouched")
        logged = [json.loads(l) for l in open(at("blown.jsonl"))]
        check(all(r["loss"] is not None and r["grad_norm"] is not None for r in logged),
              f"the log holds only finite steps ({len(logged)} rows)")

        p = train(*blown, "--skip-nonfinite-steps", "100", "--save", at("skipped.safetensors"), "--log",
                  at("skipped.jsonl"), steps=6)
        rows = [json.loads(l) for l in open(at("skipped.jsonl"))]
        skipped = [r["step"] for r in rows if r.get("skipped")]
        check(p.returncode == 0 and len(rows) == 6 and skipped and "step skipped" in p.stderr,
              f"--skip-nonfinite-steps 100 skips steps {skipped}: rc={p.returncode} {p.stderr[-300:]!r}")
        if p.returncode == 0:
            w, _, _ = safetensors_floats(at("skipped.safetensors"))
            check(all(math.isfinite(x) for t in w.values() for x in t), "the weights saved after skips are finite")
        if skipped:
            p = train(*blown, "--skip-nonfinite-steps", "1", steps=6)
            expect_error("--skip-nonfinite-steps 1 stops at the second non-finite step", p,
                         "--skip-nonfinite-steps 1")
        # An update that overflows the weights on the last step: nothing non-finite is written.
        p = train("--init", at("good.safetensors"), "--lr", "1e39", "--save", at("earlier.safetensors"), steps=1)
        expect_error("non-finite weights are not saved", p, "--save", "non-finite values after step 0",
                     "not written")
        check(open(at("earlier.safetensors"), "rb").read() == good, "the earlier --save is still untouched")
        p = train("--lr", "1e39", "--checkpoint", at("ckpt"), "--save-every", "1", steps=1)
        expect_error("non-finite weights are not checkpointed", p, "--checkpoint", "checkpoint not written")
        check(not os.path.exists(at("ckpt/index.json")), "no checkpoint is committed")
        expect_error("--skip-nonfinite-steps -1 is refused", train("--skip-nonfinite-steps", "-1"),
                     "--skip-nonfinite-steps")

        # Nothing to predict: only one-token documents (2000 eos tokens) give
        # steps without a single target, refused rather than logged as loss 0.
        with open(at("eos.bin"), "wb") as f:
            f.write(struct.pack("<2000I", *([0] * 2000)))
        only_eos = [a.hspmd, "train", "--model", model, "--data", at("eos.bin"), "--threads", "1", "--quiet",
                    "--steps", "2"]
        expect_error("one-token documents, packed: no target", run(only_eos + ["--seq-len", "32", "--global-batch",
                                                                              "2", "--pack-documents"]),
                     "[data]", "step 0 has no target token")
        expect_error("one-token documents, token budgets: no target",
                     run(only_eos + ["--batch-tokens", "512", "--max-seq-len", "128"]),
                     "[data]", "step 0 has no target token")

        if a.mpi:
            json.dump({"pipelines": [{"micro_batch_size": 2, "micro_batches": 2,
                                      "stages": [{"ranks": [0], "layers": [0, 3]}, {"ranks": [1], "layers": [4, 7]}]}]},
                      open(at("pp2.json"), "w"))
            pp2 = common + ["--strategy", at("pp2.json"), "--nproc", "2", "--steps", "4", "--lr", "1e20", "--quiet"]
            p = run(pp2 + ["--save", at("good.safetensors")])
            expect_error("two ranks stop at the non-finite step", p, "[train] step 1: loss nan")
            check(open(at("good.safetensors"), "rb").read() == good, "the earlier --save is untouched (two ranks)")
            p = run(pp2 + ["--skip-nonfinite-steps", "5", "--log", at("pp2.jsonl")])
            rows = [json.loads(l) for l in open(at("pp2.jsonl"))]
            check(p.returncode == 0 and [r["step"] for r in rows if r.get("skipped")] == [1, 2, 3],
                  f"two ranks skip the same steps: rc={p.returncode} {p.stderr[-300:]!r}")

        # 4. Outputs checked before step 0.
        os.mkdir(at("adir"))
        open(at("afile"), "w").write("x")
        cases = [("--save", "/proc/hspmd-test.safetensors", "cannot create a file in /proc"),
                 ("--save", at("adir"), "is a directory"),
                 ("--log", at("adir"), "is a directory"),
                 ("--log", "/proc/hspmd-test.jsonl", "cannot create"),
                 ("--dump-grads", "/proc/hspmd-grads.safetensors", "cannot create"),
                 ("--checkpoint", at("afile"), "not a directory")]
        for flag, path, why in cases:
            extra = ["--save-every", "1"] if flag == "--checkpoint" else []
            expect_error(f"{flag} {path} is refused before step 0", train(flag, path, *extra),
                         f"{flag} {path}", why, before_step0=True)
        if os.path.exists("/dev/full"):
            expect_error("a write error on --log fails the run", train("--quiet", "--log", "/dev/full"),
                         "--log /dev/full", "write failed")
            # --trace describes a distributed run: a strategy of one rank (an MPI singleton).
            json.dump({"pipelines": [{"micro_batch_size": 2, "micro_batches": 1,
                                      "stages": [{"ranks": [0], "layers": [0, 7]}]}]}, open(at("one.json"), "w"))
            os.symlink("/dev/full", at("full-trace.json"))
            one = common + ["--steps", "2", "--strategy", at("one.json")]
            expect_error("--trace that is a directory is refused before step 0",
                         run(one + ["--trace", at("adir")]), f"--trace {at('adir')}", "is a directory",
                         before_step0=True)
            expect_error("a write error on --trace fails the run",
                         run(one + ["--quiet", "--trace", at("full-trace.json")]), "--trace", "write failed")

        # 5. Device files are never replaced.
        os.mkfifo(at("fifo"))
        os.symlink("/dev/null", at("null-link"))
        for flag in ["--save", "--dump-grads"]:
            for target, kind in [(at("fifo"), "a FIFO"), (at("null-link"), "a character device")]:
                expect_error(f"{flag} {kind} is refused", train(flag, target), f"{flag} {target}", kind,
                             before_step0=True)
        open(at("doc.txt"), "w").write("hello")
        for target, kind in [(at("fifo"), "a FIFO"), (at("null-link"), "a character device")]:
            p = run([a.hspmd, "tokenize", "--eos", "256", "--output", target, at("doc.txt")])
            expect_error(f"tokenize --output {kind} is refused", p, f"--output {target}", kind)
        check(stat.S_ISFIFO(os.lstat(at("fifo")).st_mode), "the FIFO is still a FIFO")
        check(os.path.islink(at("null-link")), "the link is still a link")
        check(stat.S_ISCHR(os.stat("/dev/null").st_mode), "/dev/null is still a character device")
        leftovers = [n for n in os.listdir(tmp) if ".tmp" in n or "probe" in n]
        check(not leftovers, f"no temporary or probe file is left: {leftovers}")
    if FAILURES:
        sys.exit(f"FAIL: {len(FAILURES)} check(s)")
    print("PASS")


if __name__ == "__main__":
    main()
