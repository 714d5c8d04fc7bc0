// FSDPModule::zero_grad ([Note: discarding accumulated gradients] in fsdp/zero_grad.h), over MPI
// on every world size: a step abandoned after some microbatches must not leak into the next update.
//   (a) plain fully_shard: two microbatches without gradient sync, then root.zero_grad(), then a
//       full step: the parameters equal a run without the abandoned microbatches and the unsharded
//       reference; optimizer.zero_grad() alone leaks them (differs) wherever an accumulator exists
//       (several ranks; on one rank autograd accumulates into `.grad` itself, which it clears);
//   (b) HSDP with set_requires_all_reduce(false) (every mesh with 2 or more replicas: 2 x 1 on 2
//       ranks, 3 x 1 on 3, 4 x 1 and 2 x 2 on 4): the replicate partial is discarded alike;
//   (c) ranks that disagree (one discarded, its peers did not) are refused on every rank when the
//       next backward pass begins, naming the unit and zero_grad; discarding on the others too
//       recovers;
//   (d) set_to_none(false) zeroes `.grad` in place; a call inside a backward pass, a forward or a
//       SummonFullParams scope is refused, and zero_grad after a backward that threw abandons it.
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include "fsdp_cpp/comm/device_mesh.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/fully_shard_internal.h"
#include "fsdp_cpp/composable/summon_full_params.h"
#include "fsdp_cpp/contract/forward_hooks.h"
#include "fsdp_cpp/tests/composable/parity.h"
#include "fsdp_cpp/tests/composable/test_models.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::testing::MlpStack;
using fsdp::testing::rank;
using fsdp::testing::world;
using fsdp::testing::world_size;

using Params = std::map<std::string, at::Tensor>;

MlpStack make_model() {
  torch::manual_seed(77);
  return MlpStack(6, 8, 16, 3, 3);
}

// Microbatch `id` of data-parallel rank q.
std::pair<at::Tensor, at::Tensor> microbatch(int id, int q) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(7919 * id + 31 * q + 5));
  return {at::randn({4, 6}, gen), at::randn({4, 3}, gen)};
}

at::Tensor loss_of(MlpStack& model, int id, int q) {
  const auto [x, y] = microbatch(id, q);
  return torch::nn::functional::mse_loss(model(x), y);
}

Params full_params(const fsdp::FSDPModule& root, torch::nn::Module& model) {
  Params params;
  fsdp::SummonFullParams full(root, fsdp::SummonFullParamsOptions().writeback(false));
  for (const auto& item : model.named_parameters()) params[item.key()] = item.value().detach().clone();
  return params;
}

bool all_close(const Params& a, const Params& b, double rtol = 1e-5, double atol = 1e-6) {
  REQUIRE(a.size() == b.size());
  bool close = true;
  for (const auto& [key, t] : a) close &= at::allclose(t, b.at(key), rtol, atol);
  return close;
}

// Abandoned microbatches (ids 100, 101) then a full step of two microbatches (ids 0 and 1, the
// first without sync), two steps in all; what happens to the abandoned gradients is `discard`.
enum class Discard { kNoAbandonedMicrobatches, kRootZeroGrad, kOptimizerZeroGradOnly };

struct Run {
  std::function<void(fsdp::FSDPModule&)> before_abandoned = [](fsdp::FSDPModule& root) {
    root.set_requires_gradient_sync(false);
  };
  std::function<void(fsdp::FSDPModule&)> restore = [](fsdp::FSDPModule& root) {
    root.set_requires_gradient_sync(true);
  };
  fsdp::FullyShardOptions options;
  int data_rank = -1;  // the data-parallel index of this rank's batches (default: its rank)
};

Params train(const Run& run, Discard discard) {
  MlpStack model = make_model();
  auto units = fsdp::testing::shard_stack(model, run.options);
  fsdp::FSDPModule& root = units.back();
  torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  const int q = run.data_rank >= 0 ? run.data_rank : rank();
  for (int step = 0; step < 2; ++step) {
    if (discard != Discard::kNoAbandonedMicrobatches) {
      run.before_abandoned(root);
      for (int m = 0; m < 2; ++m) loss_of(model, 100 + 10 * step + m, q).backward();
      run.restore(root);
      if (discard == Discard::kRootZeroGrad) {
        root.zero_grad();
        for (const auto& u : units) {
          for (const auto& h : fsdp::detail::handles_of(u)) {
            CHECK(h->accumulated_grad_bytes() == 0);
            CHECK(h->replicate_partial_grad_bytes() == 0);
          }
          CHECK(u.sharded_grad_bytes() == 0);
        }
      } else {
        optim.zero_grad();
      }
    }
    root.set_requires_gradient_sync(false);
    loss_of(model, 10 * step, q).backward();
    root.set_requires_gradient_sync(true);
    loss_of(model, 10 * step + 1, q).backward();
    optim.step();
    optim.zero_grad();
  }
  return full_params(root, *model);
}

// The unsharded reference without the library: every data-parallel rank's two microbatches of
// each step, averaged over `replicas` ranks (each backward's loss is a mean over its rows).
Params reference(int replicas) {
  MlpStack model = make_model();
  torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < 2; ++step) {
    for (int q = 0; q < replicas; ++q) {
      for (int m = 0; m < 2; ++m) (loss_of(model, 10 * step + m, q) / replicas).backward();
    }
    optim.step();
    optim.zero_grad();
  }
  Params params;
  for (const auto& item : model->named_parameters()) params[item.key()] = item.value().detach().clone();
  return params;
}

// Whether any handle of the root's tree would keep an accumulator (not a passthrough).
bool has_accumulator(const fsdp::FullyShardOptions& options) {
  MlpStack model = make_model();
  auto units = fsdp::testing::shard_stack(model, options);
  for (const auto& u : units) {
    for (const auto& h : fsdp::detail::handles_of(u)) {
      if (!h->passthrough()) return true;
    }
  }
  return false;
}

}  // namespace

FSDP_RANKS_TEST_CASE("zero_grad discards the gradients accumulated without sync: an abandoned step does not leak",
                     "[zero_grad]") {
  Run run;
  run.options = fsdp::FullyShardOptions().communicator(fsdp::testing::fresh_comm());
  const Params without = train(run, Discard::kNoAbandonedMicrobatches);
  const Params discarded = train(run, Discard::kRootZeroGrad);
  const Params leaked = train(run, Discard::kOptimizerZeroGradOnly);
  CHECK(all_close(discarded, without, 1e-6, 1e-7));
  CHECK(all_close(discarded, reference(world_size())));
  if (has_accumulator(run.options)) {
    // optimizer.zero_grad() does not see the no-sync accumulator: the abandoned microbatches leak.
    CHECK_FALSE(all_close(leaked, without, 1e-4, 1e-5));
  } else {
    // One rank: every handle is a passthrough, autograd accumulates into `.grad` itself, and
    // optimizer.zero_grad() clears it: nothing to leak.
    REQUIRE(world_size() == 1);
    CHECK(all_close(leaked, without, 1e-6, 1e-7));
  }
}

FSDP_RANKS_TEST_CASE("zero_grad discards HSDP's replicate partial (set_requires_all_reduce(false))",
                     "[zero_grad][hsdp]") {
  const int W = world_size();
  int meshes = 0;
  for (int shard_size = 1; shard_size <= W; ++shard_size) {
    if (W % shard_size != 0 || W / shard_size < 2) continue;  // a replicate group of 2 or more ranks
    ++meshes;
    INFO(W << " ranks, mesh " << W / shard_size << " x " << shard_size);
    Run run;
    run.options = fsdp::FullyShardOptions().mesh(fsdp::comm::DeviceMesh::hybrid(world(), shard_size));
    run.before_abandoned = [](fsdp::FSDPModule& root) { root.set_requires_all_reduce(false); };
    run.restore = [](fsdp::FSDPModule& root) { root.set_requires_all_reduce(true); };
    const Params without = train(run, Discard::kNoAbandonedMicrobatches);
    const Params discarded = train(run, Discard::kRootZeroGrad);
    const Params leaked = train(run, Discard::kOptimizerZeroGradOnly);
    CHECK(all_close(discarded, without, 1e-6, 1e-7));
    CHECK(all_close(discarded, reference(W)));
    // optimizer.zero_grad() does not see the replicate partial: the abandoned microbatches leak.
    CHECK_FALSE(all_close(leaked, without, 1e-4, 1e-5));
  }
  // One rank has no replicas; 2, 3 and 4 ranks have 1, 1 and 2 meshes with replicas.
  CHECK(meshes == (W == 1 ? 0 : W == 4 ? 2 : 1));
}

FSDP_RANKS_TEST_CASE("ranks that disagree on discarding are refused on every rank at the next backward",
                     "[zero_grad][divergence]") {
  const int W = world_size();
  struct Layout {
    std::string name;
    fsdp::FullyShardOptions options;
    std::function<void(fsdp::FSDPModule&, bool)> accumulate;  // true: hold the gradients back
  };
  std::vector<Layout> layouts;
  layouts.push_back({"no sync", fsdp::FullyShardOptions().communicator(fsdp::testing::fresh_comm()),
                     [](fsdp::FSDPModule& root, bool hold) { root.set_requires_gradient_sync(!hold); }});
  if (W == 2 || W == 4) {
    layouts.push_back({"HSDP without the all-reduce, mesh 2 x " + std::to_string(W / 2),
                       fsdp::FullyShardOptions().mesh(fsdp::comm::DeviceMesh::hybrid(world(), W / 2)),
                       [](fsdp::FSDPModule& root, bool hold) { root.set_requires_all_reduce(!hold); }});
  }
  for (const auto& layout : layouts) {
    INFO(W << " ranks, " << layout.name);
    MlpStack model = make_model();
    auto units = fsdp::testing::shard_stack(model, layout.options);
    fsdp::FSDPModule& root = units.back();
    torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.1));
    layout.accumulate(root, true);
    loss_of(model, 100, rank()).backward();
    layout.accumulate(root, false);
    if (rank() == 0) {
      root.zero_grad();
    } else {
      optim.zero_grad();
    }
    const std::string e = fsdp::testing::error_of([&] { loss_of(model, 0, rank()).backward(); });
    if (W == 1) {
      // One rank: nothing to compare (and nothing was accumulated: autograd wrote `.grad`).
      CHECK(e == fsdp::testing::kNoError);
      continue;
    }
    CHECK_THAT(e, Contains("fully_shard: the ranks set different controls on unit '<root>'") &&
                      Contains("FSDPModule::zero_grad dropped gradients of passes not yet reduced on some ranks only") &&
                      Contains("discarded by zero_grad 0 times"));
    // Each rank lists the settings of its own groups' ranks: on the 2 x 2 mesh, rank 3 shares no
    // group with rank 0 (it learns of the difference through the reduced hashes).
    const bool shares_a_group_with_rank0 = !(layout.options.mesh() && W == 4 && rank() == 3);
    if (shares_a_group_with_rank0) CHECK_THAT(e, Contains("discarded by zero_grad 1 times"));
    // Each rank lists its own groups' settings: the same text on every rank without a mesh.
    const bool same = fsdp::testing::same_on_every_rank(e);
    if (!layout.options.mesh() || W == 2) CHECK(same);
    // The ranks that kept theirs discard them too: the counts agree again, and a step trains as if
    // the abandoned microbatch never ran.
    root.zero_grad();
    optim.zero_grad();
    loss_of(model, 0, rank()).backward();
    optim.step();
    MlpStack ref = make_model();
    torch::optim::SGD ref_optim(ref->parameters(), torch::optim::SGDOptions(0.1));
    for (int q = 0; q < W; ++q) (loss_of(ref, 0, q) / W).backward();
    ref_optim.step();
    Params expected;
    for (const auto& item : ref->named_parameters()) expected[item.key()] = item.value().detach();
    CHECK(all_close(full_params(root, *model), expected));
  }
}

FSDP_RANKS_TEST_CASE("zero_grad(false) zeroes the gradients in place; inside a backward pass it is refused",
                     "[zero_grad]") {
  MlpStack model = make_model();
  auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(fsdp::testing::fresh_comm()));
  fsdp::FSDPModule& root = units.back();
  root.set_requires_gradient_sync(false);
  loss_of(model, 100, rank()).backward();  // accumulated (several ranks) or in `.grad` (one rank)
  root.set_requires_gradient_sync(true);
  loss_of(model, 0, rank()).backward();
  for (const auto& p : model->parameters()) REQUIRE(p.grad().defined());
  root.zero_grad(/*set_to_none=*/false);
  for (const auto& p : model->parameters()) {
    REQUIRE(p.grad().defined());
    CHECK(p.grad().abs().sum().item<double>() == 0.0);
  }
  for (const auto& u : units) {
    for (const auto& h : fsdp::detail::handles_of(u)) CHECK(h->accumulated_grad_bytes() == 0);
  }

  // From a hook inside backward (after the root's pre-backward began the pass).
  at::Tensor out = model(microbatch(1, rank()).first);
  out.register_hook([&](const at::Tensor& g) {
    root.zero_grad();
    return g;
  });
  const std::string e = fsdp::testing::error_of([&] { out.pow(2).mean().backward(); });
  CHECK_THAT(e, Contains("FSDPModule::zero_grad") && Contains("unit '<root>'") &&
                    Contains("in the middle of a backward pass"));
  CHECK(fsdp::testing::same_on_every_rank(e));
  // After backward threw, zero_grad abandons the pass, and training goes on.
  root.zero_grad();
  loss_of(model, 2, rank()).backward();
  CHECK(root.sharded_grad_bytes() > 0);

  // Inside a SummonFullParams scope, and from inside a forward (a block's pre-forward hook).
  {
    fsdp::SummonFullParams full(root);
    CHECK_THAT(fsdp::testing::error_of([&] { root.zero_grad(); }),
               Contains("FSDPModule::zero_grad: unit '<root>' has its full parameters") && Contains("SummonFullParams"));
  }
  auto hook = fsdp::contract::register_forward_pre_hook(
      *model->block(1).ptr(), [&](torch::nn::Module&, fsdp::contract::ForwardArgs&) { root.zero_grad(); });
  const std::string in_forward = fsdp::testing::error_of([&] { model(microbatch(3, rank()).first); });
  hook.remove();
  CHECK_THAT(in_forward, Contains("FSDPModule::zero_grad: unit '<root>'") && Contains("in the middle of a forward"));
  // fully_shard's own refusal: no explanation of the units that had not run is added below it.
  CHECK(in_forward.find("had not run their pre-forward") == std::string::npos);
  CHECK(fsdp::testing::same_on_every_rank(in_forward));
  // The gradients were left alone; the forward that threw is abandoned by the next one.
  CHECK(root.sharded_grad_bytes() > 0);
  root.zero_grad();
  CHECK(root.sharded_grad_bytes() == 0);
  loss_of(model, 4, rank()).backward();
  CHECK(root.sharded_grad_bytes() > 0);
}
