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

// One GEMM shape's descriptors and chosen algorithm (ok == false: cuBLASLt
// offered none; the caller then adds apart).
struct LtPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
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

using LtKey = std::tuple<int, int64_t, int64_t, int64_t, bool, bool, int, LtAlign>;

// Plans per (thread, device, shape): made once, kept for the process (a
// training step repeats a few dozen shapes). The handle likewise.
const LtPlan& lt_plan(int dev, int64_t m, int64_t n, int64_t k, bool trans_a, bool trans_b, cudaDataType_t in_type,
                      int64_t b_cols, int64_t a_cols, const LtAlign& align, cublasLtHandle_t handle) {
  thread_local std::map<LtKey, LtPlan> plans;
  const LtKey key{dev, m, n, k, trans_a, trans_b, static_cast<int>(in_type), align};
  auto it = plans.find(key);
  if (it != plans.end()) return it->second;
  LtPlan p;
  const Lt& L = lt();
  check_lt(L.desc_create(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  // As cublasGemmEx is called: cuBLASLt's A is our b, its B our a (column-major C^T).
  const cublasOperation_t op_a = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  check_lt(L.desc_set(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a), "cublasLtMatmulDescSetAttribute");
  check_lt(L.desc_set(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b), "cublasLtMatmulDescSetAttribute");
  // Stored matrices, column-major: b [b0, b1] row-major is (b1 x b0) with ld
  // b1; a [rows, a_cols] is (a_cols x rows) with ld a_cols; C and D are (n x m).
  const uint64_t b_rows_cm = static_cast<uint64_t>(b_cols), b_cols_cm = static_cast<uint64_t>(trans_b ? n : k);
  const uint64_t a_rows_cm = static_cast<uint64_t>(a_cols), a_cols_cm = static_cast<uint64_t>(trans_a ? k : m);
  check_lt(L.layout_create(&p.a, in_type, b_rows_cm, b_cols_cm, b_cols), "cublasLtMatrixLayoutCreate");
  check_lt(L.layout_create(&p.b, in_type, a_rows_cm, a_cols_cm, a_cols), "cublasLtMatrixLayoutCreate");
  check_lt(L.layout_create(&p.c, CUDA_R_32F, static_cast<uint64_t>(n), static_cast<uint64_t>(m), n),
           "cublasLtMatrixLayoutCreate");
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
  cublasLtMatmulHeuristicResult_t result{};
  int returned = 0;
  const cublasStatus_t st = L.heuristic(handle, p.desc, p.a, p.b, p.c, p.c, pref, 1, &result, &returned);
  L.pref_destroy(pref);
  p.ok = st == CUBLAS_STATUS_SUCCESS && returned > 0;
  if (p.ok) p.algo = result.algo;
  return plans.emplace(key, p).first->second;
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

// out = op(a)·op(b) + addend (f32) in one cuBLASLt call; false when cuBLASLt
// has no algorithm for the shape (nothing was written).
bool lt_matmul_add(Stream& s, const NDArray& a_op, const NDArray& b_op, bool trans_a, bool trans_b, int64_t m,
                   int64_t n, int64_t k, int64_t a_cols, int64_t b_cols, cudaDataType_t in_type, const NDArray& addend,
                   NDArray& out) {
  const int dev = s.device().index;
  const cublasLtHandle_t h = lt_handle(dev);
  const LtAlign align{alignment_of(a_op.raw_data()), alignment_of(b_op.raw_data()), alignment_of(addend.raw_data()),
                      alignment_of(out.raw_data())};
  const LtPlan& p = lt_plan(dev, m, n, k, trans_a, trans_b, in_type, b_cols, a_cols, align, h);
  if (!p.ok) return false;
  NDArray workspace = NDArray::empty({static_cast<int64_t>(kLtWorkspace / 8)}, DType::I64, s.device());
  const float alpha = 1.0f, beta = 1.0f;
  check_lt(lt().matmul(h, p.desc, &alpha, b_op.raw_data(), p.a, a_op.raw_data(), p.b, &beta, addend.raw_data(), p.c,
                       out.raw_data(), p.c, &p.algo, workspace.raw_data(), kLtWorkspace, launch::native(s)),
           "cublasLtMatmul");
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
  const cudaDataType_t in_type = bf16 ? CUDA_R_16BF : CUDA_R_32F;
  if (addend != nullptr) {
    launch::require_contiguous("matmul", *addend);
    if (lt_matmul_add(s, a_op, b_op, trans_a, trans_b, m, n, k, a_cols, b.dim(1), in_type, *addend, out)) return;
  }
  const float alpha = 1.0f, beta = 0.0f;
  // Column-major view: C^T (n x m) = op(B)^T (n x k) · op(A)^T (k x m).
  check_blas(blas().gemm_ex(handle_for(s), trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                          static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha, b_op.raw_data(),
                          in_type, static_cast<int>(b.dim(1)), a_op.raw_data(), in_type, static_cast<int>(a_cols),
                          &beta, out.raw_data(), cuda_type(out.dtype()), static_cast<int>(n), CUBLAS_COMPUTE_32F,
                          CUBLAS_GEMM_DEFAULT),
             "cublasGemmEx");
  if (addend != nullptr) add(s, out, *addend, out);  // in place: each element read before written
}

}  // namespace hspmd::kernels::cuda
