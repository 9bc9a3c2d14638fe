#!/usr/bin/env bash
# Fetches what the GPU probes (tests/gpu) need and a GPU machine without
# internet may lack, into DIR (default .gpu-deps, git-ignored, carried to the
# GPU machine):
#   DIR/cudnn_frontend/include  NVIDIA cudnn_frontend (header-only C++ graph
#                               API, MIT), from the PyPI wheel
#                               nvidia-cudnn-frontend (its include/ folder)
#   DIR/cudnn-include           cudnn*.h copied from the local CUDA toolkit, a
#                               fallback for a machine whose cuDNN has no headers
#   DIR/nccl-include            nccl.h, likewise for NCCL
# Idempotent: a part already present is kept (FORCE=1 fetches again).
# Usage: bash scripts/fetch_cudnn_frontend.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."

DIR=${1:-.gpu-deps}
VERSION=${CUDNN_FRONTEND_VERSION:-1.32.0}
FE_DIR="$DIR/cudnn_frontend"
mkdir -p "$DIR"

if [[ -f "$FE_DIR/include/cudnn_frontend.h" && -f "$FE_DIR/VERSION" &&
      "$(cat "$FE_DIR/VERSION")" == "$VERSION" && "${FORCE:-0}" != 1 ]]; then
  echo "cudnn_frontend $VERSION already in $FE_DIR/include"
else
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  # The wheel is per Python version and platform, but its include/ is the same
  # in each: ask for one fixed tag so this works from any Python.
  python3 -m pip download --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    -d "$tmp" "nvidia-cudnn-frontend==$VERSION"
  whl=$(ls "$tmp"/nvidia_cudnn_frontend-*.whl | head -n 1)
  rm -rf "$FE_DIR.new"
  mkdir -p "$FE_DIR.new"
  python3 - "$whl" "$FE_DIR.new" <<'EOF'
import sys, zipfile, os
whl, dest = sys.argv[1], sys.argv[2]
n = 0
with zipfile.ZipFile(whl) as z:
    for name in z.namelist():
        if name.startswith("include/") and not name.endswith("/"):
            z.extract(name, dest)
            n += 1
if n == 0 or not os.path.isfile(os.path.join(dest, "include", "cudnn_frontend.h")):
    sys.exit("no include/cudnn_frontend.h in " + whl)
print(f"extracted {n} header files from {os.path.basename(whl)}")
EOF
  echo "$VERSION" > "$FE_DIR.new/VERSION"
  rm -rf "$FE_DIR"
  mv "$FE_DIR.new" "$FE_DIR"
  echo "cudnn_frontend $VERSION -> $FE_DIR/include"
fi

# cuDNN's own headers, for a GPU machine whose cuDNN (e.g. a pip package)
# ships only the libraries. cuDNN 9 keeps its ABI within the major version;
# the probes print cudnnGetVersion() at run time.
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
hdr_src=""
for d in "${CUDNN_INCLUDE_DIR:-}" "$CUDA_HOME/include" /usr/include /usr/include/x86_64-linux-gnu; do
  if [[ -n "$d" && -f "$d/cudnn.h" ]]; then hdr_src=$d; break; fi
done
if [[ -n "$hdr_src" ]]; then
  mkdir -p "$DIR/cudnn-include"
  cp -u "$hdr_src"/cudnn*.h "$DIR/cudnn-include/"
  echo "cudnn headers $(grep -E '#define CUDNN_(MAJOR|MINOR|PATCHLEVEL) ' "$hdr_src/cudnn_version.h" |
    awk '{printf "%s%s", sep, $3; sep="."}') from $hdr_src -> $DIR/cudnn-include"
else
  echo "no cudnn.h found locally; $DIR/cudnn-include not made" >&2
fi

nccl_src=""
for d in "${NCCL_INCLUDE_DIR:-}" "$CUDA_HOME/include" /usr/include /usr/include/x86_64-linux-gnu; do
  if [[ -n "$d" && -f "$d/nccl.h" ]]; then nccl_src=$d; break; fi
done
if [[ -n "$nccl_src" ]]; then
  mkdir -p "$DIR/nccl-include"
  cp -u "$nccl_src/nccl.h" "$DIR/nccl-include/"
  echo "nccl.h $(grep -m1 -E '#define NCCL_VERSION_CODE' "$nccl_src/nccl.h" | awk '{print $3}') from $nccl_src -> $DIR/nccl-include"
else
  echo "no nccl.h found locally; $DIR/nccl-include not made" >&2
fi
