#!/usr/bin/env bash
# Creates the virtual environment of the Hugging Face oracle tests
# (tests/oracle/hf_oracle_test.py): Debian's python3 with its system
# packages visible (python3-torch 1.13, python3-numpy, requests, yaml), plus
# a pinned transformers from PyPI. docs/models.md ("Oracles") says why
# these versions.
#
# Idempotent: when the venv exists with exactly these pins it only says so.
# When PyPI cannot be reached it prints one line and exits 0 (the HF tests
# then report SKIPPED); a failure with PyPI reachable exits 1.
#
# usage: bash scripts/setup_oracle_venv.sh        (HSPMD_ORACLE_VENV=DIR to place it elsewhere)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${HSPMD_ORACLE_VENV:-$PWD/.venv-oracle}"
PY=/usr/bin/python3
# transformers 4.47.1: the last release whose torch requirement admits 1.x
# (4.48 requires torch>=2.0); has Qwen2 (4.37+) and applies Mistral's
# sliding window in the eager mask. The rest: its dependencies as pip
# resolved them for that pin (requests, pyyaml, typing-extensions and numpy
# come from Debian, as dependencies of python3-torch).
PINS=(
  transformers==4.47.1
  tokenizers==0.21.4
  huggingface-hub==0.36.2
  hf-xet==1.8.0
  safetensors==0.8.0
  regex==2026.11.19
  tqdm==4.70.1
  packaging==26.4
  filelock==4.3.1
  fsspec==2026.9.0
)
STAMP="$VENV/hspmd-oracle-pins.txt"
RECORD="$VENV/hspmd-oracle-installed.txt"
want_stamp="$("$PY" -c 'import sys; print(sys.version.split()[0])') ${PINS[*]}"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want_stamp" ] &&
   "$VENV/bin/python3" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("transformers") is None)' 2>/dev/null; then
  echo "oracle venv: $VENV is up to date (${PINS[0]}; installed: $RECORD)"
  exit 0
fi

index="${PIP_INDEX_URL:-https://pypi.org/simple}"
if ! "$PY" - "$index" <<'EOF' 2>/dev/null; then
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/transformers/", timeout=15).read(1)
EOF
  stale=""
  if [ -f "$STAMP" ]; then  # ours, with other pins: the tests must not run on those
    rm -rf "$VENV"
    stale=", removed the stale one"
  fi
  echo "oracle venv: $index cannot be reached; not creating $VENV$stale (the Hugging Face oracle tests will report SKIPPED)"
  exit 0
fi

if ! "$PY" -c 'import ensurepip' 2>/dev/null; then
  echo "oracle venv: $PY has no venv/ensurepip (install Debian's python3-venv: bash scripts/install_deps.sh)" >&2
  exit 1
fi

start=$(date +%s)
rm -rf "$VENV"
"$PY" -m venv --system-site-packages "$VENV"
log="$VENV/pip-install.log"
if ! "$VENV/bin/python3" -m pip install --disable-pip-version-check --no-input --progress-bar off \
       --timeout 60 --retries 3 "${PINS[@]}" >"$log" 2>&1; then
  tail -n 20 "$log" >&2
  mv "$log" "$VENV.pip-install.log" 2>/dev/null || true
  rm -rf "$VENV"
  echo "oracle venv: pip install failed with PyPI reachable (log: $VENV.pip-install.log)" >&2
  exit 1
fi
"$VENV/bin/python3" -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}")' >/dev/null
secs=$(( $(date +%s) - start ))
size=$(du -sm "$VENV" | cut -f1)
{
  echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ): $secs s, $size MiB, from $PY $("$PY" -c 'import sys; print(sys.version.split()[0])') --system-site-packages"
  "$VENV/bin/python3" -c 'import torch, numpy; print(f"# system: torch {torch.__version__}, numpy {numpy.__version__}")'
  "$VENV/bin/python3" -m pip freeze --local --disable-pip-version-check
} >"$RECORD"
echo "$want_stamp" >"$STAMP"
echo "oracle venv: installed ${PINS[0]} and $(( ${#PINS[@]} - 1 )) dependencies into $VENV in $secs s ($size MiB; list: $RECORD)"
