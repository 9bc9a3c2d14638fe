// Training from Python: the world communicator (MPI under mpirun, else a
// world of one), TrainOptions built from the CLI's flag names, and
// TrainingRun, the training loop driven one step at a time.
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <type_traits>

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "hspmd/comm/communicator.h"
#include "hspmd/core/device.h"
#include "hspmd/core/error.h"
#include "hspmd/core/json_file.h"
#include "hspmd/optim/lr_schedule.h"
#include "hspmd/plan/plan.h"
#include "hspmd/train/trainer.h"
#include "kernels/basic.h"

namespace hspmd::python {

namespace {

// The flags of `hspmd train` the Python Trainer takes (dashes as
// underscores), each written into TrainOptions.
using Setter = std::function<void(TrainOptions&, const py::handle&)>;

// A value of the wrong type, what the option takes: options_from_flags
// names the option (a pybind11 cast error names none).
struct BadValue {
  const char* expected;
};

template <typename T>
const char* expected_kind() {
  if constexpr (std::is_same_v<T, bool>) return "True or False";
  else if constexpr (std::is_same_v<T, int>) return "an integer in [-2^31, 2^31)";
  else if constexpr (std::is_integral_v<T>) return "an integer in [-2^63, 2^63)";
  else if constexpr (std::is_floating_point_v<T>) return "a number";
  else return "a string";
}

// `v` as a T (a path-like object as its os.fspath for strings); BadValue
// when it is not one.
template <typename T>
T value(const py::handle& v) {
  try {
    if constexpr (std::is_same_v<T, std::string>)
      if (py::hasattr(v, "__fspath__")) return py::module_::import("os").attr("fspath")(v).template cast<T>();
    return v.cast<T>();
  } catch (const py::cast_error&) {
    throw BadValue{expected_kind<T>()};
  }
}

template <typename T>
Setter field(T TrainOptions::*member) {
  return [member](TrainOptions& o, const py::handle& v) { o.*member = value<T>(v); };
}

const std::map<std::string, Setter>& setters() {
  static const std::map<std::string, Setter> table = {
      {"model", field(&TrainOptions::model_path)},
      {"data", field(&TrainOptions::data_path)},
      {"init", field(&TrainOptions::init_path)},
      {"save", field(&TrainOptions::save_path)},
      {"log", field(&TrainOptions::log_path)},
      {"dump_grads", field(&TrainOptions::dump_grads_path)},
      {"op_times", field(&TrainOptions::op_times_path)},
      {"strategy", field(&TrainOptions::strategy_path)},
      {"plan", field(&TrainOptions::plan_path)},
      {"cluster", field(&TrainOptions::cluster_path)},
      {"trace", field(&TrainOptions::trace_path)},
      {"checkpoint", field(&TrainOptions::checkpoint_dir)},
      {"save_every", field(&TrainOptions::save_every)},
      {"checkpoint_sync", field(&TrainOptions::checkpoint_sync)},
      {"resume", field(&TrainOptions::resume_dir)},
      {"overwrite_checkpoint", field(&TrainOptions::overwrite_checkpoint)},
      {"seq_len", field(&TrainOptions::seq_len)},
      {"global_batch", field(&TrainOptions::global_batch)},
      {"micro_batches", field(&TrainOptions::micro_batches)},
      {"steps", field(&TrainOptions::steps)},
      {"clip_grad", field(&TrainOptions::clip_grad)},
      {"skip_nonfinite_steps", field(&TrainOptions::skip_nonfinite_steps)},
      {"threads", field(&TrainOptions::threads)},
      {"pack_documents", field(&TrainOptions::pack_documents)},
      {"progress", field(&TrainOptions::progress)},
      {"switch_algorithm", field(&TrainOptions::switch_algorithm)},
      {"switch_bucket_mb", field(&TrainOptions::switch_bucket_mb)},
      {"seed", [](TrainOptions& o, const py::handle& v) {
         const int64_t seed = value<int64_t>(v);
         if (seed < 0) fail("[flags] --seed must be >= 0, got ", seed);
         o.seed = static_cast<uint64_t>(seed);
       }},
      {"lr", [](TrainOptions& o, const py::handle& v) { o.schedule.lr = value<double>(v); }},
      {"min_lr", [](TrainOptions& o, const py::handle& v) { o.schedule.min_lr = value<double>(v); }},
      {"warmup_steps", [](TrainOptions& o, const py::handle& v) { o.schedule.warmup_steps = value<int64_t>(v); }},
      {"lr_schedule",
       [](TrainOptions& o, const py::handle& v) { o.schedule.kind = LrSchedule::parse_kind(value<std::string>(v)); }},
      {"weight_decay", [](TrainOptions& o, const py::handle& v) { o.adam.weight_decay = value<double>(v); }},
      {"beta1", [](TrainOptions& o, const py::handle& v) { o.adam.beta1 = value<double>(v); }},
      {"beta2", [](TrainOptions& o, const py::handle& v) { o.adam.beta2 = value<double>(v); }},
      {"eps", [](TrainOptions& o, const py::handle& v) { o.adam.eps = value<double>(v); }},
      {"optimizer", [](TrainOptions& o, const py::handle& v) {
         const std::string name = value<std::string>(v);
         if (name != "adamw" && name != "adam")
           fail("[flags] --optimizer: unknown optimizer '", name, "' (expected adamw or adam)");
         o.adam.decoupled_weight_decay = name == "adamw";
       }},
      {"save_dtype", [](TrainOptions& o, const py::handle& v) {
         const std::string name = value<std::string>(v);
         if (name != "f32" && name != "bf16") fail("[flags] --save-dtype: '", name, "' (expected f32 or bf16)");
         o.save_dtype = name == "bf16" ? DType::BF16 : DType::F32;
       }},
      {"precision", [](TrainOptions& o, const py::handle& v) {
         std::string name = value<std::string>(v);
         if (name == "auto") name = kernels::bf16_gemm_native() ? "bf16" : "fp32";
         o.precision.compute = parse_precision_name(name, "--precision");
       }},
      {"grad_reduce_dtype", [](TrainOptions& o, const py::handle& v) {
         o.precision.grad_reduce = parse_precision_name(value<std::string>(v), "--grad-reduce-dtype");
       }},
      {"overlap", [](TrainOptions& o, const py::handle& v) { o.overlap = value<bool>(v); }},
      {"device", [](TrainOptions& o, const py::handle& v) {
         // As the command line: plain "cuda" spreads a machine's ranks over
         // its GPUs, "cuda:N" puts them all on N. The ranks communicate
         // through the staged MPI world (docs/comm.md).
         const Device where = rank_device(value<std::string>(v), "--device", 0);
         require_device(where);
         o.device = where;
       }},
  };
  return table;
}

// TrainOptions from {flag: value} (None values skipped), with the CLI's
// defaults: lr 3e-4, all cores shared by the node's ranks, no progress line.
TrainOptions options_from_flags(const py::dict& flags) {
  TrainOptions o;
  o.schedule.lr = 3e-4;
  const int64_t cores = std::max(1u, std::thread::hardware_concurrency());
  int local = 1;
  if (const char* env = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE")) local = std::max(1, std::atoi(env));
  o.threads = static_cast<int>(std::clamp<int64_t>(cores / local, 1, 1024));
  o.progress = false;
  for (auto [key, value] : flags) {
    const std::string name = key.cast<std::string>();
    const auto it = setters().find(name);
    if (it == setters().end()) fail("[flags] unknown training option '", name, "'");
    if (value.is_none()) continue;
    try {
      it->second(o, value);
    } catch (const BadValue& bad) {
      fail("[flags] ", name, "=", shorten(py::repr(value).cast<std::string>()), ": must be ", bad.expected,
           ", got ", py::str(value.get_type().attr("__name__")).cast<std::string>());
    }
  }
  // The rates first, in the Trainer's own spelling: Trainer(lr=-1) is
  // refused as lr, not as min_lr's bound.
  o.schedule.check_rates("lr", "min_lr");
  if (o.precision.grad_reduce == DType::BF16 && !o.precision.mixed())
    fail("[flags] --grad-reduce-dtype bf16 needs --precision bf16");
  for (auto [flag, beta] : {std::pair{"--beta1", o.adam.beta1}, std::pair{"--beta2", o.adam.beta2}})
    if (!(beta >= 0 && beta < 1)) fail("[flags] ", flag, " must lie in [0, 1), got ", beta);
  if (o.threads < 1 || o.threads > 1024) fail("[flags] --threads must lie in [1, 1024], got ", o.threads);
  return o;
}

// One call at a time per run: the calls below release the GIL while they
// work, and a run's state is not shared between threads. A call that comes
// while another thread is in one is refused before it touches the run
// (hspmd.Error naming both calls); the call in progress goes on.
class OneCallAtATime {
 public:
  OneCallAtATime(const TrainingRun& run, const char* call) : run_(&run) {
    std::lock_guard<std::mutex> lock(mutex());
    const auto [it, fresh] = calls().emplace(run_, call);
    if (!fresh)
      fail("[train] Trainer.", call, ": another thread is in ", it->second,
           " of this Trainer; a Trainer's calls run one at a time (wait for that call, or give each thread its "
           "own Trainer)");
  }
  ~OneCallAtATime() {
    std::lock_guard<std::mutex> lock(mutex());
    calls().erase(run_);
  }
  OneCallAtATime(const OneCallAtATime&) = delete;
  OneCallAtATime& operator=(const OneCallAtATime&) = delete;

 private:
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::map<const TrainingRun*, const char*>& calls() {
    static std::map<const TrainingRun*, const char*> c;
    return c;
  }
  const TrainingRun* run_;
};

py::dict numpy_parameters(TrainingRun& run) {
  OneCallAtATime one(run, "state_dict()");
  std::map<std::string, NDArray> params;
  {
    py::gil_scoped_release release;
    params = run.parameters();
  }
  py::dict out;
  for (const auto& [name, array] : params) {
    py::array_t<float> a(std::vector<py::ssize_t>(array.shape().begin(), array.shape().end()));
    std::memcpy(a.mutable_data(), array.host_data<float>(), sizeof(float) * array.numel());
    out[py::str(name)] = a;
  }
  return out;
}

// {name: numpy array} as NDArrays: float32 (C order copied), any other
// dtype refused in one line naming the tensor.
std::map<std::string, NDArray> arrays_from_numpy(const py::dict& weights, const std::string& source) {
  std::map<std::string, NDArray> out;
  for (auto [key, value] : weights) {
    const std::string name = py::str(key);
    if (!py::isinstance<py::array>(value))
      fail("[weights] ", source, ": ", name, ": a ", std::string(py::str(value.get_type().attr("__name__"))),
           ", not a numpy array");
    const py::array a = py::reinterpret_borrow<py::array>(value);
    if (a.dtype().kind() != 'f' || a.dtype().itemsize() != 4)
      fail("[weights] ", source, ": ", name, ": dtype ", std::string(py::str(a.dtype())), " is not float32");
    const auto c = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(a);
    Shape shape(c.shape(), c.shape() + c.ndim());
    NDArray array = NDArray::empty(shape, DType::F32);
    if (array.numel() > 0) std::memcpy(array.host_data<float>(), c.data(), sizeof(float) * array.numel());
    out.emplace(name, std::move(array));
  }
  return out;
}

}  // namespace

void bind_train(py::module_& m) {
  py::class_<Communicator, std::shared_ptr<Communicator>>(m, "Communicator", "A world of ranks")
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("size", &Communicator::size)
      .def("barrier", &Communicator::barrier, py::call_guard<py::gil_scoped_release>())
      .def("abort", &Communicator::abort, py::arg("code") = 1);
  m.def("make_world", [] { return std::shared_ptr<Communicator>(make_world_communicator()); },
        "MPI_COMM_WORLD under mpirun (MPI initialized here once, finalized at exit), else a world of one");
  m.def("built_with_mpi", &built_with_mpi);

  py::class_<TrainOptions>(m, "TrainOptions", "The options of `hspmd train`")
      .def(py::init(&options_from_flags), py::arg("flags"))
      .def_readonly("steps", &TrainOptions::steps)
      .def_readonly("threads", &TrainOptions::threads)
      .def("set_strategy", [](TrainOptions& o, const Strategy& s) { o.strategy = s; }, py::arg("strategy"))
      .def("single_process", &single_process_options,
           "These options for a world of one: the strategy of one rank from global_batch and micro_batches");

  py::class_<TrainingRun>(m, "TrainingRun", "The training loop of `hspmd train`, one step at a time")
      .def(py::init<const TrainOptions&, Communicator&>(), py::arg("options"), py::arg("world"),
           py::keep_alive<1, 3>(), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("done", &TrainingRun::done)
      .def_property_readonly("next_step", &TrainingRun::next_step)
      .def("step", [](TrainingRun& run) {
             OneCallAtATime one(run, "step()");
             StepRecord r;
             {
               py::gil_scoped_release release;
               r = run.step();
             }
             return step_record_json(r);
           }, "Trains the next step; returns its log record as JSON text")
      .def("finish", [](TrainingRun& run) {
             OneCallAtATime one(run, "finish()");
             std::vector<StepRecord> records;
             {
               py::gil_scoped_release release;
               records = run.finish();
             }
             std::vector<std::string> out;
             for (const StepRecord& r : records) out.push_back(step_record_json(r));
             return out;
           }, "Waits for the last checkpoint, writes --save and --trace; every step's record as JSON text")
      .def_property_readonly("finished", &TrainingRun::finished)
      .def("wait_for_checkpoint", [](TrainingRun& run) {
             OneCallAtATime one(run, "load_checkpoint()");
             py::gil_scoped_release release;
             run.wait_for_checkpoint();
           },
           "Commits the pending background checkpoint (save_every=), waiting for its writers")
      .def("parameters", &numpy_parameters, "{Hugging Face name: float32 numpy array}, the same on every rank")
      .def("save_checkpoint", [](TrainingRun& run, const std::string& dir) {
             OneCallAtATime one(run, "save_checkpoint()");
             py::gil_scoped_release release;
             run.save_checkpoint(dir);
           }, py::arg("dir"))
      .def("switch_to", [](TrainingRun& run, std::optional<Strategy> strategy, std::optional<AnnotationPlan> plan,
                           const std::string& source) {
             OneCallAtATime one(run, "switch_to()");
             TrainingRun::SwitchTarget t;
             t.strategy = std::move(strategy);
             if (plan) t.plan = std::make_shared<const AnnotationPlan>(std::move(*plan));
             t.source = source;
             py::gil_scoped_release release;
             run.switch_to(t);
           }, py::arg("strategy"), py::arg("plan"), py::arg("source"),
           "Moves the run to a strategy, a compiled plan, or the strategy or plan file `source`, before the next step")
      .def("load_parameters", [](TrainingRun& run, const py::dict& weights, const std::string& source) {
             OneCallAtATime one(run, "load_state_dict()");
             std::map<std::string, NDArray> arrays = arrays_from_numpy(weights, source);
             py::gil_scoped_release release;
             run.load_parameters(std::move(arrays), source);
           }, py::arg("weights"), py::arg("source"),
           "Replaces the weights with full float32 tensors (Hugging Face names); the moments restart at zero");
}

}  // namespace hspmd::python
