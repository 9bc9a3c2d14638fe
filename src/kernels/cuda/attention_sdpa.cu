// Whole-sequence attention on cuDNN's fused SDPA (attention_cudnn.h): the
// policy (HSPMD_CUDNN_ATTENTION, the recorded fallback reason), the mapping
// of attention.h's problem onto cuDNN's, and the conversions around it.
//
// Documents become cuDNN sequences: one row of one document is a dense
// [B, S, H, D] problem; otherwise every document is a sequence of a packed
// (THD) problem whose ragged offsets point into the same [B*S, H, D] memory
// (documents never cross rows: attention.h's contract). cuDNN's softmax
// statistics are attention.h's lse: the same values (natural-log
// log-sum-exp of the scaled scores) and, dense, the same layout [B, Hq, S];
// packed, they are [documents, Hq, longest] and a small kernel moves them
// to and from lse. So the backward reads only what the contract saves.
#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/cpu/cpu.h"
#include "kernels/cuda/attention_cudnn.h"
#include "kernels/cuda/cuda.h"
#include "kernels/cuda/launch.cuh"

namespace hspmd::kernels::cuda {
namespace {

using namespace launch;

// ---- policy ----

std::atomic<int> g_mode{-1};  // a CudnnAttention, -1 until read from the environment
std::atomic<int64_t> g_calls{0};
std::atomic<int64_t> g_fallbacks{0};
std::mutex g_reason_mutex;
std::string g_reason, g_last_fallback;

CudnnAttention mode_from_environment() {
  const char* e = std::getenv("HSPMD_CUDNN_ATTENTION");
  const std::string v = e ? e : "";
  if (v == "0") return CudnnAttention::kOff;
  if (v == "1") return CudnnAttention::kRequired;
  return CudnnAttention::kAuto;
}

void record(const std::string& why) {
  std::lock_guard<std::mutex> lock(g_reason_mutex);
  g_reason = why;
}

// A case cuDNN does not take: recorded, or an error when it is required.
bool fall_back(const std::string& why) {
  if (cudnn_attention_mode() == CudnnAttention::kRequired)
    fail("[cuda] attention: cuDNN's fused attention is required (HSPMD_CUDNN_ATTENTION=1) but cannot run this "
         "case: ",
         why);
  record(why);
  {
    std::lock_guard<std::mutex> lock(g_reason_mutex);
    g_last_fallback = why;
  }
  ++g_fallbacks;
  return false;
}

void served() {
  ++g_calls;
  record("");
}

// ---- conversions ----

// Packed statistics stats [n, H, seq] <-> lse [B, H, S]: sequence i's token
// t is flat token first[i] + t of the [B*S] tokens.
__global__ void move_stats_kernel(float* stats, float* lse, const int32_t* first, const int32_t* len, int64_t n,
                                  int64_t H, int64_t seq, int64_t S, bool to_lse) {
  for (int64_t x = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; x < n * H * seq;
       x += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = x % seq, h = x / seq % H, i = x / (seq * H);
    if (t >= len[i]) continue;
    const int64_t token = first[i] + t, at = (token / S * H + h) * S + token % S;
    if (to_lse)
      lse[at] = stats[x];
    else
      stats[x] = lse[at];
  }
}

// q, k, v, O and dO as cuDNN reads them: bf16 arrays as they are, f32 ones
// rounded (cast).
NDArray as_bf16(Stream& s, const NDArray& a) {
  return a.dtype() == DType::BF16 ? a : cast(s, a, DType::BF16);
}

void to_f32(Stream& s, const NDArray& b16, NDArray& out) { cast_into(s, b16, out); }

NDArray upload(Stream& s, const std::vector<int32_t>& v) {
  return to_device(s, NDArray::from_vector_i32({static_cast<int64_t>(v.size())}, v));
}

// ---- the problem in cuDNN's terms ----

// The documents of every row as consecutive sequences: first token (flat,
// over B*S) and length of each.
struct Sequences {
  std::vector<int32_t> first, length;
  int64_t longest = 0;
};

// From each token's document start (no window): a token starts a document
// where its start is itself, else it continues the current one. Positions
// whose starts do not cut the rows that way (e.g. a position that does not
// restart at 0) are refused ("" when they do).
std::string sequences_of(const std::vector<int32_t>& start, int64_t B, int64_t S, Sequences* out) {
  for (int64_t b = 0; b < B; ++b) {
    int64_t begin = 0;
    for (int64_t i = 0; i <= S; ++i) {
      const bool ends = i == S || start[b * S + i] == i;
      if (i > 0 && ends) {
        out->first.push_back(static_cast<int32_t>(b * S + begin));
        out->length.push_back(static_cast<int32_t>(i - begin));
        out->longest = std::max(out->longest, i - begin);
        begin = i;
      } else if (i < S && start[b * S + i] != begin) {
        return "document positions that do not split the rows into consecutive documents (row " + std::to_string(b) +
               ", token " + std::to_string(i) + ")";
      }
    }
  }
  return "";
}

struct Problem {
  sdpa::Shape shape;
  Sequences seqs;
  NDArray seq_len, off_q, off_kv, first;  // device, packed only
};

// Checks the case and builds the problem. Returns "" when cuDNN may run it;
// "-" when the case is not cuDNN's to take (mode off, f32 products, no
// elements); else the reason it refuses, malformed arrays included (our
// kernels then name the error; with HSPMD_CUDNN_ATTENTION=1 fall_back does).
std::string prepare(Stream& s, const NDArray& q, const NDArray& k, const NDArray& v, const NDArray& host_docs,
                    float scale, DType products, int64_t window, Problem* p) {
  if (cudnn_attention_mode() == CudnnAttention::kOff || products != DType::BF16) return "-";
  for (const NDArray* x : {&q, &k, &v})
    if ((x->dtype() != DType::F32 && x->dtype() != DType::BF16) || x->dtype() != q.dtype() || !x->is_contiguous() ||
        x->ndim() != 4)
      return "q, k and v must be contiguous 4-d arrays of one dtype, f32 or bf16";
  const int64_t B = q.dim(0), S = q.dim(1), Hq = q.dim(2), D = q.dim(3), Hkv = k.dim(2);
  if (v.shape() != k.shape() || k.dim(0) != B || k.dim(1) != S || k.dim(3) != D || Hkv <= 0 || Hq % Hkv != 0)
    return "q, k and v shapes that do not fit (B, S and D shared, query heads a multiple of kv heads)";
  if (B * S * Hq * D == 0) return "-";
  if (D % 8 != 0 || D > 256) return "head dim " + std::to_string(D) + " (cuDNN: a multiple of 8, at most 256)";
  const std::string refused = sequences_of(cpu::key_starts(host_docs, B, S, 0), B, S, &p->seqs);
  if (!refused.empty()) return refused;
  const int64_t n = static_cast<int64_t>(p->seqs.first.size());
  const bool packed = n != B;  // else every row is one document
  if (packed && B * S * Hq * D > INT_MAX) return "packed documents past 2^31 elements (int32 ragged offsets)";
  sdpa::Shape& sh = p->shape;
  sh.batch = n, sh.Hq = Hq, sh.Hkv = Hkv, sh.D = D, sh.ragged = packed, sh.scale = scale;
  // Packed: the longest document rounded up to 64, so that batches whose
  // longest documents differ a little share a graph.
  sh.seq = packed ? (p->seqs.longest + 63) / 64 * 64 : S;
  sh.window = window >= p->seqs.longest ? 0 : window;  // a window past every document hides nothing
  if (packed) {
    std::vector<int32_t> off_q(n + 1), off_kv(n + 1);
    for (int64_t i = 0; i <= n; ++i) {
      const int64_t token = i < n ? p->seqs.first[i] : B * S;
      off_q[i] = static_cast<int32_t>(token * Hq * D);
      off_kv[i] = static_cast<int32_t>(token * Hkv * D);
    }
    p->seq_len = upload(s, p->seqs.length);
    p->first = upload(s, p->seqs.first);
    p->off_q = upload(s, off_q);
    p->off_kv = upload(s, off_kv);
  }
  return "";
}

void set_ragged(const Problem& p, sdpa::Tensors& t) {
  if (!p.shape.ragged) return;
  t.seq_len = static_cast<const int32_t*>(p.seq_len.raw_data());
  t.off_q = static_cast<const int32_t*>(p.off_q.raw_data());
  t.off_kv = static_cast<const int32_t*>(p.off_kv.raw_data());
}

void move_stats(Stream& s, const Problem& p, NDArray& stats, NDArray& lse, int64_t S, bool to_lse) {
  const sdpa::Shape& sh = p.shape;
  const int64_t n = sh.batch * sh.Hq * sh.seq;
  move_stats_kernel<<<blocks_for(n), kThreads, 0, native(s)>>>(
      stats.data<float>(), lse.data<float>(), static_cast<const int32_t*>(p.first.raw_data()),
      static_cast<const int32_t*>(p.seq_len.raw_data()), sh.batch, sh.Hq, sh.seq, S, to_lse);
  launched(to_lse ? "attention (cuDNN): stats to lse" : "attention (cuDNN): lse to stats");
}

bool f32_like(const NDArray& a, const Shape& shape) {
  return a.dtype() == DType::F32 && a.is_contiguous() && a.shape() == shape;
}

// f32 or bf16 (an array cuDNN's bf16 tensors are read from or written to).
bool float_like(const NDArray& a, const Shape& shape) {
  return (a.dtype() == DType::F32 || a.dtype() == DType::BF16) && a.is_contiguous() && a.shape() == shape;
}

}  // namespace

CudnnAttention cudnn_attention_mode() {
  int m = g_mode.load();
  if (m < 0) {
    int expected = -1;
    g_mode.compare_exchange_strong(expected, static_cast<int>(mode_from_environment()));
    m = g_mode.load();
  }
  return static_cast<CudnnAttention>(m);
}

void set_cudnn_attention_mode(CudnnAttention mode) { g_mode = static_cast<int>(mode); }

std::string cudnn_attention_fallback_reason() {
  std::lock_guard<std::mutex> lock(g_reason_mutex);
  return g_reason;
}

int64_t cudnn_attention_calls() { return g_calls.load(); }

int64_t cudnn_attention_fallbacks() { return g_fallbacks.load(); }

std::string cudnn_attention_last_fallback() {
  std::lock_guard<std::mutex> lock(g_reason_mutex);
  return g_last_fallback;
}

bool sdpa_attention_forward(Stream& s, const NDArray& q, const NDArray& k, const NDArray& v,
                            const NDArray& host_documents, float scale, NDArray& out, NDArray& lse,
                            DType products, int64_t window) {
  Problem p;
  const std::string why = prepare(s, q, k, v, host_documents, scale, products, window, &p);
  if (why == "-") return false;
  if (!why.empty()) return fall_back(why);
  const int64_t B = q.dim(0), S = q.dim(1), Hq = q.dim(2);
  if (!float_like(out, q.shape()) || !f32_like(lse, {B, Hq, S}))
    return fall_back("an output that is not a contiguous f32 or bf16 [B, S, Hq, D] with an f32 lse [B, Hq, S]");
  const NDArray qb = as_bf16(s, q), kb = as_bf16(s, k), vb = as_bf16(s, v);
  NDArray stats = p.shape.ragged ? NDArray::empty({p.shape.batch, Hq, p.shape.seq}, DType::F32, q.device()) : lse;
  sdpa::Tensors t;
  t.q = qb.raw_data(), t.k = kb.raw_data(), t.v = vb.raw_data();
  t.stats = stats.data<float>();
  set_ragged(p, t);
  std::string refused;
  // cuDNN writes a bf16 O: into `out` itself where it is bf16, else widened
  // into it. Never an fp32 O tensor: cuDNN 9.14 accepted one and wrote a
  // wrong O (docs/cuda.md, "Attention on cuDNN").
  NDArray ob = out.dtype() == DType::BF16 ? out : NDArray::empty(q.shape(), DType::BF16, q.device());
  t.o = ob.raw_data();
  if (!sdpa::forward(s, p.shape, t, &refused)) return fall_back(refused);
  if (out.dtype() == DType::F32) to_f32(s, ob, out);
  if (p.shape.ragged) move_stats(s, p, stats, lse, S, true);
  served();
  return true;
}

bool sdpa_attention_backward(Stream& s, const NDArray& q, const NDArray& k, const NDArray& v, const NDArray& out,
                             const NDArray& lse, const NDArray& grad_out, const NDArray& host_documents,
                             float scale, NDArray& dq, NDArray& dk, NDArray& dv, DType products, int64_t window) {
  Problem p;
  const std::string why = prepare(s, q, k, v, host_documents, scale, products, window, &p);
  if (why == "-") return false;
  if (!why.empty()) return fall_back(why);
  const int64_t B = q.dim(0), S = q.dim(1), Hq = q.dim(2);
  if (!float_like(out, q.shape()) || !float_like(grad_out, q.shape()) || !f32_like(lse, {B, Hq, S}) ||
      !float_like(dq, q.shape()) || !float_like(dk, k.shape()) || !float_like(dv, v.shape()))
    return fall_back("backward arrays that are not contiguous (O, dO, dq, dk, dv f32 or bf16 like q, lse f32)");
  const NDArray qb = as_bf16(s, q), kb = as_bf16(s, k), vb = as_bf16(s, v);
  const NDArray gb = as_bf16(s, grad_out);
  // cuDNN writes bf16 gradients: into dq, dk and dv themselves where they are bf16.
  const auto bf16_target = [&](const NDArray& d) {
    return d.dtype() == DType::BF16 ? d : NDArray::empty(d.shape(), DType::BF16, q.device());
  };
  NDArray dqb = bf16_target(dq), dkb = bf16_target(dk), dvb = bf16_target(dv);
  NDArray lse_in = lse;  // only read: dense, cuDNN reads the statistics from lse itself
  NDArray stats = lse_in;
  if (p.shape.ragged) {
    stats = NDArray::empty({p.shape.batch, Hq, p.shape.seq}, DType::F32, q.device());
    move_stats(s, p, stats, lse_in, S, false);
  }
  sdpa::Tensors t;
  t.q = qb.raw_data(), t.k = kb.raw_data(), t.v = vb.raw_data(), t.d_o = gb.raw_data();
  t.stats = stats.data<float>();
  t.dq = dqb.raw_data(), t.dk = dkb.raw_data(), t.dv = dvb.raw_data();
  set_ragged(p, t);
  std::string refused;
  // O as cuDNN wrote it: an f32 O holds the bf16 values widened, so the
  // rounding back is exact.
  const NDArray ob = as_bf16(s, out);
  t.o = ob.raw_data();
  if (!sdpa::backward(s, p.shape, t, &refused)) return fall_back(refused);
  if (dq.dtype() == DType::F32) to_f32(s, dqb, dq);
  if (dk.dtype() == DType::F32) to_f32(s, dkb, dk);
  if (dv.dtype() == DType::F32) to_f32(s, dvb, dv);
  served();
  return true;
}

}  // namespace hspmd::kernels::cuda
