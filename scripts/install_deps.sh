#!/usr/bin/env bash
# Installs every system package hspmd needs, from Debian's archive (and,
# with a CUDA toolkit, the cudnn_frontend headers: see fetch_cudnn_frontend).
# Idempotent: does nothing when all packages are already installed.
#   bash scripts/install_deps.sh          what building, running and testing need
#                                         (the test command), and the wheels of the
#                                         CTest python_pip_install (.pip-wheels/)
#   bash scripts/install_deps.sh --main   what building and running need (the first
#                                         command, scripts/setup.sh)
set -euo pipefail

# What building and running hspmd needs (the first command installs only
# these: `install_deps.sh --main`, from scripts/setup.sh).
PACKAGES=(
  build-essential cmake pkg-config
  libopenblas-dev            # BLAS (sgemm) for the CPU backend
  libdnnl-dev                # oneDNN: bf16 (avx512_bf16/AMX) and fp32 GEMMs; optional in CMake
  libopenmpi-dev openmpi-bin # MPI: communication and the multi-process launcher
  nlohmann-json3-dev         # JSON (configs, plans, safetensors headers)
  libgtest-dev               # GoogleTest (the same build directory serves the tests)
  coinor-libcbc-dev          # CBC: the planner's integer programs (docs/ilp.md)
  python3 python3-numpy      # Python, numpy for the module's arrays
  python3-dev python3-pybind11  # the Python module hspmd (docs/python.md; HSPMD_PYTHON)
  ccache                     # compiled objects reused across builds (CMake option HSPMD_CCACHE)
)
# What the tests and the GPU build add (the test command installs these too).
TEST_PACKAGES=(
  python3-torch              # PyTorch oracle tests and the peer benchmark
  python3-venv               # the Hugging Face oracle's venv (scripts/setup_oracle_venv.sh)
  python3-pip                # pip download of the cudnn_frontend headers (below)
  iproute2                   # ip, tc: the test hosts of scripts/netns_cluster.sh (docs/multi_host.md)
  nftables                   # nft: a lossy link between test hosts (netns_cluster.sh loss)
)
MAIN=0
if [ "${1:-}" = "--main" ]; then
  MAIN=1
else
  PACKAGES+=("${TEST_PACKAGES[@]}")
fi

# With a CUDA toolkit (nvcc), the cudnn_frontend headers from PyPI
# (scripts/fetch_cudnn_frontend.sh, into .gpu-deps), so that the build
# compiles the CUDA backend's cuDNN attention (HSPMD_CUDNN, docs/cuda.md).
# Optional: a failed fetch warns, and the build leaves cuDNN attention out.
fetch_cudnn_frontend() {
  # The first command builds CUDA only with a GPU (scripts/build.sh --main).
  if [ "$MAIN" = 1 ] && ! nvidia-smi -L >/dev/null 2>&1 && [ -z "${HSPMD_CUDA:-}" ]; then return 0; fi
  if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
    bash "$(dirname "$0")/fetch_cudnn_frontend.sh" >/dev/null 2>&1 ||
      echo "warning: scripts/fetch_cudnn_frontend.sh failed: the build leaves cuDNN attention out" >&2
  fi
  return 0
}

# The test command: scikit-build-core and its dependencies as wheels in
# .pip-wheels/, from PyPI, for the CTest python_pip_install, which installs
# them from there (pip --no-index: no network during the test). Without PyPI
# it warns, and that test reports SKIPPED. docs/python.md, "Installing with pip".
PIP_WHEELS=(scikit-build-core==1.1.2 packaging==26.4 pathspec==1.1.1)
fetch_pip_wheels() {
  if [ "$MAIN" = 1 ]; then return 0; fi
  local dir
  dir="$(cd "$(dirname "$0")/.." && pwd)/.pip-wheels"
  local have=1 w
  for w in "${PIP_WHEELS[@]}"; do
    w="${w//-/_}"
    compgen -G "$dir/${w/==/-}-*.whl" >/dev/null || have=0
  done
  if [ "$have" = 1 ]; then return 0; fi
  /usr/bin/python3 -m pip download --disable-pip-version-check --no-input --progress-bar off --timeout 30 \
      --retries 2 --only-binary=:all: --no-deps --dest "$dir" "${PIP_WHEELS[@]}" >/dev/null 2>&1 ||
    echo "warning: pip download of ${PIP_WHEELS[*]} into $dir failed (no PyPI?): the CTest python_pip_install will report SKIPPED" >&2
  return 0
}

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  fetch_cudnn_frontend
  fetch_pip_wheels
  exit 0
fi
echo "installing: ${missing[*]}" >&2
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -q
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fetch_cudnn_frontend
fetch_pip_wheels
