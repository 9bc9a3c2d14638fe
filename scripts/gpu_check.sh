#!/usr/bin/env bash
# The GPU window's checks (docs/cuda.md, "What a GPU window runs"), from the
# repository root, in two sets sized for one window (a fresh machine, 15
# minutes in all, released 30 s after a call, 8 files back):
#   bash scripts/gpu_check.sh core       # one call, at most 480 s with the build
#   bash scripts/gpu_check.sh extended   # the next call, at once: at most 300 s,
#                                        # reusing core's build (build-gpu-full)
#   bash scripts/gpu_check.sh all        # both in one call (780 s)
#   bash scripts/gpu_check.sh --local [SET]  # here, without a GPU: builds
#                                        # everything, reports each step skipped
#                                        # with its cap
# core: build, conformance (every kernel, then attention on cuDNN in the
# arrays training uses), train_cuda, oracle_cuda (Hugging Face, pinned
# transformers from .gpu-deps/wheels), dist_core (one plan of every kind
# against one GPU process), gpu_step (the TinyLlama step against PyTorch
# eager and compiled, and the loss check with its broken-attention
# self-check). extended: nccl_world1, kernel_perf, dist_ext (the other plans,
# switches, elastic, token-budget steps, crash restarts), gpu_dist,
# gpu_overlap, mps_hetero, profile_cuda. After gpu_step in core, profile_step
# (the GPU profile's prediction of gpu_step's hspmd step). Last in each call, gpu_shapes: one
# more public 1-2B config against torch.compile (core Llama-3.2-1B's shape,
# extended Qwen2-1.5B's), in what the call has left.
#
# Needs .gpu-deps carried along: scripts/fetch_cudnn_frontend.sh (cuDNN
# frontend headers, fallback cuDNN/NCCL headers), scripts/bundle_cbc.sh
# (.gpu-deps/cbc: the planner's ILP solver) and scripts/fetch_gpu_wheels.sh
# (.gpu-deps/wheels: the oracle's transformers).
#
# Writes two files into OUT (default out/gpu): summary.txt (each step's
# status, seconds and cap, then every measurement and every line that did not
# pass) and gpu_check.tgz (every log: setup.log, one per step, the JSON
# files). Both are rewritten after every step, so a call cut short still
# leaves them. No step stops the script: each step's status is collected
# (PASS, FAIL, SKIP, TIMEOUT, CRASH(rc), NOT_BUILT, NO_TIME). Each step runs
# under its own cap (CAP_<step>=S overrides it) and never past BUDGET.
# Environment: OUT, LOGS (the logs' folder, out/gpu_check/SET), JOBS,
# BUDGET (480 core, 300 extended, 780 all), STEPS (a subset of the set's
# steps), CORE_CASES / EXT_CASES (equivalence cases), RUN_PROBES=1 (the
# standalone probes and peer_torch, measured before: docs/benchmarks.md).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$(pwd)

LOCAL=0
SET=core
for a in "$@"; do
  case "$a" in
    --local) LOCAL=1 ;;
    core | extended | all) SET=$a ;;
    *) echo "gpu_check: unknown argument '$a' (expected --local and one of core, extended, all)" >&2; exit 2 ;;
  esac
done
CORE_STEPS="build conformance train_cuda oracle_cuda dist_core gpu_step profile_step gpu_shapes"
EXT_STEPS="build nccl_world1 kernel_perf dist_ext gpu_dist gpu_overlap mps_hetero profile_cuda cuda_graphs gpu_shapes"
# gpu_shapes (below): one shape at the end of each call, both with all.
case "$SET" in
  core) SET_STEPS=$CORE_STEPS; DEFAULT_BUDGET=480; SET_SHAPES="llama32_1b:llama-3.2-1b" ;;
  extended) SET_STEPS=$EXT_STEPS; DEFAULT_BUDGET=300; SET_SHAPES="qwen2_1p5b:qwen2-1.5b" ;;
  all) SET_STEPS="$CORE_STEPS ${EXT_STEPS#build }"; DEFAULT_BUDGET=780
       SET_SHAPES="llama32_1b:llama-3.2-1b qwen2_1p5b:qwen2-1.5b" ;;
esac
# The standalone probes and peer_torch (already measured on the H200,
# docs/benchmarks.md) run only with RUN_PROBES=1 (and in --local, which keeps
# their binaries): a GPU window goes to hspmd's own checks first.
RUN_PROBES=${RUN_PROBES:-$LOCAL}
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOGS=${LOGS:-out/gpu_check/$SET}
rm -rf "$LOGS"
mkdir -p "$LOGS"
LOGS=$(cd "$LOGS" && pwd)
BUILD_DIR=${BUILD_DIR:-build-gpu}
if ((LOCAL)); then JOBS=${JOBS:-2}; else JOBS=${JOBS:-$(nproc)}; fi
PROBE_TIMEOUT=${PROBE_TIMEOUT:-150}
TORCH_TIMEOUT=${TORCH_TIMEOUT:-240}
BUDGET=${BUDGET:-$DEFAULT_BUDGET}  # seconds for the whole call: no step runs past it
ORIG_LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}
export GPU_STEP_TORCH_LD_LIBRARY_PATH=$ORIG_LD_LIBRARY_PATH  # PyTorch loads its own CUDA libraries
export PYTHONUNBUFFERED=1  # a step cut at its cap still shows how far it got
PROBES=(probe_cublaslt probe_cudnn_sdpa probe_cuda_graph probe_streams)
SETUP="$LOGS/setup.log"
SUMMARY="$OUT/summary.txt"
rm -f "$SUMMARY" "$OUT/gpu_check.tgz"

T_START=$(date +%s)
declare -a STEP_NAMES STEP_STATUS STEP_SECS STEP_CAPS
note() { echo "$*" | tee -a "$SETUP"; }
pack_logs() { tar czf "$OUT/gpu_check.tgz.new" -C "$LOGS" . 2>/dev/null && mv -f "$OUT/gpu_check.tgz.new" "$OUT/gpu_check.tgz"; }
record() {  # record STEP STATUS SECS [CAP]
  STEP_NAMES+=("$1"); STEP_STATUS+=("$2"); STEP_SECS+=("$3"); STEP_CAPS+=("${4:--}")
  write_summary
  pack_logs
}
# STEPS (default: the set's): the steps to run, e.g. STEPS="conformance
# train_cuda"; the build runs whenever the set has it.
STEPS=${STEPS:-$SET_STEPS}
want() { [[ " $SET_STEPS " == *" $1 "* && " $STEPS " == *" $1 "* ]]; }
# cap_of STEP CAP: the step's cap (CAP_<step> overrides CAP), never past what
# is left of BUDGET (5 s kept for the summary).
cap_of() {
  local v="CAP_$1" c left
  c=${!v:-$2}
  left=$((T_START + BUDGET - $(date +%s) - 5))
  echo $((c < left ? c : left))
}
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
  cat "$LOGS"/*.log 2>/dev/null | grep -E "^INFO probe=(cublaslt|cudnn_sdpa|streams|peer_torch) " |
    awk '!/ cc=/ || /^INFO probe=cublaslt /' | sed -E 's/^INFO probe=//; s/ device="[^"]*"//' | cut -c1-100
  echo "set: $SET  budget: ${BUDGET}s  logs: gpu_check.tgz"
  printf "%-18s %-18s %5s %5s\n" step status secs cap
  for i in "${!STEP_NAMES[@]}"; do
    printf "%-18s %-18s %5s %5s\n" "${STEP_NAMES[$i]}" "${STEP_STATUS[$i]}" "${STEP_SECS[$i]}" "${STEP_CAPS[$i]}"
  done
  MEASURED="median_ms=|fwd_ms=|gbps|tflops=|_us=|predicted_ms=|_on_ms=|graphs_ms=|replayed_step_ms="
  for f in "${PROBES[@]}" peer_torch conformance kernel_perf train_cuda dist_core dist_ext nccl_world1 gpu_dist gpu_overlap oracle_cuda mps_hetero profile_cuda cuda_graphs profile_step gpu_step gpu_shapes; do
    [[ -f "$LOGS/$f.log" ]] || continue
    n=$(grep -E "^RESULT .*status=PASS$" "$LOGS/$f.log" | grep -c -v -E "$MEASURED")
    [[ "$n" -gt 0 ]] && echo "PASS x$n  ${f#probe_}: correctness checks (lines in $f.log)"
  done
  cat "$LOGS"/*.log 2>/dev/null | grep -E "^RESULT " | grep -v "case=cudnn_version " |
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
    cut -c1-100 | head -n 64
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
# The oracle's transformers, pinned as on the CPU (scripts/setup_oracle_venv.sh;
# the GPU machine's own is another major version): its wheels installed into
# a folder first on PYTHONPATH, for every python3 below.
if [[ -d .gpu-deps/wheels ]] && ((!LOCAL)) && want oracle_cuda; then
  SITE=${TMPDIR:-/tmp}/hspmd-oracle-site
  rm -rf "$SITE"
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
       .gpu-deps/wheels/*.whl >>"$SETUP" 2>&1; then
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    note "oracle: $(python3 -c 'import transformers; print("transformers", transformers.__version__)' 2>&1 | tail -n 1)"
  else
    note "oracle: installing .gpu-deps/wheels failed (see setup.log); the machine's transformers is used"
  fi
elif want oracle_cuda; then
  note "oracle: no .gpu-deps/wheels (scripts/fetch_gpu_wheels.sh): the machine's transformers is used"
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
  timeout -k 10 "$TORCH_TIMEOUT" python3 tests/gpu/peer_torch.py >"$LOGS/peer_torch.log" 2>&1
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
grep -E "^(RESULT|SKIP|INFO)" "$LOGS/peer_torch.log" | tail -n 30

# --------------------------------------------------------------- probes --
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
for p in "${PROBES[@]}"; do
  t0=$(date +%s)
  bin="$BUILD_DIR/$p"
  origin=built
  if [[ ! -x "$bin" && -x ".gpu-deps/prebuilt/$p" ]]; then bin=".gpu-deps/prebuilt/$p"; origin=prebuilt; fi
  if [[ ! -x "$bin" ]]; then
    echo "== $p: not built" | tee "$LOGS/$p.log"
    record "$p" NOT_BUILT 0
    continue
  fi
  left=$((T_START + BUDGET - $(date +%s) - 15))
  limit=$((left < PROBE_TIMEOUT ? left : PROBE_TIMEOUT))
  if ((limit < 20)); then
    echo "== $p: not run, the time budget (BUDGET=$BUDGET s) is spent" | tee "$LOGS/$p.log"
    record "$p" NO_TIME 0
    continue
  fi
  echo "== $p ($origin: $bin, timeout ${limit}s)" | tee "$LOGS/$p.log"
  timeout -k 10 "$limit" "$bin" 2>&1 | tee -a "$LOGS/$p.log"
  rc=${PIPESTATUS[0]}
  st=$(status_of "$rc")
  [[ "$origin" == prebuilt ]] && st="$st(prebuilt)"
  echo "== $p: $st rc=$rc $(($(date +%s) - t0))s" | tee -a "$LOGS/$p.log"
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
# conformance programs, kernel_perf and nccl_world1. The extended set, run
# right after core on the same machine, finds this build and skips it.
t0=$(date +%s)
FBUILD=${FBUILD_DIR:-build-gpu-full}
CBC=$ROOT/.gpu-deps/cbc
HSPMD=$FBUILD/src/cli/hspmd
FULL_TARGETS=(hspmd test_kernels_backend_conformance conformance_memory conformance_attention kernel_perf nccl_world1)
if [[ -n "$NVCC" && -d "$CBC" ]] && want build; then
  lim=$(cap_of build 200)
  {
    echo "== configure + build: cmake -S . -B $FBUILD (CBC from $CBC); targets ${FULL_TARGETS[*]}, cap ${lim}s"
    PKG_CONFIG_PATH=$CBC/pkgconfig:${PKG_CONFIG_PATH:-} LIBRARY_PATH=$CBC/lib:${LIBRARY_PATH:-} \
      CPLUS_INCLUDE_PATH=$CBC/include:${CPLUS_INCLUDE_PATH:-} \
      timeout 60 cmake -S . -B "$FBUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DHSPMD_CUDA=ON \
        -DHSPMD_BUILD_BENCH=OFF -DHSPMD_PYTHON=OFF "${CMAKE_HINTS[@]}" &&
      LIBRARY_PATH=$CBC/lib:${LIBRARY_PATH:-} CPLUS_INCLUDE_PATH=$CBC/include:${CPLUS_INCLUDE_PATH:-} \
        timeout "$lim" cmake --build "$FBUILD" -j "$JOBS" --target "${FULL_TARGETS[@]}"
  } >"$LOGS/build_full.log" 2>&1
  rc=$?
  ((rc != 0)) && grep -E "error|Error" "$LOGS/build_full.log" | head -n 10
  record build_full "$([[ $rc == 0 ]] && echo PASS || echo "$(status_of "$rc")")" $(($(date +%s) - t0)) "$lim"
else
  record build_full NOT_BUILT 0 0
fi
# LOCAL: the binaries are built; nothing runs without a GPU.
HAVE_GPU=1
((LOCAL)) && HAVE_GPU=0
command -v nvidia-smi >/dev/null 2>&1 || HAVE_GPU=0

# run_step NAME CAP MIN_LEFT LOG -- COMMAND...: runs COMMAND under its cap
# (the smaller of CAP and what is left of BUDGET), output to LOG (appended)
# and the console, and records its status. Not run (and recorded so): a
# step the set leaves out, no GPU (--local), no binary, no time left.
run_step() {
  local name=$1 cap=$2 min=$3 log=$4
  shift 5
  local t0 lim rc
  t0=$(date +%s)
  if ! want "$name"; then return; fi
  if ((!HAVE_GPU)); then record "$name" "SKIP(no GPU)" 0 "$cap"; return; fi
  if [[ ! -x "$HSPMD" ]]; then record "$name" NOT_BUILT 0 "$cap"; return; fi
  lim=$(cap_of "$name" "$cap")
  if ((lim < min)); then
    echo "== $name: not run, $lim s left of BUDGET=$BUDGET (needs $min)" | tee -a "$LOGS/$log"
    record "$name" NO_TIME 0 "$cap"
    return
  fi
  echo "== $name (cap ${lim}s): $*" | tee -a "$LOGS/$log"
  LD_LIBRARY_PATH=$CBC/lib:${LD_LIBRARY_PATH:-} timeout -k 5 "$lim" "$@" 2>&1 | tee -a "$LOGS/$log"
  rc=${PIPESTATUS[0]}
  record "$name" "$(status_of "$rc")" $(($(date +%s) - t0)) "$lim"
}
# Several commands as one step: each under what is left of the step's cap;
# the step's status is the worst of theirs.
run_parts() {  # run_parts NAME CAP LOG -- "CMD1" "CMD2" ... (each a bash command line)
  local name=$1 cap=$2 log=$3
  shift 4
  local t0 lim end rcs=() c left
  t0=$(date +%s)
  if ! want "$name"; then return; fi
  if ((!HAVE_GPU)); then record "$name" "SKIP(no GPU)" 0 "$cap"; return; fi
  if [[ ! -x "$HSPMD" ]]; then record "$name" NOT_BUILT 0 "$cap"; return; fi
  lim=$(cap_of "$name" "$cap")
  if ((lim < 20)); then
    echo "== $name: not run, $lim s left of BUDGET=$BUDGET" | tee -a "$LOGS/$log"
    record "$name" NO_TIME 0 "$cap"
    return
  fi
  end=$((t0 + lim))
  for c in "$@"; do
    left=$((end - $(date +%s)))
    if ((left < 10)); then
      echo "== $name: not run, the step's cap is spent: $c" | tee -a "$LOGS/$log"
      rcs+=(124)
      continue
    fi
    echo "== $name (${left}s left): $c" | tee -a "$LOGS/$log"
    LD_LIBRARY_PATH=$CBC/lib:${LD_LIBRARY_PATH:-} timeout -k 5 "$left" bash -c "$c" 2>&1 | tee -a "$LOGS/$log"
    rcs+=("${PIPESTATUS[0]}")
  done
  record "$name" "$(status_of "$(worst_rc "${rcs[@]}")")" $(($(date +%s) - t0)) "$lim"
}

# ------------------------------------------------------------ core --
# conformance: every kernel of src/kernels/kernel_list.inc on every registered
# backend against the CPU baseline (test_kernels_backend_conformance, a few
# seconds: small shapes), every kernel against the CPU at training's shapes
# (conformance_memory), then attention on cuDNN (required: a fallback
# fails), in one log and status.
run_parts conformance 75 conformance.log -- \
  "$FBUILD/tests/kernels/test_kernels_backend_conformance --gtest_brief=1" \
  "$FBUILD/tests/gpu/conformance_memory" \
  "HSPMD_CUDNN_ATTENTION=1 $FBUILD/tests/gpu/conformance_attention"

# One process trains on CUDA against the CPU (fp32, bf16, the GPU's graph on
# the CPU, checkpoints both ways).
run_step train_cuda 60 20 train_cuda.log -- python3 tests/gpu/train_cuda_test.py --hspmd "$HSPMD" --repo "$ROOT"

# The Hugging Face oracle with hspmd on the GPU: Llama, Qwen2, Mistral, fp32
# and bf16, against the pinned transformers carried as wheels
# (scripts/fetch_gpu_wheels.sh; the same version as the CPU's oracle venv).
# The three families side by side (tests/oracle/cuda_oracles.sh): one after
# the other they took about 105 s on the H200.
run_step oracle_cuda 90 30 oracle_cuda.log -- bash tests/oracle/cuda_oracles.sh "$HSPMD" cuda:0

# Plans of every kind on 3-7 ranks sharing the GPU (the staged MPI
# communicator) against one GPU process: losses, weights, bytes = predicted.
# Each kind once: 1F1B, CP x TP, an asymmetric TP 4/2/1 with ZeRO, a
# heterogeneous pipeline with recomputation, bf16 DP x TP with ZeRO, packed
# documents under CP in a heterogeneous plan with ZeRO.
CORE_CASES=${CORE_CASES:-pp4_1f1b,cp2_tp2,asym7_tp421_zero,hetero_pp_tp_recompute,bf16_dp2_tp2_zero,packed_cp_hetero_zero}
run_step dist_core 100 40 dist_core.log -- python3 tests/exec/equivalence_test.py --hspmd "$HSPMD" \
  --device cuda:0 --random 0 --cases "$CORE_CASES"

# The TinyLlama-1.1B step (S 4096, B 4, bf16) against PyTorch eager and
# torch.compile, and the loss check: hspmd and PyTorch train the bundled
# corpus from one init; hspmd's losses must stay within the bound derived
# from PyTorch's own bf16-vs-fp32 gap, and a deliberately broken attention
# must fail it (bench/gpu_step.py, docs/benchmarks.md).
GPU_STEP_CAP=${GPU_STEP_CAP:-240}
if want gpu_step; then
  lim=$(cap_of gpu_step "$GPU_STEP_CAP")
  GPU_STEP_TORCH_LD_LIBRARY_PATH=$ORIG_LD_LIBRARY_PATH run_step gpu_step "$GPU_STEP_CAP" 90 gpu_step.log -- \
    python3 bench/gpu_step.py --hspmd "$HSPMD" --warmup 2 --steps 5 --timeout $((lim - 15 < 110 ? lim - 15 : 110)) \
      --json "$LOGS/gpu_step.json"
fi

# The profile against the measured step (issue [7/12]: the GPU profile within
# 10%; bench/profile_check.py, docs/profiling.md): hspmd profile --device
# cuda at gpu_step's shape (TinyLlama, S 4096, B 4, bf16) and plan cost of
# the one-GPU strategy, against gpu_step's hspmd step of this call. After
# gpu_step, in what core has left (its steps took about 450 s of 480 on
# 2026-11-28, the oracle's 84 s since about halved): estimated 10-20 s (the
# probe stages' start and a few timed runs), not yet run on a GPU. Without
# gpu_step's JSON (STEPS without gpu_step) it trains a 4-layer step of
# TinyLlama's width itself.
if [[ -f "$LOGS/gpu_step.json" ]]; then PROFILE_STEP_FROM=(--measured-json "$LOGS/gpu_step.json"); else PROFILE_STEP_FROM=(--layers 4); fi
run_step profile_step 30 15 profile_step.log -- python3 bench/profile_check.py --hspmd "$HSPMD" --device cuda:0 \
  "${PROFILE_STEP_FROM[@]}" --json "$LOGS/profile_step.json"

# -------------------------------------------------------- extended --
# The short steps first, then the long ones (measured on the H200: nccl_world1
# 2 s, kernel_perf 2 s, gpu_dist 13 s, profile_cuda 3 s, dist_ext about 140 s).
run_step nccl_world1 15 5 nccl_world1.log -- "$FBUILD/tests/comm/nccl_world1"
# Each kernel against the copy and GEMM ceilings (measurements, not checks);
# the step's GEMMs twice: the library's algorithm (gemm_*) and the fastest of
# its top few measured per shape (gemm_*_measured, HSPMD_GEMM_ALGO=measured).
run_step kernel_perf 20 5 kernel_perf.log -- "$FBUILD/tests/gpu/kernel_perf" --device cuda:0

# bench/gpu_dist.py: dist_step.py's plans with every rank on the GPU, the
# exposed gradient synchronization, bytes = predicted.
run_step gpu_dist 30 15 gpu_dist.log -- python3 bench/gpu_dist.py --hspmd "$HSPMD" --device cuda:0 --steps 3 \
  --json "$LOGS/gpu_dist.json"

# hspmd profile on the GPU: the tiny model's parts timed with CUDA events.
run_step profile_cuda 20 10 profile_cuda.log -- python3 tests/gpu/profile_cuda_test.py --hspmd "$HSPMD" \
  --repo "$ROOT"

# bench/cuda_graphs.py: the step replayed as a CUDA graph (--cuda-graphs)
# against op by op, a small host-bound model to the benchmark's width (2
# layers), the losses bit for bit (docs/cuda.md, "CUDA graphs"). Not yet
# timed on a GPU: six short runs, estimated 25-35 s.
run_step cuda_graphs 40 15 cuda_graphs.log -- python3 bench/cuda_graphs.py --hspmd "$HSPMD" --device cuda:0 \
  --shapes tiny,mid,wide --repeats 1 --steps 13 --timeout 30

# The other plans, plan switches and a resume, elastic failures and a join,
# token-budget steps with CP and switching, crash restarts (32, 41, 8, 18
# and about 40 s on the H200). mixtral_ep4_hot_zero: expert parallelism
# with a hot expert replicated on three of four members, ZeRO (docs/moe.md;
# its reference and case add two short runs, not yet timed on a GPU: the
# cap has 15 s more for them).
EXT_CASES=${EXT_CASES:-dp4_zero,tp4,2pp2_gpipe,idle_rank,qwen2_hetero_pp_tp,tied_tp1_to_cp2tp2,mistral_cp2,mixtral_ep4_hot_zero}

run_parts dist_ext 165 dist_ext.log -- \
  "python3 tests/exec/equivalence_test.py --hspmd $HSPMD --device cuda:0 --random 0 --cases $EXT_CASES" \
  "python3 tests/exec/switch_test.py --hspmd $HSPMD --device cuda:0 --only cases,resume" \
  "python3 tests/exec/elastic_test.py --hspmd $HSPMD --device cuda:0 --part gpu" \
  "python3 tests/exec/mixed_length_test.py --hspmd $HSPMD --device cuda:0" \
  "python3 tests/exec/restart_test.py --hspmd $HSPMD --repo $ROOT --part crash --device cuda:0"

# bench/gpu_overlap.py: DP 2 on the GPU, --overlap against --no-overlap
# (losses bit-identical, less exposed synchronization), and the PyTorch DDP
# peer. The TinyLlama width with 2 layers at S 512: the full 1.1B model's
# run outran a 171 s window, 4 layers at S 1024 a 60 s cap (2026-11-28).
OVERLAP_MODEL=$LOGS/overlap_config.json
python3 - "$OVERLAP_MODEL" <<'PY'
import json, sys
json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
           "intermediate_size": 5632, "num_hidden_layers": 2, "num_attention_heads": 32,
           "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 4096,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
           "hidden_act": "silu", "torch_dtype": "float32"}, open(sys.argv[1], "w"), indent=1)
PY
run_step gpu_overlap 45 25 gpu_overlap.log -- python3 bench/gpu_overlap.py --hspmd "$HSPMD" --device cuda:0 \
  --model "$OVERLAP_MODEL" --seq-len 512 --steps 3 --timeout 15 --json "$LOGS/gpu_overlap.json"

# bench/mps_hetero.py: 50/25/25 % MPS partitions, the planner's strategy for
# them against the symmetric ones, no MPS daemon left (its guardian polls
# every 0.5 s: counted again after 3 s).
run_step mps_hetero 50 25 mps_hetero.log -- python3 bench/mps_hetero.py --hspmd "$HSPMD" --device cuda:0 \
  --global-batch 12 --seq-len 256 --steps 3 --json "$LOGS/mps_hetero.json"
if want mps_hetero && ((HAVE_GPU)); then
  sleep 3
  echo "MPS processes 3 s after the step: $(pgrep -f nvidia-cuda-mps | wc -l)" | tee -a "$LOGS/mps_hetero.log"
fi

# Two more shapes against torch.compile (issue [7/12]: another vocabulary,
# GQA ratio and tying): bench/configs/llama-3.2-1b.json (vocab 128256, 32/8
# heads of 64, tied) at the end of core, qwen2-1.5b.json (vocab 151936, 12/2
# heads of 128, tied, q/k/v biases) at the end of extended (GPU_SHAPES
# overrides: NAME:CONFIG ...), S 4096 x B 4 as the TinyLlama step, hspmd and
# compiled only (no eager, no loss check: GPU_SHAPES_LOSS=1 adds it). Last
# in its call, a shape starts only with GPU_SHAPE_MIN (60) s left, else it
# is skipped, saying so: it never takes time from the steps above. Sizing
# (estimates from the 2026-11-28 window, not measured at these shapes): the
# core steps took about 450 s of 480 then (the oracle's 84 s since halved
# by running the families side by side), the extended ones about 210 of
# 300. At full depth one shape takes about 45-55 s of hspmd (most of it the
# host's one-thread initialization of 1.2-1.5 B parameters: TinyLlama's
# 1.1 B run took 41 s for 8 steps of 0.28 s) and 80-120 s of torch.compile
# (TinyLlama's 22 layers: gpu_step's 206 s less the loss check's 33,
# hspmd's 41, eager's 27), which neither call has. So by default 4 of the
# config's layers (GPU_SHAPES_LAYERS=4): the embedding, the tied LM head
# over the whole vocabulary and 4 blocks of the real width, about 20 + 35 s
# a shape (each system's own limit GPU_SHAPES_TIMEOUT, 60 s: torch.compile's
# cold start on a fresh machine is the least known part). GPU_SHAPES_LAYERS=0 runs the configs' own depth, in a call of
# its own: STEPS="build gpu_shapes" BUDGET=300 bash scripts/gpu_check.sh
# all. Each shape's RESULT lines are named after it
# (case=llama32_1b_hspmd_over_compiled: step_time_x, tokens_per_s_x).
GPU_SHAPES=${GPU_SHAPES:-$SET_SHAPES}
GPU_SHAPES_LAYERS=${GPU_SHAPES_LAYERS:-4}
GPU_SHAPE_MIN=${GPU_SHAPE_MIN:-60}
run_shapes() {  # each shape of GPU_SHAPES under what is left of the step's cap
  local t0 lim end rcs=() shape left cmd
  t0=$(date +%s)
  if ! want gpu_shapes; then return; fi
  if ((!HAVE_GPU)); then record gpu_shapes "SKIP(no GPU)" 0 100; return; fi
  if [[ ! -x "$HSPMD" ]]; then record gpu_shapes NOT_BUILT 0 100; return; fi
  lim=$(cap_of gpu_shapes 100)
  end=$((t0 + lim))
  for shape in $GPU_SHAPES; do
    left=$((end - $(date +%s)))
    if ((left < GPU_SHAPE_MIN)); then
      echo "== gpu_shapes: ${shape%%:*} not run, $left s left (needs $GPU_SHAPE_MIN)" | tee -a "$LOGS/gpu_shapes.log"
      rcs+=(77)
      continue
    fi
    cmd=(python3 bench/gpu_step.py --hspmd "$HSPMD" --model "bench/configs/${shape#*:}.json" --label "${shape%%:*}"
         --seq 4096 --mb 4 --warmup 2 --steps 5 --systems hspmd,compiled --timeout "${GPU_SHAPES_TIMEOUT:-60}"
         --json "$LOGS/gpu_shapes_${shape%%:*}.json")
    ((GPU_SHAPES_LAYERS > 0)) && cmd+=(--layers "$GPU_SHAPES_LAYERS")
    [[ "${GPU_SHAPES_LOSS:-0}" == 1 ]] || cmd+=(--no-loss-check)
    echo "== gpu_shapes (${left}s left): ${cmd[*]}" | tee -a "$LOGS/gpu_shapes.log"
    LD_LIBRARY_PATH=$CBC/lib:${LD_LIBRARY_PATH:-} timeout -k 5 "$left" "${cmd[@]}" 2>&1 | tee -a "$LOGS/gpu_shapes.log"
    rcs+=("${PIPESTATUS[0]}")
  done
  record gpu_shapes "$(status_of "$(worst_rc "${rcs[@]}")")" $(($(date +%s) - t0)) "$lim"
}
run_shapes

write_summary
pack_logs
echo
echo "==================== summary ($SUMMARY) ===================="
cat "$SUMMARY"
if [[ "$SET" == core ]] && ((!LOCAL)); then
  echo "next, at once (the machine keeps this build for 30 s): bash scripts/gpu_check.sh extended"
fi
