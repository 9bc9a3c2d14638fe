#!/usr/bin/env python3
"""The smoke tests can fail (CTest bench_smoke_can_fail): every benchmark and
example smoke run against a broken hspmd must exit non-zero (not 0, not 77,
the skip code) and pass the broken call's message on.

  every call broken   a stand-in hspmd (and gemm_bench, hspmd_step,
                      hspmd_specialize) that refuses whatever it is asked;
  one call broken     the real hspmd except one kind of call, which fails
                      the way the planner refused `plan cost` before the
                      mixed-length fix: `train` for the mixed-length bench
                      (after its profile, cap and plan searches succeeded),
                      `plan switch` for the elastic dry run.

usage: can_fail.py --repo DIR --hspmd build/src/cli/hspmd [--python python3] [--mpi ON|OFF]
"""
import argparse
import os
import stat
import subprocess
import sys
import tempfile

FAKE = """#!/bin/sh
echo "{name}: error: a broken call: $* [smoke self-test]" >&2
exit 1
"""
# The real hspmd, except calls whose leading words are WORDS.
ONE_BROKEN = """#!/bin/sh
case "$*" in
  "{words}"*) echo "hspmd: error: [smoke self-test] a broken {words} call" >&2; exit 1 ;;
esac
exec "{real}" "$@"
"""


def write_exe(path, text):
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC | stat.S_IXGRP | stat.S_IXOTH)
    return path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", required=True)
    ap.add_argument("--hspmd", required=True)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--mpi", default="ON")
    a = ap.parse_args()
    mpi = a.mpi.upper() in ("ON", "1", "TRUE", "YES")
    a.repo, a.hspmd = os.path.abspath(a.repo), os.path.abspath(a.hspmd)
    bench = os.path.join(a.repo, "bench")
    failures = []
    with tempfile.TemporaryDirectory(prefix="bench_smoke_can_fail_") as tmp:
        fake = write_exe(os.path.join(tmp, "hspmd"), FAKE.format(name="hspmd"))
        fake_build = os.path.join(tmp, "build")
        os.makedirs(os.path.join(fake_build, "src", "cli"))
        os.makedirs(os.path.join(fake_build, "bench"))
        write_exe(os.path.join(fake_build, "src", "cli", "hspmd"), FAKE.format(name="hspmd"))
        for exe in ("gemm_bench", "hspmd_step", "hspmd_specialize"):
            write_exe(os.path.join(fake_build, "bench", exe), FAKE.format(name=exe))
        py = lambda script, *args: [a.python, os.path.join(bench, script)] + list(args)  # noqa: E731
        cases = [
            ("elastic_paper, every call", py("elastic_paper.py", "--hspmd", fake, "--smoke"), {}),
            ("planner_paper, every call", py("planner_paper.py", "--hspmd", fake, "--smoke"), {}),
            ("mixed_length_paper, every call", py("mixed_length_paper.py", "--hspmd", fake, "--smoke"), {}),
            ("specialize_scale, every call", py("specialize_scale.py", "--build", fake_build, "--smoke"), {}),
            ("gemm_bench, every call",
             py("gemm_bench.py", "--exe", os.path.join(fake_build, "bench", "gemm_bench"), "--smoke"), {}),
            ("train_step, every call",
             py("train_step.py", "--hspmd-step", os.path.join(fake_build, "bench", "hspmd_step"), "--steps", "1",
                "--threads", "1", "--precisions", "fp32"), {}),
            ("train_tiny.sh, every call", ["bash", os.path.join(a.repo, "examples", "train_tiny.sh")],
             {"SMOKE": "1", "HSPMD": fake, "OUT": os.path.join(tmp, "out1")}),
            ("elastic_paper, plan switch",
             py("elastic_paper.py", "--hspmd", write_exe(os.path.join(tmp, "no_switch"), ONE_BROKEN.format(
                 words="plan switch", real=a.hspmd)), "--smoke"), {}),
        ]
        if mpi:
            for s in ("checkpoint_async", "cp_balance", "dist_step", "emulated_step", "mixed_length_bench",
                      "planner_bench", "restart_vs_online", "switch_bench"):
                cases.append((f"{s}, every call", py(f"{s}.py", "--hspmd", fake, "--smoke"), {}))
            cases += [
                ("gpu_dist cpu:1, every call", py("gpu_dist.py", "--hspmd", fake, "--device", "cpu:1", "--steps", "3",
                                                  "--seq-len", "32"), {}),
                ("train_tiny_distributed.sh, every call",
                 ["bash", os.path.join(a.repo, "examples", "train_tiny_distributed.sh")],
                 {"SMOKE": "1", "HSPMD": fake, "OUT": os.path.join(tmp, "out2")}),
                ("mixed_length_bench, train",
                 py("mixed_length_bench.py", "--hspmd", write_exe(os.path.join(tmp, "no_train"), ONE_BROKEN.format(
                     words="train", real=a.hspmd)), "--smoke"), {}),
            ]
        for name, cmd, env in cases:
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp,
                                   env=dict(os.environ, **env))
                rc, out = r.returncode, r.stderr + r.stdout
            except subprocess.TimeoutExpired:
                rc, out = None, "timed out"
            # non-zero, and because of the broken call (its message passed on), not of something else
            ok = rc not in (0, 77, None) and "[smoke self-test]" in out
            last = out.strip().splitlines()[-1][:160] if out.strip() else ""
            print(f"{'ok  ' if ok else 'FAIL'} {name}: exit {rc}; {last}")
            if not ok:
                failures.append(name)
    print("ok" if not failures else f"these smoke runs passed a broken hspmd: {', '.join(failures)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
