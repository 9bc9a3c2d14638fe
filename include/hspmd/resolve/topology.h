// Topology: which node each rank lives on, what device it is, and how fast
// the link between two ranks is (docs/cluster.md). Pure data; the
// resolver uses it to prefer fast links, the planner and the emulator read
// the device facts.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "hspmd/resolve/links.h"

namespace hspmd {

// One entry of the device catalog. (Not `DeviceType`: that name is the
// CPU/CUDA backend enum of core/device.h.)
struct DeviceSpec {
  std::string name;
  double tflops = 0;             // dense bf16 TFLOP/s (required in JSON)
  double memory_gib = 0;         // device memory (required in JSON)
  double intra_node_gbps = 0;    // per-device link bandwidth inside a node (GB/s; JSON default 100)
  double inter_node_gbps = 0;    // per-device network bandwidth across nodes (GB/s; JSON default 25)
  // Cost model (docs/planner.md): the fraction of `tflops` dense matmuls
  // reach (roofline, JSON default 0.5), memory bandwidth for memory-bound
  // work (JSON default 2000 GB/s), per-message link latency (JSON default 0
  // us, as the emulator's links), and a profile measured on this device type
  // (a path; Topology::load makes a relative one relative to the cluster
  // file; empty: none).
  double efficiency = 0.5;
  double hbm_gbps = 2000;
  double latency_us = 0;
  std::string profile;
};

// The range a slowdown factor may take in a cluster file or an events file:
// beyond it the emulated clocks lose their meaning (1e30 overflowed them)
// and no real device pair differs that much (the paper's H800 and H20: 6.7x).
inline constexpr double kMinSlowdown = 1e-3, kMaxSlowdown = 1e3;
inline bool slowdown_in_range(double x) { return x >= kMinSlowdown && x <= kMaxSlowdown; }

// Per-rank facts.
struct RankInfo {
  int node = 0;                  // index into the cluster's nodes
  std::string device_type;       // key of the catalog
  double slowdown = 1.0;         // emulation on CPU: compute time multiplier (>= 1 slower)
  double memory_cap_gib = 0;     // emulation on CPU: memory cap, 0 = none
  // Its node gives "slowdown" or "memory_cap_gib": a device emulated on this
  // CPU, whose compute only a profile of this CPU can predict.
  bool emulated = false;
};

class Topology {
 public:
  // `world_size` ranks in nodes of `ranks_per_node` consecutive ranks (the
  // last node may be smaller), all of one generic device type with
  // 100 GB/s inside a node and 25 GB/s across nodes. Throws hspmd::Error
  // "[cluster] ..." when world_size or ranks_per_node is not positive.
  static Topology uniform(int world_size, int ranks_per_node = 8);

  // Parses the cluster JSON (docs/cluster.md):
  //   {"catalog": {"H800": {"tflops": 989, "memory_gib": 80,
  //                         "intra_node_gbps": 200, "inter_node_gbps": 25}, ...},
  //    "nodes": [{"type": "H800", "ranks": [0, 7]},             // inclusive range
  //              {"type": "H20", "ranks": [8, 15], "slowdown": 2.0,
  //               "memory_cap_gib": 4}]}
  // Nodes must cover ranks 0 .. N-1 exactly once; N is the world size. Node
  // i of the cluster is nodes[i]; "slowdown" defaults to 1, "memory_cap_gib"
  // to 0 (none). Throws hspmd::Error "[cluster] <where>: <rule>" (one line)
  // for bad JSON types, unknown or missing fields, an unknown device type,
  // overlapping or missing ranks, non-positive numbers (memory_cap_gib may
  // be 0).
  static Topology from_json(const nlohmann::json& j);
  // Reads and parses a file; errors name the file.
  static Topology load(const std::string& path);

  int world_size() const { return static_cast<int>(ranks_.size()); }
  // Throw hspmd::Error "[cluster] rank r is outside the world" for a bad rank.
  const RankInfo& rank(int r) const;
  const DeviceSpec& device_type(int r) const;
  int node_of(int r) const { return rank(r).node; }
  bool same_node(int a, int b) const { return node_of(a) == node_of(b); }
  // Bandwidth of the link a <-> b in GB/s: inside a node the smaller
  // intra_node_gbps of the two, across nodes the smaller inter_node_gbps.
  // Infinite for a == b.
  // Measured links (with_links) replace both for the node pairs measured.
  double bandwidth(int a, int b) const;
  // Latency of the link a <-> b in microseconds: the measured one
  // (with_links), else the larger latency_us of the two device types; 0 for
  // a == b.
  double latency_us(int a, int b) const;
  // The same cluster with the links `links` measured (host i of the file is
  // node i) replacing the typed bandwidth and latency of the node pairs it
  // holds, inside a node too (docs/cluster.md, "Measured links"). A link
  // between two hosts is shared by their ranks: each rank pair gets the
  // measured bandwidth over the ranks of the larger of the two nodes. Throws
  // hspmd::Error "[links] ..." when it names more hosts than there are nodes.
  Topology with_links(const LinkTable& links) const;
  bool has_measured_links() const { return !link_gbps_.empty(); }
  int num_nodes() const;
  // The same cluster with rank r's emulated slowdown replaced (elastic
  // training: a device that changed speed). Throws for a bad rank.
  Topology with_slowdown(int r, double slowdown) const;

  // The JSON form above (every catalog field written, nodes in rank order);
  // from_json reads it back to the same topology (nodes renumbered in rank
  // order).
  nlohmann::json to_json() const;

 private:
  std::vector<DeviceSpec> catalog_;
  std::vector<RankInfo> ranks_;
  std::vector<int> type_index_;  // per rank, index into catalog_
  // with_links: per node pair (row-major, num_nodes^2), 0 = not measured.
  std::vector<double> link_gbps_, link_latency_us_;
};

}  // namespace hspmd
