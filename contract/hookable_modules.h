#pragma once

// Hook-able holders for the LibTorch modules that are typical FSDP units. Each wraps LibTorch's
// own Impl (torch::nn::LinearImpl, ...), so parameters, options and FQNs are LibTorch's; only
// the call operator differs: it runs the forward hooks ([Note: forward hooks]).

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "fsdp_cpp/contract/hookable_module_holder.h"

namespace fsdp::contract {

/// Hook-able holder of torch::nn::LinearImpl.
///
///   fsdp::contract::Linear fc(torch::nn::LinearOptions(4, 8).bias(false));
///   torch::Tensor y = fc(x);
FSDP_HOOKABLE_MODULE_IMPL(Linear, torch::nn::LinearImpl);

/// Hook-able holder of torch::nn::LayerNormImpl.
///
///   fsdp::contract::LayerNorm norm(torch::nn::LayerNormOptions({8}));
FSDP_HOOKABLE_MODULE_IMPL(LayerNorm, torch::nn::LayerNormImpl);

/// Hook-able holder of torch::nn::Conv2dImpl.
///
///   fsdp::contract::Conv2d conv(torch::nn::Conv2dOptions(3, 8, 3).padding(1));
FSDP_HOOKABLE_MODULE_IMPL(Conv2d, torch::nn::Conv2dImpl);

/// Hook-able holder of torch::nn::MultiheadAttentionImpl. Its forward returns a tuple
/// (output, attention weights); hooks see the arguments the caller passed (defaults are not
/// added) and the tuple as the output. MultiheadAttentionImpl reads `out_proj->weight` directly
/// rather than calling `out_proj`, so hooks on `out_proj` never run: shard the attention module
/// as one unit.
///
///   fsdp::contract::MultiheadAttention attn(16, 4);
///   auto [out, weights] = attn(q, k, v);
FSDP_HOOKABLE_MODULE_IMPL(MultiheadAttention, torch::nn::MultiheadAttentionImpl);

/// Hook-able holder of torch::nn::EmbeddingImpl, with LibTorch's `from_pretrained`.
///
///   fsdp::contract::Embedding embed(torch::nn::EmbeddingOptions(100, 16));
///   auto frozen = fsdp::contract::Embedding::from_pretrained(weights);
class Embedding : public HookableModuleHolder<torch::nn::EmbeddingImpl> {
 public:
  using HookableModuleHolder<torch::nn::EmbeddingImpl>::HookableModuleHolder;
  using Impl TORCH_UNUSED_EXCEPT_CUDA = torch::nn::EmbeddingImpl;

  /// See torch::nn::Embedding::from_pretrained.
  static Embedding from_pretrained(const torch::Tensor& embeddings,
                                   const torch::nn::EmbeddingFromPretrainedOptions& options = {}) {
    return Embedding(torch::nn::Embedding::from_pretrained(embeddings, options).ptr());
  }
};

}  // namespace fsdp::contract
