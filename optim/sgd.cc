#include "fsdp_cpp/optim/sgd.h"

#include <memory>

#include <ATen/ops/clone.h>
#include <c10/core/GradMode.h>

#include "fsdp_cpp/optim/flat_packs.h"
#include "fsdp_cpp/optim/flat_runs.h"
#include "fsdp_cpp/optim/flat_state.h"

namespace fsdp::optim {
namespace {

using StateMap = ska::flat_hash_map<void*, std::unique_ptr<torch::optim::OptimizerParamState>>;
using torch::optim::SGDOptions;
using torch::optim::SGDParamState;

// The direction before momentum: the gradient, plus weight decay (sgd.cpp: d_p).
at::Tensor direction(const at::Tensor& p, const at::Tensor& grad, const SGDOptions& options) {
  at::Tensor d_p = grad;
  if (options.weight_decay() != 0) d_p = d_p.add(p, options.weight_decay());
  return d_p;
}

// The update after momentum, from the direction and the updated momentum buffer.
at::Tensor with_momentum(const at::Tensor& d_p, const at::Tensor& buf, const SGDOptions& options) {
  return options.nesterov() ? d_p.add(buf, options.momentum()) : buf;
}

// One parameter, exactly as torch::optim::SGD steps it.
void sgd_single(at::Tensor p, StateMap& states, const SGDOptions& options) {
  at::Tensor d_p = direction(p, p.grad(), options);
  if (options.momentum() != 0) {
    at::Tensor buf;
    auto it = states.find(p.unsafeGetTensorImpl());
    if (it == states.end()) {
      buf = at::clone(d_p).detach();
      auto state = std::make_unique<SGDParamState>();
      state->momentum_buffer(buf);
      states[p.unsafeGetTensorImpl()] = std::move(state);
    } else {
      buf = static_cast<SGDParamState&>(*it->second).momentum_buffer();
      buf.mul_(options.momentum()).add_(d_p, 1 - options.dampening());
    }
    d_p = with_momentum(d_p, buf, options);
  }
  p.add_(d_p, -1 * options.lr());
}

// A run of several parameters or a pack: one flat momentum buffer, first steps (no state yet: the buffer
// starts as the direction) and later ones in segments.
void sgd_run(const ParamRun& run, const std::vector<at::Tensor>& params, StateMap& states, const SGDOptions& options,
             FlatStepStats& stats) {
  const size_t n = run.members.size();
  at::Tensor d_p = direction(run.param, run.grad, options);
  if (options.momentum() != 0) {
    std::vector<bool> fresh(n);
    std::vector<at::Tensor*> slots(n);
    for (size_t i = 0; i < n; ++i) {
      auto& slot = states[params[run.members[i]].unsafeGetTensorImpl()];
      fresh[i] = slot == nullptr;
      if (fresh[i]) slot = std::make_unique<SGDParamState>();
      slots[i] = &static_cast<SGDParamState&>(*slot).momentum_buffer();
    }
    at::Tensor buf = flat_state(run, params, slots, stats.adopted);
    for (size_t first = 0; first < n;) {
      size_t last = first;
      while (last + 1 < n && fresh[last + 1] == fresh[first]) ++last;
      const RunSegment seg = run_segment(run, params, first, last);
      at::Tensor b = segment_view(buf, run, seg);
      const at::Tensor d = segment_view(d_p, run, seg);
      if (fresh[first]) {
        b.copy_(d);  // torch::optim: buf = clone(d_p)
      } else {
        b.mul_(options.momentum()).add_(d, 1 - options.dampening());
      }
      first = last + 1;
    }
    d_p = with_momentum(d_p, buf, options);
  }
  // `run.param` is a tensor of its own (a view without autograd, or a pack's copy): in place.
  at::Tensor param = run.param;
  param.add_(d_p, -1 * options.lr());
  finish_flat_step(run, params, stats);
}

}  // namespace

torch::Tensor SGD::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  stats_ = FlatStepStats();
  for (auto& group : param_groups_) {
    const auto& options = static_cast<const SGDOptions&>(group.options());
    const std::vector<at::Tensor>& params = group.params();
    for (const ParamRun& run : plan_runs(params, pack_max_numel_)) {
      if (run.flat()) {
        sgd_run(run, params, state_, options, stats_);
      } else {
        sgd_single(params[run.members.front()], state_, options);
        ++stats_.single_params;
      }
    }
  }
  return loss;
}

}  // namespace fsdp::optim
