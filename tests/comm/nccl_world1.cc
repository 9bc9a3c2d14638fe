// The NCCL communicator at a world of one rank on the GPU (docs/comm.md):
// every collective and a batched send / receive to itself on device buffers,
// every dtype, the unequal-pieces paths, waits on the host and on a stream,
// byte counters, and the one-line errors. Exits 0 (pass), 1 (a case
// failed) or 77 (no CUDA device or no NCCL: CTest reports it skipped).
// One line per case: RESULT probe=nccl_world1 case=<c> status=PASS|FAIL
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "hspmd/comm/communicator.h"
#include "hspmd/core/device.h"
#include "hspmd/core/error.h"
#include "kernels/memory.h"

namespace hspmd {
namespace {

int failures = 0;

void result(const std::string& name, bool ok, const std::string& detail = "") {
  std::printf("RESULT probe=nccl_world1 case=%s %s status=%s\n", name.c_str(), detail.c_str(), ok ? "PASS" : "FAIL");
  if (!ok) ++failures;
}

template <typename F>
void run_case(const std::string& name, F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    result(name, false, std::string("error=\"") + e.what() + "\"");
  }
}

Stream& gpu() { return default_stream(Device::cuda(0)); }

NDArray up(const std::vector<float>& v) { return kernels::to_device(gpu(), NDArray::from_vector({(int64_t)v.size()}, v)); }
std::vector<float> down(const NDArray& a) { return kernels::to_host(gpu(), a).to(DType::F32).to_vector(); }

int run() {
  if (!built_with_nccl() || cuda_device_count() == 0) {
    std::printf("SKIP nccl_world1: %s\n", built_with_nccl() ? "no CUDA device" : "no NCCL in this build");
    return 77;
  }
  auto host = make_single_process_communicator();
  std::unique_ptr<Communicator> comm;
  try {
    comm = make_nccl_communicator(*host, Device::cuda(0));
  } catch (const std::exception& e) {
    std::printf("SKIP nccl_world1: %s\n", e.what());
    return 77;
  }
  std::printf("INFO probe=nccl_world1 nccl_version=%d\n", nccl_version());
  const std::vector<float> x = {1.5f, -2.0f, 3.25f, 0.0f, 7.0f};

  run_case("all_reduce_f32_sum_max", [&] {
    NDArray a = up(x);
    std::vector<Request> r;
    r.push_back(comm->start_all_reduce(gpu(), a));
    comm->wait_all(r);
    bool ok = down(a) == x;
    r.push_back(comm->start_all_reduce(gpu(), a, ReduceOp::kMax));
    comm->wait_on(r, gpu());  // ordered before the copy back on the stream
    ok = ok && down(a) == x && r.empty();
    result("all_reduce_f32_sum_max", ok);
  });

  run_case("all_reduce_every_dtype", [&] {
    bool ok = true;
    for (DType t : {DType::BF16, DType::F64, DType::I32, DType::I64}) {
      NDArray host = NDArray::from_vector({5}, x).to(t == DType::BF16 ? DType::BF16 : DType::F32);
      if (t == DType::F64 || t == DType::I32 || t == DType::I64) {
        host = NDArray::empty({5}, t, Device::cpu());
        for (int i = 0; i < 5; ++i) {
          if (t == DType::F64) host.host_data<double>()[i] = x[i];
          if (t == DType::I32) host.host_data<int32_t>()[i] = static_cast<int32_t>(x[i]);
          if (t == DType::I64) host.host_data<int64_t>()[i] = static_cast<int64_t>(x[i]);
        }
      }
      NDArray a = kernels::to_device(gpu(), host);
      std::vector<Request> r;
      r.push_back(comm->start_all_reduce(gpu(), a));
      comm->wait_all(r);
      NDArray back = kernels::to_host(gpu(), a);
      ok = ok && std::memcmp(back.host_raw_data(), host.host_raw_data(), host.nbytes()) == 0;
    }
    result("all_reduce_every_dtype", ok);
  });

  run_case("reduce_scatter_all_gather_broadcast", [&] {
    NDArray a = up(x), out = up(std::vector<float>(5, 0.0f));
    std::vector<Request> r;
    r.push_back(comm->start_reduce_scatter(gpu(), a, out, {5}));
    r.push_back(comm->start_broadcast(gpu(), a, 0));
    comm->wait_all(r);
    bool ok = down(out) == x && down(a) == x;
    NDArray g = up(std::vector<float>(5, 9.0f));
    r.push_back(comm->start_all_gather(gpu(), a.slice(0, 0, 5).contiguous(), g, {5}));
    comm->wait_all(r);
    ok = ok && down(g) == x;
    result("reduce_scatter_all_gather_broadcast", ok);
  });

  run_case("batched_send_recv_to_itself", [&] {
    NDArray a = up(x), b = up(std::vector<float>(5, 0.0f));
    comm->batched_send_recv(gpu(), {send_buffer(0, a)}, {recv_buffer(0, b)});
    result("batched_send_recv_to_itself", down(b) == x);
  });

  run_case("group_of_one_and_bytes", [&] {
    const bool same = &comm->group({0}) == comm.get();
    const ByteCounters c = comm->bytes();
    // World 1: collectives move nothing; the message to itself counts.
    result("group_of_one_and_bytes", same && c.sent == 20 && c.received == 20,
           "sent=" + std::to_string(c.sent) + " received=" + std::to_string(c.received));
  });

  run_case("host_buffers_and_errors", [&] {
    // Host buffers go to the host library (here the single-process stub).
    std::vector<double> h = {1.0, 2.5};
    comm->all_reduce(h.data(), 2);
    std::string e1, e2;
    try {
      comm->group({0, 1});
    } catch (const Error& e) {
      e1 = e.what();
    }
    try {
      NDArray a = up(x);
      std::vector<Request> r;
      r.push_back(comm->start_all_reduce(gpu(), a.data<float>(), -1, DType::F32));
    } catch (const Error& e) {
      e2 = e.what();
    }
    const bool ok = h == std::vector<double>{1.0, 2.5} && e1.rfind("[comm] group", 0) == 0 &&
                    e2 == "[comm] ncclAllReduce: negative count -1";
    result("host_buffers_and_errors", ok, "e1=\"" + e1 + "\" e2=\"" + e2 + "\"");
  });

  std::printf("nccl_world1: %s\n", failures == 0 ? "all cases passed" : "FAILED");
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace hspmd

int main() {
  try {
    return hspmd::run();
  } catch (const std::exception& e) {
    std::printf("RESULT probe=nccl_world1 case=setup error=\"%s\" status=FAIL\n", e.what());
    return 1;
  }
}
