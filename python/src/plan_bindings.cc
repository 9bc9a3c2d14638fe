// Models, strategies and annotation plans as Python values, compile_plan, and
// the `hspmd plan` commands (explain, cost, search) run in-process.
#include <unistd.h>

#include <cstdio>

#include <pybind11/stl.h>

#include "bindings.h"
#include "int_arg.h"
#include "cli/commands.h"
#include "hspmd/core/error.h"
#include "hspmd/core/limits.h"
#include "hspmd/models/config.h"
#include "hspmd/models/model.h"
#include "hspmd/plan/plan.h"
#include "hspmd/plan/strategy.h"

namespace hspmd::python {

std::string capture_stdout(const std::function<void()>& fn) {
  std::fflush(stdout);
  FILE* sink = std::tmpfile();
  if (!sink) fail("[python] cannot create a temporary file to capture the command's output");
  const int saved = dup(1);
  dup2(fileno(sink), 1);
  auto restore = [&] {
    std::fflush(stdout);
    dup2(saved, 1);
    close(saved);
  };
  try {
    fn();
  } catch (...) {
    restore();
    std::fclose(sink);
    throw;
  }
  restore();
  std::string out;
  std::rewind(sink);
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, sink)) > 0;) out.append(buf, n);
  std::fclose(sink);
  return out;
}

namespace {

nlohmann::json parse(const std::string& text, const std::string& what) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail("[python] ", what, ": malformed JSON: ", e.what());
  }
}

const char* role_name(ParamRole role) {
  switch (role) {
    case ParamRole::kColumnParallel: return "column_parallel";
    case ParamRole::kRowParallel: return "row_parallel";
    case ParamRole::kVocabulary: return "vocabulary";
    case ParamRole::kReplicated: return "replicated";
  }
  return "?";
}

void bind_config(py::module_& m) {
  py::class_<ModelConfig>(m, "ModelConfig", "A Hugging Face config.json as hspmd reads it (docs/models.md)")
      .def_static("load", &ModelConfig::load, py::arg("path"))
      .def_static("from_json",
                  [](const std::string& text, const std::string& source) {
                    return ModelConfig::from_json(parse(text, source), source);
                  },
                  py::arg("text"), py::arg("source") = "config")
      .def("to_json", [](const ModelConfig& c) { return c.to_json().dump(); })
      .def_readonly("model_type", &ModelConfig::model_type)
      .def_readonly("vocab_size", &ModelConfig::vocab_size)
      .def_readonly("hidden_size", &ModelConfig::hidden_size)
      .def_readonly("intermediate_size", &ModelConfig::intermediate_size)
      .def_readonly("num_hidden_layers", &ModelConfig::num_hidden_layers)
      .def_readonly("num_attention_heads", &ModelConfig::num_attention_heads)
      .def_property_readonly("num_key_value_heads", &ModelConfig::kv_heads)
      .def_readonly("max_position_embeddings", &ModelConfig::max_position_embeddings)
      .def_readonly("tie_word_embeddings", &ModelConfig::tie_word_embeddings)
      .def_readonly("attention_bias", &ModelConfig::attention_bias)
      .def_readonly("sliding_window", &ModelConfig::sliding_window)
      .def_property_readonly("parameter_count", &ModelConfig::parameter_count)
      .def("parameters",
           [](const ModelConfig& c) {
             py::list out;
             for (const ModelParameter& p : model_parameters(c))
               out.append(py::make_tuple(p.name, p.shape, role_name(p.role)));
             return out;
           },
           "[(Hugging Face name, shape, tensor-parallel role)] in the model's order");
  m.def("model_types", &registered_model_types, "The registered model families' model_type values");
}

void bind_strategy(py::module_& m) {
  py::class_<Strategy>(m, "Strategy", "A parallel strategy (docs/strategy.md)")
      .def_static("from_json",
                  [](const std::string& text) { return strategy_from_json(parse(text, "strategy")); },
                  py::arg("text"))
      .def_static("load", &load_strategy, py::arg("path"))
      .def("to_json", [](const Strategy& s) { return to_json(s).dump(); })
      .def_readonly("description", &Strategy::description)
      .def_readonly("schedule", &Strategy::schedule)
      .def_readonly("zero", &Strategy::zero)
      .def_readonly("expert_parallel", &Strategy::expert_parallel)
      .def_property_readonly("global_batch", &Strategy::global_batch)
      .def_property_readonly("ranks", &Strategy::ranks)
      .def("validate",
           [](const Strategy& s, const ModelConfig& c, const py::object& world) {
             validate(s, c, static_cast<int>(int_arg(world, "[python] Strategy.validate: world_size",
                                                     {1, kMaxWorldSize})));
           },
           py::arg("config"), py::arg("world_size"))
      .def("__eq__", [](const Strategy& a, const Strategy& b) { return a == b; });
}

void bind_annotation_plan(py::module_& m) {
  py::class_<AnnotationPlan>(m, "AnnotationPlan", "Every tensor's annotation for a model on a world (docs/plan.md)")
      .def_static("from_json", [](const std::string& text) { return plan_from_json(parse(text, "plan")); },
                  py::arg("text"))
      .def_static("load", &load_plan, py::arg("path"))
      .def("to_json", [](const AnnotationPlan& p) { return to_json(p).dump(); })
      .def_readonly("world_size", &AnnotationPlan::world_size)
      .def_readonly("model", &AnnotationPlan::model)
      .def_readonly("tensors", &AnnotationPlan::tensors)
      .def_readonly("optimizer_states", &AnnotationPlan::optimizer_states)
      .def_readonly("strategy", &AnnotationPlan::strategy);
  m.def(
      "compile_plan",
      [](const ModelConfig& config, const Strategy& strategy, const py::object& world, const py::object& seq_len,
         const std::string& precision, const std::string& grad_reduce) {
        // The integers through the one range check (as `plan compile --world/--seq-len`), with the GIL.
        const int n = static_cast<int>(int_arg(world, "[python] compile_plan: world", {1, kMaxWorldSize}));
        CompileOptions co;
        co.seq_len = int_arg(seq_len, "[python] compile_plan: seq_len", kNonNegativeInt);  // 0: the model's
        co.precision.compute = parse_precision_name(precision, "precision");
        co.precision.grad_reduce = parse_precision_name(grad_reduce, "grad_reduce_dtype");
        py::gil_scoped_release release;
        return compile_plan(config, strategy, n, co);
      },
      py::arg("config"), py::arg("strategy"), py::arg("world_size"), py::arg("seq_len") = 0,
      py::arg("precision") = "fp32", py::arg("grad_reduce_dtype") = "fp32");
  m.def(
      "plan_cli",
      [](const std::vector<std::string>& args) {
        py::gil_scoped_release release;
        return capture_stdout([&] { cli::plan_command(args); });
      },
      py::arg("args"), "Runs `hspmd plan ARGS...` in this process and returns what it prints");
}

}  // namespace

void bind_plan(py::module_& m) {
  bind_config(m);
  bind_strategy(m);
  bind_annotation_plan(m);
}

}  // namespace hspmd::python
