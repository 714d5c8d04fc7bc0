// fully_shard training parity over MPI on every world size of the launch: the sharded model and an
// unsharded reference (same initial weights on every rank; gradients averaged over all ranks'
// batches, DDP semantics, computed without the library) give the same loss every iteration and the
// same parameters after training: bit-exact on 1 rank, within rtol 1e-5 / atol 1e-6 otherwise.
// Also checked every iteration: FQNs and parameter objects unchanged, no unsharded storage outside
// forward/backward, and the collective counts per handle.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "composable/fully_shard.h"
#include "tests/composable/test_models.h"
#include "tests/testing/multi_rank.h"

namespace {

using fsdp::comm::CollectiveKind;
using fsdp::testing::rank;
using fsdp::testing::world;
using fsdp::testing::world_size;

// One model instance and how to run and shard it.
struct Instance {
  std::shared_ptr<torch::nn::Module> module;
  // Forward on rank q's batch (a model may behave differently per rank).
  std::function<torch::Tensor(torch::Tensor, int)> forward;
  // Applies fully_shard bottom-up; returns the units, the root last.
  std::function<std::vector<fsdp::FSDPModule>(const fsdp::FullyShardOptions&)> shard;
};

struct Scenario {
  std::string name;
  int64_t in_dim;
  int64_t out_dim;
  std::function<Instance()> make;
};

enum class Optim { kSgdMomentum, kAdam, kAdamW };

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Optim kind, std::vector<at::Tensor> params) {
  switch (kind) {
    case Optim::kSgdMomentum:
      return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9));
    case Optim::kAdam:
      return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2));
    case Optim::kAdamW:
      return std::make_unique<torch::optim::AdamW>(
          params, torch::optim::AdamWOptions(1e-2).weight_decay(0.05));
  }
  return nullptr;
}

at::Tensor batch(int64_t iteration, int q, int64_t rows, int64_t cols, int salt) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(100000 * salt + 100 * iteration + q));
  return at::randn({rows, cols}, gen);
}

bool close(const at::Tensor& a, const at::Tensor& b, bool exact) {
  if (exact) return a.equal(b);
  return at::allclose(a, b, 1e-5, 1e-6);
}

std::vector<std::string> keys_of(const torch::nn::Module& m) {
  std::vector<std::string> keys;
  for (const auto& item : m.named_parameters()) keys.push_back(item.key());
  return keys;
}

// `micro_batches` backward passes accumulate into the gradients before each optimizer step.
void run_parity(const Scenario& scenario, Optim optim, bool set_to_none, int micro_batches = 1,
                int iterations = 4) {
  const int W = world_size();
  const bool exact = W == 1;
  INFO(scenario.name << ", optimizer " << static_cast<int>(optim) << ", set_to_none " << set_to_none
                     << ", " << micro_batches << " micro-batch(es), " << W << " ranks");
  torch::manual_seed(1234);
  Instance sharded = scenario.make();
  torch::manual_seed(1234);
  Instance reference = scenario.make();

  const auto keys_before = keys_of(*sharded.module);
  std::vector<const void*> impls_before;
  for (const auto& p : sharded.module->parameters()) impls_before.push_back(p.unsafeGetTensorImpl());

  auto comm = std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
  auto units = sharded.shard(fsdp::FullyShardOptions().communicator(comm));
  REQUIRE(!units.empty());

  CHECK(keys_of(*sharded.module) == keys_before);
  auto opt = make_optimizer(optim, sharded.module->parameters());
  auto ref_opt = make_optimizer(optim, reference.module->parameters());
  std::vector<const void*> impls_in_optimizer;
  for (const auto& p : opt->param_groups()[0].params()) impls_in_optimizer.push_back(p.unsafeGetTensorImpl());
  CHECK(impls_in_optimizer == impls_before);

  int64_t expected_all_gathers = 0;
  int64_t expected_reduce_scatters = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    const bool is_root = u + 1 == units.size();
    for (const auto& h : units[u].handles()) {
      // Per backward pass: forward, and again in backward unless root.
      expected_all_gathers += micro_batches * (is_root ? 1 : 2);
      expected_reduce_scatters += micro_batches * (h->requires_grad() ? 1 : 0);
    }
  }

  const int64_t rows = 5;
  for (int64_t it = 0; it < iterations; ++it) {
    const auto ag_before = comm->stats(CollectiveKind::kAllGather).calls;
    const auto rs_before = comm->stats(CollectiveKind::kReduceScatter).calls;
    at::Tensor loss;
    for (int m = 0; m < micro_batches; ++m) {
      const int64_t step = it * micro_batches + m;
      at::Tensor x = batch(step, rank(), rows, scenario.in_dim, 1);
      at::Tensor y = batch(step, rank(), rows, scenario.out_dim, 2);
      loss = torch::nn::functional::mse_loss(sharded.forward(x, rank()), y);
      loss.backward();
    }
    opt->step();
    opt->zero_grad(set_to_none);

    at::Tensor ref_loss;
    for (int m = 0; m < micro_batches; ++m) {
      const int64_t step = it * micro_batches + m;
      for (int q = 0; q < W; ++q) {
        at::Tensor lq = torch::nn::functional::mse_loss(
            reference.forward(batch(step, q, rows, scenario.in_dim, 1), q),
            batch(step, q, rows, scenario.out_dim, 2));
        (lq / W).backward();
        if (q == rank()) ref_loss = lq.detach();
      }
    }
    ref_opt->step();
    ref_opt->zero_grad(set_to_none);

    INFO("iteration " << it << ": loss " << loss.item<double>() << " reference " << ref_loss.item<double>());
    CHECK(close(loss.detach(), ref_loss, exact));
    for (const auto& u : units) {
      for (const auto& h : u.handles()) CHECK(h->unsharded_bytes() == 0);
    }
    if (it >= 1) {
      CHECK(comm->stats(CollectiveKind::kAllGather).calls - ag_before == expected_all_gathers);
      CHECK(comm->stats(CollectiveKind::kReduceScatter).calls - rs_before == expected_reduce_scatters);
    }
  }

  CHECK(keys_of(*sharded.module) == keys_before);
  for (auto& u : units) u.unshard();
  const auto ref_params = reference.module->named_parameters();
  for (const auto& item : sharded.module->named_parameters()) {
    INFO("parameter " << item.key());
    const at::Tensor& ref = ref_params[item.key()];
    REQUIRE(item.value().sizes() == ref.sizes());
    CHECK(close(item.value().detach(), ref.detach(), exact));
  }
  for (auto& u : units) u.reshard();
}

Scenario mlp_stack() {
  return {"MLP stack (a unit per block and the root)", 6, 3, [] {
            auto model = fsdp::testing::MlpStack(6, 8, 16, 3, 3);
            Instance inst;
            inst.module = model.ptr();
            inst.forward = [model](torch::Tensor x, int) mutable { return model(x); };
            inst.shard = [model](const fsdp::FullyShardOptions& o) {
              std::vector<fsdp::FSDPModule> units;
              for (size_t i = 0; i < model->blocks->size(); ++i) units.push_back(fsdp::fully_shard(model->block(i), o));
              units.push_back(fsdp::fully_shard(model, o));
              return units;
            };
            return inst;
          }};
}

Scenario nested() {
  return {"nested units at several depths", 8, 8, [] {
            auto model = fsdp::testing::make_nested_sequential();
            Instance inst;
            inst.module = model.ptr();
            inst.forward = [model](torch::Tensor x, int) mutable { return model(x); };
            inst.shard = [model](const fsdp::FullyShardOptions& o) {
              auto inner = (*model)[1].as<fsdp::contract::Sequential>();
              std::vector<fsdp::FSDPModule> units;
              units.push_back(fsdp::fully_shard(*(*inner)[1].ptr(), o));  // Lin(16,16), depth 2
              units.push_back(fsdp::fully_shard(inner, o));                // inner Seq
              units.push_back(fsdp::fully_shard(*(*model)[2].ptr(), o));   // Lin(16,4)
              units.push_back(fsdp::fully_shard(model, o));
              return units;
            };
            return inst;
          }};
}

Scenario tiny() {
  return {"parameters smaller than the world size", 3, 1, [] {
            auto model = fsdp::testing::Tiny();
            Instance inst;
            inst.module = model.ptr();
            inst.forward = [model](torch::Tensor x, int) mutable { return model(x); };
            inst.shard = [model](const fsdp::FullyShardOptions& o) {
              std::vector<fsdp::FSDPModule> units;
              units.push_back(fsdp::fully_shard(model->b, o));
              units.push_back(fsdp::fully_shard(model, o));
              return units;
            };
            return inst;
          }};
}

// A unit whose parameters rank 0 does not use (its output still flows into the loss): on rank 0
// they get no gradient, and the unit must still take part in the reduce-scatter (with zeros).
Scenario unused_on_rank_0() {
  return {"a unit whose parameters rank 0 does not use", 4, 4, [] {
            auto model = fsdp::testing::Branch(4);
            Instance inst;
            inst.module = model.ptr();
            inst.forward = [model](torch::Tensor x, int q) mutable { return model(x, q != 0); };
            inst.shard = [model](const fsdp::FullyShardOptions& o) {
              std::vector<fsdp::FSDPModule> units;
              units.push_back(fsdp::fully_shard(model->gate, o));
              units.push_back(fsdp::fully_shard(model, o));
              return units;
            };
            return inst;
          }};
}

}  // namespace

FSDP_RANKS_TEST_CASE("parity: MLP stack with SGD momentum, zero_grad keeping gradients", "[fully_shard][parity]") {
  run_parity(mlp_stack(), Optim::kSgdMomentum, /*set_to_none=*/false);
}

FSDP_RANKS_TEST_CASE("parity: MLP stack with Adam, zero_grad to none", "[fully_shard][parity]") {
  run_parity(mlp_stack(), Optim::kAdam, /*set_to_none=*/true);
}

FSDP_RANKS_TEST_CASE("parity: MLP stack with AdamW", "[fully_shard][parity]") {
  run_parity(mlp_stack(), Optim::kAdamW, /*set_to_none=*/true);
}

FSDP_RANKS_TEST_CASE("parity: nested units with SGD and AdamW", "[fully_shard][parity]") {
  run_parity(nested(), Optim::kSgdMomentum, /*set_to_none=*/false);
  run_parity(nested(), Optim::kAdamW, /*set_to_none=*/true);
}

FSDP_RANKS_TEST_CASE("parity: parameters smaller than the world size", "[fully_shard][parity]") {
  run_parity(tiny(), Optim::kAdam, /*set_to_none=*/false);
  run_parity(tiny(), Optim::kSgdMomentum, /*set_to_none=*/true);
}

FSDP_RANKS_TEST_CASE("parity: gradients accumulate over two backward passes per step", "[fully_shard][parity]") {
  run_parity(mlp_stack(), Optim::kSgdMomentum, /*set_to_none=*/false, /*micro_batches=*/2);
  run_parity(nested(), Optim::kAdam, /*set_to_none=*/true, /*micro_batches=*/2);
}

FSDP_RANKS_TEST_CASE("parity: a unit that got no gradient on one rank still joins the reduce-scatter",
                     "[fully_shard][parity]") {
  run_parity(unused_on_rank_0(), Optim::kSgdMomentum, /*set_to_none=*/false);
}
