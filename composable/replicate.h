#pragma once
// replicate: data parallelism without sharding as a composable API (PyTorch's composable
// `replicate`, DDP semantics).
//
//   auto pg = fsdp::comm::init_process_group();
//   fsdp::replicate(model);                                   // a hook-able holder
//   torch::optim::AdamW optim(model->parameters(), 1e-3);
//   for (...) {
//     auto loss = model(x).pow(2).mean();   // each rank its own batch
//     loss.backward();                      // gradients averaged over the ranks, in buckets
//     optim.step();
//     optim.zero_grad();
//   }
//
// Every rank keeps the whole model. Backward all-reduces the gradients of the module's trainable
// parameters in buckets (about `bucket_cap_mb` each, per dtype and device, parameters in reverse
// registration order as DDP does), each bucket as soon as its last gradient is ready, so
// communication overlaps the rest of backward; the end of backward writes the averages into
// `.grad`. The module tree, its FQNs and its parameter objects are unchanged.
//
// Composition: parameters that fully_shard units inside the module manage are not replicated
// (decided at the module's first forward), so
//
//   for (auto& block : model->blocks) fsdp::fully_shard(block, opts);   // sharded blocks
//   fsdp::replicate(model);                                             // the rest replicated
//
// shards the blocks and replicates the root's own parameters. fully_shard and replicate on the
// same module are refused, as are replicate inside (or around) another replicate and replicate
// inside a fully_shard unit (in either order: fully_shard around a replicated module too); the
// table is in composable/api_names.cc.
//
// The module must be called through its hook-able holder (FSDP_HOOKABLE_MODULE,
// fsdp::contract::Sequential, ...): its first forward decides the replicated parameters and its
// outputs mark the start of each backward pass. Every rank must run the same backward passes.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <torch/arg.h>
#include <torch/nn/pimpl.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/composable/api_names.h"
#include "fsdp_cpp/contract/forward_hooks.h"

namespace fsdp {

/// Options of replicate, in the LibTorch style:
///
///   fsdp::replicate(model, fsdp::ReplicateOptions().bucket_cap_mb(4));
struct ReplicateOptions {
  /// The ranks to replicate across. Default: fsdp::comm::default_process_group() (call
  /// fsdp::comm::init_process_group() first).
  TORCH_ARG(std::shared_ptr<comm::Communicator>, communicator) = nullptr;
  /// The size of a gradient bucket in MiB (DDP's bucket_cap_mb): a bucket is closed once it
  /// holds at least this many bytes, so a parameter larger than the cap gets a bucket of its own.
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  /// Broadcast rank 0's parameters and buffers when replicate is applied, so that ranks which
  /// initialised differently start equal. Parameters that a fully_shard unit already manages
  /// (sharded) are left to their unit. The same option as FullyShardOptions::sync_module_states,
  /// which is off by default; here it is on because DDP broadcasts rank 0's states at construction,
  /// as PyTorch's replicate and DistributedDataParallel do.
  TORCH_ARG(bool, sync_module_states) = true;

 public:
  /// The earlier name of sync_module_states: sets and reads the same value.
  ReplicateOptions& broadcast_module_states(bool broadcast) { return sync_module_states(broadcast); }
  const bool& broadcast_module_states() const noexcept { return sync_module_states(); }
  bool& broadcast_module_states() noexcept { return sync_module_states(); }
};

/// One gradient bucket: parameters all-reduced together, in one flat buffer.
struct ReplicateBucket {
  c10::ScalarType dtype = c10::ScalarType::Float;
  at::Device device = at::kCPU;
  /// The parameters' FQNs (relative to the replicated module), in the bucket's order: reverse
  /// registration order.
  std::vector<std::string> fqns;
  /// The gradient elements of the bucket (the sum of the parameters' numel).
  int64_t numel = 0;
};

/// What backward passes with gradient sync did so far (for tests and benchmarks).
struct ReplicateStats {
  /// Backward passes that all-reduced gradients.
  int64_t synced_backward_passes = 0;
  /// Buckets all-reduced from an autograd hook during backward, as soon as they were ready
  /// (overlapping the rest of backward), and buckets left to the end of backward (some parameter
  /// of theirs, or of a bucket before them, got no gradient on this rank).
  int64_t buckets_issued_during_backward = 0;
  int64_t buckets_issued_at_end_of_backward = 0;
};

class ReplicateState;

/// What replicate returns: the replicated module, with DDP's gradient-sync switch.
class ReplicateModule {
 public:
  explicit ReplicateModule(std::shared_ptr<ReplicateState> state) : state_(std::move(state)) {}

  /// Gradient accumulation (DDP's no_sync): with `sync` false, backward passes accumulate the
  /// local gradients in `.grad` and communicate nothing; the next backward with sync all-reduces
  /// the accumulated sum, so micro-batches give the gradients of one large batch. Takes effect
  /// from the next backward pass.
  ///
  ///   replicated.set_requires_gradient_sync(false);
  ///   for (auto& mb : micro_batches_but_last) model(mb).sum().backward();
  ///   replicated.set_requires_gradient_sync(true);
  ///   model(last).sum().backward();   // all-reduces the accumulated gradients
  void set_requires_gradient_sync(bool sync);
  bool requires_gradient_sync() const;

  /// The replicated module.
  torch::nn::Module& module() const;

  /// The gradient buckets in the order every rank all-reduces them. Decided at the module's
  /// first forward (empty before it).
  ///
  ///   model(x);                                  // the first forward
  ///   replicated.buckets().size();               // e.g. 3 with a small bucket_cap_mb
  const std::vector<ReplicateBucket>& buckets() const;
  /// The number of buckets (0 before the first forward).
  size_t num_buckets() const { return buckets().size(); }

  /// The FQNs of the replicated parameters (the module's trainable parameters that no fully_shard
  /// unit manages), in registration order. Empty before the first forward.
  std::vector<std::string> replicated_parameter_fqns() const;

  /// Counters of the backward passes so far.
  ReplicateStats stats() const;

 private:
  std::shared_ptr<ReplicateState> state_;
};

/// Replicates `module` across the ranks of the communicator (see the top of this file). Errors
/// (applied twice, on a module with fully_shard, inside a fully_shard unit or around/inside
/// another replicate) name the API, the module's FQN, what was expected and what was found, and
/// leave the model unchanged.
///
///   fsdp::ReplicateModule replicated = fsdp::replicate(*model.ptr());
ReplicateModule replicate(torch::nn::Module& module, const ReplicateOptions& options = {});

/// Replicates the module of a hook-able holder (see replicate(torch::nn::Module&)). Holders that
/// cannot run forward hooks (LibTorch's: TORCH_MODULE, torch::nn::Linear,
/// torch::nn::Sequential, ...) are refused at compile time: their call operator calls forward
/// directly, so replicate would never see a forward.
///
///   fsdp::replicate(model, fsdp::ReplicateOptions().bucket_cap_mb(1));
template <typename Holder>
  requires std::is_base_of_v<torch::detail::ModuleHolderIndicator, Holder>
ReplicateModule replicate(const Holder& module, const ReplicateOptions& options = {}) {
  static_assert(contract::HookableHolder<Holder>,
                "replicate: expected a hook-able module holder, got one that cannot run forward "
                "hooks (LibTorch's holders, e.g. TORCH_MODULE's, torch::nn::Linear or "
                "torch::nn::Sequential, call forward directly), so replicate would never see the "
                "forward that sets it up and starts each backward pass. Declare the module class "
                "with FSDP_HOOKABLE_MODULE(Name) instead of TORCH_MODULE(Name), use "
                "fsdp::contract::Linear, Embedding, LayerNorm, ... for LibTorch's modules and "
                "fsdp::contract::Sequential instead of torch::nn::Sequential "
                "(contract/hookable_modules.h).");
  return replicate(*module.ptr(), options);
}

/// The ReplicateModule replicate made of `module`, if any.
std::optional<ReplicateModule> replicate_module_of(const torch::nn::Module& module);

}  // namespace fsdp
