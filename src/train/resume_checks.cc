#include "train/resume_checks.h"

#include <limits>
#include <string>
#include <vector>

#include "hspmd/core/error.h"
#include "hspmd/core/options.h"
#include "hspmd/core/json_file.h"

namespace hspmd::train_common {

namespace {

using nlohmann::json;

json data_meta(const DataOptions& o) {
  return {{"mode", o.batch_tokens > 0 ? "token_budget" : "samples"},
          {"seq_len", o.seq_len},
          {"global_batch", o.batch_tokens > 0 ? 0 : o.global_batch},
          {"pack_documents", o.pack_documents}};
}

}  // namespace

json resume_meta(const ModelConfig& model, const TrainOptions& o) {
  json m = model.to_json();
  m.erase("initializer_range");  // only the initialization reads it
  return {{"model", m}, {"data", data_meta(o)}};
}

ResumeCursor read_resume_cursor(const json& meta, const std::string& dir) {
  ResumeCursor c;
  if (!meta.is_object()) fail("[checkpoint] ", dir, ": meta is not a JSON object");
  const auto samples = meta.find("samples");
  if (samples == meta.end()) fail("[checkpoint] ", dir, ": meta.samples is missing");
  if (!samples->is_number_integer() ||
      (samples->is_number_unsigned() ? samples->get<uint64_t>() > uint64_t{std::numeric_limits<int64_t>::max()}
                                     : samples->get<int64_t>() < 0))
    fail("[checkpoint] ", dir, ": meta.samples: ", json_excerpt(*samples), " is not an integer in [0, 2^63)");
  c.samples = samples->get<int64_t>();
  const auto seed = meta.find("seed");
  if (seed == meta.end()) fail("[checkpoint] ", dir, ": meta.seed is missing");
  if (!seed->is_number_integer() || (!seed->is_number_unsigned() && seed->get<int64_t>() < 0))
    fail("[checkpoint] ", dir, ": meta.seed: ", json_excerpt(*seed), " is not an integer in [0, 2^64)");
  c.seed = seed->get<uint64_t>();
  return c;
}

void check_resume_matches(const json& meta, const ModelConfig& model, const TrainOptions& o, const std::string& dir) {
  const json now = resume_meta(model, o);
  for (const char* part : {"model", "data"}) {
    const auto was = meta.find(part);
    if (was == meta.end()) continue;  // written before it was recorded
    if (!was->is_object()) fail("[checkpoint] ", dir, ": meta.", part, " is not a JSON object");
    std::vector<std::string> fields;  // the data mode first: it explains the other data fields
    if (part == std::string("data")) fields = {"mode", "seq_len", "global_batch", "pack_documents"};
    else
      for (const auto& item : now[part].items()) fields.push_back(item.key());
    for (const std::string& field : fields) {
      const json& value = now[part][field];
      const auto it = was->find(field);
      const json before = it == was->end() ? json(nullptr) : *it;
      if (before == value) continue;
      fail("[checkpoint] ", dir, ": written for ", part == std::string("model") ? "" : "data ", field, " ",
           json_excerpt(before), ", but this run has ", json_excerpt(value), "; resume with the ",
           part == std::string("model") ? option_name("model") : "data flags", " it was written with");
    }
  }
}

}  // namespace hspmd::train_common
