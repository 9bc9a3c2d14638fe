#!/usr/bin/env bash
# The tiny Llama of examples/train_tiny.sh, trained on 5 local MPI ranks under
# an asymmetric strategy (docs/execution.md); run examples/train_tiny.sh first
# (it tokenizes the corpus). Writes out/train_distributed.jsonl.
# STRATEGY / NPROC pick another strategy; PACK=1 trains on packed documents,
# e.g. STRATEGY=examples/strategies/tiny_cp_packed_6.json NPROC=6 PACK=1
# (context parallelism with ring attention, recomputation).
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-50}
STRATEGY=${STRATEGY:-examples/strategies/tiny_example_hetero_5.json}
NPROC=${NPROC:-5}
PACK_FLAG=()
[ "${PACK:-0}" = 1 ] && PACK_FLAG=(--pack-documents)
[ -f out/corpus.bin ] || ./build/src/cli/hspmd tokenize --model examples/tiny-llama/config.json \
  --output out/corpus.bin data/corpus/*.txt
./build/src/cli/hspmd train --model examples/tiny-llama/config.json --data out/corpus.bin \
  --strategy "$STRATEGY" --nproc "$NPROC" "${PACK_FLAG[@]}" \
  --seq-len 128 --steps "$STEPS" --lr 3e-3 --lr-schedule cosine --warmup-steps 20 \
  --weight-decay 0.1 --clip-grad 1.0 --seed 0 --threads 1 \
  --log out/train_distributed.jsonl
