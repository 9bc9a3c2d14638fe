// cudnn_frontend graphs of probe_cudnn_sdpa (see sdpa_graph.h).
#include "sdpa_graph.h"

#include <cudnn_frontend.h>

#include <chrono>
#include <cmath>
#include <exception>

namespace fe = cudnn_frontend;

namespace sdpa {

struct Graph {
  std::shared_ptr<fe::graph::Graph> g;
};
void GraphDeleter::operator()(Graph* g) const { delete g; }

namespace {

using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

TensorPtr io_tensor(fe::graph::Graph& g, const Spec& s, const char* name, int64_t uid, bool kv, TensorPtr off) {
  auto a = fe::graph::Tensor_attributes()
               .set_name(name)
               .set_uid(uid)
               .set_dim({s.B, kv ? s.Hkv : s.Hq, s.S, s.D})
               .set_stride(kv ? s.kv_strides : s.q_strides);
  if (off) a.set_ragged_offset(off);
  return g.tensor(a);
}
void as_output(const TensorPtr& t, const Spec& s, int64_t uid, bool kv, TensorPtr off) {
  t->set_output(true).set_uid(uid).set_dim({s.B, kv ? s.Hkv : s.Hq, s.S, s.D}).set_stride(kv ? s.kv_strides : s.q_strides);
  if (off) t->set_ragged_offset(off);
}
TensorPtr int_tensor(fe::graph::Graph& g, const char* name, int64_t uid, int64_t n) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({n, 1, 1, 1})
                      .set_stride({1, 1, 1, 1})
                      .set_data_type(fe::DataType_t::INT32));
}
TensorPtr stats_tensor(const Spec& s, TensorPtr t) {
  t->set_uid(U_STATS)
      .set_data_type(fe::DataType_t::FLOAT)
      .set_dim({s.B, s.Hq, s.S, 1})
      .set_stride({s.Hq * s.S, s.S, 1, 1});
  return t;
}

}  // namespace

namespace {
GraphPtr build_graph(const Spec& s, bool backward, cudnnHandle_t handle, std::string* err);
}  // namespace

// Graph construction can throw (graph::sdpa: "No suitable implementation for
// given SDPA_attributes" when no implementation takes the attributes, e.g. a
// sliding window the installed cuDNN lacks): that is a refused graph too.
GraphPtr build(const Spec& s, bool backward, cudnnHandle_t handle, std::string* err, double* build_ms) {
  auto t0 = std::chrono::steady_clock::now();
  GraphPtr g;
  try {
    g = build_graph(s, backward, handle, err);
  } catch (const std::exception& e) {
    *err = std::string("graph construction: ") + e.what();
    g = nullptr;
  }
  *build_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return g;
}

namespace {
GraphPtr build_graph(const Spec& s, bool backward, cudnnHandle_t handle, std::string* err) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  TensorPtr oq, ok, ov, oo;
  if (s.ragged) {
    oq = int_tensor(*g, "off_q", U_OFF_Q, s.B + 1);
    ok = int_tensor(*g, "off_k", U_OFF_K, s.B + 1);
    ov = int_tensor(*g, "off_v", U_OFF_V, s.B + 1);
    oo = int_tensor(*g, "off_o", U_OFF_O, s.B + 1);
  }
  auto Q = io_tensor(*g, s, "Q", U_Q, false, oq);
  auto K = io_tensor(*g, s, "K", U_K, true, ok);
  auto V = io_tensor(*g, s, "V", U_V, true, ov);
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.D));
  if (!backward) {
    auto opts = fe::graph::SDPA_attributes().set_name("sdpa_fwd").set_generate_stats(true).set_causal_mask(true).set_attn_scale(scale);
    if (s.padding_mask)
      opts.set_padding_mask(true)
          .set_seq_len_q(int_tensor(*g, "seq_q", U_SEQ_Q, s.B))
          .set_seq_len_kv(int_tensor(*g, "seq_kv", U_SEQ_KV, s.B));
    if (s.window > 0) opts.set_diagonal_band_left_bound(static_cast<int>(s.window));
    auto [O, Stats] = g->sdpa(Q, K, V, opts);
    as_output(O, s, U_O, false, oo);
    stats_tensor(s, Stats)->set_output(true);
  } else {
    auto O = io_tensor(*g, s, "O", U_O, false, oo);
    auto dO = io_tensor(*g, s, "dO", U_DO, false, oo);
    auto Stats = stats_tensor(s, g->tensor(fe::graph::Tensor_attributes().set_name("Stats")));
    auto opts = fe::graph::SDPA_backward_attributes().set_name("sdpa_bwd").set_causal_mask(true).set_attn_scale(scale);
    if (s.padding_mask)
      opts.set_padding_mask(true)
          .set_seq_len_q(int_tensor(*g, "seq_q", U_SEQ_Q, s.B))
          .set_seq_len_kv(int_tensor(*g, "seq_kv", U_SEQ_KV, s.B));
    if (s.window > 0) opts.set_diagonal_band_left_bound(static_cast<int>(s.window));
    auto [dQ, dK, dV] = g->sdpa_backward(Q, K, V, O, dO, Stats, opts);
    as_output(dQ, s, U_DQ, false, oq);
    as_output(dK, s, U_DK, true, ok);
    as_output(dV, s, U_DV, true, ov);
  }
  // validate -> operation graph -> heuristic plans -> support -> build; each
  // stage's error is kept with its name.
  auto stage = [&](const char* name, fe::error_t e) {
    if (e.is_good()) return true;
    *err = std::string(name) + ": " + e.get_message();
    return false;
  };
  bool ok_all = stage("validate", g->validate()) && stage("build_operation_graph", g->build_operation_graph(handle)) &&
                stage("create_execution_plans", g->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK})) &&
                stage("check_support", g->check_support()) && stage("build_plans", g->build_plans());
  if (!ok_all) return nullptr;
  return GraphPtr(new Graph{g});
}
}  // namespace

int64_t workspace_size(const Graph& g) { return g.g->get_workspace_size(); }

std::string execute(const Graph& g, cudnnHandle_t handle, std::unordered_map<int64_t, void*>& pack, void* ws) {
  fe::error_t e = g.g->execute(handle, pack, ws);
  return e.is_good() ? std::string() : e.get_message();
}

int frontend_version() { return CUDNN_FRONTEND_VERSION; }

}  // namespace sdpa
