// Measured links between hosts (docs/cluster.md, "Measured links"): what
// `hspmd profile --links` writes and `hspmd plan search|cost --links` read
// beside the cluster file. Pure data; Topology::with_links applies it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace hspmd {

// One message size of a link's measurement: the median one-way time (half
// a ping-pong's round trip) over the repeats.
struct LinkSample {
  int64_t bytes = 0;
  double seconds = 0;
};

// The link between host `a` and host `b` (a == b: two ranks inside host a),
// fitted as seconds(bytes) = latency_us * 1e-6 + bytes / (gbps * 1e9).
struct HostLink {
  int a = 0, b = 0;
  double gbps = 0;        // > 0
  double latency_us = 0;  // >= 0
  std::vector<LinkSample> samples;
};

struct LinkTable {
  // Host i of the file is node i of the cluster it is read with.
  std::vector<std::string> hosts;
  std::vector<HostLink> links;  // each host pair at most once
  int repeats = 0;              // ping-pongs per message size (informational)

  // The link of hosts a and b (either order); nullptr when not measured.
  const HostLink* find(int a, int b) const;

  // {"hosts": [...], "repeats": R, "links": [{"hosts": [a, b], "gbps": G,
  //  "latency_us": L, "samples": [{"bytes": B, "seconds": S}, ...]}, ...]}
  nlohmann::json to_json() const;
  // Throws hspmd::Error "[links] <where>: <rule>" (one line) for unknown or
  // missing fields, a host index outside `hosts`, a pair given twice, a
  // non-positive gbps or a negative latency.
  static LinkTable from_json(const nlohmann::json& j);
  // Reads and parses a file; errors name the file.
  static LinkTable load(const std::string& path);
};

}  // namespace hspmd
