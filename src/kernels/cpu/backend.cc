// The CPU backend (backend.h): every kernel of kernel_list.inc on the host,
// for cpu:0 and for its device test double cpu:1 (device.h). A `variant`
// kernel is the chosen ISA variant's function (cpu.h, kernels()); a `host`
// kernel is written below. Each entry is a template on the variant (-1: the
// one chosen at run time) so that tests can run every variant through the
// same table (variant_backend).
#include <cstring>

#include "hspmd/core/error.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu.h"

namespace hspmd::kernels::cpu {
namespace entries {

constexpr int kChosen = -1;

template <int V>
const Kernels& table() {
  if constexpr (V == kChosen)
    return kernels();
  else
    return *kernels_for(static_cast<CpuIsa>(V));
}

bool is_double(const Device& d) { return d == Device::host_double(); }

// A contiguous copy of `a` (contiguous) labelled with device `to` (the host
// or the test double: both are host memory).
NDArray moved(const NDArray& a, Device to) {
  HSPMD_CHECK(a.is_contiguous(), "kernels: a strided array between the host and its test double");
  NDArray out = NDArray::empty(a.shape(), a.dtype(), to);
  if (a.nbytes() > 0) std::memcpy(out.raw_data(), a.raw_data(), a.nbytes());
  return out;
}

// ---- the `variant` kernels: the variant's function ----
#define HSPMD_CPU_ENTRY_variant(name, ret, params, args) \
  template <int V>                                      \
  ret name(Stream&, HSPMD_UNPAREN params) {             \
    return table<V>().name args;                        \
  }
#define HSPMD_CPU_ENTRY_host(name, ret, params, args)
#define HSPMD_KERNEL(name, ret, params, args, cpu) HSPMD_CPU_ENTRY_##cpu(name, ret, params, args)
#include "kernels/kernel_list.inc"
#undef HSPMD_KERNEL
#undef HSPMD_CPU_ENTRY_variant
#undef HSPMD_CPU_ENTRY_host

// ---- the `host` kernels ----

template <int V>
void matmul(Stream& s, const NDArray& a, const NDArray& b, bool trans_a, bool trans_b, NDArray& out,
            GemmCompute compute, GemmEpilogue e) {
  if (e.bias != nullptr) {
    // The three kernels the op chain ran (matmul to f32, add_bias, cast): the same bits.
    NDArray y = out.dtype() == DType::F32 ? out : NDArray::empty(out.shape(), DType::F32, out.device());
    cpu::matmul(a, b, trans_a, trans_b, y, compute);
    table<V>().add_bias(y, *e.bias, y);  // in place: each element read before written
    if (out.dtype() != DType::F32) table<V>().copy(kernels::cast(s, y, out.dtype()), out);
    return;
  }
  cpu::matmul(a, b, trans_a, trans_b, out, compute);
  if (e.addend != nullptr) table<V>().add(out, *e.addend, out);  // in place: each element read before written
}

template <int V>
void attention_forward(Stream& s, const NDArray& q, const NDArray& k, const NDArray& v, const NDArray& documents,
                       float scale, NDArray& out, NDArray& lse, AttentionTiles tiles, DType products,
                       int64_t window) {
  if (q.dtype() != DType::BF16 && out.dtype() != DType::BF16)
    return table<V>().attention_forward(q, k, v, documents, scale, out, lse, tiles, products, window);
  // bf16 arrays: computed on f32 copies, the output rounded once.
  NDArray o = NDArray::empty(out.shape(), DType::F32, out.device());
  table<V>().attention_forward(as_f32(s, q), as_f32(s, k), as_f32(s, v), documents, scale, o, lse, tiles, products,
                               window);
  out = out.dtype() == DType::BF16 ? kernels::cast(s, o, DType::BF16) : o;
}

template <int V>
void attention_backward(Stream& s, const NDArray& q, const NDArray& k, const NDArray& v, const NDArray& out,
                        const NDArray& lse, const NDArray& grad_out, const NDArray& documents, float scale,
                        NDArray& dq, NDArray& dk, NDArray& dv, AttentionTiles tiles, DType products, int64_t window) {
  if (dq.dtype() == DType::F32 && dk.dtype() == DType::F32 && dv.dtype() == DType::F32)
    return table<V>().attention_backward(as_f32(s, q), as_f32(s, k), as_f32(s, v), as_f32(s, out), lse,
                                         as_f32(s, grad_out), documents, scale, dq, dk, dv, tiles, products, window);
  // bf16 gradients: computed in f32, each rounded once.
  NDArray d[3] = {NDArray::empty(dq.shape(), DType::F32, dq.device()),
                  NDArray::empty(dk.shape(), DType::F32, dk.device()),
                  NDArray::empty(dv.shape(), DType::F32, dv.device())};
  table<V>().attention_backward(as_f32(s, q), as_f32(s, k), as_f32(s, v), as_f32(s, out), lse, as_f32(s, grad_out),
                                documents, scale, d[0], d[1], d[2], tiles, products, window);
  NDArray* to[3] = {&dq, &dk, &dv};
  for (int i = 0; i < 3; ++i) *to[i] = kernels::cast(s, d[i], to[i]->dtype());
}

// The mixture-of-experts kernels: one implementation for every variant
// (row loops over few experts; their sums in double).
template <int V>
void moe_route(Stream&, const NDArray& logits, int64_t top_k, bool normalize, NDArray& weights, NDArray& indices,
               NDArray& probs) {
  cpu::moe_route(logits, top_k, normalize, weights, indices, probs);
}
template <int V>
void moe_route_backward(Stream&, const NDArray& probs, const NDArray& indices, const NDArray& dweights,
                        const NDArray* dprobs, bool normalize, NDArray& dlogits) {
  cpu::moe_route_backward(probs, indices, dweights, dprobs, normalize, dlogits);
}
template <int V>
void moe_combine(Stream&, const NDArray& rows_in, const NDArray& rows, const NDArray* weights, NDArray& y) {
  cpu::moe_combine(rows_in, rows, weights, y);
}
template <int V>
void moe_combine_backward(Stream&, const NDArray& dy, const NDArray& rows_in, const NDArray& rows,
                          const NDArray* weights, NDArray& drows_in, NDArray* dweights) {
  cpu::moe_combine_backward(dy, rows_in, rows, weights, drows_in, dweights);
}
template <int V>
void sigmoid_gate(Stream&, const NDArray& x, const NDArray& gate, NDArray& out) {
  cpu::sigmoid_gate(x, gate, out);
}
template <int V>
void sigmoid_gate_backward(Stream&, const NDArray& dy, const NDArray& x, const NDArray& gate, NDArray& dx,
                           NDArray& dgate) {
  cpu::sigmoid_gate_backward(dy, x, gate, dx, dgate);
}

template <int V>
NDArray zeros(Stream& s, const Shape& shape, DType dtype) {
  if (!is_double(s.device())) return table<V>().zeros(shape, dtype);
  NDArray z = NDArray::empty(shape, dtype, s.device());
  if (z.nbytes() > 0) std::memset(z.raw_data(), 0, z.nbytes());
  return z;
}

template <int V>
NDArray cast(Stream& s, const NDArray& a, DType dtype) {
  if (is_double(s.device())) return moved(moved(a, Device::cpu()).to(dtype), s.device());
  return a.to(dtype);
}

template <int V>
NDArray to_host(Stream& s, const NDArray& a) {
  return is_double(s.device()) ? moved(a, Device::cpu()) : a;  // the host is cpu:0
}

// The dispatch has checked that `a` lives on the host or on the stream's device.
template <int V>
NDArray to_device(Stream& s, const NDArray& a) {
  if (!a.valid() || a.device() == s.device()) return a;
  return moved(a.contiguous(), s.device());
}

// The table of variant V: &name<V> for every kernel of the list (a kernel
// without a CPU entry does not compile).
template <int V>
constexpr Backend make_backend(const char* label) {
  Backend b;
  b.name = label;
  b.device_type = DeviceType::CPU;
#define HSPMD_KERNEL(name, ret, params, args, cpu) b.kernels.name = &name<V>;
#include "kernels/kernel_list.inc"
#undef HSPMD_KERNEL
  return b;
}

constinit const Backend kChosenBackend = make_backend<kChosen>("cpu");
constinit const Backend kBaselineBackend = make_backend<static_cast<int>(CpuIsa::kBaseline)>("cpu-baseline");
constinit const Backend kAvx2Backend = make_backend<static_cast<int>(CpuIsa::kAvx2)>("cpu-avx2");
constinit const Backend kAvx512Backend = make_backend<static_cast<int>(CpuIsa::kAvx512)>("cpu-avx512");

}  // namespace entries

const Backend* variant_backend(CpuIsa isa) {
  if (kernels_for(isa) == nullptr) return nullptr;
  switch (isa) {
    case CpuIsa::kBaseline: return &entries::kBaselineBackend;
    case CpuIsa::kAvx2: return &entries::kAvx2Backend;
    case CpuIsa::kAvx512: return &entries::kAvx512Backend;
    default: return nullptr;
  }
}

void register_backend() { kernels::register_backend(entries::kChosenBackend); }

}  // namespace hspmd::kernels::cpu
