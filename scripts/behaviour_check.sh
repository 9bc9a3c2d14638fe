#!/usr/bin/env bash
# Behaviour unchanged (docs/refactoring.md, "Behaviour-unchanged check"): the
# same fixed set of CPU training runs made by hspmd built from BASE_REV (the
# commit before a refactor) and by the current tree's build, on this machine,
# compared bit for bit; then the CPU step time of both.
#   bash scripts/behaviour_check.sh [BASE_REV]     BASE_REV defaults to 2be6c64
# It
#   1. checks BASE_REV out in a git worktree at BASE_DIR (outside the repo) and
#      builds its `hspmd` CLI there, CPU only (-DHSPMD_CUDA=OFF
#      -DHSPMD_PYTHON=OFF), Release, under nice; a build already there at that
#      revision is reused (make rebuilds nothing);
#   2. builds the current tree's `hspmd` in BUILD (skip: NO_BUILD=1), holding
#      BUILD_LOCK so that it does not race another build of that folder;
#   3. runs scripts/behaviour_check_runs.py: every run with both binaries, each
#      into its own folder under OUT (OUT/base/NAME, OUT/new/NAME), comparing
#      each step's loss as logged (string-equal), the switch/reconfigure/
#      slowdown events' steps, and the saved weights (cmp); one line per run
#      and a summary; then REPEATS alternating timing runs of each binary and
#      the ratio of their median step times.
# Exit 0 when every run is identical, non-zero on any difference or failure.
# Environment: BASE_DIR (default /work/behaviour-base), BUILD (default build),
# OUT (default /tmp/behaviour-check), RUNS (comma-separated names, default
# all; `python3 scripts/behaviour_check_runs.py --list` shows them), REPEATS
# (timing runs per binary, default 5; 0 = no timing), JOBS (build jobs,
# default 2), NO_BUILD (1: use the binaries as they are), BUILD_LOCK (default
# /tmp/hspmd-build.lock).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
BASE_REV=${1:-2be6c64}
BASE_DIR=${BASE_DIR:-/work/behaviour-base}
BUILD=${BUILD:-build}
OUT=${OUT:-/tmp/behaviour-check}
RUNS=${RUNS:-}
REPEATS=${REPEATS:-5}
JOBS=${JOBS:-2}
NO_BUILD=${NO_BUILD:-0}
BUILD_LOCK=${BUILD_LOCK:-/tmp/hspmd-build.lock}

rev=$(git rev-parse --verify "$BASE_REV^{commit}")
case "$(realpath -m "$BASE_DIR")/" in
  "$REPO"/*) echo "behaviour_check: BASE_DIR $BASE_DIR is inside the repository; give a folder outside it" >&2; exit 2 ;;
esac

# 1. The base: a worktree of its own, so the working tree is never touched.
if [ -e "$BASE_DIR/.git" ]; then
  if [ "$(git -C "$BASE_DIR" rev-parse HEAD)" != "$rev" ]; then
    if [ -n "$(git -C "$BASE_DIR" status --porcelain --untracked-files=no)" ]; then
      echo "behaviour_check: $BASE_DIR has local changes; it must hold $BASE_REV as committed" >&2
      exit 2
    fi
    git -C "$BASE_DIR" checkout --quiet --detach "$rev"
  fi
elif [ -e "$BASE_DIR" ]; then
  echo "behaviour_check: $BASE_DIR exists and is not a git worktree" >&2
  exit 2
else
  git worktree prune  # a worktree folder deleted by hand stays registered until pruned
  git worktree add --detach "$BASE_DIR" "$rev" >/dev/null
fi
if [ -n "$(git -C "$BASE_DIR" status --porcelain --untracked-files=no)" ]; then
  echo "behaviour_check: $BASE_DIR has local changes; it must hold $BASE_REV as committed" >&2
  exit 2
fi
BASE_BIN=$BASE_DIR/build/src/cli/hspmd
NEW_BIN=$REPO/$BUILD/src/cli/hspmd
[ "${BUILD#/}" != "$BUILD" ] && NEW_BIN=$BUILD/src/cli/hspmd
if [ "$NO_BUILD" != 1 ]; then
  echo "building the base ($BASE_REV = ${rev:0:12}) in $BASE_DIR/build (CPU only)"
  if [ ! -f "$BASE_DIR/build/CMakeCache.txt" ]; then
    nice -n 10 cmake -S "$BASE_DIR" -B "$BASE_DIR/build" -DCMAKE_BUILD_TYPE=Release \
      -DHSPMD_CUDA=OFF -DHSPMD_PYTHON=OFF -DHSPMD_BUILD_TESTS=OFF -DHSPMD_BUILD_BENCH=OFF >/dev/null
  fi
  nice -n 10 cmake --build "$BASE_DIR/build" -j "$JOBS" --target hspmd >"$BASE_DIR/build/behaviour_build.log" 2>&1 ||
    { tail -20 "$BASE_DIR/build/behaviour_build.log" >&2; echo "behaviour_check: the base build failed" >&2; exit 1; }
  echo "$rev" >"$BASE_DIR/build/behaviour_rev"  # what NO_BUILD=1 checks the binary against
  echo "building the current tree in $BUILD"
  build_new=(cmake --build "$BUILD" -j "$JOBS" --target hspmd)
  command -v flock >/dev/null && build_new=(flock "$BUILD_LOCK" "${build_new[@]}")
  mkdir -p "$OUT"
  nice -n 10 "${build_new[@]}" >"$OUT/new_build.log" 2>&1 ||
    { tail -20 "$OUT/new_build.log" >&2; echo "behaviour_check: the current tree's build failed" >&2; exit 1; }
fi
for b in "$BASE_BIN" "$NEW_BIN"; do
  [ -x "$b" ] || { echo "behaviour_check: no hspmd binary at $b" >&2; exit 1; }
done
# With NO_BUILD=1 the base binary must be the base revision's: moving
# BASE_DIR to another revision does not rebuild it.
built=$(cat "$BASE_DIR/build/behaviour_rev" 2>/dev/null || echo unknown)
if [ "$built" != "$rev" ]; then
  echo "behaviour_check: $BASE_BIN was built at ${built:0:12}, not $BASE_REV (${rev:0:12}); run once without NO_BUILD=1" >&2
  exit 1
fi
dirty=$(git status --porcelain --untracked-files=no -- src include CMakeLists.txt | wc -l)
echo "base: $BASE_BIN ($BASE_REV = ${rev:0:12})"
echo "new:  $NEW_BIN (HEAD $(git rev-parse --short=12 HEAD), $dirty changed tracked files under src/ include/ CMakeLists.txt)"

# 3. The runs and the timing.
args=(--base "$BASE_BIN" --new "$NEW_BIN" --out "$OUT" --repeats "$REPEATS")
[ -n "$RUNS" ] && args+=(--runs "$RUNS")
python3 "$REPO/scripts/behaviour_check_runs.py" "${args[@]}"
