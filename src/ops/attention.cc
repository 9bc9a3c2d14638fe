// attention: causal grouped-query attention, optionally restricted to
// documents (cu_seqlens or per-token positions); attention_grad: its
// backward. Outputs of the forward: out [B, S, Hq, D] and the rows'
// log-sum-exp lse [B, Hq, S], kept for the backward. With q's sequence split
// over cp ranks, both run as ring attention (context parallelism) over the
// cp group. An optional sliding window W (query i sees keys i - W < j <= i)
// applies on every path, in global indices under the ring. See
// docs/attention.md.
// Deduction: batch and heads (q's and k/v's heads split by the same degree,
// which keeps GQA groups together) pass; the head dim must be whole; the
// sequence may be split (q, k, v and positions alike) only with
// context_parallel; lse follows; cu_seqlens must be whole. attention_grad is
// linear in grad_out.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>

#include "hspmd/comm/communicator.h"
#include "hspmd/ops/ops.h"
#include "kernels/attention.h"
#include "kernels/kernels.h"
#include "kernels/memory.h"
#include "op_util.h"

namespace hspmd::ops {

namespace {

constexpr const char* kOp = "attention";

void expect_rank(const char* what, const TensorMeta& m, size_t rank) {
  if (m.shape.size() != rank)
    fail("[attention] ", what, " must have rank ", rank, ", got ", sym_shape_str(m.shape));
}

void expect_heads_divide(const SymDim& hq, const SymDim& hkv) {
  bool divides = true;
  try {
    hq.divide(hkv);
  } catch (const Error&) {
    divides = false;
  }
  if (!divides)
    fail("[attention] kv heads ", hkv.str(), " must divide query heads ", hq.str());
}

// The documents input: cu_seqlens i32 [n+1] or positions i32 [B, S].
void check_documents(const TensorMeta& q, const TensorMeta& documents) {
  expect_dtype(kOp, "documents", documents, DType::I32);
  if (documents.shape.size() == 2) {
    if (!(documents.shape[0] == q.shape[0]) || !(documents.shape[1] == q.shape[1]))
      fail("[attention] document positions must be [B, S] like q's, got ",
           sym_shape_str(documents.shape), " for q ", sym_shape_str(q.shape));
  } else if (documents.shape.size() != 1) {
    fail("[attention] documents must be cu_seqlens [n+1] or positions [B, S], got ",
         sym_shape_str(documents.shape));
  }
}

// Shape rule shared by both ops: q, k, v and the optional documents.
void check_qkv(const TensorMeta& q, const TensorMeta& k, const TensorMeta& v,
               const TensorMeta* documents) {
  const char* names[] = {"q", "k", "v"};
  const TensorMeta* metas[] = {&q, &k, &v};
  if (q.dtype != DType::F32 && q.dtype != DType::BF16)
    fail("[attention] q must be f32 or bf16, got ", dtype_name(q.dtype));
  for (int i = 0; i < 3; ++i) {
    expect_dtype(kOp, names[i], *metas[i], q.dtype);
    expect_rank(names[i], *metas[i], 4);
  }
  if (k.shape != v.shape)
    fail("[attention] k and v shapes differ: ", sym_shape_str(k.shape), " vs ",
         sym_shape_str(v.shape));
  if (!(q.shape[0] == k.shape[0]) || !(q.shape[1] == k.shape[1]))
    fail("[attention] q and k must share [B, S], got ", sym_shape_str(q.shape), " and ",
         sym_shape_str(k.shape));
  if (!(q.shape[3] == k.shape[3]))
    fail("[attention] head dims differ: q has ", q.shape[3].str(), ", k has ",
         k.shape[3].str());
  expect_heads_divide(q.shape[2], k.shape[2]);
  if (documents) check_documents(q, *documents);
}

// Labels b, s, h (heads), d; `n_in` inputs: q, k, v[, out, lse, grad_out]
// [, documents]; outputs out, lse (forward) or dq, dk, dv (backward).
// Positions ([B, S], documents_rank 2) split like q; cu_seqlens stay whole.
DimRule attention_rule(size_t n_in, bool backward, bool context_parallel, int documents_rank) {
  const std::vector<std::string> qkv = {"b", "s", "h", "d"}, lse = {"b", "h", "s"};
  DimRule rule;
  rule.inputs = {qkv, qkv, qkv};
  rule.input_names = {"q", "k", "v"};
  if (backward) {
    rule.inputs.insert(rule.inputs.end(), {qkv, lse, qkv});
    rule.input_names.insert(rule.input_names.end(), {"out", "lse", "grad_out"});
    rule.outputs = {qkv, qkv, qkv};
    rule.linear = {false, false, false, false, false, true};
  } else {
    rule.outputs = {qkv, lse};
  }
  if (rule.inputs.size() < n_in) {
    rule.inputs.push_back(documents_rank == 2 ? std::vector<std::string>{"b", "s"}
                                              : std::vector<std::string>{"docs"});
    rule.input_names.push_back(documents_rank == 2 ? "positions" : "cu_seqlens");
  }
  rule.unsplittable["d"] = "attention contracts the head dim";
  rule.unsplittable["docs"] = "every device needs all document boundaries";
  if (!context_parallel)
    rule.unsplittable["s"] = "attention needs the whole sequence unless context_parallel is set";
  return rule;
}

// Rank of input `i` of the node (0 when absent): tells positions from cu_seqlens.
int documents_rank(const Node& node, size_t i) {
  return i < node.inputs.size() ? node.inputs[i].ndim() : 0;
}

NDArray optional_input(const std::vector<NDArray>& in, size_t i) {
  return i < in.size() ? in[i].contiguous() : NDArray();
}

// ---- context parallelism: ring attention over the cp group ----

constexpr int kTagRelayout = 7100;  // + the receiver's position (0 or 1)
constexpr int kTagKv = 7110;
constexpr int kTagGrad = 7111;

// This rank's place in the ring: n cp ranks, chunk c of a sequence of S
// tokens, cut into 2n halves of `half` tokens. Rank c holds halves 2c, 2c+1
// in the annotation's contiguous order and halves c, 2n-1-c in zigzag order,
// where every rank has the same share of the causal work.
struct Ring {
  Communicator* cp = nullptr;
  Stream* stream = nullptr;  // the op's (ctx.stream): the block kernels run on it
  int n = 1, c = 0;
  int64_t S = 0, half = 0;
  Box q_box;  // q's global box on this rank
  int next() const { return (c + 1) % n; }
  int prev() const { return (c + n - 1) % n; }
  int64_t local() const { return 2 * half; }
  // The half at zigzag position p of rank r, and where half g sits in zigzag order.
  int64_t zigzag_half(int r, int p) const { return p == 0 ? r : 2 * n - 1 - r; }
  std::pair<int, int> zigzag_place(int64_t g) const {
    if (g < n) return {static_cast<int>(g), 0};
    return {static_cast<int>(2 * n - 1 - g), 1};
  }
  std::pair<int, int> contiguous_place(int64_t g) const {
    return {static_cast<int>(g / 2), static_cast<int>(g % 2)};
  }
  // Global sequence indices of rank r's rows in zigzag order.
  std::vector<int64_t> zigzag_index(int r) const {
    std::vector<int64_t> index;
    for (int p = 0; p < 2; ++p)
      for (int64_t i = 0; i < half; ++i) index.push_back(zigzag_half(r, p) * half + i);
    return index;
  }
};

// The ring of this call, or none when q holds whole sequences. Every cp
// rank computes the same errors here (from global sizes), so all throw alike.
std::optional<Ring> ring_of(const OpContext& ctx, int documents_rank) {
  if (ctx.shard == nullptr) return std::nullopt;
  const Box& box = ctx.shard->input_boxes.at(0);
  const int64_t S = ctx.shard->input_global_shapes.at(0).at(1);
  if (box.end.at(1) - box.begin.at(1) == S) return std::nullopt;
  Ring ring;
  ring.stream = ctx.stream;
  ring.q_box = box;
  ring.cp = &ctx.shard->group_along(0, 1);
  ring.n = ring.cp->size();
  ring.c = ring.cp->rank();
  ring.S = S;
  if (S % (2 * ring.n) != 0)
    fail("[attention] context parallelism over cp=", ring.n,
         " needs the sequence length S divisible by 2*cp, got S=", S);
  if (documents_rank == 1)
    fail("[attention] context parallelism over cp=", ring.n,
         " needs documents as positions [B, S] or none: cu_seqlens cannot be split along the "
         "sequence");
  if (S >= (int64_t{1} << 24))  // document starts travel as f32
    fail("[attention] context parallelism needs S below 2^24 tokens, got S=", S);
  ring.half = S / (2 * ring.n);
  return ring;
}

// Copies half p (along `dim`) of a contiguous array to / from elements
// [offset, offset + numel / 2) of the flat array `packed`, row-major.
void copy_half(Stream& stream, const NDArray& a, int dim, int p, const NDArray& packed,
               int64_t offset, bool pack) {
  const int64_t h = a.dim(dim) / 2;
  Shape extent = a.shape(), at(a.ndim(), 0), zero(a.ndim(), 0);
  extent[dim] = h;
  at[dim] = p * h;
  NDArray part = packed.slice(0, offset, offset + shape_numel(extent)).reshape(extent);
  NDArray target = a;
  if (pack)
    kernels::copy_block(stream, a, at, part, zero, extent);
  else
    kernels::copy_block(stream, part, zero, target, at, extent);
}

// Copies half p of every array to / from one packed message.
void copy_halves(Stream& stream, const std::vector<NDArray>& arrays, const std::vector<int>& dims,
                 int p, const NDArray& packed, bool pack) {
  int64_t offset = 0;
  for (size_t i = 0; i < arrays.size(); offset += arrays[i].numel() / 2, ++i)
    copy_half(stream, arrays[i], dims[i], p, packed, offset, pack);
}

// Where the local half p goes in a relayout (its new owner and position
// there), and where the half that lands at position p comes from.
std::pair<int, int> relayout_destination(const Ring& ring, int p, bool to_zigzag) {
  const int64_t g = to_zigzag ? 2 * ring.c + p : ring.zigzag_half(ring.c, p);
  return to_zigzag ? ring.zigzag_place(g) : ring.contiguous_place(g);
}
int relayout_source(const Ring& ring, int p, bool to_zigzag) {
  const int64_t g = to_zigzag ? ring.zigzag_half(ring.c, p) : 2 * ring.c + p;
  return (to_zigzag ? ring.contiguous_place(g) : ring.zigzag_place(g)).first;
}

// Bytes a relayout of `count` floats per half sends and receives.
void relayout_bytes(const Ring& ring, int64_t count, bool to_zigzag, OpTraffic& t) {
  for (int p = 0; p < 2; ++p) {
    if (relayout_destination(ring, p, to_zigzag).first != ring.c) t.sent += count * 4;
    if (relayout_source(ring, p, to_zigzag) != ring.c) t.received += count * 4;
  }
}

// Moves the sequence halves of `arrays` (f32, contiguous, sequence along
// dims[i]) from contiguous to zigzag order or back, one message per half.
std::vector<NDArray> relayout(const Ring& ring, const std::vector<NDArray>& arrays,
                              const std::vector<int>& dims, bool to_zigzag) {
  int64_t count = 0;
  for (const NDArray& a : arrays) count += a.numel() / 2;
  Stream& stream = *ring.stream;
  const Device device = stream.device();
  NDArray sent[2], got[2];
  std::vector<Request> requests;
  for (int p = 0; p < 2; ++p) {
    const auto [peer, pos] = relayout_destination(ring, p, to_zigzag);
    sent[p] = NDArray::empty({count}, DType::F32, device);
    copy_halves(stream, arrays, dims, p, sent[p], true);
    if (peer == ring.c)
      got[pos] = sent[p];
    else
      requests.push_back(ring.cp->start_send(stream, sent[p], peer, kTagRelayout + pos));
  }
  for (int p = 0; p < 2; ++p) {
    const int peer = relayout_source(ring, p, to_zigzag);
    if (peer == ring.c) continue;
    got[p] = NDArray::empty({count}, DType::F32, device);
    requests.push_back(ring.cp->start_recv(stream, got[p], peer, kTagRelayout + p));
  }
  ring.cp->wait_all(requests);
  std::vector<NDArray> result;
  for (const NDArray& a : arrays) result.push_back(NDArray::empty(a.shape(), DType::F32, device));
  for (int p = 0; p < 2; ++p) copy_halves(stream, result, dims, p, got[p], false);
  return result;
}

// This rank's own problems: a chunk that is not its equal share of the
// sequence in cp order, or a negative position ("" when none).
std::string chunk_error(const Ring& ring, const NDArray& positions, std::vector<int32_t>& start) {
  const int64_t first = ring.c * ring.local();
  const Box& q_box = ring.q_box;
  if (q_box.begin.at(1) != first || q_box.end.at(1) != first + ring.local())
    return detail::concat("[attention] context parallelism over cp=", ring.n,
                          " needs q's sequence cut into equal chunks in cp order: rank ", ring.c,
                          " holds [", q_box.begin[1], ", ", q_box.end[1], ") of S=", ring.S);
  if (!positions.valid()) return "";
  try {
    start = kernels::document_starts_from_positions(*ring.stream, positions, first);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Global document starts of this rank's chunk, as f32 [B, L] for the
// relayout (zeros without positions). The cp ranks agree on errors first
// (one all-reduce of 2 floats), so that none waits forever for another.
NDArray chunk_starts(const Ring& ring, const NDArray& positions, int64_t B) {
  std::vector<int32_t> start(B * ring.local(), 0);
  const std::string error = chunk_error(ring, positions, start);
  const bool positions_bad = error.rfind("[attention] document positions", 0) == 0;
  float bad[2] = {!error.empty() && !positions_bad ? 1.0f : 0.0f, positions_bad ? 1.0f : 0.0f};
  ring.cp->all_reduce(bad, 2);
  if (!error.empty()) throw Error(error);
  if (bad[0] > 0)
    fail("[attention] context parallelism over cp=", ring.n,
         " needs q's sequence cut into equal chunks in cp order: another cp rank's chunk is not");
  if (bad[1] > 0)
    fail("[attention] document positions: a cp rank holds a negative position (rule: "
         "positions >= 0)");
  return kernels::to_device(*ring.stream, NDArray::from_vector({B, ring.local()},
                                                               std::vector<float>(start.begin(), start.end())));
}

std::vector<int32_t> starts_of(Stream& stream, const NDArray& f) {
  const std::vector<float> v = kernels::to_host(stream, f).to_vector();
  return std::vector<int32_t>(v.begin(), v.end());
}

// Keys and values of one block, packed to travel as one message: [2, B, L, Hkv, D].
NDArray part(const NDArray& packed, int i) {
  const Shape shape(packed.shape().begin() + 1, packed.shape().end());
  return packed.slice(0, i, i + 1).reshape(shape);
}

NDArray kv_pack(Stream& stream, const NDArray& k, const NDArray& v) {
  Shape shape = k.shape();
  shape.insert(shape.begin(), 2);
  NDArray kv = NDArray::empty(shape, DType::F32, stream.device());
  NDArray pk = part(kv, 0), pv = part(kv, 1);
  kernels::copy(stream, k, pk);
  kernels::copy(stream, v, pv);
  return kv;
}

Request send_to_next(const Ring& ring, const NDArray& a, int tag) {
  return ring.cp->start_send(*ring.stream, a, ring.next(), tag);
}

Request receive_from_prev(const Ring& ring, NDArray& a, int tag) {
  return ring.cp->start_recv(*ring.stream, a, ring.prev(), tag);
}

// Starts sending `block` to the next rank and receiving the previous rank's into `into`.
std::vector<Request> pass_on(const Ring& ring, const NDArray& block, NDArray& into, int tag) {
  std::vector<Request> r;
  r.push_back(send_to_next(ring, block, tag));
  r.push_back(receive_from_prev(ring, into, tag));
  return r;
}

// The zigzag inputs of one rank: queries (and their rows' data) stay, blocks of k, v travel.
struct RingInputs {
  NDArray q, kv;
  std::vector<int64_t> q_index;
  std::vector<int32_t> start;
  float scale;
  DType products;
  int64_t window;
  kernels::AttentionBlock block(const Ring& ring, const NDArray& kv_now, int step,
                                std::vector<int64_t>& k_index) const {
    k_index = ring.zigzag_index((ring.c - step + ring.n) % ring.n);
    return {q,       q_index, start,    part(kv_now, 0), part(kv_now, 1),
            k_index, scale,   products, window};
  }
  // Whether the window hides every key of the block from every local query
  // (then the block travels on but is not computed).
  bool hidden(const kernels::AttentionBlock& blk) const {
    return window > 0 && kernels::attention_block_hidden(blk);
  }
};

// Ring forward: out, lse of the local zigzag queries over every block. The
// first block is x.kv itself, whose storage then receives a later block.
void ring_forward(const Ring& ring, const RingInputs& x, NDArray& out, NDArray& lse) {
  const kernels::AttentionTiles tiles = kernels::attention_tiles();
  const int64_t B = x.q.dim(0), L = x.q.dim(1), Hq = x.q.dim(2);
  out = NDArray::empty(x.q.shape(), DType::F32, x.q.device());
  lse = NDArray::empty({B, Hq, L}, DType::F32, x.q.device());
  NDArray out_blk = NDArray::empty(out.shape(), DType::F32, x.q.device());
  NDArray lse_blk = NDArray::empty(lse.shape(), DType::F32, x.q.device());
  NDArray now = x.kv, next = NDArray::empty(x.kv.shape(), DType::F32, x.kv.device());
  std::vector<int64_t> k_index;
  for (int s = 0; s < ring.n; ++s) {
    std::vector<Request> moving;
    if (s + 1 < ring.n) moving = pass_on(ring, now, next, kTagKv);
    const kernels::AttentionBlock blk = x.block(ring, now, s, k_index);
    if (s == 0) {  // the own block: every query sees at least itself
      kernels::attention_block_forward(*ring.stream, blk, out, lse, tiles);
    } else if (!x.hidden(blk)) {
      kernels::attention_block_forward(*ring.stream, blk, out_blk, lse_blk, tiles);
      kernels::attention_merge(*ring.stream, out, lse, out_blk, lse_blk);
    }
    ring.cp->wait_all(moving);
    std::swap(now, next);
  }
}

// Ring backward: dq stays; the gradients of each block ([2, ...] like kv)
// follow it round the ring, each rank adding its share, and reach the
// block's owner after n hops. Returns dq and the own block's dk, dv (packed).
std::pair<NDArray, NDArray> ring_backward(const Ring& ring, const RingInputs& x,
                                          const NDArray& out, const NDArray& lse,
                                          const NDArray& grad_out) {
  const kernels::AttentionTiles tiles = kernels::attention_tiles();
  NDArray delta = NDArray::empty(lse.shape(), DType::F32, lse.device());
  kernels::attention_row_dots(*ring.stream, out, grad_out, delta, x.products == DType::BF16);
  NDArray dq = kernels::zeros(*ring.stream, x.q.shape(), DType::F32);
  const Shape& shape = x.kv.shape();
  const Device device = x.kv.device();
  NDArray now = x.kv, next = NDArray::empty(shape, DType::F32, device);
  NDArray grads[2] = {NDArray::empty(shape, DType::F32, device), NDArray::empty(shape, DType::F32, device)};
  NDArray arrived = NDArray::empty(shape, DType::F32, device);
  std::vector<Request> sending[2], incoming;
  std::vector<int64_t> k_index;
  for (int s = 0; s < ring.n; ++s) {
    std::vector<Request> moving;
    if (s + 1 < ring.n) moving = pass_on(ring, now, next, kTagKv);
    if (s > 0)  // what the ranks before this one added to this block's gradients
      incoming.push_back(receive_from_prev(ring, arrived, kTagGrad));
    NDArray& g = grads[s % 2];
    ring.cp->wait_all(sending[s % 2]);
    kernels::fill(*ring.stream, g, 0.0f);
    NDArray dk = part(g, 0), dv = part(g, 1);
    const kernels::AttentionBlock blk = x.block(ring, now, s, k_index);
    if (!x.hidden(blk))  // a hidden block's gradients stay zero but still travel
      kernels::attention_block_backward(*ring.stream, blk, grad_out, lse, delta, dq, dk, dv, tiles);
    ring.cp->wait_all(incoming);
    if (s > 0) kernels::accumulate(*ring.stream, arrived, g);  // g += arrived
    sending[s % 2].push_back(send_to_next(ring, g, kTagGrad));
    ring.cp->wait_all(moving);
    std::swap(now, next);
  }
  incoming.push_back(receive_from_prev(ring, arrived, kTagGrad));
  ring.cp->wait_all(incoming);
  ring.cp->wait_all(sending[0]);
  ring.cp->wait_all(sending[1]);
  return {dq, arrived};
}

// Relayouts q, k, v (and the documents' starts) into zigzag order; `extra`
// (with sequence dims extra_dims) come along.
RingInputs ring_inputs(const Ring& ring, const std::vector<NDArray>& in, const NDArray& positions,
                       float scale, DType products, int64_t window,
                       const std::vector<NDArray>& extra,
                       const std::vector<int>& extra_dims, std::vector<NDArray>& extra_zigzag) {
  std::vector<NDArray> arrays = {in[0], in[1], in[2], chunk_starts(ring, positions, in[0].dim(0))};
  std::vector<int> dims = {1, 1, 1, 1};
  arrays.insert(arrays.end(), extra.begin(), extra.end());
  dims.insert(dims.end(), extra_dims.begin(), extra_dims.end());
  std::vector<NDArray> z = relayout(ring, arrays, dims, true);
  extra_zigzag.assign(z.begin() + 4, z.end());
  return RingInputs{z[0],  kv_pack(*ring.stream, z[1], z[2]), ring.zigzag_index(ring.c),
                    starts_of(*ring.stream, z[3]), scale, products, window};
}

// Inputs: q, k, v[, documents]. Outputs: out, lse (contiguous order).
// The output merges f32 partial outputs; a bf16 `out_dtype` rounds the
// merged one once (after the relayout, which moves f32 as counted).
void ring_attention(const Ring& ring, const std::vector<NDArray>& in, const NDArray& positions,
                    float scale, DType products, int64_t window, DType out_dtype, std::vector<NDArray>& out) {
  std::vector<NDArray> none;
  const RingInputs x = ring_inputs(ring, in, positions, scale, products, window, {}, {}, none);
  NDArray o, lse;
  ring_forward(ring, x, o, lse);
  std::vector<NDArray> back = relayout(ring, {o, lse}, {1, 2}, false);
  out[0] = out_dtype == DType::F32 ? back[0] : kernels::cast(*ring.stream, back[0], out_dtype);
  out[1] = back[1];
}

// Inputs: q, k, v, out, lse, grad_out[, documents]. Outputs: dq, dk, dv.
void ring_attention_grad(const Ring& ring, const std::vector<NDArray>& in,
                         const NDArray& positions, float scale, DType products, int64_t window,
                         DType grads_dtype, std::vector<NDArray>& out) {
  std::vector<NDArray> z;
  const RingInputs x = ring_inputs(ring, in, positions, scale, products, window,
                                   {in[3], in[4], in[5]}, {1, 2, 1}, z);
  const auto [dq, dkv] = ring_backward(ring, x, z[0], z[1], z[2]);
  std::vector<NDArray> back = relayout(ring, {dq, part(dkv, 0), part(dkv, 1)}, {1, 1, 1}, false);
  for (int i = 0; i < 3; ++i)
    out[i] = grads_dtype == DType::F32 ? back[i] : kernels::cast(*ring.stream, back[i], grads_dtype);
}

// What ring_attention (or ring_attention_grad) sends and receives on this
// rank per call: the error agreement (an all-reduce of 2 floats), the
// relayouts into zigzag order and back, and the ring: n - 1 hops of the
// packed keys and values, and in the backward n hops of their gradients.
OpTraffic ring_traffic(const ShardContext& shard, bool backward) {
  const Box& q = shard.input_boxes.at(0);
  const int64_t S = shard.input_global_shapes.at(0).at(1);
  if (q.end.at(1) - q.begin.at(1) == S) return {};
  OpTraffic t{"ring_attention", shard.ranks_along(0, 1)};
  Ring ring;
  ring.n = static_cast<int>(t.group.size());
  ring.S = S;
  if (S % (2 * ring.n) != 0) return t;  // the op refuses it before sending anything
  ring.half = S / (2 * ring.n);
  ring.c = static_cast<int>(q.begin[1] / ring.local());
  const Shape ql = q.shape(), kl = shard.input_boxes.at(1).shape();
  const int64_t qn = ql[0] * ql[1] * ql[2] * ql[3], kn = kl[0] * kl[1] * kl[2] * kl[3];
  const int64_t rows = ql[0] * ql[1], lse = ql[0] * ql[2] * ql[1];
  const int64_t agree = 2 * 4 * 2 * (ring.n - 1) / ring.n;
  t.sent += agree;
  t.received += agree;
  const int64_t in = qn + 2 * kn + rows + (backward ? qn + lse + qn : 0);  // q, k, v, starts[, out, lse, dout]
  relayout_bytes(ring, in / 2, true, t);
  const int64_t hops = (ring.n - 1) * 2 * kn * 4 + (backward ? ring.n * 2 * kn * 4 : 0);
  t.sent += hops;
  t.received += hops;
  relayout_bytes(ring, (backward ? qn + 2 * kn : qn + lse) / 2, false, t);  // dq, dk, dv / out, lse
  return t;
}

std::vector<NDArray> contiguous_inputs(const std::vector<NDArray>& in, size_t n) {
  std::vector<NDArray> c;
  for (size_t i = 0; i < n; ++i) c.push_back(in[i].contiguous());
  return c;
}

// bf16 arrays as exact f32 copies: ring attention moves and merges f32
// (its traffic is counted at 4 bytes per element).
std::vector<NDArray> widened(Stream& s, std::vector<NDArray> arrays) {
  for (NDArray& a : arrays) a = kernels::as_f32(s, a);
  return arrays;
}

// The (query, key) pairs a causal document of n tokens keeps under a window
// W (0: none), each query's own key counted half: sum over positions p of
// min(p + 1, W) - 1/2, which is n^2 / 2 without a window (or with W >= n).
double causal_pairs(int64_t n, int64_t window) {
  const double len = static_cast<double>(n);
  const double w = window > 0 ? static_cast<double>(std::min(window, n)) : len;
  return w * (w + 1) / 2 + (len - w) * w - len / 2;
}

// The score and value products of causal attention on this rank: q's local
// rows against the keys of the whole sequence (ring attention visits every
// cp rank's keys), half of them unmasked: 2 * B * Hq * D * Sq * Sk. With a
// window W: 4 * B * Hq * D per kept pair, the rank's Sq / Sk share of a whole
// row's causal_pairs(Sk, W) (the zigzag ring spreads them evenly, but for
// the first W tokens).
double attention_products(const std::vector<Shape>& in, const ShardContext* shard,
                          int64_t window) {
  const Shape& q = in.at(0);
  const int64_t sk = shard ? shard->input_global_shapes.at(1).at(1) : in.at(1).at(1);
  if (window > 0 && sk > 0)
    return 4.0 * static_cast<double>(q[0] * q[2] * q[3]) * causal_pairs(sk, window) *
           static_cast<double>(q[1]) / static_cast<double>(sk);
  return 2.0 * static_cast<double>(q[0] * q[2] * q[3]) * static_cast<double>(q[1]) * static_cast<double>(sk);
}

// attention_products under a document mask, on whole rows: 4 * Hq * D per
// (query, key) pair the mask keeps. A query at position p of its document
// keeps p + 1 keys; each is counted p + 1/2 so that one document per row
// bills what no documents bill (S^2 / 2 pairs a row); cu_seqlens give
// n^2 / 2 per document of n. A window W > 0 keeps min(p + 1, W) keys of a
// query at position p, counted min(p + 1, W) - 1/2 (causal_pairs).
double document_products(const Shape& q, const NDArray& documents, int64_t window) {
  const NDArray d = kernels::to_host(default_stream(documents.device()), documents).contiguous();
  const int32_t* v = d.host_data<int32_t>("document_products");
  double pairs = 0;
  if (d.ndim() == 2) {
    const int64_t rows = d.shape()[0], s = d.shape()[1];
    for (int64_t b = 0; b < rows; ++b)
      for (int64_t i = 0; i < s; ++i) {
        const int64_t p = std::max<int64_t>(0, v[b * s + i]);
        if (window > 0)
          pairs += static_cast<double>(std::min(std::min(p, i) + 1, window)) - 0.5;
        else
          pairs += static_cast<double>(std::min(p, i)) + 0.5;
      }
  } else {
    for (int64_t j = 0; j + 1 < d.numel(); ++j) {
      const double n = static_cast<double>(v[j + 1] - v[j]);
      pairs += window > 0 ? causal_pairs(v[j + 1] - v[j], window) : n * n / 2;
    }
  }
  return 4.0 * static_cast<double>(q[2] * q[3]) * pairs;
}

// Op::flops_on of both attention ops: the document mask when there is one
// and the rows are whole on the rank. Under context parallelism the count
// stays the shapes' (with the window's share): the ring balances the work
// over its zigzag chunks, whose positions a rank's contiguous slice does not
// hold.
double attention_products_on(const std::vector<NDArray>& in, size_t documents_at,
                             const ShardContext* shard, int64_t window) {
  std::vector<Shape> shapes;
  for (size_t i = 0; i < std::min<size_t>(in.size(), 2); ++i) shapes.push_back(in[i].shape());
  const bool whole_rows = !shard || shard->input_global_shapes.at(1).at(1) == shapes[1][1];
  if (documents_at >= in.size() || !in[documents_at].valid() || !whole_rows)
    return attention_products(shapes, shard, window);
  return document_products(shapes[0], in[documents_at], window);
}

// Inputs: q, k, v, out, lse, grad_out[, documents]. Outputs: dq, dk, dv, in
// `grads` (f32, or bf16 where the forward's output is bf16: cuDNN writes
// them so).
class AttentionGradOp final : public Op {
 public:
  AttentionGradOp(float scale, bool context_parallel, DType products, int64_t window, DType grads)
      : scale_(scale), context_parallel_(context_parallel), products_(products), window_(window), grads_(grads) {}
  std::string type() const override { return "attention_grad"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    if (in.size() != 6 && in.size() != 7)
      fail("[attention_grad] expected 6 or 7 inputs, got ", in.size());
    check_qkv(in[0], in[1], in[2], in.size() == 7 ? &in[6] : nullptr);
    expect_same_shape("attention_grad", in[0], in[3]);
    expect_same_shape("attention_grad", in[0], in[5]);
    const SymShape& q = in[0].shape;
    if (in[4].shape != SymShape{q[0], q[2], q[1]})
      fail("[attention_grad] lse must be [B, Hq, S], got ", sym_shape_str(in[4].shape));
    // f32 gradients whatever q, k and v hold (they feed f32 RoPE gradients
    // and GEMM gradients that round them to bf16 themselves), unless asked
    // for bf16 ones: on a GPU cuDNN writes them in bf16, which RoPE's
    // backward and the projections' GEMMs then read as they are (no
    // widening pass, no f32 RoPE gradient, no rounding cast).
    return {TensorMeta{in[0].shape, grads_}, TensorMeta{in[1].shape, grads_}, TensorMeta{in[2].shape, grads_}};
  }
  OpTraffic traffic(const ShardContext& shard) const override { return ring_traffic(shard, true); }
  // The scores again, then dV, dP, dQ and dK: 2.5 times the forward's products.
  double flops(const std::vector<Shape>& in, const std::vector<Shape>&, const ShardContext* shard) const override {
    return 2.5 * attention_products(in, shard, window_);
  }
  double flops_on(const std::vector<NDArray>& in, const std::vector<Shape>&, const ShardContext* shard) const override {
    return 2.5 * attention_products_on(in, 6, shard, window_);
  }
  bool may_communicate() const override { return context_parallel_; }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    const NDArray documents = optional_input(in, 6);
    std::vector<NDArray> x = contiguous_inputs(in, 6);
    if (auto ring = ring_of(ctx, documents.valid() ? documents.ndim() : 0))
      return ring_attention_grad(*ring, widened(*ctx.stream, x), documents, scale_, products_, window_, grads_,
                                 out);
    for (int i = 0; i < 3; ++i) out[i] = ctx.alloc(i);
    kernels::attention_backward(*ctx.stream, x[0], x[1], x[2], x[3], x[4], x[5], documents, scale_,
                                out[0],
                                out[1], out[2], kernels::attention_tiles(), products_, window_);
  }
  std::vector<Annotation> deduce(const DeduceContext& ctx,
                                 const std::vector<Annotation>& in) const override {
    return deduce_by_dims(
        ctx, attention_rule(in.size(), true, context_parallel_, documents_rank(ctx.node, 6)), in);
  }

 private:
  float scale_;
  bool context_parallel_;
  DType products_;
  int64_t window_;  // sliding window W (0: none)
  DType grads_;     // dq, dk and dv's dtype
};

// Inputs: q, k, v[, documents]. Outputs: out, lse.
class AttentionOp final : public Op {
 public:
  AttentionOp(float scale, bool context_parallel, DType products, int64_t window, DType out_dtype)
      : scale_(scale),
        context_parallel_(context_parallel),
        products_(products),
        window_(window),
        out_dtype_(out_dtype) {}
  std::string type() const override { return "attention"; }
  std::vector<TensorMeta> infer(const std::vector<TensorMeta>& in) const override {
    if (in.size() != 3 && in.size() != 4)
      fail("[attention] expected 3 or 4 inputs, got ", in.size());
    check_qkv(in[0], in[1], in[2], in.size() == 4 ? &in[3] : nullptr);
    const SymShape& q = in[0].shape;
    // The output is f32 unless asked otherwise, whatever q, k and v hold:
    // the backward's row dots (dO . O) need O unrounded, or the gradients
    // lose softmax's shift invariance (a key bias's true gradient is nearly
    // zero). A bf16 output (Precision::attention_output, on a GPU) is what
    // cuDNN reads back in its backward anyway; the backward then writes
    // bf16 gradients too (AttentionGradOp), as cuDNN does.
    return {TensorMeta{q, out_dtype_}, TensorMeta{{q[0], q[2], q[1]}, DType::F32}};
  }
  OpTraffic traffic(const ShardContext& shard) const override { return ring_traffic(shard, false); }
  double flops(const std::vector<Shape>& in, const std::vector<Shape>&, const ShardContext* shard) const override {
    return attention_products(in, shard, window_);
  }
  double flops_on(const std::vector<NDArray>& in, const std::vector<Shape>&, const ShardContext* shard) const override {
    return attention_products_on(in, 3, shard, window_);
  }
  bool may_communicate() const override { return context_parallel_; }
  void compute(const OpContext& ctx, const std::vector<NDArray>& in,
               std::vector<NDArray>& out) const override {
    const NDArray documents = optional_input(in, 3);
    const std::vector<NDArray> x = contiguous_inputs(in, 3);
    if (auto ring = ring_of(ctx, documents.valid() ? documents.ndim() : 0))
      return ring_attention(*ring, widened(*ctx.stream, x), documents, scale_, products_, window_, out_dtype_,
                            out);
    out[0] = ctx.alloc(0);
    out[1] = ctx.alloc(1);
    kernels::attention_forward(*ctx.stream, x[0], x[1], x[2], documents, scale_, out[0], out[1],
                               kernels::attention_tiles(), products_, window_);
  }
  // With a bf16 output (where cuDNN serves attention) the backward reads dO
  // in bf16 too: o_proj's input-gradient GEMM writes it so (ops::gradient_rounded).
  bool rounds_gradient(const Node&, int output) const override {
    return output == 0 && out_dtype_ == DType::BF16;
  }
  // lse's gradient is never used: it only feeds the backward.
  std::vector<Tensor> gradient(const Node& node, const std::vector<Tensor>& g) const override {
    std::vector<Tensor> grads(node.inputs.size());
    if (!g[0].valid()) return grads;
    std::vector<Tensor> in = {node.inputs[0], node.inputs[1], node.inputs[2],
                              node.output(0), node.output(1), g[0]};
    if (node.inputs.size() == 4) in.push_back(node.inputs[3]);
    // `node` may dangle once the graph grows: everything needed is copied above.
    std::vector<Tensor> d =
        node.graph->add(
            std::make_shared<AttentionGradOp>(scale_, context_parallel_, products_, window_, out_dtype_), in);
    grads[0] = d[0], grads[1] = d[1], grads[2] = d[2];
    return grads;
  }
  std::vector<Annotation> deduce(const DeduceContext& ctx,
                                 const std::vector<Annotation>& in) const override {
    return deduce_by_dims(
        ctx, attention_rule(in.size(), false, context_parallel_, documents_rank(ctx.node, 3)), in);
  }

 private:
  float scale_;
  bool context_parallel_;
  DType products_;
  int64_t window_;   // sliding window W (0: none)
  DType out_dtype_;  // the output's dtype (lse is f32)
};

// HSPMD_DEBUG_BREAK_ATTENTION: a test-only switch that makes attention
// deliberately wrong, so that a check of the trained model (the loss check
// of bench/gpu_step.py, docs/benchmarks.md) can show it notices a wrong
// model. Read once per process. Unset, empty or 0: off. A positive integer
// W: every attention op built afterwards drops the keys more than W - 1
// positions before its query (a sliding window of W on top of the model's
// own; W = 1: each query sees only its own key). It is applied where the op
// is built, so the forward, the backward and every path (CPU, CUDA, cuDNN,
// ring attention) compute the same wrong but finite function.
int64_t debug_break_window() {
  static const int64_t window = [] {
    const char* v = std::getenv("HSPMD_DEBUG_BREAK_ATTENTION");
    if (v == nullptr || *v == '\0' || std::string(v) == "0") return int64_t{0};
    char* end = nullptr;
    const long long w = std::strtoll(v, &end, 10);
    if (*end != '\0' || w < 1)
      fail("[attention] HSPMD_DEBUG_BREAK_ATTENTION must be 0 (off) or a positive key window, got \"", v, "\"");
    std::fprintf(stderr,
                 "hspmd: HSPMD_DEBUG_BREAK_ATTENTION=%lld: attention is deliberately wrong (each query sees only "
                 "its last %lld keys); a test-only switch\n",
                 w, w);
    return static_cast<int64_t>(w);
  }();
  return window;
}

}  // namespace

Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& documents,
                 float softmax_scale, bool context_parallel, DType products, int64_t window, DType out_dtype) {
  if (!q.valid() || !k.valid() || !v.valid()) fail("[attention] q, k and v must be defined");
  if (products != DType::F32 && products != DType::BF16)
    fail("[attention] products: must be f32 or bf16, got ", dtype_name(products));
  if (q.dtype() == DType::BF16 && products != DType::BF16)
    fail("[attention] bf16 q, k and v need bf16 products");
  if (window < 0) fail("[attention] window: must be >= 0 (0: no window), got ", window);
  if (out_dtype != DType::F32 && (out_dtype != DType::BF16 || products != DType::BF16))
    fail("[attention] out_dtype: f32, or bf16 with bf16 products; got ", dtype_name(out_dtype), " with ",
         dtype_name(products), " products");
  if (const int64_t broken = debug_break_window(); broken > 0)
    window = window > 0 ? std::min(window, broken) : broken;
  std::vector<Tensor> in = {q, k, v};
  if (documents.valid()) in.push_back(documents);
  return q.graph()->add(
      std::make_shared<AttentionOp>(softmax_scale, context_parallel, products, window, out_dtype), in)[0];
}

}  // namespace hspmd::ops
