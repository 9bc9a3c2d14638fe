// The CUDA backend of the kernels (built only with HSPMD_HAVE_CUDA): the
// kernels of src/kernels/*.h that have a CUDA implementation so far, same
// names and contracts, each taking the stream it is enqueued on (a CUDA
// stream of the arrays' device; the dispatch checked the devices). Work is
// asynchronous: it is done when the stream is synchronized, except where a
// kernel returns a host value (sum_of_squares, to_host), which waits.
// Only src/kernels/ includes this header.
#pragma once

#include <vector>

#include "hspmd/core/device.h"
#include "hspmd/core/ndarray.h"
#include "kernels/attention.h"
#include "kernels/basic.h"
#include "kernels/memory.h"

namespace hspmd::kernels::cuda {

// ---- kernels.h ----
void add(Stream& s, const NDArray& a, const NDArray& b, NDArray& out);
void mul(Stream& s, const NDArray& a, const NDArray& b, NDArray& out);
void scale(Stream& s, const NDArray& a, float factor, NDArray& out);
void accumulate(Stream& s, const NDArray& a, NDArray& out);

// ---- basic.h ----
// cuBLAS (gemm.cu): f32 or bf16 products, f32 accumulation; an addend or a
// bias through cuBLASLt's epilogues where it applies.
void matmul(Stream& s, const NDArray& a, const NDArray& b, bool trans_a, bool trans_b, NDArray& out,
            GemmCompute compute, GemmEpilogue epilogue);
// f32:
void rms_norm(Stream& s, const NDArray& x, const NDArray& weight, float eps, NDArray& out);
void add_rms_norm(Stream& s, const NDArray& a, const NDArray& b, const NDArray& weight, float eps, NDArray& sum,
                  NDArray& out);
void rms_norm_backward(Stream& s, const NDArray& dy, const NDArray& x, const NDArray& weight, float eps, NDArray& dx,
                       NDArray& dweight, const NDArray* addend, NDArray* dx_bf16);
void rope_qk(Stream& s, const NDArray& q, const NDArray& k, const NDArray& positions, float theta, bool inverse,
             NDArray& q_out, NDArray& k_out);
void swiglu(Stream& s, const NDArray& gate, const NDArray& up, NDArray& out);
void swiglu_backward(Stream& s, const NDArray& dy, const NDArray& gate, const NDArray& up, NDArray& dgate,
                     NDArray& dup, NDArray* out);

// Mixture of experts (moe.cu), f32:
void moe_route(Stream& s, const NDArray& logits, int64_t top_k, bool normalize, NDArray& weights, NDArray& indices,
               NDArray& probs);
void moe_route_backward(Stream& s, const NDArray& probs, const NDArray& indices, const NDArray& dweights,
                        const NDArray* dprobs, bool normalize, NDArray& dlogits);
void moe_combine(Stream& s, const NDArray& rows_in, const NDArray& rows, const NDArray* weights, NDArray& y);
void moe_combine_backward(Stream& s, const NDArray& dy, const NDArray& rows_in, const NDArray& rows,
                          const NDArray* weights, NDArray& drows_in, NDArray* dweights);
void sigmoid_gate(Stream& s, const NDArray& x, const NDArray& gate, NDArray& out);
void sigmoid_gate_backward(Stream& s, const NDArray& dy, const NDArray& x, const NDArray& gate, NDArray& dx,
                           NDArray& dgate);

// ---- layout and reductions (layout.cu): any dtype for the layout kernels,
// f32 for the others ----
void transpose(Stream& s, const NDArray& a, int d0, int d1, NDArray& out);
void slice(Stream& s, const NDArray& a, int axis, int64_t begin, NDArray& out);
void slice_backward(Stream& s, const NDArray& grad, int axis, int64_t begin, NDArray& out);
void concat(Stream& s, const std::vector<NDArray>& parts, int axis, NDArray& out);
void reduce_sum(Stream& s, const NDArray& a, const std::vector<bool>& reduced, NDArray& out);
void broadcast_reduced(Stream& s, const NDArray& g, const std::vector<bool>& reduced, NDArray& out);
void add_bias(Stream& s, const NDArray& x, const NDArray& bias, NDArray& out);
void bias_grad(Stream& s, const NDArray& dy, NDArray& dbias);

// ---- model ops (model_ops.cu, f32) ----
void embedding(Stream& s, const NDArray& weight, const NDArray& ids, int64_t vocab_begin, int64_t vocab_size,
               NDArray& out);
void embedding_backward(Stream& s, const NDArray& grad, const NDArray& ids, int64_t vocab_begin, int64_t vocab_size,
                        NDArray& dweight);
void rope(Stream& s, const NDArray& x, const NDArray& positions, float theta, bool inverse, NDArray& out);
void cross_entropy(Stream& s, const NDArray& logits, const NDArray& targets, const NDArray& normalizer,
                   int ignore_index, NDArray& loss, NDArray& lse, int64_t classes);
void cross_entropy_shard_stats(Stream& s, const NDArray& logits, const NDArray& targets, int64_t vocab_begin,
                               int64_t vocab_size, int ignore_index, NDArray& local_lse, NDArray& target_logit,
                               int64_t classes);
void cross_entropy_combine(Stream& s, const NDArray& shard_lse, const NDArray& target_logit, const NDArray& targets,
                           const NDArray& normalizer, int ignore_index, NDArray& loss, NDArray& lse);
void cross_entropy_backward(Stream& s, const NDArray& dloss, const NDArray& logits, const NDArray& targets,
                            const NDArray& normalizer, const NDArray& lse, int ignore_index, int64_t vocab_begin,
                            NDArray& dlogits, int64_t classes);

// ---- attention.h (attention.cu): f32 arrays, f32 or bf16 products ----
void attention_forward(Stream& s, const NDArray& q, const NDArray& k, const NDArray& v, const NDArray& documents,
                       float scale, NDArray& out, NDArray& lse, AttentionTiles tiles, DType products,
                       int64_t window);
void attention_backward(Stream& s, const NDArray& q, const NDArray& k, const NDArray& v, const NDArray& out,
                        const NDArray& lse, const NDArray& grad_out, const NDArray& documents, float scale,
                        NDArray& dq, NDArray& dk, NDArray& dv, AttentionTiles tiles, DType products, int64_t window);
void attention_block_forward(Stream& s, const AttentionBlock& blk, NDArray& out_blk, NDArray& lse_blk,
                             AttentionTiles tiles);
void attention_merge(Stream& s, NDArray& out, NDArray& lse, const NDArray& out_blk, const NDArray& lse_blk);
void attention_row_dots(Stream& s, const NDArray& out, const NDArray& grad_out, NDArray& delta, bool bf16_grad);
void attention_block_backward(Stream& s, const AttentionBlock& blk, const NDArray& grad_out, const NDArray& lse,
                              const NDArray& delta, NDArray& dq, NDArray& dk, NDArray& dv, AttentionTiles tiles);

// ---- memory.h ----
void fill(Stream& s, NDArray& out, float value);
NDArray zeros(Stream& s, const Shape& shape, DType dtype);
void copy(Stream& s, const NDArray& from, NDArray& out);
NDArray cast(Stream& s, const NDArray& a, DType dtype);
// The same into `out` (contiguous, a's size; its dtype is the target).
void cast_into(Stream& s, const NDArray& a, NDArray& out);
void copy_block(Stream& s, const NDArray& from, const Shape& from_start, NDArray& to, const Shape& to_start,
                const Shape& extent, bool accumulate);
NDArray to_host(Stream& s, const NDArray& a);
NDArray to_device(Stream& s, const NDArray& host);
// Raises the first failure of the token-id and target checks queued on `s`
// since the last flush (embedding, cross_entropy: they do not wait for the
// device); waits for the stream when any are queued. to_host and
// sum_of_squares call it: a bad id surfaces at the stream's next host read.
void flush_checks(Stream& s);
// Forgets the checks queued on `s` without reading them (a capture ended:
// its kernels did not run; the graph queues its checks at each launch).
void drop_pending_checks(Stream& s);
double sum_of_squares(Stream& s, const std::vector<NDArray>& arrays);
void clip_control(Stream& s, const std::vector<NDArray>& grads, const std::vector<NDArray>& losses, double max_norm,
                  NDArray& control);
void adam_step(Stream& s, const std::vector<AdamTensor>& tensors, const AdamFactors& f);

}  // namespace hspmd::kernels::cuda
