// Op: the interface every operator implements, in one file per op
// (src/ops/<name>.cc): its shape rule, its annotation-deduction rule, its
// kernel calls and its gradient.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "hspmd/annotation/annotation.h"
#include "hspmd/core/error.h"
#include "hspmd/core/ndarray.h"
#include "hspmd/graph/graph.h"

namespace hspmd {

class AnnotatedGraph;  // hspmd/deduce/deduce.h
class Communicator;    // hspmd/comm/communicator.h
class Topology;        // hspmd/resolve/topology.h

// What an op's deduction rule (Op::deduce) sees besides its input
// annotations. The engine that fills it walks graphs: hspmd/deduce/deduce.h.
struct DeduceContext {
  const Node& node;
  // Annotations from the plan (leaves and named Reshards), by tensor name.
  const std::map<std::string, Annotation>& plan;
  // Annotations of every tensor deduced so far (all nodes before `node`).
  const AnnotatedGraph& graph;
  // Ranks are in [0, world_size); plan annotations are validated against it.
  int world_size = 1;

  // "op 'matmul' (node 12)", or "op 'reshard' 'model.layers.3.input' (node
  // 40)" for a named node, "(node 24, from hspmd_custom program: block op 8
  // (add -> out) of layer 0)" for a node with an origin: the prefix of the
  // rule's error messages.
  std::string where() const;
};

// Throws hspmd::Error "[deduce] <ctx.where()>: <args...>" (one line).
template <typename... Args>
[[noreturn]] void fail_at(const DeduceContext& ctx, const Args&... args) {
  fail("[deduce] ", ctx.where(), ": ", args...);
}

// Where a rank's local arrays sit in the global tensors, for the few ops whose
// local computation depends on it or needs its peers (vocab-parallel
// embedding and cross-entropy, context-parallel attention). Set by the
// distributed executor; absent (nullptr) on one device, where every array is
// the whole tensor.
struct ShardContext {
  std::vector<Shape> input_global_shapes;  // one per input
  std::vector<Box> input_boxes;            // the global box of each local input
  std::vector<Shape> output_global_shapes;
  std::vector<Box> output_boxes;
  // The communicator over the ranks that hold the same data as this rank
  // except along tensor dim `dim` of input `input` (the ranks sharing its
  // split along that dim), ordered by their chunk along it. Throws
  // InternalError when the executor cannot provide one.
  std::function<Communicator&(int input, int dim)> group_along;
  // The world ranks of that group, in the same order (also set by the dry
  // run, which has no communicators).
  std::function<std::vector<int>(int input, int dim)> ranks_along;

  // For ops whose inputs live on different devices (Op::spans_devices:
  // expert parallelism), which resolve their own data-dependent Reshards:
  // this rank, the deduced annotation of every input, whether this rank
  // holds each input and output (an input it does not hold comes as an
  // invalid array, and the op leaves such an output invalid), the
  // topology, and the communicator over any list of world ranks (distinct,
  // this rank among them; created collectively over its members on first
  // use). Unset (-1, empty, nullptr) for other ops.
  int rank = -1;
  std::vector<Annotation> input_annotations;
  std::vector<char> input_held, output_held;
  const Topology* topology = nullptr;
  std::function<Communicator&(const std::vector<int>& ranks)> group;
};

// Communication an op does inside compute() on one rank (op-internal, not a
// Reshard), per call, in bytes as the communicator's counters count them
// (collectives by their ring volumes, communicator.h).
struct OpTraffic {
  std::string kind;        // e.g. "ring_attention", "vocab_parallel_all_reduce"
  std::vector<int> group;  // the world ranks it talks with (itself included)
  int64_t sent = 0, received = 0;
  bool any() const { return !group.empty(); }
};

// What compute() gets besides its inputs: the concrete output shapes and
// dtypes (from the shape rule under the run's symbol bindings, or the local
// shapes under a distributed executor) and the device.
struct OpContext {
  std::vector<Shape> out_shapes;
  std::vector<DType> out_dtypes;
  Device device;
  // The stream the op's kernels run on (a stream of `device`): never null
  // when an op computes; the executors set their device's default stream.
  Stream* stream = nullptr;
  const Bindings* bindings = nullptr;
  const ShardContext* shard = nullptr;
  // Where an op whose communication depends on its input values (expert
  // parallelism's token exchange) adds the bytes this rank sends, as
  // predicted for this call (the resolver's prediction given the routing),
  // when the executor asks for it (nullptr otherwise).
  int64_t* traffic_sent = nullptr;
  // Where such an op writes the floating-point operations this call did
  // when they depend on values it computed (the expert rows this rank
  // received), for the model clock and the op timings in place of
  // Op::flops (nullptr: not asked; left negative: Op::flops stands).
  double* work_flops = nullptr;

  // A new contiguous array for output i (uninitialized).
  NDArray alloc(int i) const { return NDArray::empty(out_shapes[i], out_dtypes[i], device); }
};

class Op {
 public:
  virtual ~Op() = default;

  // Short type name, e.g. "matmul", for messages, reports and JSON. Code
  // that must recognize an op uses its typed predicate instead (is_parameter,
  // is_placeholder in graph.h; ops::is_reshard in hspmd/ops/ops.h).
  virtual std::string type() const = 0;

  // Shape rule: output metas from input metas. Throws hspmd::Error
  // ("[op] ...") when the inputs do not fit.
  virtual std::vector<TensorMeta> infer(const std::vector<TensorMeta>& inputs) const = 0;

  // Computes the outputs. `outputs` has one invalid slot per output; the op
  // fills each with ctx.alloc(i) or with a view of an input.
  virtual void compute(const OpContext& ctx, const std::vector<NDArray>& inputs,
                       std::vector<NDArray>& outputs) const = 0;

  // Reverse mode: appends the backward nodes of `node` to its graph and
  // returns one gradient per input (an invalid Tensor where an input gets
  // none). grad_outputs[i] is invalid when output i received no gradient.
  // The default throws: the op is not differentiable.
  virtual std::vector<Tensor> gradient(const Node& node,
                                       const std::vector<Tensor>& grad_outputs) const;

  // The same, where some inputs already have a gradient from later
  // consumers: addends[i] is input i's gradient so far (invalid where it has
  // none). An op may fold addends[i] into the gradient it returns for input
  // i (computing their sum in the node that makes its own term: a GEMM or a
  // norm's backward adds it as it writes, with no separate add pass) and
  // then resets addends[i] to say so; the autodiff adds the others. The
  // default folds none.
  virtual std::vector<Tensor> gradient_into(const Node& node, const std::vector<Tensor>& grad_outputs,
                                            std::vector<Tensor>& addends) const {
    (void)addends;
    return gradient(node, grad_outputs);
  }

  // Annotation deduction (docs/deduction.md): one annotation per output
  // from the inputs' annotations, which the engine has already checked to
  // live on the same subgroups (same device groups, same hsize). Throws
  // hspmd::Error "[deduce] <ctx.where()>: <rule>" when the inputs' layouts do
  // not fit the op. The default is the elementwise rule: every input must
  // have the same annotation (else "inputs 0 and I are sharded differently"),
  // no input may be partial unless is_linear() (else "input I is partial;
  // insert a Reshard to reduce it first"), and every output copies input 0.
  virtual std::vector<Annotation> deduce(const DeduceContext& ctx,
                                         const std::vector<Annotation>& inputs) const;

  // Whether the op is linear in all its inputs jointly (op(a + a') = op(a) +
  // op(a') with a, a' lists of inputs), as add and concat are: the default
  // rule then lets identical partial inputs through to a partial output.
  virtual bool is_linear() const { return false; }

  // Whether a gradient that reads this op's output should compute it again
  // in the backward (ops::recompute_for_backward) rather than keep the
  // forward's value alive until then: true for cheap elementwise ops whose
  // inputs the backward keeps anyway (swiglu), so recomputing costs one
  // pass and frees the output as soon as its forward consumers ran.
  virtual bool recompute_for_backward() const { return false; }

  // With recompute_for_backward(): appends a node that recomputes `node`'s
  // output from its inputs and, in the same pass, its inputs' gradients
  // from `grad` (the output's whole gradient), and returns the recomputed
  // output; gradient() called later with that `grad` returns the gradients
  // made there instead of another pass. Invalid: the op has no such node
  // (the default). `node` is a reference into the graph's node storage,
  // which adding nodes may move: copy from it first.
  virtual Tensor recompute_with_gradient(const Node& node, const Tensor& grad) const {
    (void)node;
    (void)grad;
    return Tensor();
  }

  // Whether this op's backward reads output `output`'s gradient rounded to
  // bf16 whatever dtype it comes in (cuDNN's attention reads dO so): the op
  // making that gradient may then write it in bf16 itself, the same bits
  // without an f32 array and a conversion (ops::gradient_rounded). `node`
  // is this op's node. None by default.
  virtual bool rounds_gradient(const Node& node, int output) const {
    (void)node;
    (void)output;
    return false;
  }

  // The op-internal communication of one call on the rank described by
  // `shard` (its boxes and ranks_along); none by default. Ops that talk to
  // their group in compute() override it with the exact volumes, so the dry
  // run can list them and the executor can check its counters against them.
  virtual OpTraffic traffic(const ShardContext& /*shard*/) const { return {}; }
  // Whether traffic() may return any (lets the dry run skip the other ops).
  virtual bool may_communicate() const { return false; }
  // Whether the op's inputs may live on different devices (expert
  // parallelism: each expert's weights on its owners, the tokens on every
  // rank of the group): the engine then skips its same-devices check, the
  // op's rule checks the layouts, and the executor runs the op on the ranks
  // of output 0 (see ShardContext). False by default.
  virtual bool spans_devices() const { return false; }

  // Floating-point operations of one call on local arrays of these shapes:
  // the work the model clock charges an op for (exec/op_work.h,
  // docs/profiling.md). The default counts one per output element
  // (elementwise ops); matmul and attention override it. `shard` (nullptr on
  // one device) gives global shapes where the local work depends on them.
  virtual double flops(const std::vector<Shape>& inputs, const std::vector<Shape>& outputs,
                       const ShardContext* shard) const;
  // The same on the call's actual inputs, for ops whose work depends on
  // input values: attention with documents counts only the products its
  // document mask keeps. The default calls flops() on the inputs' shapes.
  virtual double flops_on(const std::vector<NDArray>& inputs, const std::vector<Shape>& outputs,
                          const ShardContext* shard) const;
};

}  // namespace hspmd
