// Mistral (model_type "mistral"): the shared decoder with sliding-window
// attention: sliding_window W lets token i attend to keys i - W < j <= i (the
// mask Hugging Face applies); null means no window. Absent, it takes
// MistralConfig's default, 4096.
#include "models/mistral/mistral.h"

#include "models/config_fields.h"
#include "models/decoder.h"

namespace hspmd {

namespace {

constexpr int64_t kDefaultWindow = 4096;  // MistralConfig's default

class MistralFamily final : public DecoderFamily {
 public:
  std::string model_type() const override { return "mistral"; }
  void set_defaults(ModelConfig& c) const override {
    c.max_position_embeddings = 4096 * 32;  // MistralConfig's default
  }
  void read_config(const ConfigFields& r, ModelConfig& c) const override {
    c.sliding_window = r.present("sliding_window") ? 0 : kDefaultWindow;
    r.integer("sliding_window", c.sliding_window, false);
    if (r.given("sliding_window") && c.sliding_window <= 0)
      r.fail_rule("sliding_window=", c.sliding_window, " must be positive (or null: no window)");
  }
  void write_config(const ModelConfig& c, nlohmann::json& j) const override {
    j["sliding_window"] = c.sliding_window > 0 ? nlohmann::json(c.sliding_window) : nlohmann::json(nullptr);
  }
  double attention_pairs(const ModelConfig& c, double s) const override {
    const double w = static_cast<double>(c.sliding_window);
    if (w <= 0 || w >= s) return ModelFamily::attention_pairs(c, s);
    return s * w - w * w / 2;  // rows grow to W keys, then keep W: s^2 / 2 less the hidden triangle
  }
};

}  // namespace

const ModelFamily& mistral_family() {
  static const MistralFamily family;
  return family;
}

}  // namespace hspmd
