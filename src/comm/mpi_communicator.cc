// The MPI backend (HSPMD_MPI): a duplicate of MPI_COMM_WORLD with errors
// returned (never aborting), sub-communicators made by MPI_Comm_create_group
// (collective over the members only) and cached by member list, and
// non-blocking operations throughout so that callers can overlap several.
#include <mpi.h>

#include <climits>
#include <cstdlib>
#include <map>
#include <set>
#include <string>

#include "hspmd/comm/communicator.h"
#include "hspmd/core/error.h"

namespace hspmd {
namespace {

constexpr int kGroupTag = 0x4753;  // MPI_Comm_create_group's tag

std::string mpi_error(int rc) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(rc);
  return std::string(text, len);
}

void check(int rc, const char* call) {
  if (rc != MPI_SUCCESS) fail("[comm] ", call, ": ", mpi_error(rc));
}

int to_int(int64_t count, const char* call) {
  if (count < 0 || count > INT_MAX) fail("[comm] ", call, ": count ", count, " outside MPI's int range");
  return static_cast<int>(count);
}

// One pending MPI operation and what must outlive it (v-collective arrays).
class MpiRequest final : public Request::Impl {
 public:
  MPI_Request request = MPI_REQUEST_NULL;
  std::vector<int> counts, displs;
  const char* call = "";
  int peer = -1;
  int64_t expected = -1;  // recv: the exact message size
};

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, std::shared_ptr<ByteCounters> counters)
      : Communicator(std::move(counters)), comm_(comm) {
    check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
  }
  ~MpiCommunicator() override {
    groups_.clear();
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Communicator& group(const std::vector<int>& ranks) override;
  Request start_all_reduce(float* data, int64_t count) override;
  Request start_reduce_scatter(const float* send, float* recv, const std::vector<int64_t>& counts) override;
  Request start_all_gather(const float* send, float* recv, const std::vector<int64_t>& counts) override;
  Request start_broadcast(float* data, int64_t count, int root) override;
  Request start_send(const float* data, int64_t count, int peer, int tag) override;
  Request start_recv(float* data, int64_t count, int peer, int tag) override;
  void wait_all(std::vector<Request>& requests) override;
  void barrier() override { check(MPI_Barrier(comm_), "MPI_Barrier"); }
  void abort(int code) override { MPI_Abort(MPI_COMM_WORLD, code); }

 private:
  void check_counts(const std::vector<int64_t>& counts, const char* call, MpiRequest& r) const;
  void check_peer(int peer, const char* call) const {
    if (peer < 0 || peer >= size_) fail("[comm] ", call, ": rank ", peer, " outside a communicator of ", size_);
  }

  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
  std::map<std::vector<int>, std::unique_ptr<MpiCommunicator>> groups_;
};

Communicator& MpiCommunicator::group(const std::vector<int>& ranks) {
  auto it = groups_.find(ranks);
  if (it != groups_.end()) return *it->second;
  const std::set<int> distinct(ranks.begin(), ranks.end());
  if (ranks.empty() || distinct.size() != ranks.size() || *distinct.begin() < 0 || *distinct.rbegin() >= size_)
    fail("[comm] group: members must be distinct ranks of a communicator of ", size_);
  if (!distinct.count(rank_)) fail("[comm] group: rank ", rank_, " asks for a group without itself");
  MPI_Group parent, members;
  check(MPI_Comm_group(comm_, &parent), "MPI_Comm_group");
  check(MPI_Group_incl(parent, static_cast<int>(ranks.size()), ranks.data(), &members), "MPI_Group_incl");
  MPI_Comm comm = MPI_COMM_NULL;
  const int rc = MPI_Comm_create_group(comm_, members, kGroupTag, &comm);
  MPI_Group_free(&members);
  MPI_Group_free(&parent);
  check(rc, "MPI_Comm_create_group");
  auto made = std::make_unique<MpiCommunicator>(comm, shared_counters());
  return *groups_.emplace(ranks, std::move(made)).first->second;
}

void MpiCommunicator::check_counts(const std::vector<int64_t>& counts, const char* call, MpiRequest& r) const {
  if (static_cast<int>(counts.size()) != size_)
    fail("[comm] ", call, ": ", counts.size(), " counts for a communicator of ", size_);
  int64_t offset = 0;
  for (int64_t c : counts) {
    r.counts.push_back(to_int(c, call));
    r.displs.push_back(to_int(offset, call));
    offset += c;
  }
  to_int(offset, call);
}

Request MpiCommunicator::start_all_reduce(float* data, int64_t count) {
  auto r = std::make_unique<MpiRequest>();
  check(MPI_Iallreduce(MPI_IN_PLACE, data, to_int(count, "MPI_Iallreduce"), MPI_FLOAT, MPI_SUM, comm_, &r->request),
        "MPI_Iallreduce");
  count_all_reduce(count);
  return Request(std::move(r));
}

Request MpiCommunicator::start_reduce_scatter(const float* send, float* recv, const std::vector<int64_t>& counts) {
  auto r = std::make_unique<MpiRequest>();
  check_counts(counts, "MPI_Ireduce_scatter", *r);
  check(MPI_Ireduce_scatter(send, recv, r->counts.data(), MPI_FLOAT, MPI_SUM, comm_, &r->request),
        "MPI_Ireduce_scatter");
  count_reduce_scatter(counts);
  return Request(std::move(r));
}

Request MpiCommunicator::start_all_gather(const float* send, float* recv, const std::vector<int64_t>& counts) {
  auto r = std::make_unique<MpiRequest>();
  check_counts(counts, "MPI_Iallgatherv", *r);
  check(MPI_Iallgatherv(send, r->counts[rank_], MPI_FLOAT, recv, r->counts.data(), r->displs.data(), MPI_FLOAT,
                        comm_, &r->request),
        "MPI_Iallgatherv");
  count_all_gather(counts);
  return Request(std::move(r));
}

Request MpiCommunicator::start_broadcast(float* data, int64_t count, int root) {
  check_peer(root, "MPI_Ibcast");
  auto r = std::make_unique<MpiRequest>();
  check(MPI_Ibcast(data, to_int(count, "MPI_Ibcast"), MPI_FLOAT, root, comm_, &r->request), "MPI_Ibcast");
  count_broadcast(count, root);
  return Request(std::move(r));
}

Request MpiCommunicator::start_send(const float* data, int64_t count, int peer, int tag) {
  check_peer(peer, "MPI_Isend");
  auto r = std::make_unique<MpiRequest>();
  check(MPI_Isend(data, to_int(count, "MPI_Isend"), MPI_FLOAT, peer, tag, comm_, &r->request), "MPI_Isend");
  count_send(count);
  return Request(std::move(r));
}

Request MpiCommunicator::start_recv(float* data, int64_t count, int peer, int tag) {
  check_peer(peer, "MPI_Irecv");
  auto r = std::make_unique<MpiRequest>();
  r->call = "MPI_Irecv";
  r->peer = peer;
  r->expected = count;
  check(MPI_Irecv(data, to_int(count, "MPI_Irecv"), MPI_FLOAT, peer, tag, comm_, &r->request), "MPI_Irecv");
  count_recv(count);
  return Request(std::move(r));
}

void MpiCommunicator::wait_all(std::vector<Request>& requests) {
  std::vector<MpiRequest*> pending;
  std::vector<MPI_Request> handles;
  for (Request& r : requests) {
    if (!r.pending()) continue;
    auto* m = dynamic_cast<MpiRequest*>(r.impl());
    HSPMD_CHECK(m != nullptr, "wait_all: a request of another backend");
    pending.push_back(m);
    handles.push_back(m->request);
  }
  std::vector<MPI_Status> statuses(handles.size());
  const int rc = MPI_Waitall(static_cast<int>(handles.size()), handles.data(), statuses.data());
  if (rc == MPI_ERR_IN_STATUS) {
    for (const MPI_Status& s : statuses)
      if (s.MPI_ERROR != MPI_SUCCESS && s.MPI_ERROR != MPI_ERR_PENDING) check(s.MPI_ERROR, "MPI_Waitall");
  }
  check(rc, "MPI_Waitall");
  for (size_t i = 0; i < pending.size(); ++i) {
    if (pending[i]->expected < 0) continue;
    int got = 0;
    check(MPI_Get_count(&statuses[i], MPI_FLOAT, &got), "MPI_Get_count");
    if (got != pending[i]->expected)
      fail("[comm] ", pending[i]->call, ": a message of ", got, " floats from rank ", pending[i]->peer,
           " where ", pending[i]->expected, " were expected");
  }
  requests.clear();
}

bool launched_by_mpi() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "PMI_RANK", "MV2_COMM_WORLD_SIZE"})
    if (std::getenv(var)) return true;
  return false;
}

void finalize_mpi() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

}  // namespace

std::unique_ptr<Communicator> make_world_communicator() {
  int initialized = 0;
  check(MPI_Initialized(&initialized), "MPI_Initialized");
  if (!initialized) {
    if (!launched_by_mpi()) return make_single_process_communicator();
    int provided = 0;
    check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
    std::atexit(finalize_mpi);
  }
  MPI_Comm world = MPI_COMM_NULL;
  check(MPI_Comm_dup(MPI_COMM_WORLD, &world), "MPI_Comm_dup");
  return std::make_unique<MpiCommunicator>(world, std::make_shared<ByteCounters>());
}

bool built_with_mpi() { return true; }

}  // namespace hspmd
