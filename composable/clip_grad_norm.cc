#include "fsdp_cpp/composable/clip_grad_norm.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <optional>
#include <sstream>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include <ATen/ops/tensor.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include "fsdp_cpp/comm/agreement.h"
#include "fsdp_cpp/comm/issuing_api.h"
#include "fsdp_cpp/composable/fully_shard_internal.h"
#include "fsdp_cpp/composable/tensor_placement.h"
#include "fsdp_cpp/fsdp/open_iteration.h"
#include "fsdp_cpp/fsdp/root_context.h"
#include "fsdp_cpp/fsdp/unit_tree.h"

namespace fsdp {
namespace {

constexpr const char* kApi = "fsdp::clip_grad_norm_";

using Comms = std::vector<std::shared_ptr<comm::Communicator>>;

std::string name_of(const FSDPState& unit) { return unit.fqn().empty() ? "<root>" : unit.fqn(); }

void add_distinct(Comms& comms, const std::shared_ptr<comm::Communicator>& c) {
  if (c && c->size() > 1 && std::find(comms.begin(), comms.end(), c) == comms.end()) comms.push_back(c);
}

// The max norm's max, NaN-propagating as torch's.
double combine(bool inf, double a, double b) {
  if (!inf) return a + b;
  if (std::isnan(a) || std::isnan(b)) return std::nan("");
  return std::max(a, b);
}

std::string check_arguments(double max_norm, double norm_type) {
  std::ostringstream e;
  if (std::isnan(max_norm) || max_norm < 0) {
    e << "max_norm must be a number >= 0 (+infinity: never clip), got " << max_norm;
  } else if (std::isnan(norm_type) || norm_type <= 0) {
    e << "norm_type must be > 0 (2: the L2 norm, infinity: the max norm), got " << norm_type;
  }
  return e.str();
}

// The job: this rank's units (each once), the parameters no unit manages, the groups.
struct Job {
  std::vector<FSDPState*> units;
  std::vector<at::Tensor> unmanaged;  // parameters of the roots' modules no unit manages, once each
  Comms dp;                           // the roots' communicators, in root order
  Comms replicate;                    // their replicate groups (HSDP)
  // Units on a subset of their root's ranks (experts): summed over the root's communicator
  // ([Note: units on a subset of the root's ranks] in fsdp/lazy_init.cc).
  std::unordered_map<const FSDPState*, std::shared_ptr<comm::Communicator>> root_comm;
  std::shared_ptr<comm::Communicator> tp;
  std::string error;                  // this rank's refusal, or ""
};

void note(Job& job, const std::string& error) {
  if (job.error.empty()) job.error = error;
}

Job resolve_job(const std::vector<FSDPModule>& roots) {
  Job job;
  std::unordered_set<const void*> managed;
  for (const FSDPModule& root : roots) {
    FSDPState& state = detail::state_of(root);
    add_distinct(job.dp, state.config().comm);
    add_distinct(job.replicate, state.config().replicate);
    if (const FSDPState* above = enclosing_unit(state)) {
      note(job, "unit '" + name_of(state) + "' is not a root (it is inside unit '" + name_of(*above) +
                    "'); its gradients' norm would be its subtree's, not the model's. Expected the root of every "
                    "model part this rank holds (each pipeline stage chunk's root)");
    }
    if (const RootContext* context = state.root_context()) {
      const std::string open = runtime::open_iteration_error(*context);
      if (!open.empty()) note(job, open);
    }
    for (torch::nn::Module* module : state.modules()) {
      for (const auto& unit : distinct_units_in_tree(*module)) {
        if (std::find(job.units.begin(), job.units.end(), unit.get()) != job.units.end()) continue;
        job.units.push_back(unit.get());
        job.root_comm[unit.get()] = state.config().comm;
        add_distinct(job.dp, unit->config().comm);  // the root's, once its first forward checked it
        add_distinct(job.replicate, unit->config().replicate);
        for (const auto& handle : unit->handles()) {
          for (const auto& p : handle->params()) managed.insert(p.param.unsafeGetTensorImpl());
        }
      }
    }
  }
  for (const FSDPModule& root : roots) {
    for (torch::nn::Module* module : root.modules()) {
      for (const auto& p : module->parameters()) {
        if (managed.insert(p.unsafeGetTensorImpl()).second) job.unmanaged.push_back(p);
      }
    }
  }
  // The tp group, from the placements (whether or not a gradient is defined: every rank of the tp
  // group decides alike).
  auto consider = [&](const at::Tensor& param) {
    const auto placement = tensor_placement(param);
    if (!placement || !placement->sharded() || placement->size() == 1) return;
    if (!job.tp) {
      job.tp = placement->group;
    } else if (job.tp != placement->group) {
      note(job, "the tensor-parallel parameters of the model use different groups (" +
                    placement->describe() + " and another); expected one tensor-parallel group");
    }
  };
  for (FSDPState* unit : job.units) {
    for (const auto& handle : unit->handles()) {
      for (const auto& p : handle->params()) consider(p.param);
    }
  }
  for (const auto& p : job.unmanaged) consider(p);
  return job;
}

}  // namespace

double clip_grad_norm_(const std::vector<FSDPModule>& roots, double max_norm, double norm_type,
                       const std::shared_ptr<comm::Communicator>& pipeline_group) {
  comm::IssuingApi issuing_api(kApi);
  TORCH_CHECK(!roots.empty(), kApi, ": expected the roots this rank holds (at least one), got none");
  Job job = resolve_job(roots);
  const std::string arguments = check_arguments(max_norm, norm_type);
  if (!arguments.empty()) job.error = arguments;
  Comms groups = job.dp;
  groups.insert(groups.end(), job.replicate.begin(), job.replicate.end());
  add_distinct(groups, job.tp);
  add_distinct(groups, pipeline_group);
  // [Note: error agreement] in comm/agreement.h: before the first collective, over every group
  // the function communicates on (the roots' communicators and replicate groups, the tp group, the
  // pipeline group: together they span the job), so every rank refuses with the same error.
  comm::throw_if_any_error(groups, job.error.empty() ? std::nullopt : std::optional<std::string>(job.error), kApi);

  const bool inf = std::isinf(norm_type);
  // Four kinds of sums: [dp-sharded (per communicator) or whole on every dp rank] x [tp-sharded or
  // whole on every tp rank]. Sharded ones are summed over their group; whole ones enter once.
  std::vector<std::array<double, 2>> dp_sharded(job.dp.size(), {0.0, 0.0});
  std::array<double, 2> whole = {0.0, 0.0};
  std::vector<at::Tensor> grads;
  auto add = [&](const at::Tensor& param, const at::Tensor& g, const std::shared_ptr<comm::Communicator>& dp,
                 double share = 1.0) {
    if (!g.defined() || g.numel() == 0) return;
    grads.push_back(g);
    const double part = inf ? g.abs().max().item<double>() : g.abs().pow(norm_type).sum().item<double>() * share;
    const auto placement = tensor_placement(param);
    const int tp_sharded = placement && placement->sharded() && placement->size() > 1 ? 1 : 0;
    const auto it = std::find(job.dp.begin(), job.dp.end(), dp);
    double& into = it == job.dp.end() ? whole[tp_sharded] : dp_sharded[it - job.dp.begin()][tp_sharded];
    into = combine(inf, into, part);
  };
  for (FSDPState* unit : job.units) {
    for (const auto& handle : unit->handles()) {
      if (!handle->requires_grad()) continue;
      // Each parameter's `.grad` is its slice of this rank's shard (its whole gradient when the
      // handle does not shard).
      const auto& own = unit->config().comm;
      const auto& root = job.root_comm.at(unit);
      if (own && root && own != root && root->size() > 1) {
        // A unit on a subset of the root's ranks: the root's other ranks hold other parameters in
        // its place, so the sum runs over the root's communicator; an unsharded handle's whole
        // gradient is on every rank of the unit's own communicator and enters once.
        const double share = handle->is_sharded_strategy() ? 1.0 : 1.0 / own->size();
        for (const auto& p : handle->params()) add(p.param, p.param.grad(), root, share);
        continue;
      }
      const auto dp = handle->is_sharded_strategy() ? own : nullptr;
      for (const auto& p : handle->params()) add(p.param, p.param.grad(), dp);
    }
  }
  // Ignored parameters and parameters registered after fully_shard: whole and local on every
  // rank (FSDP1 does the same with its non-sharded parameters); scaled with the others.
  for (const auto& p : job.unmanaged) add(p, p.grad(), nullptr);

  const auto op = inf ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
  auto all_reduce = [&](comm::Communicator& group, std::vector<double> values, const std::string& tag) {
    at::Tensor t = at::tensor(values, at::kDouble).to(group.device());
    group.all_reduce(t, op, tag).wait();
    t = t.cpu();
    for (size_t i = 0; i < values.size(); ++i) values[i] = t[static_cast<int64_t>(i)].item<double>();
    return values;
  };
  double total = whole[0];
  double tp_part = whole[1];
  for (size_t i = 0; i < job.dp.size(); ++i) {
    const auto sums = all_reduce(*job.dp[i], {dp_sharded[i][0], dp_sharded[i][1]}, "clip_grad_norm_");
    total = combine(inf, total, sums[0]);
    tp_part = combine(inf, tp_part, sums[1]);
  }
  // Whether a tp all-reduce runs is decided from the model's placements, the same on every rank of
  // the tp group (parallelize_module checks that the group applied one plan).
  if (job.tp) tp_part = all_reduce(*job.tp, {tp_part}, "clip_grad_norm_: tensor parallel")[0];
  total = combine(inf, total, tp_part);
  if (pipeline_group && pipeline_group->size() > 1) {
    total = all_reduce(*pipeline_group, {total}, "clip_grad_norm_: pipeline stages")[0];
  }
  const double norm = inf ? total : std::pow(total, 1.0 / norm_type);
  const double coefficient = max_norm / (norm + 1e-6);
  if (coefficient < 1.0) {
    c10::NoGradGuard no_grad;
    for (auto& g : grads) g.mul_(coefficient);  // the parameters' .grad themselves
  }
  return norm;
}

double clip_grad_norm_(const FSDPModule& root, double max_norm, double norm_type) {
  return clip_grad_norm_(std::vector<FSDPModule>{root}, max_norm, norm_type, nullptr);
}

}  // namespace fsdp
