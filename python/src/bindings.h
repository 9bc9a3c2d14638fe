// The pieces of the Python module hspmd._core (docs/python.md), one function
// per area; module.cc calls them in order. JSON crosses the boundary as text
// (json.dumps / json.loads on the Python side).
#pragma once

#include <functional>
#include <string>

#include <pybind11/pybind11.h>

namespace hspmd::python {

namespace py = pybind11;

void bind_annotation(py::module_& m);  // DS, DeviceGroup, Annotation
void bind_plan(py::module_& m);        // ModelConfig, Strategy, AnnotationPlan, compile_plan, the plan CLI
void bind_train(py::module_& m);       // the world communicator, TrainOptions, TrainingRun

// What `fn` writes to the process's stdout (file descriptor 1), returned
// instead of printed: the CLI's commands print there. Rethrows fn's errors
// after restoring stdout.
std::string capture_stdout(const std::function<void()>& fn);

}  // namespace hspmd::python
