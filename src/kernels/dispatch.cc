// The kernel dispatch: every public kernel (kernels.h, basic.h, attention.h)
// checks that its arrays live on the stream's device, then switches once on
// that device's type and calls the backend's implementation (CPU:
// cpu/cpu.h). A device type without an implementation of the kernel ends in
// no_kernel(), the one place that declares missing backend support. A CUDA
// backend adds `case DeviceType::CUDA: return cuda::<kernel>(s, ...);` to
// each switch (and src/kernels/cuda/); no op file changes. Each switch runs
// inside a DeviceCodeScope (device_code.h): the only code that may take the
// pointers of the device test double's arrays. Host helpers that read arrays
// take the stream too and bring them to the host (to_host) first. Every
// entry point is listed at the end (dispatch_table.h) with its CUDA path;
// tests/kernels/test_cuda_paths.cc checks the listing against the headers.
#include <cstring>
#include <initializer_list>

#include "cpu/cpu.h"
#ifdef HSPMD_HAVE_CUDA
#include "cuda/attention_cudnn.h"
#include "cuda/cuda.h"
#define HSPMD_CUDA_CASE(call) \
  case DeviceType::CUDA:      \
    return cuda::call;
#else
#define HSPMD_CUDA_CASE(call)
#endif
#include "hspmd/core/device_code.h"
#include "hspmd/core/error.h"
#include "kernels/attention.h"
#include "kernels/basic.h"
#include "kernels/dispatch_table.h"
#include "kernels/kernels.h"
#include "kernels/memory.h"

namespace hspmd::kernels {

void no_kernel(const char* kernel, Device device) {
  fail("[kernels] ", kernel, ": no kernel for device ", device.str(), " in this build");
}

namespace {

// cpu:1, the device test double (device.h): CPU kernels on host memory
// that the rest of hspmd treats as a device's.
bool is_double(const Device& d) { return d == Device::host_double(); }

// A contiguous copy of `a` (contiguous) labelled with device `to` (the host
// or the test double: both are host memory).
NDArray moved(const NDArray& a, Device to) {
  HSPMD_CHECK(a.is_contiguous(), "kernels: a strided array between the host and its test double");
  NDArray out = NDArray::empty(a.shape(), a.dtype(), to);
  if (a.nbytes() > 0) std::memcpy(out.raw_data(), a.raw_data(), a.nbytes());
  return out;
}

// The device type the kernel runs on: the stream's, after checking that
// every (valid) array lives on the stream's device.
DeviceType device_of(const char* kernel, const Stream& s,
                     std::initializer_list<const NDArray*> arrays) {
  const Device d = s.device();
  for (const NDArray* a : arrays)
    if (a->valid() && !(a->device() == d))
      fail("[kernels] ", kernel, ": an array lives on ", a->device().str(), " but the stream on ",
           d.str());
  return d.type;
}

}  // namespace

// ---- kernels.h ----

void add(Stream& s, const NDArray& a, const NDArray& b, NDArray& out) {
  switch (const DeviceCodeScope code; device_of("add", s, {&a, &b, &out})) {
    case DeviceType::CPU: return cpu::kernels().add(a, b, out);
    HSPMD_CUDA_CASE(add(s, a, b, out))
    default: no_kernel("add", s.device());
  }
}

void mul(Stream& s, const NDArray& a, const NDArray& b, NDArray& out) {
  switch (const DeviceCodeScope code; device_of("mul", s, {&a, &b, &out})) {
    case DeviceType::CPU: return cpu::kernels().mul(a, b, out);
    HSPMD_CUDA_CASE(mul(s, a, b, out))
    default: no_kernel("mul", s.device());
  }
}

void scale(Stream& s, const NDArray& a, float factor, NDArray& out) {
  switch (const DeviceCodeScope code; device_of("scale", s, {&a, &out})) {
    case DeviceType::CPU: return cpu::kernels().scale(a, factor, out);
    HSPMD_CUDA_CASE(scale(s, a, factor, out))
    default: no_kernel("scale", s.device());
  }
}

void accumulate(Stream& s, const NDArray& a, NDArray& out) {
  switch (const DeviceCodeScope code; device_of("accumulate", s, {&a, &out})) {
    case DeviceType::CPU: return cpu::kernels().accumulate(a, out);
    HSPMD_CUDA_CASE(accumulate(s, a, out))
    default: no_kernel("accumulate", s.device());
  }
}

void add_bias(Stream& s, const NDArray& x, const NDArray& bias, NDArray& out) {
  switch (const DeviceCodeScope code; device_of("add_bias", s, {&x, &bias, &out})) {
    case DeviceType::CPU: return cpu::kernels().add_bias(x, bias, out);
    HSPMD_CUDA_CASE(add_bias(s, x, bias, out))
    default: no_kernel("add_bias", s.device());
  }
}

void bias_grad(Stream& s, const NDArray& dy, NDArray& dbias) {
  switch (const DeviceCodeScope code; device_of("bias_grad", s, {&dy, &dbias})) {
    case DeviceType::CPU: return cpu::kernels().bias_grad(dy, dbias);
    HSPMD_CUDA_CASE(bias_grad(s, dy, dbias))
    default: no_kernel("bias_grad", s.device());
  }
}

// ---- basic.h ----

void matmul(Stream& s, const NDArray& a, const NDArray& b, bool trans_a, bool trans_b, NDArray& out,
            GemmCompute compute, const NDArray* addend) {
  const DeviceCodeScope code;  // the addend's check compares pointers
  if (addend != nullptr) {
    HSPMD_CHECK(out.dtype() == DType::F32 && addend->dtype() == DType::F32 && addend->shape() == out.shape() &&
                    addend->raw_data() != out.raw_data(),
                "matmul: the addend must be f32 of the output's shape, the output f32 and not the addend");
    device_of("matmul", s, {addend});
  }
  switch (device_of("matmul", s, {&a, &b, &out})) {
    case DeviceType::CPU:
      cpu::matmul(a, b, trans_a, trans_b, out, compute);
      if (addend != nullptr) add(s, out, *addend, out);  // in place: each element read before written
      return;
    HSPMD_CUDA_CASE(matmul(s, a, b, trans_a, trans_b, out, compute, addend))
    default: no_kernel("matmul", s.device());
  }
}

void transpose(Stream& s, const NDArray& a, int d0, int d1, NDArray& out) {
  switch (const DeviceCodeScope code; device_of("transpose", s, {&a, &out})) {
    case DeviceType::CPU: return cpu::kernels().transpose(a, d0, d1, out);
    HSPMD_CUDA_CASE(transpose(s, a, d0, d1, out))
    default: no_kernel("transpose", s.device());
  }
}

void slice(Stream& s, const NDArray& a, int axis, int64_t begin, NDArray& out) {
  switch (const DeviceCodeScope code; device_of("slice", s, {&a, &out})) {
    case DeviceType::CPU: return cpu::kernels().slice(a, axis, begin, out);
    HSPMD_CUDA_CASE(slice(s, a, axis, begin, out))
    default: no_kernel("slice", s.device());
  }
}

void slice_backward(Stream& s, const NDArray& grad, int axis, int64_t begin, NDArray& out) {
  switch (const DeviceCodeScope code; device_of("slice_backward", s, {&grad, &out})) {
    case DeviceType::CPU: return cpu::kernels().slice_backward(grad, axis, begin, out);
    HSPMD_CUDA_CASE(slice_backward(s, grad, axis, begin, out))
    default: no_kernel("slice_backward", s.device());
  }
}

void concat(Stream& s, const std::vector<NDArray>& parts, int axis, NDArray& out) {
  for (const NDArray& p : parts) device_of("concat", s, {&p});
  switch (const DeviceCodeScope code; device_of("concat", s, {&out})) {
    case DeviceType::CPU: return cpu::kernels().concat(parts, axis, out);
    HSPMD_CUDA_CASE(concat(s, parts, axis, out))
    default: no_kernel("concat", s.device());
  }
}

void reduce_sum(Stream& s, const NDArray& a, const std::vector<bool>& reduced, NDArray& out) {
  switch (const DeviceCodeScope code; device_of("reduce_sum", s, {&a, &out})) {
    case DeviceType::CPU: return cpu::kernels().reduce_sum(a, reduced, out);
    HSPMD_CUDA_CASE(reduce_sum(s, a, reduced, out))
    default: no_kernel("reduce_sum", s.device());
  }
}

void broadcast_reduced(Stream& s, const NDArray& g, const std::vector<bool>& reduced,
                       NDArray& out) {
  switch (const DeviceCodeScope code; device_of("broadcast_reduced", s, {&g, &out})) {
    case DeviceType::CPU: return cpu::kernels().broadcast_reduced(g, reduced, out);
    HSPMD_CUDA_CASE(broadcast_reduced(s, g, reduced, out))
    default: no_kernel("broadcast_reduced", s.device());
  }
}

void embedding(Stream& s, const NDArray& weight, const NDArray& ids, int64_t vocab_begin,
               int64_t vocab_size, NDArray& out) {
  switch (const DeviceCodeScope code; device_of("embedding", s, {&weight, &ids, &out})) {
    case DeviceType::CPU: return cpu::kernels().embedding(weight, ids, vocab_begin, vocab_size, out);
    HSPMD_CUDA_CASE(embedding(s, weight, ids, vocab_begin, vocab_size, out))
    default: no_kernel("embedding", s.device());
  }
}

void embedding_backward(Stream& s, const NDArray& grad, const NDArray& ids, int64_t vocab_begin,
                        int64_t vocab_size, NDArray& dweight) {
  switch (const DeviceCodeScope code; device_of("embedding_backward", s, {&grad, &ids, &dweight})) {
    case DeviceType::CPU: return cpu::kernels().embedding_backward(grad, ids, vocab_begin, vocab_size,
                                                         dweight);
    HSPMD_CUDA_CASE(embedding_backward(s, grad, ids, vocab_begin, vocab_size, dweight))
    default: no_kernel("embedding_backward", s.device());
  }
}

void rms_norm(Stream& s, const NDArray& x, const NDArray& weight, float eps, NDArray& out) {
  switch (const DeviceCodeScope code; device_of("rms_norm", s, {&x, &weight, &out})) {
    case DeviceType::CPU: return cpu::kernels().rms_norm(x, weight, eps, out);
    HSPMD_CUDA_CASE(rms_norm(s, x, weight, eps, out))
    default: no_kernel("rms_norm", s.device());
  }
}

void rms_norm_backward(Stream& s, const NDArray& dy, const NDArray& x, const NDArray& weight,
                       float eps, NDArray& dx, NDArray& dweight, const NDArray* addend) {
  if (addend != nullptr) {
    HSPMD_CHECK((addend->dtype() == DType::F32 || addend->dtype() == DType::BF16) && addend->numel() == x.numel() &&
                    addend->is_contiguous(),
                "rms_norm_backward: the addend must be f32 or bf16 and contiguous, of x's size");
    device_of("rms_norm_backward", s, {addend});
  }
  switch (const DeviceCodeScope code; device_of("rms_norm_backward", s, {&dy, &x, &weight, &dx, &dweight})) {
    case DeviceType::CPU: return cpu::kernels().rms_norm_backward(dy, x, weight, eps, dx, dweight, addend);
    HSPMD_CUDA_CASE(rms_norm_backward(s, dy, x, weight, eps, dx, dweight, addend))
    default: no_kernel("rms_norm_backward", s.device());
  }
}

void rope(Stream& s, const NDArray& x, const NDArray& positions, float theta, bool inverse,
          NDArray& out) {
  switch (const DeviceCodeScope code; device_of("rope", s, {&x, &positions, &out})) {
    case DeviceType::CPU: return cpu::kernels().rope(x, positions, theta, inverse, out);
    HSPMD_CUDA_CASE(rope(s, x, positions, theta, inverse, out))
    default: no_kernel("rope", s.device());
  }
}

void swiglu(Stream& s, const NDArray& gate, const NDArray& up, NDArray& out) {
  switch (const DeviceCodeScope code; device_of("swiglu", s, {&gate, &up, &out})) {
    case DeviceType::CPU: return cpu::kernels().swiglu(gate, up, out);
    HSPMD_CUDA_CASE(swiglu(s, gate, up, out))
    default: no_kernel("swiglu", s.device());
  }
}

void swiglu_backward(Stream& s, const NDArray& dy, const NDArray& gate, const NDArray& up,
                     NDArray& dgate, NDArray& dup, NDArray* out) {
  if (out != nullptr) {
    HSPMD_CHECK(out->numel() == gate.numel() && out->is_contiguous(), "swiglu_backward: out size");
    device_of("swiglu_backward", s, {out});
  }
  switch (const DeviceCodeScope code; device_of("swiglu_backward", s, {&dy, &gate, &up, &dgate, &dup})) {
    case DeviceType::CPU: return cpu::kernels().swiglu_backward(dy, gate, up, dgate, dup, out);
    HSPMD_CUDA_CASE(swiglu_backward(s, dy, gate, up, dgate, dup, out))
    default: no_kernel("swiglu_backward", s.device());
  }
}

void cross_entropy(Stream& s, const NDArray& logits, const NDArray& targets,
                   const NDArray& normalizer, int ignore_index, NDArray& loss, NDArray& lse,
                   int64_t classes) {
  switch (const DeviceCodeScope code; device_of("cross_entropy", s, {&logits, &targets, &normalizer, &loss, &lse})) {
    case DeviceType::CPU:
      return cpu::kernels().cross_entropy(logits, targets, normalizer, ignore_index, loss, lse, classes);
    HSPMD_CUDA_CASE(cross_entropy(s, logits, targets, normalizer, ignore_index, loss, lse, classes))
    default: no_kernel("cross_entropy", s.device());
  }
}

void cross_entropy_shard_stats(Stream& s, const NDArray& logits, const NDArray& targets,
                               int64_t vocab_begin, int64_t vocab_size, int ignore_index,
                               NDArray& local_lse, NDArray& target_logit, int64_t classes) {
  switch (const DeviceCodeScope code; device_of("cross_entropy_shard_stats", s, {&logits, &targets, &local_lse, &target_logit})) {
    case DeviceType::CPU:
      return cpu::kernels().cross_entropy_shard_stats(logits, targets, vocab_begin, vocab_size, ignore_index,
                                            local_lse, target_logit, classes);
    HSPMD_CUDA_CASE(cross_entropy_shard_stats(s, logits, targets, vocab_begin, vocab_size, ignore_index, local_lse, target_logit, classes))
    default: no_kernel("cross_entropy_shard_stats", s.device());
  }
}

void cross_entropy_combine(Stream& s, const NDArray& shard_lse, const NDArray& target_logit,
                           const NDArray& targets, const NDArray& normalizer, int ignore_index,
                           NDArray& loss, NDArray& lse) {
  switch (const DeviceCodeScope code; device_of("cross_entropy_combine", s,
                    {&shard_lse, &target_logit, &targets, &normalizer, &loss, &lse})) {
    case DeviceType::CPU:
      return cpu::kernels().cross_entropy_combine(shard_lse, target_logit, targets, normalizer, ignore_index,
                                        loss, lse);
    HSPMD_CUDA_CASE(cross_entropy_combine(s, shard_lse, target_logit, targets, normalizer, ignore_index, loss, lse))
    default: no_kernel("cross_entropy_combine", s.device());
  }
}

void cross_entropy_backward(Stream& s, const NDArray& dloss, const NDArray& logits,
                            const NDArray& targets, const NDArray& normalizer, const NDArray& lse,
                            int ignore_index, int64_t vocab_begin, NDArray& dlogits,
                            int64_t classes) {
  switch (const DeviceCodeScope code; device_of("cross_entropy_backward", s,
                    {&dloss, &logits, &targets, &normalizer, &lse, &dlogits})) {
    case DeviceType::CPU:
      return cpu::kernels().cross_entropy_backward(dloss, logits, targets, normalizer, lse, ignore_index,
                                         vocab_begin, dlogits, classes);
    HSPMD_CUDA_CASE(cross_entropy_backward(s, dloss, logits, targets, normalizer, lse, ignore_index, vocab_begin, dlogits, classes))
    default: no_kernel("cross_entropy_backward", s.device());
  }
}

// ---- attention.h ----


// A host helper: the positions come to the host (a copy from a device; the
// array itself on the CPU), then the CPU backend's rules run there.
std::vector<int32_t> document_starts_from_positions(Stream& s, const NDArray& positions, int64_t first) {
  device_of("document_starts_from_positions", s, {&positions});
  cpu::require_contiguous("attention", positions);
  return cpu::document_starts_from_positions(to_host(s, positions), first);
}

bool fused_attention_rounds_output(Device device) {
#ifdef HSPMD_HAVE_CUDA
  return device.type == DeviceType::CUDA && cuda::sdpa::built() &&
         cuda::cudnn_attention_mode() != cuda::CudnnAttention::kOff;
#else
  (void)device;
  return false;
#endif
}

FusedAttentionReport fused_attention_report() {
  FusedAttentionReport r;
#ifdef HSPMD_HAVE_CUDA
  r.cudnn_calls = cuda::cudnn_attention_calls();
  r.fallbacks = cuda::cudnn_attention_fallbacks();
  r.last_fallback = cuda::cudnn_attention_last_fallback();
#endif
  return r;
}

void attention_forward(Stream& s, const NDArray& q, const NDArray& k, const NDArray& v,
                       const NDArray& documents, float scale, NDArray& out, NDArray& lse,
                       AttentionTiles tiles, DType products, int64_t window) {
  switch (const DeviceCodeScope code; device_of("attention_forward", s, {&q, &k, &v, &documents, &out, &lse})) {
    case DeviceType::CPU: {
      if (q.dtype() != DType::BF16 && out.dtype() != DType::BF16)
        return cpu::kernels().attention_forward(q, k, v, documents, scale, out, lse, tiles, products, window);
      // bf16 arrays: computed on f32 copies, the output rounded once.
      NDArray o = NDArray::empty(out.shape(), DType::F32, out.device());
      cpu::kernels().attention_forward(as_f32(s, q), as_f32(s, k), as_f32(s, v), documents, scale, o, lse, tiles,
                             products, window);
      out = out.dtype() == DType::BF16 ? cast(s, o, DType::BF16) : o;
      return;
    }
    HSPMD_CUDA_CASE(attention_forward(s, q, k, v, documents, scale, out, lse, tiles, products, window))
    default: no_kernel("attention_forward", s.device());
  }
}

void attention_backward(Stream& s, const NDArray& q, const NDArray& k, const NDArray& v,
                        const NDArray& out, const NDArray& lse, const NDArray& grad_out,
                        const NDArray& documents, float scale, NDArray& dq, NDArray& dk,
                        NDArray& dv, AttentionTiles tiles, DType products, int64_t window) {
  switch (const DeviceCodeScope code; device_of("attention_backward", s,
                    {&q, &k, &v, &out, &lse, &grad_out, &documents, &dq, &dk, &dv})) {
    case DeviceType::CPU: {
      if (dq.dtype() == DType::F32 && dk.dtype() == DType::F32 && dv.dtype() == DType::F32)
        return cpu::kernels().attention_backward(as_f32(s, q), as_f32(s, k), as_f32(s, v), as_f32(s, out), lse,
                                       as_f32(s, grad_out), documents, scale, dq, dk, dv, tiles, products,
                                       window);
      // bf16 gradients: computed in f32, each rounded once.
      NDArray d[3] = {NDArray::empty(dq.shape(), DType::F32, dq.device()),
                      NDArray::empty(dk.shape(), DType::F32, dk.device()),
                      NDArray::empty(dv.shape(), DType::F32, dv.device())};
      cpu::kernels().attention_backward(as_f32(s, q), as_f32(s, k), as_f32(s, v), as_f32(s, out), lse, as_f32(s, grad_out),
                              documents, scale, d[0], d[1], d[2], tiles, products, window);
      NDArray* to[3] = {&dq, &dk, &dv};
      for (int i = 0; i < 3; ++i) *to[i] = cast(s, d[i], to[i]->dtype());
      return;
    }
    HSPMD_CUDA_CASE(attention_backward(s, q, k, v, out, lse, grad_out, documents, scale, dq, dk, dv, tiles, products, window))
    default: no_kernel("attention_backward", s.device());
  }
}

void attention_block_forward(Stream& s, const AttentionBlock& blk, NDArray& out_blk,
                             NDArray& lse_blk, AttentionTiles tiles) {
  switch (const DeviceCodeScope code; device_of("attention_block_forward", s, {&blk.q, &blk.k, &blk.v, &out_blk, &lse_blk})) {
    case DeviceType::CPU: return cpu::kernels().attention_block_forward(blk, out_blk, lse_blk, tiles);
    HSPMD_CUDA_CASE(attention_block_forward(s, blk, out_blk, lse_blk, tiles))
    default: no_kernel("attention_block_forward", s.device());
  }
}

void attention_merge(Stream& s, NDArray& out, NDArray& lse, const NDArray& out_blk,
                     const NDArray& lse_blk) {
  switch (const DeviceCodeScope code; device_of("attention_merge", s, {&out, &lse, &out_blk, &lse_blk})) {
    case DeviceType::CPU: return cpu::kernels().attention_merge(out, lse, out_blk, lse_blk);
    HSPMD_CUDA_CASE(attention_merge(s, out, lse, out_blk, lse_blk))
    default: no_kernel("attention_merge", s.device());
  }
}

void attention_row_dots(Stream& s, const NDArray& out, const NDArray& grad_out, NDArray& delta,
                        bool bf16_grad) {
  switch (const DeviceCodeScope code; device_of("attention_row_dots", s, {&out, &grad_out, &delta})) {
    case DeviceType::CPU: return cpu::kernels().attention_row_dots(out, grad_out, delta, bf16_grad);
    HSPMD_CUDA_CASE(attention_row_dots(s, out, grad_out, delta, bf16_grad))
    default: no_kernel("attention_row_dots", s.device());
  }
}

void attention_block_backward(Stream& s, const AttentionBlock& blk, const NDArray& grad_out,
                              const NDArray& lse, const NDArray& delta, NDArray& dq, NDArray& dk,
                              NDArray& dv, AttentionTiles tiles) {
  switch (const DeviceCodeScope code; device_of("attention_block_backward", s,
                    {&blk.q, &blk.k, &blk.v, &grad_out, &lse, &delta, &dq, &dk, &dv})) {
    case DeviceType::CPU:
      return cpu::kernels().attention_block_backward(blk, grad_out, lse, delta, dq, dk, dv, tiles);
    HSPMD_CUDA_CASE(attention_block_backward(s, blk, grad_out, lse, delta, dq, dk, dv, tiles))
    default: no_kernel("attention_block_backward", s.device());
  }
}

// ---- memory.h ----

void fill(Stream& s, NDArray& out, float value) {
  switch (const DeviceCodeScope code; device_of("fill", s, {&out})) {
    case DeviceType::CPU: return cpu::kernels().fill(out, value);
    HSPMD_CUDA_CASE(fill(s, out, value))
    default: no_kernel("fill", s.device());
  }
}

NDArray zeros(Stream& s, const Shape& shape, DType dtype) {
  const DeviceCodeScope code;
  if (is_double(s.device())) {
    NDArray z = NDArray::empty(shape, dtype, s.device());
    if (z.nbytes() > 0) std::memset(z.raw_data(), 0, z.nbytes());
    return z;
  }
  switch (s.device().type) {
    case DeviceType::CPU: return cpu::kernels().zeros(shape, dtype);
    HSPMD_CUDA_CASE(zeros(s, shape, dtype))
    default: no_kernel("zeros", s.device());
  }
}

void copy(Stream& s, const NDArray& from, NDArray& out) {
  switch (const DeviceCodeScope code; device_of("copy", s, {&from, &out})) {
    case DeviceType::CPU: return cpu::kernels().copy(from, out);
    HSPMD_CUDA_CASE(copy(s, from, out))
    default: no_kernel("copy", s.device());
  }
}

NDArray clone(Stream& s, const NDArray& a) {
  if (device_of("clone", s, {&a}) == DeviceType::CPU && !is_double(s.device())) return a.clone();
  NDArray out = NDArray::empty(a.shape(), a.dtype(), s.device());
  copy(s, a, out);
  return out;
}

NDArray as_f32(Stream& s, const NDArray& a) {
  return a.valid() && a.dtype() == DType::BF16 ? cast(s, a, DType::F32) : a;
}

NDArray cast(Stream& s, const NDArray& a, DType dtype) {
  switch (const DeviceCodeScope code; device_of("cast", s, {&a})) {
    case DeviceType::CPU:
      if (is_double(s.device())) return moved(moved(a, Device::cpu()).to(dtype), s.device());
      return a.to(dtype);
    HSPMD_CUDA_CASE(cast(s, a, dtype))
    default: no_kernel("cast", s.device());
  }
}

void copy_block(Stream& s, const NDArray& from, const Shape& from_start, NDArray& to,
                const Shape& to_start, const Shape& extent, bool accumulate) {
  switch (const DeviceCodeScope code; device_of("copy_block", s, {&from, &to})) {
    case DeviceType::CPU: return cpu::kernels().copy_block(from, from_start, to, to_start, extent, accumulate);
    HSPMD_CUDA_CASE(copy_block(s, from, from_start, to, to_start, extent, accumulate))
    default: no_kernel("copy_block", s.device());
  }
}

NDArray to_host(Stream& s, const NDArray& a) {
  switch (const DeviceCodeScope code; device_of("to_host", s, {&a})) {
    case DeviceType::CPU: return is_double(s.device()) ? moved(a, Device::cpu()) : a;  // the host is cpu:0
    HSPMD_CUDA_CASE(to_host(s, a))
    default: no_kernel("to_host", s.device());
  }
}

NDArray to_device(Stream& s, const NDArray& a) {
  if (!a.valid() || a.device() == s.device()) return a;  // there already (CPU: the host)
  if (!(a.device() == Device::cpu()))
    fail("[kernels] to_device: the array lives on ", a.device().str(), ", neither on the host nor on ",
         s.device().str());
  const DeviceCodeScope code;
  if (is_double(s.device())) return moved(a.contiguous(), s.device());
  switch (s.device().type) {
    HSPMD_CUDA_CASE(to_device(s, a))
    default: no_kernel("to_device", s.device());
  }
}

double sum_of_squares(Stream& s, const std::vector<NDArray>& arrays) {
  for (const NDArray& a : arrays) device_of("sum_of_squares", s, {&a});
  switch (const DeviceCodeScope code; s.device().type) {
    case DeviceType::CPU: return cpu::kernels().sum_of_squares(arrays);
    HSPMD_CUDA_CASE(sum_of_squares(s, arrays))
    default: no_kernel("sum_of_squares", s.device());
  }
}

void adam_step(Stream& s, const std::vector<AdamTensor>& tensors, const AdamFactors& f) {
  for (const AdamTensor& t : tensors)
    device_of("adam_step", s, {t.param, t.grad, t.exp_avg, t.exp_avg_sq});
  switch (const DeviceCodeScope code; s.device().type) {
    case DeviceType::CPU: return cpu::kernels().adam_step(tensors, f);
    HSPMD_CUDA_CASE(adam_step(s, tensors, f))
    default: no_kernel("adam_step", s.device());
  }
}

// ---- the listing (dispatch_table.h) ----

namespace {

#ifdef HSPMD_HAVE_CUDA
template <typename F>
const void* address_of(F* f) {
  return reinterpret_cast<const void*>(f);
}
#define HSPMD_CUDA_ENTRY(name) {#name, DispatchEntry::Path::kCuda, address_of(&cuda::name)}
#else
#define HSPMD_CUDA_ENTRY(name) {#name, DispatchEntry::Path::kCuda, nullptr}
#endif
#define HSPMD_COMPOSED_ENTRY(name) {#name, DispatchEntry::Path::kComposed, nullptr}

const DispatchEntry kEntries[] = {
    // kernels.h
    HSPMD_CUDA_ENTRY(add), HSPMD_CUDA_ENTRY(mul), HSPMD_CUDA_ENTRY(scale), HSPMD_CUDA_ENTRY(accumulate),
    HSPMD_CUDA_ENTRY(add_bias), HSPMD_CUDA_ENTRY(bias_grad),
    // basic.h
    HSPMD_CUDA_ENTRY(matmul), HSPMD_CUDA_ENTRY(transpose), HSPMD_CUDA_ENTRY(slice),
    HSPMD_CUDA_ENTRY(slice_backward), HSPMD_CUDA_ENTRY(concat), HSPMD_CUDA_ENTRY(reduce_sum),
    HSPMD_CUDA_ENTRY(broadcast_reduced), HSPMD_CUDA_ENTRY(embedding), HSPMD_CUDA_ENTRY(embedding_backward),
    HSPMD_CUDA_ENTRY(rms_norm), HSPMD_CUDA_ENTRY(rms_norm_backward), HSPMD_CUDA_ENTRY(rope),
    HSPMD_CUDA_ENTRY(swiglu), HSPMD_CUDA_ENTRY(swiglu_backward), HSPMD_CUDA_ENTRY(cross_entropy),
    HSPMD_CUDA_ENTRY(cross_entropy_shard_stats), HSPMD_CUDA_ENTRY(cross_entropy_combine),
    HSPMD_CUDA_ENTRY(cross_entropy_backward),
    // attention.h
    HSPMD_COMPOSED_ENTRY(document_starts_from_positions),  // to_host, then the CPU's rules on the host
    HSPMD_CUDA_ENTRY(attention_forward), HSPMD_CUDA_ENTRY(attention_backward),
    HSPMD_CUDA_ENTRY(attention_block_forward), HSPMD_CUDA_ENTRY(attention_merge),
    HSPMD_CUDA_ENTRY(attention_row_dots), HSPMD_CUDA_ENTRY(attention_block_backward),
    // memory.h
    HSPMD_CUDA_ENTRY(fill), HSPMD_CUDA_ENTRY(zeros), HSPMD_CUDA_ENTRY(copy), HSPMD_CUDA_ENTRY(cast),
    HSPMD_COMPOSED_ENTRY(as_f32),  // cast
    HSPMD_COMPOSED_ENTRY(clone),   // empty + copy
    HSPMD_CUDA_ENTRY(copy_block), HSPMD_CUDA_ENTRY(to_host), HSPMD_CUDA_ENTRY(to_device),
    HSPMD_CUDA_ENTRY(sum_of_squares), HSPMD_CUDA_ENTRY(adam_step),
};

#undef HSPMD_CUDA_ENTRY
#undef HSPMD_COMPOSED_ENTRY

}  // namespace

std::span<const DispatchEntry> dispatch_entries() { return kEntries; }

}  // namespace hspmd::kernels
