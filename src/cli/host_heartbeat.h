// A heartbeat between the hosts of a job (docs/multi_host.md, "Heartbeat
// between hosts"): the first rank of each host sends a numbered UDP datagram
// to the first rank of every other host each interval, over the network the
// ranks use, so that a host whose link goes down or turns lossy is found in
// seconds instead of when TCP gives up (minutes) or crawls on.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "hspmd/comm/communicator.h"

namespace hspmd::cli {

class HostHeartbeat {
 public:
  // Collective over `world`: gathers every rank's host name and, from the
  // first rank of each host, a UDP port and its IPv4 addresses (those inside
  // OMPI_MCA_btl_tcp_if_include when it is set). On a job of one host, or
  // with timeout_s 0, does nothing more. Otherwise the first rank of each
  // host runs a thread that sends a datagram every interval_s() and ends the
  // process (exit 1) with one line when a host has sent nothing for
  // timeout_s ("[heartbeat] host H (ranks a-b) sent no heartbeat for T s:
  // its link is down or it stopped; ending the job") or when, of the last
  // window() datagrams it numbered (covering timeout_s), more than max_loss
  // never came ("[heartbeat] host H (ranks a-b) lost L of its last W
  // heartbeats (P%, more than --heartbeat-max-loss M): its link is lossy;
  // ending the job"). With three hosts or more a host reports another at
  // once only when a third host (its datagrams carry what it suspects)
  // agrees; the host that hears (well) from no other host, or that the
  // others suspect, ends its own ranks after a short grace, so that the
  // others' line comes first; with no agreement, after the grace, the host
  // whose datagrams the others lost the most of (the datagrams carry each
  // sender's loss counts: most_blamed) is named, which may be this one.
  // Only the job's first such line is printed (claim_report).
  HostHeartbeat(Communicator& world, double timeout_s, double max_loss);
  // The send interval and the loss window (datagrams) for a timeout.
  static double interval_s(double timeout_s);
  static int window(double timeout_s);
  // Tells the other hosts that this one is done (so that a host that
  // finishes first is not taken for a lost one) and stops the thread.
  ~HostHeartbeat();
  HostHeartbeat(const HostHeartbeat&) = delete;
  HostHeartbeat& operator=(const HostHeartbeat&) = delete;

 private:
  using Clock = std::chrono::steady_clock;
  struct Peers;
  struct Judged;
  void run();
  void receive(Peers& peers);
  Judged judge(const Peers& peers, Clock::time_point now) const;
  void decide(Peers& peers, const Judged& j, bool waited);
  [[noreturn]] void report_host(int report, int lost_count, const char* t, const char* m);
  void send_all(int32_t what, uint32_t seq, uint64_t suspects, const std::vector<double>& loss);
  [[noreturn]] void lost(const std::string& message);

  double timeout_s_ = 0, max_loss_ = 0.2, interval_s_ = 1;
  int window_ = 0;
  int host_ = 0;                                    // this rank's host index
  std::vector<std::string> names_;                  // per host
  std::vector<std::pair<int, int>> ranks_;          // per host: first and last rank
  std::vector<std::vector<uint32_t>> addresses_;    // per host: IPv4 (network order)
  std::vector<int> ports_;                          // per host (network order)
  int socket_ = -1;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace hspmd::cli
