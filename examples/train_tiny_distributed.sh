#!/usr/bin/env bash
# The tiny Llama of examples/train_tiny.sh, trained on 5 local MPI ranks under
# an asymmetric strategy (docs/execution.md); run examples/train_tiny.sh first
# (it tokenizes the corpus). Writes out/train_distributed.jsonl.
# STRATEGY / NPROC pick another strategy; PACK=1 trains on packed documents,
# e.g. STRATEGY=examples/strategies/tiny_cp_packed_6.json NPROC=6 PACK=1
# (context parallelism with ring attention, recomputation).
# Also: STEPS (default 50), OUT (the folder of corpus.bin and the log, default
# out), HSPMD (default ./build/src/cli/hspmd); SMOKE=1 is the smoke mode (2
# steps; the CTest example_smoke_train_tiny_distributed gives it a temporary
# OUT): the same commands, and the script fails unless every step logged a
# finite loss.
set -euo pipefail
cd "$(dirname "$0")/.."
SMOKE=${SMOKE:-0}
if [ "$SMOKE" = 1 ]; then STEPS=${STEPS:-2}; else STEPS=${STEPS:-50}; fi
STRATEGY=${STRATEGY:-examples/strategies/tiny_example_hetero_5.json}
NPROC=${NPROC:-5}
OUT=${OUT:-out}
HSPMD=${HSPMD:-./build/src/cli/hspmd}
PACK_FLAG=()
[ "${PACK:-0}" = 1 ] && PACK_FLAG=(--pack-documents)
mkdir -p "$OUT"
[ -f "$OUT/corpus.bin" ] || "$HSPMD" tokenize --model examples/tiny-llama/config.json \
  --output "$OUT/corpus.bin" data/corpus/*.txt
"$HSPMD" train --model examples/tiny-llama/config.json --data "$OUT/corpus.bin" \
  --strategy "$STRATEGY" --nproc "$NPROC" "${PACK_FLAG[@]}" \
  --seq-len 128 --steps "$STEPS" --lr 3e-3 --lr-schedule cosine --warmup-steps 20 \
  --weight-decay 0.1 --clip-grad 1.0 --seed 0 --threads 1 \
  --log "$OUT/train_distributed.jsonl"
if [ "$SMOKE" = 1 ]; then
  STEPS="$STEPS" OUT="$OUT" python3 - <<'PY'
import json, math, os
rows = [json.loads(l) for l in open(os.path.join(os.environ["OUT"], "train_distributed.jsonl")) if '"loss"' in l]
steps = int(os.environ["STEPS"])
if len(rows) != steps or not all(math.isfinite(r["loss"]) for r in rows):
    raise SystemExit(f"expected {steps} steps with finite losses, got {[r['loss'] for r in rows]}")
print(f"{steps} steps, losses {[round(r['loss'], 4) for r in rows]}")
PY
fi
