// TCP sockets' counters of this process (tcp_traffic.h).
#include "comm/tcp_traffic.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <linux/tcp.h>  // tcp_info with the byte and segment counters (glibc's lacks them)
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace hspmd {

namespace {

// Whether two socket addresses name the same host (same IP), or the peer is
// loopback: such a socket does not cross a host's link.
bool same_host(const sockaddr_storage& local, const sockaddr_storage& peer) {
  if (local.ss_family != peer.ss_family) return false;
  if (peer.ss_family == AF_INET) {
    const auto& l = reinterpret_cast<const sockaddr_in&>(local);
    const auto& p = reinterpret_cast<const sockaddr_in&>(peer);
    return p.sin_addr.s_addr == l.sin_addr.s_addr || (ntohl(p.sin_addr.s_addr) >> 24) == 127;
  }
  if (peer.ss_family == AF_INET6) {
    const auto& l = reinterpret_cast<const sockaddr_in6&>(local);
    const auto& p = reinterpret_cast<const sockaddr_in6&>(peer);
    return std::memcmp(&p.sin6_addr, &l.sin6_addr, sizeof(in6_addr)) == 0 || IN6_IS_ADDR_LOOPBACK(&p.sin6_addr);
  }
  return true;
}

// Adds socket `fd`'s counters when it is a TCP stream to another host.
void add_socket(int fd, TcpTraffic& total) {
  int type = 0;
  socklen_t len = sizeof(type);
  if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_STREAM) return;
  sockaddr_storage local{}, peer{};
  socklen_t local_len = sizeof(local), peer_len = sizeof(peer);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_len) != 0) return;
  if (local.ss_family != AF_INET && local.ss_family != AF_INET6) return;
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_len) != 0 || same_host(local, peer)) return;
  tcp_info info{};
  len = sizeof(info);
  if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) != 0) return;
  total.bytes += static_cast<int64_t>(info.tcpi_bytes_sent);
  total.segments += static_cast<int64_t>(info.tcpi_segs_out);
}

}  // namespace

TcpTraffic tcp_traffic_to_other_hosts() {
  TcpTraffic total;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return total;
  const int own = dirfd(dir);
  while (const dirent* e = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || fd == own) continue;
    char link[64];
    char path[64];
    std::snprintf(path, sizeof(path), "/proc/self/fd/%ld", fd);
    const ssize_t n = readlink(path, link, sizeof(link) - 1);
    if (n <= 0 || std::strncmp(link, "socket:", 7) != 0) continue;
    add_socket(static_cast<int>(fd), total);
  }
  closedir(dir);
  return total;
}

}  // namespace hspmd
