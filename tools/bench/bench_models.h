#pragma once
// The models the benchmarks train, and the file that both the C++ and the Python side read their
// weights and data from.
//
//   TinyNet: 100 blocks x + tanh(Linear(8, 8)(x)), each block its own unit (an overhead-bound
//            model: 72 parameters per unit). The root holds no parameters.
//   GPT:     //examples:gpt_model (compute-bound), each block a unit, the root holding the
//            embeddings (the token embedding tied to the output layer) and the final LayerNorm.
//
// The init file (written by `fsdp_bench --write-init FILE`, read by both sides) is a dict of named
// tensors saved with torch::pickle_save, which Python reads with torch.load:
//   tiny.config  int64 [dim, depth, batch]          tiny.<fqn>  parameters
//   tiny.x, tiny.y  float32 [ranks, batches, batch, dim]
//   gpt.config   int64 [vocab, context, d_model, heads, layers, mlp_ratio, batch]
//   gpt.<fqn>    parameters       gpt.tokens  int64 [ranks, batches, batch, context + 1]

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "fsdp_cpp/contract/hookable_module_holder.h"
#include "fsdp_cpp/contract/hookable_module_list.h"
#include "fsdp_cpp/contract/hookable_modules.h"
#include "fsdp_cpp/examples/gpt_model.h"

namespace fsdp::bench {

/// x + tanh(fc(x))
struct TinyBlockImpl : torch::nn::Module {
  explicit TinyBlockImpl(int64_t dim);
  at::Tensor forward(at::Tensor x);
  contract::Linear fc{nullptr};
};
FSDP_HOOKABLE_MODULE(TinyBlock);

/// `depth` TinyBlocks in a row.
struct TinyNetImpl : torch::nn::Module {
  TinyNetImpl(int64_t dim, int64_t depth);
  at::Tensor forward(at::Tensor x);
  std::vector<TinyBlock> block_list() const { return blocks->holders<TinyBlock>(); }
  contract::ModuleList blocks{nullptr};
};
FSDP_HOOKABLE_MODULE(TinyNet);

/// Named tensors of the init file.
using TensorMap = std::map<std::string, at::Tensor>;

void save_tensor_file(const std::string& path, const TensorMap& tensors);
TensorMap load_tensor_file(const std::string& path);

/// Copies `tensors[prefix + fqn]` into every parameter of `module` (all must be there, with the
/// parameter's shape and dtype).
void load_parameters(torch::nn::Module& module, const TensorMap& tensors, const std::string& prefix);

/// Adds every parameter of `module` to `tensors` as `prefix + fqn` (cloned).
void store_parameters(const torch::nn::Module& module, TensorMap& tensors, const std::string& prefix);

}  // namespace fsdp::bench
