#include "fsdp_cpp/contract/fqn_snapshot.h"

#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include "fsdp_cpp/contract/module_fqn.h"
#include "fsdp_cpp/tests/testing/errors.h"

// Catch2 last: c10/util/Logging.h defines a CHECK macro of its own, and the last definition wins.
#include <catch2/catch.hpp>

namespace {

using fsdp::testing::error_of;
using fsdp::contract::check_fqns_unchanged;
using fsdp::contract::ModuleFqns;
using fsdp::contract::snapshot_fqns;

using Names = std::vector<std::string>;

struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    scale = register_parameter("scale", torch::ones({1}));
    fc = register_module("fc", torch::nn::Linear(2, 2));
    steps = register_buffer("steps", torch::zeros({1}));
    out = register_module("out", torch::nn::Linear(2, 2));
  }
  torch::Tensor scale;
  torch::nn::Linear fc = nullptr;
  torch::Tensor steps;
  torch::nn::Linear out = nullptr;
};
TORCH_MODULE(Block);

std::string check_error(const ModuleFqns& before, const torch::nn::Module& module) {
  return error_of([&] {
    check_fqns_unchanged("fully_shard", fsdp::contract::describe_module("", module), before,
                         snapshot_fqns(module));
  });
}

}  // namespace

TEST_CASE("snapshot_fqns lists parameters, buffers and submodules in named_* order") {
  Block block;
  const ModuleFqns fqns = snapshot_fqns(*block);
  CHECK(fqns.parameters == Names{"scale", "fc.weight", "fc.bias", "out.weight", "out.bias"});
  CHECK(fqns.buffers == Names{"steps"});
  CHECK(fqns.submodules == Names{"fc", "out"});
}

TEST_CASE("unchanged FQNs pass, also when parameter storage is replaced") {
  Block block;
  const ModuleFqns before = snapshot_fqns(*block);
  block->fc->weight.set_data(torch::zeros({4}));  // a 1-D shard, same parameter and name
  CHECK(check_error(before, *block) == fsdp::testing::kNoError);
}

TEST_CASE("an added parameter is named in the error") {
  Block block;
  const ModuleFqns before = snapshot_fqns(*block);
  block->fc->register_parameter("extra", torch::ones({1}));
  const std::string message = check_error(before, *block);
  CHECK_THAT(message, Catch::StartsWith("fully_shard: cannot modify FQNs of module '<root>' ("));
  CHECK_THAT(message, Catch::Contains("parameters added [fc.extra]"));
  CHECK_THAT(message, !Catch::Contains("buffers"));
}

TEST_CASE("a removed submodule names its parameters and itself") {
  Block block;
  const ModuleFqns before = snapshot_fqns(*block);
  block->unregister_module("fc");
  const std::string message = check_error(before, *block);
  CHECK_THAT(message, Catch::Contains("parameters removed [fc.weight, fc.bias]"));
  CHECK_THAT(message, Catch::Contains("submodules removed [fc]"));
}

TEST_CASE("a reordered submodule is reported at the first position that changed") {
  Block block;
  const ModuleFqns before = snapshot_fqns(*block);
  block->unregister_module("fc");
  block->register_module("fc", block->fc);  // same module and name, now after "out"
  const std::string message = check_error(before, *block);
  CHECK_THAT(message, Catch::Contains("parameters reordered: at position 1 expected 'fc.weight', "
                                      "got 'out.weight'"));
  CHECK_THAT(message, Catch::Contains("submodules reordered: at position 0 expected 'fc', "
                                      "got 'out'"));
}

TEST_CASE("buffers are checked too") {
  Block block;
  const ModuleFqns before = snapshot_fqns(*block);
  block->out->register_buffer("mask", torch::ones({1}));
  CHECK_THAT(check_error(before, *block), Catch::Contains("buffers added [out.mask]"));
}

TEST_CASE("long lists of changed FQNs are cut") {
  ModuleFqns before;
  ModuleFqns after;
  for (int i = 0; i < 20; ++i) {
    after.parameters.push_back("p" + std::to_string(i));
  }
  const std::string message =
      error_of([&] { check_fqns_unchanged("replicate", "'x' (M)", before, after); });
  CHECK_THAT(message, Catch::StartsWith("replicate: cannot modify FQNs of module 'x' (M)"));
  CHECK_THAT(message, Catch::Contains("p7, ... and 12 more]"));
  CHECK_THAT(message, !Catch::Contains("p8"));
}
