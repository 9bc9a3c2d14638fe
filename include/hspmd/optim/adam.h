// Adam and AdamW, with the update rules of torch.optim.Adam / AdamW.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>
#include <utility>

#include "hspmd/core/ndarray.h"

namespace hspmd {

struct AdamConfig {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.0;
  // true: AdamW (decay applied to the weight, p *= 1 - lr*wd);
  // false: Adam with L2 (wd*p added to the gradient).
  bool decoupled_weight_decay = true;
};

class Adam {
 public:
  explicit Adam(AdamConfig config);

  // Starts a new optimizer step (increments the bias-correction step count).
  void begin_step();
  int64_t step_count() const { return step_; }

  // Updates `param` (f32, contiguous) in place from `grad` (same shape) with
  // learning rate `lr`. `decay` says whether weight decay applies to this
  // tensor. Moments are created (zero) on first use, keyed by `name`.
  // Scalar factors (bias corrections, lr) are computed in double; the
  // element-wise update runs in f32 in torch's operation order. Throws
  // hspmd::InternalError when called before begin_step(), when param/grad are
  // not contiguous f32 of equal shape, or when `name` already has moments of
  // another shape.
  void update(const std::string& name, NDArray& param, const NDArray& grad, double lr,
              bool decay);
  // The same for several tensors of one weight-decay group in one kernel
  // call (one launch on a GPU; the same bits as update() on each). Each
  // entry: the moments' name, the parameter, its gradient (all on one device).
  // `grad_scale`: the gradient-norm clip's coefficient (clip_coefficient),
  // applied by the update's own pass as each gradient is read (the same bits
  // as scaling the gradients first; they are left as they are).
  struct Update {
    std::string name;
    NDArray* param = nullptr;
    const NDArray* grad = nullptr;
    // Optional: the parameter's bf16 compute copy, rewritten from the
    // updated values in the update's pass (kernels::AdamTensor::param_bf16).
    NDArray* param_bf16 = nullptr;
  };
  // `control` (optional): kernels::clip_control's array on the tensors'
  // device, read by the update as it runs (its coefficient instead of
  // `grad_scale`; no change at all on a step it marks non-finite).
  void update_group(const std::vector<Update>& tensors, double lr, bool decay, float grad_scale = 1.0f,
                    const NDArray* control = nullptr);

  // The moments of `name` move in and out of the optimizer (a training
  // state resharded to another plan, a checkpoint): import replaces them
  // (f32, contiguous, the parameter's shape; InternalError otherwise),
  // export removes and returns them ({} when `name` has none).
  void import_moments(const std::string& name, NDArray exp_avg, NDArray exp_avg_sq);
  std::pair<NDArray, NDArray> export_moments(const std::string& name);
  // The bias-correction step count (a resumed or switched run continues it).
  void set_step_count(int64_t step) { step_ = step; }

  // CUDA graphs (docs/cuda.md, "CUDA graphs"): with `on`, the factors that
  // change every step (the learning rate's and the bias corrections') reach
  // the update through a device array per weight-decay group, refreshed by a
  // copy from page-locked host memory queued before each update call. A
  // captured step records that copy, so a replay reads what
  // refresh_factors() last wrote. Off (the default): kernel arguments. The
  // same bits either way.
  void set_factors_on_device(bool on) { factors_on_device_ = on; }
  // Writes both groups' factors for step_count() and `lr` where the copies
  // above read them (before a replayed step, whose update_group is not
  // called).
  void refresh_factors(double lr);

  const std::map<std::string, NDArray>& exp_avg() const { return m_; }
  const std::map<std::string, NDArray>& exp_avg_sq() const { return v_; }
  const AdamConfig& config() const { return config_; }

 private:
  AdamConfig config_;
  int64_t step_ = 0;
  std::map<std::string, NDArray> m_;
  std::map<std::string, NDArray> v_;
  // set_factors_on_device: per weight-decay group, the device array and its
  // page-locked host source (3 floats).
  struct DeviceFactors {
    NDArray device;
    std::shared_ptr<float> host;
  };
  bool factors_on_device_ = false;
  DeviceFactors device_factors_[2];
};

}  // namespace hspmd
