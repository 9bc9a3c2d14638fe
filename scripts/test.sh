#!/usr/bin/env bash
# Runs the whole test suite (installs missing packages and builds first).
# `ONEDNN_MAX_CPU_ISA=AVX2 OPENBLAS_CORETYPE=Haswell bash scripts/test.sh`
# takes the library paths of a CPU without AVX-512 (docs/precision.md, "CPUs
# the tests run on").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/build.sh
bash scripts/setup_oracle_venv.sh  # transformers for the HF oracle; without PyPI those tests skip
ctest --test-dir build --output-on-failure -j "$(nproc)" --timeout 600
