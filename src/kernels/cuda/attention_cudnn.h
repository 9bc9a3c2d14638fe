// cuDNN's fused attention (SDPA) for the CUDA backend's whole-sequence
// attention with bf16 products (docs/cuda.md, "Attention on cuDNN").
//
// Three parts, internal to src/kernels (and the GPU conformance tests):
//  * the policy: HSPMD_CUDNN_ATTENTION and the recorded reason of the last
//    fallback (attention_sdpa.cu);
//  * the attention entry points attention.cu calls first (attention_sdpa.cu):
//    f32 arrays in and out as attention.h's contract, converted to bf16 for
//    cuDNN and back;
//  * the cudnn_frontend graphs (namespace sdpa): attention_cudnn.cpp when the
//    build found cuDNN's and the frontend's headers (HSPMD_CUDNN), else the
//    stub no_cudnn.cpp, which refuses every graph.
// libcudnn is opened at the first graph (dlopen), never linked.
#pragma once

#include <cstdint>
#include <string>

#include "hspmd/core/device.h"
#include "hspmd/core/ndarray.h"

namespace hspmd::kernels::cuda {

// ---- policy ----

// How whole-sequence attention with bf16 products uses cuDNN:
//  kOff:      never (HSPMD_CUDNN_ATTENTION=0), our kernels only;
//  kAuto:     when the build has cuDNN, the library loads and it builds a graph
//             for the case, else our kernels, the reason recorded (the default);
//  kRequired: as kAuto, but a case cuDNN does not take throws hspmd::Error
//             naming the reason (HSPMD_CUDNN_ATTENTION=1; for tests).
// f32 products never use cuDNN (its SDPA is bf16/fp16 only) whatever the mode.
enum class CudnnAttention { kOff, kAuto, kRequired };

// The mode: HSPMD_CUDNN_ATTENTION read at the first call ("0" off, "1"
// required, unset or anything else auto), unless set_cudnn_attention_mode
// changed it. Thread-safe.
CudnnAttention cudnn_attention_mode();
void set_cudnn_attention_mode(CudnnAttention mode);

// Why the latest bf16-products attention call of this process did not run on
// cuDNN, "" when it did (or none ran). Thread-safe.
std::string cudnn_attention_fallback_reason();

// Forward and backward calls cuDNN computed so far in this process.
int64_t cudnn_attention_calls();

// Calls with bf16 products that fell back to our kernels so far in this
// process (mode auto; HSPMD_CUDNN_ATTENTION=0 is not a fallback), and the
// reason of the latest of them ("" while none did). Thread-safe.
int64_t cudnn_attention_fallbacks();
std::string cudnn_attention_last_fallback();

// ---- entry points (attention.cu calls them before its own kernels) ----

// attention_forward / attention_backward of attention.h on cuDNN, for CUDA
// arrays q [B, S, Hq, D], k and v [B, S, Hkv, D] (f32, contiguous) and
// `host_documents`, the documents already copied to the host (invalid: one
// document per row). True when cuDNN computed every output; false when the
// mode, the products (f32), the shape or cuDNN refuse the case (nothing
// written; the reason recorded unless it was the mode or f32 products).
// Throws hspmd::Error for documents that break attention.h's contract (the
// CPU backend's message), and in kRequired mode for a refused case.
//
// Outputs are cuDNN's bf16 values, in bf16 arrays or widened into f32 ones
// (out, dq, dk, dv; cuDNN is never given an fp32 O: 9.14 took one and wrote
// a wrong O); lse is its
// fp32 softmax statistic, the natural-log log-sum-exp of the scaled scores,
// [B, Hq, S] as the contract says, so the backward needs nothing else from
// the forward.
bool sdpa_attention_forward(Stream& s, const NDArray& q, const NDArray& k, const NDArray& v,
                            const NDArray& host_documents, float scale, NDArray& out, NDArray& lse,
                            DType products, int64_t window);
bool sdpa_attention_backward(Stream& s, const NDArray& q, const NDArray& k, const NDArray& v, const NDArray& out,
                             const NDArray& lse, const NDArray& grad_out, const NDArray& host_documents,
                             float scale, NDArray& dq, NDArray& dk, NDArray& dv, DType products, int64_t window);

// ---- cudnn_frontend graphs ----
namespace sdpa {

// One attention problem in cuDNN's terms: `batch` sequences of at most
// `seq` tokens, causal, GQA (Hq a multiple of Hkv), bf16 tensors with fp32
// softmax statistics [batch, Hq, seq] (packed).
//  * dense (ragged false): q [batch, seq, Hq, D], k and v [batch, seq, Hkv, D];
//  * ragged (packed documents): the sequences' tokens lie back to back in
//    [T, H, D] tensors; seq_len[i] tokens of sequence i start at element
//    offset off_q[i] (q, out, dq, dO) and off_kv[i] (k, v, dk, dv); int32,
//    [batch] and [batch + 1], on the device.
// window > 0: query i sees keys i - window < j <= i of its sequence.
struct Shape {
  int64_t batch = 0, Hq = 0, Hkv = 0, seq = 0, D = 0;
  bool ragged = false;
  int64_t window = 0;
  float scale = 1.0f;
};

// Device pointers (bf16 unless said). The forward
// reads q, k, v and writes o and stats; the backward reads q, k, v, o, d_o,
// stats and writes dq, dk, dv.
struct Tensors {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* stats = nullptr;
  const void* d_o = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  const int32_t* seq_len = nullptr;  // ragged only
  const int32_t* off_q = nullptr;
  const int32_t* off_kv = nullptr;
};

// Builds (once per shape, per thread and device: graphs and the refusals are
// cached) and enqueues the forward or backward graph on `s`. False, with
// *why set, when cuDNN or its frontend refuse the graph or its execution, or
// libcudnn cannot be loaded or is too old; nothing is enqueued then. The
// workspace comes from the device's caching allocator.
bool forward(Stream& s, const Shape& shape, const Tensors& t, std::string* why);
bool backward(Stream& s, const Shape& shape, const Tensors& t, std::string* why);

// cudnnGetVersion() of the library found at run time (e.g. 91400), or 0 with
// *why set when it cannot be loaded or the build has no cuDNN.
int cudnn_version(std::string* why);

// Whether this build has the cuDNN graphs (attention_cudnn.cpp), not
// no_cudnn.cpp's refusals.
bool built();

}  // namespace sdpa
}  // namespace hspmd::kernels::cuda
