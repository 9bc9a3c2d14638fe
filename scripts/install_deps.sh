#!/usr/bin/env bash
# Installs every system package hspmd needs, from Debian's archive (and,
# with a CUDA toolkit, the cudnn_frontend headers: see fetch_cudnn_frontend).
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
  python3-pip                # pip download of the cudnn_frontend headers (below)
)

# With a CUDA toolkit (nvcc), the cudnn_frontend headers from PyPI
# (scripts/fetch_cudnn_frontend.sh, into .gpu-deps), so that the build
# compiles the CUDA backend's cuDNN attention (HSPMD_CUDNN, docs/cuda.md).
# Optional: a failed fetch warns, and the build leaves cuDNN attention out.
fetch_cudnn_frontend() {
  if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
    bash "$(dirname "$0")/fetch_cudnn_frontend.sh" >/dev/null 2>&1 ||
      echo "warning: scripts/fetch_cudnn_frontend.sh failed: the build leaves cuDNN attention out" >&2
  fi
  return 0
}

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  fetch_cudnn_frontend
  exit 0
fi
echo "installing: ${missing[*]}" >&2
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -q
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fetch_cudnn_frontend
