#include "composable/clip_grad_norm.h"

#include "comm/issuing_api.h"
#include <cmath>
#include <unordered_set>

#include <ATen/ops/tensor.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include "composable/fully_shard_internal.h"
#include "fsdp/unit_tree.h"

namespace fsdp {

double clip_grad_norm_(const FSDPModule& root, double max_norm, double norm_type) {
  comm::IssuingApi issuing_api("fsdp::clip_grad_norm_");
  TORCH_CHECK(norm_type > 0, "fsdp::clip_grad_norm_: norm_type must be positive, got ", norm_type);
  const bool inf = std::isinf(norm_type);
  // Each unit once (siblings share a state), each gradient shard once.
  std::vector<FSDPState*> units;
  for (const auto& unit : distinct_units_in_tree(root.module())) units.push_back(unit.get());
  // Sharded gradients are reduced across the shard group (every group holds all shards);
  // replicated ones (NO_SHARD) are complete on every rank and enter once, locally.
  double sharded = 0.0, replicated = 0.0;
  std::vector<at::Tensor> grads;
  for (FSDPState* unit : units) {
    for (const auto& handle : unit->handles()) {
      if (!handle->requires_grad()) continue;
      // Each parameter's `.grad` is its slice of this rank's shard (its whole gradient when the
      // handle does not shard).
      for (const auto& p : handle->params()) {
        const at::Tensor& g = p.param.grad();
        if (!g.defined() || g.numel() == 0) continue;
        grads.push_back(g);
        const double part = inf ? g.abs().max().item<double>() : g.abs().pow(norm_type).sum().item<double>();
        double& into = handle->is_sharded_strategy() ? sharded : replicated;
        into = inf ? std::max(into, part) : into + part;
      }
    }
  }
  // Parameters no unit manages (ignored ones, or registered after fully_shard): whole and local on
  // every rank, so their gradients enter locally, once per tensor (FSDP1 does the same with its
  // non-sharded parameters); they are scaled with the others.
  std::unordered_set<const void*> managed;
  for (FSDPState* unit : units) {
    for (const auto& handle : unit->handles()) {
      for (const auto& p : handle->params()) managed.insert(p.param.unsafeGetTensorImpl());
    }
  }
  for (const auto& p : root.module().parameters()) {
    const at::Tensor& g = p.grad();
    if (!managed.insert(p.unsafeGetTensorImpl()).second || !g.defined() || g.numel() == 0) continue;
    grads.push_back(g);
    const double part = inf ? g.abs().max().item<double>() : g.abs().pow(norm_type).sum().item<double>();
    replicated = inf ? std::max(replicated, part) : replicated + part;
  }
  const auto& comm = detail::state_of(root).config().comm;
  at::Tensor total = at::tensor({sharded}, at::kDouble).to(comm->device());
  comm->all_reduce(total, inf ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM, "clip_grad_norm_").wait();
  double norm = total.cpu().item<double>();
  norm = inf ? std::max(norm, replicated) : std::pow(norm + replicated, 1.0 / norm_type);
  const double coefficient = max_norm / (norm + 1e-6);
  if (coefficient < 1.0) {
    c10::NoGradGuard no_grad;
    for (auto& g : grads) g.mul_(coefficient);  // the parameters' .grad themselves
  }
  return norm;
}

}  // namespace fsdp
