// Symbolic dimensions.
//
// A SymDim is a monomial: an integer coefficient times a product of named
// symbols, e.g. 4, B, or B*S. Data-dependent sizes (batch, sequence length)
// are symbols in the defined graph and bound to numbers per run (per
// micro-batch), so one graph serves every input size.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "hspmd/core/ndarray.h"

namespace hspmd {

using Bindings = std::map<std::string, int64_t>;

class SymDim {
 public:
  SymDim(int64_t value = 0) : coeff_(value) {}  // NOLINT: constants convert implicitly
  static SymDim symbol(const std::string& name);

  bool is_const() const { return syms_.empty(); }
  // The constant value; throws InternalError when symbolic.
  int64_t value() const;
  // A symbol alone with coefficient 1 (bindable from a concrete size).
  bool is_symbol() const { return coeff_ == 1 && syms_.size() == 1; }
  const std::string& symbol_name() const;
  // The value under `bindings`; throws hspmd::Error naming an unbound symbol.
  int64_t eval(const Bindings& bindings) const;

  SymDim operator*(const SymDim& other) const;
  // Exact division by a constant or a sub-monomial; throws hspmd::Error when
  // the result would not be a monomial with integer coefficient.
  SymDim divide(const SymDim& other) const;
  bool operator==(const SymDim& other) const {
    return coeff_ == other.coeff_ && syms_ == other.syms_;
  }
  std::string str() const;

 private:
  int64_t coeff_ = 0;
  std::vector<std::string> syms_;  // sorted
};

using SymShape = std::vector<SymDim>;

SymShape sym_shape(const Shape& shape);
SymDim sym_numel(const SymShape& shape);
Shape eval_shape(const SymShape& shape, const Bindings& bindings);
std::string sym_shape_str(const SymShape& shape);

}  // namespace hspmd
