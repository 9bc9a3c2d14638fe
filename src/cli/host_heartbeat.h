// A heartbeat between the hosts of a job (docs/multi_host.md, "Heartbeat
// between hosts"): the first rank of each host sends a UDP datagram to the
// first rank of every other host each interval, over the network the ranks
// use, so that a host whose link goes down is found in seconds instead of
// when TCP gives up (minutes).
#pragma once

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "hspmd/comm/communicator.h"

namespace hspmd::cli {

// HSPMD_HEARTBEAT_TIMEOUT (seconds, default 10, 0 = off; the launcher passes
// HSPMD_* variables to every host). hspmd::Error "[flags] ..." for a value
// that is not a number in [0, 3600].
double heartbeat_timeout_s();

class HostHeartbeat {
 public:
  // Collective over `world`: gathers every rank's host name and, from the
  // first rank of each host, a UDP port and its IPv4 addresses (those inside
  // OMPI_MCA_btl_tcp_if_include when it is set). On a job of one host, or
  // with timeout_s 0, does nothing more. Otherwise the first rank of each
  // host runs a thread that ends the process (exit 1) with one line when a
  // host has sent nothing for timeout_s: "[heartbeat] host H (ranks a-b)
  // sent no heartbeat for T s: its link is down or it stopped; ending the
  // job", or, on the host that hears no other host, "[heartbeat] host H
  // (this host) heard none of the other K hosts for T s: its link is down;
  // ending the job" (after a short grace, so that the others' line comes
  // first). Only the job's first such line is printed (claim_report).
  HostHeartbeat(Communicator& world, double timeout_s);
  // Tells the other hosts that this one is done (so that a host that
  // finishes first is not taken for a lost one) and stops the thread.
  ~HostHeartbeat();
  HostHeartbeat(const HostHeartbeat&) = delete;
  HostHeartbeat& operator=(const HostHeartbeat&) = delete;

 private:
  void run();
  void send_all(int32_t what);
  [[noreturn]] void lost(const std::string& message);

  double timeout_s_ = 0, interval_s_ = 1;
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
