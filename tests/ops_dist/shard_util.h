// Helpers for the vocab-parallel op tests: build local slices of global
// arrays and run one op node's compute() with a hand-made ShardContext, the
// way the distributed executor does.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "hspmd/annotation/annotation.h"
#include "hspmd/graph/graph.h"
#include "hspmd/graph/op.h"

namespace hspmd::testing {

// Runs node.op->compute() on `inputs`, outputs allocated with `out_shapes`.
inline std::vector<NDArray> run_op(const Node& node, const std::vector<NDArray>& inputs,
                                   const std::vector<Shape>& out_shapes,
                                   const ShardContext* shard = nullptr) {
  OpContext ctx;
  ctx.stream = &default_stream(Device::cpu());
  ctx.out_shapes = out_shapes;
  for (const TensorMeta& m : node.outputs) ctx.out_dtypes.push_back(m.dtype);
  ctx.device = Device::cpu();
  ctx.shard = shard;
  std::vector<NDArray> out(out_shapes.size());
  node.op->compute(ctx, inputs, out);
  return out;
}

// The whole index space of `shape`.
inline Box whole(const Shape& shape) { return Box{Shape(shape.size(), 0), shape}; }

// `box` with dim d cut to equal chunk i of n.
inline Box cut(Box box, int d, int i, int n) {
  const int64_t size = (box.end[d] - box.begin[d]) / n, begin = box.begin[d];
  box.begin[d] = begin + i * size;
  box.end[d] = begin + (i + 1) * size;
  return box;
}

// A contiguous copy of a[box].
inline NDArray take(const NDArray& a, const Box& box) { return box_slice(a, box); }

// Elementwise |got - want| <= abs + rel * |want|.
inline void expect_close(const NDArray& got, const NDArray& want, double rel, double abs) {
  ASSERT_EQ(got.shape(), want.shape());
  const std::vector<float> g = got.to_vector(), w = want.to_vector();
  for (size_t i = 0; i < g.size(); ++i)
    ASSERT_LE(std::abs(g[i] - w[i]), abs + rel * std::abs(w[i])) << "element " << i;
}

inline void expect_equal(const NDArray& got, const NDArray& want) {
  ASSERT_EQ(got.shape(), want.shape());
  EXPECT_EQ(got.to_vector(), want.to_vector());
}

}  // namespace hspmd::testing
