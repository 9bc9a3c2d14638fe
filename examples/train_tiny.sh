#!/usr/bin/env bash
# The README's main job: tokenize the bundled corpus and train the tiny Llama
# on it. Writes to out/: corpus.bin, train.jsonl, tiny-llama.safetensors.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-300}
mkdir -p out
./build/src/cli/hspmd tokenize --model examples/tiny-llama/config.json \
  --output out/corpus.bin data/corpus/*.txt
./build/src/cli/hspmd train --model examples/tiny-llama/config.json --data out/corpus.bin \
  --seq-len 128 --global-batch 16 --steps "$STEPS" --lr 3e-3 --lr-schedule cosine \
  --warmup-steps 20 --weight-decay 0.1 --clip-grad 1.0 --seed 0 --precision auto \
  --log out/train.jsonl --save out/tiny-llama.safetensors
python3 - <<'PY'
import json
rows = [json.loads(l) for l in open("out/train.jsonl")]
first = sum(r["loss"] for r in rows[:10]) / 10
last = sum(r["loss"] for r in rows[-10:]) / 10
print(f"mean loss of the first 10 steps {first:.3f}, of the last 10 steps {last:.3f}")
PY
