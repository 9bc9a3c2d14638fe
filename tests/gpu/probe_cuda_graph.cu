// probe_cuda_graph: a training-step-like sequence on a non-default stream
// (small elementwise kernels, a cuBLASLt GEMM, an in-place "optimizer"
// update, a device-to-device copy feeding the next step), run eagerly N times
// and, from the same starting state, captured once into a CUDA graph and
// replayed N times. The two final states must be bitwise equal; the probe
// reports the median time per step of each and the speedup.
//
// Capture rules the backend has to follow (all exercised here):
//  - everything runs on one non-default stream (cudaStreamNonBlocking); no
//    synchronizing call (cudaMalloc, cudaMemcpy, cudaStreamSynchronize) while
//    capturing;
//  - cuBLASLt: the algorithm is chosen (heuristic) before the capture and the
//    workspace is passed explicitly, so nothing allocates inside the graph.
//    With the classic cuBLAS API the equivalent is cublasSetWorkspace() on the
//    handle before capturing (else cuBLAS may allocate during capture);
//  - kernel arguments and pointers are frozen at capture: replays reuse the
//    same buffers, so state lives in fixed device buffers.
#include "probe_common.cuh"

#include <cublasLt.h>

#include <chrono>

using namespace probe;

#define PROBE_LT(call)                                                             \
  do {                                                                             \
    cublasStatus_t s_ = (call);                                                    \
    if (s_ != CUBLAS_STATUS_SUCCESS)                                               \
      ::probe::fatal(#call, cublasLtGetStatusString(s_), __FILE__, __LINE__);     \
  } while (0)

namespace {

constexpr int M = 256, H = 512;  // tokens, hidden (square weight)
constexpr size_t kWorkspace = 4u << 20;

__global__ void k_scale(const float* x, float* h, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) h[i] = x[i] * 0.5f + 0.01f;
}
__global__ void k_bias_gelu(float* y, const float* b, int rows, int cols) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < rows * cols) {
    float v = y[i] + b[i % cols];
    y[i] = 0.5f * v * (1.f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v)));
  }
}
__global__ void k_softsign(float* y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = y[i] / (1.f + fabsf(y[i]));
}
// W[n, k] = 0.999 W[n, k] + 1e-3 y[0, n] h[0, k]: a rank-1 "gradient" step.
__global__ void k_update(float* W, const float* y, const float* h, int n_out, int k_in) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n_out * k_in) {
    int n = i / k_in, k = i % k_in;
    W[i] = 0.999f * W[i] + 1e-3f * y[n] * h[k];
  }
}

struct Ctx {
  cudaStream_t s;
  cublasLtHandle_t lt;
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t la, lb, lc;
  cublasLtMatmulAlgo_t algo;
  void* ws;
  float *x, *W, *b, *h, *y;
};

// One step. No synchronizing calls: it is also what gets captured.
void step(const Ctx& c) {
  const int n = M * H, tpb = 256, blocks = (n + tpb - 1) / tpb;
  k_scale<<<blocks, tpb, 0, c.s>>>(c.x, c.h, n);
  PROBE_LAUNCH("k_scale");
  const float alpha = 1.f, beta = 0.f;
  // Row-major y[M,H] = h[M,H] W[H,H]^T, as column-major y^T = W h^T.
  cublasStatus_t st = cublasLtMatmul(c.lt, c.desc, &alpha, c.W, c.la, c.h, c.lb, &beta, c.y, c.lc, c.y, c.lc,
                                     &c.algo, c.ws, kWorkspace, c.s);
  if (st != CUBLAS_STATUS_SUCCESS) fatal("cublasLtMatmul", cublasLtGetStatusString(st), __FILE__, __LINE__);
  PROBE_LAUNCH("cublasLtMatmul");
  k_bias_gelu<<<blocks, tpb, 0, c.s>>>(c.y, c.b, M, H);
  PROBE_LAUNCH("k_bias_gelu");
  k_softsign<<<blocks, tpb, 0, c.s>>>(c.y, n);
  PROBE_LAUNCH("k_softsign");
  k_update<<<(H * H + tpb - 1) / tpb, tpb, 0, c.s>>>(c.W, c.y, c.h, H, H);
  PROBE_LAUNCH("k_update");
  PROBE_CUDA(cudaMemcpyAsync(c.x, c.y, n * sizeof(float), cudaMemcpyDeviceToDevice, c.s));
}

}  // namespace

int main() {
  require_device("cuda_graph");
  Ctx c{};
  PROBE_CUDA(cudaStreamCreateWithFlags(&c.s, cudaStreamNonBlocking));
  PROBE_LT(cublasLtCreate(&c.lt));
  PROBE_CUDA(cudaMalloc(&c.ws, kWorkspace));
  for (float** p : {&c.x, &c.h, &c.y}) PROBE_CUDA(cudaMalloc(p, M * H * sizeof(float)));
  PROBE_CUDA(cudaMalloc(&c.W, H * H * sizeof(float)));
  PROBE_CUDA(cudaMalloc(&c.b, H * sizeof(float)));
  float *x0, *W0;
  PROBE_CUDA(cudaMalloc(&x0, M * H * sizeof(float)));
  PROBE_CUDA(cudaMalloc(&W0, H * H * sizeof(float)));
  fill(x0, M * H, 31, 1.0f);
  fill(W0, H * H, 32, 1.0f / std::sqrt(static_cast<float>(H)));
  fill(c.b, H, 33, 0.1f);
  PROBE_CUDA(cudaDeviceSynchronize());  // fills ran on the legacy stream; c.s does not wait for it

  // fp32 GEMM (CUBLAS_COMPUTE_32F), algorithm chosen once, before any capture.
  PROBE_LT(cublasLtMatmulDescCreate(&c.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t opT = CUBLAS_OP_T, opN = CUBLAS_OP_N;
  PROBE_LT(cublasLtMatmulDescSetAttribute(c.desc, CUBLASLT_MATMUL_DESC_TRANSA, &opT, sizeof opT));
  PROBE_LT(cublasLtMatmulDescSetAttribute(c.desc, CUBLASLT_MATMUL_DESC_TRANSB, &opN, sizeof opN));
  PROBE_LT(cublasLtMatrixLayoutCreate(&c.la, CUDA_R_32F, H, H, H));
  PROBE_LT(cublasLtMatrixLayoutCreate(&c.lb, CUDA_R_32F, H, M, H));
  PROBE_LT(cublasLtMatrixLayoutCreate(&c.lc, CUDA_R_32F, H, M, H));
  cublasLtMatmulPreference_t pref;
  PROBE_LT(cublasLtMatmulPreferenceCreate(&pref));
  size_t ws = kWorkspace;
  PROBE_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
  cublasLtMatmulHeuristicResult_t res{};
  int returned = 0;
  PROBE_LT(cublasLtMatmulAlgoGetHeuristic(c.lt, c.desc, c.la, c.lb, c.lc, c.lc, pref, 1, &res, &returned));
  if (returned == 0) fatal("cublasLtMatmulAlgoGetHeuristic", "0 algorithms", __FILE__, __LINE__);
  c.algo = res.algo;
  PROBE_LT(cublasLtMatmulPreferenceDestroy(pref));

  const int N = 100;
  auto reset = [&] {
    PROBE_CUDA(cudaMemcpyAsync(c.x, x0, M * H * sizeof(float), cudaMemcpyDeviceToDevice, c.s));
    PROBE_CUDA(cudaMemcpyAsync(c.W, W0, H * H * sizeof(float), cudaMemcpyDeviceToDevice, c.s));
    poison(c.h, M * H * sizeof(float), c.s);
    poison(c.y, M * H * sizeof(float), c.s);
    PROBE_CUDA(cudaStreamSynchronize(c.s));
  };
  auto snapshot = [&] {
    std::vector<float> v(M * H + H * H);
    PROBE_CUDA(cudaMemcpy(v.data(), c.x, M * H * sizeof(float), cudaMemcpyDeviceToHost));
    PROBE_CUDA(cudaMemcpy(v.data() + M * H, c.W, H * H * sizeof(float), cudaMemcpyDeviceToHost));
    return v;
  };

  // Eager: N steps.
  reset();
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < N; ++i) step(c);
  PROBE_CUDA(cudaStreamSynchronize(c.s));
  double eager_wall = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / N;
  std::vector<float> eager = snapshot();

  // Graph: capture one step, replay N times from the same start.
  reset();
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  PROBE_CUDA(cudaStreamBeginCapture(c.s, cudaStreamCaptureModeThreadLocal));
  step(c);
  PROBE_CUDA(cudaStreamEndCapture(c.s, &graph));
  size_t nodes = 0;
  PROBE_CUDA(cudaGraphGetNodes(graph, nullptr, &nodes));
  auto ti = std::chrono::steady_clock::now();
  PROBE_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  double inst_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - ti).count();
  PROBE_CUDA(cudaGraphUpload(exec, c.s));
  PROBE_CUDA(cudaStreamSynchronize(c.s));
  t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < N; ++i) PROBE_CUDA(cudaGraphLaunch(exec, c.s));
  PROBE_CUDA(cudaStreamSynchronize(c.s));
  double graph_wall = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / N;
  std::vector<float> replay = snapshot();

  bool finite = true, changed = false;
  std::vector<float> start(M * H + H * H);
  PROBE_CUDA(cudaMemcpy(start.data(), x0, M * H * sizeof(float), cudaMemcpyDeviceToHost));
  PROBE_CUDA(cudaMemcpy(start.data() + M * H, W0, H * H * sizeof(float), cudaMemcpyDeviceToHost));
  size_t diff = 0;
  for (size_t i = 0; i < eager.size(); ++i) {
    if (!std::isfinite(eager[i]) || !std::isfinite(replay[i])) finite = false;
    if (std::memcmp(&eager[i], &replay[i], 4) != 0) ++diff;
    if (eager[i] != start[i]) changed = true;
  }
  bool ok = finite && changed && diff == 0;
  result("eager_vs_graph_bitwise", pass_fail(ok), "steps=%d M=%d H=%d nodes=%zu differing=%zu finite=%d changed=%d", N,
         M, H, nodes, diff, finite ? 1 : 0, changed ? 1 : 0);

  // Timing: median over 30 blocks of 10 steps (after 5 warm-up blocks), per step.
  const int blk = 10;
  double eager_ms = median_ms(c.s, 5, 30, [&] {
                      for (int i = 0; i < blk; ++i) step(c);
                    }) / blk;
  double graph_ms = median_ms(c.s, 5, 30, [&] {
                      for (int i = 0; i < blk; ++i) PROBE_CUDA(cudaGraphLaunch(exec, c.s));
                    }) / blk;
  result("step_time", "INFO", "eager_ms=%.4f graph_ms=%.4f speedup=%.2f wall_eager_ms=%.4f wall_graph_ms=%.4f inst_ms=%.2f",
         eager_ms, graph_ms, eager_ms / graph_ms, eager_wall, graph_wall, inst_ms);

  PROBE_CUDA(cudaGraphExecDestroy(exec));
  PROBE_CUDA(cudaGraphDestroy(graph));
  cublasLtMatrixLayoutDestroy(c.la);
  cublasLtMatrixLayoutDestroy(c.lb);
  cublasLtMatrixLayoutDestroy(c.lc);
  cublasLtMatmulDescDestroy(c.desc);
  PROBE_LT(cublasLtDestroy(c.lt));
  for (void* p : {(void*)c.x, (void*)c.W, (void*)c.b, (void*)c.h, (void*)c.y, (void*)x0, (void*)W0, c.ws})
    PROBE_CUDA(cudaFree(p));
  PROBE_CUDA(cudaStreamDestroy(c.s));
  return exit_code();
}
