#pragma once
// summon_full_params (FSDP1's FullyShardedDataParallel.summon_full_params): a scope in which the
// original parameters of a fully_shard unit (and of every unit inside it) have their original
// shapes and full values, outside forward and backward, e.g. to inspect or edit weights.
//
//   {
//     fsdp::SummonFullParams full(root);           // collective: every rank enters
//     for (auto& item : model->named_parameters()) std::cout << item.key() << item.value().sizes();
//     torch::NoGradGuard no_grad;
//     model->head->weight.mul_(0.5);               // written back into every rank's shard
//   }                                              // collective: every rank leaves
//
// Inside the scope each original parameter (the same tensor object the module and the optimizer
// hold) is a full-shape tensor in the parameters' own dtype: full precision even under mixed
// precision (the full-precision shards are all-gathered, not the low-precision compute copies).
// Leaving the scope restores exactly what the parameters and their `.grad` held before (the
// sharded views, or the unsharded views of a unit kept unsharded), after copying edits of the full
// values into each rank's shard when `writeback` is on.
//
// Entering and leaving are collectives over each unit's ranks: every rank must enter and leave the
// same scopes in the same order, with the same options. A scope must not be entered inside a
// forward or backward (nor between a forward and its backward while a backward can still run
// through the forward's outputs, on every world size), nor on a unit
// already summoned; a root forward while any unit of its tree is summoned is refused (before it
// runs, naming the unit).

#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include "fsdp_cpp/composable/fully_shard.h"

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace fsdp {

class FlatParamHandle;

/// Options of SummonFullParams, in the LibTorch style:
///
///   fsdp::SummonFullParams full(root, fsdp::SummonFullParamsOptions().writeback(false).with_grads(true));
struct SummonFullParamsOptions {
  /// Also every unit inside this one (false: only the unit's own parameters, not those of units
  /// nested in it).
  TORCH_ARG(bool, recurse) = true;
  /// On leaving, copy the full parameters' values (edited in place, or replaced by a tensor of the
  /// same shape) back into each rank's shard. Off: edits are discarded.
  TORCH_ARG(bool, writeback) = true;
  /// Only rank 0 materialises the full parameters; the other ranks take part in the all-gathers
  /// but keep their sharded parameters (and gradients) in the scope. Refused with writeback. Off
  /// by default, unlike FullStateDictOptions::rank0_only: the full parameters are summoned to
  /// compute with them (or edit them) on every rank, as PyTorch's summon_full_params does.
  TORCH_ARG(bool, rank0_only) = false;
  /// The full parameters (and gradients) are copies in host memory; writeback copies them back to
  /// the shards. Without sharding (NO_SHARD, one rank) they are copies too.
  TORCH_ARG(bool, offload_to_cpu) = false;
  /// Also full gradients: each trainable parameter's `.grad` is a full-shape tensor in the
  /// parameters' dtype equal to
  ///     all-gather of the sharded gradients (the averaged gradients of the synchronised backward
  ///     passes, as the optimizer would see them; zeros on ranks whose `.grad` is unset)
  ///   + this rank's gradients accumulated without sync and not reduced yet (its own local sum
  ///     over those backward passes, not divided by the world size, so it differs across ranks).
  /// On one rank (nothing to reduce) that is simply the parameter's gradient. A unit's FlatParameter
  /// whose gradients are unset on every rank (and none accumulated) keeps `.grad` unset. Frozen
  /// parameters have none. Edits of the gradients are never written back: leaving restores the
  /// `.grad` held before (sharded views, or unset).
  TORCH_ARG(bool, with_grads) = false;
};

/// An RAII scope holding the full parameters of a unit (see the top of this file).
///
///   {
///     fsdp::SummonFullParams full(units.back(), fsdp::SummonFullParamsOptions().with_grads(true));
///     const auto w = model->in->weight.detach().clone();        // full shape, full values
///     const auto g = model->in->weight.grad().clone();          // full gradient
///   }
///
/// Errors (inside a forward or backward, nested on a summoned unit, rank0_only with writeback)
/// name the unit's FQN and leave the model as it was.
class SummonFullParams {
 public:
  /// Collective: all-gathers each unit's full-precision FlatParameter (and gradients with
  /// `with_grads`) and points the original parameters at their full values.
  explicit SummonFullParams(const FSDPModule& unit, SummonFullParamsOptions options = {});
  /// Calls exit(); an error there is reported as a warning, not thrown. Left by an exception
  /// (stack unwinding), nothing is written back on any rank ([Note: summon exit]).
  ~SummonFullParams();

  SummonFullParams(const SummonFullParams&) = delete;
  SummonFullParams& operator=(const SummonFullParams&) = delete;

  /// Leaves the scope now (collective): writes the full values back into the shards (with
  /// `writeback`) and restores the parameters' data and `.grad` to what they were before the
  /// scope. With `writeback` the ranks first exchange whether each can write back: a full
  /// parameter replaced inside the scope by a tensor of another shape on any rank, or any rank
  /// leaving by an exception, means no rank writes anything (in-place edits of parameters without
  /// sharding, e.g. on one rank, are the replicas' own and stay); every rank then restores its
  /// parameters and throws the same error naming the ranks and parameters ([Note: summon exit]
  /// in summon_full_params.cc). Idempotent: the destructor does nothing after it.
  void exit();

  /// Whether the scope still holds the full parameters (exit() not called yet).
  bool active() const { return !exited_; }

 private:
  struct Handle {
    FlatParamHandle* handle = nullptr;
    bool was_unsharded = false;      // unsharded (compute views) when the scope began
    at::Tensor full;                 // 1-D padded full values, undefined where not materialised
    at::Tensor full_grad;            // 1-D padded full gradient, undefined where not shown
    std::vector<at::Tensor> data;    // each parameter's data before the scope
    std::vector<at::Tensor> grads;   // each parameter's `.grad` before the scope (maybe undefined)
  };
  struct Unit {
    std::shared_ptr<FSDPState> state;
    std::vector<Handle> handles;
  };

  void leave(bool by_exception);
  // comm::agree_on_error over the units' communicators: "" when no rank has a problem, else
  // "\n  rank R: <problem>" (the same on every rank).
  std::string agree_on_problems(const std::string& mine) const;

  SummonFullParamsOptions options_;
  std::string fqn_;  // the scope's unit
  std::vector<Unit> units_;
  bool exited_ = false;
  int uncaught_exceptions_ = std::uncaught_exceptions();  // an exception unwinds the scope: more
};

/// The original (unsharded) shape of `param`, a parameter of `model`'s tree: for a parameter a
/// unit in that tree manages, the shape it had before fully_shard, whatever its current form (a
/// 1-D slice of the shard, possibly empty, or a full-shape view); for any other tensor, its own
/// shape. Pass the root (or a module containing the unit that manages `param`). Local: no
/// collective.
///
///   const auto shape = fsdp::unsharded_shape(*model, model->head->weight);   // e.g. {3, 8}
std::vector<int64_t> unsharded_shape(torch::nn::Module& model, const at::Tensor& param);
/// Same, over the modules of `root`'s unit.
std::vector<int64_t> unsharded_shape(const FSDPModule& root, const at::Tensor& param);

}  // namespace fsdp
