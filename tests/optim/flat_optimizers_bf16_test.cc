// fsdp::optim::Adam and AdamW with bfloat16 moments (FlatAdamOptions::state_dtype(at::kBFloat16),
// [Note: bfloat16 moments] in optim/adam_family_step.h), single process.
//
// The reference is computed independently: torch::optim's float32 Adam/AdamW on separate copies
// of the parameters, whose state tensors this test rounds to bfloat16 (to nearest, ties to even:
// LibTorch's float -> bfloat16 conversion) before and after every step. With round-to-nearest
// the flat optimizer must equal it bit for bit (parameters, moments, step counters), on runs,
// packs and parameters stepped alone. Stochastic rounding is checked against float32 states
// within a stated tolerance, and by what round-to-nearest gets wrong: exp_avg_sq that never
// decays with beta2 = 0.999. The allocator counts the bytes (12 per parameter with float32
// parameters and gradients); archives move between float32-state and bfloat16-state optimizers.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/serialize.h>

#include "fsdp_cpp/optim/adam.h"
#include "fsdp_cpp/optim/adamw.h"
#include "fsdp_cpp/tests/optim/flat_pair.h"
#include "fsdp_cpp/tests/testing/errors.h"
#include "fsdp_cpp/tools/bench/counting_allocator.h"

#include <catch2/catch.hpp>

namespace {

using Catch::Matchers::Contains;
using fsdp::optim::FlatAdamOptions;
using fsdp::optim::StateRounding;
using torch::optim::AdamOptions;
using torch::optim::AdamWOptions;

FlatAdamOptions bf16(StateRounding rounding = StateRounding::kNearest) {
  return FlatAdamOptions().state_dtype(at::kBFloat16).rounding(rounding);
}

// Shapes around the CPU kernels' vector widths and above the bfloat16 chunk (65536 elements), so
// chunks, vectorized bodies and tails fall at other elements in the run than in each parameter.
const std::vector<std::vector<int64_t>> kShapes = {{3, 5}, {7}, {1}, {33}, {4, 4}, {100}, {17, 3}, {70001}, {9}};

using fsdp::optim::testing::Pair;
using fsdp::optim::testing::view_of;

// The state of `p` in `optim` (Adam's and AdamW's have the same fields).
template <class State>
State* state_in(torch::optim::Optimizer& optim, const at::Tensor& p) {
  auto it = optim.state().find(p.unsafeGetTensorImpl());
  return it == optim.state().end() ? nullptr : static_cast<State*>(it->second.get());
}

// The reference's emulation of bfloat16 storage: every float32 state tensor rounded to bfloat16.
template <class State>
void round_states(torch::optim::Optimizer& ref) {
  for (auto& entry : ref.state()) {
    auto& s = static_cast<State&>(*entry.second);
    for (at::Tensor t : {s.exp_avg(), s.exp_avg_sq(), s.max_exp_avg_sq()}) {
      if (t.defined()) t.copy_(t.to(at::kBFloat16));
    }
  }
}

// Parameters equal; the flat optimizer's moments bfloat16 and equal to the reference's rounded
// float32 ones; step counters equal.
template <class State>
void check_equal_bf16(const std::vector<at::Tensor>& flat_params, const std::vector<at::Tensor>& ref_params,
                      torch::optim::Optimizer& flat, torch::optim::Optimizer& ref) {
  for (size_t i = 0; i < flat_params.size(); ++i) {
    INFO("parameter " << i);
    REQUIRE(torch::equal(flat_params[i].detach(), ref_params[i].detach()));
    State* f = state_in<State>(flat, flat_params[i]);
    State* r = state_in<State>(ref, ref_params[i]);
    REQUIRE((f == nullptr) == (r == nullptr));
    if (f == nullptr) continue;
    CHECK(f->step() == r->step());
    CHECK(f->exp_avg().scalar_type() == at::kBFloat16);
    CHECK(f->exp_avg_sq().scalar_type() == at::kBFloat16);
    CHECK(torch::equal(f->exp_avg(), r->exp_avg().to(at::kBFloat16)));
    CHECK(torch::equal(f->exp_avg_sq(), r->exp_avg_sq().to(at::kBFloat16)));
    CHECK(f->max_exp_avg_sq().defined() == r->max_exp_avg_sq().defined());
    if (r->max_exp_avg_sq().defined()) {
      CHECK(f->max_exp_avg_sq().scalar_type() == at::kBFloat16);
      CHECK(torch::equal(f->max_exp_avg_sq(), r->max_exp_avg_sq().to(at::kBFloat16)));
    }
  }
}

template <class Flat, class Ref, class State, class Options>
void run_nearest(const Options& options, int steps, const std::vector<std::vector<size_t>>& without = {}) {
  Pair pair(kShapes);
  Flat flat(pair.params, options, bf16());
  Ref ref(pair.ref, options);
  for (int it = 0; it < steps; ++it) {
    INFO("step " << it);
    pair.set_grads(it, it < static_cast<int>(without.size()) ? without[it] : std::vector<size_t>{});
    flat.step();
    ref.step();
    round_states<State>(ref);
    if (without.empty()) {
      CHECK(flat.last_step().flat_runs == 1);
      CHECK(flat.last_step().flat_params == static_cast<int64_t>(kShapes.size()));
      if (it > 0) CHECK(flat.last_step().adopted == 0);  // the bfloat16 buffers are reused
    }
    check_equal_bf16<State>(pair.params, pair.ref, flat, ref);
  }
}

}  // namespace

TEST_CASE("bf16 moments, round to nearest: torch::optim's float32 step with states rounded to bf16, bit for bit",
          "[optim][bf16]") {
  SECTION("AdamW on a run") {
    for (const auto& options : {AdamWOptions(1e-2), AdamWOptions(3e-3).amsgrad(true).weight_decay(0.1),
                                AdamWOptions(1e-1).betas({0.8, 0.95}).eps(1e-6).weight_decay(0.05)}) {
      run_nearest<fsdp::optim::AdamW, torch::optim::AdamW, torch::optim::AdamWParamState>(options, 5);
    }
  }
  SECTION("Adam on a run") {
    for (const auto& options : {AdamOptions(1e-2), AdamOptions(1e-2).weight_decay(0.05).amsgrad(true)}) {
      run_nearest<fsdp::optim::Adam, torch::optim::Adam, torch::optim::AdamParamState>(options, 5);
    }
  }
  SECTION("parameters without a gradient: the run split, segments of different step counters") {
    run_nearest<fsdp::optim::AdamW, torch::optim::AdamW, torch::optim::AdamWParamState>(
        AdamWOptions(1e-2).amsgrad(true), 5, {{}, {3}, {0, 8}, {}, {4, 5}});
  }
  SECTION("packs of small parameters and a large parameter stepped alone") {
    auto make = [] {
      auto gen = at::detail::createCPUGenerator(3);
      std::vector<at::Tensor> ps;
      for (int64_t n : {5, 1, 300, 17, 64}) ps.push_back(at::randn({n}, gen).requires_grad_(true));
      ps.push_back(at::randn({300, 100}, gen).requires_grad_(true));  // above the pack limit: alone
      return ps;
    };
    auto flat_params = make();
    auto ref_params = make();
    const auto options = AdamWOptions(1e-2).weight_decay(0.1);
    fsdp::optim::AdamW flat(flat_params, options, bf16());
    torch::optim::AdamW ref(ref_params, options);
    for (int it = 0; it < 4; ++it) {
      INFO("step " << it);
      auto gen = at::detail::createCPUGenerator(50 + it);
      for (size_t i = 0; i < flat_params.size(); ++i) {
        at::Tensor g = at::randn(flat_params[i].sizes(), gen);
        flat_params[i].mutable_grad() = g;
        ref_params[i].mutable_grad() = g.clone();
      }
      flat.step();
      ref.step();
      round_states<torch::optim::AdamWParamState>(ref);
      CHECK(flat.last_step().packs == 1);
      CHECK(flat.last_step().packed_params == 5);
      CHECK(flat.last_step().single_params == 1);
      check_equal_bf16<torch::optim::AdamWParamState>(flat_params, ref_params, flat, ref);
    }
  }
}

TEST_CASE("bf16 moments: the options are validated", "[optim][bf16]") {
  Pair pair(std::vector<std::vector<int64_t>>{{8}, {4}});
  CHECK_THAT(fsdp::testing::error_of([&] {
               fsdp::optim::AdamW(pair.params, AdamWOptions(), FlatAdamOptions().state_dtype(at::kHalf));
             }),
             Contains("fsdp::optim::AdamW: FlatAdamOptions::state_dtype must be Float") && Contains("got Half"));
  CHECK_THAT(fsdp::testing::error_of([&] {
               fsdp::optim::Adam(pair.params, AdamOptions(), FlatAdamOptions().state_dtype(at::kDouble));
             }),
             Contains("fsdp::optim::Adam: FlatAdamOptions::state_dtype must be Float") && Contains("got Double"));
  std::vector<at::Tensor> doubles = {at::zeros({3}, at::kDouble).requires_grad_(true)};
  CHECK_THAT(fsdp::testing::error_of([&] { fsdp::optim::AdamW(doubles, AdamWOptions(), bf16()); }),
             Contains("fsdp::optim::AdamW: FlatAdamOptions::state_dtype(BFloat16) keeps the moments of float32 "
                      "parameters") &&
                 Contains("parameter 0 of param group 0 (shape [3]) is Double (expected Float"));
  // A parameter added after construction is checked at the step.
  fsdp::optim::AdamW optim(pair.params, AdamWOptions(), bf16());
  optim.add_param_group(torch::optim::OptimizerParamGroup(doubles));
  doubles[0].mutable_grad() = at::ones({3}, at::kDouble);
  pair.set_grads(0);
  CHECK_THAT(fsdp::testing::error_of([&] { optim.step(); }),
             Contains("fsdp::optim::AdamW: FlatAdamOptions::state_dtype(BFloat16)") && Contains("is Double"));
  // The defaults: float32 states, torch::optim's values.
  CHECK(FlatAdamOptions().state_dtype() == at::kFloat);
  CHECK(FlatAdamOptions().rounding() == StateRounding::kStochastic);
}

TEST_CASE("exp_avg_sq in bf16 stalls with round-to-nearest; stochastic rounding follows float32", "[optim][bf16]") {
  // One 4096-element parameter, lr 0 (it never moves), beta2 0.999: gradients of standard
  // deviation 1 for 1000 steps, then 0.1 for 3000. Float32 exp_avg_sq decays from about 0.63 to
  // 0.01 * (1 - 0.999^3000) + 0.63 * 0.999^3000; a bf16 decrement of 0.1% is below half the
  // spacing of bf16 (2^-9..2^-8 relative), so round-to-nearest keeps the old value.
  const int64_t n = 4096;
  auto mean_v = [](torch::optim::Optimizer& o, const at::Tensor& p) {
    return state_in<torch::optim::AdamParamState>(o, p)->exp_avg_sq().to(at::kDouble).mean().item<double>();
  };
  std::vector<at::Tensor> p32 = {at::zeros({n}).requires_grad_(true)};
  std::vector<at::Tensor> pnear = {at::zeros({n}).requires_grad_(true)};
  std::vector<at::Tensor> psr = {at::zeros({n}).requires_grad_(true)};
  const auto options = AdamOptions(0.0);
  fsdp::optim::Adam f32(p32, options);
  fsdp::optim::Adam near(pnear, options, bf16(StateRounding::kNearest));
  fsdp::optim::Adam sr(psr, options, bf16(StateRounding::kStochastic));
  auto gen = at::detail::createCPUGenerator(5);
  double at_1000[3] = {0, 0, 0};
  for (int t = 1; t <= 4000; ++t) {
    const at::Tensor g = at::randn({n}, gen) * (t <= 1000 ? 1.0 : 0.1);
    for (auto* ps : {&p32, &pnear, &psr}) (*ps)[0].mutable_grad() = g.clone();
    f32.step();
    near.step();
    sr.step();
    if (t == 1000) {
      at_1000[0] = mean_v(f32, p32[0]);
      at_1000[1] = mean_v(near, pnear[0]);
      at_1000[2] = mean_v(sr, psr[0]);
    }
  }
  const double v32 = mean_v(f32, p32[0]), vnear = mean_v(near, pnear[0]), vsr = mean_v(sr, psr[0]);
  std::printf("exp_avg_sq mean after 1000 steps (std 1) / 3000 more (std 0.1): float32 %.4f / %.5f, bf16 nearest "
              "%.4f / %.5f, bf16 stochastic %.4f / %.5f\n",
              at_1000[0], v32, at_1000[1], vnear, at_1000[2], vsr);
  const double closed_form = 0.01 * (1 - std::pow(0.999, 3000)) + at_1000[0] * std::pow(0.999, 3000);
  CHECK(std::abs(v32 - closed_form) < 0.02 * closed_form);
  CHECK(std::abs(at_1000[2] - at_1000[0]) < 0.01 * at_1000[0]);
  CHECK(std::abs(vsr - v32) < 0.01 * v32);  // stochastic: within 1% of float32
  CHECK(vnear > 5 * v32);                   // nearest: stalled near its value at step 1000
}

TEST_CASE("bf16 moments, stochastic rounding: within a stated tolerance of float32 states", "[optim][bf16]") {
  // Tolerance: after k steps of lr 1e-2 every parameter within k * lr * 2^-5 of the float32-state
  // run (Adam's update is at most about lr per step and bf16 moments change it by a relative
  // error of a few 2^-8), and the mean difference (the bias) 20 times smaller.
  for (const auto& options : {AdamWOptions(1e-2), AdamWOptions(1e-2).amsgrad(true).betas({0.8, 0.95})}) {
    Pair pair(kShapes);
    fsdp::optim::AdamW flat(pair.params, options, bf16(StateRounding::kStochastic));
    torch::optim::AdamW ref(pair.ref, options);
    const int steps = 20;
    for (int it = 0; it < steps; ++it) {
      pair.set_grads(it);
      flat.step();
      ref.step();
    }
    at::Tensor diff = at::cat({pair.flat.detach().narrow(0, pair.offsets[7], 70001),
                               pair.flat.detach().narrow(0, pair.offsets[0], 15)}) -
                      at::cat({pair.ref[7].detach().reshape(-1), pair.ref[0].detach().reshape(-1)});
    const double max_abs = diff.abs().max().item<double>();
    const double bias = std::abs(diff.mean().item<double>());
    const double tolerance = steps * 1e-2 * std::pow(2.0, -5);
    std::printf("stochastic bf16 moments vs float32 states after %d steps: max |dp| %.3g, mean dp %.3g (tolerance "
                "%.3g)\n", steps, max_abs, bias, tolerance);
    CHECK(max_abs < tolerance);
    CHECK(bias < tolerance / 20);
    CHECK(max_abs > 0);  // the states are bf16: not float32's values exactly
  }
}

TEST_CASE("bf16 moments: the same seed rounds the same; another seed differently", "[optim][bf16]") {
  auto train = [](uint64_t seed) {
    Pair pair(kShapes);
    fsdp::optim::AdamW flat(pair.params, AdamWOptions(1e-2), bf16(StateRounding::kStochastic).seed(seed));
    for (int it = 0; it < 3; ++it) {
      pair.set_grads(it);
      flat.step();
    }
    return pair.flat.detach().clone();
  };
  const at::Tensor a = train(1), b = train(1), c = train(2);
  CHECK(torch::equal(a, b));
  CHECK_FALSE(torch::equal(a, c));
}

TEST_CASE("bf16 moments: 12 bytes per parameter by the allocator (float32 parameter 4, gradient 4, moments 2 + 2)",
          "[optim][bf16][memory]") {
  auto& alloc = fsdp::bench::CountingAllocator::install();
  // Parameters laid out like a FlatParameter's shard without padding (every numel a multiple of
  // 4): one run of n elements. Each optimizer gets its own parameters and gradients.
  const std::vector<int64_t> sizes = {1 << 18, 4096, 1 << 17, 12, 1 << 16};
  int64_t n = 0;
  for (int64_t s : sizes) n += s;
  for (const bool low : {false, true}) {
    INFO((low ? "bf16 moments" : "float32 moments"));
    alloc.mark();
    at::Tensor flat = at::zeros({n});
    at::Tensor grad = at::zeros({n});
    std::vector<at::Tensor> params;
    int64_t offset = 0;
    for (int64_t s : sizes) {
      at::Tensor p = view_of(flat, offset, {s}).requires_grad_(true);
      p.mutable_grad() = view_of(grad, offset, {s});
      params.push_back(p);
      offset += s;
    }
    {
      c10::NoGradGuard no_grad;
      flat.normal_();
      grad.normal_();
    }
    const int64_t param_and_grad = alloc.current_since_mark();
    CHECK(param_and_grad == 8 * n);
    fsdp::optim::AdamW optim(params, AdamWOptions(1e-3),
                             low ? bf16(StateRounding::kStochastic) : FlatAdamOptions());
    alloc.reset_peak();
    optim.step();
    const int64_t state = alloc.current_since_mark() - param_and_grad;
    const int64_t transient = alloc.peak_since_mark() - alloc.current_since_mark();
    CHECK(optim.last_step().flat_runs == 1);
    CHECK(optim.last_step().flat_params == static_cast<int64_t>(sizes.size()));
    const int64_t formula = (low ? 2 + 2 : 4 + 4) * n;  // exp_avg + exp_avg_sq per element
    std::printf("%s moments: %lld parameters; optimizer state %lld bytes by the allocator (formula %lld); parameter + "
                "gradient + state %.3f bytes per parameter; transient during the step %lld bytes\n",
                low ? "bf16" : "float32", static_cast<long long>(n), static_cast<long long>(state),
                static_cast<long long>(formula), static_cast<double>(param_and_grad + state) / n,
                static_cast<long long>(transient));
    CHECK(state == formula);
    CHECK(param_and_grad + state == (low ? 12 : 16) * n);
    // A second step allocates no state; bf16's float32 working copies stay chunk-sized.
    alloc.reset_peak();
    optim.step();
    CHECK(alloc.current_since_mark() == param_and_grad + state);
    if (low) {
      CHECK(alloc.peak_since_mark() - alloc.current_since_mark() <= 24 * fsdp::optim::kBFloat16Chunk);
    }
  }
}

TEST_CASE("bf16 moments: archives move between float32-state and bf16-state optimizers", "[optim][bf16][checkpoint]") {
  using State = torch::optim::AdamWParamState;
  const auto options = AdamWOptions(1e-2).amsgrad(true);
  // Two steps with float32 states, saved.
  Pair pair(kShapes);
  fsdp::optim::AdamW f32(pair.params, options);
  for (int it = 0; it < 2; ++it) {
    pair.set_grads(it);
    f32.step();
  }
  std::stringstream f32_saved;
  torch::save(f32, f32_saved);

  // Into a bf16-state optimizer: its next step adopts the float32 states, rounded to nearest
  // (LibTorch's conversion, whatever the rounding option); then as the reference continues.
  Pair low_pair(kShapes), ref_pair(kShapes);
  {
    c10::NoGradGuard no_grad;
    for (size_t i = 0; i < kShapes.size(); ++i) {
      low_pair.params[i].copy_(pair.params[i]);
      ref_pair.ref[i].copy_(pair.params[i]);
    }
  }
  fsdp::optim::AdamW low(low_pair.params, options, bf16());
  torch::optim::AdamW ref(ref_pair.ref, options);
  std::stringstream copy1(f32_saved.str()), copy2(f32_saved.str());
  torch::load(low, copy1);
  torch::load(ref, copy2);
  round_states<State>(ref);
  for (int it = 2; it < 4; ++it) {
    low_pair.set_grads(it);
    ref_pair.set_grads(it);
    low.step();
    ref.step();
    round_states<State>(ref);
    if (it == 2) CHECK(low.last_step().adopted == 3);  // exp_avg, exp_avg_sq, max_exp_avg_sq
    check_equal_bf16<State>(low_pair.params, ref_pair.ref, low, ref);
  }

  // What a bf16-state optimizer saves: bfloat16 moments (as torch's Adam saves its states' dtype).
  std::stringstream low_saved;
  torch::save(low, low_saved);
  torch::optim::AdamW probe(std::vector<at::Tensor>(ref_pair.ref), options);
  std::stringstream copy3(low_saved.str());
  torch::load(probe, copy3);
  CHECK(state_in<State>(probe, ref_pair.ref[0])->exp_avg().scalar_type() == at::kBFloat16);

  // And back into a float32-state fsdp::optim::AdamW: the bf16 values are adopted exactly into
  // float32 buffers, and it continues as torch::optim with the same float32 states does.
  Pair back_pair(kShapes);
  {
    c10::NoGradGuard no_grad;
    for (size_t i = 0; i < kShapes.size(); ++i) {
      back_pair.params[i].copy_(low_pair.params[i]);
      back_pair.ref[i].copy_(low_pair.params[i]);
    }
  }
  fsdp::optim::AdamW back(back_pair.params, options);
  torch::optim::AdamW back_ref(back_pair.ref, options);
  std::stringstream copy4(low_saved.str()), copy5(low_saved.str());
  torch::load(back, copy4);
  torch::load(back_ref, copy5);
  for (auto& entry : back_ref.state()) {  // torch::optim would keep bf16 states: converted here
    auto& s = static_cast<State&>(*entry.second);
    s.exp_avg(s.exp_avg().to(at::kFloat));
    s.exp_avg_sq(s.exp_avg_sq().to(at::kFloat));
    s.max_exp_avg_sq(s.max_exp_avg_sq().to(at::kFloat));
  }
  for (int it = 4; it < 6; ++it) {
    back_pair.set_grads(it);
    back.step();
    back_ref.step();
    if (it == 4) CHECK(back.last_step().adopted == 3);
    for (size_t i = 0; i < kShapes.size(); ++i) {
      INFO("parameter " << i);
      CHECK(torch::equal(back_pair.params[i].detach(), back_pair.ref[i].detach()));
      State* f = state_in<State>(back, back_pair.params[i]);
      State* r = state_in<State>(back_ref, back_pair.ref[i]);
      CHECK(f->exp_avg().scalar_type() == at::kFloat);
      CHECK(torch::equal(f->exp_avg(), r->exp_avg()));
      CHECK(torch::equal(f->exp_avg_sq(), r->exp_avg_sq()));
      CHECK(torch::equal(f->max_exp_avg_sq(), r->max_exp_avg_sq()));
    }
  }
}
