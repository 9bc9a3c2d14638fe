// The two integer linear programs of the planner (docs/ilp.md): how many
// transformer layers each stage of one pipeline holds, and how many
// micro-batches each pipeline runs. Both minimise the slowest member (a
// stage, a pipeline) subject to a sum constraint and per-member bounds.
//
// Each is solved either by the COIN-OR CBC branch-and-cut solver (the model
// written out as an ILP) or by an exact combinatorial algorithm for this
// structure that returns the same optimum (the fast path). Brute-force
// references (`*_exhaustive`) check both in the tests.
//
// Thread safety: the functions are pure and may be called from several
// threads; calls into CBC are serialised by an internal lock. CBC prints
// nothing (log level 0).
#pragma once

#include <vector>

namespace hspmd {

// Which solver answers assign_layers / assign_micro_batches.
//   kCbc:   the ILP through CBC's C API (about 1-2 ms a call, docs/ilp.md);
//   kExact: greedy / parametric search on the max time (microseconds at
//           planner sizes), the same optimal objective; `optimal` is
//           always true.
// kCbc is the default: the documented ILP, solved by the named solver; the
// planner's search loop passes kExact where thousands of calls add up.
enum class IlpSolver { kCbc, kExact };

// Layers per stage of one pipeline (the first ILP).
struct LayerStage {
  double time_per_layer = 0;    // seconds one layer adds to this stage's per-micro-batch time (fwd + bwd)
  double fixed_time = 0;        // seconds per micro-batch independent of the layer count (embedding, head, p2p)
  double memory_per_layer = 0;  // bytes one layer adds on this stage's ranks
  double fixed_memory = 0;      // bytes independent of the layer count
  double memory_capacity = 0;   // bytes per rank available; <= 0 means unlimited
  int min_layers = 1;
};

struct LayerAssignment {
  bool feasible = false;
  std::vector<int> layers;      // per stage, summing to num_layers (empty when infeasible)
  double max_stage_time = 0;    // max_k fixed_time_k + time_per_layer_k * layers_k
  int worst_stage = -1;         // when infeasible: the stage whose memory is most short
  double bytes_missing = 0;     // when infeasible: by how many bytes (see assign_layers)
  bool optimal = true;          // false when the time limit stopped CBC before proving optimality
};

// Minimises T subject to
//   sum_k x_k = num_layers,  x_k >= min_layers_k,  x_k integer,
//   fixed_time_k + time_per_layer_k * x_k <= T,
//   fixed_memory_k + memory_per_layer_k * x_k <= memory_capacity_k  (capacity > 0).
// Feasibility is decided from the data before any solver runs. Infeasible
// (feasible = false, no layers):
//   * a stage cannot hold its min_layers: worst_stage is the stage with the
//     largest shortfall there, bytes_missing that shortfall;
//   * every stage at its memory limit still leaves D layers unplaced:
//     worst_stage is the stage that could take all D extra layers with the
//     fewest extra bytes, bytes_missing those bytes.
// When the time limit stops CBC before it has an integer solution, a
// feasible assignment that ignores time is returned with optimal = false.
// `max_stage_time` is recomputed from the integer result. Deterministic.
// Throws hspmd::Error "[ilp] ..." on invalid input: no stages, num_layers < 1,
// a negative or non-finite time or memory, min_layers < 0, num_layers below
// the sum of min_layers, a time limit that is not positive.
LayerAssignment assign_layers(const std::vector<LayerStage>& stages, int num_layers,
                              double time_limit_s = 10, IlpSolver solver = IlpSolver::kCbc);

// Micro-batches per pipeline (the second ILP).
struct MicroBatchPipeline {
  int micro_batch_size = 1;         // samples per micro-batch of this pipeline
  double time_per_micro_batch = 0;  // seconds each micro-batch adds (the bottleneck stage)
  double fixed_time = 0;            // seconds independent of the count (fill and drain, gradient sync)
  int min_micro_batches = 1;        // >= the pipeline's stage count
  int max_micro_batches = 0;        // memory limit (GPipe keeps all in flight); 0 = unlimited
};

struct MicroBatchAssignment {
  bool feasible = false;
  std::vector<int> counts;  // per pipeline (empty when infeasible)
  double max_time = 0;      // max_p fixed_time_p + time_per_micro_batch_p * counts_p
  bool optimal = true;      // false when the time limit stopped CBC before proving optimality
};

// Minimises T subject to
//   sum_p micro_batch_size_p * n_p = global_batch,
//   min_micro_batches_p <= n_p <= max_micro_batches_p (when > 0),  n_p integer,
//   fixed_time_p + time_per_micro_batch_p * n_p <= T.
// feasible = false when only the max_micro_batches limits make the global
// batch unreachable (a memory limit below min_micro_batches included).
// Time limit and determinism as assign_layers.
// Throws hspmd::Error "[ilp] ..." on invalid input: no pipelines,
// global_batch < 1, micro_batch_size < 1, min_micro_batches < 1,
// max_micro_batches < 0, a negative or non-finite time, a time limit that is
// not positive, or a global batch that no counts n_p >= min_micro_batches_p
// reach even without the maxima (too small, or not a combination of the
// micro-batch sizes).
MicroBatchAssignment assign_micro_batches(const std::vector<MicroBatchPipeline>& pipelines,
                                          int global_batch, double time_limit_s = 10,
                                          IlpSolver solver = IlpSolver::kCbc);

// Exact references by enumeration of every assignment, for tests (small
// instances only: the work grows as num_layers^stages, resp.
// global_batch^pipelines). Same validation, results and infeasibility
// fields as above; ties go to the first assignment in lexicographic order.
LayerAssignment assign_layers_exhaustive(const std::vector<LayerStage>& stages, int num_layers);
MicroBatchAssignment assign_micro_batches_exhaustive(const std::vector<MicroBatchPipeline>& pipelines,
                                                     int global_batch);

}  // namespace hspmd
