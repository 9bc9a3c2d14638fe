#include "train/step_log.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "hspmd/core/error.h"
#include "hspmd/core/options.h"
#include "kernels/attention.h"
#include "kernels/memory.h"

namespace hspmd::dist {

namespace {

constexpr int kStepMetricFields = sizeof(StepMetrics) / sizeof(int64_t);
static_assert(sizeof(StepMetrics) == kStepMetricFields * sizeof(int64_t));

int64_t ns(double s) { return static_cast<int64_t>(s * 1e9); }

}  // namespace

StepMeter::StepMeter(Communicator& world) : world_(world), spans_hosts_(world.size() > 1 && job_spans_hosts()) {
  if (spans_hosts_) tcp_ = tcp_traffic_to_other_hosts();
}

StepMetrics StepMeter::measure(const ExecGraph& graph, const VirtualClock* clock, int64_t extra_sent,
                               size_t activations, double grad_sync_s, int64_t overlapped) {
  StepMetrics mine;
  mine.bytes_sent = world_.bytes().sent + extra_sent;
  mine.reshard_sent = graph.ledger().measured;
  mine.reshard_predicted = graph.ledger().predicted;
  mine.op_sent = graph.ledger().op_measured;
  mine.op_predicted = graph.ledger().op_predicted;
  mine.expert_sent = graph.ledger().expert_measured;
  mine.expert_predicted = graph.ledger().expert_predicted;
  mine.clock_ns = clock ? ns(clock->now()) : 0;
  mine.compute_ns = clock ? ns(clock->compute_s()) : 0;
  mine.peak_bytes = static_cast<int64_t>(allocator_for(graph.device()).peak_bytes());
  mine.activation_bytes = static_cast<int64_t>(activations);
  mine.grad_sync_ns = ns(grad_sync_s);
  mine.grad_sync_overlapped = overlapped;
  static const int64_t sm_percent = [] {  // set before the process's first CUDA call (--mps-percent)
    const char* p = std::getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
    return p ? int64_t{std::atoi(p)} : int64_t{0};
  }();
  mine.sm_percent = sm_percent;
  const kernels::FusedAttentionReport attention = kernels::fused_attention_report();
  mine.attention_fallbacks = attention.fallbacks;
  if (attention.fallbacks > 0 && !warned_attention_fallback_) {  // once per rank: the step is far slower
    warned_attention_fallback_ = true;
    std::fprintf(stderr,
                 "hspmd: warning: rank %d: attention fell back from cuDNN's fused attention to hspmd's own, much "
                 "slower kernels (%lld calls so far): %s (HSPMD_CUDNN_ATTENTION=1 makes it an error)\n",
                 world_.rank(), static_cast<long long>(attention.fallbacks), attention.last_fallback.c_str());
  }
  return mine;
}

void StepMeter::fill(const StepMetrics& mine, const VirtualClock* clock, StepRecord& r) {
  std::vector<StepMetrics> all(world_.size());
  world_.all_gather(reinterpret_cast<const int64_t*>(&mine), reinterpret_cast<int64_t*>(all.data()),
                    std::vector<int64_t>(world_.size(), kStepMetricFields));
  int64_t end = 0;
  emulated_compute_.resize(all.size(), 0);
  for (size_t k = 0; k < all.size(); ++k) {
    const StepMetrics& m = all[k];
    r.bytes_sent.push_back(m.bytes_sent);
    r.reshard_bytes_sent.push_back(m.reshard_sent);
    r.predicted_reshard_bytes.push_back(m.reshard_predicted);
    r.op_bytes_sent.push_back(m.op_sent);
    r.predicted_op_bytes.push_back(m.op_predicted);
    r.expert_bytes_sent.push_back(m.expert_sent);
    r.predicted_expert_bytes.push_back(m.expert_predicted);
    r.peak_memory_bytes.push_back(m.peak_bytes);
    r.peak_activation_bytes.push_back(m.activation_bytes);
    r.grad_sync_s.push_back(m.grad_sync_ns * 1e-9);
    r.sm_percent.push_back(m.sm_percent);
    r.grad_sync_overlapped.push_back(m.grad_sync_overlapped);
    r.attention_fallbacks.push_back(m.attention_fallbacks);
    end = std::max(end, m.clock_ns);
    if (!clock) continue;
    r.emulated_compute_s.push_back((m.compute_ns - emulated_compute_[k]) * 1e-9);
    emulated_compute_[k] = m.compute_ns;
  }
  if (spans_hosts_) fill_cross_host(r);
  if (!clock) return;
  r.emulated_step_time_s = (end - emulated_end_) * 1e-9;
  emulated_end_ = end;
}

void StepMeter::fill_cross_host(StepRecord& r) {
  const TcpTraffic now = tcp_traffic_to_other_hosts();
  const int64_t mine[2] = {now.bytes - tcp_.bytes, now.segments - tcp_.segments};
  tcp_ = now;
  std::vector<int64_t> all(2 * static_cast<size_t>(world_.size()));
  world_.all_gather(mine, all.data(), std::vector<int64_t>(world_.size(), 2));
  for (size_t k = 0; k < all.size(); k += 2) {
    r.cross_host_bytes_sent.push_back(all[k]);
    r.cross_host_segments.push_back(all[k + 1]);
  }
}

void StepLog::open(const std::string& path, int rank, bool append) {
  if (rank != 0 || path.empty()) return;
  path_ = path;
  out_.open(path, append ? std::ios::app : std::ios::trunc);
  if (!out_) fail("[train] ", option_name("log"), " ", path, ": cannot open for writing: ", std::strerror(errno));
}

void StepLog::write(const nlohmann::json& record) {
  if (!out_.is_open()) return;
  nlohmann::json stamped = record;
  stamped["unix_time"] =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  out_ << stamped.dump() << "\n" << std::flush;
  if (!out_) fail("[train] ", option_name("log"), " ", path_, ": write failed (disk full or I/O error)");
}

void StepLog::drop_steps_from(int64_t back) {
  if (!out_.is_open()) return;
  out_.close();
  std::vector<std::string> kept;
  {
    std::ifstream in(path_);
    for (std::string line; std::getline(in, line);) {
      const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
      if (!j.is_discarded() && j.contains("loss") && j.value("step", int64_t{0}) >= back) continue;
      kept.push_back(line);
    }
  }
  const std::string tmp = path_ + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    for (const std::string& line : kept) out << line << "\n";
    out.close();
    if (!out) fail("[train] ", option_name("log"), " ", path_, ": write failed (disk full or I/O error)");
  }
  std::filesystem::rename(tmp, path_);
  out_.open(path_, std::ios::app);
  if (!out_) fail("[train] ", option_name("log"), " ", path_, ": cannot reopen for writing: ", std::strerror(errno));
}

}  // namespace hspmd::dist
