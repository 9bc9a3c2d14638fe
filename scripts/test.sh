#!/usr/bin/env bash
# Runs the whole test suite (installs missing packages and builds first).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/build.sh
bash scripts/setup_oracle_venv.sh  # transformers for the HF oracle; without PyPI those tests skip
ctest --test-dir build --output-on-failure -j "$(nproc)" --timeout 600
