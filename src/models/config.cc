#include "hspmd/models/config.h"

#include <algorithm>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>

#include "hspmd/core/error.h"
#include "hspmd/core/json_file.h"
#include "hspmd/models/model.h"
#include "models/config_fields.h"

namespace hspmd {
namespace {

using nlohmann::json;

void validate(const ModelConfig& c, const ConfigFields& r) {
  const std::pair<const char*, int64_t> sizes[] = {
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.hidden_size},
      {"intermediate_size", c.intermediate_size},
      {"num_hidden_layers", c.num_hidden_layers},
      {"num_attention_heads", c.num_attention_heads},
      {"num_key_value_heads", c.num_key_value_heads},
      {"max_position_embeddings", c.max_position_embeddings}};
  for (const auto& [name, value] : sizes)
    if (value <= 0) r.fail_rule(name, "=", value, " must be positive");
  if (c.num_hidden_layers > kMaxHiddenLayers)
    r.fail_rule("num_hidden_layers=", c.num_hidden_layers, " is more than hspmd builds (at most ", kMaxHiddenLayers,
                ": every layer is its own part of the graph on every rank; docs/models.md)");
  if (c.hidden_size % c.num_attention_heads != 0)
    r.fail_rule("num_attention_heads=", c.num_attention_heads, " does not divide hidden_size=", c.hidden_size);
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    r.fail_rule("num_key_value_heads=", c.num_key_value_heads,
                " does not divide num_attention_heads=", c.num_attention_heads);
  if (c.head_dim() % 2 != 0)
    r.fail_rule("head_dim=hidden_size/num_attention_heads=", c.head_dim(), " must be even (RoPE rotates pairs)");
  // Written as !(x > 0) so NaN is rejected too.
  if (!(c.rms_norm_eps > 0)) r.fail_rule("rms_norm_eps=", c.rms_norm_eps, " must be positive");
  if (!(c.rope_theta > 0)) r.fail_rule("rope_theta=", c.rope_theta, " must be positive");
  if (!(c.initializer_range > 0)) r.fail_rule("initializer_range=", c.initializer_range, " must be positive");
  if (c.eos_token_id < 0 || c.eos_token_id >= c.vocab_size)
    r.fail_rule("eos_token_id=", c.eos_token_id, " is outside the vocabulary [0, ", c.vocab_size, ")");
}

// Fields every family refuses: each would make the run train a different
// model than the file describes.
void reject_unsupported(const json& j, const ConfigFields& r, int64_t hidden, int64_t heads) {
  std::string text;
  r.string("hidden_act", text);
  if (!text.empty() && text != "silu") r.fail_rule("hidden_act '", shorten(text), "' is not supported (only silu)");
  int64_t head_dim = 0;
  r.integer("head_dim", head_dim, false);
  if (j.contains("head_dim") && !j["head_dim"].is_null() && heads > 0 && head_dim * heads != hidden)
    r.fail_rule("head_dim=", head_dim, " is not supported (only hidden_size/num_attention_heads=", hidden / heads, ")");
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null())
    r.fail_rule("rope_scaling ", json_excerpt(j["rope_scaling"]), " is not supported (only null)");
  for (const char* bias : {"attention_bias", "mlp_bias"}) {
    bool on = false;
    r.boolean(bias, on);
    if (on) r.fail_rule(bias, "=true is not supported (only false)");
  }
  double dropout = 0;
  r.number("attention_dropout", dropout);
  if (dropout != 0) r.fail_rule("attention_dropout=", dropout, " is not supported (only 0: hspmd trains without dropout)");
}

}  // namespace

ModelConfig ModelConfig::from_json(const json& j, const std::string& source) {
  ConfigFields r(j, source);
  if (!j.is_object()) r.fail_rule("the config is not a JSON object");
  ModelConfig c;
  r.string("model_type", c.model_type);
  const ModelFamily* family = find_model_family(c.model_type);
  if (family == nullptr)
    r.fail_rule("model_type '", shorten(c.model_type), "' is not supported (registered: ", registered_model_types(), ")");
  family->set_defaults(c);
  r.integer("vocab_size", c.vocab_size, true);
  r.integer("hidden_size", c.hidden_size, true);
  r.integer("intermediate_size", c.intermediate_size, true);
  r.integer("num_hidden_layers", c.num_hidden_layers, true);
  r.integer("num_attention_heads", c.num_attention_heads, true);
  c.num_key_value_heads = c.num_attention_heads;
  r.integer("num_key_value_heads", c.num_key_value_heads, false);
  r.number("rms_norm_eps", c.rms_norm_eps);
  r.number("rope_theta", c.rope_theta);
  r.integer("max_position_embeddings", c.max_position_embeddings, false);
  r.boolean("tie_word_embeddings", c.tie_word_embeddings);
  r.integer_or_first_of_list("eos_token_id", c.eos_token_id);
  r.number("initializer_range", c.initializer_range);
  r.integer("padded_vocab_size", c.padded_vocab_size, false);
  validate(c, r);
  reject_unsupported(j, r, c.hidden_size, c.num_attention_heads);
  family->read_config(r, c);
  if (c.padded_vocab_size != 0 && c.padded_vocab_size < c.vocab_size)
    r.fail_rule("padded_vocab_size=", c.padded_vocab_size, " is smaller than vocab_size=", c.vocab_size);
  return c;
}

ModelConfig ModelConfig::load(const std::string& path) {
  return from_json(read_json_file(path, "config"), path);
}

ParameterCount count_parameters(const ModelConfig& c) {
  // One layer's declarations: the count costs nothing per layer, whatever
  // num_hidden_layers says (the memory check runs before anything is built).
  // A mixture-of-experts model's sparse and dense layers are counted apart.
  ParameterCount out;
  double most = -1;
  auto count = [&](ModelConfig one, int64_t block_copies, bool with_rest) {
    one.num_hidden_layers = 1;
    for (const ModelParameter& p : model_parameters(one)) {
      if (p.part != ModelPart::kBlock && !with_rest) continue;
      double n = 1;
      for (int64_t d : p.shape) n *= static_cast<double>(d);
      const int64_t copies = p.part == ModelPart::kBlock ? block_copies : 1;
      n *= static_cast<double>(copies);
      out.total += n;
      if (n > most) {
        most = n;
        out.largest = p.name;
        out.largest_shape = p.shape;
        out.largest_copies = copies;
      }
    }
  };
  if (!c.moe.any()) {
    count(c, c.num_hidden_layers, true);
    return out;
  }
  const int64_t sparse = c.sparse_layers();
  ModelConfig sparse_one = c, dense_one = c;
  sparse_one.moe.decoder_sparse_step = 1;
  sparse_one.moe.mlp_only_layers.clear();
  dense_one.moe.mlp_only_layers = {0};
  count(sparse_one, sparse, true);
  if (sparse < c.num_hidden_layers) count(dense_one, c.num_hidden_layers - sparse, false);
  return out;
}

double ModelConfig::parameter_count() const { return count_parameters(*this).total; }

bool ModelConfig::Moe::sparse_layer(int64_t i) const {
  if (num_experts <= 0 || decoder_sparse_step <= 0 || (i + 1) % decoder_sparse_step != 0) return false;
  return std::find(mlp_only_layers.begin(), mlp_only_layers.end(), i) == mlp_only_layers.end();
}

int64_t ModelConfig::sparse_layers() const {
  int64_t n = 0;
  for (int64_t i = 0; i < num_hidden_layers; ++i) n += moe.sparse_layer(i) ? 1 : 0;
  return n;
}

std::optional<uint64_t> machine_memory_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  while (in >> key >> kib) {
    if (key == "MemTotal:") return kib * 1024;
    in.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
  }
  return std::nullopt;
}

void check_parameters_fit_memory(const ModelConfig& c, const std::string& source, int bytes_per_parameter,
                                 const char* what) {
  const std::optional<uint64_t> total = machine_memory_bytes();
  if (!total) return;
  const ParameterCount count = count_parameters(c);
  const double bytes = count.total * bytes_per_parameter;
  if (bytes <= static_cast<double>(*total)) return;
  std::ostringstream gib;
  gib.precision(3);
  gib << count.total << " parameters need " << bytes / (1u << 30) << " GiB (" << bytes_per_parameter
      << " bytes each: " << what << "), more than this machine's "
      << static_cast<double>(*total) / (1u << 30) << " GiB (MemTotal); the largest parameter: " << count.largest
      << " " << shape_str(count.largest_shape);
  if (count.largest_copies != 1) gib << " in each of " << count.largest_copies << " layers";
  fail("[config] ", source, ": ", gib.str());
}

json ModelConfig::to_json() const {
  json j = {{"model_type", model_type},
          {"vocab_size", vocab_size},
          {"hidden_size", hidden_size},
          {"intermediate_size", intermediate_size},
          {"num_hidden_layers", num_hidden_layers},
          {"num_attention_heads", num_attention_heads},
          {"num_key_value_heads", num_key_value_heads > 0 ? num_key_value_heads : num_attention_heads},
          {"rms_norm_eps", rms_norm_eps},
          {"rope_theta", rope_theta},
          {"max_position_embeddings", max_position_embeddings},
          {"tie_word_embeddings", tie_word_embeddings},
          {"eos_token_id", eos_token_id},
          {"initializer_range", initializer_range}};
  if (table_rows() != vocab_size) j["padded_vocab_size"] = padded_vocab_size;
  model_family(model_type).write_config(*this, j);
  return j;
}

}  // namespace hspmd
