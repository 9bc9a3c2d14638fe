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
#include <cublasLt.h>   // the same: cuBLASLt, for the GEMMs with an addend (C != D)
#include <cublas_v2.h>  // types and prototypes only: the library is opened at run time
#include <cuda_bf16.h>

#include <dlfcn.h>

#include <initializer_list>
#include <map>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

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

// One cuBLAS handle per (thread, device): a handle is not safe to share
// between threads that set different streams; each call binds its stream.
cublasHandle_t handle_for(Stream& s) {
  thread_local std::map<int, cublasHandle_t> handles;
  const int dev = s.device().index;
  auto it = handles.find(dev);
  if (it == handles.end()) {
    cuda_rt::check(cudaSetDevice(dev), "cudaSetDevice");
    cublasHandle_t h = nullptr;
    check_blas(blas().create(&h), "cublasCreate");
    it = handles.emplace(dev, h).first;
  }
  check_blas(blas().set_stream(it->second, launch::native(s)), "cublasSetStream");
  return it->second;
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
// GemmAlgorithm::kMeasured: how many heuristic results are timed, and how often.
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
};

// One GEMM key's descriptors and algorithms (ok == false: cuBLASLt offered
// none; the caller then runs cublasGemmEx, and adds apart).
struct LtPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algos[kTuneCandidates]{};  // the heuristic's first `count`, best first
  int count = 0;
  int chosen = 0;  // into algos; -1: cublasGemmEx (no addend only)
  bool ok = false;
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

// (device, m, n, k, transposes, in and out types, addend, measured, alignments)
using LtKey = std::tuple<int, int64_t, int64_t, int64_t, bool, bool, int, int, bool, bool, LtAlign>;

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

// Up to `count` heuristic results for the plan, best first.
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
  for (int i = 0; i < returned; ++i)
    if (results[i].state == CUBLAS_STATUS_SUCCESS) p.algos[p.count++] = results[i].algo;
  p.ok = p.count > 0;
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
  return lt().matmul(h, p->desc, &alpha, c.b->raw_data(), p->a, c.a->raw_data(), p->b, &beta, c_data, p->c,
                     c.out->raw_data(), p->d, &p->algos[algo], workspace, kLtWorkspace, launch::native(s));
}

// GemmAlgorithm::kMeasured: the fastest of the plan's algorithms (and of
// cublasGemmEx without an addend) on the call's own arrays, each run once
// and then timed over kTuneReps runs between two CUDA events. 0 (the
// heuristic's first) when the stream is being captured or anything fails.
int measure_fastest(Stream& s, cublasLtHandle_t h, const LtPlan& p, const GemmCall& c, void* workspace) {
  const cudaStream_t st = launch::native(s);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(st, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone) {
    (void)cudaGetLastError();
    return 0;
  }
  cudaEvent_t start = nullptr, end = nullptr;
  if (cudaEventCreate(&start) != cudaSuccess || cudaEventCreate(&end) != cudaSuccess) {
    (void)cudaGetLastError();
    if (start != nullptr) (void)cudaEventDestroy(start);
    return 0;
  }
  int best = 0;
  float best_ms = -1.0f;
  for (int algo = c.addend != nullptr ? 0 : -1; algo < p.count; ++algo) {
    bool ok = run_gemm(s, h, &p, algo, c, workspace) == CUBLAS_STATUS_SUCCESS;  // the warm-up
    ok = ok && cudaEventRecord(start, st) == cudaSuccess;
    for (int r = 0; ok && r < kTuneReps; ++r) ok = run_gemm(s, h, &p, algo, c, workspace) == CUBLAS_STATUS_SUCCESS;
    float ms = 0;
    ok = ok && cudaEventRecord(end, st) == cudaSuccess && cudaEventSynchronize(end) == cudaSuccess &&
         cudaEventElapsedTime(&ms, start, end) == cudaSuccess;
    if (!ok) (void)cudaGetLastError();
    if (ok && (best_ms < 0 || ms < best_ms)) {
      best = algo;
      best_ms = ms;
    }
  }
  (void)cudaEventDestroy(start);
  (void)cudaEventDestroy(end);
  return best_ms < 0 ? 0 : best;
}

// Plans per (thread, LtKey): made once, kept for the process (a training
// step repeats a few dozen shapes); measured ones choose at their first call.
const LtPlan& lt_plan(Stream& s, const GemmCall& c, bool measured, cublasLtHandle_t handle, void* workspace) {
  thread_local std::map<LtKey, LtPlan> plans;
  const LtAlign align{alignment_of(c.a->raw_data()), alignment_of(c.b->raw_data()),
                      alignment_of(c.addend != nullptr ? c.addend->raw_data() : c.out->raw_data()),
                      alignment_of(c.out->raw_data())};
  const LtKey key{s.device().index, c.m, c.n, c.k, c.trans_a, c.trans_b, static_cast<int>(c.in_type),
                  static_cast<int>(c.out->dtype()), c.addend != nullptr, measured, align};
  auto it = plans.find(key);
  if (it != plans.end()) return it->second;
  LtPlan p;
  describe(p, c);
  find_algorithms(p, align, measured ? kTuneCandidates : 1, handle);
  if (p.ok && measured) p.chosen = measure_fastest(s, handle, p, c, workspace);
  return plans.emplace(key, p).first->second;
}

// The call through cuBLASLt with its plan's algorithm; false when the plan
// has none or chose cublasGemmEx (nothing was written that counts).
bool lt_matmul(Stream& s, const GemmCall& c, bool measured) {
  const cublasLtHandle_t h = lt_handle(s.device().index);
  NDArray workspace = NDArray::empty({static_cast<int64_t>(kLtWorkspace / 8)}, DType::I64, s.device());
  const LtPlan& p = lt_plan(s, c, measured, h, workspace.raw_data());
  if (!p.ok || p.chosen < 0) return false;
  check_lt(run_gemm(s, h, &p, p.chosen, c, workspace.raw_data()), "cublasLtMatmul");
  launch::launched("cublasLtMatmul");
  return true;
}

}  // namespace

void matmul(Stream& s, const NDArray& a, const NDArray& b, bool trans_a, bool trans_b, NDArray& out,
            GemmCompute compute, const NDArray* addend) {
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
  GemmCall c{&a_op, &b_op, trans_a, trans_b, m, n, k, a_cols, b.dim(1), bf16 ? CUDA_R_16BF : CUDA_R_32F, addend, &out};
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
  // cuBLASLt for an addend (C != D), and for every GEMM whose algorithm is measured.
  const bool measured = gemm_algorithm() == GemmAlgorithm::kMeasured;
  if ((addend != nullptr || measured) && lt_matmul(s, c, measured)) return;
  // Column-major view: C^T (n x m) = op(B)^T (n x k) · op(A)^T (k x m).
  c.addend = nullptr;
  check_blas(run_gemm(s, nullptr, nullptr, -1, c, nullptr), "cublasGemmEx");
  if (addend != nullptr) add(s, out, *addend, out);  // in place: each element read before written
}

}  // namespace hspmd::kernels::cuda
