// The paper's appendix strategies (examples/strategies) compile and dry-run,
// and resolve into the primitives the paper describes: tensor-parallel
// all-gather / reduce-scatter inside stages, send/recv or BSR between stages,
// split collectives for gradient sync across pipelines of different shapes.
#include <gtest/gtest.h>

#include "hspmd/plan/plan.h"

namespace hspmd {
namespace {

const std::string kRoot = HSPMD_SOURCE_DIR;

std::vector<PlannedReshard> dry_run_example(const std::string& model, const std::string& strategy,
                                            const std::string& cluster) {
  const Topology topology = Topology::load(kRoot + "/examples/clusters/" + cluster + ".json");
  const AnnotationPlan plan =
      compile_plan(ModelConfig::load(kRoot + "/examples/models/" + model + ".json"),
                   load_strategy(kRoot + "/examples/strategies/" + strategy + ".json"),
                   topology.world_size());
  return dry_run(plan, topology);
}

std::string kind(const std::vector<PlannedReshard>& all, const std::string& name, int rank) {
  for (const auto& r : all)
    if (r.name == name) {
      auto it = r.resolution().ranks.find(rank);
      return it == r.resolution().ranks.end() ? "absent" : kind_name(it->second.kind);
    }
  return "no reshard " + name;
}

bool point_to_point(const std::string& k) { return k == "send" || k == "recv" || k == "bsr"; }

// Appendix table "32B, 16 H800, 16 H20": two pipelines of four TP4 stages,
// H20 stages first, with ZeRO-1.
TEST(AppendixStrategies, Hetero32bOn16H800And16H20) {
  const auto all = dry_run_example("llama-32b", "hetero_32b_16h800_16h20", "16h800_16h20");
  EXPECT_EQ(kind(all, "model.layers.0.attn_input", 16), "all_gather");
  EXPECT_EQ(kind(all, "model.layers.20.mlp_output", 1), "reduce_scatter");
  EXPECT_EQ(kind(all, "backward.model.layers.20.mlp_input", 2), "reduce_scatter");
  EXPECT_TRUE(point_to_point(kind(all, "model.layers.14.input", 0)));   // H20 stage -> H800 stage
  EXPECT_TRUE(point_to_point(kind(all, "model.layers.14.input", 23)));
  EXPECT_EQ(kind(all, "grad.model.layers.3.mlp.up_proj.weight", 16), "split_reduce_scatter");
  EXPECT_EQ(kind(all, "zero_gather.model.layers.3.mlp.up_proj.weight", 24), "split_all_gather");
}

// Elastic C2 (31 H20, one GPU lost): the second pipeline ends with TP2 and
// TP1 stages, so its last layers sync with a TP4 stage of the first pipeline.
TEST(AppendixStrategies, ElasticC2On31H20) {
  const auto all = dry_run_example("llama-32b", "elastic_c2_31h20", "31h20");
  EXPECT_EQ(kind(all, "model.layers.0.attn_input", 0), "all_gather");
  EXPECT_EQ(kind(all, "model.layers.0.attn_output", 17), "reduce_scatter");
  EXPECT_TRUE(point_to_point(kind(all, "model.layers.15.input", 4)));
  EXPECT_TRUE(point_to_point(kind(all, "model.layers.48.input", 28)));  // TP4 -> TP2
  EXPECT_TRUE(point_to_point(kind(all, "model.layers.56.input", 30)));  // TP2 -> TP1
  EXPECT_EQ(kind(all, "model.layers.56.attn_output", 30), "identity");  // TP1: nothing to sum
  EXPECT_EQ(kind(all, "grad.model.layers.57.mlp.down_proj.weight", 30), "split_all_reduce");
  EXPECT_EQ(kind(all, "grad.model.layers.57.mlp.down_proj.weight", 12), "split_all_reduce");
  EXPECT_EQ(kind(all, "grad.model.layers.50.self_attn.q_proj.weight", 28), "split_all_reduce");
  EXPECT_EQ(kind(all, "grad.model.layers.5.self_attn.q_proj.weight", 0), "split_all_reduce");
}

}  // namespace
}  // namespace hspmd
