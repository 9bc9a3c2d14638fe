// The Reshard points of the plan-mode Llama graph are the identity on one
// device: the loss and every gradient equal those of the plain graph.
#include <gtest/gtest.h>

#include <cstdlib>

#include "hspmd/core/error.h"
#include "hspmd/graph/executor.h"
#include "hspmd/models/model.h"

namespace hspmd {
namespace {

ModelConfig tiny(bool tied) {
  return ModelConfig{.vocab_size = 32,
                     .hidden_size = 16,
                     .intermediate_size = 24,
                     .num_hidden_layers = 2,
                     .num_attention_heads = 4,
                     .num_key_value_heads = 2,
                     .tie_word_embeddings = tied};
}

ValueMap feeds(const ModelConfig& c) {
  ValueMap v;
  for (auto& [name, a] : init_model_parameters(c, 7)) v[name] = a;
  std::vector<int32_t> ids, targets, positions;
  for (int b = 0; b < 2; ++b)
    for (int s = 0; s < 5; ++s) {
      ids.push_back((b * 7 + s * 3) % 32);
      targets.push_back((b * 5 + s * 11 + 1) % 32);
      positions.push_back(s);
    }
  v["input_ids"] = NDArray::from_vector_i32({2, 5}, ids);
  v["targets"] = NDArray::from_vector_i32({2, 5}, targets);
  v["positions"] = NDArray::from_vector_i32({2, 5}, positions);
  v["normalizer"] = NDArray::from_vector({}, {10.0f});
  return v;
}

std::vector<NDArray> run(const ModelGraph& m, const ValueMap& values) {
  std::vector<Tensor> fetches = {m.loss};
  fetches.insert(fetches.end(), m.grads.begin(), m.grads.end());
  return Executor(*m.graph, fetches).run(values);
}

void expect_same_training_step(bool tied) {
  const ModelConfig c = tiny(tied);
  ModelBuildOptions points;
  points.reshard_points = true;
  points.context_parallel = true;
  const ModelGraph plain = build_model(c), marked = build_model(c, points);
  ASSERT_EQ(plain.names, marked.names);
  const ValueMap values = feeds(c);
  const std::vector<NDArray> a = run(plain, values), b = run(marked, values);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].shape(), b[i].shape()) << i;
    const float* x = a[i].data<float>();
    const float* y = b[i].data<float>();
    for (int64_t k = 0; k < a[i].numel(); ++k) ASSERT_EQ(x[k], y[k]) << "output " << i;
  }
  int reshards = 0;
  for (int id = 0; id < marked.graph->num_nodes(); ++id)
    if (marked.graph->node(id).name.rfind("model.layers.1.", 0) == 0) ++reshards;
  EXPECT_EQ(reshards, 6 + 9);  // six Reshard points and nine parameters of block 1
}

TEST(LlamaReshardPoints, IdentityOnOneDevice) { expect_same_training_step(false); }
TEST(LlamaReshardPoints, IdentityOnOneDeviceTied) { expect_same_training_step(true); }

// Every node of the training graph is read by another or is the loss or a
// gradient: the executors run every node of the graph, so a node nothing
// reads (a conversion a later simplification made redundant, say) would be
// a pass each step for nothing. Both precisions, tied or not, with the
// plan's Reshard points and without, Qwen2's biases and Mistral's window.
TEST(TrainingGraph, HasNoUnreadNodes) {
  for (const char* family : {"llama", "qwen2", "mistral"})
    for (bool tied : {false, true})
      for (bool points : {false, true})
        for (int variant : {0, 1, 2}) {  // f32; bf16; bf16 as a GPU computes it (attention writes bf16)
          const DType compute = variant == 0 ? DType::F32 : DType::BF16;
          const bool gpu = variant == 2;
          ModelConfig c = tiny(tied);
          c.model_type = family;
          c.attention_bias = std::string(family) == "qwen2";
          if (std::string(family) == "mistral") c.sliding_window = 3;
          ModelBuildOptions o;
          o.reshard_points = points;
          o.precision.compute = compute;
          if (gpu) o.precision.attention_output = DType::BF16;
          const ModelGraph m = build_model(c, o);
          const Graph& g = *m.graph;
          std::vector<int> readers(g.num_nodes(), 0);
          for (int id = 0; id < g.num_nodes(); ++id)
            for (const Tensor& in : g.node(id).inputs) ++readers[in.node_id()];
          readers[m.loss.node_id()] += 1;
          for (const Tensor& t : m.grads) readers[t.node_id()] += 1;
          for (int id = 0; id < g.num_nodes(); ++id) {
            const Node& n = g.node(id);
            if (n.inputs.empty()) continue;  // leaves: parameters and placeholders
            EXPECT_GT(readers[id], 0) << family << (tied ? " tied" : "") << (points ? " points" : "") << " "
                                      << dtype_name(compute) << (gpu ? " gpu" : "") << ": node " << id << " (" << n.op->type()
                                      << (n.name.empty() ? "" : " '" + n.name + "'") << ") is read by nothing";
          }
        }
}

// A bf16 attention output is o_proj's operand as it is: no conversion
// node reads it, and the backward gets it (rounded) as its O. Its bf16
// gradients reach the q, k and v projections' GEMMs the same way: RoPE's
// backward reads dq and dk as they are and writes bf16, dv is v_proj's
// gradient operand, and no conversion node reads any of them (Qwen2's
// bias gradients read a widened copy). o_proj's input-gradient GEMM writes
// dO in bf16, which cuDNN's backward reads so. The step computes nearly the same
// loss and gradients as with the f32 output.
TEST(TrainingGraph, Bf16AttentionOutputFeedsOProjAsItIs) {
  for (const bool bias : {false, true}) {
    ModelConfig c = tiny(false);
    c.attention_bias = bias;
    ModelBuildOptions cpu, gpu;
    cpu.precision.compute = DType::BF16;
    gpu.precision = cpu.precision;
    gpu.precision.attention_output = DType::BF16;  // what for_device picks where cuDNN serves attention
    const ModelGraph a = build_model(c, cpu), b = build_model(c, gpu);
    const Graph& g = *b.graph;
    int attention = 0, gradients = 0, rotations_back = 0, bias_grads = 0;
    const auto type_of = [&](const Tensor& t) { return g.node(t.node_id()).op->type(); };
    for (int id = 0; id < g.num_nodes(); ++id) {
      const Node& n = g.node(id);
      for (const Tensor& in : n.inputs) {
        const std::string from = type_of(in);
        // Conversions read neither attention's outputs nor its gradients,
        // nor RoPE's rotations of them (but bias_grad's f32 copy).
        const bool after_attention_grad =
            from == "attention_grad" ||
            ((from == "rope" || from == "rope_qk") && type_of(g.node(in.node_id()).inputs[0]) == "attention_grad") ||
            (from == "reshape" && type_of(g.node(in.node_id()).inputs[0]) == "attention_grad");
        if (n.op->type() == "cast" && (from == "attention" || after_attention_grad)) {
          int readers = 0, bias_readers = 0;
          for (int r = id + 1; r < g.num_nodes(); ++r)
            for (const Tensor& x : g.node(r).inputs)
              if (x.node_id() == id) ++readers, bias_readers += g.node(r).op->type() == "bias_grad";
          EXPECT_TRUE(bias && readers == bias_readers && readers > 0)
              << "node " << id << " (" << n.op->type() << ") converts " << from << "'s output";
        }
      }
      if (n.op->type() == "attention") {
        ++attention;
        EXPECT_EQ(n.outputs[0].dtype, DType::BF16);
        EXPECT_EQ(n.outputs[1].dtype, DType::F32);  // lse
      }
      if (n.op->type() == "attention_grad") {
        ++gradients;
        for (const auto& out : n.outputs) EXPECT_EQ(out.dtype, DType::BF16);
        // dO comes from o_proj's input-gradient GEMM in bf16, as cuDNN reads it.
        EXPECT_EQ(n.inputs.at(5).dtype(), DType::BF16);
        EXPECT_EQ(type_of(g.node(n.inputs.at(5).node_id()).inputs.at(0)), "matmul");
      }
      if ((n.op->type() == "rope" || n.op->type() == "rope_qk") && type_of(n.inputs[0]) == "attention_grad") {
        rotations_back += static_cast<int>(n.outputs.size());  // rope_qk: q's and k's
        for (const auto& out : n.outputs) EXPECT_EQ(out.dtype, DType::BF16);
      }
      bias_grads += n.op->type() == "bias_grad";
    }
    EXPECT_EQ(attention, c.num_hidden_layers);
    EXPECT_EQ(gradients, c.num_hidden_layers);
    EXPECT_EQ(rotations_back, 2 * c.num_hidden_layers);  // q and k
    EXPECT_EQ(bias_grads, bias ? 3 * c.num_hidden_layers : 0);
    const ValueMap values = feeds(c);
    const std::vector<NDArray> ra = run(a, values), rb = run(b, values);
    const float la = ra[0].data<float>()[0], lb = rb[0].data<float>()[0];
    EXPECT_NEAR(la, lb, 1e-3 * std::abs(la));
    ASSERT_EQ(ra.size(), rb.size());
    for (size_t i = 1; i < ra.size(); ++i) {
      double diff = 0, scale = 0;
      for (int64_t e = 0; e < ra[i].numel(); ++e)
        diff = std::max(diff, static_cast<double>(std::abs(ra[i].data<float>()[e] - rb[i].data<float>()[e]))),
        scale = std::max(scale, static_cast<double>(std::abs(ra[i].data<float>()[e])));
      // Two bf16 roundings more per gradient path: well under 5% of the gradient's scale.
      EXPECT_LE(diff, 5e-2 * scale + 1e-6) << (bias ? "qwen2 " : "llama ") << b.names[i - 1];
    }
  }
}

}  // namespace
}  // namespace hspmd
