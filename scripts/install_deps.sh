#!/usr/bin/env bash
# Installs every system package hspmd needs, from Debian's archive.
# Idempotent: does nothing when all packages are already installed.
set -euo pipefail

PACKAGES=(
  build-essential cmake pkg-config
  libopenblas-dev            # BLAS (sgemm) for the CPU backend
  libdnnl-dev                # oneDNN: bf16 (avx512_bf16/AMX) and fp32 GEMMs; optional in CMake
  libopenmpi-dev openmpi-bin # MPI: communication and the multi-process launcher
  nlohmann-json3-dev         # JSON (configs, plans, safetensors headers)
  libgtest-dev               # GoogleTest
  coinor-libcbc-dev          # CBC: the planner's integer programs (docs/ilp.md)
  python3 python3-torch python3-numpy  # PyTorch oracle tests and the peer benchmark
  python3-venv               # the Hugging Face oracle's venv (scripts/setup_oracle_venv.sh)
  python3-dev python3-pybind11  # the Python module hspmd (docs/python.md; HSPMD_PYTHON)
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "installing: ${missing[*]}" >&2
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -q
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
