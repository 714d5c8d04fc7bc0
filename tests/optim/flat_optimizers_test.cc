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
#include "fsdp_cpp/tests/optim/flat_pair.h"
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

using fsdp::optim::testing::Pair;
using fsdp::optim::testing::view_of;

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

TEST_CASE("Param groups split runs; parameters outside the optimizer are never written", "[optim]") {
  SECTION("two groups, each a contiguous part of the storage, different hyperparameters") {
    Pair pair(kShapes);
    auto groups = [](const std::vector<at::Tensor>& ps) {
      std::vector<torch::optim::OptimizerParamGroup> g;
      g.emplace_back(std::vector<at::Tensor>(ps.begin(), ps.begin() + 4),
                     std::make_unique<AdamWOptions>(AdamWOptions(1e-2).weight_decay(0.1)));
      g.emplace_back(std::vector<at::Tensor>(ps.begin() + 4, ps.end()),
                     std::make_unique<AdamWOptions>(AdamWOptions(3e-2).amsgrad(true).weight_decay(0)));
      return g;
    };
    fsdp::optim::AdamW flat(groups(pair.params));
    torch::optim::AdamW ref(groups(pair.ref));
    for (int it = 0; it < 4; ++it) {
      pair.set_grads(it);
      flat.step();
      ref.step();
      // The first group is small: a pack; the second a run in place.
      CHECK(flat.last_step().packs == 1);
      CHECK(flat.last_step().packed_params == 4);
      CHECK(flat.last_step().flat_runs == 1);
      CHECK(flat.last_step().flat_params == 5);
      check_equal(pair, flat, ref);
    }
  }
  SECTION("every other parameter: no run (the small ones packed), and the others keep their values") {
    Pair pair(kShapes);
    std::vector<at::Tensor> odd_flat, odd_ref;
    for (size_t i = 1; i < pair.params.size(); i += 2) {
      odd_flat.push_back(pair.params[i]);
      odd_ref.push_back(pair.ref[i]);
    }
    fsdp::optim::SGD flat(odd_flat, SGDOptions(0.1).momentum(0.9).weight_decay(0.1));
    torch::optim::SGD ref(odd_ref, SGDOptions(0.1).momentum(0.9).weight_decay(0.1));
    for (int it = 0; it < 3; ++it) {
      pair.set_grads(it);  // the even parameters have gradients too
      flat.step();
      ref.step();
      CHECK(flat.last_step().flat_runs == 0);
      CHECK(flat.last_step().packed_params == 3);  // {7}, {33}, {100}
      CHECK(flat.last_step().single_params == 1);  // {40001}
      check_equal(pair, flat, ref);  // the even ones: neither optimizer touched them
    }
  }
}

TEST_CASE("Parameters without a gradient: runs split, step counters as torch::optim's", "[optim]") {
  Pair pair(kShapes);
  fsdp::optim::Adam flat(pair.params, AdamOptions(1e-2).weight_decay(0.01).amsgrad(true));
  torch::optim::Adam ref(pair.ref, AdamOptions(1e-2).weight_decay(0.01).amsgrad(true));
  const std::vector<std::vector<size_t>> without = {{}, {3}, {0, 8}, {}, {4, 5}, {}};
  for (size_t it = 0; it < without.size(); ++it) {
    INFO("step " << it);
    pair.set_grads(static_cast<int>(it), without[it]);
    flat.step();
    ref.step();
    check_equal(pair, flat, ref);
    CHECK(flat.last_step().flat_params + flat.last_step().packed_params + flat.last_step().single_params ==
          static_cast<int64_t>(kShapes.size() - without[it].size()));
  }
  // Step 1 split the run at parameter 3: [0..2] and [4..8]; step 3 found counters that differ
  // (0 and 8 missed step 2, 3 missed step 1) and stepped the run in segments. Six steps:
  auto& s3 = static_cast<torch::optim::AdamParamState&>(*flat.state().at(pair.params[3].unsafeGetTensorImpl()));
  auto& s1 = static_cast<torch::optim::AdamParamState&>(*flat.state().at(pair.params[1].unsafeGetTensorImpl()));
  CHECK(s3.step() == 5);
  CHECK(s1.step() == 6);
}

TEST_CASE("Replaced or loaded state is adopted into a flat buffer again", "[optim]") {
  Pair pair(kShapes);
  const auto options = AdamWOptions(1e-2).amsgrad(true);
  fsdp::optim::AdamW flat(pair.params, options);
  torch::optim::AdamW ref(pair.ref, options);
  for (int it = 0; it < 2; ++it) {
    pair.set_grads(it);
    flat.step();
    ref.step();
  }
  // The user replaces one state tensor (same values): the next step adopts it.
  auto& s = static_cast<torch::optim::AdamWParamState&>(*flat.state().at(pair.params[2].unsafeGetTensorImpl()));
  s.exp_avg(s.exp_avg().clone());
  pair.set_grads(2);
  flat.step();
  ref.step();
  CHECK(flat.last_step().adopted == 1);
  check_equal(pair, flat, ref);
  // Writes into a state tensor reach the buffer (it is a view): the same write on both sides.
  auto& r = static_cast<torch::optim::AdamWParamState&>(*ref.state().at(pair.ref[5].unsafeGetTensorImpl()));
  static_cast<torch::optim::AdamWParamState&>(*flat.state().at(pair.params[5].unsafeGetTensorImpl())).exp_avg().mul_(2);
  r.exp_avg().mul_(2);
  pair.set_grads(3);
  flat.step();
  ref.step();
  CHECK(flat.last_step().adopted == 0);
  check_equal(pair, flat, ref);

  // save/load across the two kinds: the flat optimizer's archive into torch::optim and back.
  std::stringstream flat_saved, ref_saved;
  torch::save(flat, flat_saved);
  torch::save(ref, ref_saved);
  Pair other(kShapes);  // a second copy of the same parameters
  fsdp::optim::AdamW flat2(other.params, options);
  torch::optim::AdamW ref2(other.ref, options);
  torch::load(flat2, ref_saved);  // torch::optim's archive into the flat optimizer
  torch::load(ref2, flat_saved);  // and the other way
  for (size_t i = 0; i < other.params.size(); ++i) {
    torch::NoGradGuard no_grad;
    other.params[i].copy_(pair.params[i]);
    other.ref[i].copy_(pair.ref[i]);
  }
  for (int it = 4; it < 7; ++it) {
    other.set_grads(it);
    flat2.step();
    ref2.step();
    if (it == 4) CHECK(flat2.last_step().adopted == 3);
    check_equal(other, flat2, ref2);
  }
}

TEST_CASE("Plain LibTorch modules: every parameter alone, the same values", "[optim]") {
  torch::manual_seed(0);
  torch::nn::Linear a(5, 7), b(5, 7);
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < a->parameters().size(); ++i) b->parameters()[i].copy_(a->parameters()[i]);
  }
  fsdp::optim::SGD flat(a->parameters(), SGDOptions(0.1).momentum(0.9).nesterov(true));
  torch::optim::SGD ref(b->parameters(), SGDOptions(0.1).momentum(0.9).nesterov(true));
  for (int it = 0; it < 3; ++it) {
    const at::Tensor x = torch::randn({4, 5});
    a(x).square().sum().backward();
    b(x).square().sum().backward();
    flat.step();
    ref.step();
    flat.zero_grad();
    ref.zero_grad();
    CHECK(flat.last_step().flat_runs == 0);
    CHECK(flat.last_step().packed_params == 2);  // small parameters of separate storages: a pack
    for (size_t i = 0; i < 2; ++i) CHECK(torch::equal(a->parameters()[i], b->parameters()[i]));
    CHECK_FALSE(a->parameters()[0].grad().defined());
  }
}

TEST_CASE("Runs: eps == 0 allows no padding; empty parameters; closures", "[optim]") {
  SECTION("Adam with eps == 0 steps only unpadded neighbours together") {
    // {20000}, {8} and {3} are adjacent without padding, {3} is followed by padding.
    Pair pair(std::vector<std::vector<int64_t>>{{20000}, {8}, {3}, {5}});
    fsdp::optim::Adam flat(pair.params, AdamOptions(1e-2).eps(0));
    torch::optim::Adam ref(pair.ref, AdamOptions(1e-2).eps(0));
    pair.set_grads(0);
    flat.step();
    ref.step();
    CHECK(flat.last_step().flat_runs == 1);
    CHECK(flat.last_step().flat_params == 3);    // {20000}, {8}, {3}
    CHECK(flat.last_step().packed_params == 1);  // {5}, after the padding: small, packed
    check_equal(pair, flat, ref);
    CHECK_FALSE(pair.flat.isnan().any().item<bool>());
  }
  SECTION("an empty parameter inside a run: its step counter and empty state as torch::optim's") {
    Pair pair(std::vector<std::vector<int64_t>>{{20000}, {0}, {10}});
    fsdp::optim::AdamW flat(pair.params, AdamWOptions(1e-2));
    torch::optim::AdamW ref(pair.ref, AdamWOptions(1e-2));
    for (int it = 0; it < 2; ++it) {
      pair.set_grads(it);
      flat.step();
      ref.step();
      CHECK(flat.last_step().flat_params == 2);    // {20000}, {10}: the empty one splits nothing
      CHECK(flat.last_step().packed_params == 1);  // the empty one, packed (no elements)
      check_equal(pair, flat, ref);
    }
  }
  SECTION("the closure runs with gradients enabled and its loss is returned") {
    Pair pair(std::vector<std::vector<int64_t>>{{6}, {10}});
    fsdp::optim::SGD flat(pair.params, SGDOptions(0.1));
    torch::optim::SGD ref(pair.ref, SGDOptions(0.1));
    auto closure = [](std::vector<at::Tensor> ps) {
      return [ps] {
        at::Tensor loss = ps[0].square().sum() + ps[1].sum();
        for (const auto& p : ps) p.mutable_grad() = at::Tensor();
        loss.backward();
        return loss;
      };
    };
    const at::Tensor loss = flat.step(closure(pair.params));
    const at::Tensor ref_loss = ref.step(closure(pair.ref));
    CHECK(torch::equal(loss, ref_loss));
    check_equal(pair, flat, ref);
  }
}

TEST_CASE("Packs: small parameters of separate storages and dtypes, stepped as one tensor per dtype", "[optim]") {
  auto make = [](uint64_t seed) {
    auto gen = at::detail::createCPUGenerator(seed);
    std::vector<at::Tensor> ps;
    for (int64_t n : {5, 1, 300, 17, 64}) ps.push_back(at::randn({n}, gen).requires_grad_(true));
    for (int64_t n : {9, 2}) ps.push_back(at::randn({n}, gen).to(at::kDouble).requires_grad_(true));
    ps.push_back(at::randn({20000}, gen).requires_grad_(true));  // above the pack limit: alone
    return ps;
  };
  auto flat_params = make(3);
  auto ref_params = make(3);
  fsdp::optim::Adam flat(flat_params, AdamOptions(1e-2).amsgrad(true).weight_decay(0.1));
  torch::optim::Adam ref(ref_params, AdamOptions(1e-2).amsgrad(true).weight_decay(0.1));
  for (int it = 0; it < 5; ++it) {
    auto gen = at::detail::createCPUGenerator(50 + it);
    for (size_t i = 0; i < flat_params.size(); ++i) {
      const bool missing = (it == 2 && i == 1) || (it == 3 && i == 5);
      at::Tensor g = at::randn(flat_params[i].sizes(), gen).to(flat_params[i].scalar_type());
      flat_params[i].mutable_grad() = missing ? at::Tensor() : g;
      ref_params[i].mutable_grad() = missing ? at::Tensor() : g.clone();
    }
    flat.step();
    ref.step();
    INFO("step " << it);
    CHECK(flat.last_step().packs == 2);
    CHECK(flat.last_step().single_params == 1);
    for (size_t i = 0; i < flat_params.size(); ++i) {
      INFO("parameter " << i);
      CHECK(torch::equal(flat_params[i].detach(), ref_params[i].detach()));
      auto& fs = static_cast<torch::optim::AdamParamState&>(*flat.state().at(flat_params[i].unsafeGetTensorImpl()));
      auto& rs = static_cast<torch::optim::AdamParamState&>(*ref.state().at(ref_params[i].unsafeGetTensorImpl()));
      CHECK(fs.step() == rs.step());
      CHECK(torch::equal(fs.exp_avg(), rs.exp_avg()));
      CHECK(torch::equal(fs.max_exp_avg_sq(), rs.max_exp_avg_sq()));
    }
  }
  // The version counters moved as torch::optim's in-place updates move them.
  CHECK(flat_params[0]._version() == ref_params[0]._version());
}
