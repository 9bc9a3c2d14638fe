// What a training checkpoint must agree on with the run that resumes it
// (docs/checkpoint.md, "What a resume checks"): its meta is validated
// field by field, and the model and the data mode it was written under must
// be the run's, so that a checkpoint is never loaded into another model
// (cut, zero-extended or misread) nor continued under another sampling.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "hspmd/models/config.h"
#include "hspmd/train/trainer.h"

namespace hspmd::train_common {

// The meta a checkpoint records about the run beside its state: "model"
// (the config's JSON) and "data" ({"mode": "samples" | "token_budget",
// "seq_len", "global_batch", "pack_documents"}).
nlohmann::json resume_meta(const ModelConfig& model, const TrainOptions& o);

// The meta's samples and seed, checked: throws hspmd::Error "[checkpoint]
// DIR: meta.samples: <value> is not an integer in [0, 2^63)" (or
// meta.seed: "... is not an integer in [0, 2^64)", a missing field, ...).
struct ResumeCursor {
  int64_t samples = 0;
  uint64_t seed = 0;
};
ResumeCursor read_resume_cursor(const nlohmann::json& meta, const std::string& dir);

// Throws hspmd::Error "[checkpoint] DIR: written for <field> <value>, but
// <this run> has <value>; resume with the model and data flags it was
// written with" when the recorded model config or data mode differs from
// the run's (checkpoints without them, written before they were recorded,
// are not checked).
void check_resume_matches(const nlohmann::json& meta, const ModelConfig& model, const TrainOptions& o,
                          const std::string& dir);

}  // namespace hspmd::train_common
