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
#include "hspmd/core/options.h"
#include "hspmd/core/json_file.h"
#include "hspmd/plan/plan.h"
#include "hspmd/options/train_options.h"
#include "hspmd/train/trainer.h"

namespace hspmd::python {

namespace {

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

// A keyword's value as the schema row's type wants it.
OptionValue option_value(const OptionSpec<TrainOptions>& spec, const py::handle& v) {
  switch (spec.type) {
    case OptionType::kBool: return value<bool>(v);
    case OptionType::kDouble: return value<double>(v);
    case OptionType::kString: return value<std::string>(v);
    case OptionType::kInt: {
      const bool narrow = spec.range.lo == kIntRange.lo && spec.range.hi == kIntRange.hi;
      const int64_t n = narrow ? value<int>(v) : value<int64_t>(v);
      return check_int_range(option_ref(spec.name), n, spec.range);
    }
  }
  return false;
}

// The Trainer's keywords beyond the schema: where this process computes,
// the overlap (the command line's --overlap / --no-overlap), the progress line.
bool set_python_option(TrainOptions& o, const std::string& name, const py::handle& v) {
  if (name == "overlap") {
    o.overlap = value<bool>(v);
  } else if (name == "progress") {
    o.progress = value<bool>(v);
  } else if (name == "device") {
    // As the command line: plain "cuda" spreads a machine's ranks over
    // its GPUs, "cuda:N" puts them all on N. The ranks communicate
    // through the staged MPI world (docs/comm.md).
    const Device where = rank_device(value<std::string>(v), option_name("device"), 0);
    require_device(where);
    o.device = where;
  } else {
    return false;
  }
  return true;
}

// TrainOptions from {keyword: value} (None values skipped): the schema's
// options (train_option_table) with their defaults (default_train_options)
// and no progress line, then validate()'s rules.
TrainOptions options_from_flags(const py::dict& flags) {
  TrainOptions o = default_train_options();
  o.progress = false;
  GivenOptions given;
  for (auto [key, v] : flags) {
    const std::string name = key.cast<std::string>();
    const OptionSpec<TrainOptions>* spec = find_train_option(name);
    if (spec == nullptr && name != "overlap" && name != "progress" && name != "device")
      fail(options_tag(), " unknown training option '", name, "'");
    if (v.is_none()) continue;
    try {
      if (spec != nullptr) spec->set(o, option_value(*spec, v));
      else set_python_option(o, name, v);
    } catch (const BadValue& bad) {
      fail(options_tag(), " ", name, "=", shorten(py::repr(v).cast<std::string>()), ": must be ", bad.expected,
           ", got ", py::str(v.get_type().attr("__name__")).cast<std::string>());
    }
    given.insert(name);
  }
  validate(o, given);
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
           }, "Waits for the last checkpoint, writes save= and trace=; every step's record as JSON text")
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
