#include "hspmd/comm/shadow.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <numeric>
#include <set>

#include "hspmd/core/error.h"

namespace hspmd {

namespace {

size_t bytes_of(int64_t count, DType dtype) { return static_cast<size_t>(count) * dtype_size(dtype); }

class ShadowCommunicator final : public Communicator {
 public:
  ShadowCommunicator(int size, int rank, std::shared_ptr<ByteCounters> counters)
      : Communicator(std::move(counters)), size_(size), rank_(rank) {
    if (size < 1) fail("[comm] shadow: a group needs at least one member, got ", size);
    if (rank < 0 || rank >= size) fail("[comm] shadow: rank ", rank, " is outside a group of ", size);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  Communicator& group(const std::vector<int>& ranks) override {
    auto found = groups_.find(ranks);
    if (found != groups_.end()) return *found->second;
    const std::set<int> distinct(ranks.begin(), ranks.end());
    if (distinct.size() != ranks.size()) fail("[comm] shadow: group lists a rank twice");
    for (int r : ranks)
      if (r < 0 || r >= size_) fail("[comm] shadow: group member ", r, " is outside a group of ", size_);
    const auto me = std::find(ranks.begin(), ranks.end(), rank_);
    if (me == ranks.end()) fail("[comm] shadow: rank ", rank_, " is not a member of the group it asks for");
    auto sub = std::make_unique<ShadowCommunicator>(static_cast<int>(ranks.size()),
                                                    static_cast<int>(me - ranks.begin()), shared_counters());
    return *groups_.emplace(ranks, std::move(sub)).first->second;
  }

  void wait_all(std::vector<Request>& requests) override { requests.clear(); }
  void barrier() override {}
  void abort(int) override {}

 protected:
  Request do_all_reduce(Stream& stream, void*, int64_t count, DType dtype, ReduceOp) override {
    stream.synchronize();
    count_all_reduce(count, dtype);
    return {};
  }
  Request do_reduce_scatter(Stream& stream, const void* send, void* recv, const std::vector<int64_t>& counts,
                            DType dtype) override {
    stream.synchronize();
    check_counts(counts, "reduce_scatter");
    count_reduce_scatter(counts, dtype);
    const auto* src = static_cast<const char*>(send) + bytes_of(offset(counts, rank_), dtype);
    if (src != recv) std::memmove(recv, src, bytes_of(counts[rank_], dtype));
    return {};
  }
  Request do_all_gather(Stream& stream, const void* send, void* recv, const std::vector<int64_t>& counts,
                        DType dtype) override {
    stream.synchronize();
    check_counts(counts, "all_gather");
    count_all_gather(counts, dtype);
    auto* out = static_cast<char*>(recv);
    char* mine = out + bytes_of(offset(counts, rank_), dtype);
    if (mine != send) std::memmove(mine, send, bytes_of(counts[rank_], dtype));
    for (int m = 0; m < size_; ++m)
      if (m != rank_) std::memset(out + bytes_of(offset(counts, m), dtype), 0, bytes_of(counts[m], dtype));
    return {};
  }
  Request do_broadcast(Stream& stream, void*, int64_t count, DType dtype, int root) override {
    stream.synchronize();
    check_peer(root, "broadcast");
    count_broadcast(count, dtype, root);
    return {};
  }
  Request do_send(Stream& stream, const void*, int64_t count, DType dtype, int peer, int) override {
    stream.synchronize();
    check_peer(peer, "send");
    count_send(count, dtype);
    return {};
  }
  Request do_recv(Stream& stream, void* data, int64_t count, DType dtype, int peer, int) override {
    stream.synchronize();
    check_peer(peer, "recv");
    count_recv(count, dtype);
    std::memset(data, 0, bytes_of(count, dtype));
    return {};
  }

 private:
  static int64_t offset(const std::vector<int64_t>& counts, int member) {
    return std::accumulate(counts.begin(), counts.begin() + member, int64_t{0});
  }
  void check_counts(const std::vector<int64_t>& counts, const char* call) const {
    if (static_cast<int>(counts.size()) != size_)
      fail("[comm] shadow ", call, ": ", counts.size(), " counts for a group of ", size_);
  }
  void check_peer(int peer, const char* call) const {
    if (peer < 0 || peer >= size_) fail("[comm] shadow ", call, ": rank ", peer, " is outside a group of ", size_);
  }

  int size_, rank_;
  std::map<std::vector<int>, std::unique_ptr<ShadowCommunicator>> groups_;
};

}  // namespace

std::unique_ptr<Communicator> make_shadow_communicator(int size, int rank) {
  return std::make_unique<ShadowCommunicator>(size, rank, std::make_shared<ByteCounters>());
}

}  // namespace hspmd
