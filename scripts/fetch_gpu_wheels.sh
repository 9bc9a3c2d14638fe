#!/usr/bin/env bash
# Fetches the Hugging Face oracle's Python packages as wheels for the GPU
# machine (Python 3.12, x86-64, no internet there), into DIR/wheels (default
# .gpu-deps/wheels, carried along with .gpu-deps). The versions are
# scripts/setup_oracle_venv.sh's pins, so the oracle compares against the
# same transformers on the CPU and on the GPU machine, and one tolerance
# holds (docs/models.md, "Oracles"). scripts/gpu_check.sh installs them with
# pip --target into a folder it puts first on PYTHONPATH for the oracle.
# Idempotent (FORCE=1 fetches again).
#   bash scripts/fetch_gpu_wheels.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.gpu-deps}/wheels
pin() {  # pin NAME -> NAME==VERSION as setup_oracle_venv.sh pins it
  grep -E "^  $1==" scripts/setup_oracle_venv.sh | tr -d ' ' || { echo "no pin for $1" >&2; exit 1; }
}
WANT=("$(pin transformers)" "$(pin tokenizers)" "$(pin huggingface-hub)")
STAMP="$DIR/pins.txt"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "${WANT[*]}" && "${FORCE:-0}" != 1 ]]; then
  echo "gpu wheels: ${WANT[*]} already in $DIR"
  exit 0
fi
rm -rf "$DIR.new"
mkdir -p "$DIR.new"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DIR.new" "${WANT[@]}"
echo "${WANT[*]}" >"$DIR.new/pins.txt"
rm -rf "$DIR"
mv "$DIR.new" "$DIR"
echo "gpu wheels: ${WANT[*]} -> $DIR ($(du -sh "$DIR" | cut -f1))"
