#include "hspmd/planner/link_profile.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>

#include "hspmd/core/error.h"

namespace hspmd {
namespace {

constexpr int kNameChars = 64;  // host names gathered as fixed-size int32 arrays
constexpr int kTagSize = 71, kTagData = 72;

// Every rank's host index (hosts numbered by their first rank) and the names.
std::vector<int> gather_hosts(Communicator& world, const std::string& host, std::vector<std::string>& names) {
  std::vector<int32_t> mine(kNameChars, 0);
  for (size_t i = 0; i < host.size() && i + 1 < kNameChars; ++i) mine[i] = static_cast<unsigned char>(host[i]);
  std::vector<int32_t> all(static_cast<size_t>(kNameChars * world.size()));
  world.all_gather(mine.data(), all.data(), std::vector<int64_t>(world.size(), kNameChars));
  std::vector<int> host_of;
  for (int r = 0; r < world.size(); ++r) {
    std::string name;
    for (int i = 0; i < kNameChars && all[static_cast<size_t>(r * kNameChars + i)] != 0; ++i)
      name.push_back(static_cast<char>(all[static_cast<size_t>(r * kNameChars + i)]));
    const auto it = std::find(names.begin(), names.end(), name);
    host_of.push_back(static_cast<int>(it - names.begin()));
    if (it == names.end()) names.push_back(name);
  }
  return host_of;
}

// The initiator's side of one message size: the median one-way time of
// `repeats` ping-pongs of `bytes` (after one warm-up; with 0, the one run).
double ping(Communicator& world, int peer, int64_t bytes, int repeats, std::vector<float>& buf) {
  int64_t header[2] = {bytes, repeats};
  world.send(header, 2, peer, kTagSize);
  const int64_t n = std::max<int64_t>(1, bytes / 4);
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(static_cast<size_t>(n), 1.0f);
  std::vector<double> times;
  for (int i = 0; i <= repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    world.send(buf.data(), n, peer, kTagData);
    world.recv(buf.data(), n, peer, kTagData);
    const double rtt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (i > 0 || repeats == 0) times.push_back(rtt / 2);  // repeats 0: the one run counts
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// The responder's side: echoes each message until the initiator sends size 0.
void pong(Communicator& world, int peer, std::vector<float>& buf) {
  for (;;) {
    int64_t header[2] = {0, 0};
    world.recv(header, 2, peer, kTagSize);
    if (header[0] == 0) return;
    const int64_t n = std::max<int64_t>(1, header[0] / 4);
    if (static_cast<int64_t>(buf.size()) < n) buf.resize(static_cast<size_t>(n));
    for (int i = 0; i <= header[1]; ++i) {
      world.recv(buf.data(), n, peer, kTagData);
      world.send(buf.data(), n, peer, kTagData);
    }
  }
}

// The initiator's measurement of one link (see measure_links).
HostLink probe(Communicator& world, int peer, const LinkProbeOptions& o) {
  std::vector<float> buf;
  HostLink l;
  l.latency_us = ping(world, peer, 8, o.repeats, buf) * 1e6;
  // B/4 at least 128 KiB: past tc's 64 KiB bucket, which a link refills
  // while the answer travels back, so both sizes get the same free burst.
  int64_t big = 128 << 10;
  while (big < o.max_bytes && ping(world, peer, big, 0, buf) < o.target_seconds) big *= 2;
  big = std::min(std::max<int64_t>(big, 512 << 10), o.max_bytes);
  const double t_quarter = ping(world, peer, big / 4, o.repeats, buf), t_big = ping(world, peer, big, o.repeats, buf);
  int64_t stop[2] = {0, 0};
  world.send(stop, 2, peer, kTagSize);
  const double slope = t_big > t_quarter ? (t_big - t_quarter) / static_cast<double>(big - big / 4) : 0;
  l.gbps = (slope > 0 ? 1.0 / slope : static_cast<double>(big) / t_big) / 1e9;
  l.samples = {{8, l.latency_us * 1e-6}, {big / 4, t_quarter}, {big, t_big}};
  return l;
}

// Ranks (initiator, responder) per measured host pair, in a fixed order.
std::vector<std::pair<std::pair<int, int>, std::pair<int, int>>> pairs_of(const std::vector<int>& host_of,
                                                                          int hosts) {
  std::vector<std::vector<int>> ranks(static_cast<size_t>(hosts));
  for (size_t r = 0; r < host_of.size(); ++r) ranks[static_cast<size_t>(host_of[r])].push_back(static_cast<int>(r));
  std::vector<std::pair<std::pair<int, int>, std::pair<int, int>>> out;
  for (int a = 0; a < hosts; ++a) {
    if (ranks[a].size() > 1) out.push_back({{a, a}, {ranks[a][0], ranks[a][1]}});
    for (int b = a + 1; b < hosts; ++b) out.push_back({{a, b}, {ranks[a][0], ranks[b][0]}});
  }
  return out;
}

}  // namespace

LinkTable measure_links(Communicator& world, const std::string& host, const LinkProbeOptions& o) {
  if (o.repeats < 1) fail("[profile] the links' repeats must be >= 1, got ", o.repeats);
  if (!(o.target_seconds > 0)) fail("[profile] the links' target time must be positive, got ", o.target_seconds);
  if (o.max_bytes < (256 << 10)) fail("[profile] the links' largest message must be >= 256 KiB, got ", o.max_bytes);
  LinkTable t;
  t.repeats = o.repeats;
  const std::vector<int> host_of = gather_hosts(world, host, t.hosts);
  std::vector<float> buf;
  for (const auto& [hosts, ranks] : pairs_of(host_of, static_cast<int>(t.hosts.size()))) {
    HostLink l;
    if (world.rank() == ranks.first) l = probe(world, ranks.second, o);
    if (world.rank() == ranks.second) pong(world, ranks.first, buf);
    // The initiator's result to everyone: gbps, latency, then (bytes, seconds) x 3.
    double packed[8] = {l.gbps, l.latency_us};
    for (size_t i = 0; i < l.samples.size() && i < 3; ++i)
      packed[2 + 2 * i] = static_cast<double>(l.samples[i].bytes), packed[3 + 2 * i] = l.samples[i].seconds;
    world.broadcast(packed, 8, ranks.first);
    l = HostLink{hosts.first, hosts.second, packed[0], packed[1], {}};
    for (int i = 0; i < 3; ++i) l.samples.push_back({static_cast<int64_t>(packed[2 + 2 * i]), packed[3 + 2 * i]});
    t.links.push_back(l);
    world.barrier();
  }
  return t;
}

}  // namespace hspmd
