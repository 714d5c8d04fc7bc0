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
//
// [Note: bfloat16 moments] With FlatAdamOptions::state_dtype(at::kBFloat16) exp_avg, exp_avg_sq
// (and max_exp_avg_sq) are bfloat16 tensors: 2 + 2 bytes per float32 parameter instead of 4 + 4,
// so a mixed-precision fully_shard model holds 12 bytes per parameter (float32 shard 4, float32
// gradient 4, moments 2 + 2) instead of 16. The arithmetic stays float32: each step upcasts a
// chunk of the moments (kBFloat16Chunk elements: the float32 working copies stay small whatever
// the run's size), applies exactly the float32 update above (adam_update, the same ops; the
// parameter update uses the float32 moments of this step), and rounds the moments back to
// bfloat16. So with round-to-nearest the values equal torch::optim's float32 Adam/AdamW whose
// states are rounded to bfloat16 after every step, bit for bit (tests/optim checks that).
// Rounding: stochastic by default (StateRounding::kStochastic): a float32 moment x between the
// neighbouring bfloat16 values lo < hi becomes hi with probability (x - lo) / (hi - lo), so
// E[round(x)] = x (implemented on the bits: a uniform random 16-bit integer added to the low
// half of x's bits, which are then cleared; the NaNs LibTorch's arithmetic makes stay NaN).
// Why not nearest: bfloat16 has 8 significant bits, a relative spacing of 2^-8..2^-7, and
// exp_avg_sq moves by (1 - beta2) = 1e-3 of (grad^2 - exp_avg_sq) per step with beta2 = 0.999.
// Any move below half a spacing (relative 2^-9..2^-8, i.e. unless grad^2 differs from exp_avg_sq
// by a factor of about 3 or more) rounds back to the old value: exp_avg_sq stalls, and it can
// never decay (0.999 x rounds to x). Measured (tests/optim/flat_optimizers_bf16_test.cc,
// "exp_avg_sq in bf16 stalls with round-to-nearest"; 4096 elements, lr 0): gradients of standard
// deviation 1 for 1000 steps, then 0.1 for 3000. The mean exp_avg_sq in float32: 0.6329 after
// the first phase, 0.04097 after the second (the closed form 0.01 (1 - 0.999^3000) +
// 0.6329 * 0.999^3000 = 0.0410); bfloat16 to nearest: 0.6684 (already 6% high: grad^2 is
// skewed, the many small decrements round away while the rare large increments stay), then
// 0.66838, stalled, 16 times float32's; bfloat16 stochastic: 0.6328 and 0.04096 (within 0.1% of
// float32). Stochastic rounding makes the moments noisy instead (per step an error of mean zero
// below one spacing, 2^-8..2^-7 of the value, averaged over the 1/(1 - beta2) steps the moment
// spans); exp_avg (beta1 = 0.9, moves
// of 10%) is rounded the same way, so its small increments are not lost either. The random bits
// of a chunk come from a CPU generator seeded with (FlatAdamOptions::seed, the step counter, the
// chunk's position in the step), so a run resumed from a checkpoint rounds as before; on
// another device they are drawn on the CPU and copied. Nearest (StateRounding::kNearest) is
// deterministic without a seed and is what the bit-for-bit tests use.

#include <algorithm>
#include <cmath>
#include <memory>
#include <tuple>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/GradMode.h>
#include <ATen/ops/max.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>

#include "fsdp_cpp/optim/adam.h"
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

inline uint64_t mix64(uint64_t x) {  // splitmix64's finalizer
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/// Rounds the float32 moments of one step() to bfloat16 ([Note: bfloat16 moments]).
class StateRounder {
 public:
  explicit StateRounder(const FlatAdamOptions& options) : options_(options) {}

  /// Starts a chunk of the step whose counter becomes `step`: its random bits.
  void begin_chunk(int64_t step) {
    if (options_.rounding() != StateRounding::kStochastic) return;
    const uint64_t seed = mix64(options_.seed() ^ mix64(static_cast<uint64_t>(step) ^ mix64(chunks_++)));
    generator_ = at::detail::createCPUGenerator(seed);
  }

  /// `dst` (bfloat16) = `src` (the float32 working copy, which this may modify) rounded.
  void round_into(const at::Tensor& dst, at::Tensor& src) {
    if (options_.rounding() == StateRounding::kStochastic) {
      at::Tensor noise = at::randint(0, int64_t{1} << 16, src.sizes(), generator_, at::TensorOptions().dtype(at::kInt));
      if (!src.device().is_cpu()) noise = noise.to(src.device());
      // x's bits plus a uniform integer below 2^16, the low 16 bits cleared: up with probability
      // (low bits) / 2^16. Magnitude-wise for either sign, so unbiased; infinities stay infinite.
      at::Tensor bits = src.view(at::kInt);
      bits.add_(noise).bitwise_and_(static_cast<int32_t>(0xFFFF0000u));
    }
    dst.copy_(src);  // exact after the stochastic step; to nearest, ties to even, otherwise
  }

 private:
  const FlatAdamOptions& options_;
  uint64_t chunks_ = 0;
  at::Generator generator_;
};

/// adam_update on bfloat16 moments: per chunk, float32 copies of the moments, the float32 update,
/// the moments rounded back ([Note: bfloat16 moments]).
template <class Options>
void adam_update_bf16(const at::Tensor& p, const at::Tensor& grad, const at::Tensor& exp_avg,
                      const at::Tensor& exp_avg_sq, const at::Tensor& max_exp_avg_sq, int64_t step,
                      const Options& options, bool decoupled, StateRounder& rounder) {
  const bool amsgrad = max_exp_avg_sq.defined();
  const bool chunked = p.is_contiguous() && grad.is_contiguous() && exp_avg.is_contiguous() &&
                       exp_avg_sq.is_contiguous() && (!amsgrad || max_exp_avg_sq.is_contiguous());
  const int64_t n = p.numel();
  const int64_t chunk = chunked ? kBFloat16Chunk : std::max<int64_t>(n, 1);
  auto part = [&](const at::Tensor& t, int64_t begin, int64_t len) {
    return chunked ? t.view({-1}).narrow(0, begin, len) : t;
  };
  for (int64_t begin = 0; begin < n; begin += chunk) {
    const int64_t len = std::min(chunk, n - begin);
    at::Tensor pc = part(p, begin, len);
    const at::Tensor m16 = part(exp_avg, begin, len);
    const at::Tensor v16 = part(exp_avg_sq, begin, len);
    const at::Tensor vmax16 = amsgrad ? part(max_exp_avg_sq, begin, len) : at::Tensor();
    at::Tensor m = m16.to(at::kFloat);
    at::Tensor v = v16.to(at::kFloat);
    at::Tensor vmax = amsgrad ? vmax16.to(at::kFloat) : at::Tensor();
    adam_update(pc, part(grad, begin, len), m, v, vmax, step, options, decoupled);
    rounder.begin_chunk(step);
    rounder.round_into(m16, m);
    rounder.round_into(v16, v);
    if (amsgrad) rounder.round_into(vmax16, vmax);
  }
}

/// The moments' dtype for `p` ([Note: bfloat16 moments]); refuses a parameter bfloat16 moments
/// cannot serve.
inline c10::ScalarType state_dtype_for(const at::Tensor& p, const FlatAdamOptions& flat_options, const char* name) {
  if (flat_options.state_dtype() != at::kBFloat16) return p.scalar_type();
  TORCH_CHECK(p.scalar_type() == at::kFloat, "fsdp::optim::", name,
              ": FlatAdamOptions::state_dtype(BFloat16) keeps the moments of float32 parameters in bfloat16; a "
              "parameter of shape ", p.sizes(), " is ", p.scalar_type(), " (expected Float)");
  return at::kBFloat16;
}

/// `t` in `dtype` (a state loaded or set in another dtype is converted, as flat_state adopts it).
inline void convert_state(at::Tensor& t, c10::ScalarType dtype) {
  if (t.defined() && t.scalar_type() != dtype) t = t.to(dtype);
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

// One parameter, exactly as torch::optim::Adam/AdamW step it (with float32 states: bfloat16
// moments are stepped by adam_update_bf16).
template <class State, class Options>
void adam_single(at::Tensor p, StateMap& states, const Options& options, bool decoupled, const char* name,
                 const FlatAdamOptions& flat_options, StateRounder& rounder) {
  const at::Tensor& grad = p.grad();
  TORCH_CHECK(!grad.is_sparse(), name, " does not support sparse gradients");
  const bool bf16 = flat_options.state_dtype() == at::kBFloat16;
  const c10::ScalarType dtype = state_dtype_for(p, flat_options, name);
  const auto state_options = p.options().dtype(dtype);
  auto it = states.find(p.unsafeGetTensorImpl());
  if (it == states.end()) {
    auto fresh = std::make_unique<State>();
    fresh->step(0);
    fresh->exp_avg(at::zeros_like(p, state_options, at::MemoryFormat::Preserve));
    fresh->exp_avg_sq(at::zeros_like(p, state_options, at::MemoryFormat::Preserve));
    if (options.amsgrad()) fresh->max_exp_avg_sq(at::zeros_like(p, state_options, at::MemoryFormat::Preserve));
    states[p.unsafeGetTensorImpl()] = std::move(fresh);
  }
  auto& state = static_cast<State&>(*states[p.unsafeGetTensorImpl()]);
  convert_state(state.exp_avg(), dtype);
  convert_state(state.exp_avg_sq(), dtype);
  convert_state(state.max_exp_avg_sq(), dtype);
  state.step(state.step() + 1);
  if (bf16) {
    adam_update_bf16(p, grad, state.exp_avg(), state.exp_avg_sq(), state.max_exp_avg_sq(), state.step(), options,
                     decoupled, rounder);
  } else {
    adam_update(p, grad, state.exp_avg(), state.exp_avg_sq(), state.max_exp_avg_sq(), state.step(), options,
                decoupled);
  }
}

// A run of several parameters or a pack: flat state, one update per segment of equal step counters.
template <class State, class Options>
void adam_run(const ParamRun& run, const std::vector<at::Tensor>& params, StateMap& states, const Options& options,
              bool decoupled, const char* name, const FlatAdamOptions& flat_options, StateRounder& rounder,
              FlatStepStats& stats) {
  const size_t n = run.members.size();
  const bool bf16 = flat_options.state_dtype() == at::kBFloat16;
  const c10::ScalarType dtype = state_dtype_for(params[run.members.front()], flat_options, name);
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
    return flat_state(run, params, slots, stats.adopted, dtype);
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
    const at::Tensor g = segment_view(run.grad, run, seg);
    if (bf16) {
      adam_update_bf16(p, g, m, v, vmax, step, options, decoupled, rounder);
    } else {
      adam_update(p, g, m, v, vmax, step, options, decoupled);
    }
    first = last + 1;
  }
  finish_flat_step(run, params, stats);
}

// The whole step() of Adam (decoupled false) or AdamW (true): the closure, then every group.
template <class State, class Options>
at::Tensor adam_family_step(const torch::optim::Optimizer::LossClosure& closure,
                            std::vector<torch::optim::OptimizerParamGroup>& groups, StateMap& states,
                            bool decoupled, const char* name, int64_t pack_max_numel,
                            const FlatAdamOptions& flat_options, FlatStepStats& stats) {
  at::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  stats = FlatStepStats();
  StateRounder rounder(flat_options);
  for (auto& group : groups) {
    const auto& options = static_cast<const Options&>(group.options());
    // eps == 0 would turn zero padding into NaN: no gaps then ([Note: flat runs]).
    const int64_t max_gap = options.eps() > 0 ? kMaxRunGapBytes : 0;
    const std::vector<at::Tensor>& params = group.params();
    for (const ParamRun& run : plan_runs(params, pack_max_numel, max_gap)) {
      if (run.flat()) {
        adam_run<State>(run, params, states, options, decoupled, name, flat_options, rounder, stats);
      } else {
        adam_single<State>(params[run.members.front()], states, options, decoupled, name, flat_options, rounder);
        ++stats.single_params;
      }
    }
  }
  return loss;
}

}  // namespace fsdp::optim::detail
