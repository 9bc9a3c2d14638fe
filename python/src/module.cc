// hspmd._core: the C++ half of the Python package hspmd (python/hspmd/).
// Every hspmd::Error raised in C++ arrives in Python as hspmd.Error with the
// same one-line message; internal invariant failures as hspmd.InternalError.
#include <cstring>

#include <nlohmann/json.hpp>
#include <pybind11/pybind11.h>

#include "bindings.h"
#include "hspmd/core/error.h"
#include "hspmd/core/options.h"

namespace py = pybind11;

namespace {

PyObject* error_type = nullptr;
PyObject* internal_error_type = nullptr;

// Raises `type` with `what`, its bytes decoded as UTF-8 with undecodable
// ones as \xNN escapes: a message that echoes a non-UTF-8 input (a JSON
// file in Latin-1) arrives whole, never as an empty message.
void raise(PyObject* type, const char* what) {
  PyObject* message = PyUnicode_DecodeUTF8(what, static_cast<Py_ssize_t>(std::strlen(what)), "backslashreplace");
  if (message == nullptr) {
    PyErr_Clear();
    message = PyUnicode_FromString("(the message could not be decoded)");
  }
  PyErr_SetObject(type, message);
  Py_XDECREF(message);
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "hspmd's C++ core (docs/python.md); use the package hspmd, not this module";
  // Errors name options by their keyword (seq_len), not the command line's flag (hspmd/core/options.h).
  hspmd::set_option_spelling(hspmd::OptionSpelling::kKeyword);
  // SetupFailure and the other Error subclasses are translated as their base.
  error_type = py::register_exception<hspmd::Error>(m, "Error", PyExc_RuntimeError).ptr();
  internal_error_type = py::register_exception<hspmd::InternalError>(m, "InternalError", PyExc_RuntimeError).ptr();
  // Registered last, so tried first: the same two types with messages that
  // survive any bytes, and a JSON-library error that escaped a parser as
  // hspmd.Error rather than a bare RuntimeError.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const hspmd::Error& e) {
      raise(error_type, e.what());
    } catch (const hspmd::InternalError& e) {
      raise(internal_error_type, e.what());
    } catch (const nlohmann::json::exception& e) {
      raise(error_type, (std::string("[json] ") + e.what()).c_str());
    }
  });
  hspmd::python::bind_annotation(m);
  hspmd::python::bind_plan(m);
  hspmd::python::bind_train(m);
}
