#include "fsdp_cpp/composable/clip_grad_norm.h"

#include "fsdp_cpp/comm/issuing_api.h"
#include <cmath>
#include <unordered_set>

#include <ATen/ops/tensor.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include "fsdp_cpp/composable/fully_shard_internal.h"
#include "fsdp_cpp/composable/tensor_placement.h"
#include "fsdp_cpp/fsdp/unit_tree.h"

namespace fsdp {

double clip_grad_norm_(const FSDPModule& root, double max_norm, double norm_type) {
  comm::IssuingApi issuing_api("fsdp::clip_grad_norm_");
  TORCH_CHECK(norm_type > 0, "fsdp::clip_grad_norm_: norm_type must be positive, got ", norm_type);
  const bool inf = std::isinf(norm_type);
  // Each unit once (siblings share a state), each gradient shard once.
  std::vector<FSDPState*> units;
  for (const auto& unit : distinct_units_in_tree(root.module())) units.push_back(unit.get());
  // Sharded gradients are reduced across the shard group (every group holds all shards);
  // replicated ones (NO_SHARD) are complete on every rank and enter once, locally. Under tensor
  // parallelism a gradient is also either this rank's piece of a TP-sharded parameter (summed over
  // the TP group) or whole on every TP rank (entered once): four sums, [dp-sharded, local] x
  // [TP-sharded, TP-whole].
  double parts[2][2] = {{0.0, 0.0}, {0.0, 0.0}};  // [dp sharded?][tp sharded?]
  std::shared_ptr<comm::Communicator> tp_group;
  std::vector<at::Tensor> grads;
  auto add = [&](const at::Tensor& param, const at::Tensor& g, bool dp_sharded) {
    grads.push_back(g);
    const double part = inf ? g.abs().max().item<double>() : g.abs().pow(norm_type).sum().item<double>();
    bool tp_sharded = false;
    if (auto placement = tensor_placement(param); placement && placement->sharded() && placement->size() > 1) {
      TORCH_CHECK(!tp_group || tp_group == placement->group, "fsdp::clip_grad_norm_: the tensor-parallel "
                  "parameters of the model use different groups; expected one tensor-parallel group");
      tp_group = placement->group;
      tp_sharded = true;
    }
    double& into = parts[dp_sharded][tp_sharded];
    into = inf ? std::max(into, part) : into + part;
  };
  for (FSDPState* unit : units) {
    for (const auto& handle : unit->handles()) {
      if (!handle->requires_grad()) continue;
      // Each parameter's `.grad` is its slice of this rank's shard (its whole gradient when the
      // handle does not shard).
      for (const auto& p : handle->params()) {
        const at::Tensor& g = p.param.grad();
        if (!g.defined() || g.numel() == 0) continue;
        add(p.param, g, handle->is_sharded_strategy());
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
    add(p, g, /*dp_sharded=*/false);
  }
  const auto& comm = detail::state_of(root).config().comm;
  const auto op = inf ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
  auto combine = [&](double a, double b) { return inf ? std::max(a, b) : a + b; };
  at::Tensor dp_sums = at::tensor({parts[1][0], parts[1][1]}, at::kDouble).to(comm->device());
  comm->all_reduce(dp_sums, op, "clip_grad_norm_").wait();
  dp_sums = dp_sums.cpu();
  // Whether a TP all-reduce runs is decided from the model's placements, the same on every rank
  // of the TP group (parallelize_module checks that the group applied one plan).
  double tp_part = combine(dp_sums[1].item<double>(), parts[0][1]);
  if (tp_group) {
    at::Tensor t = at::tensor({tp_part}, at::kDouble).to(tp_group->device());
    tp_group->all_reduce(t, op, "clip_grad_norm_: tensor parallel").wait();
    tp_part = t.cpu().item<double>();
  }
  double norm = combine(combine(dp_sums[0].item<double>(), parts[0][0]), tp_part);
  if (!inf) norm = std::pow(norm, 1.0 / norm_type);
  const double coefficient = max_norm / (norm + 1e-6);
  if (coefficient < 1.0) {
    c10::NoGradGuard no_grad;
    for (auto& g : grads) g.mul_(coefficient);  // the parameters' .grad themselves
  }
  return norm;
}

}  // namespace fsdp
