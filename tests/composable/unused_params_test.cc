// Parameters some ranks do not use (mixture-of-experts routing, auxiliary heads, towers that get no
// input on some ranks), over MPI on every world size, against the unsharded reference of parity.h
// (gradients averaged over every rank's batch, as DDP gives them):
//   (a) experts in one unit, some of them without tokens on a rank: their gradients there are
//       zeros, and the unit reduces as in the dense case;
//   (b) an expert per unit, called with an empty batch on the ranks that route it no token;
//   (c) a unit whose forward runs on every rank but whose output is in the loss on some ranks
//       only: its backward never starts on the others, which still take part in its all-gather
//       and reduce-scatter ([Note: backward reach] in fsdp/backward_reach.h);
//   (d) a unit called on some ranks only: refused on every rank with an error naming the unit,
//       in the first (checked) iteration and in later ones, and the model trains on afterwards.
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/optim/sgd.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/contract/hookable_module_holder.h"
#include "fsdp_cpp/contract/hookable_module_list.h"
#include "fsdp_cpp/contract/hookable_modules.h"
#include "fsdp_cpp/tests/composable/parity.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::testing::error_of;
using fsdp::testing::Instance;
using fsdp::testing::Optim;
using fsdp::testing::ParityOptions;
using fsdp::testing::Scenario;

constexpr int64_t kDim = 6;
constexpr int64_t kExperts = 4;

/// down(relu(up(x)))
struct ExpertImpl : torch::nn::Module {
  explicit ExpertImpl(int64_t dim) {
    up = register_module("up", fsdp::contract::Linear(dim, 2 * dim));
    down = register_module("down", fsdp::contract::Linear(2 * dim, dim));
  }
  torch::Tensor forward(torch::Tensor x) { return down(torch::relu(up(x))); }
  fsdp::contract::Linear up{nullptr}, down{nullptr};
};
FSDP_HOOKABLE_MODULE(Expert);

/// Top-1 mixture of experts: every expert is called on every rank with the tokens routed to it
/// (possibly none). On rank q the router may not pick expert q % kExperts, so that expert gets no
/// token there whatever the data.
struct MoeImpl : torch::nn::Module {
  MoeImpl() {
    router = register_module("router", fsdp::contract::Linear(kDim, kExperts));
    experts = register_module("experts", fsdp::contract::ModuleList());
    for (int64_t e = 0; e < kExperts; ++e) experts->push_back(Expert(kDim));
    head = register_module("head", fsdp::contract::Linear(kDim, kDim));
  }
  torch::Tensor forward(torch::Tensor x, int q) {
    at::Tensor probs = torch::softmax(router(x), -1);
    at::Tensor mask = at::zeros({kExperts});
    mask[q % kExperts] = -1e9;
    const at::Tensor choice = (probs.detach() + mask).argmax(-1);
    at::Tensor out = at::zeros_like(x);
    for (int64_t e = 0; e < kExperts; ++e) {
      const at::Tensor rows = (choice == e).nonzero().squeeze(1);
      const at::Tensor weight = probs.index_select(0, rows).select(1, e).unsqueeze(1);
      out = out.index_add(0, rows, expert(e)(x.index_select(0, rows)) * weight);
    }
    return head(x + out);
  }
  Expert expert(int64_t e) const { return experts->at<Expert>(static_cast<size_t>(e)); }
  fsdp::contract::Linear router{nullptr};
  fsdp::contract::ModuleList experts{nullptr};
  fsdp::contract::Linear head{nullptr};
};
FSDP_HOOKABLE_MODULE(Moe);

/// trunk -> head, plus an auxiliary head whose output is added to the result on some ranks only.
/// `called_on(q)`: whether rank q calls aux at all; `in_loss(q)`: whether its output joins the
/// result there.
struct AuxImpl : torch::nn::Module {
  AuxImpl(std::function<bool(int)> called_on, std::function<bool(int)> in_loss)
      : called_on_(std::move(called_on)), in_loss_(std::move(in_loss)) {
    trunk = register_module("trunk", fsdp::contract::Linear(kDim, kDim));
    aux = register_module("aux", Expert(kDim));
    head = register_module("head", fsdp::contract::Linear(kDim, kDim));
  }
  torch::Tensor forward(torch::Tensor x, int q) {
    at::Tensor h = torch::tanh(trunk(x));
    at::Tensor y = head(h);
    if (called_on_(q)) {
      at::Tensor a = aux(h);
      if (in_loss_(q)) y = y + a;
    }
    return y;
  }
  std::function<bool(int)> called_on_, in_loss_;
  fsdp::contract::Linear trunk{nullptr};
  Expert aux{nullptr};
  fsdp::contract::Linear head{nullptr};
};
FSDP_HOOKABLE_MODULE(Aux);

Scenario moe_unit_per_expert() {
  return {"an expert per unit, some called with no token", kDim, kDim, [] {
            auto model = Moe();
            Instance inst;
            inst.module = model.ptr();
            inst.forward = [model](torch::Tensor x, int q) mutable { return model(x, q); };
            inst.shard = [model](const fsdp::FullyShardOptions& o) {
              std::vector<fsdp::FSDPModule> units;
              for (int64_t e = 0; e < kExperts; ++e) units.push_back(fsdp::fully_shard(model->expert(e), o));
              units.push_back(fsdp::fully_shard(model, o));
              return units;
            };
            return inst;
          }};
}

Scenario moe_experts_in_one_unit() {
  return {"every expert in one unit", kDim, kDim, [] {
            auto model = Moe();
            Instance inst;
            inst.module = model.ptr();
            inst.forward = [model](torch::Tensor x, int q) mutable { return model(x, q); };
            inst.shard = [model](const fsdp::FullyShardOptions& o) {
              std::vector<torch::nn::Module*> experts;
              for (int64_t e = 0; e < kExperts; ++e) experts.push_back(model->expert(e).ptr().get());
              std::vector<fsdp::FSDPModule> units;
              units.push_back(fsdp::fully_shard(experts, o));
              units.push_back(fsdp::fully_shard(model, o));
              return units;
            };
            return inst;
          }};
}

// (c): aux runs on every rank; its output is in the loss on even ranks only.
Scenario aux_in_loss_on_even_ranks(int unreachable_backward_all_gathers) {
  return {"a unit whose output is in the loss on even ranks only", kDim, kDim, [] {
            auto model = Aux([](int) { return true; }, [](int q) { return q % 2 == 0; });
            Instance inst;
            inst.module = model.ptr();
            inst.forward = [model](torch::Tensor x, int q) mutable { return model(x, q); };
            inst.shard = [model](const fsdp::FullyShardOptions& o) {
              std::vector<fsdp::FSDPModule> units;
              units.push_back(fsdp::fully_shard(model->aux, o));
              units.push_back(fsdp::fully_shard(model->head, o));
              units.push_back(fsdp::fully_shard(model, o));
              return units;
            };
            return inst;
          },
          0, unreachable_backward_all_gathers};
}

ParityOptions with(Optim optim, fsdp::ShardingStrategy strategy = fsdp::ShardingStrategy::kFullShard) {
  ParityOptions o;
  o.optim = optim;
  o.iterations = 4;
  o.shard_options.strategy(strategy);
  return o;
}

}  // namespace

FSDP_RANKS_TEST_CASE("unused parameters: an expert per unit, called with an empty batch on some ranks",
                     "[fully_shard][unused]") {
  fsdp::testing::run_parity(moe_unit_per_expert(), with(Optim::kAdam));
  fsdp::testing::run_parity(moe_unit_per_expert(), with(Optim::kSgdMomentum, fsdp::ShardingStrategy::kShardGradOp));
}

FSDP_RANKS_TEST_CASE("unused parameters: every expert in one unit, some without tokens on a rank",
                     "[fully_shard][unused]") {
  fsdp::testing::run_parity(moe_experts_in_one_unit(), with(Optim::kAdamW));
}

FSDP_RANKS_TEST_CASE("unused parameters: a unit whose output is in the loss on some ranks only",
                     "[fully_shard][unused]") {
  // Full shard: the unit's backward all-gather is issued on every rank (the reach of the backward
  // pass is agreed when it begins). Without resharding after forward there is none.
  fsdp::testing::run_parity(aux_in_loss_on_even_ranks(0), with(Optim::kAdam));
  fsdp::testing::run_parity(aux_in_loss_on_even_ranks(0), with(Optim::kAdam, fsdp::ShardingStrategy::kShardGradOp));
}

FSDP_RANKS_TEST_CASE("unused parameters: a unit whose output is in the loss on no rank is not reduced",
                     "[fully_shard][unused]") {
  const int W = fsdp::testing::world_size();
  torch::manual_seed(0);
  auto model = Aux([](int) { return true; }, [](int) { return false; });
  auto comm = std::make_shared<fsdp::comm::Communicator>(fsdp::testing::world().backend(), at::kCPU);
  fsdp::FullyShardOptions o;
  o.communicator(comm);
  fsdp::fully_shard(model->aux, o);
  fsdp::fully_shard(model->head, o);
  fsdp::fully_shard(model, o);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  const at::Tensor aux_before = model->aux->up->weight.detach().clone();
  for (int it = 0; it < 3; ++it) {
    comm->reset_stats();
    model(at::randn({5, kDim}), fsdp::testing::rank()).square().mean().backward();
    // As in local training: no gradient at all, so the optimizer leaves the unit alone (zeros
    // would still move it through SGD's momentum).
    for (const auto& p : model->aux->parameters()) CHECK_FALSE(p.grad().defined());
    for (const auto& p : model->head->parameters()) CHECK(p.grad().defined());
    if (W > 1) {
      // head and the root reduce; aux neither all-gathers for backward nor reduces.
      CHECK(comm->stats(fsdp::comm::CollectiveKind::kReduceScatter).calls == 2);
      CHECK(comm->stats(fsdp::comm::CollectiveKind::kAllGather).calls == 3 + 1);  // forward 3, head again
    }
    opt.step();
    opt.zero_grad();
  }
  CHECK(model->aux->up->weight.detach().equal(aux_before));
}

FSDP_RANKS_TEST_CASE("unused parameters: a unit called on some ranks only is refused on every rank",
                     "[fully_shard][unused]") {
  const int W = fsdp::testing::world_size();
  const int r = fsdp::testing::rank();
  torch::manual_seed(0);
  // Rank 1 does not call aux in iterations 0 (checked: [Note: divergence check]) and 3 (unchecked:
  // the MPI backend's check of each collective refuses it); every rank calls it otherwise.
  int iteration = 0;
  const auto skips = [&](int q) { return q == 1 && (iteration == 0 || iteration == 3); };
  auto model = Aux([&](int q) { return !skips(q); }, [](int) { return true; });
  fsdp::FullyShardOptions o;
  o.communicator(std::make_shared<fsdp::comm::Communicator>(fsdp::testing::world().backend(), at::kCPU));
  fsdp::fully_shard(model->aux, o);
  fsdp::fully_shard(model->head, o);
  fsdp::fully_shard(model, o);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  for (iteration = 0; iteration < 6; ++iteration) {
    const std::string message = error_of([&] {
      at::Tensor x = at::randn({5, kDim});
      model(x, r).square().mean().backward();
      opt.step();
      opt.zero_grad();
    });
    INFO("iteration " << iteration << ": " << message);
    const bool diverges = W > 1 && (iteration == 0 || iteration == 3);
    if (!diverges) {
      CHECK(message == fsdp::testing::kNoError);
      continue;
    }
    CHECK_THAT(message, Contains("differ"));
    // Every rank's error names the unit: the divergence check names the ranks and units that
    // differ; the MPI check names the unit this rank issued the collective for.
    if (iteration == 0 || r != 1) CHECK_THAT(message, Contains("aux"));
  }
}
