// fsdp::optim::Adam, AdamW and SGD against torch::optim's on the same parameters, single process.
//
// The parameters under test are laid out as fully_shard lays out a FlatParameter's shard: views of
// one flat storage, each starting at a multiple of 16 bytes (zero padding between them), their
// gradients views of one flat gradient at the same offsets (a fresh one each step, as after
// zero_grad(set_to_none)). The reference: separate tensors with the same values and gradients,
// stepped by torch::optim. After every step each parameter, each state tensor and each step
// counter must be bitwise equal (torch::equal), for every optimizer and option combination, and
// the flat optimizer must have stepped the runs it should have as runs (last_step()).
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>
#include <torch/serialize.h>

#include "fsdp_cpp/optim/adam.h"
#include "fsdp_cpp/optim/adamw.h"
#include "fsdp_cpp/optim/sgd.h"
#include "fsdp_cpp/tests/testing/errors.h"

#include <catch2/catch.hpp>

namespace {

using torch::optim::AdamOptions;
using torch::optim::AdamWOptions;
using torch::optim::SGDOptions;

// Shapes chosen around the CPU kernels' vector widths (8 and 16 floats) and above one thread's
// grain (32768 elements), so vectorized bodies, scalar tails and thread chunks fall at different
// elements in the flat run than in each parameter.
const std::vector<std::vector<int64_t>> kShapes = {{3, 5}, {7}, {1}, {33}, {4, 4}, {100}, {17, 3}, {40001}, {9}};

int64_t aligned(int64_t n) { return (n + 3) / 4 * 4; }  // 16 bytes of float

at::Tensor view_of(const at::Tensor& flat, int64_t offset, c10::IntArrayRef shape) {
  at::Tensor t = at::empty({0}, flat.options());
  std::vector<int64_t> strides(shape.size(), 1);
  for (int64_t d = static_cast<int64_t>(shape.size()) - 2; d >= 0; --d) strides[d] = strides[d + 1] * shape[d + 1];
  t.set_(flat.storage(), offset, shape, strides);
  return t;
}

// Parameters laid out like a FlatParameter's shard, and the same values as separate tensors.
struct Pair {
  std::vector<int64_t> offsets;
  int64_t total = 0;
  at::Tensor flat;                 // the shard
  std::vector<at::Tensor> params;  // views of it
  std::vector<at::Tensor> ref;     // separate tensors

  explicit Pair(const std::vector<std::vector<int64_t>>& shapes = kShapes, uint64_t seed = 0) {
    for (const auto& s : shapes) {
      offsets.push_back(total);
      int64_t n = 1;
      for (int64_t d : s) n *= d;
      total += aligned(n);
    }
    flat = at::zeros({total});
    auto gen = at::detail::createCPUGenerator(seed + 7);
    for (size_t i = 0; i < shapes.size(); ++i) {
      at::Tensor p = view_of(flat, offsets[i], shapes[i]);
      p.copy_(at::randn(shapes[i], gen));
      p.requires_grad_(true);
      params.push_back(p);
      ref.push_back(p.detach().clone().requires_grad_(true));
    }
  }

  // Gradients for step `it`: one flat gradient (zero padding) for the views, copies for the
  // reference; parameters in `without` get none.
  void set_grads(int it, const std::vector<size_t>& without = {}) {
    at::Tensor g = at::zeros({total});
    auto gen = at::detail::createCPUGenerator(1000 + it);
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor values = at::randn(params[i].sizes(), gen);
      if (std::find(without.begin(), without.end(), i) != without.end()) {
        params[i].mutable_grad() = at::Tensor();
        ref[i].mutable_grad() = at::Tensor();
        continue;
      }
      at::Tensor gi = view_of(g, offsets[i], params[i].sizes());
      gi.copy_(values);
      params[i].mutable_grad() = gi;
      ref[i].mutable_grad() = values.clone();
    }
  }
};

// Every parameter, state tensor and step counter bitwise equal.
void check_equal(const Pair& pair, torch::optim::Optimizer& flat, torch::optim::Optimizer& ref) {
  for (size_t i = 0; i < pair.params.size(); ++i) {
    INFO("parameter " << i);
    REQUIRE(torch::equal(pair.params[i].detach(), pair.ref[i].detach()));
    const auto f = flat.state().find(pair.params[i].unsafeGetTensorImpl());
    const auto r = ref.state().find(pair.ref[i].unsafeGetTensorImpl());
    REQUIRE((f == flat.state().end()) == (r == ref.state().end()));
    if (f == flat.state().end()) continue;
    if (auto* fs = dynamic_cast<torch::optim::AdamWParamState*>(f->second.get())) {
      auto& rs = static_cast<torch::optim::AdamWParamState&>(*r->second);
      CHECK(fs->step() == rs.step());
      CHECK(torch::equal(fs->exp_avg(), rs.exp_avg()));
      CHECK(torch::equal(fs->exp_avg_sq(), rs.exp_avg_sq()));
      CHECK(fs->max_exp_avg_sq().defined() == rs.max_exp_avg_sq().defined());
      if (rs.max_exp_avg_sq().defined()) CHECK(torch::equal(fs->max_exp_avg_sq(), rs.max_exp_avg_sq()));
    } else if (auto* fa = dynamic_cast<torch::optim::AdamParamState*>(f->second.get())) {
      auto& ra = static_cast<torch::optim::AdamParamState&>(*r->second);
      CHECK(fa->step() == ra.step());
      CHECK(torch::equal(fa->exp_avg(), ra.exp_avg()));
      CHECK(torch::equal(fa->exp_avg_sq(), ra.exp_avg_sq()));
      CHECK(fa->max_exp_avg_sq().defined() == ra.max_exp_avg_sq().defined());
      if (ra.max_exp_avg_sq().defined()) CHECK(torch::equal(fa->max_exp_avg_sq(), ra.max_exp_avg_sq()));
    } else {
      auto& fm = static_cast<torch::optim::SGDParamState&>(*f->second);
      auto& rm = static_cast<torch::optim::SGDParamState&>(*r->second);
      CHECK(torch::equal(fm.momentum_buffer(), rm.momentum_buffer()));
    }
  }
}

template <class Flat, class Ref, class Options>
void run_steps(const Options& options, int steps, uint64_t seed = 0) {
  Pair pair(kShapes, seed);
  Flat flat(pair.params, options);
  Ref ref(pair.ref, options);
  for (int it = 0; it < steps; ++it) {
    pair.set_grads(it);
    flat.step();
    ref.step();
    CHECK(flat.last_step().flat_runs == 1);
    CHECK(flat.last_step().flat_params == static_cast<int64_t>(kShapes.size()));
    CHECK(flat.last_step().single_params == 0);
    if (it > 0) CHECK(flat.last_step().adopted == 0);  // the state buffers are reused
    check_equal(pair, flat, ref);
  }
}

}  // namespace

TEST_CASE("AdamW steps a flat run bit for bit as torch::optim::AdamW", "[optim]") {
  const std::vector<std::pair<std::string, AdamWOptions>> cases = {
      {"defaults", AdamWOptions(1e-2)},
      {"no weight decay", AdamWOptions(1e-2).weight_decay(0)},
      {"amsgrad", AdamWOptions(3e-3).amsgrad(true).weight_decay(0.1)},
      {"betas and eps", AdamWOptions(1e-1).betas({0.8, 0.95}).eps(1e-6).weight_decay(0.05)},
  };
  for (const auto& [name, options] : cases) {
    INFO(name);
    run_steps<fsdp::optim::AdamW, torch::optim::AdamW>(options, 5);
  }
}

TEST_CASE("Adam steps a flat run bit for bit as torch::optim::Adam", "[optim]") {
  const std::vector<std::pair<std::string, AdamOptions>> cases = {
      {"defaults", AdamOptions(1e-2)},
      {"weight decay", AdamOptions(1e-2).weight_decay(0.05)},
      {"amsgrad", AdamOptions(3e-3).amsgrad(true)},
      {"amsgrad, weight decay, betas", AdamOptions(1e-1).amsgrad(true).weight_decay(0.01).betas({0.5, 0.9})},
  };
  for (const auto& [name, options] : cases) {
    INFO(name);
    run_steps<fsdp::optim::Adam, torch::optim::Adam>(options, 5);
  }
}

TEST_CASE("SGD steps a flat run bit for bit as torch::optim::SGD", "[optim]") {
  const std::vector<std::pair<std::string, SGDOptions>> cases = {
      {"plain", SGDOptions(0.1)},
      {"weight decay", SGDOptions(0.1).weight_decay(0.01)},
      {"momentum", SGDOptions(0.05).momentum(0.9)},
      {"momentum, dampening", SGDOptions(0.05).momentum(0.9).dampening(0.1)},
      {"nesterov", SGDOptions(0.05).momentum(0.8).nesterov(true)},
      {"nesterov, weight decay", SGDOptions(0.05).momentum(0.8).nesterov(true).weight_decay(0.02)},
  };
  for (const auto& [name, options] : cases) {
    INFO(name);
    run_steps<fsdp::optim::SGD, torch::optim::SGD>(options, 5);
  }
}
