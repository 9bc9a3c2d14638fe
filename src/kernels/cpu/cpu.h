// The CPU backend: the kernels of src/kernels/*.h as they run on the host.
//
// Same names, arguments and contracts as the public kernels (without the
// stream: CPU work runs inline in the calling thread, threaded with OpenMP);
// the dispatch in src/kernels/dispatch.cc calls them after checking that the
// arrays live on the stream's device. Only src/kernels/ includes this header.
#pragma once

#include <cstdint>
#include <vector>

#include "hspmd/core/ndarray.h"
#include "kernels/attention.h"
#include "kernels/basic.h"
#include "kernels/memory.h"

namespace hspmd::kernels::cpu {

// HSPMD_CHECK that `a` is contiguous (the CPU kernels read flat buffers);
// the device was checked by the dispatch.
void require_contiguous(const char* kernel, const NDArray& a);

// ---- kernels.h ----
void add(const NDArray& a, const NDArray& b, NDArray& out);
void mul(const NDArray& a, const NDArray& b, NDArray& out);
void scale(const NDArray& a, float factor, NDArray& out);
void accumulate(const NDArray& a, NDArray& out);
void add_bias(const NDArray& x, const NDArray& bias, NDArray& out);
void bias_grad(const NDArray& dy, NDArray& dbias);

// ---- basic.h ----
void matmul(const NDArray& a, const NDArray& b, bool trans_a, bool trans_b, NDArray& out,
            GemmCompute compute);
void transpose(const NDArray& a, int d0, int d1, NDArray& out);
void slice(const NDArray& a, int axis, int64_t begin, NDArray& out);
void slice_backward(const NDArray& grad, int axis, int64_t begin, NDArray& out);
void concat(const std::vector<NDArray>& parts, int axis, NDArray& out);
void reduce_sum(const NDArray& a, const std::vector<bool>& reduced, NDArray& out);
void broadcast_reduced(const NDArray& g, const std::vector<bool>& reduced, NDArray& out);
void embedding(const NDArray& weight, const NDArray& ids, int64_t vocab_begin, int64_t vocab_size,
               NDArray& out);
void embedding_backward(const NDArray& grad, const NDArray& ids, int64_t vocab_begin,
                        int64_t vocab_size, NDArray& dweight);
void rms_norm(const NDArray& x, const NDArray& weight, float eps, NDArray& out);
void rms_norm_backward(const NDArray& dy, const NDArray& x, const NDArray& weight, float eps,
                       NDArray& dx, NDArray& dweight, const NDArray* addend);
void rope(const NDArray& x, const NDArray& positions, float theta, bool inverse, NDArray& out);
void swiglu(const NDArray& gate, const NDArray& up, NDArray& out);
void swiglu_backward(const NDArray& dy, const NDArray& gate, const NDArray& up, NDArray& dgate,
                     NDArray& dup, NDArray* out);
void cross_entropy(const NDArray& logits, const NDArray& targets, const NDArray& normalizer,
                   int ignore_index, NDArray& loss, NDArray& lse, int64_t classes);
void cross_entropy_shard_stats(const NDArray& logits, const NDArray& targets,
                               int64_t vocab_begin, int64_t vocab_size, int ignore_index,
                               NDArray& local_lse, NDArray& target_logit, int64_t classes);
void cross_entropy_combine(const NDArray& shard_lse, const NDArray& target_logit,
                           const NDArray& targets, const NDArray& normalizer, int ignore_index,
                           NDArray& loss, NDArray& lse);
void cross_entropy_backward(const NDArray& dloss, const NDArray& logits, const NDArray& targets,
                            const NDArray& normalizer, const NDArray& lse, int ignore_index,
                            int64_t vocab_begin, NDArray& dlogits, int64_t classes);

// ---- attention.h ----
// document_starts_from_positions of positions in host memory (the dispatch
// brings a device's there first).
std::vector<int32_t> document_starts_from_positions(const NDArray& positions, int64_t first);
// Per token of [B, S], where its visible keys start in its row: its
// document's start from `documents` (host memory; see attention.h),
// raised to i - W + 1 by a window W > 0. Throws as attention_forward does.
// Also the CUDA attention's host side.
std::vector<int32_t> key_starts(const NDArray& documents, int64_t B, int64_t S, int64_t window);
void attention_forward(const NDArray& q, const NDArray& k, const NDArray& v,
                       const NDArray& documents, float scale, NDArray& out, NDArray& lse,
                       AttentionTiles tiles, DType products, int64_t window);
void attention_backward(const NDArray& q, const NDArray& k, const NDArray& v, const NDArray& out,
                        const NDArray& lse, const NDArray& grad_out, const NDArray& documents,
                        float scale, NDArray& dq, NDArray& dk, NDArray& dv,
                        AttentionTiles tiles, DType products, int64_t window);
void attention_block_forward(const AttentionBlock& blk, NDArray& out_blk, NDArray& lse_blk,
                             AttentionTiles tiles);
void attention_merge(NDArray& out, NDArray& lse, const NDArray& out_blk, const NDArray& lse_blk);
void attention_row_dots(const NDArray& out, const NDArray& grad_out, NDArray& delta, bool bf16_grad);
void attention_block_backward(const AttentionBlock& blk, const NDArray& grad_out,
                              const NDArray& lse, const NDArray& delta, NDArray& dq, NDArray& dk,
                              NDArray& dv, AttentionTiles tiles);

// ---- memory.h ----
void fill(NDArray& out, float value);
NDArray zeros(const Shape& shape, DType dtype);
void copy(const NDArray& from, NDArray& out);
void copy_block(const NDArray& from, const Shape& from_start, NDArray& to, const Shape& to_start,
                const Shape& extent, bool accumulate);
double sum_of_squares(const std::vector<NDArray>& arrays);
void adam_step(const std::vector<AdamTensor>& tensors, const AdamFactors& f);

}  // namespace hspmd::kernels::cpu
