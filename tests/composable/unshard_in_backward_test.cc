// FSDPModule::set_unshard_in_backward(false) ([Note: unshard in backward] in fsdp/backward.cc) and
// the per-pass comparison of the gradient controls across ranks ([Note: backward reach]), over
// MPI on every world size:
//   - an embedding unit whose backward needs no weight values trains like the unsharded reference
//     (SGD with momentum, 3 steps), with one all-gather fewer per step and no unsharded memory in
//     its backward;
//   - a unit whose forward saves its weights for backward is refused in forward on every rank,
//     naming it, and training goes on (equal to the reference) once the control is set back;
//   - a control set on some ranks only (unshard_in_backward, a divide factor, gradient sync) is
//     refused on every rank when the backward pass begins, naming the unit, with nothing reduced.
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/optim/sgd.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/fully_shard_internal.h"
#include "fsdp_cpp/composable/summon_full_params.h"
#include "fsdp_cpp/contract/hookable_module_holder.h"
#include "fsdp_cpp/contract/hookable_modules.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace fsdp::testing {

/// tokens -> Embedding(13, 8) -> Linear(8, 8) -> tanh -> Linear(8, 3).
struct EmbedMlpImpl : torch::nn::Module {
  EmbedMlpImpl() {
    emb = register_module("emb", contract::Embedding(13, 8));
    body = register_module("body", contract::Linear(8, 8));
    head = register_module("head", contract::Linear(8, 3));
  }
  torch::Tensor forward(torch::Tensor tokens) { return head(torch::tanh(body(emb(tokens)))); }
  contract::Embedding emb{nullptr};
  contract::Linear body{nullptr}, head{nullptr};
};
FSDP_HOOKABLE_MODULE(EmbedMlp);

}  // namespace fsdp::testing

namespace {

using Catch::Matchers::Contains;
using fsdp::comm::CollectiveKind;
using fsdp::testing::fresh_comm;
using fsdp::testing::EmbedMlp;
using fsdp::testing::rank;
using fsdp::testing::world;
using fsdp::testing::world_size;

EmbedMlp make_model() {
  torch::manual_seed(99);
  return EmbedMlp();
}

at::Tensor tokens(int64_t step, int q) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(500 + 10 * step + q));
  return at::randint(0, 13, {6}, gen, at::kLong);
}

at::Tensor target(int64_t step, int q) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(900 + 10 * step + q));
  return at::randn({6, 3}, gen);
}

at::Tensor loss_of(EmbedMlp& model, int64_t step, int q) {
  return torch::nn::functional::mse_loss(model(tokens(step, q)), target(step, q));
}

struct Sharded {
  EmbedMlp model = make_model();
  std::shared_ptr<fsdp::comm::Communicator> comm = fresh_comm();
  fsdp::FSDPModule emb{nullptr}, body{nullptr}, root{nullptr};
  Sharded() {
    auto options = fsdp::FullyShardOptions().communicator(comm);
    emb = fsdp::fully_shard(*model->emb, options);
    body = fsdp::fully_shard(*model->body, options);
    root = fsdp::fully_shard(*model, options);
  }
};

// The reference: an unsharded copy trained with the same optimizer on the mean over the ranks'
// losses of `steps` steps (the DDP average), no library code.
std::vector<at::Tensor> reference_after(const std::vector<int64_t>& steps) {
  EmbedMlp model = make_model();
  torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int64_t step : steps) {
    optim.zero_grad();
    at::Tensor loss = loss_of(model, step, 0);
    for (int q = 1; q < world_size(); ++q) loss = loss + loss_of(model, step, q);
    (loss / world_size()).backward();
    optim.step();
  }
  std::vector<at::Tensor> values;
  for (const auto& p : model->parameters()) values.push_back(p.detach().clone());
  return values;
}

void check_equals_reference(Sharded& s, const std::vector<at::Tensor>& reference) {
  fsdp::SummonFullParams full(s.root, fsdp::SummonFullParamsOptions().writeback(false));
  const auto params = s.model->parameters();
  REQUIRE(params.size() == reference.size());
  for (size_t i = 0; i < params.size(); ++i) {
    INFO("parameter " << i);
    CHECK(at::allclose(params[i].detach(), reference[i], 1e-5, 1e-6));
  }
}

FSDP_RANKS_TEST_CASE("an embedding unit that does not unshard in backward trains like the reference, one all-gather fewer",
                     "[unshard_in_backward][parity]") {
  Sharded s;
  CHECK(s.emb.unshard_in_backward());
  s.emb.set_unshard_in_backward(false);
  CHECK_FALSE(s.emb.unshard_in_backward());
  CHECK(s.body.unshard_in_backward());  // this unit only
  torch::optim::SGD optim(s.model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  const auto& emb_handles = fsdp::detail::handles_of(s.emb);
  for (int64_t step = 0; step < 3; ++step) {
    optim.zero_grad();
    s.comm->reset_stats();
    at::Tensor loss = loss_of(s.model, step, rank());
    // In the embedding's backward (a hook on its weight runs when autograd computes the weight's
    // gradient, after the unit's pre-backward): full-shape parameters over a buffer of no memory.
    int64_t unsharded_in_backward = -1;
    std::vector<int64_t> weight_shape;
    auto hook = s.model->emb->weight.register_hook([&](const at::Tensor& grad) {
      unsharded_in_backward = 0;
      for (const auto& h : emb_handles) unsharded_in_backward += static_cast<int64_t>(h->unsharded_bytes());
      weight_shape = s.model->emb->weight.sizes().vec();
      return grad;
    });
    loss.backward();
    s.model->emb->weight.remove_hook(hook);
    optim.step();
    CHECK(unsharded_in_backward == 0);
    CHECK(weight_shape == std::vector<int64_t>{13, 8});
    if (world_size() > 1) {
      // Forward: the root, emb and body over the shard group; backward: body only (the root
      // stays unsharded; the embedding gathers nothing).
      CHECK(s.comm->stats(CollectiveKind::kAllGather).calls == 3 + 1);
    }
    for (const auto& h : emb_handles) CHECK(h->unsharded_bytes() == 0);
  }
  check_equals_reference(s, reference_after({0, 1, 2}));
}

FSDP_RANKS_TEST_CASE("a unit whose backward reads its weights is refused on every rank without unshard_in_backward, and trains after",
                     "[unshard_in_backward][misuse]") {
  Sharded s;
  s.body.set_unshard_in_backward(false);  // a Linear's input gradient needs its weight
  torch::optim::SGD optim(s.model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  if (world_size() > 1) {
    optim.zero_grad();
    // Refused in forward, once the unit's parameters are sharded again: its forward saved
    // weight.t() for backward.
    CHECK_THROWS_WITH(loss_of(s.model, 0, rank()), Contains("unit 'body' was set to skip its backward all-gather") &&
                                                      Contains("saved views of its parameters") &&
                                                      Contains("set_unshard_in_backward(true)"));
  } else {
    // One rank: nothing is sharded, the parameters always hold their values.
    optim.zero_grad();
    loss_of(s.model, 0, rank()).backward();
    optim.step();
  }
  s.body.set_unshard_in_backward(true);
  const std::vector<int64_t> steps = world_size() > 1 ? std::vector<int64_t>{1, 2} : std::vector<int64_t>{0, 1, 2};
  for (int64_t step : steps) {
    if (world_size() == 1 && step == 0) continue;  // stepped above
    optim.zero_grad();
    loss_of(s.model, step, rank()).backward();
    optim.step();
  }
  check_equals_reference(s, reference_after(world_size() > 1 ? std::vector<int64_t>{1, 2} : std::vector<int64_t>{0, 1, 2}));
}

FSDP_RANKS_TEST_CASE("a gradient control set on some ranks only is refused on every rank when backward begins",
                     "[unshard_in_backward][divergence]") {
  const int W = world_size();
  for (int which = 0; which < 3; ++which) {
    INFO("control " << which);
    Sharded s;
    torch::optim::SGD optim(s.model->parameters(), torch::optim::SGDOptions(0.1));
    // An agreeing step first: the check runs in every iteration, not only the first.
    optim.zero_grad();
    loss_of(s.model, 0, rank()).backward();
    optim.step();
    if (rank() == W - 1) {
      if (which == 0) s.emb.set_unshard_in_backward(false);
      if (which == 1) s.body.set_gradient_divide_factor(2.0, /*recurse=*/false);
      if (which == 2) s.body.set_requires_gradient_sync(false, /*recurse=*/false);
    }
    const std::string unit = which == 0 ? "emb" : "body";
    optim.zero_grad();
    const at::Tensor loss = loss_of(s.model, 1, rank());
    if (W == 1) {
      loss.backward();  // one rank agrees with itself
      continue;
    }
    CHECK_THROWS_WITH(loss.backward(), Contains("the ranks set different controls on unit '" + unit + "'") &&
                                           Contains("nothing was reduced"));
    // Set alike again, training goes on.
    if (rank() == W - 1) {
      s.emb.set_unshard_in_backward(true);
      s.body.set_requires_gradient_sync(true, false);
      if (which == 1) s.body.set_gradient_divide_factor(static_cast<double>(W), false);
    }
    if (which == 1) s.body.set_gradient_divide_factor(static_cast<double>(W), false);
    optim.zero_grad();
    loss_of(s.model, 2, rank()).backward();
    optim.step();
  }
}

}  // namespace
