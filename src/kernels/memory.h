// Memory kernels: fills, copies, block copies between boxes, host transfers,
// and the optimizer's multi-tensor kernels (norm, AdamW). Everything above
// src/kernels/ that moves or combines tensor elements outside an op's math
// (communication packing, state resharding, attention's ring messages,
// gradient clipping, the optimizer) calls these; see kernels.h for the
// dispatch rules (stream first, arrays on the stream's device).
#pragma once

#include <cstdint>
#include <vector>

#include "hspmd/core/device.h"
#include "hspmd/core/ndarray.h"

namespace hspmd::kernels {

// ---- fills and copies (any dtype; contiguous arrays) ----
// Sets every element of `out` to `value` (converted to out's dtype as
// NDArray::fill does: bf16 rounded to nearest even, integers truncated).
void fill(Stream& s, NDArray& out, float value);
// A new array on the stream's device, every element zero.
NDArray zeros(Stream& s, const Shape& shape, DType dtype);
// out = from (same dtype and element count; shapes may differ).
void copy(Stream& s, const NDArray& from, NDArray& out);

// The same values in `dtype` (f32 <-> bf16, rounding to nearest even as
// NDArray::to; a copy when the dtypes agree), a new contiguous array on the
// stream's device. The cast op and the Reshards that carry bf16 use it.
NDArray cast(Stream& s, const NDArray& a, DType dtype);
// `a` itself unless it is bf16, else an exact f32 copy (cast): for kernels
// that compute on f32 arrays and also accept bf16 ones.
NDArray as_f32(Stream& s, const NDArray& a);

// A copy of `a` (new storage, contiguous) on the stream's device.
NDArray clone(Stream& s, const NDArray& a);

// Block copy between two contiguous arrays of one dtype and rank: for every
// index i of `extent`, to[to_start + i] = from[from_start + i] (or += with
// `accumulate`, f32 only). Both blocks must lie inside their arrays
// (hspmd::InternalError otherwise). Packing a box into a message is a block
// copy into an array of the box's shape; unpacking is the reverse.
void copy_block(Stream& s, const NDArray& from, const Shape& from_start, NDArray& to,
                const Shape& to_start, const Shape& extent, bool accumulate = false);

// ---- host transfers ----
// The array in host memory: `a` itself when it lives there already (no copy:
// a CPU stream), else a host copy once the stream's work on `a` is done.
NDArray to_host(Stream& s, const NDArray& a);
// The array on the stream's device: `a` itself when it lives there already
// (every array on a CPU stream), else a copy of the host array `a` in the
// stream's order (an array on a third device: hspmd::Error).
NDArray to_device(Stream& s, const NDArray& a);
// `out.nbytes()` bytes of host memory at `host` into `out` (contiguous, on
// the stream's device), in the stream's order: what a replayed CUDA graph
// reads, refreshed in place (a batch, AdamW's step factors; docs/cuda.md,
// "CUDA graphs"). From page-locked memory the copy reads the host bytes
// when the stream reaches it, and a captured copy reads them again at each
// launch; from pageable memory the call returns once they are staged.
void copy_from_host(Stream& s, const void* host, NDArray& out);
// The same from a host array of `out`'s shape and dtype.
void copy_from_host(Stream& s, const NDArray& host, NDArray& out);

// ---- optimizer ----
// Σ x² over every element of `arrays` (f32, contiguous), accumulated in
// double one element after the other in the given order (a fixed order:
// the same bits on every run and every thread count). Returns to the host.
double sum_of_squares(Stream& s, const std::vector<NDArray>& arrays);
// The step's gradient clip and finiteness guard on the device, so that the
// host queues the update without reading the norm first (the read waits for
// the device): writes `control` (f64 [3], on the stream's device) =
//   [0] Σ x² over `grads`, the bits sum_of_squares returns for them;
//   [1] the clip's coefficient for the norm sqrt([0]) and `max_norm`, the
//       f32 value of clip_coefficient (optim/lr_schedule.h): max_norm /
//       (norm + 1e-6) in double, rounded once to f32, when max_norm > 0 and
//       norm > max_norm, else 1;
//   [2] 1 when the norm and every value of `losses` (f32 scalars, the
//       step's loss terms) are finite, else 0.
// adam_step reads [1] and [2] through AdamFactors::control.
void clip_control(Stream& s, const std::vector<NDArray>& grads, const std::vector<NDArray>& losses,
                  double max_norm, NDArray& control);

// The scalar factors of one AdamW / Adam step, computed by the caller in
// double and narrowed once.
struct AdamFactors {
  float beta1 = 0, beta2 = 0, eps = 0;
  float one_minus_beta1 = 0, one_minus_beta2 = 0;
  float l2 = 0;           // Adam with L2: wd * p added to the gradient
  float decay_scale = 1;  // AdamW: p *= 1 - lr * wd
  float sqrt_bc2 = 1;     // sqrt(1 - beta2^t)
  float step_size = 0;    // lr / (1 - beta1^t)
  // The gradient-norm clip's coefficient: the kernel reads grad * grad_scale
  // (one f32 product, rounded, as kernels::scale writes it) instead of a
  // separate pass over the gradients first; 1: the gradient as it is.
  float grad_scale = 1;
  // clip_control's array (f64 [3] on the update's device), or nullptr: when
  // set, the coefficient is its [1] (grad_scale is not read) and nothing is
  // written unless its [2] is 1 (a non-finite step leaves the parameters
  // and moments as they were). The update reads it when it runs, so the
  // host needs no value of it.
  const NDArray* control = nullptr;
  // The step's factors on the update's device (f32 [3]: decay_scale,
  // sqrt_bc2, step_size), or nullptr: when set, the update reads those three
  // from it as it runs, not from the fields above (which change every step:
  // a captured CUDA graph replays the launch's arguments as they were).
  const NDArray* step = nullptr;
};
// One tensor of a multi-tensor AdamW step: param, grad, and the two moments,
// f32, contiguous, one shape.
struct AdamTensor {
  NDArray* param = nullptr;
  const NDArray* grad = nullptr;
  NDArray* exp_avg = nullptr;
  NDArray* exp_avg_sq = nullptr;
  // Optional (bf16, contiguous, the param's size): the updated parameter
  // rounded to bf16 as kernels::cast rounds it, written in the update's own
  // pass (the weight's bf16 compute copy for the next step, without a cast
  // of its own that reads the f32 master again). Not written where the
  // parameter is not (a step the control array marks non-finite), so it
  // stays the copy of the parameter as it is.
  NDArray* param_bf16 = nullptr;
};
// The update of torch.optim.AdamW / Adam in torch's operation order, on every
// tensor of the list (one launch on a device backend):
//   g = grad * grad_scale (rounded) + l2 * p; p *= decay_scale; m = b1 m + (1-b1) g;
//   v = b2 v + (1-b2) g²; p -= step_size * m / (sqrt(v) / sqrt_bc2 + eps).
void adam_step(Stream& s, const std::vector<AdamTensor>& tensors, const AdamFactors& f);

}  // namespace hspmd::kernels
