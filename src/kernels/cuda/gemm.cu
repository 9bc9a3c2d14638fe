// matmul on CUDA: cuBLAS (cublasGemmEx) with the same contract as the CPU
// kernel (kernels/basic.h): out = op(a2) · op(b), a2 = a viewed as
// [numel / a.dim(-1), a.dim(-1)], row-major. fp32 products accumulate in
// fp32 (CUBLAS_COMPUTE_32F, no TF32: the handle keeps the default math
// mode and cuBLAS only uses TF32 when asked); bf16 products (an operand is
// BF16 or compute is kBF16) take both operands in bf16 (an f32 operand is
// rounded to nearest even first, as the CPU kernel does) and accumulate in
// fp32; out is F32 or BF16.
//
// Row-major C[m,n] = A·B is column-major C^T[n,m] = B^T·A^T, so cuBLAS is
// called with the operands swapped: first B (ldb = b.dim(1)), then A (lda =
// a.dim(-1)), ldc = n.
//
// A bias (GemmEpilogue::bias, f32 [N]): cuBLASLt's BIAS epilogue adds a
// vector of "D's rows" to every column of the column-major D; D here is C^T
// (n x m), whose rows are our last dim N, so bias[j] is added to every row
// of our row-major output, in f32 after the product and before the one
// rounding to out. Used for a key only once its output, at the key's first
// call, has the digest of the two-pass path (cublasGemmEx into f32, then one
// kernel adding the bias and rounding: the bits of matmul, add_bias and
// cast); else, and where cuBLASLt offers no algorithm, the two passes.
#include <cublasLt.h>   // the same: cuBLASLt, for the GEMMs with an addend (C != D)
#include <cublas_v2.h>  // types and prototypes only: the library is opened at run time
#include <cuda_bf16.h>

#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <map>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/basic.h"
#include "kernels/cuda/cuda.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/memory.h"

namespace hspmd::kernels::cuda {
namespace {

// cuBLAS is opened at the first CUDA matmul, not linked: linked, its
// libraries (cuBLAS and cuBLASLt, ~600 MB) are mapped and relocated when
// any hspmd process starts, 0.15 s and 230 MB of resident memory per
// process even for CPU-only runs of many emulated ranks.
struct Blas {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  decltype(&cublasSetWorkspace_v2) set_workspace = nullptr;
  cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*,
                            const void*, cudaDataType, int, const void*, cudaDataType, int, const void*, void*,
                            cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t) = nullptr;
  decltype(&cublasGetStatusString) status_string = nullptr;
};

// The first of `names` dlopen finds (the loader's path first, then the
// toolkit this was built against), or "[cuda] matmul: cannot load <what>
// (each name: why)".
void* open_library(const char* what, std::initializer_list<const char*> names) {
  std::string tried;
  for (const char* name : names) {
    if (void* lib = dlopen(name, RTLD_NOW | RTLD_LOCAL)) return lib;
    const char* why = dlerror();
    tried += std::string(tried.empty() ? "" : "; ") + name + ": " + (why ? why : "not found");
  }
  fail("[cuda] matmul: cannot load ", what, " (", tried, ")");
}

const Blas& blas() {
  static const Blas b = [] {
    void* lib = open_library("cuBLAS", {"libcublas.so." HSPMD_CUBLAS_MAJOR,
                                        HSPMD_CUBLAS_DIR "/libcublas.so." HSPMD_CUBLAS_MAJOR, "libcublas.so"});
    Blas out;
    const auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (!fn) fail("[cuda] matmul: cuBLAS has no ", name);
    };
    sym(out.create, "cublasCreate_v2");
    sym(out.set_stream, "cublasSetStream_v2");
    sym(out.set_workspace, "cublasSetWorkspace_v2");
    sym(out.gemm_ex, "cublasGemmEx");
    sym(out.status_string, "cublasGetStatusString");
    return out;
  }();
  return b;
}

void check_blas(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS)
    fail("[cuda] ", what, ": cuBLAS error ", static_cast<int>(st), " (", blas().status_string(st), ")");
}

// cuBLAS's workspace per handle: its own default (32 MiB on Hopper). Set
// by us, from a buffer allocated with the handle, so that cuBLAS never
// allocates one while a stream is captured (a CUDA graph: docs/cuda.md,
// "CUDA graphs"); cublasSetStream resets the workspace, so it is set again
// after each.
constexpr size_t kBlasWorkspace = size_t{32} << 20;

struct BlasHandle {
  cublasHandle_t handle = nullptr;
  void* workspace = nullptr;  // process lifetime, as the handle
};

// One cuBLAS handle per (thread, device): a handle is not safe to share
// between threads that set different streams; each call binds its stream.
cublasHandle_t handle_for(Stream& s) {
  thread_local std::map<int, BlasHandle> handles;
  const int dev = s.device().index;
  auto it = handles.find(dev);
  if (it == handles.end()) {
    cuda_rt::check(cudaSetDevice(dev), "cudaSetDevice");
    BlasHandle h;
    check_blas(blas().create(&h.handle), "cublasCreate");
    cuda_rt::check(cudaMalloc(&h.workspace, kBlasWorkspace), "cudaMalloc (cuBLAS workspace)");
    it = handles.emplace(dev, h).first;
  }
  check_blas(blas().set_stream(it->second.handle, launch::native(s)), "cublasSetStream");
  check_blas(blas().set_workspace(it->second.handle, it->second.workspace, kBlasWorkspace), "cublasSetWorkspace");
  return it->second.handle;
}

// `a` as bf16 on the device: itself when it is BF16, else a rounded copy
// (cast's kernel; kept alive by the returned array).
NDArray as_bf16(Stream& s, const NDArray& a) { return a.dtype() == DType::BF16 ? a : cast(s, a, DType::BF16); }

cudaDataType_t cuda_type(DType t) { return t == DType::BF16 ? CUDA_R_16BF : CUDA_R_32F; }

// ---- cuBLASLt: D = op(A)·op(B) + C with C != D (the matmul's addend) ----
// cublasGemmEx adds beta·C only in place (C == D): folding a gradient's
// accumulation into it would cost a copy of the addend first, as much as the
// add it replaces. cuBLASLt reads C and writes D apart: the GEMM reads the
// addend once and writes the sum once.

struct Lt {
  decltype(&cublasLtCreate) create = nullptr;
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
  decltype(&cublasLtMatmulAlgoConfigGetAttribute) algo_config_get = nullptr;
  decltype(&cublasLtGetStatusString) status_string = nullptr;
};

const Lt& lt() {
  static const Lt l = [] {
    void* lib = open_library("cuBLASLt", {"libcublasLt.so." HSPMD_CUBLAS_MAJOR,
                                          HSPMD_CUBLAS_DIR "/libcublasLt.so." HSPMD_CUBLAS_MAJOR, "libcublasLt.so"});
    Lt out;
    const auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (!fn) fail("[cuda] matmul: cuBLASLt has no ", name);
    };
    sym(out.create, "cublasLtCreate");
    sym(out.desc_create, "cublasLtMatmulDescCreate");
    sym(out.desc_set, "cublasLtMatmulDescSetAttribute");
    sym(out.desc_destroy, "cublasLtMatmulDescDestroy");
    sym(out.layout_create, "cublasLtMatrixLayoutCreate");
    sym(out.layout_destroy, "cublasLtMatrixLayoutDestroy");
    sym(out.pref_create, "cublasLtMatmulPreferenceCreate");
    sym(out.pref_set, "cublasLtMatmulPreferenceSetAttribute");
    sym(out.pref_destroy, "cublasLtMatmulPreferenceDestroy");
    sym(out.heuristic, "cublasLtMatmulAlgoGetHeuristic");
    sym(out.matmul, "cublasLtMatmul");
    sym(out.algo_config_get, "cublasLtMatmulAlgoConfigGetAttribute");
    sym(out.status_string, "cublasLtGetStatusString");
    return out;
  }();
  return l;
}

void check_lt(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS)
    fail("[cuda] ", what, ": cuBLASLt error ", static_cast<int>(st), " (", lt().status_string(st), ")");
}

constexpr size_t kLtWorkspace = size_t{32} << 20;  // cuBLAS's own default on Hopper
// GemmAlgorithm::kMeasured: how many heuristic results are tried, and how
// often each eligible one is timed.
constexpr int kTuneCandidates = 8;
constexpr int kTuneReps = 3;

// One GEMM call's operands and shape, as matmul() derives them.
struct GemmCall {
  const NDArray* a = nullptr;  // a_op, b_op: bf16 copies where the products are bf16
  const NDArray* b = nullptr;
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0, a_cols = 0, b_cols = 0;
  cudaDataType_t in_type = CUDA_R_32F;
  const NDArray* addend = nullptr;  // out = op(a)·op(b) + addend (f32, C != D)
  NDArray* out = nullptr;
  const NDArray* bias = nullptr;  // out = op(a)·op(b) + bias[N] on every row (f32 [N])
};

// One GEMM key's descriptors and algorithms (ok == false: cuBLASLt offered
// none; the caller then runs cublasGemmEx, and adds apart).
struct LtPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  // The heuristic's results, best first, without repeats. With an addend,
  // algos[0] is the heuristic mode's algorithm (the first result of a query
  // for one, as that mode asks), the measured mode's other candidates after.
  cublasLtMatmulAlgo_t algos[kTuneCandidates + 1]{};
  int count = 0;
  int chosen = 0;  // into algos; -1: cublasGemmEx (no addend only)
  bool ok = false;
  // Measured mode: false until a call has chosen (a call on a stream being
  // captured, or whose output is all zeros, runs the default and leaves the
  // choice to a later call).
  bool decided = true;
  // With a bias: false until a call has compared algos[0]'s output with the
  // two-pass path's (the same exceptions as `decided`).
  bool verified = true;
};

// The alignment of each of A, B, C and D, for the heuristic: it would
// otherwise assume 256-byte aligned pointers and may pick a kernel that
// needs them (a view can start anywhere).
struct LtAlign {
  uint32_t a = 256, b = 256, c = 256, d = 256;
  bool operator<(const LtAlign& o) const { return std::tie(a, b, c, d) < std::tie(o.a, o.b, o.c, o.d); }
};

uint32_t alignment_of(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && v % a != 0) a /= 2;
  return a;
}

// (device, m, n, k, transposes, in and out types, addend, the bias's alignment
// (0: none; the heuristic reads it from the pointer), measured, alignments)
using LtKey = std::tuple<int, int64_t, int64_t, int64_t, bool, bool, int, int, bool, uint32_t, bool, LtAlign>;

uint64_t dim(int64_t v) { return static_cast<uint64_t>(v); }

// The descriptor and the four layouts of a call, as cublasGemmEx is called:
// cuBLASLt's A is our b, its B our a (column-major C^T). C is the f32 addend
// where there is one, else D itself (beta 0).
void describe(LtPlan& p, const GemmCall& c) {
  const Lt& L = lt();
  check_lt(L.desc_create(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  const cublasOperation_t op_a = c.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = c.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  check_lt(L.desc_set(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a), "cublasLtMatmulDescSetAttribute");
  check_lt(L.desc_set(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b), "cublasLtMatmulDescSetAttribute");
  if (c.bias != nullptr) {
    // f32 bias whatever D's type; its pointer is set per call (run_gemm).
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    const int32_t bias_type = CUDA_R_32F;
    const void* bias_data = c.bias->raw_data();  // the heuristic reads its alignment
    check_lt(L.desc_set(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue),
             "cublasLtMatmulDescSetAttribute");
    check_lt(L.desc_set(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof bias_type),
             "cublasLtMatmulDescSetAttribute");
    check_lt(L.desc_set(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_data, sizeof bias_data),
             "cublasLtMatmulDescSetAttribute");
  }
  // Stored matrices, column-major: b [b0, b1] row-major is (b1 x b0) with ld
  // b1; a [rows, a_cols] is (a_cols x rows) with ld a_cols; C and D are (n x m).
  check_lt(L.layout_create(&p.a, c.in_type, dim(c.b_cols), dim(c.trans_b ? c.n : c.k), c.b_cols),
           "cublasLtMatrixLayoutCreate");
  check_lt(L.layout_create(&p.b, c.in_type, dim(c.a_cols), dim(c.trans_a ? c.k : c.m), c.a_cols),
           "cublasLtMatrixLayoutCreate");
  const cudaDataType_t out_type = cuda_type(c.out->dtype());
  check_lt(L.layout_create(&p.d, out_type, dim(c.n), dim(c.m), c.n), "cublasLtMatrixLayoutCreate");
  if (c.addend != nullptr)
    check_lt(L.layout_create(&p.c, CUDA_R_32F, dim(c.n), dim(c.m), c.n), "cublasLtMatrixLayoutCreate");
  else
    p.c = p.d;
}

// Appends up to `count` heuristic results to the plan's algorithms, best
// first, leaving out any it already holds.
void find_algorithms(LtPlan& p, const LtAlign& align, int count, cublasLtHandle_t handle) {
  const Lt& L = lt();
  cublasLtMatmulPreference_t pref = nullptr;
  check_lt(L.pref_create(&pref), "cublasLtMatmulPreferenceCreate");
  const size_t ws = kLtWorkspace;
  check_lt(L.pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws),
           "cublasLtMatmulPreferenceSetAttribute");
  // cuBLASLt's A is our b, its B our a.
  for (const auto& [attr, bytes] : {std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align.b},
                                    std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align.a},
                                    std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align.c},
                                    std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align.d}})
    check_lt(L.pref_set(pref, attr, &bytes, sizeof bytes), "cublasLtMatmulPreferenceSetAttribute");
  cublasLtMatmulHeuristicResult_t results[kTuneCandidates]{};
  count = count < kTuneCandidates ? count : kTuneCandidates;
  int returned = 0;
  const cublasStatus_t st = L.heuristic(handle, p.desc, p.a, p.b, p.c, p.d, pref, count, results, &returned);
  L.pref_destroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS) returned = 0;
  constexpr int kCapacity = sizeof p.algos / sizeof p.algos[0];
  for (int i = 0; i < returned && p.count < kCapacity; ++i) {
    if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
    bool held = false;
    for (int j = 0; j < p.count && !held; ++j)
      held = std::memcmp(&p.algos[j], &results[i].algo, sizeof results[i].algo) == 0;
    if (!held) p.algos[p.count++] = results[i].algo;
  }
}

cublasLtHandle_t lt_handle(int dev) {
  thread_local std::map<int, cublasLtHandle_t> handles;
  auto it = handles.find(dev);
  if (it == handles.end()) {
    cuda_rt::check(cudaSetDevice(dev), "cudaSetDevice");
    cublasLtHandle_t h = nullptr;
    check_lt(lt().create(&h), "cublasLtCreate");
    it = handles.emplace(dev, h).first;
  }
  return it->second;
}

// One run of the call: cuBLASLt's algorithm `algo` (or cublasGemmEx, -1).
cublasStatus_t run_gemm(Stream& s, cublasLtHandle_t h, const LtPlan* p, int algo, const GemmCall& c,
                        void* workspace) {
  const float alpha = 1.0f, beta = c.addend != nullptr ? 1.0f : 0.0f;
  if (algo < 0)
    return blas().gemm_ex(handle_for(s), c.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, c.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                          static_cast<int>(c.n), static_cast<int>(c.m), static_cast<int>(c.k), &alpha,
                          c.b->raw_data(), c.in_type, static_cast<int>(c.b_cols), c.a->raw_data(), c.in_type,
                          static_cast<int>(c.a_cols), &beta, c.out->raw_data(), cuda_type(c.out->dtype()),
                          static_cast<int>(c.n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  const void* c_data = c.addend != nullptr ? c.addend->raw_data() : c.out->raw_data();
  if (c.bias != nullptr) {
    const void* bias_data = c.bias->raw_data();
    const cublasStatus_t st = lt().desc_set(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_data, sizeof bias_data);
    if (st != CUBLAS_STATUS_SUCCESS) return st;
  }
  return lt().matmul(h, p->desc, &alpha, c.b->raw_data(), p->a, c.a->raw_data(), p->b, &beta, c_data, p->c,
                     c.out->raw_data(), p->d, &p->algos[algo], workspace, kLtWorkspace, launch::native(s));
}

// ---- GemmAlgorithm::kMeasured: only algorithms with the default's bits ----
// Another algorithm may sum a dot product in another order and so round its
// last bits differently; a choice made by timing, which can change from run
// to run, would then change the results with it. A candidate is eligible
// only when its output on the call's own arrays has the same bits as the
// default algorithm's (the one the heuristic mode runs), compared through a
// 64-bit digest computed on the device.

__device__ inline uint64_t splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// digest[0] += the sum over elements of splitmix64(bits ^ index · golden),
// digest[1] += the count of elements other than ±0. Sums modulo 2^64 do not
// depend on the order of the atomic adds: the same bits give the same
// digest on every run. `Bits` is the element's raw type (u32 for f32, u16
// for bf16), `magnitude` its bits without the sign.
template <typename Bits>
__global__ void digest_kernel(const Bits* __restrict__ v, int64_t n, Bits magnitude,
                              unsigned long long* __restrict__ digest) {
  uint64_t sum = 0, nonzero = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const Bits bits = v[i];
    sum += splitmix64(static_cast<uint64_t>(bits) ^ (static_cast<uint64_t>(i) * 0x9e3779b97f4a7c15ull));
    nonzero += (bits & magnitude) != 0 ? 1 : 0;
  }
  for (int off = 16; off > 0; off /= 2) {
    sum += __shfl_down_sync(0xffffffffu, sum, off);
    nonzero += __shfl_down_sync(0xffffffffu, nonzero, off);
  }
  if ((threadIdx.x & 31) == 0) {
    atomicAdd(&digest[0], static_cast<unsigned long long>(sum));
    atomicAdd(&digest[1], static_cast<unsigned long long>(nonzero));
  }
}

// Adds the output's digest into `digest` (two zeroed u64), asynchronously.
// The grid is capped: a few thousand atomic adds per digest, not one per
// warp of a large output.
bool launch_digest(cudaStream_t st, const NDArray& out, unsigned long long* digest) {
  const int64_t n = out.numel();
  const int64_t blocks = (n + launch::kThreads - 1) / launch::kThreads;
  const unsigned grid = static_cast<unsigned>(blocks < 1024 ? (blocks > 0 ? blocks : 1) : 1024);
  if (out.dtype() == DType::F32)
    digest_kernel<<<grid, launch::kThreads, 0, st>>>(static_cast<const uint32_t*>(out.raw_data()), n,
                                                     uint32_t{0x7fffffffu}, digest);
  else
    digest_kernel<<<grid, launch::kThreads, 0, st>>>(static_cast<const uint16_t*>(out.raw_data()), n,
                                                     uint16_t{0x7fffu}, digest);
  return cudaGetLastError() == cudaSuccess;
}

// Whether a cuBLASLt algorithm computes each dot product in one pass: no
// split-K and no reduction scheme. A split-K algorithm adds partial sums
// (and may match the default on one array by chance, not on the next);
// such candidates are left out before any run, and so is one whose
// configuration cannot be read.
bool single_pass(const cublasLtMatmulAlgo_t& algo) {
  int32_t splits = 0;
  uint32_t scheme = 0;
  size_t written = 0;
  if (lt().algo_config_get(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits, sizeof splits, &written) !=
          CUBLAS_STATUS_SUCCESS ||
      written != sizeof splits)
    return false;
  if (lt().algo_config_get(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme, sizeof scheme, &written) !=
          CUBLAS_STATUS_SUCCESS ||
      written != sizeof scheme)
    return false;
  return splits <= 1 && scheme == CUBLASLT_REDUCTION_SCHEME_NONE;
}

// The measured mode's choice for a call: an algorithm (into the plan's, -1
// cublasGemmEx) and whether it is final for the key.
struct Choice {
  int algo = 0;
  bool decided = true;
};

// GemmAlgorithm::kMeasured at a key's first call. The default (what the
// heuristic mode runs: cublasGemmEx without an addend, the plan's algos[0]
// with one) runs first, then each single-pass candidate once, the output
// filled with a byte pattern before each (a candidate that wrote nothing, or
// part, cannot match), each output digested on the device; one host wait
// reads the digests. The candidates whose digest is the default's, and the
// default, are then timed over kTuneReps runs between two CUDA events on
// the call's own arrays (their digest run was the warm-up); the fastest is
// kept. Not decided: the stream is being captured (a CUDA graph: no host
// wait), or the default's output is all zeros (any algorithm gives zeros:
// nothing tells them apart); the default runs and a later call chooses.
// Any error: the default, decided.
Choice measure_fastest(Stream& s, cublasLtHandle_t h, const LtPlan& p, const GemmCall& c, void* workspace) {
  const int base = c.addend != nullptr || c.bias != nullptr ? 0 : -1;
  const cudaStream_t st = launch::native(s);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(st, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone) {
    (void)cudaGetLastError();
    return {base, false};
  }
  // What is tried, as indices into algos (-1: cublasGemmEx): the default
  // first, then the single-pass candidates.
  std::vector<int> tried{base};
  for (int algo = base + 1; algo < p.count; ++algo)
    if (single_pass(p.algos[algo])) tried.push_back(algo);
  if (tried.size() == 1) return {base, true};

  // The digests: two u64 per tried algorithm (I64 storage), zeroed.
  const auto slots = static_cast<int64_t>(tried.size());
  NDArray digests = NDArray::empty({2 * slots}, DType::I64, s.device());
  auto* d = static_cast<unsigned long long*>(digests.raw_data());
  std::vector<char> ran(tried.size(), 0);
  bool ok = cudaMemsetAsync(d, 0, digests.nbytes(), st) == cudaSuccess;
  for (size_t i = 0; ok && i < tried.size(); ++i) {
    if (i > 0 && cudaMemsetAsync(c.out->raw_data(), 0x7f, c.out->nbytes(), st) != cudaSuccess) {
      ok = false;  // 0x7f bytes: a large finite value in f32 and in bf16
      break;
    }
    ran[i] = run_gemm(s, h, &p, tried[i], c, workspace) == CUBLAS_STATUS_SUCCESS;
    if (!ran[i]) {
      (void)cudaGetLastError();
      if (i == 0) ok = false;  // the default itself failed: its own call reports it
      continue;
    }
    ok = launch_digest(st, *c.out, d + 2 * i);
  }
  std::vector<unsigned long long> host(static_cast<size_t>(2 * slots), 0);
  ok = ok && cudaMemcpyAsync(host.data(), d, digests.nbytes(), cudaMemcpyDeviceToHost, st) == cudaSuccess &&
       cudaStreamSynchronize(st) == cudaSuccess;
  if (!ok) {
    (void)cudaGetLastError();
    return {base, true};
  }
  if (host[1] == 0) return {base, false};
  std::vector<int> eligible{base};
  for (size_t i = 1; i < tried.size(); ++i)
    if (ran[i] && host[2 * i] == host[0] && host[2 * i + 1] == host[1]) eligible.push_back(tried[i]);
  if (eligible.size() == 1) return {base, true};

  cudaEvent_t start = nullptr, end = nullptr;
  if (cudaEventCreate(&start) != cudaSuccess || cudaEventCreate(&end) != cudaSuccess) {
    (void)cudaGetLastError();
    if (start != nullptr) (void)cudaEventDestroy(start);
    return {base, true};
  }
  int best = base;
  float best_ms = -1.0f;
  for (int algo : eligible) {
    bool timed = cudaEventRecord(start, st) == cudaSuccess;
    for (int r = 0; timed && r < kTuneReps; ++r)
      timed = run_gemm(s, h, &p, algo, c, workspace) == CUBLAS_STATUS_SUCCESS;
    float ms = 0;
    timed = timed && cudaEventRecord(end, st) == cudaSuccess && cudaEventSynchronize(end) == cudaSuccess &&
            cudaEventElapsedTime(&ms, start, end) == cudaSuccess;
    if (!timed) (void)cudaGetLastError();
    if (timed && (best_ms < 0 || ms < best_ms)) {
      best = algo;
      best_ms = ms;
    }
  }
  (void)cudaEventDestroy(start);
  (void)cudaEventDestroy(end);
  return {best, true};
}

// ---- a bias apart: the GEMM into f32, then one pass adding and rounding ----

// out[i] = bias[i % n] added to y[i] in f32, rounded once to T (y may be out
// itself when T is float): add_bias's sum and cast's rounding.
template <typename T>
__global__ void add_bias_round_kernel(const float* y, const float* __restrict__ bias, T* out, int64_t n,
                                      int64_t total) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = launch::from_f32<T>(y[i] + bias[i % n]);
}

void add_bias_round(Stream& s, const NDArray& y, const NDArray& bias, NDArray& out) {
  const int64_t total = out.numel();
  if (total == 0) return;
  const unsigned grid = launch::blocks_for(total);
  if (out.dtype() == DType::F32)
    add_bias_round_kernel<float><<<grid, launch::kThreads, 0, launch::native(s)>>>(
        y.data<float>(), bias.data<float>(), out.data<float>(), bias.numel(), total);
  else
    add_bias_round_kernel<__nv_bfloat16><<<grid, launch::kThreads, 0, launch::native(s)>>>(
        y.data<float>(), bias.data<float>(), static_cast<__nv_bfloat16*>(out.raw_data()), bias.numel(), total);
  launch::launched("matmul bias");
}

// The call with its bias in two passes: cublasGemmEx writes the f32 product
// (into out when out is f32), then add_bias_round (k == 0: a zero product).
void matmul_bias_apart(Stream& s, const GemmCall& c) {
  NDArray& out = *c.out;
  NDArray y = out.dtype() == DType::F32 ? out : NDArray::empty(out.shape(), DType::F32, out.device());
  if (c.k == 0) {
    fill(s, y, 0.0f);
  } else {
    GemmCall product = c;
    product.bias = nullptr;
    product.out = &y;
    check_blas(run_gemm(s, nullptr, nullptr, -1, product, nullptr), "cublasGemmEx");
  }
  add_bias_round(s, y, *c.bias, out);
}

// Whether algos[0] with the bias epilogue gives the two-pass path's bits on
// this call's arrays: each output digested on the device, one host wait.
// The epilogue runs first, so out holds the two-pass result at the end. Not
// decided: the stream is being captured (nothing runs here), or the two-pass
// output is all zeros. Any error: decided, no match.
Choice epilogue_matches(Stream& s, cublasLtHandle_t h, const LtPlan& p, const GemmCall& c, void* workspace) {
  const cudaStream_t st = launch::native(s);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(st, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone) {
    (void)cudaGetLastError();
    return {-1, false};
  }
  NDArray digests = NDArray::empty({4}, DType::I64, s.device());
  auto* d = static_cast<unsigned long long*>(digests.raw_data());
  bool ok = cudaMemsetAsync(d, 0, digests.nbytes(), st) == cudaSuccess &&
            cudaMemsetAsync(c.out->raw_data(), 0x7f, c.out->nbytes(), st) == cudaSuccess &&
            run_gemm(s, h, &p, 0, c, workspace) == CUBLAS_STATUS_SUCCESS && launch_digest(st, *c.out, d);
  if (!ok) (void)cudaGetLastError();
  matmul_bias_apart(s, c);  // throws on its own errors, as the path without an epilogue does
  unsigned long long host[4] = {};
  ok = ok && launch_digest(st, *c.out, d + 2) &&
       cudaMemcpyAsync(host, d, digests.nbytes(), cudaMemcpyDeviceToHost, st) == cudaSuccess &&
       cudaStreamSynchronize(st) == cudaSuccess;
  if (!ok) {
    (void)cudaGetLastError();
    return {-1, true};
  }
  if (host[3] == 0) return {-1, false};
  return {host[0] == host[2] && host[1] == host[3] ? 0 : -1, true};
}

// Plans per (thread, LtKey): made once, kept for the process (a training
// step repeats a few dozen shapes); measured ones choose at their first call
// (or a later one, while undecided).
const LtPlan& lt_plan(Stream& s, const GemmCall& c, bool measured, cublasLtHandle_t handle, void* workspace) {
  thread_local std::map<LtKey, LtPlan> plans;
  const LtAlign align{alignment_of(c.a->raw_data()), alignment_of(c.b->raw_data()),
                      alignment_of(c.addend != nullptr ? c.addend->raw_data() : c.out->raw_data()),
                      alignment_of(c.out->raw_data())};
  const LtKey key{s.device().index, c.m, c.n, c.k, c.trans_a, c.trans_b, static_cast<int>(c.in_type),
                  static_cast<int>(c.out->dtype()), c.addend != nullptr,
                  c.bias != nullptr ? alignment_of(c.bias->raw_data()) : 0u, measured, align};
  auto it = plans.find(key);
  if (it == plans.end()) {
    LtPlan p;
    describe(p, c);
    // The heuristic mode's algorithm is the result of a query for one, as
    // that mode asks (a longer query is not promised to rank it first); the
    // measured mode's candidates follow it. Without an addend (or bias) the
    // default is cublasGemmEx and the candidates are the query's results alone.
    const bool epilogue = c.addend != nullptr || c.bias != nullptr;
    if (measured && epilogue) {
      find_algorithms(p, align, 1, handle);
      if (p.count > 0) find_algorithms(p, align, kTuneCandidates, handle);
    } else {
      find_algorithms(p, align, measured ? kTuneCandidates : 1, handle);
    }
    p.ok = p.count > 0;
    p.decided = !(p.ok && measured);
    p.verified = !(p.ok && c.bias != nullptr);
    it = plans.emplace(key, p).first;
  }
  LtPlan& p = it->second;
  if (!p.verified) {
    // The caller then runs the call again, through the verified epilogue or
    // the two passes (once per key: the same bits).
    const Choice check = epilogue_matches(s, handle, p, c, workspace);
    p.verified = check.decided;
    p.ok = !check.decided || check.algo == 0;
    return p;
  }
  if (!p.decided) {
    const Choice choice = measure_fastest(s, handle, p, c, workspace);
    p.chosen = choice.algo;
    p.decided = choice.decided;
  }
  return p;
}

// The call through cuBLASLt with its plan's algorithm; false when the plan
// has none or chose cublasGemmEx (nothing was written that counts).
bool lt_matmul(Stream& s, const GemmCall& c, bool measured) {
  const cublasLtHandle_t h = lt_handle(s.device().index);
  NDArray workspace = NDArray::empty({static_cast<int64_t>(kLtWorkspace / 8)}, DType::I64, s.device());
  const LtPlan& p = lt_plan(s, c, measured, h, workspace.raw_data());
  if (!p.ok || !p.verified || p.chosen < 0) return false;
  check_lt(run_gemm(s, h, &p, p.chosen, c, workspace.raw_data()), "cublasLtMatmul");
  launch::launched("cublasLtMatmul");
  return true;
}

}  // namespace

void matmul(Stream& s, const NDArray& a, const NDArray& b, bool trans_a, bool trans_b, NDArray& out,
            GemmCompute compute, GemmEpilogue epilogue) {
  const NDArray* addend = epilogue.addend;
  const NDArray* bias = epilogue.bias;
  launch::require_contiguous("matmul", a);
  launch::require_contiguous("matmul", b);
  launch::require_contiguous("matmul", out);
  HSPMD_CHECK(a.ndim() >= 1 && b.ndim() == 2, "matmul: ranks ", a.ndim(), ", ", b.ndim());
  for (DType t : {a.dtype(), b.dtype(), out.dtype()})
    if (t != DType::F32 && t != DType::BF16)
      fail("[matmul] dtypes ", dtype_name(a.dtype()), ", ", dtype_name(b.dtype()), " -> ", dtype_name(out.dtype()),
           ": each must be f32 or bf16");
  const int64_t a_cols = a.dim(-1);
  const int64_t a_rows = a_cols == 0 ? 0 : a.numel() / a_cols;
  const int64_t m = trans_a ? a_cols : a_rows;
  const int64_t k = trans_a ? a_rows : a_cols;
  const int64_t n = trans_b ? b.dim(0) : b.dim(1);
  const int64_t kb = trans_b ? b.dim(1) : b.dim(0);
  HSPMD_CHECK(k == kb && out.numel() == m * n, "matmul: inner dims ", k, " vs ", kb);
  if (m == 0 || n == 0) return;
  if (bias != nullptr) {
    launch::require_contiguous("matmul", *bias);
    HSPMD_CHECK(addend == nullptr && bias->dtype() == DType::F32 && bias->numel() == n,
                "matmul: the bias must be f32 [", n, "] without an addend, got ", dtype_name(bias->dtype()),
                shape_str(bias->shape()));
  }
  if (k == 0 && bias != nullptr) {
    GemmCall zero{&a, &b, trans_a, trans_b, m, n, k, a_cols, b.dim(1), CUDA_R_32F, nullptr, &out, bias};
    return matmul_bias_apart(s, zero);
  }
  if (k == 0) {
    fill(s, out, 0.0f);
    if (addend != nullptr) add(s, out, *addend, out);
    return;
  }
  constexpr int64_t kMax = 0x7fffffff;  // cuBLAS's int dimensions
  if (m > kMax || n > kMax || k > kMax)
    fail("[matmul] ", m, " x ", k, " x ", n, ": a dimension exceeds cuBLAS's 2^31 - 1");
  const bool bf16 = compute == GemmCompute::kBF16 || a.dtype() == DType::BF16 || b.dtype() == DType::BF16;
  const NDArray a_op = bf16 ? as_bf16(s, a) : a, b_op = bf16 ? as_bf16(s, b) : b;
  GemmCall c{&a_op, &b_op, trans_a, trans_b, m, n, k, a_cols, b.dim(1), bf16 ? CUDA_R_16BF : CUDA_R_32F, addend, &out,
             bias};
  if (addend != nullptr) {
    // basic.h's contract, which cuBLASLt's C reads as is: f32 of out's size
    // (an f32 C layout over it), and apart from out. An addend inside out
    // would be C == D, and the measured mode runs each candidate algorithm
    // several times on the real arrays: D = A·B + D again each run.
    launch::require_contiguous("matmul", *addend);
    HSPMD_CHECK(addend->dtype() == DType::F32 && out.dtype() == DType::F32 && addend->numel() == out.numel(),
                "matmul: the addend must be f32 of the output's size with an f32 output, got ",
                dtype_name(addend->dtype()), shape_str(addend->shape()), " for ", dtype_name(out.dtype()),
                shape_str(out.shape()));
    const auto* a0 = static_cast<const char*>(addend->raw_data());
    const auto* o0 = static_cast<const char*>(out.raw_data());
    HSPMD_CHECK(a0 + addend->nbytes() <= o0 || o0 + out.nbytes() <= a0, "matmul: the addend overlaps the output");
  }
  // cuBLASLt for an addend (C != D), a bias whose pointer the epilogue takes
  // (16-byte aligned), and every GEMM whose algorithm is measured.
  const bool measured = gemm_algorithm() == GemmAlgorithm::kMeasured;
  if (bias != nullptr && alignment_of(bias->raw_data()) < 16) return matmul_bias_apart(s, c);
  if ((addend != nullptr || bias != nullptr || measured) && lt_matmul(s, c, measured)) return;
  if (bias != nullptr) return matmul_bias_apart(s, c);
  // Column-major view: C^T (n x m) = op(B)^T (n x k) · op(A)^T (k x m).
  c.addend = nullptr;
  check_blas(run_gemm(s, nullptr, nullptr, -1, c, nullptr), "cublasGemmEx");
  if (addend != nullptr) add(s, out, *addend, out);  // in place: each element read before written
}

}  // namespace hspmd::kernels::cuda
