#include "train/checkpoint_saver.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "hspmd/core/error.h"
#include "hspmd/core/options.h"
#include "train/collectives.h"

namespace hspmd::dist {

CheckpointSaver::~CheckpointSaver() {
  if (pending_ && pending_->writer.joinable()) pending_->writer.join();
}

void CheckpointSaver::agree_on_run_id() {
  std::string id = o_.run_id;
  if (const char* env = std::getenv("HSPMD_RUN_ID"); id.empty() && env != nullptr) id = env;
  if (!id.empty()) {
    run_id_ = id;
    return;
  }
  uint64_t value = 0;  // rank 0 draws it; the others take rank 0's
  if (world_.rank() == 0) value = std::stoull(new_run_id(), nullptr, 16);
  world_.broadcast(&value, 1, DType::I64, 0);
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(value));
  run_id_ = buf;
}

void CheckpointSaver::resumed_from(const CheckpointReader& reader) {
  resume_run_id_ = reader.index().meta.value("run_id", std::string());
  std::error_code ec;
  if (!o_.checkpoint_dir.empty() && std::filesystem::equivalent(o_.resume_dir, o_.checkpoint_dir, ec))
    resumed_run_id_ = reader.index().meta.value("run_id", std::string());
}

bool CheckpointSaver::own_committed() const {
  if (o_.checkpoint_dir.empty() || !checkpoint_exists(o_.checkpoint_dir)) return false;
  const std::string id = checkpoint_run_id(o_.checkpoint_dir);
  return id == run_id_ || (resumed_run_id_ && id == *resumed_run_id_);
}

bool CheckpointSaver::committed_at(int64_t step) {
  finish(true);
  return own_committed() && CheckpointReader(o_.checkpoint_dir).index().step == step;
}

void CheckpointSaver::check_owner_agreed(const std::string& dir, const std::string& what) {
  std::string error;
  if (world_.rank() == 0) {
    CheckpointWriter w;
    w.what = what;
    std::error_code ec;
    w.overwrite = o_.overwrite_checkpoint && !o_.checkpoint_dir.empty() &&
                  std::filesystem::equivalent(dir, o_.checkpoint_dir, ec);
    w.resume_dir = o_.resume_dir;
    w.resume_run_id = resume_run_id_;
    w.run_id = run_id_;
    w.fix = what == "[checkpoint] save_checkpoint"
                ? "a run writes over its own checkpoints and the one it resumed only; give another directory "
                  "(or load_checkpoint " + dir + " to continue that run)"
                : "a run writes over its own checkpoints and the one it resumed only (another run committed "
                  "there after this one started); give another " + option_name("checkpoint");
    try {
      check_checkpoint_owner(dir, w);
    } catch (const Error& e) {
      error = e.what();
    }
  }
  broadcast_text(error, world_);
  if (!error.empty()) fail(error);
}

void CheckpointSaver::start(const std::string& dir, int64_t step, std::vector<CheckpointShard> shards,
                            nlohmann::json meta) {
  auto p = std::make_unique<Pending>();
  p->step = step;
  p->dir = dir;
  p->meta = std::move(meta);
  Pending* raw = p.get();
  const int rank = world_.rank();
  p->writer = std::thread([raw, rank, dir, shards = std::move(shards)] {
    try {
      write_checkpoint_shards(dir, raw->step, rank, shards);
    } catch (const std::exception& e) {
      raw->error = e.what();
    }
    raw->done = true;
  });
  pending_ = std::move(p);
  if (o_.checkpoint_sync) finish(true);
}

void CheckpointSaver::finish(bool wait) {
  if (!pending_) return;  // the same on every rank: saves are collective
  int64_t busy = !wait && !pending_->done ? 1 : 0;
  world_.all_reduce(&busy, 1, ReduceOp::kMax);
  if (busy) return;
  pending_->writer.join();
  int64_t failed = pending_->error.empty() ? 0 : 1;
  world_.all_reduce(&failed, 1, ReduceOp::kMax);
  if (failed) {
    const std::string error = pending_->error, dir = pending_->dir;
    pending_.reset();
    fail(error.empty() ? std::string("[checkpoint] ") + dir + ": another rank failed to write its shards"
                       : error);
  }
  if (world_.rank() == 0) commit_checkpoint(pending_->dir, pending_->step, world_.size(), pending_->meta);
  world_.barrier();  // committed before any rank reads index.json
  pending_.reset();
}

}  // namespace hspmd::dist
