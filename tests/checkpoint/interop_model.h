#pragma once
// The model the checkpoint interoperability tests build on both sides: this one in C++, and
// tests/python/interop_model.py in Python (PyTorch's FSDP2), with the same FQNs and shapes:
//   emb.weight [10, 13], w1.weight [24, 13], w1.bias [24], w2.weight [7, 24], w2.bias [7],
//   norm.weight [7], norm.bias [7];  forward(idx) = norm(w2(relu(w1(emb(idx))))).

#include <torch/nn/module.h>
#include <torch/nn/functional/activation.h>

#include "fsdp_cpp/contract/hookable_module_holder.h"
#include "fsdp_cpp/contract/hookable_modules.h"

namespace fsdp::testing {

struct InteropModelImpl : torch::nn::Module {
  InteropModelImpl() {
    emb = register_module("emb", contract::Embedding(10, 13));
    w1 = register_module("w1", contract::Linear(13, 24));
    w2 = register_module("w2", contract::Linear(24, 7));
    norm = register_module("norm", contract::LayerNorm(torch::nn::LayerNormOptions({7})));
  }
  torch::Tensor forward(torch::Tensor idx) { return norm(w2(torch::relu(w1(emb(idx))))); }
  contract::Embedding emb{nullptr};
  contract::Linear w1{nullptr}, w2{nullptr};
  contract::LayerNorm norm{nullptr};
};
FSDP_HOOKABLE_MODULE(InteropModel);

}  // namespace fsdp::testing
