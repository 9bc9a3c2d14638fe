#include "hspmd/optim/adam.h"

#include <cmath>

#include "hspmd/core/error.h"
#include "kernels/memory.h"

namespace hspmd {

namespace {

// Returns the moment buffer for `name`, zero-created on first use.
NDArray& moment(std::map<std::string, NDArray>& moments, const std::string& name,
                const Shape& shape, Device device) {
  auto it = moments.find(name);
  if (it == moments.end())
    it = moments.emplace(name, kernels::zeros(default_stream(device), shape, DType::F32)).first;
  HSPMD_CHECK(it->second.shape() == shape, "optimizer state '", name, "' has shape ",
              shape_str(it->second.shape()), " but the parameter has ", shape_str(shape));
  return it->second;
}

// Scalar factors of one step, computed in double then narrowed once.
kernels::AdamFactors step_factors(const AdamConfig& c, int64_t step, double lr, bool decay) {
  const double wd = decay ? c.weight_decay : 0.0;
  const double bc1 = 1.0 - std::pow(c.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(c.beta2, static_cast<double>(step));
  kernels::AdamFactors f;
  f.beta1 = static_cast<float>(c.beta1);
  f.beta2 = static_cast<float>(c.beta2);
  f.eps = static_cast<float>(c.eps);
  f.one_minus_beta1 = static_cast<float>(1.0 - c.beta1);
  f.one_minus_beta2 = static_cast<float>(1.0 - c.beta2);
  f.l2 = c.decoupled_weight_decay ? 0.0f : static_cast<float>(wd);
  f.decay_scale = c.decoupled_weight_decay ? static_cast<float>(1.0 - lr * wd) : 1.0f;
  f.sqrt_bc2 = static_cast<float>(std::sqrt(bc2));
  f.step_size = static_cast<float>(lr / bc1);
  return f;
}

// AdamFactors::step's three values.
void write_factors(float* out, const kernels::AdamFactors& f) {
  out[0] = f.decay_scale;
  out[1] = f.sqrt_bc2;
  out[2] = f.step_size;
}

}  // namespace

Adam::Adam(AdamConfig config) : config_(config) {}

void Adam::begin_step() { ++step_; }

void Adam::update(const std::string& name, NDArray& param, const NDArray& grad, double lr,
                  bool decay) {
  update_group({{name, &param, &grad}}, lr, decay);
}

void Adam::update_group(const std::vector<Update>& tensors, double lr, bool decay, float grad_scale,
                        const NDArray* control) {
  if (tensors.empty()) return;
  std::vector<kernels::AdamTensor> group;
  for (const Update& u : tensors) {
    const std::string& name = u.name;
    const NDArray& param = *u.param;
    const NDArray& grad = *u.grad;
    HSPMD_CHECK(step_ > 0, "Adam::update('", name, "') before begin_step()");
    HSPMD_CHECK(param.dtype() == DType::F32 && grad.dtype() == DType::F32,
                "Adam::update('", name, "') needs f32 param and grad");
    HSPMD_CHECK(param.is_contiguous() && grad.is_contiguous(), "Adam::update('", name,
                "') needs contiguous param and grad");
    HSPMD_CHECK(param.shape() == grad.shape(), "Adam::update('", name, "'): param ",
                shape_str(param.shape()), " vs grad ", shape_str(grad.shape()));
    HSPMD_CHECK(param.device() == tensors[0].param->device(), "Adam::update_group: tensors on several devices");
    NDArray& m = moment(m_, name, param.shape(), param.device());
    NDArray& v = moment(v_, name, param.shape(), param.device());
    group.push_back({u.param, u.grad, &m, &v, u.param_bf16});
  }
  kernels::AdamFactors f = step_factors(config_, step_, lr, decay);
  f.grad_scale = grad_scale;
  f.control = control;
  Stream& stream = default_stream(tensors[0].param->device());
  if (factors_on_device_) {
    DeviceFactors& d = device_factors_[decay ? 1 : 0];
    if (!d.device.valid() || d.device.device() != stream.device()) {
      Allocator& staging = staging_host_allocator();
      d.host = std::shared_ptr<float>(static_cast<float*>(staging.allocate(3 * sizeof(float))),
                                      [&staging](float* p) { staging.deallocate(p, 3 * sizeof(float)); });
      d.device = NDArray::empty({3}, DType::F32, stream.device());
    }
    write_factors(d.host.get(), f);
    kernels::copy_from_host(stream, d.host.get(), d.device);
    f.step = &d.device;
  }
  kernels::adam_step(stream, group, f);
}

void Adam::refresh_factors(double lr) {
  for (int decay : {0, 1})
    if (device_factors_[decay].host != nullptr)
      write_factors(device_factors_[decay].host.get(), step_factors(config_, step_, lr, decay == 1));
}

void Adam::import_moments(const std::string& name, NDArray exp_avg, NDArray exp_avg_sq) {
  for (const NDArray* a : {&exp_avg, &exp_avg_sq})
    HSPMD_CHECK(a->dtype() == DType::F32 && a->is_contiguous(), "Adam::import_moments('", name,
                "') needs contiguous f32 moments");
  HSPMD_CHECK(exp_avg.shape() == exp_avg_sq.shape(), "Adam::import_moments('", name, "'): shapes differ");
  m_[name] = std::move(exp_avg);
  v_[name] = std::move(exp_avg_sq);
}

std::pair<NDArray, NDArray> Adam::export_moments(const std::string& name) {
  auto m = m_.find(name);
  auto v = v_.find(name);
  if (m == m_.end() || v == v_.end()) return {};
  std::pair<NDArray, NDArray> out{std::move(m->second), std::move(v->second)};
  m_.erase(m);
  v_.erase(v);
  return out;
}

}  // namespace hspmd
