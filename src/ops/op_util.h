// Helpers shared by op files: checks of the shape rules with one-line errors,
// and label lists for the deduction rules (DimRule, hspmd/deduce/deduce.h).
#pragma once

#include <string>
#include <vector>

#include "hspmd/core/error.h"
#include "hspmd/deduce/deduce.h"
#include "hspmd/graph/op.h"

namespace hspmd::ops {

// Throws "[op] expected N inputs" unless inputs.size() == n.
inline void expect_inputs(const std::string& op, const std::vector<TensorMeta>& in, size_t n) {
  if (in.size() != n) fail("[", op, "] expected ", n, " inputs, got ", in.size());
}

inline void expect_dtype(const std::string& op, const char* what, const TensorMeta& m, DType t) {
  if (m.dtype != t)
    fail("[", op, "] ", what, " must be ", dtype_name(t), ", got ", dtype_name(m.dtype));
}

inline void expect_same_shape(const std::string& op, const TensorMeta& a, const TensorMeta& b) {
  if (a.shape != b.shape)
    fail("[", op, "] shapes differ: ", sym_shape_str(a.shape), " vs ", sym_shape_str(b.shape));
}

// Normalizes a possibly negative axis for a tensor of rank `ndim`.
inline int norm_axis(const std::string& op, int axis, int ndim) {
  int a = axis < 0 ? axis + ndim : axis;
  if (a < 0 || a >= ndim) fail("[", op, "] axis ", axis, " out of range for rank ", ndim);
  return a;
}

// `labels` followed by `more` (e.g. token labels + the hidden dim's label).
inline std::vector<std::string> labels_plus(std::vector<std::string> labels,
                                            const std::vector<std::string>& more) {
  labels.insert(labels.end(), more.begin(), more.end());
  return labels;
}

// Marks every label of `labels` as summed over when an output lacks it.
inline void sum_over(DimRule& rule, const std::vector<std::string>& labels) {
  for (const auto& l : labels) rule.reductions[l] = Reduction::kSum;
}

}  // namespace hspmd::ops
