#include "fsdp_cpp/contract/hookable_module_list.h"

#include <string>
#include <vector>

#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>

#include "fsdp_cpp/contract/hookable_modules.h"
#include "fsdp_cpp/tests/contract/fixtures.h"
#include "fsdp_cpp/tests/testing/errors.h"

// Catch2 last: c10/util/Logging.h defines a CHECK macro of its own, and the last definition wins.
#include <catch2/catch.hpp>

namespace {

using fsdp::testing::error_of;
using fsdp::contract::fixtures::Log;
using fsdp::contract::AnyHookableModule;
using fsdp::contract::ForwardArgs;
using fsdp::contract::ModuleList;
using fsdp::contract::RemovableHandle;
using fsdp::contract::register_forward_hook;
using fsdp::contract::register_forward_pre_hook;

struct BlockImpl : torch::nn::Cloneable<BlockImpl> {  // Cloneable: the clone test copies it
  explicit BlockImpl(int64_t dim) : dim(dim) { reset(); }
  void reset() override { fc = register_module("fc", fsdp::contract::Linear(dim, dim)); }
  int64_t dim;
  torch::Tensor forward(torch::Tensor x) { return torch::tanh(fc(x)) + x; }
  fsdp::contract::Linear fc = nullptr;
};
FSDP_HOOKABLE_MODULE(Block);

struct ModelImpl : torch::nn::Module {
  explicit ModelImpl(int num_blocks) {
    blocks = register_module("blocks", ModuleList());
    for (int i = 0; i < num_blocks; ++i) blocks->push_back(Block(4));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (const auto& block : *blocks) x = block(x);  // through each block's hooks
    return x;
  }
  ModuleList blocks = nullptr;
};
FSDP_HOOKABLE_MODULE(Model);

}  // namespace

TEST_CASE("iterating a ModuleList calls each element through its hooks, in order") {
  Model model(3);
  Log log;
  std::vector<RemovableHandle> handles;
  for (size_t i = 0; i < model->blocks->size(); ++i) {
    const std::string name = std::to_string(i);
    handles.push_back(register_forward_pre_hook(
        *model->blocks->ptr(i),
        [&log, name](torch::nn::Module&, ForwardArgs&) { log.push_back(name + ".pre"); }));
    handles.push_back(register_forward_hook(
        *model->blocks->ptr(i), [&log, name](torch::nn::Module&, const ForwardArgs&,
                                             c10::IValue&) { log.push_back(name + ".post"); }));
  }
  torch::Tensor x = torch::randn({2, 4});

  torch::Tensor y = model(x);
  CHECK(log == Log{"0.pre", "0.post", "1.pre", "1.post", "2.pre", "2.post"});
  torch::Tensor expected = x;
  for (size_t i = 0; i < 3; ++i) {
    expected = model->blocks->at<Block>(i)->forward(expected);  // the hooks change nothing
  }
  CHECK(torch::allclose(y, expected));
}

TEST_CASE("a ModuleList element's hooks replace what the parent receives") {
  Model model(2);
  register_forward_hook(
      *model->blocks->ptr(1), [](torch::nn::Module&, const ForwardArgs&, c10::IValue& output) {
        output = torch::zeros_like(output.toTensor());
      });
  CHECK(torch::equal(model(torch::randn({1, 4})), torch::zeros({1, 4})));
}

TEST_CASE("at<Holder> returns the typed hook-able holder, checking the class") {
  Model model(2);
  int pre_calls = 0;
  register_forward_pre_hook(*model->blocks->ptr(1), [&](torch::nn::Module&, ForwardArgs&) {
    ++pre_calls;
  });
  Block block = model->blocks->at<Block>(1);
  CHECK(block.get() == model->blocks->ptr(1).get());
  block(torch::randn({1, 4}));
  CHECK(pre_calls == 1);
  const std::string message = error_of([&] { model->blocks->at<fsdp::contract::Linear>(0); });
  CHECK_THAT(message, Catch::Contains("BlockImpl"));
  CHECK_THAT(message, Catch::Contains("is not a torch::nn::LinearImpl"));
}

TEST_CASE("holders<Holder> returns every element as a typed hook-able holder") {
  Model model(3);
  int pre_calls = 0;
  std::vector<RemovableHandle> handles;
  for (size_t i = 0; i < 3; ++i) {
    handles.push_back(register_forward_pre_hook(
        *model->blocks->ptr(i), [&](torch::nn::Module&, ForwardArgs&) { ++pre_calls; }));
  }
  const torch::Tensor input = torch::randn({1, 4});
  torch::Tensor x = input;
  std::vector<Block> blocks = model->blocks->holders<Block>();
  REQUIRE(blocks.size() == 3);
  for (Block& block : blocks) {
    x = block(x);
  }
  CHECK(pre_calls == 3);
  torch::Tensor expected = input;
  for (Block& block : blocks) {
    expected = block->forward(expected);  // bypasses the hooks, which change nothing here
  }
  CHECK(pre_calls == 3);
  CHECK(torch::allclose(x, expected));
}

TEST_CASE("ModuleList has torch::nn::ModuleList's FQNs") {
  Model model(2);
  torch::nn::ModuleList theirs(torch::nn::Linear(4, 4), torch::nn::Linear(4, 4));
  ModuleList ours(fsdp::contract::Linear(4, 4), fsdp::contract::Linear(4, 4));
  CHECK(ours->named_parameters().keys() == theirs->named_parameters().keys());
  CHECK(model->named_parameters().keys() ==
        std::vector<std::string>{"blocks.0.fc.weight", "blocks.0.fc.bias", "blocks.1.fc.weight",
                                 "blocks.1.fc.bias"});
}

TEST_CASE("a ModuleList may hold modules that cannot be called") {
  ModuleList list(torch::nn::ModuleList(), fsdp::contract::Linear(2, 2));
  CHECK(list->size() == 2);
  CHECK_FALSE((*list)[0].is_callable());
  CHECK((*list)[1].is_callable());
  CHECK_THAT(error_of([&] { (*list)[0](torch::ones({1})); }), Catch::Contains("cannot be called"));
  CHECK_THAT(error_of([&] { (*list)[2]; }), Catch::Contains("index 2 out of range"));
  CHECK_THAT(error_of([&] { list->push_back(AnyHookableModule()); }),
             Catch::Contains("got an empty one"));
}

TEST_CASE("clone copies the elements, not their hooks") {
  Model model(2);
  int pre_calls = 0;
  register_forward_pre_hook(*model->blocks->ptr(0), [&](torch::nn::Module&, ForwardArgs&) {
    ++pre_calls;
  });
  auto copy = std::dynamic_pointer_cast<fsdp::contract::ModuleListImpl>(model->blocks->clone());
  REQUIRE(copy != nullptr);
  CHECK(copy->named_parameters().keys() == model->blocks->named_parameters().keys());
  CHECK(copy->ptr(0).get() != model->blocks->ptr(0).get());
  torch::Tensor x = torch::randn({1, 4});
  CHECK(torch::allclose((*copy)[0](x), model->blocks->at<Block>(0)->forward(x)));
  CHECK(pre_calls == 0);
}
