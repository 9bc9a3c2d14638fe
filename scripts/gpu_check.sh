#!/usr/bin/env bash
# Builds and runs the GPU probes (tests/gpu, docs/gpu.md) on a GPU machine,
# from the repository root, without the rest of hspmd (no CBC needed):
#   bash scripts/gpu_check.sh            # on the GPU machine
#   bash scripts/gpu_check.sh --local    # here, without a GPU: builds, every
#                                        # probe skips (77), and the binaries
#                                        # are kept in .gpu-deps/prebuilt
# Needs .gpu-deps (scripts/fetch_cudnn_frontend.sh) carried along: the
# cudnn_frontend headers, fallback cuDNN/NCCL headers, prebuilt probes; and
# for its last step (the whole project, one process training on CUDA
# against the CPU) .gpu-deps/cbc (scripts/bundle_cbc.sh).
#
# Writes under OUT (default out/gpu), at most 12 files: setup.log (machine,
# libraries, configure, build), one log per probe, peer_torch.log,
# conformance_memory.log, train_cuda.log, gpu_step.log, gpu_step.json,
# profile_cuda.log and summary.txt, which is printed last. No step stops the script: each step's
# status is collected (PASS, FAIL, SKIP, TIMEOUT, CRASH(rc), NOT_BUILT).
# Environment: OUT, BUILD_DIR (build-gpu), JOBS, PROBE_TIMEOUT (seconds per
# probe, 150), TORCH_TIMEOUT (240), BUDGET (540: the whole script; a probe
# gets at most what is left, and summary.txt is rewritten after every step,
# so a run cut short still leaves one).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$(pwd)

LOCAL=0
[[ "${1:-}" == "--local" ]] && LOCAL=1
# The standalone probes and peer_torch (already measured on the H200,
# docs/benchmarks.md) run only with RUN_PROBES=1 (and in --local, which keeps
# their binaries): a GPU window goes to hspmd's own checks first.
RUN_PROBES=${RUN_PROBES:-$LOCAL}
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
BUILD_DIR=${BUILD_DIR:-build-gpu}
if ((LOCAL)); then JOBS=${JOBS:-2}; else JOBS=${JOBS:-$(nproc)}; fi
PROBE_TIMEOUT=${PROBE_TIMEOUT:-150}
TORCH_TIMEOUT=${TORCH_TIMEOUT:-240}
BUDGET=${BUDGET:-540}  # seconds for the whole script: later probes get what is left
ORIG_LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}
PROBES=(probe_cublaslt probe_cudnn_sdpa probe_cuda_graph probe_streams)
SETUP="$OUT/setup.log"
SUMMARY="$OUT/summary.txt"
rm -f "$SETUP" "$SUMMARY" "$OUT"/peer_torch.log
for p in "${PROBES[@]}" conformance_memory kernel_perf train_cuda; do rm -f "$OUT/$p.log"; done

T_START=$(date +%s)
declare -a STEP_NAMES STEP_STATUS STEP_SECS
note() { echo "$*" | tee -a "$SETUP"; }
record() { STEP_NAMES+=("$1"); STEP_STATUS+=("$2"); STEP_SECS+=("$3"); write_summary; }
# STEPS (default: all): the steps to run, e.g. STEPS="conformance_memory
# train_cuda oracle_cuda gpu_step" for [2/5], STEPS="dist_cuda gpu_dist gpu_overlap
# mps_hetero" for [3/5]; the whole-project build runs whenever one needs it.
STEPS=${STEPS:-}
want() { [[ -z "$STEPS" || " $STEPS " == *" $1 "* ]]; }
worst_rc() {  # exit codes of one step's parts -> the step's: a failure first, 77 (skip) only if all skipped
  local r out=77
  for r in "$@"; do
    if ((r != 0 && r != 77)); then echo "$r"; return; fi
    ((r == 0)) && out=0
  done
  echo "$out"
}
status_of() {  # exit code -> status word
  case "$1" in
    0) echo PASS ;; 1) echo FAIL ;; 77) echo SKIP ;; 124 | 137) echo TIMEOUT ;;
    *) echo "CRASH($1)" ;;
  esac
}

# -------------------------------------------------------------- summary --
# Status first, then probe, case and shortened fields, 100 characters a line.
# Every RESULT line that measures something (ms, GB/s, us) or did not PASS
# is listed; the other PASS lines (correctness checks) are counted per probe.
write_summary() {
  {
  echo "gpu_check $(date -u +%FT%TZ) local=$LOCAL total=$(($(date +%s) - T_START))s"
  echo "gpu: $GPU_LINE"
  echo "nvcc: $([[ -n "$NVCC" ]] && "$NVCC" --version 2>/dev/null | grep -o 'release [0-9.]*' || echo none)"
  # Versions, and the device's properties once (every probe prints them).
  cat "$OUT"/*.log 2>/dev/null | grep -E "^INFO probe=(cublaslt|cudnn_sdpa|streams|peer_torch) " |
    awk '!/ cc=/ || /^INFO probe=cublaslt /' | sed -E 's/^INFO probe=//; s/ device="[^"]*"//' | cut -c1-100
  printf "%-18s %-16s %s\n" step status secs
  for i in "${!STEP_NAMES[@]}"; do
    printf "%-18s %-16s %s\n" "${STEP_NAMES[$i]}" "${STEP_STATUS[$i]}" "${STEP_SECS[$i]}"
  done
  MEASURED="median_ms=|fwd_ms=|gbps|tflops=|_us=|predicted_ms=|_on_ms="
  for f in "${PROBES[@]}" peer_torch conformance_memory kernel_perf train_cuda dist_cuda gpu_dist gpu_overlap oracle_cuda mps_hetero; do
    [[ -f "$OUT/$f.log" ]] || continue
    n=$(grep -E "^RESULT .*status=PASS$" "$OUT/$f.log" | grep -c -v -E "$MEASURED")
    [[ "$n" -gt 0 ]] && echo "PASS x$n  ${f#probe_}: correctness checks (lines in $f.log)"
  done
  cat "$OUT"/*.log 2>/dev/null | grep -E "^RESULT " | grep -v "case=cudnn_version " |
    awk -v m="$MEASURED" '!/status=PASS$/ || $0 ~ m' |
    sed -E 's/^RESULT probe=([^ ]+) case=([^ ]+) (.*) status=([^ ]+)$/\4 \1 \2 \3/;
            /^[^ ]+ peer_torch /s/ (dq|dk|dv)_err=[^ ]*//g;
            s/^([^ ]+) cublaslt /\1 lt /; s/^([^ ]+) cudnn_sdpa /\1 sdpa /; s/^([^ ]+) peer_torch /\1 torch /;
            s/^([^ ]+) cuda_graph /\1 graph /;
            s/ (M|N|K|B|Hq|Hkv|S|D)=[0-9]+//g;
            s/ (layout|bound|build_ms|epi|bytes|count|err_tanh|err_erf|gelu|aux_err|stats|stats_err|varlen)=[^ ]*//g;
            s/ (wall_eager_ms|wall_graph_ms|inst_ms)=[^ ]*//g; s/^UNSUPPORTED /UNSUPP /;
            s/ (window|match_w|param_for_w|distinct|err_wm1|err_w|err_wp1|baseline|full_fwd_ms|full_bwd_ms|api)=[^ ]*//g;
            s/median_ms=/ms=/g; s/rel_err=/err=/g; s/fwd_tflops=/fTF=/g; s/bwd_tflops=/bTF=/g; s/tflops=/TF=/g;
            s/fwd_ms=/fms=/g; s/bwd_ms=/bms=/g;
            s/_err=/=/g; s/gbps_rw=/GB\/s_rw=/g; s/gbps=/GB\/s=/g' |
    awk '{ printf "%-7s %-7s %-28s", $1, $2, $3; for (i = 4; i <= NF; ++i) printf " %s", $i; printf "\n" }' |
    cut -c1-100 | head -n 52
  } >"$SUMMARY"
}

# ------------------------------------------------------------ machine --
t0=$(date +%s)
note "== gpu_check $(date -u +%FT%TZ) local=$LOCAL root=$ROOT jobs=$JOBS"
note "git: $(git rev-parse --short HEAD 2>/dev/null || echo none) $(git status --porcelain 2>/dev/null | wc -l) changed paths"
GPU_LINE="none"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$SETUP"
  GPU_LINE=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n 1)
else
  note "nvidia-smi: not found"
fi

# Python site-packages (pip's nvidia-* wheels keep libraries in nvidia/*/lib).
SITES=()
for py in python3 /opt/torch/.venv/bin/python3; do
  command -v "$py" >/dev/null 2>&1 || continue
  while IFS= read -r d; do [[ -d "$d" ]] && SITES+=("$d"); done < <("$py" -c \
    'import site, sysconfig; print(sysconfig.get_paths()["purelib"]); [print(p) for p in site.getsitepackages()]' 2>/dev/null)
done
SITES+=(/opt/torch/.venv/lib/python3*/site-packages)
note "python3: $(command -v python3 || echo none); site-packages searched: ${SITES[*]}"

# nvcc: PATH, then the usual toolkit places, then pip's nvidia/cu13 or cuda_nvcc.
NVCC=$(command -v nvcc 2>/dev/null)
if [[ -z "$NVCC" ]]; then
  for c in /usr/local/cuda/bin/nvcc /usr/local/cuda-13*/bin/nvcc /usr/local/cuda-1*/bin/nvcc; do
    [[ -x "$c" ]] && NVCC=$c && break
  done
fi
if [[ -z "$NVCC" ]]; then
  for s in "${SITES[@]}"; do
    for c in "$s"/nvidia/cu13/bin/nvcc "$s"/nvidia/cuda_nvcc/bin/nvcc; do
      [[ -x "$c" ]] && NVCC=$c && break 2
    done
  done
fi
if [[ -n "$NVCC" ]]; then
  export CUDACXX=$NVCC
  PATH="$(dirname "$NVCC"):$PATH"
  export PATH
  note "nvcc: $NVCC"
  "$NVCC" --version 2>&1 | tail -n 2 | tee -a "$SETUP"
else
  note "nvcc: not found (the probes cannot be built here; prebuilt ones are used if carried)"
fi
note "cmake: $(command -v cmake || echo none) $(cmake --version 2>/dev/null | head -n 1)"
note "ninja: $(command -v ninja || echo none); g++: $(g++ --version 2>/dev/null | head -n 1)"

# Shared libraries: the toolkit and system first, then pip packages.
LIB_DIRS=(/usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib
          /usr/lib/x86_64-linux-gnu /usr/local/cuda-13*/lib64 /usr/local/cuda-13*/lib)
if [[ -n "$NVCC" ]]; then LIB_DIRS=("$(dirname "$(dirname "$NVCC")")/lib64" "${LIB_DIRS[@]}"); fi
find_lib() {  # find_lib NAME -> full path of the first match
  local d f
  for d in "${LIB_DIRS[@]}"; do
    [[ -e "$d/$1" ]] && { echo "$d/$1"; return; }
  done
  for d in "${SITES[@]}"; do
    [[ -d "$d/nvidia" ]] || continue
    f=$(find "$d/nvidia" -maxdepth 3 -name "$1" 2>/dev/null | sort | head -n 1)
    [[ -n "$f" ]] && { echo "$f"; return; }
  done
}
LDP=()
declare -A LIB
for name in libcudnn.so.9 libnccl.so.2 libcublasLt.so.13 libnvrtc.so.13 libcudart.so.13; do
  LIB[$name]=$(find_lib "$name")
  if [[ -n "${LIB[$name]}" ]]; then
    note "lib: $name -> ${LIB[$name]}"
    d=$(dirname "${LIB[$name]}")
    [[ " ${LDP[*]} " == *" $d "* ]] || LDP+=("$d")
  else
    note "lib: $name -> not found"
  fi
done
LD_NEW=$(IFS=:; echo "${LDP[*]}")
export LD_LIBRARY_PATH="${LD_NEW}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
note "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"

# Headers next to the library (same version) first; carried copies last.
find_header() {  # find_header FILE LIBPATH CARRIED_DIR
  local d
  local cands=()
  [[ -n "$2" ]] && cands+=("$(dirname "$(dirname "$2")")/include")
  cands+=(/usr/local/cuda/include /usr/include /usr/include/x86_64-linux-gnu "$3")
  for d in "${cands[@]}"; do [[ -f "$d/$1" ]] && { echo "$d"; return; }; done
}
CMAKE_HINTS=()
CUDNN_INC=$(find_header cudnn.h "${LIB[libcudnn.so.9]}" "$ROOT/.gpu-deps/cudnn-include")
if [[ -n "$CUDNN_INC" && -n "${LIB[libcudnn.so.9]}" ]]; then
  hv=$(awk '/#define CUDNN_(MAJOR|MINOR|PATCHLEVEL) /{printf "%s%s", s, $3; s="."}' "$CUDNN_INC/cudnn_version.h" 2>/dev/null)
  note "cudnn headers: $CUDNN_INC (version $hv; the runtime version is printed by probe_cudnn_sdpa)"
  CMAKE_HINTS+=("-DCUDNN_INCLUDE_DIR=$CUDNN_INC" "-DCUDNN_LIBRARY=${LIB[libcudnn.so.9]}")
fi
NCCL_INC=$(find_header nccl.h "${LIB[libnccl.so.2]}" "$ROOT/.gpu-deps/nccl-include")
if [[ -n "$NCCL_INC" && -n "${LIB[libnccl.so.2]}" ]]; then
  note "nccl headers: $NCCL_INC"
  CMAKE_HINTS+=("-DNCCL_INCLUDE_DIR=$NCCL_INC" "-DNCCL_LIBRARY=${LIB[libnccl.so.2]}")
fi
if [[ ! -f .gpu-deps/cudnn_frontend/include/cudnn_frontend.h ]]; then
  note "cudnn_frontend: .gpu-deps/cudnn_frontend/include missing; trying scripts/fetch_cudnn_frontend.sh"
  bash scripts/fetch_cudnn_frontend.sh >>"$SETUP" 2>&1 || note "cudnn_frontend: fetch failed (probe_cudnn_sdpa not built)"
fi
record environment INFO $(($(date +%s) - t0))

if ((RUN_PROBES)); then
# ------------------------------------------------- peer, during the build --
# peer_torch needs no build: run it now, on the otherwise idle GPU, and wait
# for it before the probes so that no two GPU jobs overlap.
# It keeps the caller's LD_LIBRARY_PATH: torch loads its own pip CUDA libraries.
T_TORCH=$(date +%s)
TORCH_RC=$(mktemp)
(
  export PEER_TORCH_COMPILE_TIMEOUT=${PEER_TORCH_COMPILE_TIMEOUT:-75}
  export LD_LIBRARY_PATH=$ORIG_LD_LIBRARY_PATH
  [[ -n "$LD_LIBRARY_PATH" ]] || unset LD_LIBRARY_PATH
  timeout -k 10 "$TORCH_TIMEOUT" python3 tests/gpu/peer_torch.py >"$OUT/peer_torch.log" 2>&1
  echo "$? $(($(date +%s) - T_TORCH))" >"$TORCH_RC"
) &
TORCH_PID=$!

# --------------------------------------------------- configure + build --
t0=$(date +%s)
GEN=()
command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)
if [[ -f "$BUILD_DIR/CMakeCache.txt" ]] &&
   ! grep -q "^CMAKE_HOME_DIRECTORY:INTERNAL=$ROOT/tests/gpu$" "$BUILD_DIR/CMakeCache.txt"; then
  note "$BUILD_DIR holds another configuration; using $BUILD_DIR-probes"
  BUILD_DIR=$BUILD_DIR-probes
fi
if [[ -f "$BUILD_DIR/CMakeCache.txt" ]]; then GEN=(); fi  # keep the existing generator
BUILD_STATUS=FAIL
if command -v cmake >/dev/null 2>&1 && [[ -n "$NVCC" ]]; then
  note "== configure: cmake -S tests/gpu -B $BUILD_DIR ${GEN[*]} -DHSPMD_CUDA=ON -DHSPMD_BUILD_BENCH=OFF ${CMAKE_HINTS[*]}"
  if timeout 180 cmake -S tests/gpu -B "$BUILD_DIR" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
       -DHSPMD_CUDA=ON -DHSPMD_BUILD_BENCH=OFF "${CMAKE_HINTS[@]}" >>"$SETUP" 2>&1; then
    grep -E "^-- GPU probes" "$SETUP" | tail -n 5
    note "== build: cmake --build $BUILD_DIR -j $JOBS (keep going)"
    KEEP=(-k)
    grep -q "^CMAKE_GENERATOR:INTERNAL=Ninja" "$BUILD_DIR/CMakeCache.txt" && KEEP=(-k 0)
    if timeout 300 cmake --build "$BUILD_DIR" -j "$JOBS" -- "${KEEP[@]}" >>"$SETUP" 2>&1; then
      BUILD_STATUS=PASS
    else
      note "build: failed or partial (see setup.log); missing probes fall back to .gpu-deps/prebuilt"
      grep -E "error|Error" "$SETUP" | head -n 20
    fi
  else
    note "configure: failed (see setup.log); falling back to .gpu-deps/prebuilt"
    tail -n 20 "$SETUP"
  fi
else
  note "configure: skipped (no cmake or no nvcc)"
fi
record build "$BUILD_STATUS" $(($(date +%s) - t0))

# Here (--local): keep the binaries for carrying (.gpu-deps/prebuilt), a
# fallback for a GPU machine where the build fails.
if ((LOCAL)) && [[ "$BUILD_STATUS" == PASS ]]; then
  mkdir -p .gpu-deps/prebuilt
  for p in "${PROBES[@]}"; do [[ -x "$BUILD_DIR/$p" ]] && cp -f "$BUILD_DIR/$p" .gpu-deps/prebuilt/; done
  note "prebuilt: $(cd .gpu-deps/prebuilt && ls | tr '\n' ' ')($(du -sh .gpu-deps/prebuilt | cut -f1))"
fi

# ------------------------------------------------------------ peer wait --
wait "$TORCH_PID" 2>/dev/null
read -r rc torch_secs <"$TORCH_RC" 2>/dev/null || { rc=127; torch_secs=0; }
rm -f "$TORCH_RC"
record peer_torch "$(status_of "$rc")" "$torch_secs"
echo "== peer_torch: $(status_of "$rc") (log: peer_torch.log)"
grep -E "^(RESULT|SKIP|INFO)" "$OUT/peer_torch.log" | tail -n 30

# --------------------------------------------------------------- probes --
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
for p in "${PROBES[@]}"; do
  t0=$(date +%s)
  bin="$BUILD_DIR/$p"
  origin=built
  if [[ ! -x "$bin" && -x ".gpu-deps/prebuilt/$p" ]]; then bin=".gpu-deps/prebuilt/$p"; origin=prebuilt; fi
  if [[ ! -x "$bin" ]]; then
    echo "== $p: not built" | tee "$OUT/$p.log"
    record "$p" NOT_BUILT 0
    continue
  fi
  left=$((T_START + BUDGET - $(date +%s) - 15))
  limit=$((left < PROBE_TIMEOUT ? left : PROBE_TIMEOUT))
  if ((limit < 20)); then
    echo "== $p: not run, the time budget (BUDGET=$BUDGET s) is spent" | tee "$OUT/$p.log"
    record "$p" NO_TIME 0
    continue
  fi
  echo "== $p ($origin: $bin, timeout ${limit}s)" | tee "$OUT/$p.log"
  timeout -k 10 "$limit" "$bin" 2>&1 | tee -a "$OUT/$p.log"
  rc=${PIPESTATUS[0]}
  st=$(status_of "$rc")
  [[ "$origin" == prebuilt ]] && st="$st(prebuilt)"
  echo "== $p: $st rc=$rc $(($(date +%s) - t0))s" | tee -a "$OUT/$p.log"
  record "$p" "$st" $(($(date +%s) - t0))
done

else
  note "probes and peer_torch: skipped (RUN_PROBES=0; measured before, docs/benchmarks.md)"
  record probes "SKIP(RUN_PROBES=0)" 0
  GEN=()
  command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)
fi

# ------------------------------------------ the whole project, once --
# With CBC carried (.gpu-deps/cbc: bash scripts/bundle_cbc.sh here), one
# build of the project gives every binary the steps below run: hspmd, the
# conformance programs and nccl_world1. Without it, conformance falls back
# to a kernels-only build and the training steps are not built.
t0=$(date +%s)
FBUILD=${FBUILD_DIR:-build-gpu-full}
CBC=$ROOT/.gpu-deps/cbc
FULL_TARGETS=(hspmd conformance_memory conformance_attention kernel_perf nccl_world1)
if [[ -n "$NVCC" && -d "$CBC" ]]; then
  left=$((T_START + BUDGET - $(date +%s) - 15))
  {
    echo "== configure + build: cmake -S . -B $FBUILD (CBC from $CBC); targets ${FULL_TARGETS[*]}"
    PKG_CONFIG_PATH=$CBC/pkgconfig:${PKG_CONFIG_PATH:-} LIBRARY_PATH=$CBC/lib:${LIBRARY_PATH:-} \
      CPLUS_INCLUDE_PATH=$CBC/include:${CPLUS_INCLUDE_PATH:-} \
      timeout $((left / 2)) cmake -S . -B "$FBUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DHSPMD_CUDA=ON \
        -DHSPMD_BUILD_BENCH=OFF -DHSPMD_PYTHON=OFF "${CMAKE_HINTS[@]}" &&
      LIBRARY_PATH=$CBC/lib:${LIBRARY_PATH:-} CPLUS_INCLUDE_PATH=$CBC/include:${CPLUS_INCLUDE_PATH:-} \
        timeout $((left / 2)) cmake --build "$FBUILD" -j "$JOBS" --target "${FULL_TARGETS[@]}"
  } >"$OUT/build_full.log" 2>&1
  rc=$?
  ((rc != 0)) && grep -E "error|Error" "$OUT/build_full.log" | head -n 10
  record build_full "$([[ $rc == 0 ]] && echo PASS || echo FAIL)" $(($(date +%s) - t0))
else
  record build_full NOT_BUILT 0
fi

# ------------------------------------------- CUDA backend conformance --
# hspmd's own CUDA backend (docs/cuda.md) against its CPU backend: core and
# kernels only (-DHSPMD_GPU_KERNELS_ONLY=ON: no CBC needed), one program.
t0=$(date +%s)
KBUILD=${KBUILD_DIR:-build-gpu-kernels}
left=$((T_START + BUDGET - $(date +%s) - 15))
if ! want conformance_memory; then
  record conformance_memory "SKIP(STEPS)" 0
elif ((left < 60)); then
  echo "== conformance_memory: not run, the time budget (BUDGET=$BUDGET s) is spent" | tee "$OUT/conformance_memory.log"
  record conformance_memory NO_TIME 0
elif [[ -z "$NVCC" ]]; then
  record conformance_memory NOT_BUILT 0
else
  if [[ -x "$FBUILD/tests/gpu/conformance_memory" ]]; then
    KBUILD=$FBUILD  # built above with the whole project
    echo "== conformance from $FBUILD" >"$OUT/conformance_memory.log"
  else
  {
    echo "== configure + build: cmake -S . -B $KBUILD -DHSPMD_GPU_KERNELS_ONLY=ON; targets conformance_memory" \
      "conformance_attention"
    timeout $((left / 2)) cmake -S . -B "$KBUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DHSPMD_CUDA=ON \
      -DHSPMD_GPU_KERNELS_ONLY=ON "${CMAKE_HINTS[@]}" &&
      timeout $((left / 2)) cmake --build "$KBUILD" -j "$JOBS" --target conformance_memory conformance_attention \
        kernel_perf
  } >"$OUT/conformance_memory.log" 2>&1
  fi
  if [[ -x "$KBUILD/tests/gpu/conformance_memory" ]]; then
    left=$((T_START + BUDGET - $(date +%s) - 10))
    timeout -k 10 $((left < PROBE_TIMEOUT ? left : PROBE_TIMEOUT)) "$KBUILD/tests/gpu/conformance_memory" 2>&1 |
      tee -a "$OUT/conformance_memory.log"
    rc=${PIPESTATUS[0]}
    # Attention on cuDNN (required: a fallback fails), same log and status.
    if [[ -x "$KBUILD/tests/gpu/conformance_attention" ]]; then
      left=$((T_START + BUDGET - $(date +%s) - 10))
      HSPMD_CUDNN_ATTENTION=1 timeout -k 10 $((left < PROBE_TIMEOUT ? left : PROBE_TIMEOUT)) \
        "$KBUILD/tests/gpu/conformance_attention" 2>&1 | tee -a "$OUT/conformance_memory.log"
      rc2=${PIPESTATUS[0]}
      if ((rc == 0 && rc2 != 77)); then rc=$rc2; fi
    fi
    # The performance mode: each kernel against the copy and GEMM ceilings
    # (kernel_perf.log; measurements, not checks).
    left=$((T_START + BUDGET - $(date +%s) - 10))
    if [[ -x "$KBUILD/tests/gpu/kernel_perf" ]] && ((left > 90)); then
      timeout -k 10 60 "$KBUILD/tests/gpu/kernel_perf" --device cuda:0 2>&1 | tee "$OUT/kernel_perf.log"
    fi
    record conformance_memory "$(status_of "$rc")" $(($(date +%s) - t0))
  else
    grep -E "error|Error" "$OUT/conformance_memory.log" | head -n 10
    record conformance_memory NOT_BUILT $(($(date +%s) - t0))
  fi
fi

# ------------------------------------------ one process trains on CUDA --
# The whole project (CBC carried in .gpu-deps/cbc: ../shared/tools/
# bundle_cbc.sh .gpu-deps/cbc here), target hspmd only, then
# tests/gpu/train_cuda_test.py: fp32 and bf16 runs against the CPU's, a GPU
# checkpoint resumed on the CPU (docs/cuda.md).
t0=$(date +%s)
left=$((T_START + BUDGET - $(date +%s) - 15))
rm -f "$OUT/train_cuda.log"
if ! want train_cuda; then
  record train_cuda "SKIP(STEPS)" 0
elif ((left < 90)); then
  echo "== train_cuda: not run, the time budget (BUDGET=$BUDGET s) is spent" | tee "$OUT/train_cuda.log"
  record train_cuda NO_TIME 0
elif [[ -z "$NVCC" || ! -d "$CBC" ]]; then
  echo "== train_cuda: not built (nvcc: ${NVCC:-none}; CBC bundle: $CBC $([[ -d $CBC ]] && echo present || echo absent))" |
    tee "$OUT/train_cuda.log"
  record train_cuda NOT_BUILT 0
else
  [[ -x "$FBUILD/src/cli/hspmd" ]] && echo "== hspmd from $FBUILD" >"$OUT/train_cuda.log" ||
  {
    echo "== configure + build: cmake -S . -B $FBUILD (CBC from $CBC); target hspmd"
    PKG_CONFIG_PATH=$CBC/pkgconfig:${PKG_CONFIG_PATH:-} LIBRARY_PATH=$CBC/lib:${LIBRARY_PATH:-} \
      CPLUS_INCLUDE_PATH=$CBC/include:${CPLUS_INCLUDE_PATH:-} \
      timeout $((left / 2)) cmake -S . -B "$FBUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DHSPMD_CUDA=ON \
        -DHSPMD_BUILD_BENCH=OFF -DHSPMD_PYTHON=OFF "${CMAKE_HINTS[@]}" &&
      LIBRARY_PATH=$CBC/lib:${LIBRARY_PATH:-} CPLUS_INCLUDE_PATH=$CBC/include:${CPLUS_INCLUDE_PATH:-} \
        timeout $((left / 2)) cmake --build "$FBUILD" -j "$JOBS" --target hspmd
  } >"$OUT/train_cuda.log" 2>&1
  if [[ -x "$FBUILD/src/cli/hspmd" ]]; then
    left=$((T_START + BUDGET - $(date +%s) - 10))
    LD_LIBRARY_PATH=$CBC/lib:${LD_LIBRARY_PATH:-} timeout -k 10 $((left < 240 ? left : 240)) \
      python3 tests/gpu/train_cuda_test.py --hspmd "$FBUILD/src/cli/hspmd" --repo "$ROOT" 2>&1 |
      tee -a "$OUT/train_cuda.log"
    rc=${PIPESTATUS[0]}
    record train_cuda "$(status_of "$rc")" $(($(date +%s) - t0))
  else
    grep -E "error|Error" "$OUT/train_cuda.log" | head -n 10
    record train_cuda NOT_BUILT $(($(date +%s) - t0))
  fi
fi

# ------------------------------------------- several ranks on the GPU --
# Issue [3/5] (docs/comm.md): the NCCL communicator at world 1
# (tests/comm/nccl_world1.cc), then plans of every kind with 2-7 ranks
# sharing the GPU (the staged MPI communicator) against one GPU process
# (tests/exec/equivalence_test.py --device cuda:0: losses, weights and
# bytes = predicted), plan switches, elastic failures and a join,
# token-budget steps, crash restarts.
t0=$(date +%s)
left=$((T_START + BUDGET - $(date +%s) - 15))
rm -f "$OUT/dist_cuda.log"
DIST_CASES=${DIST_CASES:-dp4_zero,pp4_1f1b,2pp2_gpipe,tp4,asym7_tp421_zero,hetero_pp_tp_recompute,cp2_tp2,packed_cp_hetero_zero,tied_tp1_to_cp2tp2,idle_rank,bf16_dp2_tp2_zero,qwen2_hetero_pp_tp,mistral_cp2}
if ! want dist_cuda; then
  record dist_cuda "SKIP(STEPS)" 0
elif ((left < 60)); then
  echo "== dist_cuda: not run, the time budget (BUDGET=$BUDGET s) is spent" | tee "$OUT/dist_cuda.log"
  record dist_cuda NO_TIME 0
elif [[ ! -x "${FBUILD:-build-gpu-full}/src/cli/hspmd" ]]; then
  echo "== dist_cuda: not built (no $FBUILD/src/cli/hspmd)" | tee "$OUT/dist_cuda.log"
  record dist_cuda NOT_BUILT 0
else
  {
    echo "== build: target nccl_world1"
    LIBRARY_PATH=$CBC/lib:${LIBRARY_PATH:-} CPLUS_INCLUDE_PATH=$CBC/include:${CPLUS_INCLUDE_PATH:-} \
      timeout $((left / 4)) cmake --build "$FBUILD" -j "$JOBS" --target nccl_world1
  } >"$OUT/dist_cuda.log" 2>&1
  rc=0
  if [[ -x "$FBUILD/tests/comm/nccl_world1" ]]; then
    timeout -k 5 60 "$FBUILD/tests/comm/nccl_world1" 2>&1 | tee -a "$OUT/dist_cuda.log"
    rc=${PIPESTATUS[0]}
  else
    echo "nccl_world1: not built" | tee -a "$OUT/dist_cuda.log"
    rc=1
  fi
  left=$((T_START + BUDGET - $(date +%s) - 10))
  LD_LIBRARY_PATH=$CBC/lib:${LD_LIBRARY_PATH:-} timeout -k 10 $((left < 300 ? left : 300)) \
    python3 tests/exec/equivalence_test.py --hspmd "$FBUILD/src/cli/hspmd" --device cuda:0 --random 0 \
      --cases "$DIST_CASES" 2>&1 | tee -a "$OUT/dist_cuda.log"
  rc2=${PIPESTATUS[0]}
  rc=$(worst_rc "$rc" "$rc2")
  # Plan switches between heterogeneous plans (all three algorithms on the
  # first case, bytes measured = predicted) and a resume under another plan.
  left=$((T_START + BUDGET - $(date +%s) - 10))
  if ((left > 45)); then
    LD_LIBRARY_PATH=$CBC/lib:${LD_LIBRARY_PATH:-} timeout -k 10 $((left < 200 ? left : 200)) \
      python3 tests/exec/switch_test.py --hspmd "$FBUILD/src/cli/hspmd" --device cuda:0 --only cases,resume \
        2>&1 | tee -a "$OUT/dist_cuda.log"
    rc3=${PIPESTATUS[0]}
    rc=$(worst_rc "$rc" "$rc3")
  fi
  # Elastic training on the GPU: two failures and a join on 8 ranks of a
  # heterogeneous pipeline pair, with and without ZeRO (re-plans,
  # checkpoint-served slices), against one GPU process.
  left=$((T_START + BUDGET - $(date +%s) - 10))
  if ((left > 60)); then
    LD_LIBRARY_PATH=$CBC/lib:${LD_LIBRARY_PATH:-} timeout -k 10 $((left < 150 ? left : 150)) \
      python3 tests/exec/elastic_test.py --hspmd "$FBUILD/src/cli/hspmd" --device cuda:0 --part gpu \
        2>&1 | tee -a "$OUT/dist_cuda.log"
    rc4=${PIPESTATUS[0]}
    rc=$(worst_rc "$rc" "$rc4")
  fi
  # Token-budget steps with dispatch (CP, ZeRO, a switch, strategies per
  # step, bucket switching), then ranks killed mid-run and the job restarted
  # from its checkpoint.
  left=$((T_START + BUDGET - $(date +%s) - 10))
  if ((left > 60)); then
    LD_LIBRARY_PATH=$CBC/lib:${LD_LIBRARY_PATH:-} timeout -k 10 $((left < 150 ? left : 150)) \
      python3 tests/exec/mixed_length_test.py --hspmd "$FBUILD/src/cli/hspmd" --device cuda:0 \
        2>&1 | tee -a "$OUT/dist_cuda.log"
    rc5=${PIPESTATUS[0]}
    rc=$(worst_rc "$rc" "$rc5")
  fi
  left=$((T_START + BUDGET - $(date +%s) - 10))
  if ((left > 60)); then
    LD_LIBRARY_PATH=$CBC/lib:${LD_LIBRARY_PATH:-} timeout -k 10 $((left < 120 ? left : 120)) \
      python3 tests/exec/restart_test.py --hspmd "$FBUILD/src/cli/hspmd" --repo "$ROOT" --part crash \
        --device cuda:0 2>&1 | tee -a "$OUT/dist_cuda.log"
    rc6=${PIPESTATUS[0]}
    rc=$(worst_rc "$rc" "$rc6")
  fi
  record dist_cuda "$(status_of "$rc")" $(($(date +%s) - t0))
fi

# ------------------------- the Hugging Face oracle with hspmd on the GPU --
# tests/oracle/hf_oracle_test.py: Llama, Qwen2 and Mistral configs, fp32 and
# bf16, hspmd on cuda:0 against transformers on the CPU (5 steps: losses,
# gradients, weights). Runs with the python3 on PATH (the GPU machine's
# PyTorch venv); skipped (77) when transformers is not importable there.
t0=$(date +%s)
left=$((T_START + BUDGET - $(date +%s) - 15))
rm -f "$OUT/oracle_cuda.log"
if ! want oracle_cuda; then
  record oracle_cuda "SKIP(STEPS)" 0
elif ((left < 120)); then
  echo "== oracle_cuda: not run, the time budget (BUDGET=$BUDGET s) is spent" | tee "$OUT/oracle_cuda.log"
  record oracle_cuda NO_TIME 0
elif [[ ! -x "${FBUILD:-build-gpu-full}/src/cli/hspmd" ]]; then
  record oracle_cuda NOT_BUILT 0
else
  rcs=()
  for fam in llama qwen2 mistral; do
    for variant in f32 bf16; do
      echo "== oracle $fam $variant" >>"$OUT/oracle_cuda.log"
      LD_LIBRARY_PATH=$CBC/lib:${LD_LIBRARY_PATH:-} timeout -k 5 60 python3 tests/oracle/hf_oracle_test.py \
        --hspmd "$FBUILD/src/cli/hspmd" --family "$fam" --variant "$variant" --device cuda:0 \
        >>"$OUT/oracle_cuda.log" 2>&1
      r=$?
      rcs+=("$r")
      echo "RESULT probe=oracle_cuda case=${fam}_$variant status=$(status_of "$r")" | tee -a "$OUT/oracle_cuda.log"
      ((r == 77)) && break 2  # no transformers here: the others would skip too
    done
  done
  # Qwen2 in bf16 with attention's output kept f32 (cuDNN asked for an fp32
  # O): whether that keeps the key bias's gradient within the oracle's
  # tolerance where the bf16 O does not (docs/cuda.md, "Attention on
  # cuDNN"). Information: not part of the step's status.
  if [[ "${rcs[-1]}" != 77 ]]; then
    echo "== oracle qwen2 bf16 HSPMD_ATTENTION_IO=f32" >>"$OUT/oracle_cuda.log"
    HSPMD_ATTENTION_IO=f32 LD_LIBRARY_PATH=$CBC/lib:${LD_LIBRARY_PATH:-} timeout -k 5 60 python3 \
      tests/oracle/hf_oracle_test.py --hspmd "$FBUILD/src/cli/hspmd" --family qwen2 --variant bf16 \
      --device cuda:0 >>"$OUT/oracle_cuda.log" 2>&1
    echo "RESULT probe=oracle_cuda case=qwen2_bf16_f32_o status=INFO($(status_of "$?"))" | tee -a "$OUT/oracle_cuda.log"
  fi
  record oracle_cuda "$(status_of "$(worst_rc "${rcs[@]}")")" $(($(date +%s) - t0))
fi

# ------------------------------- the distributed step on the GPU, timed --
# bench/gpu_dist.py: bench/dist_step.py's plans with every rank on the GPU
# (staged), the exposed gradient synchronization, bytes = predicted. Capped
# at 90 s: the TinyLlama step below gets the rest.
t0=$(date +%s)
left=$((T_START + BUDGET - $(date +%s) - 15))
if ! want gpu_dist; then
  record gpu_dist "SKIP(STEPS)" 0
elif ((left < 150)); then
  echo "== gpu_dist: not run, the time budget (BUDGET=$BUDGET s) is spent" | tee "$OUT/gpu_dist.log"
  record gpu_dist NO_TIME 0
elif [[ ! -x "${FBUILD:-build-gpu-full}/src/cli/hspmd" ]]; then
  record gpu_dist NOT_BUILT 0
else
  LD_LIBRARY_PATH=$CBC/lib:${LD_LIBRARY_PATH:-} timeout -k 10 90 \
    python3 bench/gpu_dist.py --hspmd "$FBUILD/src/cli/hspmd" --device cuda:0 --steps 4 --json "$OUT/gpu_dist.json" \
    2>&1 | tee "$OUT/gpu_dist.log"
  rc=${PIPESTATUS[0]}
  record gpu_dist "$(status_of "$rc")" $(($(date +%s) - t0))
fi

# ------------------------------ the overlapped gradient synchronization --
# bench/gpu_overlap.py: DP 2 of the TinyLlama-1.1B shape in bf16, both ranks
# on the GPU (staged), --overlap against --no-overlap: the exposed
# synchronization of each, losses bit-identical ([3/5]'s overlap acceptance);
# then the PyTorch peer (DDP over gloo, two ranks on the GPU) in the same call.
t0=$(date +%s)
left=$((T_START + BUDGET - $(date +%s) - 15))
if ! want gpu_overlap; then
  record gpu_overlap "SKIP(STEPS)" 0
elif ((left < 150)); then
  echo "== gpu_overlap: not run, the time budget (BUDGET=$BUDGET s) is spent" | tee "$OUT/gpu_overlap.log"
  record gpu_overlap NO_TIME 0
elif [[ ! -x "${FBUILD:-build-gpu-full}/src/cli/hspmd" ]]; then
  record gpu_overlap NOT_BUILT 0
else
  GPU_STEP_TORCH_LD_LIBRARY_PATH=$ORIG_LD_LIBRARY_PATH LD_LIBRARY_PATH=$CBC/lib:${LD_LIBRARY_PATH:-} \
    timeout -k 10 $((left < 240 ? left : 240)) python3 bench/gpu_overlap.py --hspmd "$FBUILD/src/cli/hspmd" --device cuda:0 --timeout 90 \
      --json "$OUT/gpu_overlap.json" 2>&1 | tee "$OUT/gpu_overlap.log"
  rc=${PIPESTATUS[0]}
  record gpu_overlap "$(status_of "$rc")" $(($(date +%s) - t0))
fi

# ------------------------- heterogeneous partitions of the GPU (MPS) --
# bench/mps_hetero.py: profiles of 50/25/25 % MPS partitions, the planner's
# strategy for them against the symmetric ones trained on the partitions,
# the prediction's error, no MPS daemon left (docs/cuda.md).
t0=$(date +%s)
left=$((T_START + BUDGET - $(date +%s) - 15))
if ! want mps_hetero; then
  record mps_hetero "SKIP(STEPS)" 0
elif ((left < 150)); then
  echo "== mps_hetero: not run, the time budget (BUDGET=$BUDGET s) is spent" | tee "$OUT/mps_hetero.log"
  record mps_hetero NO_TIME 0
elif [[ ! -x "${FBUILD:-build-gpu-full}/src/cli/hspmd" ]]; then
  record mps_hetero NOT_BUILT 0
else
  LD_LIBRARY_PATH=$CBC/lib:${LD_LIBRARY_PATH:-} timeout -k 10 $((left < 240 ? left : 240)) \
    python3 bench/mps_hetero.py --hspmd "$FBUILD/src/cli/hspmd" --device cuda:0 --global-batch 12 --steps 4 --json "$OUT/mps_hetero.json" \
    2>&1 | tee "$OUT/mps_hetero.log"
  rc=${PIPESTATUS[0]}
  record mps_hetero "$(status_of "$rc")" $(($(date +%s) - t0))
  echo "MPS processes after the step: $(pgrep -f nvidia-cuda-mps | wc -l)" | tee -a "$OUT/mps_hetero.log"
fi

# ----------------------------------------- hspmd profile on the GPU --
# tests/gpu/profile_cuda_test.py: the tiny model's parts timed with CUDA
# events (fp32, bf16; tp 1, 2), the profile's sanity (docs/cuda.md).
t0=$(date +%s)
rm -f "$OUT/profile_cuda.log"
left=$((T_START + BUDGET - $(date +%s) - 10))
if ! want profile_cuda; then
  record profile_cuda "SKIP(STEPS)" 0
elif ((left < 30)); then
  echo "== profile_cuda: not run, the time budget (BUDGET=$BUDGET s) is spent" | tee "$OUT/profile_cuda.log"
  record profile_cuda NO_TIME 0
elif [[ ! -x "${FBUILD:-build-gpu-full}/src/cli/hspmd" ]]; then
  echo "== profile_cuda: no hspmd built (see train_cuda.log)" | tee "$OUT/profile_cuda.log"
  record profile_cuda NOT_BUILT 0
else
  LD_LIBRARY_PATH=$CBC/lib:${LD_LIBRARY_PATH:-} timeout -k 10 $((left < 300 ? left : 300)) \
    python3 tests/gpu/profile_cuda_test.py --hspmd "$FBUILD/src/cli/hspmd" --repo "$ROOT" 2>&1 |
    tee "$OUT/profile_cuda.log"
  rc=${PIPESTATUS[0]}
  record profile_cuda "$(status_of "$rc")" $(($(date +%s) - t0))
fi

# ------------------------------------ the training step against PyTorch --
# bench/gpu_step.py at the full TinyLlama-1.1B shape (S 4096, B 4, bf16),
# 3 warm-up + 5 timed steps: hspmd train --device cuda, PyTorch eager and
# torch.compile, one after the other; table, RESULT lines and gpu_step.json
# (docs/benchmarks.md "GPU step"). Needs the hspmd of the step above.
t0=$(date +%s)
rm -f "$OUT/gpu_step.log" "$OUT/gpu_step.json"
left=$((T_START + BUDGET - $(date +%s) - 15))
if ! want gpu_step; then
  record gpu_step "SKIP(STEPS)" 0
elif ((left < 120)); then
  echo "== gpu_step: not run, the time budget (BUDGET=$BUDGET s) is spent" | tee "$OUT/gpu_step.log"
  record gpu_step NO_TIME 0
elif [[ ! -x "${FBUILD:-build-gpu-full}/src/cli/hspmd" ]]; then
  echo "== gpu_step: no hspmd built (see train_cuda.log)" | tee "$OUT/gpu_step.log"
  record gpu_step NOT_BUILT 0
else
  echo "== gpu_step (timeout ${left}s, each system at most $(((left - 20) / 3))s)" | tee "$OUT/gpu_step.log"
  # hspmd gets the toolkit's and CBC's libraries, PyTorch the caller's path.
  GPU_STEP_TORCH_LD_LIBRARY_PATH=$ORIG_LD_LIBRARY_PATH LD_LIBRARY_PATH=$CBC/lib:${LD_LIBRARY_PATH:-} \
    timeout -k 10 "$left" python3 bench/gpu_step.py --hspmd "$FBUILD/src/cli/hspmd" --warmup 3 --steps 5 \
      --timeout $(((left - 20) / 3)) --json "$OUT/gpu_step.json" 2>&1 | tee -a "$OUT/gpu_step.log"
  rc=${PIPESTATUS[0]}
  record gpu_step "$(status_of "$rc")" $(($(date +%s) - t0))
fi

write_summary
echo
echo "==================== summary ($SUMMARY) ===================="
cat "$SUMMARY"
