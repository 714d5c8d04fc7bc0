#include "fsdp_cpp/contract/contract.h"

#include <stdexcept>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include "fsdp_cpp/contract/forward_hooks.h"
#include "fsdp_cpp/tests/contract/fixtures.h"
#include "fsdp_cpp/tests/testing/errors.h"

// Catch2 last: c10/util/Logging.h defines a CHECK macro of its own, and the last definition wins.
#include <catch2/catch.hpp>

namespace {

using fsdp::testing::error_of;
using fsdp::contract::fixtures::Block;
using fsdp::contract::fixtures::BlockImpl;
using Model = fsdp::contract::fixtures::TwoBlocks;
using fsdp::contract::apply_api;
using fsdp::contract::ApiState;
using fsdp::contract::ForwardArgs;
using fsdp::contract::ModuleStateRegistry;
using fsdp::contract::num_forward_hooks;
using fsdp::contract::num_forward_pre_hooks;
using fsdp::contract::register_forward_hook;
using fsdp::contract::register_forward_pre_hook;
using fsdp::contract::RemovableHandle;

struct ShardState : ApiState {
  int id = 0;
};

// An API implementation that registers a pre-forward hook and counts its runs.
auto hooking_api(int* runs) {
  return [runs](torch::nn::Module& module) {
    ++*runs;
    register_forward_pre_hook(module, [](torch::nn::Module&, ForwardArgs&) {});
    auto state = std::make_shared<ShardState>();
    state->id = *runs;
    return state;
  };
}

}  // namespace

TEST_CASE("apply_api runs fn once and records the state it returns") {
  ModuleStateRegistry registry;
  Block block;
  int runs = 0;
  std::shared_ptr<ShardState> state = apply_api("fully_shard", *block, hooking_api(&runs), registry);
  CHECK(runs == 1);
  REQUIRE(state != nullptr);
  CHECK(state->id == 1);
  CHECK(registry.get(*block, "fully_shard") == state);
  CHECK(num_forward_pre_hooks(*block) == 1);  // what fn registered stays
}

TEST_CASE("applying the same API twice fails before fn runs, naming the API and the FQN") {
  ModuleStateRegistry registry;
  Model model;
  int runs = 0;
  auto first = apply_api("fully_shard", *model->block1, hooking_api(&runs), registry);
  apply_api("fully_shard", *model, hooking_api(&runs), registry);
  REQUIRE(runs == 2);

  const std::string message =
      error_of([&] { apply_api("fully_shard", *model->block1, hooking_api(&runs), registry); });
  CHECK_THAT(message, Catch::StartsWith("fully_shard: module 'block1' ("));
  CHECK_THAT(message, Catch::Contains("already has fully_shard applied"));
  CHECK(runs == 2);
  CHECK(registry.get(*model->block1, "fully_shard") == first);
  CHECK(num_forward_pre_hooks(*model->block1) == 1);
}

TEST_CASE("different APIs may be applied to the same module") {
  ModuleStateRegistry registry;
  Block block;
  int runs = 0;
  auto shard = apply_api("fully_shard", *block, hooking_api(&runs), registry);
  auto replicate = apply_api("replicate", *block, hooking_api(&runs), registry);
  CHECK(registry.get(*block, "fully_shard") == shard);
  CHECK(registry.get(*block, "replicate") == replicate);
  CHECK(shard != replicate);
}

TEST_CASE("apply_api refuses an API declared exclusive with one applied, before fn runs") {
  fsdp::contract::declare_exclusive({.api = "contract_test.x",
                                     .existing = "contract_test.y",
                                     .same_module = true,
                                     .inside = true,
                                     .why = "expected x away from y"});
  ModuleStateRegistry registry;
  Model model;
  int runs = 0;
  apply_api("contract_test.y", *model->block1, hooking_api(&runs), registry);
  REQUIRE(runs == 1);

  const std::string on_it =
      error_of([&] { apply_api("contract_test.x", *model->block1, hooking_api(&runs), registry); });
  CHECK(on_it == std::string("contract_test.x: module '<root>' (fsdp::contract::fixtures::BlockImpl) already has "
                             "contract_test.y applied; expected x away from y"));
  const std::string around =
      error_of([&] { apply_api("contract_test.x", *model, hooking_api(&runs), registry); });
  CHECK(around == std::string("contract_test.x: module '<root>' (fsdp::contract::fixtures::TwoBlocksImpl) contains "
                              "'block1' (fsdp::contract::fixtures::BlockImpl), which contract_test.y was applied "
                              "to; expected x away from y"));
  CHECK(runs == 1);
  CHECK(registry.apis_of(*model->block1) == std::vector<std::string>{"contract_test.y"});
  CHECK(registry.apis_of(*model).empty());
  CHECK(num_forward_pre_hooks(*model) == 0);

  // Not declared: x beside y, and y where x is.
  CHECK_NOTHROW(apply_api("contract_test.x", *model->block0, hooking_api(&runs), registry));
  CHECK_NOTHROW(apply_api("contract_test.y", *model->block0, hooking_api(&runs), registry));
  CHECK(runs == 3);
}

TEST_CASE("an API that adds a parameter fails with 'cannot modify FQNs' and leaves no trace") {
  ModuleStateRegistry registry;
  Model model;
  const auto keys_before = model->named_parameters().keys();
  const std::string message = error_of([&] {
    apply_api(
        "fully_shard", *model,
        [&](torch::nn::Module& module) {
          register_forward_pre_hook(module, [](torch::nn::Module&, ForwardArgs&) {});
          register_forward_hook(*model->block0->fc,
                                [](torch::nn::Module&, const ForwardArgs&, c10::IValue&) {});
          apply_api("inner", *model->block1,
                    [](torch::nn::Module&) { return std::make_shared<ApiState>(); }, registry);
          model->block0->fc->register_parameter("extra", torch::ones({1}));
          return std::make_shared<ShardState>();
        },
        registry);
  });
  CHECK_THAT(message, Catch::StartsWith("fully_shard: cannot modify FQNs of module '<root>' ("));
  CHECK_THAT(message, Catch::Contains("parameters added [block0.fc.extra]"));
  CHECK_FALSE(registry.contains(*model, "fully_shard"));
  CHECK_FALSE(registry.contains(*model->block1, "inner"));  // nested application undone
  CHECK(registry.size() == 0);
  CHECK(num_forward_pre_hooks(*model) == 0);                // hooks fn registered removed
  CHECK(num_forward_hooks(*model->block0->fc) == 0);
}

TEST_CASE("an API that reorders submodules fails") {
  ModuleStateRegistry registry;
  Model model;
  const std::string message = error_of([&] {
    apply_api(
        "fully_shard", *model,
        [&](torch::nn::Module& module) {
          module.unregister_module("block0");
          module.register_module("block0", model->block0);
          return std::make_shared<ShardState>();
        },
        registry);
  });
  CHECK_THAT(message, Catch::Contains("cannot modify FQNs"));
  CHECK_THAT(message, Catch::Contains("submodules reordered"));
  CHECK_FALSE(registry.contains(*model, "fully_shard"));
}

TEST_CASE("fn's own exception propagates and leaves no state and no hooks behind") {
  ModuleStateRegistry registry;
  Block block;
  RemovableHandle existing =
      register_forward_pre_hook(*block, [](torch::nn::Module&, ForwardArgs&) {});
  auto failing = [&](torch::nn::Module& module) -> std::shared_ptr<ShardState> {
    register_forward_pre_hook(module, [](torch::nn::Module&, ForwardArgs&) {});
    throw std::runtime_error("setup failed");
  };
  CHECK_THROWS_WITH(apply_api("fully_shard", *block, failing, registry), "setup failed");
  CHECK_FALSE(registry.contains(*block, "fully_shard"));
  CHECK(num_forward_pre_hooks(*block) == 1);  // only the hook from before apply_api
  CHECK(existing.is_registered());

  // The API can be applied after the failure.
  int runs = 0;
  CHECK_NOTHROW(apply_api("fully_shard", *block, hooking_api(&runs), registry));
}

TEST_CASE("fn returning no state fails") {
  ModuleStateRegistry registry;
  Block block;
  const std::string message = error_of([&] {
    apply_api(
        "fully_shard", *block,
        [](torch::nn::Module&) { return std::shared_ptr<ShardState>(); }, registry);
  });
  CHECK_THAT(message, Catch::StartsWith("fully_shard: module '<root>' ("));
  CHECK_THAT(message, Catch::Contains("got nullptr"));
  CHECK_FALSE(registry.contains(*block, "fully_shard"));
}

TEST_CASE("an API that only replaces parameter storage keeps the contract") {
  ModuleStateRegistry registry;
  Block block;
  torch::Tensor weight = block->fc->weight;
  auto state = apply_api(
      "fully_shard", *block,
      [](torch::nn::Module& module) {
        for (auto& parameter : module.parameters()) {
          parameter.set_data(parameter.detach().flatten().narrow(0, 0, 1).clone());
        }
        return std::make_shared<ShardState>();
      },
      registry);
  CHECK(state != nullptr);
  CHECK(block->fc->weight.is_same(weight));
  CHECK(block->fc->weight.sizes() == std::vector<int64_t>{1});
}

TEST_CASE("apply_api rejects a module not owned by a shared_ptr") {
  ModuleStateRegistry registry;
  BlockImpl on_stack;
  int runs = 0;
  CHECK_THAT(error_of([&] { apply_api("fully_shard", on_stack, hooking_api(&runs), registry); }),
             Catch::Contains("is not owned by a std::shared_ptr"));
  CHECK(runs == 0);
}

TEST_CASE("apply_api uses the global registry by default") {
  Block block;
  int runs = 0;
  auto state = apply_api("fully_shard", *block, hooking_api(&runs));
  CHECK(ModuleStateRegistry::global().get(*block, "fully_shard") == state);
  CHECK(ModuleStateRegistry::global().erase(*block, "fully_shard"));
}
