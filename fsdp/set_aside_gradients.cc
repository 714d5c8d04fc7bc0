#include "fsdp_cpp/fsdp/set_aside_gradients.h"

#include <c10/core/GradMode.h>

namespace fsdp {

void SetAsideGradients::set_aside(const at::Tensor& param) {
  saved_.emplace_back(param, param.grad());
  param.mutable_grad() = at::Tensor();
}

void SetAsideGradients::add_back() {
  for (auto& [param, saved] : saved_) {
    if (!saved.defined()) continue;
    at::Tensor& grad = param.mutable_grad();
    if (grad.defined()) {
      c10::NoGradGuard no_grad;
      grad.add_(saved);
    } else {
      grad = saved;
    }
  }
  saved_.clear();
}

void SetAsideGradients::restore() {
  for (auto& [param, saved] : saved_) param.mutable_grad() = saved;
  saved_.clear();
}

}  // namespace fsdp
