#!/usr/bin/env bash
# Sets up a fresh Debian machine: system packages, then the build.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/build.sh
