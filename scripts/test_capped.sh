#!/usr/bin/env bash
# The capped leg of the test command (scripts/test.sh; docs/precision.md,
# "CPUs the tests run on"): the precision-sensitive tests (bf16, the
# oracles against PyTorch and Hugging Face, the plan equivalence, the model
# clock) again, with every instruction-set choice capped at AVX2, as an
# AVX2-only CPU makes them: hspmd's CPU kernels (HSPMD_CPU_ISA), oneDNN
# (ONEDNN_MAX_CPU_ISA), OpenBLAS (OPENBLAS_CORETYPE=Haswell) and PyTorch's
# ATen (ATEN_CPU_CAPABILITY; the references turn torch's oneDNN off under
# the cap, llama_ref.py). On a CPU without AVX-512 the main run already was
# this leg, and it is not run twice. Extra arguments go to ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! grep -qw avx512f /proc/cpuinfo; then
  echo "capped leg: this CPU has no AVX-512; the main run took the AVX2 paths already"
  exit 0
fi
REGEX="${HSPMD_CAPPED_TESTS:-bf16|Bf16|oracle|equivalence|model_clock}"
echo "capped leg: HSPMD_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 OPENBLAS_CORETYPE=Haswell ATEN_CPU_CAPABILITY=avx2," \
     "tests matching '$REGEX'"
HSPMD_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 OPENBLAS_CORETYPE=Haswell ATEN_CPU_CAPABILITY=avx2 \
  ctest --test-dir build --output-on-failure -j "$(nproc)" --timeout 600 -R "$REGEX" "$@"
