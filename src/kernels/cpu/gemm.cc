// matmul on CPU: OpenBLAS sgemm and, when the build has it, oneDNN matmul
// primitives (bf16 on CPUs with avx512_bf16 / AMX; fp32 on request).
//
// Paths (docs/precision.md, "GEMM backends"):
//  * fp32: a cached oneDNN f32 primitive (default when built with oneDNN), or
//    cblas_sgemm (HSPMD_GEMM_F32=openblas, or no oneDNN in the build).
//  * bf16 native: operands in bf16 (F32 ones rounded into a scratch buffer),
//    a cached oneDNN bf16 x bf16 -> out-dtype primitive, fp32 accumulation.
//  * bf16 emulated: operands rounded to bf16 values kept in fp32 buffers, then
//    cblas_sgemm. A bf16 x bf16 product is exact in fp32, so both bf16 paths
//    differ only in the order of the fp32 sums.
// Transposes are strides in the oneDNN memory descriptors (and the BLAS
// transpose flags), never materialized.
#include <cblas.h>
#include <omp.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "hspmd/core/cpu_isa.h"
#include "hspmd/core/error.h"
#include "kernels/basic.h"
#include "kernels/cpu/cpu.h"
#include "kernels/kernels.h"

#ifdef HSPMD_HAVE_DNNL
#include <map>
#include <mutex>
#include <tuple>

#include <oneapi/dnnl/dnnl.hpp>
#endif

namespace hspmd::kernels {

namespace {

// ---- settings (environment read once, setters override) ----

bool env_bf16_emulate() {
  const char* v = std::getenv("HSPMD_GEMM_BF16");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "native") == 0) return false;
  if (std::strcmp(v, "emulate") == 0) return true;
  fail("[matmul] HSPMD_GEMM_BF16 must be \"emulate\" or \"native\", got \"", v, "\"");
}

GemmF32Backend env_f32_backend() {
  // Default with AVX-512 oneDNN (5-10% faster than OpenBLAS at the model's
  // shapes, 1 and 2 threads, and one threading runtime with our OpenMP
  // kernels); below it OpenBLAS, whose AVX2 kernels beat oneDNN's there
  // (the LM head's weight gradient 102 against 46 GFLOP/s, the reference
  // step's GEMMs 0.47 against 0.57-0.60 s; docs/precision.md). OpenBLAS
  // when the build has no oneDNN.
  const char* v = std::getenv("HSPMD_GEMM_F32");
  if (v == nullptr || *v == '\0')
    return cpu_isa() >= CpuIsa::kAvx512 ? GemmF32Backend::kOneDNN : GemmF32Backend::kOpenBLAS;
  if (std::strcmp(v, "onednn") == 0) return GemmF32Backend::kOneDNN;
  if (std::strcmp(v, "openblas") == 0) return GemmF32Backend::kOpenBLAS;
  fail("[matmul] HSPMD_GEMM_F32 must be \"openblas\" or \"onednn\", got \"", v, "\"");
}

GemmAlgorithm env_gemm_algorithm() {
  const char* v = std::getenv("HSPMD_GEMM_ALGO");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "heuristic") == 0) return GemmAlgorithm::kHeuristic;
  if (std::strcmp(v, "measured") == 0) return GemmAlgorithm::kMeasured;
  fail("[matmul] HSPMD_GEMM_ALGO must be \"heuristic\" or \"measured\", got \"", v, "\"");
}

std::atomic<GemmAlgorithm>& gemm_algorithm_flag() {
  static std::atomic<GemmAlgorithm> flag{env_gemm_algorithm()};
  return flag;
}

std::atomic<bool>& bf16_emulation_flag() {
  static std::atomic<bool> flag{env_bf16_emulate()};
  return flag;
}

std::atomic<GemmF32Backend>& f32_backend_flag() {
#ifdef HSPMD_HAVE_DNNL
  static std::atomic<GemmF32Backend> flag{env_f32_backend()};
#else
  // Validate the variable; without oneDNN every fp32 GEMM is OpenBLAS.
  static std::atomic<GemmF32Backend> flag{(env_f32_backend(), GemmF32Backend::kOpenBLAS)};
#endif
  return flag;
}

// ---- conversions (OpenMP over large arrays) ----

constexpr int64_t kParallelElems = 1 << 16;

void round_to_bf16(const float* src, uint16_t* dst, int64_t n) { f32_to_bf16_n(src, dst, n); }

// fp32 values rounded to the nearest bf16 value, kept in fp32.
void round_to_bf16_values(const float* src, float* dst, int64_t n) {
#pragma omp parallel for schedule(static) if (n > kParallelElems)
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(f32_to_bf16(src[i]));
}

void widen_bf16(const uint16_t* src, float* dst, int64_t n) { bf16_to_f32_n(src, dst, n); }

// An uninitialized scratch array of n elements.
template <typename T>
std::unique_ptr<T[]> scratch(int64_t n) {
  return std::unique_ptr<T[]>(new T[static_cast<size_t>(n)]);
}

// The problem in BLAS terms: C[m, n] = op(A)[m, k] · op(B)[k, n], all row
// major; lda / ldb are the stored row lengths.
struct Gemm {
  int64_t m, n, k, lda, ldb;
  bool trans_a, trans_b;
};

void sgemm(const Gemm& g, const float* a, const float* b, float* c) {
  cblas_sgemm(CblasRowMajor, g.trans_a ? CblasTrans : CblasNoTrans,
              g.trans_b ? CblasTrans : CblasNoTrans, static_cast<int>(g.m), static_cast<int>(g.n),
              static_cast<int>(g.k), 1.0f, a, static_cast<int>(g.lda), b,
              static_cast<int>(g.ldb), 0.0f, c, static_cast<int>(g.n));
}

#ifdef HSPMD_HAVE_DNNL

// ---- oneDNN: one engine, one stream per calling thread, cached primitives ----

using dnnl::memory;

memory::data_type dnnl_type(DType t) {
  return t == DType::BF16 ? memory::data_type::bf16 : memory::data_type::f32;
}

// (m, n, k, trans_a, trans_b, a dtype, b dtype, out dtype, threads). The
// thread count is part of the key: oneDNN's OpenMP runtime fixes a
// primitive's partitioning for the thread count at creation.
using PrimKey = std::tuple<int64_t, int64_t, int64_t, bool, bool, DType, DType, DType, int>;

struct Prim {
  dnnl::matmul matmul;
  memory::desc a_md, b_md, c_md;
};

constexpr size_t kMaxCachedPrims = 4096;

struct Dnnl {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  std::mutex mu;
  std::map<PrimKey, std::shared_ptr<const Prim>> cache;
};

// HSPMD_CPU_ISA's cap, given to oneDNN before its first primitive (it takes
// a cap only then). ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA), when set, is
// oneDNN's own cap and wins.
void cap_onednn() {
  static const bool done = [] {
    if (!cpu_isa_capped() || std::getenv("ONEDNN_MAX_CPU_ISA") || std::getenv("DNNL_MAX_CPU_ISA")) return true;
    dnnl::cpu_isa cap = dnnl::cpu_isa::avx512_core_bf16;
    switch (cpu_isa()) {
      case CpuIsa::kBaseline: cap = dnnl::cpu_isa::sse41; break;
      case CpuIsa::kAvx2: cap = dnnl::cpu_isa::avx2; break;
      case CpuIsa::kAvx512: cap = dnnl::cpu_isa::avx512_core; break;
      default: break;
    }
    try {
      dnnl::set_max_cpu_isa(cap);
    } catch (const dnnl::error&) {
      // Too late (a primitive exists already): oneDNN keeps the CPU's level.
    }
    return true;
  }();
  (void)done;
}

Dnnl& dnnl_state() {
  cap_onednn();
  static Dnnl state;
  return state;
}

// oneDNN streams are not meant for concurrent use by several threads; each
// thread that runs matmuls gets its own (CPU streams are cheap wrappers).
dnnl::stream& dnnl_stream() {
  thread_local dnnl::stream stream(dnnl_state().engine);
  return stream;
}

std::shared_ptr<const Prim> dnnl_prim(const Gemm& g, DType ta, DType tb, DType tc) {
  // oneDNN's OpenMP runtime runs on omp_get_max_threads() threads, the count
  // set_num_threads() sets (with OpenBLAS's).
  const int threads = omp_get_max_threads();
  const PrimKey key{g.m, g.n, g.k, g.trans_a, g.trans_b, ta, tb, tc, threads};
  Dnnl& d = dnnl_state();
  std::lock_guard<std::mutex> lock(d.mu);
  auto it = d.cache.find(key);
  if (it != d.cache.end()) return it->second;
  // Logical A [m, k], B [k, n]; a transposed operand is the stored matrix
  // read with swapped strides.
  const memory::dims a_strides = g.trans_a ? memory::dims{1, g.lda} : memory::dims{g.lda, 1};
  const memory::dims b_strides = g.trans_b ? memory::dims{1, g.ldb} : memory::dims{g.ldb, 1};
  auto p = std::make_shared<Prim>();
  p->a_md = memory::desc({g.m, g.k}, dnnl_type(ta), a_strides);
  p->b_md = memory::desc({g.k, g.n}, dnnl_type(tb), b_strides);
  p->c_md = memory::desc({g.m, g.n}, dnnl_type(tc), memory::dims{g.n, 1});
  try {
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(p->a_md, p->b_md, p->c_md), d.engine);
    p->matmul = dnnl::matmul(pd);
  } catch (const dnnl::error& e) {
    fail("[matmul] oneDNN matmul ", g.m, "x", g.n, "x", g.k, " (", dtype_name(ta), ", ",
         dtype_name(tb), " -> ", dtype_name(tc), "): ", e.what());
  }
  // Shapes that vary step by step (mixed lengths) would grow the cache
  // without bound: past kMaxCachedPrims it starts over (primitives in use
  // stay alive through their shared_ptr).
  if (d.cache.size() >= kMaxCachedPrims) d.cache.clear();
  d.cache.emplace(key, p);
  return p;
}

void dnnl_gemm(const Gemm& g, DType ta, const void* a, DType tb, const void* b, DType tc,
               void* c) {
  std::shared_ptr<const Prim> p = dnnl_prim(g, ta, tb, tc);
  const dnnl::engine& eng = dnnl_state().engine;
  memory am(p->a_md, eng, const_cast<void*>(a));
  memory bm(p->b_md, eng, const_cast<void*>(b));
  memory cm(p->c_md, eng, c);
  dnnl::stream& s = dnnl_stream();
  p->matmul.execute(s, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
  s.wait();
}

const char* dnnl_isa_name(dnnl::cpu_isa isa) {
  switch (isa) {
    case dnnl::cpu_isa::avx512_core_amx: return "avx512_core_amx";
    case dnnl::cpu_isa::avx512_core_bf16: return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_vnni: return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core: return "avx512_core";
    case dnnl::cpu_isa::avx2_vnni: return "avx2_vnni";
    case dnnl::cpu_isa::avx2: return "avx2";
    case dnnl::cpu_isa::avx: return "avx";
    case dnnl::cpu_isa::sse41: return "sse41";
    default: return "unknown";
  }
}

bool isa_has(dnnl::cpu_isa isa, dnnl::cpu_isa feature) {
  const auto bits = static_cast<unsigned>(isa), want = static_cast<unsigned>(feature);
  return (bits & want) == want;
}

#endif  // HSPMD_HAVE_DNNL

// ---- the paths ----

void f32_gemm(const Gemm& g, const float* a, const float* b, float* c) {
#ifdef HSPMD_HAVE_DNNL
  if (f32_backend_flag().load() == GemmF32Backend::kOneDNN) {
    dnnl_gemm(g, DType::F32, a, DType::F32, b, DType::F32, c);
    return;
  }
#endif
  sgemm(g, a, b, c);
}

// fp32 result into out (F32 directly, BF16 through a rounded scratch).
template <typename F>
void into_out(NDArray& out, int64_t mn, F gemm_into) {
  if (out.dtype() == DType::F32) {
    gemm_into(out.data<float>());
    return;
  }
  auto tmp = scratch<float>(mn);
  gemm_into(tmp.get());
  round_to_bf16(tmp.get(), out.data<uint16_t>(), mn);
}

void bf16_emulated(const Gemm& g, const NDArray& a, const NDArray& b, NDArray& out) {
  auto as_bf16_values = [](const NDArray& x) {
    auto buf = scratch<float>(x.numel());
    if (x.dtype() == DType::BF16) widen_bf16(x.data<uint16_t>(), buf.get(), x.numel());
    else round_to_bf16_values(x.data<float>(), buf.get(), x.numel());
    return buf;
  };
  auto ab = as_bf16_values(a);
  auto bb = as_bf16_values(b);
  into_out(out, g.m * g.n, [&](float* c) { sgemm(g, ab.get(), bb.get(), c); });
}

#ifdef HSPMD_HAVE_DNNL
void bf16_native(const Gemm& g, const NDArray& a, const NDArray& b, NDArray& out) {
  std::unique_ptr<uint16_t[]> a_tmp, b_tmp;
  auto as_bf16 = [](const NDArray& x, std::unique_ptr<uint16_t[]>& tmp) -> const uint16_t* {
    if (x.dtype() == DType::BF16) return x.data<uint16_t>();
    tmp = scratch<uint16_t>(x.numel());
    round_to_bf16(x.data<float>(), tmp.get(), x.numel());
    return tmp.get();
  };
  const uint16_t* pa = as_bf16(a, a_tmp);
  const uint16_t* pb = as_bf16(b, b_tmp);
  dnnl_gemm(g, DType::BF16, pa, DType::BF16, pb, out.dtype(), out.raw_data());
}
#endif

bool float_dtype(DType t) { return t == DType::F32 || t == DType::BF16; }

}  // namespace

void cpu::matmul(const NDArray& a, const NDArray& b, bool trans_a, bool trans_b, NDArray& out,
                 GemmCompute compute) {
  cpu::require_contiguous("matmul", a);
  cpu::require_contiguous("matmul", b);
  cpu::require_contiguous("matmul", out);
  HSPMD_CHECK(a.ndim() >= 1 && b.ndim() == 2, "matmul: ranks ", a.ndim(), ", ", b.ndim());
  if (!float_dtype(a.dtype()) || !float_dtype(b.dtype()) || !float_dtype(out.dtype()))
    fail("[matmul] dtypes ", dtype_name(a.dtype()), ", ", dtype_name(b.dtype()), " -> ",
         dtype_name(out.dtype()), ": each must be f32 or bf16");
  const int64_t a_cols = a.dim(-1);
  const int64_t a_rows = a_cols == 0 ? 0 : a.numel() / a_cols;
  const int64_t m = trans_a ? a_cols : a_rows;
  const int64_t k = trans_a ? a_rows : a_cols;
  const int64_t n = trans_b ? b.dim(0) : b.dim(1);
  const int64_t kb = trans_b ? b.dim(1) : b.dim(0);
  HSPMD_CHECK(k == kb && out.numel() == m * n, "matmul: inner dims ", k, " vs ", kb);
  if (m == 0 || n == 0) return;
  if (k == 0) {
    cpu::kernels().fill(out, 0.0f);
    return;
  }
  const Gemm g{m, n, k, a_cols, b.dim(1), trans_a, trans_b};
  const bool bf16 = compute == GemmCompute::kBF16 || a.dtype() == DType::BF16 ||
                    b.dtype() == DType::BF16;
  if (!bf16) {
    into_out(out, m * n, [&](float* c) { f32_gemm(g, a.data<float>(), b.data<float>(), c); });
    return;
  }
#ifdef HSPMD_HAVE_DNNL
  if (!bf16_gemm_emulated()) {
    bf16_native(g, a, b, out);
    return;
  }
#endif
  bf16_emulated(g, a, b, out);
}

bool bf16_gemm_native() {
#ifdef HSPMD_HAVE_DNNL
  cap_onednn();
  static const bool native = isa_has(dnnl::get_effective_cpu_isa(),
                                     dnnl::cpu_isa::avx512_core_bf16) &&
                             cpu_isa() >= CpuIsa::kAvx512Bf16;
  return native;
#else
  return false;
#endif
}

void set_bf16_gemm_emulation(bool emulate) { bf16_emulation_flag().store(emulate); }

bool bf16_gemm_emulated() { return bf16_emulation_flag().load() || !bf16_gemm_native(); }

bool set_f32_gemm_backend(GemmF32Backend backend) {
#ifdef HSPMD_HAVE_DNNL
  f32_backend_flag().store(backend);
  return true;
#else
  f32_backend_flag().store(GemmF32Backend::kOpenBLAS);
  return backend == GemmF32Backend::kOpenBLAS;
#endif
}

GemmF32Backend f32_gemm_backend() { return f32_backend_flag().load(); }

void set_gemm_algorithm(GemmAlgorithm algorithm) { gemm_algorithm_flag().store(algorithm); }

GemmAlgorithm gemm_algorithm() { return gemm_algorithm_flag().load(); }

std::string gemm_isa_description() {
  std::string bf16;
#ifdef HSPMD_HAVE_DNNL
  cap_onednn();
  const dnnl::cpu_isa isa = dnnl::get_effective_cpu_isa();
  const std::string onednn = std::string("oneDNN ") + dnnl_isa_name(isa);
  if (!bf16_gemm_native()) {
    bf16 = onednn + ", OpenBLAS sgemm (bf16 emulated: no native bf16)";
  } else if (bf16_emulation_flag().load()) {
    bf16 = onednn + ", OpenBLAS sgemm (bf16 emulated: forced)";
  } else {
    bf16 = onednn + (isa_has(isa, dnnl::cpu_isa::avx512_core_amx) ? " (bf16 AMX)"
                                                                   : " (bf16 avx512_bf16)");
  }
#else
  bf16 = "OpenBLAS sgemm (bf16 emulated: built without oneDNN)";
#endif
  const bool f32_dnnl = f32_gemm_backend() == GemmF32Backend::kOneDNN;
  return bf16 + "; fp32 " + (f32_dnnl ? "oneDNN matmul" : "OpenBLAS sgemm") + "; CPU kernels " +
         cpu_isa_name(cpu::kernels().isa) + ", CPU level " + cpu_isa_description();
}

}  // namespace hspmd::kernels
