#!/usr/bin/env bash
# Sets up a fresh Debian machine for the main job: the packages hspmd needs
# to build and run (install_deps.sh --main: not PyTorch, which only the tests
# use), then the CLI and the Python module (scripts/build.sh --main; CUDA
# only with a GPU). The test command (scripts/test.sh) installs and builds
# the rest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh --main
bash scripts/build.sh --main
