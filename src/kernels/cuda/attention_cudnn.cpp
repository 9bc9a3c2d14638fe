// cuDNN SDPA graphs through cudnn_frontend (attention_cudnn.h, namespace
// sdpa). Host C++: the frontend's headers (graph API and a JSON library) are
// compiled once here, by the host compiler, not by nvcc's three passes.
//
// Built with NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING: the frontend calls cuDNN
// through dlsym on cudnn_frontend::cudnn_dlhandle, which we open at the first
// graph, so a process that never runs attention on cuDNN does not map it
// (libcudnn and its engine libraries are hundreds of MB; gemm.cu says why
// that matters for cuBLAS).
#include "kernels/cuda/attention_cudnn.h"

#include <cudnn_frontend.h>
#include <dlfcn.h>

#include <cstdlib>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <unordered_map>

#include "kernels/cuda/runtime.h"
#include "hspmd/core/error.h"

namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;  // the frontend's handle of libcudnn (see above)
}  // namespace cudnn_frontend

namespace hspmd::kernels::cuda::sdpa {
namespace {

namespace fe = cudnn_frontend;
using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

// cuDNN 9 keeps its ABI within the major version; the frontend checks each
// feature against the version it finds (THD needs Hopper, and so on).
constexpr int kMinVersion = 90000;

struct Library {
  int version = 0;
  std::string error;
};

// Opens libcudnn once: the loader's path first, then the directory the build
// found it in. The frontend opens the CUDA runtime by name as well; we name
// the one this build links (else a stray libcudart.so.12 would be taken).
const Library& library() {
  static const Library lib = [] {
    Library out;
    setenv("CUDNN_FRONTEND_CUDART_LIB_NAME", "libcudart.so." HSPMD_CUDART_MAJOR, 0);
    void* handle = nullptr;
    std::string tried;
    for (const char* name : {"libcudnn.so.9", HSPMD_CUDNN_DIR "/libcudnn.so.9", "libcudnn.so"}) {
      handle = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (handle) break;
      const char* e = dlerror();
      tried += std::string(tried.empty() ? "" : "; ") + name + ": " + (e ? e : "not found");
    }
    if (!handle) {
      out.error = "cannot load cuDNN (" + tried + ")";
      return out;
    }
    auto get_version = reinterpret_cast<size_t (*)()>(dlsym(handle, "cudnnGetVersion"));
    if (!get_version) {
      out.error = "libcudnn has no cudnnGetVersion";
      return out;
    }
    const int v = static_cast<int>(get_version());
    if (v / 10000 != CUDNN_MAJOR || v < kMinVersion) {
      out.error = "cuDNN " + std::to_string(v) + " found, this build needs major " + std::to_string(CUDNN_MAJOR) +
                  " and at least " + std::to_string(kMinVersion);
      return out;
    }
    fe::cudnn_dlhandle = handle;
    out.version = v;
    return out;
  }();
  return lib;
}

// One cuDNN handle per (thread, device), bound to each call's stream (as the
// cuBLAS handles of gemm.cu). Kept for the thread's life.
cudnnHandle_t handle_for(Stream& s, std::string* why) {
  thread_local std::map<int, cudnnHandle_t> handles;
  const int dev = s.device().index;
  auto it = handles.find(dev);
  if (it == handles.end()) {
    cuda_rt::set_device(dev);
    cudnnHandle_t h = nullptr;
    const cudnnStatus_t st = fe::detail::create_handle(&h);
    if (st != CUDNN_STATUS_SUCCESS) {
      *why = "cudnnCreate failed (status " + std::to_string(static_cast<int>(st)) + ")";
      return nullptr;
    }
    it = handles.emplace(dev, h).first;
  }
  const cudnnStatus_t st = fe::detail::set_stream(it->second, static_cast<cudaStream_t>(s.native_handle()));
  if (st != CUDNN_STATUS_SUCCESS) {
    *why = "cudnnSetStream failed (status " + std::to_string(static_cast<int>(st)) + ")";
    return nullptr;
  }
  return it->second;
}

// Tensor uids of the variant packs.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV, kSeqLenQ, kSeqLenKV, kOffQ, kOffK, kOffV, kOffO };

// [batch, H, seq, D] over memory [.., seq, H, D]: the batch stride is unused
// with ragged offsets.
std::vector<int64_t> dims(const Shape& s, bool kv) { return {s.batch, kv ? s.Hkv : s.Hq, s.seq, s.D}; }
std::vector<int64_t> strides(const Shape& s, bool kv) {
  const int64_t H = kv ? s.Hkv : s.Hq;
  return {s.seq * H * s.D, s.D, H * s.D, 1};
}

// The graph's int32 [n] inputs (sequence lengths, offsets).
TensorPtr int_input(fe::graph::Graph& g, const char* name, int64_t uid, int64_t n) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({n, 1, 1, 1})
                      .set_stride({1, 1, 1, 1})
                      .set_data_type(fe::DataType_t::INT32));
}

// Packed documents: one offset tensor per I/O tensor of the forward (the
// gradients share their input's) and the lengths for queries and keys, as
// probe_cudnn_sdpa declared them; the same device arrays fill them.
struct Offsets {
  TensorPtr q, k, v, o, seq_len_q, seq_len_kv;
};

Offsets ragged_inputs(fe::graph::Graph& g, const Shape& s) {
  if (!s.ragged) return {};
  return {int_input(g, "off_q", kOffQ, s.batch + 1),        int_input(g, "off_k", kOffK, s.batch + 1),
          int_input(g, "off_v", kOffV, s.batch + 1),        int_input(g, "off_o", kOffO, s.batch + 1),
          int_input(g, "seq_len_q", kSeqLenQ, s.batch), int_input(g, "seq_len_kv", kSeqLenKV, s.batch)};
}

TensorPtr input(fe::graph::Graph& g, const Shape& s, const char* name, int64_t uid, bool kv, const TensorPtr& off) {
  auto a = fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(dims(s, kv)).set_stride(strides(s, kv));
  if (off) a.set_ragged_offset(off);
  return g.tensor(a);
}

void as_output(const TensorPtr& t, const Shape& s, int64_t uid, bool kv, const TensorPtr& off) {
  t->set_output(true).set_uid(uid).set_dim(dims(s, kv)).set_stride(strides(s, kv));
  if (off) t->set_ragged_offset(off);
}

// fp32 [batch, Hq, seq, 1], packed: the layout every cuDNN 9 reads back.
void as_stats(const TensorPtr& t, const Shape& s) {
  t->set_uid(kStats).set_data_type(fe::DataType_t::FLOAT).set_dim({s.batch, s.Hq, s.seq, 1}).set_stride(
      {s.Hq * s.seq, s.seq, 1, 1});
}

// Causal, the window, and for packed documents the sequence lengths (the
// frontend takes ragged offsets only with a padding mask).
template <typename Attributes>
void set_mask(Attributes& a, const Shape& s, const Offsets& off) {
  a.set_causal_mask(true).set_attn_scale(s.scale);
  if (s.ragged) a.set_padding_mask(true).set_seq_len_q(off.seq_len_q).set_seq_len_kv(off.seq_len_kv);
  if (s.window > 0) a.set_diagonal_band_left_bound(static_cast<int>(s.window));
}

std::shared_ptr<fe::graph::Graph> new_graph() {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return g;
}

std::shared_ptr<fe::graph::Graph> forward_graph(const Shape& s) {
  auto g = new_graph();
  const Offsets off = ragged_inputs(*g, s);
  auto q = input(*g, s, "q", kQ, false, off.q), k = input(*g, s, "k", kK, true, off.k);
  auto v = input(*g, s, "v", kV, true, off.v);
  auto a = fe::graph::SDPA_attributes().set_name("attention").set_generate_stats(true);
  set_mask(a, s, off);
  auto [o, stats] = g->sdpa(q, k, v, a);
  as_output(o, s, kO, false, off.o);
  as_stats(stats, s);
  stats->set_output(true);
  return g;
}

std::shared_ptr<fe::graph::Graph> backward_graph(const Shape& s) {
  auto g = new_graph();
  const Offsets off = ragged_inputs(*g, s);
  auto q = input(*g, s, "q", kQ, false, off.q), k = input(*g, s, "k", kK, true, off.k);
  auto v = input(*g, s, "v", kV, true, off.v), o = input(*g, s, "o", kO, false, off.o);
  auto d_o = input(*g, s, "d_o", kDO, false, off.o);
  auto stats = g->tensor(fe::graph::Tensor_attributes().set_name("stats"));
  as_stats(stats, s);
  auto a = fe::graph::SDPA_backward_attributes().set_name("attention_backward");
  set_mask(a, s, off);
  auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, d_o, stats, a);
  as_output(dq, s, kDQ, false, off.q);
  as_output(dk, s, kDK, true, off.k);
  as_output(dv, s, kDV, true, off.v);
  return g;
}

// A built graph, or why cuDNN refused it (kept, so a refused shape is not
// tried again on every call).
struct Entry {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace = 0;
  std::string refused;
};

// validate -> operation graph -> heuristics -> support -> plans; the first
// stage that fails names itself. Construction may throw (e.g. "No suitable
// implementation" for a window the installed cuDNN lacks): a refusal too.
Entry build(const Shape& s, bool backward, cudnnHandle_t h) {
  Entry e;
  try {
    auto g = backward ? backward_graph(s) : forward_graph(s);
    const std::pair<const char*, std::function<fe::error_t()>> stages[] = {
        {"validate", [&] { return g->validate(); }},
        {"build_operation_graph", [&] { return g->build_operation_graph(h); }},
        {"create_execution_plans", [&] { return g->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}); }},
        {"check_support", [&] { return g->check_support(); }},
        {"build_plans", [&] { return g->build_plans(); }},
    };
    for (const auto& [name, run] : stages) {
      fe::error_t err = run();
      if (!err.is_good()) {
        e.refused = std::string(name) + ": " + err.get_message();
        return e;
      }
    }
    e.workspace = g->get_workspace_size();
    e.graph = g;
  } catch (const std::exception& x) {
    e.refused = std::string("graph construction: ") + x.what();
  }
  return e;
}

std::string key_of(const Shape& s, bool backward, int device) {
  std::ostringstream k;
  k << device << (backward ? " bwd " : " fwd ") << s.batch << ' ' << s.Hq << ' ' << s.Hkv << ' ' << s.seq << ' '
    << s.D << ' ' << s.ragged << ' ' << s.window << ' ' << std::hexfloat << s.scale;
  return k.str();
}

// Graphs per thread (a graph and its handle stay on one thread). Packed
// documents give a new shape per distinct document count: the cache is
// dropped when it grows past kMaxGraphs, so it cannot grow without bound.
constexpr size_t kMaxGraphs = 256;

const Entry* graph_for(const Shape& s, bool backward, Stream& st, cudnnHandle_t h) {
  thread_local std::unordered_map<std::string, Entry> cache;
  const std::string key = key_of(s, backward, st.device().index);
  auto it = cache.find(key);
  if (it == cache.end()) {
    if (cache.size() >= kMaxGraphs) cache.clear();
    it = cache.emplace(key, build(s, backward, h)).first;
  }
  return &it->second;
}

bool run(Stream& st, const Shape& s, bool backward, std::unordered_map<int64_t, void*>& pack, std::string* why) {
  const Library& lib = library();
  if (!lib.error.empty()) {
    *why = lib.error;
    return false;
  }
  cudnnHandle_t h = handle_for(st, why);
  if (!h) return false;
  const Entry* e = graph_for(s, backward, st, h);
  if (!e->graph) {
    *why = "cuDNN " + std::to_string(lib.version) + " refused the graph: " + e->refused;
    return false;
  }
  NDArray ws;
  if (e->workspace > 0) ws = NDArray::empty({(e->workspace + 7) / 8}, DType::I64, st.device());
  try {
    fe::error_t err = e->graph->execute(h, pack, ws.valid() ? ws.raw_data() : nullptr);
    if (!err.is_good()) {
      *why = "execute: " + err.get_message();
      return false;
    }
  } catch (const std::exception& x) {
    *why = std::string("execute: ") + x.what();
    return false;
  }
  return true;
}

void add_ragged(std::unordered_map<int64_t, void*>& pack, const Shape& s, const Tensors& t) {
  if (!s.ragged) return;
  auto* seq_len = const_cast<int32_t*>(t.seq_len);
  auto* off_q = const_cast<int32_t*>(t.off_q);
  auto* off_kv = const_cast<int32_t*>(t.off_kv);
  pack[kSeqLenQ] = pack[kSeqLenKV] = seq_len;
  pack[kOffQ] = pack[kOffO] = off_q;
  pack[kOffK] = pack[kOffV] = off_kv;
}

}  // namespace

bool forward(Stream& st, const Shape& s, const Tensors& t, std::string* why) {
  std::unordered_map<int64_t, void*> pack{{kQ, const_cast<void*>(t.q)},
                                          {kK, const_cast<void*>(t.k)},
                                          {kV, const_cast<void*>(t.v)},
                                          {kO, t.o},
                                          {kStats, t.stats}};
  add_ragged(pack, s, t);
  return run(st, s, false, pack, why);
}

bool backward(Stream& st, const Shape& s, const Tensors& t, std::string* why) {
  std::unordered_map<int64_t, void*> pack{{kQ, const_cast<void*>(t.q)},   {kK, const_cast<void*>(t.k)},
                                          {kV, const_cast<void*>(t.v)},   {kO, t.o},
                                          {kDO, const_cast<void*>(t.d_o)}, {kStats, t.stats},
                                          {kDQ, t.dq},                     {kDK, t.dk},
                                          {kDV, t.dv}};
  add_ragged(pack, s, t);
  return run(st, s, true, pack, why);
}

bool built() { return true; }

int cudnn_version(std::string* why) {
  const Library& lib = library();
  if (!lib.error.empty()) *why = lib.error;
  return lib.version;
}

}  // namespace hspmd::kernels::cuda::sdpa
