// The custom family (model_type "hspmd_custom"): builds the graph a config's
// program describes with the same ops:: functions as the shared decoder, so
// that deduction, autodiff, the plan and every executor treat it like a
// built-in family. Its Reshard points are the program's "mark" ops.
#include "models/custom/custom.h"

#include <algorithm>
#include <cmath>
#include <unordered_set>

#include "hspmd/core/error.h"
#include "hspmd/ops/autodiff.h"
#include "hspmd/ops/ops.h"
#include "models/config_fields.h"
#include "models/custom/program.h"

namespace hspmd {

namespace {

using custom::at_layer;
using custom::Program;
using custom::ProgramOp;
using custom::ProgramPart;
using nlohmann::json;

Program program_of(const ModelConfig& c) { return custom::parse_program(c.program, "[config] hspmd_custom "); }

ModelPart part_of(const std::string& part) {
  return part == "embedding" ? ModelPart::kEmbedding : part == "block" ? ModelPart::kBlock : ModelPart::kHead;
}

// The point a "mark" op of `part` in `layer` (-1 outside the blocks) declares.
ReshardPoint point_of(const ProgramOp& o, ModelPart part, int64_t layer) {
  ReshardPoint p{at_layer(o.attrs["name"].get<std::string>(), layer), ReshardKind::kBlockInput, part, layer, ""};
  custom::reshard_kind_from_name(o.attrs["kind"].get<std::string>(), p.kind);
  if (p.kind == ReshardKind::kTiedHead) p.parameter = o.inputs[0];
  return p;
}

std::vector<ModelParameter> parameters_of(const Program& p, const ModelConfig& c) {
  std::vector<ModelParameter> out;
  auto add = [&](const custom::ProgramParameter& d, int64_t layer) {
    Shape shape;
    for (const json& dim : d.dims) shape.push_back(dim.is_string() ? c.table_rows() : dim.get<int64_t>());
    out.push_back({at_layer(d.name, layer), shape, d.role, d.init, d.part, layer});
  };
  for (const auto& d : p.parameters)
    if (d.part == ModelPart::kEmbedding) add(d, -1);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    for (const auto& d : p.parameters)
      if (d.part == ModelPart::kBlock) add(d, i);
  for (const auto& d : p.parameters)
    if (d.part == ModelPart::kHead) add(d, -1);
  return out;
}

// Builds the ops of one part of the program into the graph.
class PartBuilder {
 public:
  PartBuilder(const ModelConfig& c, const ModelBuildOptions& o, ModelGraph& m) : c_(c), o_(o), m_(m) {}

  // Runs `part`'s ops for `layer` (-1 outside the blocks) on `input` (the
  // part's input tensor, invalid for the embedding); returns its output.
  Tensor run(const ProgramPart& part, const std::string& name, int64_t layer, const Tensor& input) {
    scope_.clear();
    if (input.valid()) scope_[part.input] = input;
    for (const ProgramOp& o : part.ops) {
      std::vector<Tensor> in;
      for (const std::string& n : o.inputs) in.push_back(find(n, layer));
      const std::string where =
          "hspmd_custom program: " + o.where + (layer >= 0 ? " of layer " + std::to_string(layer) : "");
      const int first_node = m_.graph->num_nodes();
      try {
        scope_[o.output] = apply(o, in, part_of(name), layer);
      } catch (const Error& e) {
        fail("[model] ", where, ": ", e.what());
      } catch (const json::exception& e) {
        fail("[model] ", where, ": an attribute has the wrong type (", e.what(), ")");
      }
      // Deduction's errors name the program op, not only a graph node.
      m_.graph->set_origin(first_node, where);
    }
    return scope_.at(part.output);
  }

 private:
  Tensor find(const std::string& name, int64_t layer) const {
    if (auto it = scope_.find(name); it != scope_.end()) return it->second;
    return m_.graph->find(at_layer(name, layer));
  }

  DType lo() const { return o_.precision.compute; }

  static float number(const ProgramOp& o, const char* key, double fallback) {
    return static_cast<float>(o.attrs.contains(key) ? o.attrs[key].get<double>() : fallback);
  }
  static int64_t integer(const ProgramOp& o, const char* key, int64_t fallback = 0) {
    if (!o.attrs.contains(key)) return fallback;
    if (!o.attrs[key].is_number_integer()) fail("attribute '", key, "' must be an integer");
    return o.attrs[key].get<int64_t>();
  }

  SymShape shape_attr(const ProgramOp& o) const {
    SymShape shape;
    for (const json& d : o.attrs["shape"]) {
      if (d == "B" || d == "S")
        shape.push_back(SymDim::symbol(d.get<std::string>()));
      else if (d.is_number_integer() && d.get<int64_t>() > 0)
        shape.push_back(d.get<int64_t>());
      else
        fail("shape entry ", json_excerpt(d), " is not a positive integer, \"B\" or \"S\"");
    }
    return shape;
  }

  DType dtype_attr(const ProgramOp& o) const {
    const std::string d = o.attrs["dtype"].is_string() ? o.attrs["dtype"].get<std::string>() : "";
    if (d == "compute") return lo();
    if (d == "f32" || d == "fp32") return DType::F32;
    if (d == "bf16") return DType::BF16;
    fail("dtype ", json_excerpt(o.attrs["dtype"]), " (expected f32, bf16 or compute)");
  }

  Tensor attention(const ProgramOp& o, const std::vector<Tensor>& in) const {
    const SymShape& q = in[0].shape();
    if (q.size() != 4 || !q[3].is_const()) fail("q must be [B, S, heads, head_dim] with a constant head_dim");
    const double d = static_cast<double>(q[3].value());
    Tensor documents;
    if (o_.packed_documents) {
      if (in.size() < 4) fail("packed documents need the positions as 4th input (the document mask)");
      documents = in[3];
    }
    return ops::attention(in[0], in[1], in[2], documents, number(o, "scale", 1.0 / std::sqrt(d)),
                          o_.context_parallel, lo(), integer(o, "window"));
  }

  // A Reshard point, with mixed precision's casts as the shared decoder
  // places them: activations travel in the compute dtype; the residual
  // stream comes back in f32.
  Tensor mark(const ProgramOp& o, const Tensor& x, ModelPart part, int64_t layer) const {
    ReshardPoint point = point_of(o, part, layer);
    const ReshardKind kind = point.kind;
    Tensor out = kind == ReshardKind::kPositions ? x : ops::cast(x, lo());
    if (o_.reshard_points) {
      out = ops::reshard(out, point.name);
      m_.points.emplace(out.node_id(), std::move(point));
    }
    const bool residual = kind == ReshardKind::kEmbeddingOutput || kind == ReshardKind::kBlockInput ||
                          kind == ReshardKind::kSublayerOutput;
    return residual ? ops::cast(out, DType::F32) : out;
  }

  Tensor apply(const ProgramOp& o, const std::vector<Tensor>& in, ModelPart part, int64_t layer) const {
    const std::string& op = o.op;
    if (op == "embedding") return ops::embedding(in[0], in[1]);
    if (op == "linear") return ops::linear(ops::cast(in[0], lo()), ops::cast(in[1], lo()));
    if (op == "matmul")
      return ops::matmul(ops::cast(in[0], lo()), ops::cast(in[1], lo()), o.attrs.value("trans_a", false),
                         o.attrs.value("trans_b", false));
    if (op == "add") return ops::add(in[0], in[1]);
    if (op == "add_bias") return ops::add_bias(in[0], in[1]);
    if (op == "mul") return ops::mul(in[0], in[1]);
    if (op == "scale") return ops::scale(in[0], number(o, "factor", 1.0));
    if (op == "rms_norm") return ops::rms_norm(in[0], in[1], number(o, "eps", c_.rms_norm_eps));
    if (op == "rope") return ops::rope(in[0], in[1], number(o, "theta", c_.rope_theta));
    if (op == "swiglu") return ops::swiglu(in[0], in[1]);
    if (op == "attention") return attention(o, in);
    if (op == "cross_entropy")
      return ops::cross_entropy(in[0], in[1], in[2], static_cast<int>(integer(o, "ignore_index", -100)),
                                c_.table_rows() != c_.vocab_size ? c_.vocab_size : 0);
    if (op == "reshape") return ops::reshape(in[0], shape_attr(o));
    if (op == "transpose")
      return ops::transpose(in[0], static_cast<int>(integer(o, "dim0")), static_cast<int>(integer(o, "dim1")));
    if (op == "slice")
      return ops::slice(in[0], static_cast<int>(integer(o, "axis")), integer(o, "begin"), integer(o, "end"));
    if (op == "concat") return ops::concat(in, static_cast<int>(integer(o, "axis")));
    if (op == "reduce_sum") return ops::reduce_sum(in[0], o.attrs.value("axes", std::vector<int>{}));
    if (op == "cast") return ops::cast(in[0], dtype_attr(o));
    if (op == "mark") return mark(o, in[0], part, layer);
    HSPMD_CHECK(false, "op ", op, " passed parsing but has no builder");
  }

  const ModelConfig& c_;
  const ModelBuildOptions& o_;
  ModelGraph& m_;
  std::map<std::string, Tensor> scope_;
};

// The training graph of the program. `keeps_its_input`, when given, is set
// to whether the last block built writes a tensor of its input's shape and
// dtype (then every further layer reads what that one read).
ModelGraph build_custom(const ModelConfig& c, const ModelBuildOptions& o, bool* keeps_its_input = nullptr) {
  const Program p = program_of(c);
  ModelGraph m;
  Graph& g = *m.graph;
  const SymDim B = SymDim::symbol("B"), S = SymDim::symbol("S");
  m.input_ids = g.placeholder("input_ids", {B, S}, DType::I32);
  m.targets = g.placeholder("targets", {B, S}, DType::I32);
  m.positions = g.placeholder("positions", {B, S}, DType::I32);
  m.normalizer = g.placeholder("normalizer", {}, DType::F32);
  m.parameters = parameters_of(p, c);
  for (const ModelParameter& d : m.parameters) {
    m.names.push_back(d.name);
    m.params.push_back(g.parameter(d.name, d.shape));
  }
  PartBuilder build(c, o, m);
  Tensor h = build.run(p.embedding, "embedding", -1, Tensor());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const Tensor out = build.run(p.block, "block", i, h);
    if (keeps_its_input) *keeps_its_input = out.shape() == h.shape() && out.dtype() == h.dtype();
    h = out;
  }
  m.loss = build.run(p.head, "head", -1, h);
  if (!m.loss.shape().empty())
    fail("[model] hspmd_custom program: the head's output '", p.head.output, "' is not a scalar (the loss): shape ",
         sym_shape_str(m.loss.shape()));
  m.grads = gradients(m.loss, m.params);
  for (size_t i = 0; i < m.grads.size(); ++i) {
    if (!m.grads[i].valid())
      fail("[model] hspmd_custom program: parameter ", m.names[i], " does not reach the loss");
    if (!o.reshard_points) continue;
    const ModelParameter& d = m.parameters[i];
    ReshardPoint point{"grad." + d.name, ReshardKind::kGradSync, d.part, d.layer, d.name};
    m.grads[i] = ops::reshard(m.grads[i], point.name);
    m.points.emplace(m.grads[i].node_id(), std::move(point));
  }
  return m;
}

class CustomFamily final : public ModelFamily {
 public:
  std::string model_type() const override { return "hspmd_custom"; }

  // The program is parsed and its graph built once, so that a bad program
  // fails when its config is read, naming the op. That graph has at most
  // two layers (reading a config costs nothing per layer; the run builds
  // the whole model after the memory check): every further layer applies
  // the same ops to its own parameters, and when the block writes what it
  // reads (a residual stream's shape and dtype) layer 2 onwards read what
  // layer 1 read. A block that changes them is built with every layer (the
  // head reads what the last one writes). The names of every layer's
  // parameters and points are checked apart ("p{i}" at layer 10 and "p1{i}"
  // at layer 0 are both "p10").
  void read_config(const ConfigFields& r, ModelConfig& c) const override {
    if (!r.given("program")) r.fail_rule("model_type hspmd_custom needs a 'program' (docs/models.md)");
    c.program = r.object()["program"];
    try {
      const Program p = custom::parse_program(c.program, "");
      ModelConfig probe = c;
      probe.num_hidden_layers = std::min<int64_t>(c.num_hidden_layers, 2);
      const bool deeper = c.num_hidden_layers > probe.num_hidden_layers;
      bool keeps_its_input = true;  // what the last block built did
      try {
        (void)build_custom(probe, ModelBuildOptions{}, &keeps_its_input);
      } catch (const Error&) {
        if (keeps_its_input || !deeper) throw;  // every layer fails alike, or the head does on what it reads
      }
      if (!keeps_its_input && deeper) (void)build_custom(c, ModelBuildOptions{});
      std::unordered_set<std::string> names;
      for (const ModelParameter& d : parameters_of(p, c))
        if (!names.insert(d.name).second)
          fail("program: parameter '", d.name, "' is declared twice (two names with {i} meet at one layer)");
      for (const ReshardPoint& point : reshard_points(c))
        if (point.kind != ReshardKind::kGradSync && !names.insert(point.name).second)
          fail("program: point '", point.name, "' is named twice (a parameter or another point has its name)");
    } catch (const Error& e) {
      const std::string what = e.what(), tag = "[model] hspmd_custom ";
      r.fail_rule(what.rfind(tag, 0) == 0 ? what.substr(tag.size()) : what);
    }
  }
  void write_config(const ModelConfig& c, json& j) const override { j["program"] = c.program; }
  std::vector<ModelParameter> parameters(const ModelConfig& c) const override {
    return parameters_of(program_of(c), c);
  }
  std::vector<ReshardPoint> reshard_points(const ModelConfig& c) const override {
    const Program p = program_of(c);
    std::vector<ReshardPoint> out;
    auto marks = [&](const ProgramPart& part, ModelPart where, int64_t layer) {
      for (const ProgramOp& o : part.ops)
        if (o.op == "mark") out.push_back(point_of(o, where, layer));
    };
    marks(p.embedding, ModelPart::kEmbedding, -1);
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) marks(p.block, ModelPart::kBlock, i);
    marks(p.head, ModelPart::kHead, -1);
    for (const ModelParameter& d : parameters_of(p, c))
      out.push_back({"grad." + d.name, ReshardKind::kGradSync, d.part, d.layer, d.name});
    return out;
  }
  ModelGraph build(const ModelConfig& c, const ModelBuildOptions& o) const override { return build_custom(c, o); }
};

}  // namespace

const ModelFamily& custom_family() {
  static const CustomFamily family;
  return family;
}

}  // namespace hspmd
