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
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "hspmd/core/error.h"
#include "launcher.h"

namespace hspmd::cli {
namespace {

constexpr int kNameChars = 64;
constexpr int kMaxAddresses = 4;
// A datagram holds the sender's host index h, or -(h + 2) when it is done.
int32_t bye(int host) { return -(host + 2); }

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

double heartbeat_timeout_s() {
  const char* v = std::getenv("HSPMD_HEARTBEAT_TIMEOUT");
  if (v == nullptr || *v == '\0') return 10;
  char* end = nullptr;
  const double t = std::strtod(v, &end);
  if (*end != '\0' || !(t >= 0) || t > 3600)
    fail("[flags] HSPMD_HEARTBEAT_TIMEOUT must be seconds in [0, 3600] (0: off), got '", v, "'");
  return t;
}

HostHeartbeat::HostHeartbeat(Communicator& world, double timeout_s) : timeout_s_(timeout_s) {
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
  interval_s_ = std::min(1.0, timeout_s / 5);
  thread_ = std::thread([this] { run(); });
}

HostHeartbeat::~HostHeartbeat() {
  if (thread_.joinable()) {
    stop_ = true;
    thread_.join();
    for (int i = 0; i < 3; ++i) send_all(bye(host_));
  }
  if (socket_ >= 0) close(socket_);
}

void HostHeartbeat::send_all(int32_t what) {
  for (size_t h = 0; h < names_.size(); ++h) {
    if (static_cast<int>(h) == host_) continue;
    for (uint32_t a : addresses_[h]) {
      sockaddr_in to{};
      to.sin_family = AF_INET;
      to.sin_port = static_cast<in_port_t>(ports_[h]);
      to.sin_addr.s_addr = a;
      sendto(socket_, &what, sizeof what, MSG_DONTWAIT, reinterpret_cast<sockaddr*>(&to), sizeof to);
    }
  }
}

void HostHeartbeat::run() {
  const size_t hosts = names_.size();
  std::vector<Clock::time_point> heard(hosts, Clock::now());
  std::vector<bool> done(hosts, false);
  Clock::time_point next_send = Clock::now();
  const auto timeout = std::chrono::duration<double>(timeout_s_);
  while (!stop_) {
    if (Clock::now() >= next_send) {
      send_all(host_);
      next_send = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(interval_s_));
    }
    pollfd p{socket_, POLLIN, 0};
    if (poll(&p, 1, 100) > 0) {
      int32_t what = 0;
      while (recv(socket_, &what, sizeof what, MSG_DONTWAIT) == sizeof what) {
        if (what >= 0 && static_cast<size_t>(what) < hosts) heard[what] = Clock::now();
        if (what <= -2 && static_cast<size_t>(-what - 2) < hosts) done[-what - 2] = true;
      }
    }
    const Clock::time_point now = Clock::now();
    std::vector<int> silent;
    for (size_t h = 0; h < hosts; ++h)
      if (static_cast<int>(h) != host_ && !done[h] && now - heard[h] > timeout) silent.push_back(static_cast<int>(h));
    if (silent.empty()) continue;
    char t[32];
    std::snprintf(t, sizeof t, "%g", timeout_s_);
    if (silent.size() + 1 == hosts && hosts > 2) {
      if (now - heard[silent[0]] < timeout + std::chrono::seconds(3)) continue;  // the others report first
      lost("[heartbeat] host " + names_[host_] + " (this host) heard none of the other " +
           std::to_string(hosts - 1) + " hosts for " + t + " s: its link is down; ending the job");
    }
    const auto [first, last] = ranks_[silent[0]];
    lost("[heartbeat] host " + names_[silent[0]] + " (ranks " + std::to_string(first) + "-" + std::to_string(last) +
         ") sent no heartbeat for " + t + " s: its link is down or it stopped; ending the job");
  }
}

void HostHeartbeat::lost(const std::string& message) {
  if (claim_report(message)) {
    std::fprintf(stderr, "hspmd: error: %s\n", message.c_str());
    std::fflush(stderr);
  }
  std::_Exit(1);
}

}  // namespace hspmd::cli
