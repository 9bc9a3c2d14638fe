#!/usr/bin/env bash
# Runs the whole test suite (installs missing packages and builds first),
# then the capped leg (scripts/test_capped.sh): the bf16, oracle and
# equivalence tests again with every instruction-set choice capped at AVX2,
# as a CPU without AVX-512 makes them (docs/precision.md, "CPUs the tests
# run on").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/build.sh
bash scripts/setup_oracle_venv.sh  # transformers for the HF oracle; without PyPI those tests skip
ctest --test-dir build --output-on-failure -j "$(nproc)" --timeout 600
bash scripts/test_capped.sh
