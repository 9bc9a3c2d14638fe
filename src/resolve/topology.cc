#include "hspmd/resolve/topology.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <map>
#include <utility>

#include "hspmd/core/error.h"
#include "hspmd/core/json_file.h"

namespace hspmd {
namespace {

using nlohmann::json;

constexpr double kDefaultIntraGbps = 100;
constexpr double kDefaultInterGbps = 25;
constexpr double kDefaultEfficiency = 0.5;
constexpr double kDefaultHbmGbps = 2000;

// Parsing context: `where` prefixes every error ("[cluster] <where>: <rule>").
struct Reader {
  template <typename... Args>
  [[noreturn]] static void fail_at(const std::string& where, const Args&... args) {
    fail("[cluster] ", where, ": ", args...);
  }

  static void only_fields(const json& j, const std::string& where, std::initializer_list<const char*> allowed) {
    if (!j.is_object()) fail_at(where, "must be an object, got ", json_excerpt(j));
    for (auto it = j.begin(); it != j.end(); ++it) {
      bool known = false;
      for (const char* f : allowed) known = known || it.key() == f;
      if (!known) fail_at(where + "." + shorten(it.key()), "unknown field");
    }
  }

  static const json& required(const json& j, const std::string& where, const char* field) {
    if (!j.contains(field)) fail_at(where + "." + field, "missing");
    return j[field];
  }

  static constexpr double kMaxFigure = 1e9;
  // A number > 0 (or >= 0 with allow_zero), at most kMaxFigure; `fallback`
  // when absent and given.
  static double positive(const json& j, const std::string& where, const char* field, double fallback,
                         bool allow_zero = false, double most = kMaxFigure) {
    if (!j.contains(field)) {
      if (fallback < 0) fail_at(where + "." + field, "missing");
      return fallback;
    }
    const json& v = j[field];
    if (!v.is_number()) fail_at(where + "." + field, "must be a number, got ", json_excerpt(v));
    const double x = v.get<double>();
    if (allow_zero ? x < 0 : x <= 0)
      fail_at(where + "." + field, "must be ", allow_zero ? "non-negative" : "positive", ", got ", json_excerpt(v));
    // Beyond any device (1e9 GiB, TFLOP/s or GB/s): such a figure only
    // overflows what is computed from it (memory_gib 1e308 became an
    // infinite capacity deep in the planner's integer programs).
    if (x > most) fail_at(where + "." + field, "must be at most 1e9, got ", json_excerpt(v));
    return x;
  }

  static int rank_number(const json& v, const std::string& where) {
    if (!v.is_number_integer()) fail_at(where, "must be an integer rank, got ", json_excerpt(v));
    if (v.is_number_unsigned() ? v.get<uint64_t>() > INT_MAX : (v.get<int64_t>() < 0 || v.get<int64_t>() > INT_MAX))
      fail_at(where, "rank ", json_excerpt(v), " is out of range");
    if (v.get<int64_t>() >= kMaxWorldSize)
      fail_at(where, "rank ", json_excerpt(v), " is above the limit of ", kMaxWorldSize, " ranks");
    return v.get<int>();
  }
};

DeviceSpec parse_device_type(const std::string& name, const json& j) {
  const std::string where = "catalog." + name;
  Reader::only_fields(j, where, {"tflops", "memory_gib", "intra_node_gbps", "inter_node_gbps", "efficiency",
                                 "hbm_gbps", "latency_us", "profile"});
  DeviceSpec t;
  t.name = name;
  t.tflops = Reader::positive(j, where, "tflops", -1);
  t.memory_gib = Reader::positive(j, where, "memory_gib", -1);
  t.intra_node_gbps = Reader::positive(j, where, "intra_node_gbps", kDefaultIntraGbps);
  t.inter_node_gbps = Reader::positive(j, where, "inter_node_gbps", kDefaultInterGbps);
  t.efficiency = Reader::positive(j, where, "efficiency", kDefaultEfficiency);
  if (t.efficiency > 1) Reader::fail_at(where + ".efficiency", "must be at most 1, got ", json_excerpt(j["efficiency"]));
  t.hbm_gbps = Reader::positive(j, where, "hbm_gbps", kDefaultHbmGbps);
  t.latency_us = Reader::positive(j, where, "latency_us", 0, /*allow_zero=*/true);
  if (j.contains("profile")) {
    if (!j["profile"].is_string() || j["profile"].get<std::string>().empty())
      Reader::fail_at(where + ".profile", "must be a file name, got ", json_excerpt(j["profile"]));
    t.profile = j["profile"].get<std::string>();
  }
  return t;
}

// The inclusive rank range [first, last] of one node entry.
std::pair<int, int> parse_range(const json& node, const std::string& where) {
  const json& r = Reader::required(node, where, "ranks");
  if (!r.is_array() || r.size() != 2)
    Reader::fail_at(where + ".ranks", "must be [first, last] (inclusive), got ", json_excerpt(r));
  const int first = Reader::rank_number(r[0], where + ".ranks[0]");
  const int last = Reader::rank_number(r[1], where + ".ranks[1]");
  if (last < first) Reader::fail_at(where + ".ranks", "last rank ", last, " is before first rank ", first);
  return {first, last};
}

}  // namespace

Topology Topology::uniform(int world_size, int ranks_per_node) {
  if (world_size <= 0) fail("[cluster] uniform: world size ", world_size, " is not positive");
  if (world_size > kMaxWorldSize)
    fail("[cluster] uniform: world size ", world_size, " is above the limit of ", kMaxWorldSize, " ranks");
  if (ranks_per_node <= 0) fail("[cluster] uniform: ranks per node ", ranks_per_node, " is not positive");
  Topology t;
  DeviceSpec generic;
  generic.name = "generic";
  generic.tflops = 100;
  generic.memory_gib = 80;
  generic.intra_node_gbps = kDefaultIntraGbps;
  generic.inter_node_gbps = kDefaultInterGbps;
  generic.efficiency = kDefaultEfficiency;
  generic.hbm_gbps = kDefaultHbmGbps;
  t.catalog_.push_back(generic);
  for (int r = 0; r < world_size; ++r) {
    t.ranks_.push_back(RankInfo{r / ranks_per_node, "generic", 1.0, 0});
    t.type_index_.push_back(0);
  }
  return t;
}

Topology Topology::from_json(const json& j) {
  Reader::only_fields(j, "cluster", {"catalog", "nodes"});
  const json& catalog = Reader::required(j, "cluster", "catalog");
  if (!catalog.is_object() || catalog.empty())
    Reader::fail_at("catalog", "must be a non-empty object of device types");
  Topology t;
  std::map<std::string, int> type_of;
  for (auto it = catalog.begin(); it != catalog.end(); ++it) {
    type_of[it.key()] = static_cast<int>(t.catalog_.size());
    t.catalog_.push_back(parse_device_type(it.key(), it.value()));
  }
  const json& nodes = Reader::required(j, "cluster", "nodes");
  if (!nodes.is_array() || nodes.empty()) Reader::fail_at("nodes", "must be a non-empty array of nodes");
  std::map<int, std::pair<int, RankInfo>> by_rank;  // rank -> (type index, info)
  for (size_t n = 0; n < nodes.size(); ++n) {
    const std::string where = "nodes[" + std::to_string(n) + "]";
    Reader::only_fields(nodes[n], where, {"type", "ranks", "slowdown", "memory_cap_gib"});
    const json& type = Reader::required(nodes[n], where, "type");
    if (!type.is_string()) Reader::fail_at(where + ".type", "must be a string, got ", json_excerpt(type));
    auto found = type_of.find(type.get<std::string>());
    if (found == type_of.end())
      Reader::fail_at(where + ".type", "unknown device type '", shorten(type.get<std::string>()), "' (not in the catalog)");
    RankInfo info{static_cast<int>(n), found->first,
                  Reader::positive(nodes[n], where, "slowdown", 1.0, false, HUGE_VAL),  // its own range below
                  Reader::positive(nodes[n], where, "memory_cap_gib", 0.0, true),
                  nodes[n].contains("slowdown") || nodes[n].contains("memory_cap_gib")};
    if (!slowdown_in_range(info.slowdown))
      Reader::fail_at(where + ".slowdown", "must lie in [", kMinSlowdown, ", ", kMaxSlowdown,
                      "] (a compute-time multiplier), got ", info.slowdown);
    auto [first, last] = parse_range(nodes[n], where);
    for (int r = first; r <= last; ++r) {
      auto [it, fresh] = by_rank.emplace(r, std::make_pair(found->second, info));
      if (!fresh) Reader::fail_at(where + ".ranks", "rank ", r, " is already in nodes[", it->second.second.node, "]");
    }
  }
  const int world = static_cast<int>(by_rank.size());
  for (int r = 0; r < world; ++r)
    if (!by_rank.count(r)) Reader::fail_at("nodes", "rank ", r, " is missing (ranks must cover 0 .. ", world - 1, ")");
  for (auto& [r, entry] : by_rank) {
    t.type_index_.push_back(entry.first);
    t.ranks_.push_back(entry.second);
  }
  return t;
}

Topology Topology::load(const std::string& path) {
  const json j = read_json_file(path, "cluster");
  try {
    Topology t = from_json(j);
    const std::filesystem::path dir = std::filesystem::path(path).parent_path();
    for (DeviceSpec& spec : t.catalog_)
      if (!spec.profile.empty() && std::filesystem::path(spec.profile).is_relative())
        spec.profile = (dir / spec.profile).string();
    return t;
  } catch (const Error& e) {
    const std::string what = e.what();
    const std::string prefix = "[cluster] ";
    fail("[cluster] ", path, ": ", what.compare(0, prefix.size(), prefix) == 0 ? what.substr(prefix.size()) : what);
  }
}

const RankInfo& Topology::rank(int r) const {
  if (r < 0 || r >= world_size()) fail("[cluster] rank ", r, " is outside the world [0, ", world_size(), ")");
  return ranks_[r];
}

Topology Topology::with_slowdown(int r, double slowdown) const {
  rank(r);  // range check
  if (!(slowdown > 0) || !std::isfinite(slowdown)) fail("[cluster] rank ", r, ": slowdown must be > 0, got ", slowdown);
  Topology t = *this;
  t.ranks_[r].slowdown = slowdown;
  return t;
}

const DeviceSpec& Topology::device_type(int r) const {
  rank(r);  // range check
  return catalog_[type_index_[r]];
}

double Topology::bandwidth(int a, int b) const {
  if (a == b) {
    rank(a);
    return std::numeric_limits<double>::infinity();
  }
  const DeviceSpec& ta = device_type(a);
  const DeviceSpec& tb = device_type(b);
  if (has_measured_links()) {
    const size_t pair = static_cast<size_t>(node_of(a) * num_nodes() + node_of(b));
    if (link_gbps_[pair] > 0) return link_gbps_[pair];
  }
  if (same_node(a, b)) return std::min(ta.intra_node_gbps, tb.intra_node_gbps);
  return std::min(ta.inter_node_gbps, tb.inter_node_gbps);
}

double Topology::latency_us(int a, int b) const {
  if (a == b) return rank(a), 0.0;
  if (has_measured_links()) {
    const size_t pair = static_cast<size_t>(node_of(a) * num_nodes() + node_of(b));
    if (link_gbps_[pair] > 0) return link_latency_us_[pair];
  }
  return std::max(device_type(a).latency_us, device_type(b).latency_us);
}

Topology Topology::with_links(const LinkTable& links) const {
  const int n = num_nodes();
  if (static_cast<int>(links.hosts.size()) > n)
    fail("[links] the file measures ", links.hosts.size(), " hosts but the cluster has ", n,
         " nodes (host i of the links file is node i of the cluster)");
  Topology t = *this;
  if (t.link_gbps_.empty()) t.link_gbps_.assign(static_cast<size_t>(n * n), 0), t.link_latency_us_ = t.link_gbps_;
  std::vector<int> ranks_on(static_cast<size_t>(n), 0);
  for (const RankInfo& r : ranks_) ++ranks_on[static_cast<size_t>(r.node)];
  for (const HostLink& l : links.links)
    for (const auto& [x, y] : {std::pair{l.a, l.b}, std::pair{l.b, l.a}}) {
      // A host's link is shared by its ranks; the typed bandwidth is per device.
      const int sharing = x == y ? 1 : std::max(ranks_on[static_cast<size_t>(x)], ranks_on[static_cast<size_t>(y)]);
      t.link_gbps_[static_cast<size_t>(x * n + y)] = l.gbps / std::max(sharing, 1);
      t.link_latency_us_[static_cast<size_t>(x * n + y)] = l.latency_us;
    }
  return t;
}

int Topology::num_nodes() const {
  int n = 0;
  for (const RankInfo& r : ranks_) n = std::max(n, r.node + 1);
  return n;
}

nlohmann::json Topology::to_json() const {
  json catalog = json::object();
  for (const DeviceSpec& t : catalog_)
    catalog[t.name] = {{"tflops", t.tflops},
                       {"memory_gib", t.memory_gib},
                       {"intra_node_gbps", t.intra_node_gbps},
                       {"inter_node_gbps", t.inter_node_gbps},
                       {"efficiency", t.efficiency},
                       {"hbm_gbps", t.hbm_gbps},
                       {"latency_us", t.latency_us}};
  for (const DeviceSpec& t : catalog_)
    if (!t.profile.empty()) catalog[t.name]["profile"] = t.profile;
  json nodes = json::array();
  for (int r = 0; r < world_size();) {
    int last = r;  // a node entry is a run of consecutive ranks sharing every fact
    const RankInfo& info = ranks_[r];
    while (last + 1 < world_size() && ranks_[last + 1].node == info.node &&
           ranks_[last + 1].device_type == info.device_type && ranks_[last + 1].slowdown == info.slowdown &&
           ranks_[last + 1].memory_cap_gib == info.memory_cap_gib && ranks_[last + 1].emulated == info.emulated)
      ++last;
    json node = {{"type", info.device_type}, {"ranks", {r, last}}};
    if (info.slowdown != 1.0 || info.emulated) node["slowdown"] = info.slowdown;
    if (info.memory_cap_gib != 0) node["memory_cap_gib"] = info.memory_cap_gib;
    nodes.push_back(node);
    r = last + 1;
  }
  return {{"catalog", catalog}, {"nodes", nodes}};
}

}  // namespace hspmd
