// Measuring the links between hosts over the real transport (`hspmd profile
// --links`, docs/cluster.md "Measured links"): ping-pongs between one rank
// of each host pair (and two ranks inside a host), one pair at a time.
#pragma once

#include <string>

#include "hspmd/comm/communicator.h"
#include "hspmd/resolve/links.h"

namespace hspmd {

struct LinkProbeOptions {
  int repeats = 5;               // timed ping-pongs per message size (after one warm-up); the median counts
  double target_seconds = 0.1;   // the largest message takes about this long one way
  int64_t max_bytes = 64 << 20;  // ... and is at most this large
};

// Collective over `world`: every rank calls it with its host's name. Hosts
// are numbered in the order of their first rank; for each host with two
// ranks or more its first two measure the host's own link, and the first
// ranks of every two hosts measure theirs (the other ranks wait, so that no
// two measurements share a link). Each link: an 8-byte ping-pong for the
// latency, then messages doubling from 128 KiB until one takes
// target_seconds (or max_bytes), then that size B (at least 512 KiB) and
// B/4 timed; the
// bandwidth is the slope between them (so tc's burst and the latency
// cancel), the latency the 8-byte message's one-way time. Every rank
// returns the same table. Throws hspmd::Error for options out of range.
LinkTable measure_links(Communicator& world, const std::string& host, const LinkProbeOptions& options);

}  // namespace hspmd
