// fully_shard training parity (FULL_SHARD) over MPI on every world size of the launch; see
// tests/composable/parity.h for what is compared and checked.
#include <torch/nn/functional/activation.h>

#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/tests/composable/parity.h"
#include "fsdp_cpp/tests/composable/test_models.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using fsdp::testing::Instance;
using fsdp::testing::Optim;
using fsdp::testing::ParityOptions;
using fsdp::testing::Scenario;

ParityOptions with(Optim optim, bool set_to_none, int micro_batches = 1) {
  ParityOptions o;
  o.optim = optim;
  o.set_to_none = set_to_none;
  o.micro_batches = micro_batches;
  return o;
}

void run_parity(const Scenario& s, Optim optim, bool set_to_none, int micro_batches = 1) {
  fsdp::testing::run_parity(s, with(optim, set_to_none, micro_batches));
}

Scenario mlp_stack() { return fsdp::testing::mlp_stack_scenario("MLP stack (a unit per block and the root)"); }

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
