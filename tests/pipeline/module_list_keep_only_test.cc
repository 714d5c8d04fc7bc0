// contract::ModuleList::keep_only ([Note: pruned ModuleList]), the piece a pipeline stage is cut
// with: the kept elements keep their names (so their parameters' FQNs), positions count the kept
// elements, the removed ones are unregistered, and what is refused is refused with a clear error.
#include "fsdp_cpp/contract/hookable_module_list.h"

#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include "fsdp_cpp/contract/hookable_modules.h"
#include "fsdp_cpp/tests/testing/errors.h"

// Catch2 last: c10/util/Logging.h defines a CHECK macro of its own, and the last definition wins.
#include <catch2/catch.hpp>

namespace {

using Catch::Matchers::Contains;
using fsdp::contract::Linear;
using fsdp::contract::ModuleList;
using fsdp::testing::error_of;
using fsdp::testing::kNoError;

struct ModelImpl : torch::nn::Module {
  explicit ModelImpl(int n) {
    blocks = register_module("blocks", ModuleList());
    for (int i = 0; i < n; ++i) blocks->push_back(Linear(3, 3));
  }
  ModuleList blocks = nullptr;
};
TORCH_MODULE(Model);

std::vector<std::string> keys(const torch::nn::Module& module) {
  std::vector<std::string> out;
  for (const auto& item : module.named_parameters()) out.push_back(item.key());
  return out;
}

TEST_CASE("ModuleList::keep_only: kept elements keep their names and FQNs", "[pipeline][module_list]") {
  Model model(5);
  std::vector<torch::nn::Module*> originals;
  for (size_t i = 0; i < 5; ++i) originals.push_back(model->blocks->ptr(i).get());
  const at::Tensor w3 = model->blocks->at<Linear>(3)->weight;
  model->blocks->keep_only(3, 5);
  CHECK(model->blocks->size() == 2);
  CHECK(model->blocks->is_pruned());
  CHECK(model->blocks->first_name() == 3);
  CHECK(model->blocks->name(0) == "3");
  CHECK(model->blocks->name(1) == "4");
  CHECK(keys(*model) == std::vector<std::string>{"blocks.3.weight", "blocks.3.bias", "blocks.4.weight",
                                                 "blocks.4.bias"});
  // Positions count the kept elements, in order; they are the same modules, not copies.
  CHECK(model->blocks->ptr(0).get() == originals[3]);
  CHECK(model->blocks->ptr(1).get() == originals[4]);
  CHECK(model->blocks->at<Linear>(0)->weight.is_same(w3));
  std::vector<torch::nn::Module*> iterated;
  for (const auto& element : *model->blocks) iterated.push_back(element.ptr().get());
  CHECK(iterated == std::vector<torch::nn::Module*>{originals[3], originals[4]});
  CHECK(model->blocks->holders<Linear>().size() == 2);
  // Calls go through the kept element.
  const at::Tensor x = at::randn({2, 3});
  CHECK(at::equal((*model->blocks)[1].forward(x), model->blocks->at<Linear>(1)(x)));
  // named_children / named_modules agree.
  std::vector<std::string> children;
  for (const auto& item : model->blocks->named_children()) children.push_back(item.key());
  CHECK(children == std::vector<std::string>{"3", "4"});
}

TEST_CASE("ModuleList::keep_only: ranges by name, narrowing, empty and whole", "[pipeline][module_list]") {
  SECTION("keeping everything changes nothing (push_back still works)") {
    Model model(3);
    model->blocks->keep_only(0, 3);
    CHECK_FALSE(model->blocks->is_pruned());
    CHECK(model->blocks->size() == 3);
    model->blocks->push_back(Linear(3, 3));
    CHECK(model->blocks->name(3) == "3");
  }
  SECTION("a second keep_only narrows by name") {
    Model model(6);
    model->blocks->keep_only(1, 5);
    model->blocks->keep_only(2, 4);
    CHECK(model->blocks->size() == 2);
    CHECK(model->blocks->name(0) == "2");
    CHECK(keys(*model).front() == "blocks.2.weight");
    CHECK(keys(*model).back() == "blocks.3.bias");
  }
  SECTION("the first elements only") {
    Model model(4);
    model->blocks->keep_only(0, 2);
    CHECK(model->blocks->is_pruned());
    CHECK(model->blocks->name(1) == "1");
    CHECK(keys(*model).size() == 4);
  }
  SECTION("an empty range empties the list") {
    Model model(4);
    model->blocks->keep_only(2, 2);
    CHECK(model->blocks->is_empty());
    CHECK(model->blocks->begin() == model->blocks->end());
    CHECK(keys(*model).empty());
    CHECK(model->blocks->is_pruned());
  }
}

TEST_CASE("ModuleList::keep_only: errors", "[pipeline][module_list]") {
  Model model(4);
  CHECK_THAT(error_of([&] { model->blocks->keep_only(3, 1); }),
             Contains("ModuleList::keep_only") && Contains("begin <= end") && Contains("reversed range [3, 1)"));
  CHECK_THAT(error_of([&] { model->blocks->keep_only(2, 5); }),
             Contains("ModuleList::keep_only") && Contains("[2, 5)") && Contains("names the list holds, [0, 4)"));
  CHECK_THAT(error_of([&] { model->blocks->keep_only(-1, 2); }), Contains("[-1, 2)"));
  CHECK(model->blocks->size() == 4);  // refused calls change nothing
  CHECK_FALSE(model->blocks->is_pruned());
  model->blocks->keep_only(1, 3);
  // Names, not positions: 0 is gone.
  CHECK_THAT(error_of([&] { model->blocks->keep_only(0, 2); }),
             Contains("names the list holds, [1, 3)") && Contains("pruned before"));
  CHECK_THAT(error_of([&] { model->blocks->push_back(Linear(3, 3)); }),
             Contains("ModuleList::push_back") && Contains("pruned by keep_only") &&
                 Contains("elements named 1 .. 2"));
  CHECK(model->blocks->size() == 2);
  CHECK_THAT(error_of([&] { (void)(*model->blocks)[2]; }),
             Contains("index 2 out of range") && Contains("positions in the pruned list, not names"));
  CHECK_THAT(error_of([&] { (void)model->blocks->name(2); }), Contains("position 2 out of range"));
}

TEST_CASE("ModuleList::keep_only: clone keeps the names", "[pipeline][module_list]") {
  Model model(5);
  model->blocks->keep_only(2, 4);
  auto copy = std::dynamic_pointer_cast<fsdp::contract::ModuleListImpl>(model->blocks->clone());
  REQUIRE(copy != nullptr);
  CHECK(copy->is_pruned());
  CHECK(copy->first_name() == 2);
  CHECK(keys(*copy) == std::vector<std::string>{"2.weight", "2.bias", "3.weight", "3.bias"});
  CHECK(copy->ptr(0).get() != model->blocks->ptr(0).get());
  CHECK(at::equal(copy->at<Linear>(0)->weight, model->blocks->at<Linear>(0)->weight));
  CHECK_THAT(error_of([&] { copy->push_back(Linear(3, 3)); }), Contains("pruned by keep_only"));
}

}  // namespace
