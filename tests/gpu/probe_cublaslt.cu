// probe_cublaslt: cuBLASLt matmuls in the row-major layout a framework uses,
// every epilogue the Linear/MLP layers need, checked against float64 CPU
// references, then timed (median of cudaEvent-timed repeats).
//
// Layout. The framework holds row-major tensors and computes
//   C[M,N] = op(A) * op(B),  A stored [M,K] (or [K,M] when ta),
//                            B stored [K,N] (or [N,K] when tb)
// nn.Linear forward is Y[M,N] = X[M,K] * W[N,K]^T (ta=false, tb=true).
// cuBLASLt is column-major: a row-major [r,c] buffer is a column-major [c,r]
// one, so the probe asks cuBLASLt for C^T[N,M] = op(B)^T * op(A)^T: its
// "A" operand is our B buffer (column-major rows = tb ? K : N, op T when tb),
// its "B" operand is our A buffer (rows = ta ? M : K, op T when ta), and D is
// column-major [N,M] with ld N. Consequences the backend must follow:
//  - BIAS/GELU_BIAS: the bias runs along cuBLASLt's rows = our N (per output
//    feature, as nn.Linear);
//  - the GELU aux (pre-activation) has D's layout, EPILOGUE_AUX_LD = N;
//  - BGRADB reduces our op(A) over K (bias length M): the weight gradient
//    dW[N_out,K_in] = dY^T X gives db = sum over tokens of dY;
//  - BGRADA reduces our op(B) over K (bias length N): dW^T = X^T dY.
#include "probe_common.cuh"

#include <cublasLt.h>

#include <map>
#include <random>
#include <string>

using namespace probe;

#define PROBE_LT(call)                                                             \
  do {                                                                             \
    cublasStatus_t s_ = (call);                                                    \
    if (s_ != CUBLAS_STATUS_SUCCESS)                                               \
      ::probe::fatal(#call, cublasLtGetStatusString(s_), __FILE__, __LINE__);     \
  } while (0)

namespace {

constexpr size_t kWorkspace = 32u << 20;  // 32 MiB

enum class Io { BF16, F32 };

bool bias_in(cublasLtEpilogue_t e) {
  return e == CUBLASLT_EPILOGUE_BIAS || e == CUBLASLT_EPILOGUE_GELU_BIAS ||
         e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
}
bool bgrad_out(cublasLtEpilogue_t e) {
  return e == CUBLASLT_EPILOGUE_BGRADA || e == CUBLASLT_EPILOGUE_BGRADB ||
         e == CUBLASLT_EPILOGUE_DGELU_BGRAD;
}
bool aux_out(cublasLtEpilogue_t e) { return e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS; }
bool aux_in(cublasLtEpilogue_t e) {
  return e == CUBLASLT_EPILOGUE_DGELU || e == CUBLASLT_EPILOGUE_DGELU_BGRAD;
}
bool gelu_fwd(cublasLtEpilogue_t e) {
  return e == CUBLASLT_EPILOGUE_GELU || e == CUBLASLT_EPILOGUE_GELU_BIAS ||
         e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
}

struct Spec {
  std::string name;
  Io io;
  int64_t M, N, K;
  bool ta, tb;
  cublasLtEpilogue_t epi;
  bool optional;  // UNSUPPORTED instead of FAIL when no algorithm is offered
  bool timed;     // timing size: sampled check, median time, TFLOP/s
};

// Bias (or bias gradient) length in our row-major terms.
int64_t bias_len(const Spec& s) { return s.epi == CUBLASLT_EPILOGUE_BGRADB ? s.M : s.N; }

struct Lt {
  cublasLtHandle_t h = nullptr;
  void* ws = nullptr;
  cudaStream_t stream = nullptr;
};

// One planned matmul: descriptors plus the heuristic's first algorithm.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulAlgo_t algo{};
  int returned = 0;
  std::string why;  // reason when no algorithm
  ~Plan() {
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

bool plan(const Lt& lt, const Spec& s, const void* bias, void* aux, Plan& p) {
  cudaDataType_t t = s.io == Io::BF16 ? CUDA_R_16BF : CUDA_R_32F;
  // CUBLAS_COMPUTE_32F: fp32 accumulation, and for fp32 operands no TF32.
  PROBE_LT(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t opa = s.tb ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt A = our B
  cublasOperation_t opb = s.ta ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt B = our A
  PROBE_LT(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa));
  PROBE_LT(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb));
  PROBE_LT(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &s.epi, sizeof s.epi));
  if (bias_in(s.epi) || bgrad_out(s.epi))
    PROBE_LT(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
  if (aux_in(s.epi) || aux_out(s.epi)) {
    int64_t ld = s.N;
    PROBE_LT(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux));
    PROBE_LT(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof ld));
  }
  uint64_t ar = s.tb ? s.K : s.N, ac = s.tb ? s.N : s.K;
  uint64_t br = s.ta ? s.M : s.K, bc = s.ta ? s.K : s.M;
  PROBE_LT(cublasLtMatrixLayoutCreate(&p.la, t, ar, ac, static_cast<int64_t>(ar)));
  PROBE_LT(cublasLtMatrixLayoutCreate(&p.lb, t, br, bc, static_cast<int64_t>(br)));
  PROBE_LT(cublasLtMatrixLayoutCreate(&p.lc, t, s.N, s.M, s.N));

  cublasLtMatmulPreference_t pref = nullptr;
  PROBE_LT(cublasLtMatmulPreferenceCreate(&pref));
  size_t ws = kWorkspace;
  PROBE_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
  cublasLtMatmulHeuristicResult_t res[8];
  cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt.h, p.desc, p.la, p.lb, p.lc, p.lc, pref, 8,
                                                     res, &p.returned);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || p.returned == 0) {
    p.why = std::string("cublasLtMatmulAlgoGetHeuristic: ") +
            (st != CUBLAS_STATUS_SUCCESS ? cublasLtGetStatusString(st) : "0 algorithms");
    return false;
  }
  p.algo = res[0].algo;
  return true;
}

void run(const Lt& lt, const Plan& p, const void* A, const void* B, void* C) {
  const float alpha = 1.0f, beta = 0.0f;
  cublasStatus_t st = cublasLtMatmul(lt.h, p.desc, &alpha, B, p.la, A, p.lb, &beta, C, p.lc, C, p.lc,
                                     &p.algo, lt.ws, kWorkspace, lt.stream);
  if (st != CUBLAS_STATUS_SUCCESS) fatal("cublasLtMatmul", cublasLtGetStatusString(st), __FILE__, __LINE__);
  PROBE_LAUNCH("cublasLtMatmul");
}

// Row-major bf16 bias + tanh-GELU in place, 8 elements per thread: the
// unfused baseline the epilogue replaces.
__global__ void bias_gelu_kernel(__nv_bfloat16* y, const __nv_bfloat16* b, int64_t rows, int64_t cols) {
  int64_t n8 = rows * cols / 8;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n8;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t col = (i * 8) % cols;
    uint4 v = reinterpret_cast<uint4*>(y)[i];
    uint4 bv = *reinterpret_cast<const uint4*>(b + col);
    __nv_bfloat162* pv = reinterpret_cast<__nv_bfloat162*>(&v);
    const __nv_bfloat162* pb = reinterpret_cast<const __nv_bfloat162*>(&bv);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float2 x = __bfloat1622float2(pv[j]);
      float2 c = __bfloat1622float2(pb[j]);
      x.x += c.x;
      x.y += c.y;
      const float k = 0.7978845608028654f;
      x.x = 0.5f * x.x * (1.f + tanhf(k * (x.x + 0.044715f * x.x * x.x * x.x)));
      x.y = 0.5f * x.y * (1.f + tanhf(k * (x.y + 0.044715f * x.y * x.y * x.y)));
      pv[j] = __float22bfloat162_rn(x);
    }
    reinterpret_cast<uint4*>(y)[i] = v;
  }
}

// ------------------------------------------------------------ buffers --
struct Buffers {
  void *A = nullptr, *B = nullptr, *C = nullptr, *bias = nullptr, *aux = nullptr;
  size_t es = 2;
  ~Buffers() {
    for (void* p : {A, B, C, bias, aux})
      if (p) cudaFree(p);
  }
};

void fill_any(void* p, size_t n, Io io, uint64_t seed, float scale) {
  if (io == Io::BF16)
    fill(static_cast<__nv_bfloat16*>(p), n, seed, scale);
  else
    fill(static_cast<float*>(p), n, seed, scale);
}
std::vector<double> host_any(const void* p, size_t n, Io io) {
  return io == Io::BF16 ? to_host(static_cast<const __nv_bfloat16*>(p), n)
                        : to_host(static_cast<const float*>(p), n);
}
// Elements [off, off + count) with stride (in elements) -> host doubles.
std::vector<double> host_strided(const void* p, size_t off, size_t count, size_t stride, Io io) {
  size_t es = io == Io::BF16 ? 2 : 4;
  std::vector<unsigned char> raw(count * es);
  const char* src = static_cast<const char*>(p) + off * es;
  if (stride == 1)
    PROBE_CUDA(cudaMemcpy(raw.data(), src, count * es, cudaMemcpyDeviceToHost));
  else
    PROBE_CUDA(cudaMemcpy2D(raw.data(), es, src, stride * es, es, count, cudaMemcpyDeviceToHost));
  std::vector<double> r(count);
  for (size_t i = 0; i < count; ++i) {
    if (io == Io::BF16) {
      uint16_t b;
      std::memcpy(&b, &raw[i * 2], 2);
      r[i] = bf_bits2f(b);
    } else {
      float f;
      std::memcpy(&f, &raw[i * 4], 4);
      r[i] = f;
    }
  }
  return r;
}

// A device buffer copied to the host as is; at() converts one element.
struct HostRaw {
  std::vector<unsigned char> raw;
  Io io;
  HostRaw(const void* p, size_t n, Io io_) : raw(n * (io_ == Io::BF16 ? 2 : 4)), io(io_) {
    PROBE_CUDA(cudaMemcpy(raw.data(), p, raw.size(), cudaMemcpyDeviceToHost));
  }
  double at(size_t i) const {
    if (io == Io::BF16) {
      uint16_t b;
      std::memcpy(&b, &raw[i * 2], 2);
      return bf_bits2f(b);
    }
    float f;
    std::memcpy(&f, &raw[i * 4], 4);
    return f;
  }
};

double bound_for(const Spec& s) {
  if (s.io == Io::BF16) return 1e-2;
  if (gelu_fwd(s.epi)) return 1e-3;  // the epilogue's GELU may be an approximation
  return s.K <= 1024 ? 1e-5 : 1e-4;
}

const char* epi_name(cublasLtEpilogue_t e) {
  switch (e) {
    case CUBLASLT_EPILOGUE_DEFAULT: return "DEFAULT";
    case CUBLASLT_EPILOGUE_BIAS: return "BIAS";
    case CUBLASLT_EPILOGUE_GELU: return "GELU";
    case CUBLASLT_EPILOGUE_GELU_BIAS: return "GELU_BIAS";
    case CUBLASLT_EPILOGUE_GELU_AUX_BIAS: return "GELU_AUX_BIAS";
    case CUBLASLT_EPILOGUE_DGELU: return "DGELU";
    case CUBLASLT_EPILOGUE_DGELU_BGRAD: return "DGELU_BGRAD";
    case CUBLASLT_EPILOGUE_BGRADA: return "BGRADA";
    case CUBLASLT_EPILOGUE_BGRADB: return "BGRADB";
    default: return "?";
  }
}

// Reference of one output element from the pre-epilogue dot product.
struct Ref {
  double out_tanh, out_erf, aux;
};
Ref epilogue_ref(const Spec& s, double dot, double bias, double aux) {
  double pre = dot + (bias_in(s.epi) ? bias : 0.0);
  Ref r{pre, pre, pre};
  if (gelu_fwd(s.epi)) {
    r.out_tanh = gelu_tanh(pre);
    r.out_erf = gelu_erf(pre);
  } else if (aux_in(s.epi)) {
    r.out_tanh = dot * dgelu_tanh(aux);
    r.out_erf = dot * dgelu_erf(aux);
  }
  return r;
}

int g_seed = 1;

// One case: plan, poison, run, check (full or sampled), time when timed.
void run_case(const Lt& lt, const Spec& s) {
  Buffers b;
  b.es = s.io == Io::BF16 ? 2 : 4;
  const size_t nA = s.M * s.K, nB = s.K * s.N, nC = s.M * s.N;
  const int64_t blen = bias_len(s);
  PROBE_CUDA(cudaMalloc(&b.A, nA * b.es));
  PROBE_CUDA(cudaMalloc(&b.B, nB * b.es));
  PROBE_CUDA(cudaMalloc(&b.C, nC * b.es));
  if (bias_in(s.epi) || bgrad_out(s.epi)) PROBE_CUDA(cudaMalloc(&b.bias, blen * b.es));
  if (aux_in(s.epi) || aux_out(s.epi)) PROBE_CUDA(cudaMalloc(&b.aux, nC * b.es));
  const uint64_t seed = 1000 * (g_seed++);
  // Weights scaled 1/sqrt(K): pre-activations of order 1, where GELU bends.
  fill_any(b.A, nA, s.io, seed + 1, 1.0f);
  fill_any(b.B, nB, s.io, seed + 2, 1.0f / std::sqrt(static_cast<float>(s.K)));
  if (bias_in(s.epi)) fill_any(b.bias, blen, s.io, seed + 3, 0.5f);
  if (aux_in(s.epi)) fill_any(b.aux, nC, s.io, seed + 4, 2.0f);
  PROBE_CUDA(cudaDeviceSynchronize());

  char shape[96];
  std::snprintf(shape, sizeof shape, "M=%lld N=%lld K=%lld", (long long)s.M, (long long)s.N, (long long)s.K);
  Plan p;
  if (!plan(lt, s, b.bias, b.aux, p)) {
    result(s.name.c_str(), s.optional ? "UNSUPPORTED" : "FAIL", "%s epi=%s msg=\"%s\"", shape,
           epi_name(s.epi), p.why.c_str());
    return;
  }
  poison(b.C, nC * b.es, lt.stream);
  if (bgrad_out(s.epi)) poison(b.bias, blen * b.es, lt.stream);
  if (aux_out(s.epi)) poison(b.aux, nC * b.es, lt.stream);

  double ms = 0;
  if (s.timed) {
    ms = median_ms(lt.stream, 20, 50, [&] { run(lt, p, b.A, b.B, b.C); });
  } else {
    run(lt, p, b.A, b.B, b.C);
  }
  PROBE_CUDA(cudaStreamSynchronize(lt.stream));

  // Which (m, n) to check: all of them, or 256 random ones at timing sizes.
  std::vector<std::pair<int64_t, int64_t>> idx;
  if (s.timed) {
    std::mt19937_64 rng(seed);
    for (int i = 0; i < 256; ++i) idx.emplace_back(rng() % s.M, rng() % s.N);
  } else {
    for (int64_t m = 0; m < s.M; ++m)
      for (int64_t n = 0; n < s.N; ++n) idx.emplace_back(m, n);
  }
  // The operands come to the host whole (raw, converted per element when
  // used): strided device-to-host copies of single columns are slow.
  const HostRaw hA(b.A, nA, s.io), hB(b.B, nB, s.io);
  std::vector<double> hC, hbias, haux_out, haux_in;
  if (!s.timed) {
    hC = host_any(b.C, nC, s.io);
    if (aux_in(s.epi)) haux_in = host_any(b.aux, nC, s.io);
    if (aux_out(s.epi)) haux_out = host_any(b.aux, nC, s.io);
  }
  if (b.bias) hbias = host_any(b.bias, blen, s.io);  // input bias, or the bias gradient
  auto dev_elem = [&](const void* ptr, size_t e) { return host_strided(ptr, e, 1, 1, s.io)[0]; };

  // Rows of op(A) and columns of op(B), as doubles, cached.
  std::map<int64_t, std::vector<double>> rowA, colB;
  auto opA_row = [&](int64_t m) -> const std::vector<double>& {
    auto it = rowA.find(m);
    if (it != rowA.end()) return it->second;
    std::vector<double> r(s.K);
    for (int64_t k = 0; k < s.K; ++k) r[k] = hA.at(s.ta ? k * s.M + m : m * s.K + k);
    return rowA[m] = std::move(r);
  };
  auto opB_col = [&](int64_t n) -> const std::vector<double>& {
    auto it = colB.find(n);
    if (it != colB.end()) return it->second;
    std::vector<double> r(s.K);
    for (int64_t k = 0; k < s.K; ++k) r[k] = hB.at(s.tb ? n * s.K + k : k * s.N + n);
    return colB[n] = std::move(r);
  };

  std::vector<double> out, ref_t, ref_e, aux_got, aux_ref;
  std::vector<double> bg_ref(bgrad_out(s.epi) ? blen : 0, 0.0);
  for (auto [m, n] : idx) {
    const auto& ar = opA_row(m);
    const auto& bc = opB_col(n);
    double dot = 0;
    for (int64_t k = 0; k < s.K; ++k) dot += ar[k] * bc[k];
    const size_t e = m * s.N + n;
    double bias = bias_in(s.epi) ? hbias[n] : 0.0;
    double auxv = !aux_in(s.epi) ? 0.0 : s.timed ? dev_elem(b.aux, e) : haux_in[e];
    Ref r = epilogue_ref(s, dot, bias, auxv);
    ref_t.push_back(r.out_tanh);
    ref_e.push_back(r.out_erf);
    out.push_back(s.timed ? dev_elem(b.C, e) : hC[e]);
    if (aux_out(s.epi)) {
      aux_ref.push_back(r.aux);
      aux_got.push_back(s.timed ? dev_elem(b.aux, e) : haux_out[e]);
    }
    if (s.epi == CUBLASLT_EPILOGUE_DGELU_BGRAD) bg_ref[n] += r.out_tanh;
  }
  // Bias gradients: every entry at correctness sizes, the sampled rows at
  // timing sizes (BGRADB; the other two need whole columns).
  std::vector<double> bg_got, bg_want;
  if (s.epi == CUBLASLT_EPILOGUE_BGRADB) {
    std::vector<int64_t> rows;
    if (s.timed)
      for (auto [m, n] : idx) rows.push_back(m);
    else
      for (int64_t m = 0; m < s.M; ++m) rows.push_back(m);
    for (int64_t m : rows) {
      const auto& ar = opA_row(m);
      double sum = 0;
      for (int64_t k = 0; k < s.K; ++k) sum += ar[k];
      bg_want.push_back(sum);
      bg_got.push_back(s.timed ? dev_elem(b.bias, m) : hbias[m]);
    }
  } else if (bgrad_out(s.epi) && !s.timed) {
    if (s.epi == CUBLASLT_EPILOGUE_BGRADA)
      for (int64_t n = 0; n < s.N; ++n) {
        const auto& bc = opB_col(n);
        for (int64_t k = 0; k < s.K; ++k) bg_ref[n] += bc[k];
      }
    bg_want = bg_ref;
    bg_got = hbias;
  }

  const double bound = bound_for(s);
  double et = rel_err(out, ref_t), ee = rel_err(out, ref_e);
  bool gelu_case = gelu_fwd(s.epi) || aux_in(s.epi);
  double err = gelu_case ? std::min(et, ee) : et;
  bool ok = within(err, bound);
  std::string extra;
  char buf[160];
  if (gelu_case) {
    std::snprintf(buf, sizeof buf, " gelu=%s err_tanh=%.2e err_erf=%.2e", et <= ee ? "tanh" : "erf", et, ee);
    extra += buf;
  }
  if (aux_out(s.epi)) {
    double ea = rel_err(aux_got, aux_ref);
    ok = ok && within(ea, bound);
    std::snprintf(buf, sizeof buf, " aux_err=%.2e", ea);
    extra += buf;
  }
  if (!bg_want.empty()) {
    double eb = rel_err(bg_got, bg_want);
    ok = ok && within(eb, bound);
    std::snprintf(buf, sizeof buf, " bgrad_err=%.2e", eb);
    extra += buf;
  }
  if (s.timed) {
    double tflops = 2.0 * s.M * s.N * s.K / (ms * 1e-3) / 1e12;
    result(s.name.c_str(), pass_fail(ok), "%s epi=%s rel_err=%.2e%s median_ms=%.4f tflops=%.1f", shape,
           epi_name(s.epi), err, extra.c_str(), ms, tflops);
  } else {
    result(s.name.c_str(), pass_fail(ok), "%s epi=%s rel_err=%.2e%s bound=%.0e", shape, epi_name(s.epi), err,
           extra.c_str(), bound);
  }
}

// matmul (DEFAULT) followed by a separate bias+GELU kernel, against the
// fused GELU_BIAS epilogue, at the MLP shape; both checked on samples.
void run_unfused_vs_fused(const Lt& lt, int64_t M, int64_t N, int64_t K) {
  Spec sd{"mlp_unfused_bias_gelu", Io::BF16, M, N, K, false, true, CUBLASLT_EPILOGUE_DEFAULT, false, true};
  Spec sf = sd;
  sf.name = "mlp_fused_gelu_bias";
  sf.epi = CUBLASLT_EPILOGUE_GELU_BIAS;
  Buffers b;
  PROBE_CUDA(cudaMalloc(&b.A, M * K * 2));
  PROBE_CUDA(cudaMalloc(&b.B, N * K * 2));
  PROBE_CUDA(cudaMalloc(&b.C, M * N * 2));
  PROBE_CUDA(cudaMalloc(&b.bias, N * 2));
  void* C2 = nullptr;
  PROBE_CUDA(cudaMalloc(&C2, M * N * 2));
  fill_any(b.A, M * K, Io::BF16, 77001, 1.0f);
  fill_any(b.B, N * K, Io::BF16, 77002, 1.0f / std::sqrt(static_cast<float>(K)));
  fill_any(b.bias, N, Io::BF16, 77003, 0.5f);
  PROBE_CUDA(cudaDeviceSynchronize());
  Plan pd, pf;
  if (!plan(lt, sd, nullptr, nullptr, pd) || !plan(lt, sf, b.bias, nullptr, pf)) {
    result("mlp_unfused_vs_fused", "FAIL", "msg=\"%s%s\"", pd.why.c_str(), pf.why.c_str());
    cudaFree(C2);
    return;
  }
  auto* C = static_cast<__nv_bfloat16*>(b.C);
  auto* bias = static_cast<const __nv_bfloat16*>(b.bias);
  poison(b.C, M * N * 2, lt.stream);
  poison(C2, M * N * 2, lt.stream);
  double ms_u = median_ms(lt.stream, 20, 50, [&] {
    run(lt, pd, b.A, b.B, b.C);
    bias_gelu_kernel<<<132 * 8, 256, 0, lt.stream>>>(C, bias, M, N);
    PROBE_LAUNCH("bias_gelu_kernel");
  });
  double ms_f = median_ms(lt.stream, 20, 50, [&] { run(lt, pf, b.A, b.B, C2); });
  PROBE_CUDA(cudaStreamSynchronize(lt.stream));

  std::mt19937_64 rng(77);
  std::vector<double> ou, of, rt, re;
  std::vector<double> hbias = host_any(b.bias, N, Io::BF16);
  for (int i = 0; i < 256; ++i) {
    int64_t m = rng() % M, n = rng() % N;
    auto xr = host_strided(b.A, m * K, K, 1, Io::BF16);
    auto wr = host_strided(b.B, n * K, K, 1, Io::BF16);
    double dot = 0;
    for (int64_t k = 0; k < K; ++k) dot += xr[k] * wr[k];
    // (The unfused path rounds the matmul output to bf16 before the bias:
    // within the bf16 bound.)
    rt.push_back(gelu_tanh(dot + hbias[n]));
    re.push_back(gelu_erf(dot + hbias[n]));
    ou.push_back(host_strided(b.C, m * N + n, 1, 1, Io::BF16)[0]);
    of.push_back(host_strided(C2, m * N + n, 1, 1, Io::BF16)[0]);
  }
  double eu = rel_err(ou, rt);
  double ef = std::min(rel_err(of, rt), rel_err(of, re));
  double fl = 2.0 * M * N * K;
  char shape[96];
  std::snprintf(shape, sizeof shape, "M=%lld N=%lld K=%lld", (long long)M, (long long)N, (long long)K);
  result("mlp_unfused_bias_gelu", pass_fail(within(eu, 1e-2)), "%s rel_err=%.2e median_ms=%.4f tflops=%.1f",
         shape, eu, ms_u, fl / (ms_u * 1e-3) / 1e12);
  result("mlp_fused_gelu_bias", pass_fail(within(ef, 1e-2)), "%s rel_err=%.2e median_ms=%.4f tflops=%.1f",
         shape, ef, ms_f, fl / (ms_f * 1e-3) / 1e12);
  result("mlp_fusion_speedup", "INFO", "unfused_ms=%.4f fused_ms=%.4f speedup=%.3f", ms_u, ms_f, ms_u / ms_f);
  cudaFree(C2);
}

}  // namespace

int main() {
  require_device("cublaslt");
  Lt lt;
  PROBE_LT(cublasLtCreate(&lt.h));
  PROBE_CUDA(cudaStreamCreateWithFlags(&lt.stream, cudaStreamNonBlocking));
  PROBE_CUDA(cudaMalloc(&lt.ws, kWorkspace));
  std::printf("INFO probe=cublaslt cublasLt_version=%zu workspace_mib=%zu\n", cublasLtGetVersion(),
              kWorkspace >> 20);

  const auto D = CUBLASLT_EPILOGUE_DEFAULT;
  // Correctness: odd shapes that are still multiples of 8.
  const int64_t M = 136, N = 264, K = 72;
  std::vector<Spec> specs = {
      {"bf16_fwd", Io::BF16, M, N, K, false, true, D, false, false},
      {"bf16_fwd_bias", Io::BF16, M, N, K, false, true, CUBLASLT_EPILOGUE_BIAS, false, false},
      {"bf16_fwd_gelu", Io::BF16, M, N, K, false, true, CUBLASLT_EPILOGUE_GELU, false, false},
      {"bf16_fwd_gelu_bias", Io::BF16, M, N, K, false, true, CUBLASLT_EPILOGUE_GELU_BIAS, false, false},
      {"bf16_fwd_gelu_aux_bias", Io::BF16, M, N, K, false, true, CUBLASLT_EPILOGUE_GELU_AUX_BIAS, false, false},
      // dX[M,K] = dY[M,N] W[N,K]
      {"bf16_dgrad", Io::BF16, M, K, N, false, false, D, false, false},
      // dH[M,N] = (dY2[M,K] W2[K,N]) * gelu'(aux[M,N])
      {"bf16_dgelu", Io::BF16, M, N, K, false, false, CUBLASLT_EPILOGUE_DGELU, false, false},
      {"bf16_dgelu_bgrad", Io::BF16, M, N, K, false, false, CUBLASLT_EPILOGUE_DGELU_BGRAD, true, false},
      // dW[N,K] = dY[M,N]^T X[M,K] (tokens M are the reduction)
      {"bf16_wgrad", Io::BF16, N, K, M, true, false, D, false, false},
      {"bf16_wgrad_bgradb", Io::BF16, N, K, M, true, false, CUBLASLT_EPILOGUE_BGRADB, true, false},
      // dW^T[K,N] = X^T dY
      {"bf16_wgradT_bgrada", Io::BF16, K, N, M, true, false, CUBLASLT_EPILOGUE_BGRADA, true, false},
      {"f32_fwd", Io::F32, M, N, K, false, true, D, false, false},
      {"f32_fwd_bias", Io::F32, M, N, K, false, true, CUBLASLT_EPILOGUE_BIAS, false, false},
      {"f32_fwd_gelu_bias", Io::F32, M, N, K, false, true, CUBLASLT_EPILOGUE_GELU_BIAS, true, false},
      {"f32_dgrad", Io::F32, M, K, N, false, false, D, false, false},
      {"f32_wgrad", Io::F32, N, K, M, true, false, D, false, false},
      // Timing sizes.
      {"bf16_8192cube", Io::BF16, 8192, 8192, 8192, false, true, D, false, true},
      {"mlp_fwd", Io::BF16, 4096, 11008, 4096, false, true, D, false, true},
      {"mlp_fwd_gelu_aux_bias", Io::BF16, 4096, 11008, 4096, false, true, CUBLASLT_EPILOGUE_GELU_AUX_BIAS, false,
       true},
      {"mlp_dgrad", Io::BF16, 4096, 4096, 11008, false, false, D, false, true},
      {"mlp_wgrad_bgradb", Io::BF16, 11008, 4096, 4096, true, false, CUBLASLT_EPILOGUE_BGRADB, true, true},
      {"f32_4096cube", Io::F32, 4096, 4096, 4096, false, true, D, false, true},
  };
  for (const auto& s : specs) run_case(lt, s);
  run_unfused_vs_fused(lt, 4096, 11008, 4096);

  PROBE_CUDA(cudaFree(lt.ws));
  PROBE_CUDA(cudaStreamDestroy(lt.stream));
  PROBE_LT(cublasLtDestroy(lt.h));
  return exit_code();
}
