#include "fsdp_cpp/fsdp/post_backward_function.h"

#include <cstdint>

#include <torch/csrc/autograd/custom_function.h>

namespace fsdp {
namespace {

struct RegisterPostBackward : torch::autograd::Function<RegisterPostBackward> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                int64_t callback, int64_t arg, int64_t tag,
                                                at::TensorList inputs) {
    ctx->saved_data["callback"] = callback;
    ctx->saved_data["arg"] = arg;
    ctx->saved_data["tag"] = tag;
    return inputs.vec();
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto callback = reinterpret_cast<PostBackwardCallback>(ctx->saved_data["callback"].toInt());
    callback(reinterpret_cast<void*>(ctx->saved_data["arg"].toInt()), ctx->saved_data["tag"].toInt());
    // The three leading non-tensor arguments get no gradient.
    torch::autograd::variable_list result(3);
    result.reserve(grads.size() + 3);
    for (auto& g : grads) result.push_back(std::move(g));
    return result;
  }
};

}  // namespace

std::vector<at::Tensor> register_post_backward(std::vector<at::Tensor> inputs,
                                               PostBackwardCallback callback, void* arg, int64_t tag) {
  // A TensorList (not a std::vector) so that autograd sees the tensors as differentiable inputs.
  return RegisterPostBackward::apply(reinterpret_cast<int64_t>(callback),
                                     reinterpret_cast<int64_t>(arg), tag, at::TensorList(inputs));
}

}  // namespace fsdp
