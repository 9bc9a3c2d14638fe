// An integer argument from Python through the one integer-range check
// (hspmd/core/int_range.h), as the CLI's flags go through it: a value that
// does not fit is refused with hspmd.Error naming the argument and the range,
// never cut to 32 bits nor left to pybind11's cast ("incompatible function
// arguments").
#pragma once

#include <string>

#include <pybind11/pybind11.h>

#include "hspmd/core/error.h"
#include "hspmd/core/int_range.h"

namespace hspmd::python {

// `value` (a Python int, or anything with __index__, such as a NumPy integer;
// not a bool or a float) as an integer in `range`. Throws hspmd::Error
// "<what> must be an integer, got <type> <repr>" or "<what> <value> is
// outside [lo, hi]". Needs the GIL.
inline int64_t int_arg(const pybind11::handle& value, const std::string& what, const IntRange& range) {
  namespace py = pybind11;
  PyObject* v = value.ptr();
  if (PyBool_Check(v) || !PyIndex_Check(v))
    fail(what, " must be an integer, got ", std::string(py::str(py::type::handle_of(value).attr("__name__"))), " ",
         std::string(py::repr(value)));
  const py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(v));
  if (!index) throw py::error_already_set();
  int overflow = 0;
  const long long x = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (overflow != 0) fail_int_range(what, std::string(py::str(index)), range);
  if (x == -1 && PyErr_Occurred()) throw py::error_already_set();
  return check_int_range(what, x, range);
}

}  // namespace hspmd::python
