// The CPU backend: the kernels of src/kernels/*.h as they run on the host.
//
// Same names, arguments and contracts as the public kernels (without the
// stream: CPU work runs inline in the calling thread, threaded with OpenMP);
// the dispatch in src/kernels/dispatch.cc calls them after checking that the
// arrays live on the stream's device. Only src/kernels/ includes this header.
//
// One build serves every x86-64 CPU: the kernels listed in
// variant_kernels.inc are compiled once per instruction-set level
// (variant.h: baseline, AVX2, AVX-512), and kernels() is the table of the
// level cpu_isa() chooses at run time (HSPMD_CPU_ISA caps it;
// hspmd/core/cpu_isa.h). matmul is OpenBLAS's and oneDNN's, which choose
// their own code at run time.
#pragma once

#include <cstdint>
#include <vector>

#include "hspmd/core/cpu_isa.h"
#include "hspmd/core/ndarray.h"
#include "kernels/attention.h"
#include "kernels/basic.h"
#include "kernels/memory.h"

namespace hspmd::kernels::cpu {

// HSPMD_CHECK that `a` is contiguous (the CPU kernels read flat buffers);
// the device was checked by the dispatch.
void require_contiguous(const char* kernel, const NDArray& a);

void matmul(const NDArray& a, const NDArray& b, bool trans_a, bool trans_b, NDArray& out,
            GemmCompute compute);

// The mixture-of-experts kernels (moe.cc; basic.h has their contracts).
void moe_route(const NDArray& logits, int64_t top_k, bool normalize, NDArray& weights, NDArray& indices,
               NDArray& probs);
void moe_route_backward(const NDArray& probs, const NDArray& indices, const NDArray& dweights, const NDArray* dprobs,
                        bool normalize, NDArray& dlogits);
void moe_combine(const NDArray& rows_in, const NDArray& rows, const NDArray* weights, NDArray& y);
void moe_combine_backward(const NDArray& dy, const NDArray& rows_in, const NDArray& rows, const NDArray* weights,
                          NDArray& drows_in, NDArray* dweights);
void sigmoid_gate(const NDArray& x, const NDArray& gate, NDArray& out);
void sigmoid_gate_backward(const NDArray& dy, const NDArray& x, const NDArray& gate, NDArray& dx, NDArray& dgate);

// One instruction-set level's kernels (variant_kernels.inc): a function
// pointer per kernel.
struct Kernels {
  CpuIsa isa = CpuIsa::kBaseline;  // the level they were compiled for
#define HSPMD_CPU_KERNEL(name, ret, params) ret(*name) params = nullptr;
#include "kernels/cpu/variant_kernels.inc"
#undef HSPMD_CPU_KERNEL
};

// The kernels of the highest level the build has at or below cpu_isa().
const Kernels& kernels();
// The kernels compiled for exactly `isa` (kBaseline, kAvx2, kAvx512), or
// nullptr when the build has no such variant (tests run each one).
const Kernels* kernels_for(CpuIsa isa);

// Per token of [B, S], where its visible keys start in its row: its
// document's start from `documents` (host memory; see attention.h),
// raised to i - W + 1 by a window W > 0. Throws as attention_forward does.
// Also the CUDA attention's host side. kernels().key_starts.
std::vector<int32_t> key_starts(const NDArray& documents, int64_t B, int64_t S, int64_t window);
// Global index where the keys of query t of an attention block start: its
// document's start, raised to i - W + 1 by a window W > 0 (attention_host.cc).
std::vector<int32_t> windowed_starts(const AttentionBlock& blk);
// document_starts_from_positions of positions in host memory (the dispatch
// brings a device's there first). kernels().document_starts_from_positions.
std::vector<int32_t> document_starts_from_positions(const NDArray& positions, int64_t first);

}  // namespace hspmd::kernels::cpu
