#include "host_heartbeat.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <sstream>

#include "hspmd/core/error.h"
#include "hspmd/core/options.h"
#include "launcher.h"

namespace hspmd::cli {
namespace {

constexpr int kNameChars = 64;
constexpr int kMaxAddresses = 4;
// A datagram holds the sender's host index h, or -(h + 2) when it is done,
// and its number (0, 1, ... per sender), from which receivers count losses.
// It also carries the hosts the sender finds silent or lossy (bit h, for
// the first 64 hosts), so that a host can tell whether the others agree.
struct Datagram {
  int32_t what;
  uint32_t seq;
  uint64_t suspects;
};
uint64_t bit(int h) { return h < 64 ? uint64_t{1} << h : 0; }
int32_t bye(int host) { return -(host + 2); }
// The loss is judged over windows of at least this many datagrams.
constexpr int kMinLossWindow = 10;
// A host that finds another one silent or lossy reports it at once when a
// third host agrees; else it waits this long (the host whose own link failed
// finds all the others bad, no one agrees, and their line comes first).
constexpr auto kGrace = std::chrono::seconds(3);

using Clock = std::chrono::steady_clock;

// Whether `ifa` is one of OMPI_MCA_btl_tcp_if_include's interfaces (names or
// CIDR ranges, comma-separated); every interface when it is not set.
bool included(const ifaddrs& ifa, uint32_t addr) {
  const char* list = std::getenv("OMPI_MCA_btl_tcp_if_include");
  if (list == nullptr || *list == '\0') return true;
  std::stringstream ss(list);
  for (std::string item; std::getline(ss, item, ',');) {
    const size_t slash = item.find('/');
    if (slash == std::string::npos) {
      if (item == ifa.ifa_name) return true;
      continue;
    }
    in_addr net{};
    const int bits = std::atoi(item.c_str() + slash + 1);
    if (inet_pton(AF_INET, item.substr(0, slash).c_str(), &net) != 1 || bits < 0 || bits > 32) continue;
    const uint32_t mask = bits == 0 ? 0 : htonl(~uint32_t{0} << (32 - bits));
    if ((addr & mask) == (net.s_addr & mask)) return true;
  }
  return false;
}

// This machine's IPv4 addresses the ranks' TCP may use (no loopback).
std::vector<uint32_t> local_addresses() {
  std::vector<uint32_t> out;
  ifaddrs* all = nullptr;
  if (getifaddrs(&all) != 0) return out;
  for (ifaddrs* a = all; a != nullptr && out.size() < kMaxAddresses; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET || (a->ifa_flags & IFF_LOOPBACK)) continue;
    const uint32_t addr = reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr.s_addr;
    if (included(*a, addr)) out.push_back(addr);
  }
  freeifaddrs(all);
  return out;
}

std::string this_host() {
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  return name;
}

}  // namespace

double HostHeartbeat::interval_s(double timeout_s) { return std::clamp(timeout_s / 40, 0.02, 1.0); }

int HostHeartbeat::window(double timeout_s) {
  return std::max(1, static_cast<int>(std::lround(timeout_s / interval_s(timeout_s))));
}

HostHeartbeat::HostHeartbeat(Communicator& world, double timeout_s, double max_loss)
    : timeout_s_(timeout_s), max_loss_(max_loss) {
  const int n = world.size();
  std::vector<int32_t> mine(kNameChars, 0), all(static_cast<size_t>(kNameChars * n));
  const std::string host = this_host();
  for (size_t i = 0; i < host.size() && i + 1 < kNameChars; ++i) mine[i] = static_cast<unsigned char>(host[i]);
  world.all_gather(mine.data(), all.data(), std::vector<int64_t>(n, kNameChars));
  std::vector<int> host_of(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    std::string name;
    for (int i = 0; i < kNameChars && all[static_cast<size_t>(r * kNameChars + i)] != 0; ++i)
      name.push_back(static_cast<char>(all[static_cast<size_t>(r * kNameChars + i)]));
    const auto it = std::find(names_.begin(), names_.end(), name);
    host_of[r] = static_cast<int>(it - names_.begin());
    if (it == names_.end()) names_.push_back(name), ranks_.push_back({r, r});
    ranks_[host_of[r]].second = r;
  }
  host_ = host_of[world.rank()];
  const bool leader = ranks_[host_].first == world.rank();
  const bool active = names_.size() > 1 && timeout_s > 0;
  // The leaders' port and addresses: [port, count, a0 .. a3] per rank.
  std::vector<int64_t> info(2 + kMaxAddresses, 0), infos(static_cast<size_t>((2 + kMaxAddresses) * n));
  if (active && leader) {
    socket_ = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_in any{};
    any.sin_family = AF_INET;
    socklen_t len = sizeof any;
    if (socket_ < 0 || bind(socket_, reinterpret_cast<sockaddr*>(&any), sizeof any) != 0 ||
        getsockname(socket_, reinterpret_cast<sockaddr*>(&any), &len) != 0)
      fail("[heartbeat] host ", host, ": cannot open a UDP socket");
    const std::vector<uint32_t> addrs = local_addresses();
    info[0] = any.sin_port, info[1] = static_cast<int64_t>(addrs.size());
    for (size_t i = 0; i < addrs.size(); ++i) info[2 + i] = addrs[i];
  }
  if (!active) return;
  world.all_gather(info.data(), infos.data(), std::vector<int64_t>(n, 2 + kMaxAddresses));
  for (const auto& [first, last] : ranks_) {
    const int64_t* p = infos.data() + static_cast<size_t>(first) * (2 + kMaxAddresses);
    ports_.push_back(static_cast<int>(p[0]));
    addresses_.emplace_back(p + 2, p + 2 + p[1]);
  }
  if (!leader) return;
  interval_s_ = interval_s(timeout_s);
  window_ = window(timeout_s);
  thread_ = std::thread([this] { run(); });
}

HostHeartbeat::~HostHeartbeat() {
  if (thread_.joinable()) {
    stop_ = true;
    thread_.join();
    for (int i = 0; i < 3; ++i) send_all(bye(host_), 0, 0);
  }
  if (socket_ >= 0) close(socket_);
}

void HostHeartbeat::send_all(int32_t what, uint32_t seq, uint64_t suspects) {
  const Datagram d{what, seq, suspects};
  for (size_t h = 0; h < names_.size(); ++h) {
    if (static_cast<int>(h) == host_) continue;
    for (uint32_t a : addresses_[h]) {
      sockaddr_in to{};
      to.sin_family = AF_INET;
      to.sin_port = static_cast<in_port_t>(ports_[h]);
      to.sin_addr.s_addr = a;
      sendto(socket_, &d, sizeof d, MSG_DONTWAIT, reinterpret_cast<sockaddr*>(&to), sizeof to);
    }
  }
}

void HostHeartbeat::run() {
  const size_t hosts = names_.size();
  std::vector<Clock::time_point> heard(hosts, Clock::now());
  std::vector<bool> done(hosts, false);
  std::vector<uint64_t> theirs(hosts, 0);  // per host, the hosts its latest datagram suspects
  // Per host, the numbers received within the last window_ below its newest
  // (a datagram sent to several of a host's addresses counts once).
  std::vector<std::set<uint32_t>> received(hosts);
  Clock::time_point next_send = Clock::now();
  Clock::time_point bad_since{};  // since when this host finds some host bad
  bool any_bad = false;
  uint64_t mine = 0;  // the hosts this host finds bad
  const auto timeout = std::chrono::duration<double>(timeout_s_);
  uint32_t seq = 0;
  char t[32], m[32];
  std::snprintf(t, sizeof t, "%g", timeout_s_);
  std::snprintf(m, sizeof m, "%g", max_loss_);
  while (!stop_) {
    if (Clock::now() >= next_send) {
      send_all(host_, seq++, mine);
      next_send = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(interval_s_));
    }
    receive(heard, done, theirs, received);
    const Clock::time_point now = Clock::now();
    // The hosts silent for the timeout, then those that lost too many (judged
    // once the sender has numbered a whole window); the fresh ones: heard
    // within half the timeout and not bad.
    std::vector<int> bad, fresh;
    std::vector<int> lost_of(hosts, 0);
    size_t others = 0, silent = 0;
    for (size_t h = 0; h < hosts; ++h) {
      if (static_cast<int>(h) == host_ || done[h]) continue;
      ++others;
      const std::set<uint32_t>& r = received[h];
      if (!r.empty() && *r.rbegin() + 1 >= static_cast<uint32_t>(window_))
        lost_of[h] = window_ - static_cast<int>(r.size());
      if (now - heard[h] > timeout) {
        bad.insert(bad.begin() + static_cast<std::ptrdiff_t>(silent++), static_cast<int>(h));
        lost_of[h] = -1;
      } else if (window_ >= kMinLossWindow && lost_of[h] > max_loss_ * window_) {
        bad.push_back(static_cast<int>(h));
      } else if (now - heard[h] < timeout / 2) {
        fresh.push_back(static_cast<int>(h));
      }
    }
    mine = 0;
    for (int h : bad) mine |= bit(h);
    if (bad.empty()) {
      any_bad = false;
      continue;
    }
    if (!any_bad) any_bad = true, bad_since = now;
    const bool waited = now - bad_since >= kGrace;
    int report = bad[0];
    if (others >= 2) {
      // A fresh host that finds this one bad, or none fresh: this host's own link.
      bool me = fresh.empty();
      for (int h : fresh) me = me || (theirs[h] & bit(host_)) != 0;
      if (me) {
        if (!waited) continue;
        if (silent == others)
          lost("[heartbeat] host " + names_[host_] + " (this host) heard none of the other " +
               std::to_string(others) + " hosts for " + t + " s: its link is down; ending the job");
        lost("[heartbeat] host " + names_[host_] + " (this host): the other hosts' heartbeats and its own are lost "
             "(more than " + option_name("heartbeat_max_loss") + " " + m + "): its link is lossy; ending the job");
      }
      // At once when a fresh host agrees, else after the grace.
      report = -1;
      for (int x : bad)
        for (int h : fresh)
          if (report < 0 && (theirs[h] & bit(x)) != 0) report = x;
      if (report < 0) {
        if (!waited) continue;
        report = bad[0];
      }
    }
    report_host(report, lost_of[report], t, m);
  }
}

// Waits up to 20 ms for datagrams and takes in every one that came: when
// each host was last heard, what it suspects, its numbers within the loss
// window, and the hosts that said goodbye.
void HostHeartbeat::receive(std::vector<Clock::time_point>& heard, std::vector<bool>& done,
                            std::vector<uint64_t>& theirs, std::vector<std::set<uint32_t>>& received) {
  const size_t hosts = names_.size();
  pollfd p{socket_, POLLIN, 0};
  if (poll(&p, 1, 20) <= 0) return;
  Datagram d{};
  while (recv(socket_, &d, sizeof d, MSG_DONTWAIT) == sizeof d) {
    if (d.what >= 0 && static_cast<size_t>(d.what) < hosts) {
      heard[d.what] = Clock::now();
      theirs[d.what] = d.suspects;
      std::set<uint32_t>& r = received[d.what];
      r.insert(d.seq);
      const uint32_t newest = *r.rbegin();
      if (newest >= static_cast<uint32_t>(window_)) r.erase(r.begin(), r.upper_bound(newest - window_));
    }
    if (d.what <= -2 && static_cast<size_t>(-d.what - 2) < hosts) done[-d.what - 2] = true;
  }
}

// Ends the job naming host `report`: silent (lost < 0) or lossy (`lost` of
// the window lost); `t` and `m` the timeout and the max loss as printed.
void HostHeartbeat::report_host(int report, int lost_count, const char* t, const char* m) {
  const auto [first, last] = ranks_[report];
  const std::string who =
      "[heartbeat] host " + names_[report] + " (ranks " + std::to_string(first) + "-" + std::to_string(last) + ") ";
  if (lost_count < 0) lost(who + "sent no heartbeat for " + t + " s: its link is down or it stopped; ending the job");
  char pct[32];
  std::snprintf(pct, sizeof pct, "%.0f%%", 100.0 * lost_count / window_);
  lost(who + "lost " + std::to_string(lost_count) + " of its last " + std::to_string(window_) + " heartbeats (" +
       pct + ", more than " + option_name("heartbeat_max_loss") + " " + m + "): its link is lossy; ending the job");
}

void HostHeartbeat::lost(const std::string& message) {
  if (claim_report(message)) {
    std::fprintf(stderr, "hspmd: error: %s\n", message.c_str());
    std::fflush(stderr);
  }
  std::_Exit(1);
}

}  // namespace hspmd::cli
