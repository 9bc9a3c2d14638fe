// What this process has sent to other hosts over TCP, read from the kernel
// (docs/multi_host.md, "Bytes on the wire"). Between hosts Open MPI's ranks
// talk over its TCP transport (btl tcp), one socket per peer process; within
// a host over shared memory, which no socket carries. Linux only.
#pragma once

#include <cstdint>

namespace hspmd {

// Totals over this process's TCP sockets whose peer address is not one of
// the socket's own host (its local address, loopback): what the kernel's
// TCP_INFO says each sent since it was opened.
struct TcpTraffic {
  int64_t bytes = 0;     // stream bytes sent (MPI's payload and its headers; retransmissions included)
  int64_t segments = 0;  // TCP segments sent, data and pure acknowledgements
};

// Reads /proc/self/fd and asks each socket for TCP_INFO: cheap (microseconds
// per socket), thread-safe, never throws; a socket closed meanwhile is
// skipped. All zero in a process with no such socket.
TcpTraffic tcp_traffic_to_other_hosts();

}  // namespace hspmd
