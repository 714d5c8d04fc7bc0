#include "fsdp_cpp/contract/module_fqn.h"

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>

#include "fsdp_cpp/tests/contract/fixtures.h"

// Catch2 last: c10/util/Logging.h defines a CHECK macro of its own, and the last definition wins.
#include <catch2/catch.hpp>

namespace {

using fsdp::contract::fixtures::Block;
using fsdp::contract::fixtures::BlockImpl;
using fsdp::contract::describe_module;
using fsdp::contract::display_fqn;
using fsdp::contract::find_module_fqn;

struct ModelImpl : torch::nn::Module {
  ModelImpl() {
    embed = register_module("embed", torch::nn::Linear(2, 2));
    blocks = register_module("blocks", torch::nn::ModuleList());
    blocks->push_back(Block());
    blocks->push_back(Block());
  }
  torch::nn::Linear embed = nullptr;
  torch::nn::ModuleList blocks = nullptr;
};
TORCH_MODULE(Model);

}  // namespace

TEST_CASE("find_module_fqn gives the root the empty FQN") {
  Model model;
  CHECK(find_module_fqn(*model, *model) == std::string());
}

TEST_CASE("find_module_fqn gives nested modules their dotted FQNs") {
  Model model;
  auto block1 = model->blocks->ptr<BlockImpl>(1);
  CHECK(find_module_fqn(*model, *model->embed) == "embed");
  CHECK(find_module_fqn(*model, *model->blocks) == "blocks");
  CHECK(find_module_fqn(*model, *block1) == "blocks.1");
  CHECK(find_module_fqn(*model, *block1->fc) == "blocks.1.fc");
  // Relative to a subtree root.
  CHECK(find_module_fqn(*model->blocks, *block1->fc) == "1.fc");
}

TEST_CASE("find_module_fqn returns nullopt for a module outside the tree") {
  Model model;
  Block stranger;
  CHECK_FALSE(find_module_fqn(*model, *stranger).has_value());
  // A parent is not inside its child's tree.
  CHECK_FALSE(find_module_fqn(*model->blocks, *model).has_value());
}

TEST_CASE("find_module_fqn reports the first name of a module registered twice") {
  struct TiedImpl : torch::nn::Module {
    TiedImpl() {
      shared = torch::nn::Linear(2, 2);
      register_module("first", shared);
      register_module("second", shared);
    }
    torch::nn::Linear shared = nullptr;
  };
  auto tied = std::make_shared<TiedImpl>();
  CHECK(find_module_fqn(*tied, *tied->shared) == "first");
}

TEST_CASE("find_module_fqn works on a root that is not owned by a shared_ptr") {
  BlockImpl block;  // on the stack
  CHECK(find_module_fqn(block, *block.fc) == "fc");
  CHECK(find_module_fqn(block, block) == std::string());
}

TEST_CASE("display_fqn and describe_module render FQNs for error messages") {
  Block block;
  CHECK(display_fqn("") == "<root>");
  CHECK(display_fqn("blocks.0") == "blocks.0");
  CHECK(describe_module("blocks.0", *block) == "'blocks.0' (" + block->name() + ")");
  CHECK(describe_module("", *block) == "'<root>' (" + block->name() + ")");
  CHECK_THAT(block->name(), Catch::Contains("BlockImpl"));
}
