#!/usr/bin/env bash
# The Hugging Face oracle with hspmd on a GPU (scripts/gpu_check.sh, step
# oracle_cuda): Llama, Qwen2 and Mistral, fp32 then bf16, the three families
# (and the mixture-of-experts families' fp32 cases, hf_moe_oracle_test.py)
# side by side (each runs HF on the CPU with THREADS threads and hspmd on the
# GPU; one after the other they took about 105 s on the H200, which is most
# of a window's step). Prints each run's log in a fixed order with one
# RESULT line per run; exits 0 when all pass, 77 when all skip (no
# transformers), else 1.
#   bash tests/oracle/cuda_oracles.sh HSPMD [DEVICE]
set -uo pipefail
HSPMD=$1
DEVICE=${2:-cuda:0}
HERE=$(cd "$(dirname "$0")" && pwd)
THREADS=${THREADS:-$(( $(nproc) / 3 > 0 ? $(nproc) / 3 : 1 ))}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
FAMILIES=(llama qwen2 mistral)
for fam in "${FAMILIES[@]}"; do
  (
    for variant in f32 bf16; do
      log=$tmp/${fam}_$variant.log
      OMP_NUM_THREADS=$THREADS python3 "$HERE/hf_oracle_test.py" --hspmd "$HSPMD" --family "$fam" \
        --variant "$variant" --device "$DEVICE" >"$log" 2>&1
      echo $? >"$tmp/${fam}_$variant.rc"
    done
  ) &
done
(
  OMP_NUM_THREADS=$THREADS python3 "$HERE/hf_moe_oracle_test.py" --hspmd "$HSPMD" --device "$DEVICE" \
    >"$tmp/moe_f32.log" 2>&1
  echo $? >"$tmp/moe_f32.rc"
) &
wait
pass=0 skip=0 fail=0
for fam in "${FAMILIES[@]}"; do
  for variant in f32 bf16; do
    echo "== oracle $fam $variant"
    cat "$tmp/${fam}_$variant.log"
    rc=$(cat "$tmp/${fam}_$variant.rc" 2>/dev/null || echo 1)
    case "$rc" in
      0) st=PASS; pass=$((pass + 1)) ;; 77) st=SKIP; skip=$((skip + 1)) ;; *) st=FAIL; fail=$((fail + 1)) ;;
    esac
    echo "RESULT probe=oracle_cuda case=${fam}_$variant status=$st"
  done
done
echo "== oracle moe f32"
cat "$tmp/moe_f32.log"
rc=$(cat "$tmp/moe_f32.rc" 2>/dev/null || echo 1)
case "$rc" in
  0) st=PASS; pass=$((pass + 1)) ;; 77) st=SKIP; skip=$((skip + 1)) ;; *) st=FAIL; fail=$((fail + 1)) ;;
esac
echo "RESULT probe=oracle_cuda case=moe_f32 status=$st"
((fail > 0)) && exit 1
((pass == 0 && skip > 0)) && exit 77
exit 0
