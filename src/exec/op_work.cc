#include "hspmd/exec/op_work.h"

#include <algorithm>

#include "hspmd/core/error.h"

namespace hspmd {

OpWork op_work(const Node& node, const std::vector<Shape>& inputs, const std::vector<Shape>& outputs,
               const ShardContext* shard) {
  OpWork w;
  w.flops = node.op->flops(inputs, outputs, shard);
  for (const auto* list : {&inputs, &outputs})
    for (const Shape& s : *list) w.elements += static_cast<double>(shape_numel(s));
  return w;
}

OpWork op_work(const Node& node, const std::vector<NDArray>& inputs, const std::vector<NDArray>& outputs,
               const ShardContext* shard) {
  auto shapes = [](const std::vector<NDArray>& arrays) {
    std::vector<Shape> out;
    for (const NDArray& a : arrays) out.push_back(a.valid() ? a.shape() : Shape{0});
    return out;
  };
  const std::vector<Shape> out_shapes = shapes(outputs);
  OpWork w;
  w.flops = node.op->flops_on(inputs, out_shapes, shard);
  for (const auto* list : {&inputs, &outputs})
    for (const NDArray& a : *list) w.elements += a.valid() ? static_cast<double>(a.numel()) : 0.0;
  return w;
}

OpTimeModel::OpTimeModel(std::map<std::string, OpFit> fits, const std::string& source)
    : fits_(std::move(fits)), source_(source) {
  if (fits_.empty())
    fail("[profile] ", source_, ": no per-op fits (\"ops\"); make the profile with `hspmd profile`");
}

double OpTimeModel::seconds(const std::string& type, const OpWork& work) const {
  auto it = fits_.find(type);
  if (it == fits_.end()) it = fits_.find(kAnyOp);
  if (it == fits_.end())
    fail("[profile] ", source_, ": no fit for op type '", type, "' and no '", kAnyOp, "' fallback");
  return std::max(0.0, it->second.at(work.flops, work.elements));
}

}  // namespace hspmd
