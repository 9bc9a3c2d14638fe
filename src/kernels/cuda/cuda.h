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
#include "kernels/basic.h"
#include "kernels/memory.h"

namespace hspmd::kernels::cuda {

// ---- kernels.h ----
void add(Stream& s, const NDArray& a, const NDArray& b, NDArray& out);
void mul(Stream& s, const NDArray& a, const NDArray& b, NDArray& out);
void scale(Stream& s, const NDArray& a, float factor, NDArray& out);
void accumulate(Stream& s, const NDArray& a, NDArray& out);

// ---- basic.h ----
// cuBLAS (gemm.cu): f32 or bf16 products, f32 accumulation.
void matmul(Stream& s, const NDArray& a, const NDArray& b, bool trans_a, bool trans_b, NDArray& out,
            GemmCompute compute);
// f32:
void rms_norm(Stream& s, const NDArray& x, const NDArray& weight, float eps, NDArray& out);
void rms_norm_backward(Stream& s, const NDArray& dy, const NDArray& x, const NDArray& weight, float eps, NDArray& dx,
                       NDArray& dweight);
void swiglu(Stream& s, const NDArray& gate, const NDArray& up, NDArray& out);
void swiglu_backward(Stream& s, const NDArray& dy, const NDArray& gate, const NDArray& up, NDArray& dgate,
                     NDArray& dup);

// ---- memory.h ----
void fill(Stream& s, NDArray& out, float value);
NDArray zeros(Stream& s, const Shape& shape, DType dtype);
void copy(Stream& s, const NDArray& from, NDArray& out);
void copy_block(Stream& s, const NDArray& from, const Shape& from_start, NDArray& to, const Shape& to_start,
                const Shape& extent, bool accumulate);
NDArray to_host(Stream& s, const NDArray& a);
NDArray to_device(Stream& s, const NDArray& host);
double sum_of_squares(Stream& s, const std::vector<NDArray>& arrays);
void adam_step(Stream& s, const std::vector<AdamTensor>& tensors, const AdamFactors& f);

}  // namespace hspmd::kernels::cuda
