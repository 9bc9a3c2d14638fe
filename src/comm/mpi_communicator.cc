// The MPI backend (HSPMD_MPI): a duplicate of MPI_COMM_WORLD with errors
// returned (never aborting), sub-communicators made by MPI_Comm_create_group
// (collective over the members only) and cached by member list, and
// non-blocking operations throughout so that callers can overlap several.
// Every dtype maps to an MPI type; bf16, which MPI lacks, travels as
// MPI_UINT16_T and is reduced by user-defined operations (bf16_sum, bf16_max).
#include <fcntl.h>
#include <unistd.h>

#include <mutex>
#include <mpi.h>

#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <string>

#include "hspmd/comm/communicator.h"
#include "hspmd/core/error.h"
#include "hspmd/core/options.h"

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

MPI_Datatype mpi_type(DType dtype) {
  switch (dtype) {
    case DType::F32: return MPI_FLOAT;
    case DType::F64: return MPI_DOUBLE;
    case DType::I32: return MPI_INT32_T;
    case DType::I64: return MPI_INT64_T;
    case DType::BF16: return MPI_UINT16_T;  // the bit pattern; reductions by bf16_op
  }
  HSPMD_CHECK(false, "no MPI type for dtype ", static_cast<int>(dtype));
}

// bf16 reductions: each combining step widens both operands to f32, adds
// (or compares) there and rounds back to bf16 with f32_to_bf16 (nearest
// even). MPI may apply the step in any tree order (the ops are commutative),
// so a sum is exact whenever every partial sum is representable in bf16.
void bf16_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = f32_to_bf16(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
}

void bf16_max(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) {
    const float x = bf16_to_f32(a[i]), y = bf16_to_f32(b[i]);
    if (!std::isnan(y) && (std::isnan(x) || x > y)) b[i] = a[i];  // NaN wins in any order
  }
}

// The user-defined bf16 operations, created on first use (after MPI_Init)
// and freed before MPI_Finalize when hspmd finalizes MPI. Created under a
// lock: the training thread (a bf16 TP all-reduce) and the gradient
// overlap's communication thread (--grad-reduce-dtype bf16) may both be first.
MPI_Op bf16_ops[2] = {MPI_OP_NULL, MPI_OP_NULL};  // kSum, kMax
std::mutex bf16_ops_mutex;

MPI_Op mpi_op(DType dtype, ReduceOp op) {
  HSPMD_CHECK(op == ReduceOp::kSum || op == ReduceOp::kMax, "unknown reduce op ", static_cast<int>(op));
  const bool max = op == ReduceOp::kMax;
  if (dtype != DType::BF16) return max ? MPI_MAX : MPI_SUM;
  std::lock_guard<std::mutex> lock(bf16_ops_mutex);
  MPI_Op& made = bf16_ops[max ? 1 : 0];
  if (made == MPI_OP_NULL) check(MPI_Op_create(max ? bf16_max : bf16_sum, 1, &made), "MPI_Op_create");
  return made;
}

// One pending MPI operation and what must outlive it (v-collective arrays).
class MpiRequest final : public Request::Impl {
 public:
  MPI_Request request = MPI_REQUEST_NULL;
  std::vector<int> counts, displs;
  const char* call = "";
  int peer = -1;
  int64_t expected = -1;  // recv: the exact message size, in elements of dtype
  DType dtype = DType::F32;
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
  Request do_all_reduce(Stream& stream, void* data, int64_t count, DType dtype, ReduceOp op) override;
  Request do_reduce_scatter(Stream& stream, const void* send, void* recv, const std::vector<int64_t>& counts,
                               DType dtype) override;
  Request do_all_gather(Stream& stream, const void* send, void* recv, const std::vector<int64_t>& counts,
                           DType dtype) override;
  Request do_broadcast(Stream& stream, void* data, int64_t count, DType dtype, int root) override;
  Request do_send(Stream& stream, const void* data, int64_t count, DType dtype, int peer, int tag) override;
  Request do_recv(Stream& stream, void* data, int64_t count, DType dtype, int peer, int tag) override;
  void wait_all(std::vector<Request>& requests) override;
  void barrier() override { check(MPI_Barrier(comm_), "MPI_Barrier"); }
  std::unique_ptr<Communicator> duplicate() override;
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

Request MpiCommunicator::do_all_reduce(Stream& stream, void* data, int64_t count, DType dtype, ReduceOp op) {
  stream.synchronize();
  auto r = std::make_unique<MpiRequest>();
  check(MPI_Iallreduce(MPI_IN_PLACE, data, to_int(count, "MPI_Iallreduce"), mpi_type(dtype), mpi_op(dtype, op), comm_,
                       &r->request),
        "MPI_Iallreduce");
  count_all_reduce(count, dtype);
  return Request(std::move(r));
}

Request MpiCommunicator::do_reduce_scatter(Stream& stream, const void* send, void* recv, const std::vector<int64_t>& counts,
                                              DType dtype) {
  stream.synchronize();
  auto r = std::make_unique<MpiRequest>();
  check_counts(counts, "MPI_Ireduce_scatter", *r);
  check(MPI_Ireduce_scatter(send, recv, r->counts.data(), mpi_type(dtype), mpi_op(dtype, ReduceOp::kSum), comm_,
                            &r->request),
        "MPI_Ireduce_scatter");
  count_reduce_scatter(counts, dtype);
  return Request(std::move(r));
}

Request MpiCommunicator::do_all_gather(Stream& stream, const void* send, void* recv, const std::vector<int64_t>& counts,
                                          DType dtype) {
  stream.synchronize();
  auto r = std::make_unique<MpiRequest>();
  check_counts(counts, "MPI_Iallgatherv", *r);
  const MPI_Datatype type = mpi_type(dtype);
  check(MPI_Iallgatherv(send, r->counts[rank_], type, recv, r->counts.data(), r->displs.data(), type, comm_,
                        &r->request),
        "MPI_Iallgatherv");
  count_all_gather(counts, dtype);
  return Request(std::move(r));
}

Request MpiCommunicator::do_broadcast(Stream& stream, void* data, int64_t count, DType dtype, int root) {
  stream.synchronize();
  check_peer(root, "MPI_Ibcast");
  auto r = std::make_unique<MpiRequest>();
  check(MPI_Ibcast(data, to_int(count, "MPI_Ibcast"), mpi_type(dtype), root, comm_, &r->request), "MPI_Ibcast");
  count_broadcast(count, dtype, root);
  return Request(std::move(r));
}

Request MpiCommunicator::do_send(Stream& stream, const void* data, int64_t count, DType dtype, int peer, int tag) {
  stream.synchronize();
  check_peer(peer, "MPI_Isend");
  auto r = std::make_unique<MpiRequest>();
  check(MPI_Isend(data, to_int(count, "MPI_Isend"), mpi_type(dtype), peer, tag, comm_, &r->request), "MPI_Isend");
  count_send(count, dtype);
  return Request(std::move(r));
}

Request MpiCommunicator::do_recv(Stream& stream, void* data, int64_t count, DType dtype, int peer, int tag) {
  stream.synchronize();
  check_peer(peer, "MPI_Irecv");
  auto r = std::make_unique<MpiRequest>();
  r->call = "MPI_Irecv";
  r->peer = peer;
  r->expected = count;
  r->dtype = dtype;
  check(MPI_Irecv(data, to_int(count, "MPI_Irecv"), mpi_type(dtype), peer, tag, comm_, &r->request), "MPI_Irecv");
  count_recv(count, dtype);
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
    const MpiRequest& p = *pending[i];
    if (p.expected < 0) continue;
    int got = 0;
    check(MPI_Get_count(&statuses[i], mpi_type(p.dtype), &got), "MPI_Get_count");
    if (got == MPI_UNDEFINED) {  // a sender of another dtype
      check(MPI_Get_count(&statuses[i], MPI_BYTE, &got), "MPI_Get_count");
      const char* name = dtype_name(p.dtype);
      fail("[comm] ", p.call, ": a message of ", got, " bytes (not whole ", name, " elements) from rank ", p.peer,
           " where ", p.expected, " ", name, " elements were expected");
    }
    if (got != p.expected)
      fail("[comm] ", p.call, ": a message of ", got, " ", dtype_name(p.dtype), " elements from rank ", p.peer,
           " where ", p.expected, " were expected");
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
  if (finalized) return;
  for (MPI_Op& op : bf16_ops)
    if (op != MPI_OP_NULL) MPI_Op_free(&op);
  MPI_Finalize();
}

// At exit (glibc's on_exit passes the exit status). A rank under the
// launcher (`hspmd launch`, `hspmd train --nproc`: HSPMD_JOB_DIR is set) that
// exits with a failure -- sys.exit(3), an uncaught Python exception, a C++
// rank returning 1 -- does not finalize: MPI_Finalize waits for every rank
// while the others may wait in a collective for this one, and the job would
// hang with no dead rank for the launcher to see (issue 39 item 4). The
// first such rank leaves "R C" in the job directory's `exit` file (mpirun's
// banner naming it is not always relayed), then MPI_Abort with the status
// ends the job at once; the launcher says "rank R exited with code C".
void finalize_mpi_at_exit(int status, void*) {
  int finalized = 0, size = 1, rank = 0;
  MPI_Finalized(&finalized);
  const char* job_dir = std::getenv("HSPMD_JOB_DIR");
  if (!finalized && status != 0 && job_dir != nullptr && MPI_Comm_size(MPI_COMM_WORLD, &size) == MPI_SUCCESS &&
      size > 1) {
    std::fflush(stdout);
    std::fflush(stderr);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    const std::string path = std::string(job_dir) + "/exit";
    const int fd = ::open(path.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0600);
    if (fd >= 0) {
      const std::string text = std::to_string(rank) + " " + std::to_string(status) + "\n";
      [[maybe_unused]] const ssize_t written = ::write(fd, text.data(), text.size());  // else mpirun's banner
      ::close(fd);
    }
    MPI_Abort(MPI_COMM_WORLD, status);
  }
  finalize_mpi();
}

}  // namespace

std::unique_ptr<Communicator> MpiCommunicator::duplicate() {
  int level = MPI_THREAD_SINGLE;
  check(MPI_Query_thread(&level), "MPI_Query_thread");
  if (level < MPI_THREAD_MULTIPLE)
    fail("[comm] MPI_Comm_dup for a communication thread: this MPI was initialized without MPI_THREAD_MULTIPLE "
         "(it provides level ", level, "); train without the gradient overlap (",
         option_spelling() == OptionSpelling::kFlag ? option_name("no_overlap") : std::string("overlap=False"), ")");
  MPI_Comm dup = MPI_COMM_NULL;
  check(MPI_Comm_dup(comm_, &dup), "MPI_Comm_dup");
  return std::make_unique<MpiCommunicator>(dup, std::make_shared<ByteCounters>());
}

namespace {

// Open MPI's non-blocking all-reduce (coll/libnbc) takes a binomial tree, a
// reduce to the group's first member and a broadcast back, for every group
// under 4 members and for every in-place call (all of hspmd's): that member
// sends and receives twice what the others do, each phase uses one direction
// of a link at a time, and a step's time depends on how independent groups'
// phases happen to interleave on a shared link (on the test hosts, 1.13 to
// 1.40 s for one plan whose ring takes 1.06 s). A ring has every member send
// and receive 2(n-1)/n of the buffer at once, both directions of every link
// busy: what NCCL does on GPUs, what the byte counters and the cost model
// bill. So a job whose ranks span hosts (job_spans_hosts) asks for the ring. A job on one host keeps the tree: its
// all-reduces are shared-memory copies bound by latency, and ranks that
// share cores (the emulated clusters) wait a scheduler slice per round,
// which the ring's 2(n-1) rounds pay more often (4 data-parallel ranks on 2
// cores: 48-50 ms a step with the tree, 78-88 ms with the ring). Set before
// MPI_Init, which reads it (docs/comm.md, "The MPI backend's all-reduce"); a
// user's own setting (the variable, or mpirun's --mca) wins. Other MPI
// libraries ignore the variable.
void prefer_ring_all_reduce() {
  if (job_spans_hosts()) setenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "ring", /*overwrite=*/0);
}

}  // namespace

std::unique_ptr<Communicator> make_world_communicator() {
  int initialized = 0;
  check(MPI_Initialized(&initialized), "MPI_Initialized");
  if (!initialized) {
    if (!launched_by_mpi()) return make_single_process_communicator();  // staged already
    int provided = 0;
    prefer_ring_all_reduce();
    // Multiple: the overlapped gradient synchronization drives a duplicate
    // world from its own thread (duplicate()).
    check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
    on_exit(finalize_mpi_at_exit, nullptr);
  }
  MPI_Comm world = MPI_COMM_NULL;
  check(MPI_Comm_dup(MPI_COMM_WORLD, &world), "MPI_Comm_dup");
  return make_staged_communicator(std::make_unique<MpiCommunicator>(world, std::make_shared<ByteCounters>()),
                                  stage_host_buffers_requested());
}

bool built_with_mpi() { return true; }

}  // namespace hspmd
