// AnnotationPlan: the low-level plan (docs/plan.md) — the
// annotations of every leaf tensor (inputs, parameters), of every named
// Reshard output, and of the optimizer states, for one model and one world.
// compile_plan() derives it from a Strategy; users may also write or edit it
// by hand. dry_run() resolves every Reshard of the annotated training graph
// (forward, backward, gradient sync, ZeRO gathers) for a virtual world.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "hspmd/annotation/annotation.h"
#include "hspmd/deduce/deduce.h"
#include "hspmd/graph/op.h"
#include "hspmd/models/model.h"
#include "hspmd/models/config.h"
#include "hspmd/plan/strategy.h"
#include "hspmd/resolve/resolver.h"
#include "hspmd/resolve/topology.h"

namespace hspmd {

struct AnnotationPlan {
  ModelConfig model;
  int world_size = 1;
  // Leaf placeholders (input_ids, targets, positions, normalizer, ...),
  // parameters (Hugging Face names) and named Reshard outputs (e.g.
  // "model.layers.3.input", "grad.model.norm.weight") -> annotation.
  std::map<std::string, Annotation> tensors;
  // Parameter name -> annotation of its fp32 master weight and Adam moments.
  // Absent: the same as the parameter (no ZeRO).
  std::map<std::string, Annotation> optimizer_states;
  // Sizes of the symbolic dims for the dry run's byte counts ("B": global
  // batch of one micro-batch step, "S": sequence length).
  std::map<std::string, int64_t> bindings;
  // The strategy it was compiled from, when any (kept for the executor's
  // schedules and for reports).
  std::optional<Strategy> strategy;
  // How the training graph computes (docs/precision.md): its casts decide
  // the dtypes, hence the bytes, of what the Reshards carry. JSON:
  // "precision": {"compute": "bf16", "grad_reduce": "fp32"}, absent = fp32.
  Precision precision;
};

// Options of compile_plan.
struct CompileOptions {
  int64_t seq_len = 0;  // 0: the model's max_position_embeddings
  Precision precision;
};

// Strategy -> annotation plan for the model (any registered family; validates the strategy
// first; throws its errors).
AnnotationPlan compile_plan(const ModelConfig& config, const Strategy& strategy, int world_size,
                            const CompileOptions& options = {});

// JSON form (docs/plan.md); plan_from_json validates every annotation and
// throws hspmd::Error "[plan] ..." one-liners.
nlohmann::json to_json(const AnnotationPlan& plan);
AnnotationPlan plan_from_json(const nlohmann::json& j);
AnnotationPlan load_plan(const std::string& path);
// Whether `path` holds an annotation plan (a JSON object with "tensors")
// rather than a strategy; false for a file that cannot be read or parsed
// (the strategy loader then reports it, naming the file).
bool is_plan_file(const std::string& path);

// The plan's training graph, annotated: the model's graph with its Reshard
// points (docs/plan.md), deduced under the plan. The dry run and each rank's
// executable graph start from it (one code path).
struct AnnotatedTraining {
  ModelGraph model;
  std::unique_ptr<AnnotatedGraph> annotated;
  Precision precision;  // the plan's: the grad.{parameter} Reshards carry precision.grad_reduce

  // Every Reshard node in graph order, with its spec (concrete shape under
  // `bindings`, source and destination annotations). Throws hspmd::Error
  // "[plan] reshard '<name>': ..." for a symbol missing from `bindings`.
  // With `only_rank` >= 0, only the Reshards whose source or destination
  // holds that rank (the others' annotations are not copied).
  std::vector<std::pair<int, ReshardSpec>> reshards(const Bindings& bindings, int only_rank = -1) const;
  // The dry-run phase of Reshard node `id`: "grad_sync" for a gradient-sync
  // point, else "forward" before the loss and "backward" after it.
  std::string phase(int id) const;
};
// Throws the deduction's errors.
AnnotatedTraining annotate_training_graph(const AnnotationPlan& plan);

// Per parameter, the dtype ZeRO-1 gathers it in: bf16 under mixed precision
// when the training graph reads the parameter only through casts to bf16
// (the linear weights: their bf16 compute copies are all the replicas use),
// f32 otherwise (norm scales, the embedding table). One pass over the graph.
std::map<std::string, DType> zero_gather_dtypes(const AnnotationPlan& plan, const ModelGraph& model);

// resolve() with memory: Reshards that differ only by name (the layers of a
// stage, the same ZeRO gather every step) share one resolution, whose `name`
// is the first one's. Keyed by shape, dtype and both annotations (key()).
// With `only_rank` >= 0 it resolves for that rank alone (resolve_for_rank):
// a Reshard the rank takes part in (it is in the source or the destination)
// gets a resolution holding the rank's entry only, any other Reshard null,
// unresolved (its errors are left to the ranks that take part).
class ResolutionCache {
 public:
  explicit ResolutionCache(const Topology& topology, int only_rank = -1)
      : topology_(topology), only_rank_(only_rank) {}
  std::shared_ptr<const Resolution> operator()(const ReshardSpec& spec);
  static std::string key(const ReshardSpec& spec);
  const Topology& topology() const { return topology_; }
  int only_rank() const { return only_rank_; }

 private:
  const Topology& topology_;
  int only_rank_;
  std::map<std::string, std::shared_ptr<const Resolution>> cache_;
};

// One Reshard of the dry run.
struct PlannedReshard {
  std::string name;       // the Reshard's name ("model.layers.3.input", "grad.<param>",
                          // "zero_gather.<param>", "backward.<name>")
  std::string phase;      // "forward", "backward", "grad_sync", "zero_gather"
  // Shared between Reshards that resolve alike (the layers of one stage);
  // its `name` is the first such Reshard's: use `name` above.
  std::shared_ptr<const Resolution> shared;

  const Resolution& resolution() const { return *shared; }
};

// Communication inside ops (Op::traffic: context-parallel attention's ring,
// vocab-parallel cross-entropy), which no Reshard shows: per op type and
// phase, the number of such calls in one micro-batch and, per rank, their
// bytes summed (the group is the first call's).
struct PlannedOpTraffic {
  std::string op;     // the op type: "attention", "attention_grad", "cross_entropy"
  std::string kind;   // OpTraffic::kind: "ring_attention", "vocab_parallel_loss"
  std::string phase;  // "forward" or "backward"
  int calls = 0;
  std::map<int, OpTraffic> ranks;
};

// The op-internal communication of one micro-batch under the plan's
// bindings (of an already annotated training graph of the plan, or deducing
// one). With `only_rank` >= 0, only that rank's: `ranks` holds it alone and
// `calls` counts its own calls (every entry lists ops it runs).
std::vector<PlannedOpTraffic> op_traffic(const AnnotationPlan& plan);
std::vector<PlannedOpTraffic> op_traffic(const AnnotationPlan& plan, const AnnotatedTraining& t,
                                         int only_rank = -1);

// Deduces the annotated training graph of `plan` and resolves every Reshard
// over `topology` (its world size must equal the plan's). Throws the
// deduction's and the resolver's errors.
// With `traffic`, also fills in op_traffic() from the same deduction.
std::vector<PlannedReshard> dry_run(const AnnotationPlan& plan, const Topology& topology,
                                    std::vector<PlannedOpTraffic>* traffic = nullptr);

// The dry run as one rank needs it to specialize (docs/plan.md "One rank's
// dry run"): only the Reshards `rank` takes part in, in dry_run()'s order,
// each resolved for that rank alone (ResolutionCache with only_rank), so
// every entry equals dry_run()'s entry of the same Reshard cut to the rank
// (name, phase, headline, and the rank's primitives); with `traffic`, the
// rank's op_traffic(). Time and memory follow the Reshards the rank takes
// part in, not the world (beyond the deduction, whose annotations list the
// world). The second form reuses an annotated training graph of `plan` and
// a cache for the rank (only_rank() >= 0, over the topology): an ExecGraph's,
// whose resolutions under the same bindings are not made again. Throws the
// deduction's errors and the resolver's for the rank's Reshards, and
// InternalError for a rank outside the world or a cache for every rank.
std::vector<PlannedReshard> rank_dry_run(const AnnotationPlan& plan, const Topology& topology, int rank,
                                         std::vector<PlannedOpTraffic>* traffic = nullptr);
std::vector<PlannedReshard> rank_dry_run(const AnnotationPlan& plan, const AnnotatedTraining& training,
                                         ResolutionCache& resolve_cached,
                                         std::vector<PlannedOpTraffic>* traffic = nullptr);

}  // namespace hspmd
