#include "hspmd/graph/sym.h"

#include <algorithm>
#include <sstream>

#include "hspmd/core/error.h"

namespace hspmd {

SymDim SymDim::symbol(const std::string& name) {
  SymDim d(1);
  d.syms_.push_back(name);
  return d;
}

int64_t SymDim::value() const {
  HSPMD_CHECK(is_const(), "dim ", str(), " is symbolic");
  return coeff_;
}

const std::string& SymDim::symbol_name() const {
  HSPMD_CHECK(is_symbol(), "dim ", str(), " is not a lone symbol");
  return syms_[0];
}

int64_t SymDim::eval(const Bindings& bindings) const {
  int64_t v = coeff_;
  for (const auto& s : syms_) {
    auto it = bindings.find(s);
    if (it == bindings.end()) fail("[shape] symbol '", s, "' is not bound");
    v *= it->second;
  }
  return v;
}

SymDim SymDim::operator*(const SymDim& other) const {
  SymDim d(coeff_ * other.coeff_);
  d.syms_ = syms_;
  d.syms_.insert(d.syms_.end(), other.syms_.begin(), other.syms_.end());
  std::sort(d.syms_.begin(), d.syms_.end());
  return d;
}

SymDim SymDim::divide(const SymDim& other) const {
  if (other.coeff_ == 0 || coeff_ % other.coeff_ != 0)
    fail("[shape] ", str(), " is not divisible by ", other.str());
  SymDim d(coeff_ / other.coeff_);
  d.syms_ = syms_;
  for (const auto& s : other.syms_) {
    auto it = std::find(d.syms_.begin(), d.syms_.end(), s);
    if (it == d.syms_.end()) fail("[shape] ", str(), " is not divisible by ", other.str());
    d.syms_.erase(it);
  }
  return d;
}

std::string SymDim::str() const {
  if (syms_.empty()) return std::to_string(coeff_);
  std::ostringstream os;
  if (coeff_ != 1) os << coeff_ << "*";
  for (size_t i = 0; i < syms_.size(); ++i) os << (i ? "*" : "") << syms_[i];
  return os.str();
}

SymShape sym_shape(const Shape& shape) { return SymShape(shape.begin(), shape.end()); }

SymDim sym_numel(const SymShape& shape) {
  SymDim n(1);
  for (const auto& d : shape) n = n * d;
  return n;
}

Shape eval_shape(const SymShape& shape, const Bindings& bindings) {
  Shape out;
  out.reserve(shape.size());
  for (const auto& d : shape) out.push_back(d.eval(bindings));
  return out;
}

std::string sym_shape_str(const SymShape& shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i].str();
  os << "]";
  return os.str();
}

}  // namespace hspmd
