#!/usr/bin/env python3
"""Every script under bench/ and examples/ has a smoke test in the suite
(CTest bench_smoke_coverage; docs/benchmarks.md, "Smoke tests and the docs
check").

SMOKE below names, for each script, the CTest that runs it in its smoke mode
(tests/bench_smoke/CMakeLists.txt, or the test that already ran it before:
the GPU benchmarks' CPU harnesses, the Python examples' equivalence tests).
This test lists them and fails when

  * a Python or shell script under bench/ or examples/ is missing from SMOKE
    (a new script needs a smoke test), or SMOKE names a file that is gone;
  * the named CTest is not registered in this build (`ctest --show-only`),
    unless it needs a part the build left out (MPI, the Python module, the
    benchmarks' C++ drivers);
  * the CTest does not run the script: its command names the script, or a
    test script in its command does (tests/python/*_test.py run the
    examples), or the script is run by another smoke-tested script.

usage: coverage.py --repo DIR --build DIR --ctest CTEST [--mpi ON|OFF] [--python-module ON|OFF] [--bench ON|OFF]
"""
import argparse
import glob
import json
import os
import subprocess
import sys

# script -> (the CTests that may run it, the first registered counts; what they need beyond the build:
# "mpi", "python" (the module), "bench" (bench/'s C++ drivers) or None). The GPU benchmarks' CPU harnesses
# are tests/gpu's in a build with the CUDA toolkit, bench_smoke_*'s without it.
SMOKE = {
    "bench/checkpoint_async.py": (["bench_smoke_checkpoint_async"], "mpi"),
    "bench/cp_balance.py": (["bench_smoke_cp_balance"], "mpi"),
    "bench/dist_step.py": (["bench_smoke_dist_step"], "mpi"),
    "bench/elastic_paper.py": (["bench_smoke_elastic_paper"], None),
    "bench/emulated_step.py": (["bench_smoke_emulated_step"], "mpi"),
    "bench/gemm_bench.py": (["bench_smoke_gemm_bench"], "bench"),
    "bench/gpu_dist.py": (["gpu_dist_bench_harness_on_cpu", "bench_smoke_gpu_dist"], "mpi"),
    "bench/gpu_overlap.py": (["gpu_overlap_bench_harness_on_cpu", "bench_smoke_gpu_overlap"], "mpi"),
    "bench/gpu_step.py": (["gpu_step_bench_harness_on_cpu", "bench_smoke_gpu_step"], None),
    "bench/mixed_length_bench.py": (["bench_smoke_mixed_length_bench"], "mpi"),
    "bench/mixed_length_paper.py": (["bench_smoke_mixed_length_paper"], None),
    "bench/moe_step.py": (["bench_smoke_moe_step"], None),
    "bench/moe_imbalance.py": (["bench_smoke_moe_imbalance"], None),
    "bench/mps_hetero.py": (["mps_hetero_bench_harness_on_cpu"], "mpi"),
    "bench/planner_bench.py": (["bench_smoke_planner_bench"], "mpi"),
    "bench/planner_paper.py": (["bench_smoke_planner_paper"], None),
    "bench/profile_check.py": (["bench_smoke_profile_check"], None),
    "bench/restart_vs_online.py": (["bench_smoke_restart_vs_online"], "mpi"),
    "bench/roofline_fit.py": (["plan_roofline_calibration"], None),
    "bench/specialize_scale.py": (["bench_smoke_specialize_scale"], "bench"),
    "bench/step_memory.py": (["step_memory_harness", "bench_smoke_step_memory"], None),
    "bench/switch_bench.py": (["bench_smoke_switch_bench"], "mpi"),
    "bench/torch_step.py": (["bench_smoke_train_step"], "bench"),  # run by train_step.py
    "bench/train_step.py": (["bench_smoke_train_step"], "bench"),
    "bench/weight_copies.py": (["bench_smoke_weight_copies"], None),
    "bench/cuda_graphs.py": (["bench_smoke_cuda_graphs"], None),
    "examples/python/custom_gpt.py": (["python_custom_model"], "python"),
    "examples/python/switch_plans.py": (["python_trainer_switch"], "python"),
    "examples/python/train_tiny.py": (["python_trainer_matches_cli_np1"], "python"),
    "examples/train_tiny.sh": (["example_smoke_train_tiny"], None),
    "examples/train_tiny_distributed.sh": (["example_smoke_train_tiny_distributed"], "mpi"),
}


def scripts(repo):
    found = set()
    for pattern in ("bench/*.py", "bench/**/*.py", "examples/**/*.py", "examples/**/*.sh", "examples/*.sh",
                    "bench/*.sh"):
        for f in glob.glob(os.path.join(repo, pattern), recursive=True):
            rel = os.path.relpath(f, repo)
            if "__pycache__" not in rel:
                found.add(rel)
    return found


def runs(test, script, repo, tests, seen=()):
    """Whether the CTest's command runs the script (directly, or through a script of its command)."""
    cmd = tests[test]
    base = os.path.basename(script)
    for arg in cmd:
        if os.path.normpath(arg).endswith(os.path.normpath(script)):
            return True
    for arg in cmd:
        if arg.endswith(".py") and os.path.isfile(arg) and arg not in seen:
            src = open(arg, encoding="utf-8", errors="replace").read()
            if base in src:
                return True
    return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", required=True)
    ap.add_argument("--build", required=True)
    ap.add_argument("--ctest", default="ctest")
    ap.add_argument("--mpi", default="ON")
    ap.add_argument("--python-module", default="ON")
    ap.add_argument("--bench", default="ON")
    a = ap.parse_args()
    on = lambda v: v.upper() in ("ON", "1", "TRUE", "YES")  # noqa: E731
    have = {"mpi": on(a.mpi), "python": on(a.python_module), "bench": on(a.bench), None: True}
    r = subprocess.run([a.ctest, "--test-dir", a.build, "--show-only=json-v1"], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"ctest --show-only failed: {r.stderr[-1000:]}")
    tests = {t["name"]: t.get("command", []) for t in json.loads(r.stdout)["tests"]}
    problems, lines = [], []
    present = scripts(a.repo)
    for s in sorted(present - set(SMOKE)):
        problems.append(f"{s}: no smoke test (add one to tests/bench_smoke/CMakeLists.txt and to SMOKE here)")
    for s in sorted(set(SMOKE) - present):
        problems.append(f"{s}: named in SMOKE but not in the repository")
    for s in sorted(set(SMOKE) & present):
        names, needs = SMOKE[s]
        test = next((t for t in names if t in tests), None)
        if test is None:
            if have[needs]:
                problems.append(f"{s}: none of its smoke tests ({', '.join(names)}) is registered")
            else:
                lines.append(f"  {s:40s} {' / '.join(names)} (not in this build: no {needs})")
            continue
        if s == "bench/torch_step.py":  # run by train_step.py, which the test runs
            ok = runs(test, "bench/train_step.py", a.repo, tests) and \
                "torch_step.py" in open(os.path.join(a.repo, "bench", "train_step.py")).read()
        else:
            ok = runs(test, s, a.repo, tests)
        if not ok:
            problems.append(f"{s}: the test {test} does not run it")
        lines.append(f"  {s:40s} {test}")
    print(f"smoke tests of the {len(present)} scripts under bench/ and examples/:")
    print("\n".join(lines))
    for p in problems:
        print("FAIL: " + p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
