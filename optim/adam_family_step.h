#pragma once
// The step shared by fsdp::optim::Adam and AdamW (internal: in the srcs of //optim:flat_optimizers).
//
// [Note: exact steps] Each run ([Note: flat runs]) is stepped with the op sequence of LibTorch's
// own step (torch/csrc/api/src/optim/adam.cpp, adamw.cpp, sgd.cpp of torch 2.15), the same ops
// with the same scalar arguments (computed in double as there), on the run's flat tensors instead
// of one parameter's. Every op is elementwise, so each element of a parameter goes through the
// same arithmetic either way; tests/optim compare the values with torch::equal. A run of one
// parameter is stepped on the parameter's own tensors, state created as torch::optim creates it.
// The per-parameter `step` counters are kept as torch::optim keeps them (incremented for every
// parameter with a gradient); members of a run whose counters differ (one of them missed a step
// without a gradient) are stepped in segments of equal counters.

#include <cmath>
#include <memory>
#include <tuple>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/GradMode.h>
#include <ATen/ops/max.h>
#include <ATen/ops/zeros_like.h>
#include <torch/optim/optimizer.h>

#include "fsdp_cpp/optim/flat_packs.h"
#include "fsdp_cpp/optim/flat_runs.h"
#include "fsdp_cpp/optim/flat_state.h"
#include "fsdp_cpp/optim/flat_step_stats.h"

namespace fsdp::optim::detail {

using StateMap = ska::flat_hash_map<void*, std::unique_ptr<torch::optim::OptimizerParamState>>;

// One Adam/AdamW update of `p` (after the step counter became `step`), as LibTorch's step does it.
template <class Options>
void adam_update(at::Tensor& p, const at::Tensor& grad_in, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                 at::Tensor& max_exp_avg_sq, int64_t step, const Options& options, bool decoupled) {
  // AdamW: decoupled weight decay first (adamw.cpp: "Perform stepweight decay").
  if (decoupled && options.weight_decay() != 0) p.mul_(1 - options.lr() * options.weight_decay());
  const auto beta1 = std::get<0>(options.betas());
  const auto beta2 = std::get<1>(options.betas());
  const auto bias_correction1 = 1 - std::pow(beta1, step);
  const auto bias_correction2 = 1 - std::pow(beta2, step);
  at::Tensor grad = grad_in;
  if (!decoupled && options.weight_decay() != 0) grad = grad.add(p, options.weight_decay());
  exp_avg.mul_(beta1).add_(grad, 1 - beta1);
  exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2);
  at::Tensor denom;
  if (options.amsgrad()) {
    at::max_out(max_exp_avg_sq, exp_avg_sq, max_exp_avg_sq);
    denom = (max_exp_avg_sq.sqrt() / std::sqrt(bias_correction2)).add_(options.eps());
  } else {
    denom = (exp_avg_sq.sqrt() / std::sqrt(bias_correction2)).add_(options.eps());
  }
  const auto step_size = options.lr() / bias_correction1;
  p.addcdiv_(exp_avg, denom, -step_size);
}

template <class State>
State& state_of(StateMap& states, const at::Tensor& p) {
  auto& slot = states[p.unsafeGetTensorImpl()];
  if (!slot) {
    auto fresh = std::make_unique<State>();
    fresh->step(0);
    slot = std::move(fresh);
  }
  return static_cast<State&>(*slot);
}

// One parameter, exactly as torch::optim::Adam/AdamW step it.
template <class State, class Options>
void adam_single(at::Tensor p, StateMap& states, const Options& options, bool decoupled, const char* name) {
  const at::Tensor& grad = p.grad();
  TORCH_CHECK(!grad.is_sparse(), name, " does not support sparse gradients");
  auto it = states.find(p.unsafeGetTensorImpl());
  if (it == states.end()) {
    auto fresh = std::make_unique<State>();
    fresh->step(0);
    fresh->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
    fresh->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
    if (options.amsgrad()) fresh->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
    states[p.unsafeGetTensorImpl()] = std::move(fresh);
  }
  auto& state = static_cast<State&>(*states[p.unsafeGetTensorImpl()]);
  state.step(state.step() + 1);
  adam_update(p, grad, state.exp_avg(), state.exp_avg_sq(), state.max_exp_avg_sq(), state.step(), options, decoupled);
}

// A run of several parameters or a pack: flat state, one update per segment of equal step counters.
template <class State, class Options>
void adam_run(const ParamRun& run, const std::vector<at::Tensor>& params, StateMap& states, const Options& options,
              bool decoupled, FlatStepStats& stats) {
  const size_t n = run.members.size();
  std::vector<State*> member_states(n);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[run.members[i]];
    State& s = state_of<State>(states, p);
    TORCH_CHECK(!options.amsgrad() || s.step() == 0 || s.max_exp_avg_sq().defined(),
                "fsdp::optim: amsgrad is set but the state of a parameter of shape ", p.sizes(),
                " that was already stepped has no max_exp_avg_sq (was amsgrad turned on after steps?)");
    member_states[i] = &s;
  }
  std::vector<at::Tensor*> slots(n);
  auto flat = [&](auto field) {
    for (size_t i = 0; i < n; ++i) slots[i] = &field(*member_states[i]);
    return flat_state(run, params, slots, stats.adopted);
  };
  at::Tensor exp_avg = flat([](State& s) -> at::Tensor& { return s.exp_avg(); });
  at::Tensor exp_avg_sq = flat([](State& s) -> at::Tensor& { return s.exp_avg_sq(); });
  at::Tensor max_exp_avg_sq;
  if (options.amsgrad()) max_exp_avg_sq = flat([](State& s) -> at::Tensor& { return s.max_exp_avg_sq(); });

  for (size_t first = 0; first < n;) {
    size_t last = first;
    while (last + 1 < n && member_states[last + 1]->step() == member_states[first]->step()) ++last;
    const int64_t step = member_states[first]->step() + 1;
    for (size_t i = first; i <= last; ++i) member_states[i]->step(step);
    const RunSegment seg = run_segment(run, params, first, last);
    at::Tensor p = segment_view(run.param, run, seg);
    at::Tensor m = segment_view(exp_avg, run, seg);
    at::Tensor v = segment_view(exp_avg_sq, run, seg);
    at::Tensor vmax = max_exp_avg_sq.defined() ? segment_view(max_exp_avg_sq, run, seg) : at::Tensor();
    adam_update(p, segment_view(run.grad, run, seg), m, v, vmax, step, options, decoupled);
    first = last + 1;
  }
  finish_flat_step(run, params, stats);
}

// The whole step() of Adam (decoupled false) or AdamW (true): the closure, then every group.
template <class State, class Options>
at::Tensor adam_family_step(const torch::optim::Optimizer::LossClosure& closure,
                            std::vector<torch::optim::OptimizerParamGroup>& groups, StateMap& states,
                            bool decoupled, const char* name, int64_t pack_max_numel, FlatStepStats& stats) {
  at::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  stats = FlatStepStats();
  for (auto& group : groups) {
    const auto& options = static_cast<const Options&>(group.options());
    // eps == 0 would turn zero padding into NaN: no gaps then ([Note: flat runs]).
    const int64_t max_gap = options.eps() > 0 ? kMaxRunGapBytes : 0;
    const std::vector<at::Tensor>& params = group.params();
    for (const ParamRun& run : plan_runs(params, pack_max_numel, max_gap)) {
      if (run.flat()) {
        adam_run<State>(run, params, states, options, decoupled, stats);
      } else {
        adam_single<State>(params[run.members.front()], states, options, decoupled, name);
        ++stats.single_params;
      }
    }
  }
  return loss;
}

}  // namespace fsdp::optim::detail
