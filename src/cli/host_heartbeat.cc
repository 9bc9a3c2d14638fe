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
#include "heartbeat_blame.h"
#include "launcher.h"

namespace hspmd::cli {
namespace {

constexpr int kNameChars = 64;
constexpr int kMaxAddresses = 4;
// A datagram holds the sender's host index h, or -(h + 2) when it is done,
// and its number (0, 1, ... per sender), from which receivers count losses.
// It also carries, for the first 64 hosts, those the sender finds silent or
// lossy (bit h), so that a host can tell whether the others agree, and the
// share of each host's datagrams the sender lost over its last window (in
// thousandths; kUnknownLoss before a whole window, and for the sender),
// from which a host tells whose link is at fault when none agrees.
constexpr int kMaxJudgedHosts = 64;
constexpr uint16_t kUnknownLoss = 0xFFFF;
struct Datagram {
  int32_t what;
  uint32_t seq;
  uint64_t suspects;
  uint16_t loss[kMaxJudgedHosts];
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
    for (int i = 0; i < 3; ++i) send_all(bye(host_), 0, 0, {});
  }
  if (socket_ >= 0) close(socket_);
}

// What the thread knows of the other hosts: when each was last heard, which
// hosts its latest datagram suspects and the losses it reported (a row of
// most_blamed's table), its numbers within the last window below its newest
// (a datagram sent to several of a host's addresses counts once), and
// whether it said goodbye.
struct HostHeartbeat::Peers {
  explicit Peers(size_t hosts)
      : heard(hosts, Clock::now()), done(hosts, false), suspects(hosts, 0),
        loss(hosts, std::vector<double>(hosts, -1.0)), received(hosts) {}
  std::vector<Clock::time_point> heard;
  std::vector<bool> done;
  std::vector<uint64_t> suspects;
  std::vector<std::vector<double>> loss;
  std::vector<std::set<uint32_t>> received;
};

// One look at the other hosts: the silent ones (nothing for the timeout),
// then the lossy ones (judged once the sender has numbered a whole window),
// in `bad`; the fresh ones (heard within half the timeout and not bad); per
// host the datagrams lost of its last window (-1: silent); this host's row
// of the loss table.
struct HostHeartbeat::Judged {
  std::vector<int> bad, fresh, lost_of;
  std::vector<double> loss;
  size_t others = 0, silent = 0;
};

HostHeartbeat::Judged HostHeartbeat::judge(const Peers& peers, Clock::time_point now) const {
  const size_t hosts = names_.size();
  const auto timeout = std::chrono::duration<double>(timeout_s_);
  Judged j;
  j.lost_of.assign(hosts, 0);
  j.loss.assign(hosts, -1.0);
  for (size_t h = 0; h < hosts; ++h) {
    if (static_cast<int>(h) == host_ || peers.done[h]) continue;
    ++j.others;
    const std::set<uint32_t>& r = peers.received[h];
    if (!r.empty() && *r.rbegin() + 1 >= static_cast<uint32_t>(window_)) {
      j.lost_of[h] = window_ - static_cast<int>(r.size());
      j.loss[h] = static_cast<double>(j.lost_of[h]) / window_;
    }
    if (now - peers.heard[h] > timeout) {
      j.bad.insert(j.bad.begin() + static_cast<std::ptrdiff_t>(j.silent++), static_cast<int>(h));
      j.lost_of[h] = -1;
      j.loss[h] = 1.0;
    } else if (window_ >= kMinLossWindow && j.lost_of[h] > max_loss_ * window_) {
      j.bad.push_back(static_cast<int>(h));
    } else if (now - peers.heard[h] < timeout / 2) {
      j.fresh.push_back(static_cast<int>(h));
    }
  }
  return j;
}

void HostHeartbeat::send_all(int32_t what, uint32_t seq, uint64_t suspects, const std::vector<double>& loss) {
  Datagram d{what, seq, suspects, {}};
  for (int h = 0; h < kMaxJudgedHosts; ++h) {
    const double l = static_cast<size_t>(h) < loss.size() ? loss[static_cast<size_t>(h)] : -1.0;
    d.loss[h] = l < 0 ? kUnknownLoss : static_cast<uint16_t>(std::lround(std::min(l, 1.0) * 1000));
  }
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
  Peers peers(names_.size());
  Clock::time_point next_send = Clock::now();
  // Since when this host finds some host bad, and when it last did: a count
  // near the line dips under it now and then (at 30% loss a window of 40
  // holds 8 or fewer losses one time in ten), which must not restart the
  // grace; only a grace's length with nothing bad does.
  Clock::time_point bad_since{}, last_bad{};
  bool any_bad = false;
  uint64_t mine = 0;  // the hosts this host finds bad
  std::vector<double> my_loss;
  uint32_t seq = 0;
  while (!stop_) {
    if (Clock::now() >= next_send) {
      send_all(host_, seq++, mine, my_loss);
      next_send = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(interval_s_));
    }
    receive(peers);
    const Clock::time_point now = Clock::now();
    Judged j = judge(peers, now);
    my_loss = j.loss;
    mine = 0;
    for (int h : j.bad) mine |= bit(h);
    if (j.bad.empty()) {
      if (any_bad && now - last_bad >= kGrace) any_bad = false;
      continue;
    }
    if (!any_bad) any_bad = true, bad_since = now;
    last_bad = now;
    decide(peers, j, now - bad_since >= kGrace);
  }
}

// With three hosts or more: this host's own link when a fresh host finds it
// bad or none is fresh; another host at once when a fresh host agrees; else,
// after the grace, the host the table blames most (most_blamed), which may
// be this one. With two hosts: the other one at once.
void HostHeartbeat::decide(Peers& peers, const Judged& j, bool waited) {
  char t[32], m[32];
  std::snprintf(t, sizeof t, "%g", timeout_s_);
  std::snprintf(m, sizeof m, "%g", max_loss_);
  const std::string self_lossy = "[heartbeat] host " + names_[host_] +
                                 " (this host): the other hosts' heartbeats and its own are lost (more than " +
                                 option_name("heartbeat_max_loss") + " " + m + "): its link is lossy; ending the job";
  int report = j.bad[0];
  if (j.others >= 2) {
    bool me = j.fresh.empty();
    for (int h : j.fresh) me = me || (peers.suspects[h] & bit(host_)) != 0;
    if (me) {
      if (!waited) return;
      if (j.silent == j.others)
        lost("[heartbeat] host " + names_[host_] + " (this host) heard none of the other " +
             std::to_string(j.others) + " hosts for " + t + " s: its link is down; ending the job");
      lost(self_lossy);
    }
    report = -1;
    for (int x : j.bad)
      for (int h : j.fresh)
        if (report < 0 && (peers.suspects[h] & bit(x)) != 0) report = x;
    if (report < 0) {
      if (!waited) return;
      peers.loss[static_cast<size_t>(host_)] = j.loss;
      report = most_blamed(peers.loss, j.bad, host_);
      if (report == host_) lost(self_lossy);
    }
  }
  report_host(report, j.lost_of[report], t, m);
}

// Waits up to 20 ms for datagrams and takes in every one that came.
void HostHeartbeat::receive(Peers& peers) {
  const size_t hosts = names_.size();
  pollfd p{socket_, POLLIN, 0};
  if (poll(&p, 1, 20) <= 0) return;
  Datagram d{};
  while (recv(socket_, &d, sizeof d, MSG_DONTWAIT) == sizeof d) {
    if (d.what >= 0 && static_cast<size_t>(d.what) < hosts) {
      const auto h = static_cast<size_t>(d.what);
      peers.heard[h] = Clock::now();
      peers.suspects[h] = d.suspects;
      for (size_t c = 0; c < hosts; ++c)
        peers.loss[h][c] = c >= kMaxJudgedHosts || d.loss[c] == kUnknownLoss ? -1.0 : d.loss[c] / 1000.0;
      std::set<uint32_t>& r = peers.received[h];
      r.insert(d.seq);
      const uint32_t newest = *r.rbegin();
      if (newest >= static_cast<uint32_t>(window_)) r.erase(r.begin(), r.upper_bound(newest - window_));
    }
    if (d.what <= -2 && static_cast<size_t>(-d.what - 2) < hosts) peers.done[static_cast<size_t>(-d.what - 2)] = true;
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
