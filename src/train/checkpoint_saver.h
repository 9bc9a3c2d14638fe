// A distributed run's training checkpoints (docs/checkpoint.md): the run's
// id, agreed on by every rank and stamped into each checkpoint it commits;
// which committed checkpoints are this run's own (another run's is never
// written over or read back); and the background write: every rank copies
// its shards and writes them on a thread while the steps go on, then rank 0
// commits the index (the checkpoint's atomic point) once all have.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "hspmd/comm/communicator.h"
#include "hspmd/io/checkpoint.h"
#include "hspmd/train/trainer.h"

namespace hspmd::dist {

class CheckpointSaver {
 public:
  CheckpointSaver(const TrainOptions& o, Communicator& world) : o_(o), world_(world) {}
  ~CheckpointSaver();
  CheckpointSaver(const CheckpointSaver&) = delete;
  CheckpointSaver& operator=(const CheckpointSaver&) = delete;

  // Collective: the run's id (TrainOptions::run_id, else HSPMD_RUN_ID, else
  // drawn by rank 0).
  void agree_on_run_id();
  const std::string& run_id() const { return run_id_; }
  // With --resume: the checkpoint read (its run id; when it is the
  // --checkpoint directory itself, its checkpoints count as this run's
  // until replaced).
  void resumed_from(const CheckpointReader& reader);
  // Whether --checkpoint holds a committed checkpoint of this run.
  bool own_committed() const;
  // Whether the committed checkpoint of this run is the one of `step`
  // (waits for the pending write first). Collective.
  bool committed_at(int64_t step);
  // check_checkpoint_owner for this run writing into `dir`: rank 0 reads
  // the index, every rank throws the same error. Collective.
  void check_owner_agreed(const std::string& dir, const std::string& what);
  // Writes `shards` (copies: the steps go on) of `step` into `dir` on a
  // background thread (synchronously with --checkpoint-sync); finish()
  // commits it with `meta`.
  void start(const std::string& dir, int64_t step, std::vector<CheckpointShard> shards, nlohmann::json meta);
  // Collective. When every rank's writer is done (or `wait`: after waiting
  // for them), rank 0 commits the pending checkpoint; a writer's error ends
  // the run. Does nothing without a pending checkpoint.
  void finish(bool wait);

 private:
  struct Pending {
    int64_t step = 0;
    std::string dir;  // where it is committed
    nlohmann::json meta;
    std::thread writer;
    std::atomic<bool> done{false};
    std::string error;  // the writer's failure, or ""
  };
  const TrainOptions& o_;
  Communicator& world_;
  std::string run_id_;
  // With --resume the --checkpoint directory itself: the run id of the
  // checkpoint resumed (it counts as this run's own until replaced).
  std::optional<std::string> resumed_run_id_;
  // With --resume: the run id of the checkpoint resumed, wherever it is.
  std::optional<std::string> resume_run_id_;
  std::unique_ptr<Pending> pending_;
};

}  // namespace hspmd::dist
