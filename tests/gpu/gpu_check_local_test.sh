#!/usr/bin/env bash
# scripts/gpu_check.sh without a GPU (--local), the build left out: each set
# lists every one of its steps as skipped with its cap, writes summary.txt
# and gpu_check.tgz into OUT and nothing else, and refuses an unknown set.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
check() {  # check SET STEP...
  local set=$1 step line
  shift
  OUT=$tmp/$set LOGS=$tmp/logs-$set RUN_PROBES=0 STEPS="$*" bash "$ROOT/scripts/gpu_check.sh" --local "$set" \
    >"$tmp/$set.console" 2>&1 || { echo "FAIL $set: exit $?"; fail=1; }
  for step in "$@"; do
    line=$(grep -E "^$step +SKIP\(no GPU\) +0 +[0-9]+$" "$tmp/$set/summary.txt")
    if [[ -z "$line" ]]; then echo "FAIL $set: no 'SKIP(no GPU)' line with a cap for $step"; fail=1; fi
  done
  if [[ "$(cd "$tmp/$set" && ls | tr '\n' ' ')" != "gpu_check.tgz summary.txt " ]]; then
    echo "FAIL $set: OUT holds $(ls "$tmp/$set" | tr '\n' ' ')"; fail=1
  fi
  tar tzf "$tmp/$set/gpu_check.tgz" | grep -q setup.log || { echo "FAIL $set: no setup.log in gpu_check.tgz"; fail=1; }
}
check core conformance train_cuda oracle_cuda dist_core gpu_step profile_step gpu_shapes
check extended nccl_world1 kernel_perf dist_ext gpu_dist gpu_overlap mps_hetero profile_cuda gpu_shapes
OUT=$tmp/bad bash "$ROOT/scripts/gpu_check.sh" --local fast >"$tmp/bad.console" 2>&1
rc=$?
if ((rc != 2)) || ! grep -q "unknown argument 'fast'" "$tmp/bad.console"; then
  echo "FAIL unknown set: exit $rc: $(head -c 300 "$tmp/bad.console")"; fail=1
fi
((fail == 0)) && echo "gpu_check --local: every step of both sets reported skipped with its cap"
exit $fail
