// ExecGraph: one rank's executable graph (paper §6.2, docs/execution.md). From the
// annotation plan it builds the model's training graph with its Reshard points,
// deduces every annotation, keeps the nodes this rank runs, and resolves every
// Reshard it takes part in, for this rank alone (resolve_for_rank, the same
// resolver the dry run uses): it holds no other rank's primitives and
// resolves no Reshard it is not part of. Running it
// feeds local arrays, computes local shards, and executes the resolved
// communication through a Communicator.
//
// One ExecGraph serves micro-batches of any size: the parts that depend on
// the symbolic dims (local op shapes, forward and backward Reshard
// resolutions) form a shape instance, built on first use per distinct
// Bindings and cached. Not thread-safe: use one ExecGraph from one thread.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "hspmd/comm/communicator.h"
#include "hspmd/comm/execute.h"
#include "hspmd/deduce/deduce.h"
#include "hspmd/exec/op_work.h"
#include "hspmd/exec/virtual_clock.h"
#include "hspmd/graph/executor.h"
#include "hspmd/models/model.h"
#include "hspmd/plan/pipelines.h"
#include "hspmd/plan/plan.h"

namespace hspmd {

class ExecGraph {
  struct Instance;  // the shape-dependent part, per Bindings (exec_graph.cc)

 public:
  // `bindings`: the default sizes of the symbolic dims ("B": the summed
  // micro-batch sizes of the pipelines, "S": the sequence length). Which
  // nodes and Reshards this rank runs is decided under them, the
  // gradient-sync Reshards (parameter shapes) are resolved under them, and
  // their shape instance is built at once. Throws the deduction's and the
  // resolver's errors.
  // The graph shares ownership of `plan` and `topology`: graphs of several
  // plans may live at once (a plan switch builds the next beside the last).
  // `device`: where this rank's ops run and allocate (their OpContext's
  // device, its default stream); CPU is the only one built today.
  ExecGraph(std::shared_ptr<const AnnotationPlan> plan, std::shared_ptr<const Topology> topology, int rank,
            Bindings bindings, Device device = Device::cpu());
  // Copies `plan` and `topology`.
  ExecGraph(const AnnotationPlan& plan, const Topology& topology, int rank, Bindings bindings,
            Device device = Device::cpu());
  ~ExecGraph();
  ExecGraph(const ExecGraph&) = delete;  // its ops' contexts point into it
  ExecGraph& operator=(const ExecGraph&) = delete;

  int rank() const { return rank_; }
  const AnnotationPlan& plan() const { return *plan_; }
  const Topology& topology() const { return *topology_; }
  const ModelGraph& model() const { return model_; }
  const Bindings& bindings() const { return bindings_; }  // the constructor's
  // Where this rank's ops run: their device and its default stream (the
  // device's allocator measures the rank's memory).
  Device device() const { return device_; }
  Stream& stream() const { return default_stream(device_); }
  // The annotation of a leaf, a named Reshard output or a parameter gradient
  // after gradient sync ("grad.<param>").
  const Annotation& annotation(const std::string& name) const;
  // The global box of `name` this rank holds, or nullopt; `global_shape` is
  // its full shape.
  std::optional<Box> local_box(const std::string& name, const Shape& global_shape) const;

  // The loss tensor's annotation (which ranks hold a term of it).
  const Annotation& loss_annotation() const { return annotated_->of(model_.loss); }

  // What a trainer needs besides the graph to specialize this rank, from the
  // graph's own deduction (no second one), under the plan's bindings:
  // rank_dry_run() of this rank (the Reshards it takes part in, each with
  // its entry alone, and with `traffic` its op-internal communication), and
  // the plan's discovered pipelines (discover_pipelines() over the forward
  // Reshards). Throw the resolver's and discovery's errors.
  std::vector<PlannedReshard> dry_run(std::vector<PlannedOpTraffic>* traffic = nullptr) const;
  std::vector<DiscoveredPipeline> discover_pipelines() const;

  struct MicroBatch {
    std::optional<float> loss;                   // this rank's loss term, when it holds one (read on the host)
    NDArray loss_array;                          // ... and the one-element array it was read from
    std::map<std::string, NDArray> raw_grads;    // local parameter gradients before sync
  };
  // What one micro-batch keeps between its forward and its backward, and
  // the shape instance and recompute setting it ran with. Move-only in
  // practice (copies share the arrays); consumed by backward().
  // `slots` and `remaining` (NodeValues, hspmd/graph/executor.h) are the
  // values and reads left that run_nodes works on.
  struct Activations : NodeValues {
    const Instance* instance = nullptr;
    bool recompute = false;
  };
  // The forward of one micro-batch (nodes up to the loss) under `bindings`
  // (the constructor's when omitted). `values`: this rank's local
  // placeholders and parameter shards, by name. Throws hspmd::Error "[exec]
  // rank R: no local value for '<name>'" for a missing leaf and "[exec] rank
  // R: '<name>' has local shape [..] but the bindings give [..]" for a leaf
  // whose shape disagrees with the bindings (both before any communication),
  // eval_shape's error for a symbol missing from `bindings`, and local_box's
  // for sizes the leaves' layouts cannot cut.
  Activations forward(const ValueMap& values, Communicator& world) const;
  // A value a forward computed and kept for the caller (the model's router
  // statistics), or an invalid array where this rank did not compute it.
  NDArray forward_value(const Activations& a, const Tensor& t) const;
  // Whether this rank's value of `t` is the one to count when the ranks'
  // values are summed (is_representative of its deduced annotation).
  bool represents(const Tensor& t) const;
  Activations forward(const ValueMap& values, Communicator& world, const Bindings& bindings) const;
  // Its backward (the rest, but gradient sync), under the forward's shape
  // instance: the loss term and raw grads. With recompute (set_recompute),
  // first re-runs the forward nodes that the forward released.
  //
  // `on_grad` (optional): called as each raw gradient of this micro-batch
  // is final, with the parameter's name and the array (on the graph's
  // stream; the work that computes it may still be queued there), before
  // the backward goes on: the overlapped gradient synchronization starts
  // there (docs/comm.md). The array is also in the result's raw_grads.
  // `read_loss` false: the result's loss stays unread (loss_array only), so
  // that the host does not wait for the device at each micro-batch; the
  // trainer reads the step's losses once its schedule is queued.
  using GradReady = std::function<void(const std::string& param, const NDArray& raw_grad)>;
  MicroBatch backward(Activations activations, Communicator& world, const GradReady& on_grad = {},
                      bool read_loss = true) const;
  // forward then backward.
  MicroBatch run_micro_batch(const ValueMap& values, Communicator& world) const;
  MicroBatch run_micro_batch(const ValueMap& values, Communicator& world,
                             const Bindings& bindings) const;

  // The step's pre-processing (docs/precision.md): while a StepScope lives,
  // the forward nodes that read nothing but parameters (and compute without
  // communicating: under mixed precision, the bf16 compute copies of the
  // weights) run in the first micro-batch, and the later micro-batches of
  // the step reuse their outputs. Parameters must not change meanwhile.
  // Without a scope every micro-batch computes them. One scope at a time.
  //
  // `given`: outputs of parameter_casts() nodes the caller already holds
  // for the parameters as they are now (the optimizer wrote them with the
  // update, docs/precision.md, "The weights' bf16 copies"): used as those
  // nodes' outputs instead of running the casts. A given array must have
  // the parameter's local shape and the cast's dtype (InternalError at the
  // node otherwise); the caller answers for its values.
  class StepScope {
   public:
    explicit StepScope(const ExecGraph& graph, std::map<int, NDArray> given = {});
    ~StepScope();
    StepScope(const StepScope&) = delete;
    StepScope& operator=(const StepScope&) = delete;
    // The output of parameter-only node `id` in this step (given, or
    // computed by the step's first forward), or an invalid array where the
    // step has not reached it.
    NDArray value(int id) const;

   private:
    const ExecGraph& graph_;
  };
  // Whether node `id` is such a parameter-only node of this rank's forward.
  bool parameter_only(int id) const { return id < static_cast<int>(parameter_only_.size()) && parameter_only_[id]; }
  // The parameter-only nodes of this rank's forward that cast one parameter,
  // as the rank feeds it, to another dtype (under mixed precision, the
  // weights' bf16 compute copies), in graph order.
  struct ParameterCast {
    int node = -1;
    std::string param;
    DType dtype = DType::BF16;
  };
  std::vector<ParameterCast> parameter_casts() const;

  // Activation recomputation (docs/execution.md), for the forwards started
  // after the call. On: forward() keeps only the leaves, the loss and the
  // outputs of the Reshards that bring data from other stages (or send it
  // there), and releases every other value once the forward no longer needs
  // it; backward() re-runs this rank's other forward nodes (compute and
  // intra-stage Reshards, in graph order, so a stage's ranks match their
  // collectives) but never those boundary Reshards. Losses and gradients are
  // bitwise the same as with it off. Every rank of a stage must agree.
  void set_recompute(bool on) { recompute_ = on; }
  bool recompute() const { return recompute_; }

  // Gradient sync (hspmd/exec/grad_sync.h runs it): the grad.<param>
  // Reshard of `param` resolved for this rank, or nullptr when this rank
  // takes no part in it; its spec (to resolve it for every rank); and one
  // such sync run as any other Reshard of the graph (the clock, deferred
  // sends and the byte ledger), `local` in the resolution's dtype.
  const Resolution* grad_resolution(const std::string& param) const;
  const ReshardSpec& grad_spec(const std::string& param) const;
  NDArray run_grad_sync(const std::string& param, const NDArray& local, Communicator& world) const;
  // Whether an emulated clock runs the graph (set_clock).
  bool clocked() const { return clock_ != nullptr; }

  // Moves a local array of `name` from annotation `from` to `to` (e.g. a ZeRO
  // gather, or gathering a parameter to rank 0 for saving).
  // `dtype`: of the elements moved; `local` is converted to it when it
  // differs, and the result comes back as `local`'s dtype.
  NDArray reshard(const std::string& name, const Shape& shape, const Annotation& from,
                  const Annotation& to, const NDArray& local, Communicator& world,
                  DType dtype = DType::F32) const;

  // Bytes this rank sent inside Reshards since reset_ledger(): measured by
  // the communicator's counters, and predicted by the resolutions.
  struct ByteLedger {
    int64_t measured = 0;
    int64_t predicted = 0;
    // Inside ops (Op::traffic: ring attention, vocab-parallel loss): measured
    // by the counters around each op's compute, predicted by the op. Under
    // an emulated clock the measured side also holds the clock messages.
    int64_t op_measured = 0;
    int64_t op_predicted = 0;
    // The part of op_* that expert parallelism's token exchange sent
    // (moe_experts), measured and as the resolver predicted it from the
    // calls' routing counts.
    int64_t expert_measured = 0;
    int64_t expert_predicted = 0;
  };
  const ByteLedger& ledger() const { return ledger_; }

  // With deferred sends on, Reshards return without waiting their outgoing
  // messages (pipeline schedules, see execute()); wait_sends() completes them.
  void set_deferred_sends(bool on) { defer_sends_ = on; }
  void wait_sends(Communicator& world) const { pending_.wait(world); }

  // Emulation (virtual_clock.h): with a clock, every op's compute advances
  // it, and every Reshard first synchronizes it with the rank's peers in
  // that Reshard (senders' clocks travel to receivers; collective members
  // exchange theirs) and adds the transfer time over the topology's links.
  // Ops that communicate inside their kernels get, through group_along, a
  // ClockedCommunicator (src/exec/clocked_comm.h) billing that to the clock.
  void set_clock(VirtualClock* clock) { clock_ = clock; }
  // The model clock (docs/profiling.md): with a clock in model mode, every
  // op advances it by `model`'s prediction for its work (op_work) when it
  // completes, instead of by CPU time. Required before running with such a
  // clock (InternalError otherwise).
  void set_op_time_model(std::shared_ptr<const OpTimeModel> model) { time_model_ = std::move(model); }
  // Profiling: after every op this rank computes, `observer` gets the node,
  // its work and the compute seconds it billed to the clock (0 without one).
  using OpObserver = std::function<void(const Node& node, const OpWork& work, double seconds)>;
  void set_op_observer(OpObserver observer) { observer_ = std::move(observer); }
  // Where the time goes (`hspmd train --op-times`): while `sink` is set, every
  // op this rank computes appends its type and two events recorded on its
  // stream around it (nothing waits: read them once the stream is done),
  // with the bytes of its arrays and its flops.
  struct OpTiming {
    std::string type;
    Event start, end;
    double bytes = 0;  // the op's input and output arrays, as their dtypes store them
    double flops = 0;  // OpWork::flops
  };
  void set_op_timing(std::vector<OpTiming>* sink) { op_timing_ = sink; }
  // Emulation: after every op and Reshard, the bytes this process holds must
  // stay within `bytes` (0 = no cap), else hspmd::Error "[emulate] rank R:
  // out of memory ...".
  void set_memory_cap(size_t bytes) { memory_cap_ = bytes; }
  void reset_ledger() const { ledger_ = {}; }
  // Adds Reshard bytes moved outside the graph's world (the gradient sync's).
  void add_to_ledger(int64_t measured, int64_t predicted) const {
    ledger_.measured += measured;
    ledger_.predicted += predicted;
  }

 private:
  struct LocalOp;
  // The shape instance of `bindings`, built and cached on first use.
  const Instance& instance(const Bindings& bindings) const;
  std::unique_ptr<LocalOp> make_local_op(const Node& node, const Bindings& bindings) const;
  void select_nodes(const std::map<int, std::shared_ptr<const Resolution>>& forward);
  void find_parameter_only();
  void count_uses();
  void plan_recompute(const std::map<int, std::shared_ptr<const Resolution>>& forward);
  void check_feeds(const ValueMap& values, const Instance& inst) const;
  std::vector<NDArray> compute(const LocalOp& op, const Node& node,
                               const std::vector<NDArray>& inputs) const;
  mutable Communicator* world_ = nullptr;  // the run's world, for group_along
  // With a clock: the ops' groups, wrapped to bill their communication to it.
  mutable std::map<std::vector<int>, std::unique_ptr<Communicator>> clocked_groups_;
  // `name`: the Reshard's own name (a shared resolution carries another's).
  NDArray run_reshard(const Resolution& r, const std::string& name, const NDArray& in,
                      Communicator& world) const;
  // Runs `ids` in order through hspmd::run_nodes (release after the last
  // local consumer); `values` feeds the leaves (nullptr after the loss);
  // `on_grad` as backward() takes it.
  void run_nodes(std::span<const int> ids, const ValueMap* values, Activations& a,
                 Communicator& world, const char* trace_prefix = "", const GradReady* on_grad = nullptr) const;
  size_t forward_end_ = 0;  // order_[0, forward_end_) is the forward
  std::vector<char> parameter_only_;  // per node id (StepScope)
  mutable bool step_open_ = false;
  mutable std::map<int, std::vector<NDArray>> step_values_;  // parameter-only outputs of the open step
  mutable std::set<int> step_given_;                          // those of them the StepScope was given
  mutable ByteLedger ledger_;
  bool defer_sends_ = false;
  bool recompute_ = false;
  VirtualClock* clock_ = nullptr;
  std::shared_ptr<const OpTimeModel> time_model_;
  OpObserver observer_;
  std::vector<OpTiming>* op_timing_ = nullptr;
  size_t memory_cap_ = 0;
  void check_memory(const Node& node) const;
  void sync_clock(const Resolution& r, Communicator& world) const;
  mutable PendingSends pending_;
  std::shared_ptr<const AnnotationPlan> plan_;
  std::shared_ptr<const Topology> topology_;
  int rank_;
  Bindings bindings_;
  Device device_;
  AnnotatedTraining training_;
  const ModelGraph& model_ = training_.model;
  const AnnotatedGraph* annotated_ = nullptr;
  mutable ResolutionCache resolve_;                // alike Reshards resolve once
  mutable std::map<Bindings, std::unique_ptr<const Instance>> instances_;
  // Shape-independent, built once under the constructor's bindings:
  std::vector<int> order_;                         // node ids this rank runs, in graph order
  UseCounts uses_;                                 // per node output: consumers in order_ (+1 kept)
  std::map<std::string, int> grad_sync_node_;      // param name -> grad.<param> node id
  std::map<int, ReshardSpec> grad_specs_;  // grad.<param> node id -> its Reshard (grad_sync resolves it for all ranks)
  std::map<int, std::shared_ptr<const Resolution>> grad_resolutions_;  // grad.<param> node id ->
  // Recomputation: the forward nodes whose outputs the forward keeps
  // (leaves, loss, boundary Reshards), the forward nodes backward() re-runs,
  // and the use counts of the forward and of re-run + backward.
  std::vector<bool> saved_;
  std::vector<int> recompute_order_;
  UseCounts recompute_forward_uses_;
  UseCounts recompute_backward_uses_;
};

// Whether `rank` holds the representative copy of its value under `a`: the
// first subgroup only when subgroups are copies (hdim -1), and inside its
// subgroup the rank with dup coordinate 0. Summing a quantity over the
// representatives counts every distinct value (or partial term) once.
bool is_representative(const Annotation& a, int rank);

}  // namespace hspmd
