#include "hspmd/planner/cost_model.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <set>

#include "hspmd/core/error.h"
#include "hspmd/core/options.h"
#include "hspmd/core/ndarray.h"
#include "hspmd/models/model.h"

namespace hspmd {

namespace {

constexpr double kBytes = 4;  // fp32: gradients always; everything on a profiled device
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

bool same_dims(const ModelConfig& a, const ModelConfig& b) {
  return a.model_type == b.model_type && a.sliding_window == b.sliding_window &&
         a.hidden_size == b.hidden_size && a.intermediate_size == b.intermediate_size &&
         a.num_attention_heads == b.num_attention_heads && a.kv_heads() == b.kv_heads() &&
         a.vocab_size == b.vocab_size;
}

// Whether TP splits a parameter of this role.
bool tp_split(ParamRole role) { return role != ParamRole::kReplicated; }

}  // namespace

CostModel::CostModel(ModelConfig model, Topology topology,
                     std::map<std::string, std::shared_ptr<const Profile>> profiles,
                     std::shared_ptr<const Profile> fallback)
    : model_(std::move(model)), topology_(std::move(topology)), profiles_(std::move(profiles)),
      fallback_(std::move(fallback)) {
  auto check = [&](const Profile& p, const std::string& what) {
    if (!same_dims(p.config, model_))
      fail("[cost] ", what, ": the profile was made for another model (", p.config.model_type, ", window ",
           p.config.sliding_window, ", hidden ", p.config.hidden_size,
           ", ffn ", p.config.intermediate_size, ", heads ", p.config.num_attention_heads, "/",
           p.config.kv_heads(), ", vocab ", p.config.vocab_size, ") than the model's (", model_.model_type,
           ", window ", model_.sliding_window, ", hidden ",
           model_.hidden_size, ", ffn ", model_.intermediate_size, ", heads ", model_.num_attention_heads, "/",
           model_.kv_heads(), ", vocab ", model_.vocab_size, ")");
  };
  for (const auto& [type, p] : profiles_) check(*p, "device type " + type);
  if (fallback_) check(*fallback_, option_name("profile"));
  // A block's parameters: the average over the layers (a mixture of
  // experts may mix dense and sparse layers).
  int64_t block_params = 0, block_tp_params = 0;
  for (const ModelParameter& p : model_parameters(model_)) {
    const int64_t n = shape_numel(p.shape);
    if (p.part == ModelPart::kBlock) {
      block_params += n;
      if (tp_split(p.role)) block_tp_params += n;
    } else if (p.role == ParamRole::kVocabulary && p.part == ModelPart::kEmbedding) {
      embed_params_ += n;
    } else if (tp_split(p.role)) {
      head_params_ += n;
    } else {
      head_rep_params_ += n;  // the final norm
    }
  }
  const int64_t layers = std::max<int64_t>(1, model_.num_hidden_layers);
  layer_params_ = block_params / layers;
  layer_tp_params_ = block_tp_params / layers;
  layer_compute_ = model_family(model_.model_type).layer_compute(model_);
  expert_params_ = model_.moe.num_experts * 3 * model_.hidden_size * model_.moe.expert_intermediate_size;
}

CostModel CostModel::load(const ModelConfig& model, const Topology& topology, const std::string& profile_path) {
  std::map<std::string, std::shared_ptr<const Profile>> profiles;
  std::set<std::string> types;
  for (int r = 0; r < topology.world_size(); ++r) types.insert(topology.rank(r).device_type);
  for (const std::string& type : types) {
    const DeviceSpec& spec = topology.device_type([&] {
      for (int r = 0; r < topology.world_size(); ++r)
        if (topology.rank(r).device_type == type) return r;
      return 0;
    }());
    if (!spec.profile.empty()) profiles[type] = std::make_shared<const Profile>(Profile::load(spec.profile));
  }
  std::shared_ptr<const Profile> fallback;
  if (!profile_path.empty()) fallback = std::make_shared<const Profile>(Profile::load(profile_path));
  return CostModel(model, topology, std::move(profiles), std::move(fallback));
}

const Profile* CostModel::profile_of(int rank) const {
  auto it = profiles_.find(topology_.rank(rank).device_type);
  if (it != profiles_.end()) return it->second.get();
  return fallback_.get();
}

bool CostModel::profiled(int rank) const { return profile_of(rank) != nullptr; }

bool CostModel::overlaps_grad_sync(int rank) const {
  const Profile* p = profile_of(rank);
  return p == nullptr || p->device.rfind("cuda", 0) == 0;
}

void CostModel::require_profiles_for_emulation(const std::string& cluster) const {
  for (int r = 0; r < topology_.world_size(); ++r)
    if (topology_.rank(r).emulated && !profiled(r))
      fail("[plan] ", cluster, ": rank ", r, " (device type '", topology_.rank(r).device_type,
           "') is emulated on this CPU (its node gives \"slowdown\" or \"memory_cap_gib\") but has no "
           "profile, and the catalog's tflops roofline says nothing about this CPU: measure one with `hspmd "
           "profile ", option_name("model"), " M -o P.json` and pass ", option_name("profile"),
           " P.json (or give the type a \"profile\" in the catalog)");
}

double CostModel::activation_element_bytes(int rank) const {
  const Profile* p = profile_of(rank);
  return p && p->precision != "bf16" ? kBytes : 2.0;
}

double CostModel::part_seconds(int rank, const std::string& part, int tp, int cp, int64_t s, int64_t b) const {
  const double slowdown = topology_.rank(rank).slowdown;
  const Profile* p = profile_of(rank);
  if (p == nullptr) return roofline_seconds(rank, part, tp, cp, s, b) * slowdown;
  if (const ProfileEntry* e = p->find(tp, cp))
    return std::max(0.0, e->parts.at(part).at(s, b)) * slowdown * e->emulation_factor;
  // Not profiled at this degree: the nearest profiled degree, its work
  // scaled by the ratio of degrees (the per-rank work is ~1/(tp*cp)).
  const ProfileEntry* best = nullptr;
  double best_gap = std::numeric_limits<double>::infinity();
  for (const ProfileEntry& e : p->entries) {
    const double gap = std::abs(std::log2(static_cast<double>(e.tp * e.cp) / (tp * cp))) + (e.cp != cp ? 0.5 : 0.0);
    if (gap < best_gap) best_gap = gap, best = &e;
  }
  const std::string note = "tp " + std::to_string(tp) + " cp " + std::to_string(cp) +
                           " extrapolated from the profile's tp " + std::to_string(best->tp) + " cp " +
                           std::to_string(best->cp);
  if (std::find(notes_.begin(), notes_.end(), note) == notes_.end()) notes_.push_back(note);
  return std::max(0.0, best->parts.at(part).at(s, b)) * (best->tp * best->cp) / static_cast<double>(tp * cp) *
         slowdown * best->emulation_factor;
}

// FLOPs of the part on one rank / (tflops x efficiency); the embedding is
// memory-bound (a gather of b*s rows).
double CostModel::roofline_seconds(int rank, const std::string& part, int tp, int cp, int64_t s, int64_t b) const {
  const DeviceSpec& d = topology_.device_type(rank);
  const double rate = d.tflops * 1e12 * d.efficiency;
  const double tokens = static_cast<double>(b) * static_cast<double>(s) / (tp * cp);
  const double h = static_cast<double>(model_.hidden_size);
  // The matmuls, then QK^T and PV over the (query, key) pairs the family's
  // causal attention keeps (s^2 / 2 without a window), split over tp x cp x cp.
  const double pairs = model_family(model_.model_type).attention_pairs(model_, static_cast<double>(s));
  // Parameters TP divides act on the rank's 1 / (tp x cp) of the tokens, the
  // replicated experts on its 1 / cp (every tp rank routes the same tokens).
  const double fwd_block = 2.0 * tokens * layer_compute_.tp_split +
                           2.0 * static_cast<double>(b) * static_cast<double>(s) / cp * layer_compute_.whole +
                           4.0 * static_cast<double>(b) * pairs * h / (tp * cp * cp);
  const double fwd_head = 2.0 * tokens * static_cast<double>(model_.table_rows()) * h;
  const double embed_bytes = tokens * h * kBytes * 2;
  if (part == "block_fwd") return fwd_block / rate;
  if (part == "block_bwd") return 2 * fwd_block / rate;
  if (part == "head_fwd") return fwd_head / rate;
  if (part == "head_bwd") return 2 * fwd_head / rate;
  if (part == "embed_fwd") return embed_bytes / (d.hbm_gbps * 1e9);
  if (part == "embed_bwd") return 2 * embed_bytes / (d.hbm_gbps * 1e9);
  fail("[cost] unknown part '", part, "'");
}

double CostModel::optimizer_seconds(int rank, int64_t n) const {
  const double slowdown = topology_.rank(rank).slowdown;
  if (const Profile* p = profile_of(rank)) {
    // Scaled as the profile's undivided degree (tp 1, cp 1) is, when it has one.
    const ProfileEntry* e = p->find(1, 1);
    const double factor = e != nullptr ? e->emulation_factor : 1.0;
    return (p->optimizer.per_param_s * static_cast<double>(n) + p->optimizer.fixed_s) * slowdown * factor;
  }
  // AdamW is memory-bound: ~ 7 fp32 reads and writes per parameter.
  return static_cast<double>(n) * 28.0 / (topology_.device_type(rank).hbm_gbps * 1e9) * slowdown;
}

double CostModel::link_seconds(int a, int b, double bytes) const {
  if (a == b || bytes <= 0) return 0;
  return topology_.latency_us(a, b) * 1e-6 + bytes / (topology_.bandwidth(a, b) * 1e9);
}

// A ring collective in which each member sends `bytes_per_member` in all:
// bounded by the slowest link of the group (as the emulator bills it), plus
// one latency per ring step.
double CostModel::group_seconds(const std::vector<int>& ranks, double bytes_per_member) const {
  if (ranks.size() < 2 || bytes_per_member <= 0) return 0;
  const auto [latency, per_byte] = group_link(ranks);
  return latency + bytes_per_member * per_byte;
}

// Under measured links (Topology::with_links): the slowest link and the
// largest latency between the group's nodes, one member of each node
// standing for it (and two for a node's own link).
static std::pair<double, double> measured_group_link(const Topology& t, const std::vector<int>& ranks) {
  std::map<int, std::vector<int>> by_node;  // node -> up to two members
  for (int r : ranks)
    if (auto& m = by_node[t.node_of(r)]; m.size() < 2 && (m.empty() || m[0] != r)) m.push_back(r);
  double bw = std::numeric_limits<double>::infinity(), latency = 0;
  for (auto i = by_node.begin(); i != by_node.end(); ++i) {
    if (i->second.size() > 1) {
      bw = std::min(bw, t.bandwidth(i->second[0], i->second[1]));
      latency = std::max(latency, t.latency_us(i->second[0], i->second[1]));
    }
    for (auto j = std::next(i); j != by_node.end(); ++j) {
      bw = std::min(bw, t.bandwidth(i->second[0], j->second[0]));
      latency = std::max(latency, t.latency_us(i->second[0], j->second[0]));
    }
  }
  if (!std::isfinite(bw)) return {0.0, 0.0};  // one rank listed twice
  return {latency * 1e-6 * static_cast<double>(ranks.size() - 1), 1.0 / (bw * 1e9)};
}

std::pair<double, double> CostModel::group_link(const std::vector<int>& ranks) const {
  if (ranks.size() < 2) return {0.0, 0.0};
  if (topology_.has_measured_links()) return measured_group_link(topology_, ranks);
  // The slowest link between two members (Topology::bandwidth): across
  // nodes the smaller inter-node bandwidth of the two, inside a node the
  // smaller intra-node one. O(n): the least inter-node bandwidth of any
  // member when the group spans nodes, and per node with two members or
  // more the least intra-node bandwidth there.
  std::map<int, std::pair<int, double>> nodes;  // node -> (members, least intra)
  double inter = std::numeric_limits<double>::infinity(), latency = 0;
  for (int r : ranks) {
    const DeviceSpec& d = topology_.device_type(r);
    auto [it, fresh] = nodes.try_emplace(topology_.node_of(r), 0, std::numeric_limits<double>::infinity());
    it->second.first += 1;
    it->second.second = std::min(it->second.second, d.intra_node_gbps);
    inter = std::min(inter, d.inter_node_gbps);
    latency = std::max(latency, d.latency_us);
  }
  double bw = nodes.size() > 1 ? inter : std::numeric_limits<double>::infinity();
  for (const auto& [node, m] : nodes)
    if (m.first > 1) bw = std::min(bw, m.second);
  if (!std::isfinite(bw)) return {0.0, 0.0};  // one rank listed twice
  return {latency * 1e-6 * static_cast<double>(ranks.size() - 1), 1.0 / (bw * 1e9)};
}

std::pair<double, double> CostModel::rank_compute(int rank, const StageShape& st, int64_t s, int64_t b) const {
  const int tp = st.tp(), cp = st.cp;
  auto part = [&](const char* name) { return part_seconds(rank, name, tp, cp, s, b); };
  double f = st.layers * part("block_fwd"), g = st.layers * part("block_bwd");
  if (st.first) f += part("embed_fwd"), g += part("embed_bwd");
  if (st.last) f += part("head_fwd"), g += part("head_bwd");
  if (st.recompute) g += f;  // the backward re-runs the forward first
  return {f, g};
}

StageCost CostModel::stage_cost(const StageShape& st, int64_t s, int64_t b) const {
  const int tp = st.tp(), cp = st.cp;
  StageCost c;
  for (int r : st.ranks) {  // the stage runs at its slowest rank's pace
    const auto [f, g] = rank_compute(r, st, s, b);
    c.fwd = std::max(c.fwd, f);
    c.bwd = std::max(c.bwd, g);
  }
  // The hidden state of a micro-batch, (b, s, h) fp32; under cp each
  // context slice holds s/cp of it.
  const double ab = activation_element_bytes(st.ranks.front());
  const double act = static_cast<double>(b) * s * model_.hidden_size * ab / cp;
  if (tp > 1) {
    // Sequence-parallel blocks: an all-gather before and a reduce-scatter
    // after attention and the MLP (4 per block each way), each member
    // sending (tp-1)/tp of the slice; the embedding's reduce-scatter and the
    // head's all-gather once per stage end; the vocabulary-parallel loss
    // all-reduces three per-token scalars.
    for (int c0 = 0; c0 < cp; ++c0) {
      std::vector<int> group(st.ranks.begin() + c0 * tp, st.ranks.begin() + (c0 + 1) * tp);
      const double one = group_seconds(group, act * (tp - 1) / tp);
      double f = 4 * st.layers * one, g = 4 * st.layers * one;
      if (st.first) f += one, g += one;
      if (st.last) {
        f += one + 3 * group_seconds(group, 2.0 * b * s / cp * ab * (tp - 1) / tp);
        g += one;
      }
      c.fwd_comm = std::max(c.fwd_comm, f);
      c.bwd_comm = std::max(c.bwd_comm, g);
    }
  }
  if (st.expert_parallel > 1 && st.sparse_layers > 0) {
    // Expert parallelism (ops/moe_ep.cc): per sparse layer and micro-batch,
    // at uniform routing a rank sends the (G-1)/G of its k rows a token that
    // go to other members' experts (compute dtype) and gets their outputs
    // back (f32, the owners sending as much); the backward sends the rows
    // and their output gradients and returns the input gradients.
    const double g = st.expert_parallel;
    const double rows = static_cast<double>(b) * s / cp * model_.moe.top_k * (g - 1) / g * model_.hidden_size;
    c.fwd_comm += st.sparse_layers * group_seconds(st.expert_group, rows * (ab + kBytes));
    c.bwd_comm += st.sparse_layers * group_seconds(st.expert_group, rows * (2 * ab + kBytes));
  }
  if (cp > 1) {
    // Ring attention (ops/attention.cc): the inputs move from contiguous
    // context slices to the load-balanced layout (half of them, all of them
    // on some ranks beyond two slices), keys and values pass cp - 1 hops
    // (the backward also returns their gradients around the ring), and the
    // outputs move back; per block and micro-batch.
    const double hd = static_cast<double>(model_.head_dim()), tokens = static_cast<double>(b) * s / cp;
    const double qn = tokens * model_.num_attention_heads / tp * hd, kn = tokens * model_.kv_heads() / tp * hd;
    const double lse = tokens * model_.num_attention_heads / tp, rows = tokens;
    const double moved = cp == 2 ? 1.0 : 2.0;
    // Ring attention moves f32 whatever the plan computes in (it widens
    // bf16 inputs; its traffic counts 4 bytes an element, ops/attention.cc).
    const double fwd_bytes =
        kBytes * (moved * (qn + 2 * kn + rows) / 2 + (cp - 1) * 2 * kn + moved * (qn + lse) / 2);
    const double bwd_bytes = kBytes * (moved * (3 * qn + 2 * kn + rows + lse) / 2 + (2 * cp - 1) * 2 * kn +
                                       moved * (qn + 2 * kn) / 2);
    double fwd = 0, bwd = 0;
    for (int t0 = 0; t0 < tp; ++t0) {
      std::vector<int> ring;
      for (int c0 = 0; c0 < cp; ++c0) ring.push_back(st.ranks[c0 * tp + t0]);
      fwd = std::max(fwd, group_seconds(ring, fwd_bytes));
      bwd = std::max(bwd, group_seconds(ring, bwd_bytes));
    }
    c.fwd_comm += st.layers * fwd;
    c.bwd_comm += st.layers * bwd;
  }
  return c;
}

// Each rank of the sending stage sends its share of the (b, s, h) hidden
// state to the receiving stage; the receiver with the most to receive
// bounds it: the whole state over min(|from|, |to|) parallel links.
double CostModel::boundary_seconds(const StageShape& from, const StageShape& to, int64_t s, int64_t b) const {
  const double act = static_cast<double>(b) * s * model_.hidden_size * activation_element_bytes(from.ranks.front());
  const size_t n = std::min(from.ranks.size(), to.ranks.size());
  double worst = 0;
  for (int a : from.ranks)
    for (int c : to.ranks) worst = std::max(worst, link_seconds(a, c, act / static_cast<double>(n)));
  return worst;
}

int64_t CostModel::stage_params(const StageShape& st) const {
  const int tp = st.tp();
  int64_t n = st.layers * ((layer_params_ - layer_tp_params_) + layer_tp_params_ / tp);
  if (st.first) n += embed_params_ / tp;
  if (st.last) n += head_params_ / tp + head_rep_params_;
  // Expert parallelism: a rank holds 1 / G of a sparse layer's experts (the
  // block average above counted them all, spread over the layers).
  if (st.expert_parallel > 1)
    n -= st.sparse_layers * expert_params_ / st.expert_parallel * (st.expert_parallel - 1);
  return n;
}

// Per token of the micro-batch, what one block keeps for its backward on a
// rank: the measured value of the profile when there is one, else a count
// of the executor's saved tensors (fp32): norm inputs and outputs, q/k/v and
// their rotated copies, the attention output and its softmax statistics,
// the MLP's gate, up and product, the residual sums; plus the attention
// probabilities where the kernel materialises them (per head, s of them).
double CostModel::activation_bytes(const StageShape& st, int64_t s, int64_t b) const {
  const int tp = st.tp(), cp = st.cp;
  const double tokens = static_cast<double>(b) * s;
  double per_token_layer = -1, per_token_stage = 0;
  if (const Profile* p = profile_of(st.ranks.front()))
    for (const LayerMemory& m : p->memory)
      if (m.tp == tp && m.cp == cp) {
        per_token_layer = st.recompute ? m.activation_bytes_per_token_recompute : m.activation_bytes_per_token;
        per_token_stage =
            st.recompute ? m.stage_activation_bytes_per_token_recompute : m.stage_activation_bytes_per_token;
      }
  if (per_token_layer < 0)  // no profile of this layer: the family's estimate
    per_token_layer = model_family(model_.model_type)
                          .activation_bytes_per_token(model_, activation_element_bytes(st.ranks.front()), tp, cp,
                                                      st.recompute);
  double bytes = tokens * (per_token_layer * st.layers + per_token_stage);
  if (st.last)  // logits of the vocabulary shard and their gradient, in the compute dtype
    bytes += 2 * tokens / (tp * cp) * static_cast<double>(model_.table_rows()) *
             activation_element_bytes(st.ranks.front());
  return bytes;
}

MemoryBreakdown CostModel::stage_memory(const StageShape& st, int64_t s, int64_t b, int in_flight,
                                        double zero_share, bool zero) const {
  const double n = static_cast<double>(stage_params(st));
  MemoryBreakdown m;
  if (profiled(st.ranks.front())) {
    // This executor, as profiled: fp32 parameters, raw gradients and one
    // micro-batch's, Adam moments (ZeRO: an fp32 master shard and the
    // moments' shard).
    m.params = n * kBytes;
    m.grads = 2 * n * kBytes;
    m.optimizer = zero ? 3 * n * kBytes / std::max(1.0, zero_share) : 2 * n * kBytes;
  } else {
    // Mixed precision on a GPU (the roofline's bf16 TFLOP/s): bf16
    // parameters, fp32 gradient accumulators, fp32 master weights and Adam
    // moments (split under ZeRO).
    m.params = n * 2;
    m.grads = n * kBytes;
    m.optimizer = 3 * n * kBytes / (zero ? std::max(1.0, zero_share) : 1.0);
  }
  m.activations = in_flight * activation_bytes(st, s, b);
  if (st.recompute) {  // the backward rebuilds one micro-batch's whole forward
    StageShape full = st;
    full.recompute = false;
    m.activations += activation_bytes(full, s, b);
  }
  return m;
}

double CostModel::capacity_bytes(int rank) const {
  const RankInfo& info = topology_.rank(rank);
  if (info.memory_cap_gib > 0) return info.memory_cap_gib * kGiB;
  return topology_.device_type(rank).memory_gib * kGiB;
}

int CostReport::overflow_rank() const {
  int worst = -1;
  double most = 0;
  for (const RankCost& r : ranks)
    if (r.capacity_bytes > 0 && r.memory.total() - r.capacity_bytes > most)
      most = r.memory.total() - r.capacity_bytes, worst = r.rank;
  return worst;
}

nlohmann::json CostReport::to_json() const {
  nlohmann::json rs = nlohmann::json::array();
  for (const RankCost& r : ranks)
    rs.push_back({{"rank", r.rank},
                  {"pipeline", r.pipeline},
                  {"stage", r.stage},
                  {"compute_s", r.compute_s},
                  {"comm_s", r.comm_s},
                  {"bubble_s", r.bubble_s},
                  {"step_s", r.step_s},
                  {"memory_gib", r.memory.total() / kGiB},
                  {"memory",
                   {{"params_gib", r.memory.params / kGiB},
                    {"grads_gib", r.memory.grads / kGiB},
                    {"optimizer_gib", r.memory.optimizer / kGiB},
                    {"activations_gib", r.memory.activations / kGiB}}},
                  {"capacity_gib", r.capacity_bytes / kGiB}});
  return {{"predicted_step_s", predicted_step_s}, {"pipeline_s", pipeline_s}, {"ranks", rs}, {"notes", notes}};
}

namespace {

// One pipeline's schedule, simulated: per stage the order in which the
// executor runs its forwards and backwards (schedules.cc), each starting when
// the stage is free and its input has arrived. A receive completes at the
// sender's clock plus the transfer; a (deferred) send costs the sender the
// transfer too, as the emulated links bill it.
struct PipelineSim {
  std::vector<double> end;        // per stage: when its last backward (and send) ends
  std::vector<double> busy;       // per stage: compute
  std::vector<double> comm;       // per stage: collectives and transfers
};

PipelineSim simulate_pipeline(const std::vector<StageCost>& cost, const std::vector<double>& boundary,
                              int micro_batches, const std::string& schedule) {
  const int k_n = static_cast<int>(cost.size()), m_n = micro_batches;
  // Per stage the op sequence: +j forward of micro-batch j, -(j+1) backward.
  std::vector<std::vector<int>> order(k_n);
  for (int k = 0; k < k_n; ++k) {
    if (schedule == "gpipe") {
      for (int j = 0; j < m_n; ++j) order[k].push_back(j + 1);
      for (int j = 0; j < m_n; ++j) order[k].push_back(-(j + 1));
    } else {
      const int warmup = std::min(k_n - k - 1, m_n);
      int next = 0, done = 0;
      for (; next < warmup; ++next) order[k].push_back(next + 1);
      for (; next < m_n; ++next) order[k].push_back(next + 1), order[k].push_back(-(++done));
      while (done < m_n) order[k].push_back(-(++done));
    }
  }
  const double inf = std::numeric_limits<double>::infinity();
  // Clock of the sender at its send, per (stage, micro-batch).
  std::vector<std::vector<double>> fwd_sent(k_n, std::vector<double>(m_n, inf)),
      bwd_sent(k_n, std::vector<double>(m_n, inf));
  std::vector<size_t> pos(k_n, 0);
  std::vector<double> clock(k_n, 0);
  PipelineSim sim;
  sim.busy.assign(k_n, 0);
  sim.comm.assign(k_n, 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int k = 0; k < k_n; ++k) {
      while (pos[k] < order[k].size()) {
        const int op = order[k][pos[k]];
        const bool fwd = op > 0;
        const int j = (fwd ? op : -op) - 1;
        double t = clock[k];
        const StageCost& c = cost[k];
        if (fwd && k > 0) {  // receive the activation
          if (fwd_sent[k - 1][j] == inf) break;
          t = std::max(t, fwd_sent[k - 1][j]) + boundary[k - 1];
          sim.comm[k] += boundary[k - 1];
        }
        if (!fwd && k + 1 < k_n) {  // receive the gradient
          if (bwd_sent[k + 1][j] == inf) break;
          t = std::max(t, bwd_sent[k + 1][j]) + boundary[k];
          sim.comm[k] += boundary[k];
        }
        t += fwd ? c.fwd + c.fwd_comm : c.bwd + c.bwd_comm;
        sim.busy[k] += fwd ? c.fwd : c.bwd;
        sim.comm[k] += fwd ? c.fwd_comm : c.bwd_comm;
        if (fwd && k + 1 < k_n) fwd_sent[k][j] = t, t += boundary[k], sim.comm[k] += boundary[k];
        if (!fwd && k > 0) bwd_sent[k][j] = t, t += boundary[k - 1], sim.comm[k] += boundary[k - 1];
        clock[k] = t;
        ++pos[k];
        progress = true;
      }
    }
  }
  for (int k = 0; k < k_n; ++k)
    HSPMD_CHECK(pos[k] == order[k].size(), "pipeline simulation deadlocked at stage ", k);
  sim.end = clock;
  return sim;
}

// A stage of the strategy with its shape and place.
struct Placed {
  StageShape shape;
  int pipeline, stage;
};

// Per layer, over every pipeline: the ranks holding it (its data-parallel
// group), how many ways ZeRO splits its states, its replicas, and the
// group_link of its holders, computed on first use (per rank it was a pass
// over every holder: 2,048 ranks, 4e6 steps).
struct LayerHolders {
  using GroupLink = std::function<std::pair<double, double>(const std::vector<int>&)>;

  explicit LayerHolders(int layers)
      : ranks(layers), zero_share(layers, 0), replicas(layers, 0), link(layers, {0.0, -1.0}) {}
  const std::pair<double, double>& link_of(int l, const GroupLink& group_link) {
    if (link[l].second < 0) link[l] = group_link(ranks[l]);
    return link[l];
  }

  std::vector<std::vector<int>> ranks;
  std::vector<double> zero_share, replicas;
  std::vector<std::pair<double, double>> link;  // second < 0: not computed yet
};

// Expert parallelism: the stage's sparse layers and its first rank's group.
void place_experts(const ModelConfig& c, const Strategy& strategy, const Stage& st, StageShape& sh) {
  sh.expert_parallel = strategy.expert_parallel;
  if (strategy.expert_parallel <= 1 || c.moe.num_experts <= 0) return;
  for (int l = st.first_layer; l <= st.last_layer; ++l) {
    if (!c.moe.sparse_layer(l)) continue;
    if (sh.sparse_layers++ > 0) continue;
    for (const auto& group : expert_groups(strategy, l).slots) {
      bool mine = false;
      for (const std::vector<int>& slot : group)
        mine = mine || std::find(slot.begin(), slot.end(), st.ranks.front()) != slot.end();
      if (mine)
        for (const std::vector<int>& slot : group) sh.expert_group.push_back(slot.front());
    }
  }
}

// Every stage of the strategy, per pipeline; fills in each layer's holders.
std::vector<std::vector<Placed>> place_stages(const ModelConfig& c, const Strategy& strategy, LayerHolders& holders) {
  std::vector<std::vector<Placed>> placed(strategy.pipelines.size());
  for (size_t p = 0; p < strategy.pipelines.size(); ++p) {
    const Pipeline& pl = strategy.pipelines[p];
    for (size_t k = 0; k < pl.stages.size(); ++k) {
      const Stage& st = pl.stages[k];
      StageShape sh{st.ranks, st.cp, st.num_layers(), k == 0, k + 1 == pl.stages.size(), st.recompute};
      place_experts(c, strategy, st, sh);
      placed[p].push_back({sh, static_cast<int>(p), static_cast<int>(k)});
      for (int l = st.first_layer; l <= st.last_layer; ++l) {
        holders.ranks[l].insert(holders.ranks[l].end(), st.ranks.begin(), st.ranks.end());
        holders.zero_share[l] += st.tp() * st.cp;
        holders.replicas[l] += st.cp;
      }
    }
  }
  return placed;
}

// What the schedule phase leaves to the gradient sync: when each pipeline
// ends, and per pipeline and stage one micro-batch's backward (compute and
// the stage's collectives), the window a GPU's bucketed gradient sync hides in.
struct Scheduled {
  std::vector<double> pipeline_end;
  std::vector<std::vector<double>> last_backward;
};

// Pipeline p's schedule, simulated from its stages' costs and transfers.
PipelineSim simulate_stages(const CostModel& model, const Strategy& strategy, size_t p,
                            const std::vector<Placed>& stages, int64_t seq_len, Scheduled& scheduled) {
  const Pipeline& pl = strategy.pipelines[p];
  std::vector<StageCost> costs;
  std::vector<double> boundary;
  for (size_t k = 0; k < stages.size(); ++k) {
    costs.push_back(model.stage_cost(stages[k].shape, seq_len, pl.micro_batch_size));
    if (k + 1 < stages.size())
      boundary.push_back(model.boundary_seconds(stages[k].shape, stages[k + 1].shape, seq_len, pl.micro_batch_size));
  }
  PipelineSim sim = simulate_pipeline(costs, boundary, pl.micro_batches, strategy.schedule);
  for (const StageCost& c : costs) scheduled.last_backward[p].push_back(c.bwd + c.bwd_comm);
  scheduled.pipeline_end[p] = *std::max_element(sim.end.begin(), sim.end.end());
  return sim;
}

// Pipeline p's ranks when its schedule ends: their compute, communication,
// end and memory.
void report_scheduled_ranks(const CostModel& model, const Strategy& strategy, size_t p,
                            const std::vector<Placed>& stages, const LayerHolders& holders, const PipelineSim& sim,
                            int64_t seq_len, CostReport& rep) {
  const Pipeline& pl = strategy.pipelines[p];
  for (size_t k = 0; k < stages.size(); ++k) {
    const StageShape& sh = stages[k].shape;
    const int kn = static_cast<int>(stages.size());
    const int in_flight = strategy.schedule == "gpipe" ? pl.micro_batches
                                                       : std::min(kn - static_cast<int>(k), pl.micro_batches);
    double share = 0;
    const Stage& st = pl.stages[k];
    for (int l = st.first_layer; l <= st.last_layer; ++l)
      share = std::max(share, holders.zero_share[l] / (sh.tp() * sh.cp));
    for (int r : sh.ranks) {
      RankCost& rc = rep.ranks[r];
      rc.pipeline = static_cast<int>(p);
      rc.stage = static_cast<int>(k);
      // The rank's own compute at its own speed (the stage's pace is its
      // slowest rank's: faster ranks wait, which counts as bubble).
      const auto [f, g] = model.rank_compute(r, sh, seq_len, pl.micro_batch_size);
      rc.compute_s = (f + g) * pl.micro_batches;
      rc.comm_s = sim.comm[k];
      rc.step_s = sim.end[k];
      rc.memory = model.stage_memory(sh, seq_len, pl.micro_batch_size, in_flight, strategy.zero ? share : 1.0,
                                     strategy.zero);
    }
  }
}

// A rank's gradient sync: a ring all-reduce (or reduce-scatter + all-gather
// under ZeRO) of its gradient shard over the pipelines holding its layers,
// then of its parameters outside the blocks over the first layer's holders.
double gradient_sync_seconds(const CostModel& model, const StageShape& sh, const Stage& st, int dp,
                             LayerHolders& holders, const LayerHolders::GroupLink& group_link) {
  double sync = 0;
  const double per_layer =
      static_cast<double>((model.layer_params() - model.layer_tp_params()) + model.layer_tp_params() / sh.tp());
  for (int l = st.first_layer; l <= st.last_layer; ++l) {
    const int n = static_cast<int>(std::lround(holders.replicas[l]));  // data-parallel (and cp) replicas
    if (n <= 1) continue;
    const auto& [latency, per_byte] = holders.link_of(l, group_link);
    sync += latency + per_byte * 2.0 * per_layer * kBytes * (n - 1) / n;
  }
  const double extra = static_cast<double>(model.stage_params(sh)) - per_layer * sh.layers;
  if (extra > 0 && dp > 1 && holders.ranks[st.first_layer].size() >= 2) {
    // group_seconds over the first layer's holders, from its cached link.
    const auto& [latency, per_byte] = holders.link_of(st.first_layer, group_link);
    sync += latency + per_byte * (2.0 * extra * kBytes * (dp - 1) / dp);
  }
  return sync;
}

// A rank's step once its gradients are synced (from `start`, or overlapped
// with its last backward, see evaluate) and its optimizer has stepped.
void finish_rank_step(const CostModel& model, int r, const StageShape& sh, bool zero, int dp, double start,
                      double sync, double last_backward, RankCost& rc) {
  const int64_t n_opt = zero ? static_cast<int64_t>(static_cast<double>(model.stage_params(sh)) /
                                                    std::max(1.0, static_cast<double>(dp)))
                             : model.stage_params(sh);
  const double opt = model.optimizer_seconds(r, n_opt);
  double synced = start + sync;
  if (model.overlaps_grad_sync(r) && sync > 0 && sh.layers > 0) {
    const double layers_d = static_cast<double>(sh.layers);
    const double hide = last_backward * (layers_d - 1) / layers_d;
    synced = std::max(rc.step_s - hide + sync, start + sync / layers_d);
  }
  rc.compute_s += opt;
  rc.comm_s += sync;
  rc.step_s = synced + opt;
}

// The gradient sync and optimizer step of a stage's ranks, after every
// pipeline's schedule.
void sync_stage(const CostModel& model, const Strategy& strategy, const Placed& placed, const Scheduled& scheduled,
                LayerHolders& holders, const LayerHolders::GroupLink& group_link, CostReport& rep) {
  const StageShape& sh = placed.shape;
  const Stage& st = strategy.pipelines[placed.pipeline].stages[placed.stage];
  const int dp = static_cast<int>(strategy.pipelines.size());
  double start = 0;
  for (double end : scheduled.pipeline_end) start = std::max(start, end);
  for (int r : sh.ranks) {
    RankCost& rc = rep.ranks[r];
    start = std::max(start, rc.step_s);
    const double sync = gradient_sync_seconds(model, sh, st, dp, holders, group_link);
    finish_rank_step(model, r, sh, strategy.zero, dp, start, sync,
                     scheduled.last_backward[placed.pipeline][placed.stage], rc);
  }
}

}  // namespace

CostReport CostModel::evaluate(const Strategy& strategy, int64_t seq_len) const {
  notes_.clear();
  const int world = topology_.world_size();
  CostReport rep;
  rep.ranks.resize(world);
  for (int r = 0; r < world; ++r) rep.ranks[r].rank = r, rep.ranks[r].capacity_bytes = capacity_bytes(r);
  LayerHolders holders(static_cast<int>(model_.num_hidden_layers));
  const std::vector<std::vector<Placed>> placed = place_stages(model_, strategy, holders);
  Scheduled scheduled{std::vector<double>(placed.size(), 0), std::vector<std::vector<double>>(placed.size())};
  for (size_t p = 0; p < placed.size(); ++p) {
    const PipelineSim sim = simulate_stages(*this, strategy, p, placed[p], seq_len, scheduled);
    rep.pipeline_s.push_back(scheduled.pipeline_end[p]);
    report_scheduled_ranks(*this, strategy, p, placed[p], holders, sim, seq_len, rep);
  }
  // Gradient synchronisation: each layer's gradients are reduced over its
  // holders once every holder's pipeline has finished; then the optimizer
  // and, under ZeRO, the gather of the updated parameters. On a GPU (a
  // roofline rank: no profile) the sync runs in buckets on its own stream
  // while the last micro-batch's backward goes on, as Megatron-LM and the
  // paper's system overlap it: a layer's gradients are final once that
  // backward has passed it, so the sync may start when the rank's backward
  // has done all but its stage's first layer, and it ends no earlier than
  // one layer's share after every holder has finished; so does a GPU
  // profiled on CUDA (hspmd train overlaps there by default). A rank
  // profiled on the CPU syncs after its schedule, as training there does.
  const LayerHolders::GroupLink link_of_group = [this](const std::vector<int>& ranks) { return group_link(ranks); };
  for (const std::vector<Placed>& stages : placed)
    for (const Placed& stage : stages) sync_stage(*this, strategy, stage, scheduled, holders, link_of_group, rep);
  for (RankCost& rc : rep.ranks) {
    if (rc.pipeline < 0) continue;
    rc.bubble_s = std::max(0.0, rc.step_s - rc.compute_s - rc.comm_s);
    rep.predicted_step_s = std::max(rep.predicted_step_s, rc.step_s);
  }
  rep.notes = notes_;
  std::set<const Profile*> busy;
  for (int r = 0; r < world; ++r)
    if (const Profile* p = profile_of(r); p && p->measured_under_load() && busy.insert(p).second)
      rep.notes.push_back("the profile of device type '" + topology_.rank(r).device_type +
                          "' was measured on a busy machine (" + p->load_summary() +
                          "): its times may be off; profile again on a quiet machine");
  if (profiles_.empty() && !fallback_)
    rep.notes.push_back("compute from the roofline (no profile): FLOPs / (tflops x efficiency)");
  return rep;
}

}  // namespace hspmd
