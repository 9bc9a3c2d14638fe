#!/usr/bin/env bash
# Configures and builds hspmd (Release) into build/.
#   bash scripts/build.sh          everything: the CLI, the Python module, the
#                                  tests, benchmarks and fuzzers (the test command)
#   bash scripts/build.sh --main   what the main job needs: the CLI and the
#                                  Python module (the first command, scripts/setup.sh)
# Other arguments go to cmake's configure step. Both build the same
# configuration in build/, so the test command after the first one builds
# only the rest.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGETS=()
ARGS=()
for a in "$@"; do
  if [ "$a" = "--main" ]; then TARGETS=(--target hspmd); else ARGS+=("$a"); fi
done
# The first command compiles the CUDA backend only where it can run: a GPU
# that nvidia-smi lists, or HSPMD_CUDA=ON/AUTO given (a build configured
# once keeps its choice; the test command on a fresh clone compiles it
# whenever nvcc is found).
if [ ${#TARGETS[@]} -gt 0 ] && [ ! -f build/CMakeCache.txt ] && [ -z "${HSPMD_CUDA:-}" ] &&
   ! nvidia-smi -L >/dev/null 2>&1; then
  ARGS+=(-DHSPMD_CUDA=OFF)
elif [ -n "${HSPMD_CUDA:-}" ]; then
  ARGS+=("-DHSPMD_CUDA=$HSPMD_CUDA")
fi
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release "${ARGS[@]}" >/dev/null
# The Python module's target exists when pybind11 and the Python headers
# were found (HSPMD_PYTHON=AUTO).
# (grep reads the whole list: with -q it would stop early, and pipefail would
# count cmake's broken pipe as a failure.)
if [ ${#TARGETS[@]} -gt 0 ] && cmake --build build --target help | grep -w hspmd_python >/dev/null; then
  TARGETS+=(hspmd_python)
fi
cmake --build build -j "$(nproc)" "${TARGETS[@]}"
