#include "fsdp_cpp/fsdp/hidden_params.h"

#include <algorithm>

#include <ATen/ops/empty.h>

namespace fsdp {

bool HiddenParams::hides(const at::Tensor& param) const {
  return std::any_of(hidden_.begin(), hidden_.end(), [&](const Hidden& h) { return h.param.is_same(param); });
}

void HiddenParams::hide(const at::Tensor& param) {
  if (hides(param)) return;
  at::Tensor placeholder = at::empty({0}, param.options());
  hidden_.push_back({param, param.data(), placeholder});
  param.set_data(placeholder);  // the parameter's TensorImpl: every holder of it sees the placeholder
}

void HiddenParams::show_all() {
  for (auto& h : hidden_) {
    if (h.param.is_alias_of(h.placeholder)) h.param.set_data(h.data);
  }
  hidden_.clear();
}

}  // namespace fsdp
