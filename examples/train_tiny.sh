#!/usr/bin/env bash
# The README's main job: tokenize the bundled corpus and train the tiny Llama
# on it. Writes to out/: corpus.bin, train.jsonl, tiny-llama.safetensors.
# Environment: STEPS (default 300), OUT (the output folder, default out),
# HSPMD (default ./build/src/cli/hspmd); SMOKE=1 is the smoke mode (3 steps
# into OUT; the CTest example_smoke_train_tiny gives it a temporary OUT): the
# same commands, and the script fails unless every step logged a finite loss.
set -euo pipefail
cd "$(dirname "$0")/.."
SMOKE=${SMOKE:-0}
if [ "$SMOKE" = 1 ]; then STEPS=${STEPS:-3}; else STEPS=${STEPS:-300}; fi
OUT=${OUT:-out}
HSPMD=${HSPMD:-./build/src/cli/hspmd}
mkdir -p "$OUT"
"$HSPMD" tokenize --model examples/tiny-llama/config.json \
  --output "$OUT/corpus.bin" data/corpus/*.txt
"$HSPMD" train --model examples/tiny-llama/config.json --data "$OUT/corpus.bin" \
  --seq-len 128 --global-batch 16 --steps "$STEPS" --lr 3e-3 --lr-schedule cosine \
  --warmup-steps 20 --weight-decay 0.1 --clip-grad 1.0 --seed 0 --precision auto \
  --log "$OUT/train.jsonl" --save "$OUT/tiny-llama.safetensors"
STEPS="$STEPS" OUT="$OUT" python3 - <<'PY'
import json, math, os
rows = [json.loads(l) for l in open(os.path.join(os.environ["OUT"], "train.jsonl")) if '"loss"' in l]
steps = int(os.environ["STEPS"])
if len(rows) != steps or not all(math.isfinite(r["loss"]) for r in rows):
    raise SystemExit(f"expected {steps} steps with finite losses, got {[r['loss'] for r in rows]}")
k = min(10, len(rows))
first = sum(r["loss"] for r in rows[:k]) / k
last = sum(r["loss"] for r in rows[-k:]) / k
print(f"mean loss of the first {k} steps {first:.3f}, of the last {k} steps {last:.3f}")
PY
