// Helpers of the deduction tests: small annotations, plans and error checks.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "hspmd/core/error.h"
#include "hspmd/deduce/deduce.h"
#include "hspmd/graph/graph.h"
#include "hspmd/graph/op.h"

namespace hspmd {

inline void PrintTo(const Annotation& a, std::ostream* os) { *os << to_string(a); }
inline void PrintTo(const DistStates& s, std::ostream* os) { *os << to_string(s); }

namespace deduce_test {


using Plan = std::map<std::string, Annotation>;
inline const SymDim B = SymDim::symbol("B"), S = SymDim::symbol("S");
inline constexpr int kP = kPartial;

// States with an explicit order.
inline DistStates ds(std::map<int, int> degrees, std::vector<int> order) {
  return DistStates{std::move(degrees), std::move(order)};
}

// One subgroup over `ranks`.
inline Annotation on(std::vector<int> ranks, std::map<int, int> degrees = {},
              std::vector<int> order = {}) {
  return Annotation{
      {Subgroup{DeviceGroup{std::move(ranks)}, ds(std::move(degrees), std::move(order))}}};
}

inline Subgroup sub(std::vector<int> ranks, std::map<int, int> degrees = {}, std::vector<int> order = {}) {
  return Subgroup{DeviceGroup{std::move(ranks)}, ds(std::move(degrees), std::move(order))};
}

inline Annotation hetero(std::vector<Subgroup> groups, int hdim, std::vector<int64_t> weights = {}) {
  return Annotation{std::move(groups), hdim, std::move(weights)};
}

// The message of the hspmd::Error `f` throws ("" when it throws none).
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Expects deduce() to throw one line containing every piece of `parts`.
inline void expect_error(const Graph& g, const Plan& plan, int world, std::vector<std::string> parts) {
  const std::string msg = error_of([&] { deduce(g, plan, world); });
  ASSERT_FALSE(msg.empty()) << "no error; expected " << parts[0];
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  for (const auto& p : parts)
    EXPECT_NE(msg.find(p), std::string::npos) << "missing '" << p << "' in: " << msg;
}

// The first node of `type` after node `after`.
inline const Node& find_node(const Graph& g, const std::string& type, int after = -1) {
  for (int id = after + 1; id < g.num_nodes(); ++id)
    if (g.node(id).op->type() == type) return g.node(id);
  throw std::runtime_error("no node of type " + type);
}

}  // namespace deduce_test
}  // namespace hspmd
