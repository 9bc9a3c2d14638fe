// hspmd._core: the C++ half of the Python package hspmd (python/hspmd/).
// Every hspmd::Error raised in C++ arrives in Python as hspmd.Error with the
// same one-line message; internal invariant failures as hspmd.InternalError.
#include <pybind11/pybind11.h>

#include "bindings.h"
#include "hspmd/core/error.h"

namespace py = pybind11;

PYBIND11_MODULE(_core, m) {
  m.doc() = "hspmd's C++ core (docs/python.md); use the package hspmd, not this module";
  // SetupFailure and the other Error subclasses are translated as their base.
  py::register_exception<hspmd::Error>(m, "Error", PyExc_RuntimeError);
  py::register_exception<hspmd::InternalError>(m, "InternalError", PyExc_RuntimeError);
  hspmd::python::bind_annotation(m);
  hspmd::python::bind_plan(m);
  hspmd::python::bind_train(m);
}
