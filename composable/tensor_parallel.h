#pragma once
// parallelize_module: tensor parallelism for LibTorch modules (PyTorch's
// torch.distributed.tensor.parallel.parallelize_module, Megatron's column/row-parallel layers).
//
//   auto mesh = fsdp::comm::DeviceMesh::create(*pg.comm, {2, 2}, {"dp", "tp"});
//   fsdp::parallelize_module(*model, mesh->group("tp"), {
//       {"blocks.*.attn.qkv", fsdp::ColwiseParallel().chunks(3)},     // fused [q; k; v]
//       {"blocks.*.attn.proj", fsdp::RowwiseParallel()},
//       {"blocks.*.mlp.fc", fsdp::ColwiseParallel()},
//       {"blocks.*.mlp.proj", fsdp::RowwiseParallel()},
//   });
//   for (auto& block : model->block_list())
//     fsdp::fully_shard(block, fsdp::FullyShardOptions().communicator(mesh->group("dp")));
//   fsdp::fully_shard(model, fsdp::FullyShardOptions().communicator(mesh->group("dp")));
//
// Each plan entry maps module FQNs (relative to `module`; `*` matches one FQN component, e.g.
// `blocks.*.attn.qkv`) to a style. Parameters are replaced by this rank's piece in place: the
// same tensor objects (the optimizer's, after or before the call), the same FQNs, the same module
// tree; each piece's placement is queryable (composable/tensor_placement.h). The modules run
// their own forward on the pieces; the styles add the collectives around it as autograd
// functions ([Note: tensor-parallel gradients] in composable/tp_collectives.h), through forward
// wrappers (contract/forward_hooks.h), so modules must be called through hook-able holders.
//
// Layouts of activations: Replicate (every rank holds the whole tensor) or Shard(d) (rank r holds
// piece r of dimension d; the sequence dimension, 1, for sequence parallelism). The styles:
//  - ColwiseParallel (Linear: weight and bias split along the output features, `chunks` equal
//    blocks each split, for fused projections; Embedding: the embedding dimension). Input
//    Replicate (default; its gradient is summed over the group) or Shard(d) (all-gathered,
//    gradient reduce-scattered); output Shard(-1) (default, the local columns) or Replicate
//    (all-gathered).
//  - RowwiseParallel (Linear: weight split along the input features, bias whole and added after
//    the reduction; Embedding: the vocabulary, ids outside a rank's rows give zeros). Input
//    Shard(-1) (default) or Replicate (this rank's piece taken); output Replicate (default:
//    all-reduced) or Shard(d) (reduce-scattered, sequence parallelism).
//  - SequenceParallel (LayerNorm, a module implementing PerPositionModule such as an RMSNorm,
//    Dropout, any module without parameters acting per position): input and output
//    Shard(sequence_dim) (a Replicate input is split first); its parameters stay whole and their
//    gradients are summed over the group (each rank saw only its positions).
//  - PrepareModuleInput / PrepareModuleOutput: redistribute a module's first tensor argument or
//    its tensor output between layouts (Shard(d) -> Replicate all-gathers, Replicate -> Shard(d)
//    takes the local piece).
// Loss parallel is vocab_parallel_cross_entropy (composable/loss_parallel.h) on a
// column-parallel head's Shard(-1) logits.
//
// Order and composition: parallelize_module before fully_shard (fully_shard then flattens the
// pieces and shards them over the data-parallel group), once per module (a second call on a
// placed module is refused). Works on a model built under MetaInitGuard: a meta parameter stays
// meta with its local shape, and fully_shard materializes only this rank's slice of it.
// Activation checkpointing composes when applied to a module around the parallelized ones (a
// block), not to a parallelized module itself.
//
// A style whose input is Replicate compares a checksum of its input over the group at the
// module's first call (every call with FSDP_DEBUG=1): ranks of a tp group given different data
// (seeded by world rank rather than data-parallel rank) are refused on every rank, naming the
// module ([Note: replicated inputs] in tensor_parallel.cc).
//
// Bad input (a plan entry matching no module, a style on a module type it does not support, a
// dimension the group size does not divide, a module already parallelized or managed by
// fully_shard) is refused before anything changes, with an error naming parallelize_module, the
// FQN, what was expected and what was found. Each rank validates its own model first; the ranks of
// the group then agree (comm/agreement.h, [Note: tensor-parallel agreement] in
// tensor_parallel.cc), so a rank whose model or plan differs (a module it lacks, another shape)
// makes every rank of the group throw the same error, naming that rank, and no rank changes
// anything.
//
// A parallelized module must be called through its hook-able holder (`fc(x)`, not
// `fc->forward(x)`): LibTorch offers no way to refuse the bypassed call itself, so it is refused at
// the first backward pass that reaches the module's parameters while the module has never been
// called through its holder with gradients on (a c10::Error naming parallelize_module, the FQN and
// the holder). A bypass under no-grad, or after the module was called through its holder once, is
// not detected ([Note: bypassed tensor-parallel modules] in tensor_parallel.cc).

#include <memory>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/comm/device_mesh.h"
#include "fsdp_cpp/composable/api_names.h"  // kTensorParallelApi

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace fsdp {

/// How an activation is laid out over the tensor-parallel group.
struct Layout {
  static Layout replicate() { return Layout{false, 0}; }
  static Layout shard(int64_t dim) { return Layout{true, dim}; }
  bool is_shard = false;
  int64_t dim = 0;
  bool operator==(const Layout&) const = default;
  std::string describe() const;
};

struct ColwiseParallel {
  TORCH_ARG(Layout, input_layout) = Layout::replicate();
  TORCH_ARG(Layout, output_layout) = Layout::shard(-1);
  /// Equal blocks of the output features split each (3 for a fused [q; k; v] projection).
  TORCH_ARG(int64_t, chunks) = 1;
};

struct RowwiseParallel {
  TORCH_ARG(Layout, input_layout) = Layout::shard(-1);
  TORCH_ARG(Layout, output_layout) = Layout::replicate();
};

struct SequenceParallel {
  TORCH_ARG(int64_t, sequence_dim) = 1;
  /// Replicate: the input is whole on every rank and this rank's positions are taken first.
  TORCH_ARG(Layout, input_layout) = Layout::shard(1);
};

struct PrepareModuleInput {
  TORCH_ARG(Layout, input_layout) = Layout::shard(1);
  TORCH_ARG(Layout, desired_input_layout) = Layout::replicate();
};

struct PrepareModuleOutput {
  TORCH_ARG(Layout, output_layout) = Layout::replicate();
  TORCH_ARG(Layout, desired_output_layout) = Layout::shard(1);
};

using ParallelStyle =
    std::variant<ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput, PrepareModuleOutput>;

/// A module with parameters that acts on each position alone (a norm), so that SequenceParallel
/// can run it on this rank's positions: it names the members its forward reads its parameters
/// from, and SequenceParallel gives the forward, in their place, views whose gradient is summed
/// over the tp group (the parameters stay whole on every rank).
///
///   struct RMSNormImpl : torch::nn::Module, fsdp::PerPositionModule {
///     std::vector<at::Tensor*> per_position_parameters() override { return {&weight}; }
///     at::Tensor weight;
///   };
class PerPositionModule {
 public:
  virtual ~PerPositionModule() = default;
  virtual std::vector<at::Tensor*> per_position_parameters() = 0;
};

/// Plan entries in order: (FQN pattern, style). A module matched by several entries gets each
/// style in plan order (e.g. PrepareModuleInput and SequenceParallel), but at most one of the
/// parameter-placing styles (Colwise, Rowwise, SequenceParallel).
using TensorParallelPlan = std::vector<std::pair<std::string, ParallelStyle>>;

/// Applies `plan` to the modules under `module` over `group` (see the top of this file). A
/// collective only in that nothing communicates: every rank of the group must apply the same plan
/// to the same model (checked: the plan's matches are compared across the group).
void parallelize_module(torch::nn::Module& module, const std::shared_ptr<comm::Communicator>& group,
                        const TensorParallelPlan& plan);

/// The same over the group of the mesh dimension `mesh_dim` (placements name it).
void parallelize_module(torch::nn::Module& module, const comm::DeviceMesh& mesh, const std::string& mesh_dim,
                        const TensorParallelPlan& plan);

/// The modules under `module` (FQNs relative to it) that `pattern` matches (`*` = one component).
std::vector<std::string> match_modules(torch::nn::Module& module, const std::string& pattern);

/// Whether parallelize_module placed `module`'s parameters or wrapped its forward.
bool is_tensor_parallel(const torch::nn::Module& module);

}  // namespace fsdp
