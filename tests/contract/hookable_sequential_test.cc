#include "fsdp_cpp/contract/hookable_sequential.h"

#include <string>
#include <vector>

#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>

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
using fsdp::contract::RemovableHandle;
using fsdp::contract::register_forward_hook;
using fsdp::contract::register_forward_pre_hook;
using fsdp::contract::Sequential;

struct AddImpl : torch::nn::Cloneable<AddImpl> {  // Cloneable: the clone tests copy it
  explicit AddImpl(double value) : value(value) {}
  void reset() override {}
  torch::Tensor forward(torch::Tensor x) { return x + value; }
  double value;
};
FSDP_HOOKABLE_MODULE(Add);

struct SumImpl : torch::nn::Module {
  torch::Tensor forward(const torch::Tensor& a, const torch::Tensor& b) { return a + b; }
};
TORCH_MODULE(Sum);

// Logs "<name>.pre" / "<name>.post" for `module`; keeps the handles.
struct Tracer {
  void trace(torch::nn::Module& module, const std::string& name) {
    handles.push_back(register_forward_pre_hook(
        module, [this, name](torch::nn::Module&, ForwardArgs&) { log.push_back(name + ".pre"); }));
    handles.push_back(register_forward_hook(
        module, [this, name](torch::nn::Module&, const ForwardArgs&, c10::IValue&) {
          log.push_back(name + ".post");
        }));
  }
  Log log;
  std::vector<RemovableHandle> handles;
};

}  // namespace

TEST_CASE("Sequential runs each child through its hooks, in order") {
  fsdp::contract::Linear fc(3, 3);
  Sequential seq(fc, torch::nn::ReLU(), Add(1.0));
  Tracer tracer;
  for (size_t i = 0; i < seq->size(); ++i) {
    tracer.trace(*seq->ptr(i), std::to_string(i));
  }
  torch::Tensor x = torch::randn({2, 3});

  torch::Tensor y = seq->forward(x);
  CHECK(tracer.log == Log{"0.pre", "0.post", "1.pre", "1.post", "2.pre", "2.post"});
  CHECK(torch::allclose(y, torch::relu(fc->forward(x)) + 1.0));
}

TEST_CASE("Sequential's holder runs the Sequential's own hooks around its children") {
  Sequential seq(Add(1.0), Add(2.0));
  Tracer tracer;
  tracer.trace(*seq, "seq");
  tracer.trace(*seq->ptr(0), "0");
  tracer.trace(*seq->ptr(1), "1");

  torch::Tensor y = seq(torch::zeros({1}));
  CHECK(tracer.log == Log{"seq.pre", "0.pre", "0.post", "1.pre", "1.post", "seq.post"});
  CHECK(torch::equal(y, torch::full({1}, 3.0)));
}

TEST_CASE("a child's hooks replace what flows to the next child") {
  Sequential seq(Add(1.0), Add(2.0));
  register_forward_hook(
      *seq->ptr(0), [](torch::nn::Module&, const ForwardArgs&, c10::IValue& output) {
        output = output.toTensor() * 10;
      });
  CHECK(torch::equal(seq(torch::zeros({1})), torch::full({1}, 12.0)));  // (0 + 1) * 10 + 2
}

TEST_CASE("LibTorch's Sequential bypasses hooks; ours runs them") {
  fsdp::contract::Linear fc(2, 2);
  int pre_calls = 0;
  register_forward_pre_hook(*fc, [&](torch::nn::Module&, ForwardArgs&) {
    ++pre_calls;
  });
  torch::nn::Sequential theirs(fc);
  theirs->forward(torch::ones({1, 2}));
  CHECK(pre_calls == 0);
  Sequential ours(fc);
  ours(torch::ones({1, 2}));
  CHECK(pre_calls == 1);
}

TEST_CASE("Sequential has torch::nn::Sequential's FQNs") {
  torch::nn::Sequential theirs(torch::nn::Linear(2, 3), torch::nn::ReLU(), torch::nn::Linear(3, 1));
  Sequential ours(fsdp::contract::Linear(2, 3), torch::nn::ReLU(), fsdp::contract::Linear(3, 1));
  CHECK(ours->named_parameters().keys() == theirs->named_parameters().keys());
  CHECK(ours->named_parameters().keys() ==
        std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias"});

  Sequential named;
  named->push_back("proj", fsdp::contract::Linear(2, 2));
  named->push_back(torch::nn::ReLU());
  CHECK(named->named_children().keys() == std::vector<std::string>{"proj", "1"});
}

TEST_CASE("the first child receives all arguments, later children the previous output") {
  Sequential seq(Sum(), Add(1.0));
  torch::Tensor y = seq(torch::full({1}, 2.0), torch::full({1}, 3.0));
  CHECK(torch::equal(y, torch::full({1}, 6.0)));
}

TEST_CASE("a nested Sequential runs its children's hooks") {
  Sequential inner(Add(1.0), Add(2.0));
  Sequential outer(inner, Add(3.0));
  Tracer tracer;
  tracer.trace(*inner, "inner");
  tracer.trace(*inner->ptr(1), "inner.1");
  tracer.trace(*outer->ptr(1), "1");

  torch::Tensor y = outer(torch::zeros({1}));
  CHECK(tracer.log == Log{"inner.pre", "inner.1.pre", "inner.1.post", "inner.post", "1.pre",
                          "1.post"});
  CHECK(torch::equal(y, torch::full({1}, 6.0)));
  CHECK(outer->named_parameters().is_empty());
  CHECK(outer->named_modules("", false).keys() ==
        std::vector<std::string>{"0", "0.0", "0.1", "1"});
}

TEST_CASE("errors: empty Sequential, non-callable child, failing child named") {
  Sequential empty;
  CHECK_THAT(error_of([&] { empty(torch::ones({1})); }), Catch::Contains("no children"));

  Sequential seq(Add(1.0));
  CHECK_THAT(error_of([&] { seq->push_back(AnyHookableModule(torch::nn::ModuleList())); }),
             Catch::Contains("child '1'"));
  CHECK(seq->size() == 1);

  Sequential typed(Add(1.0), fsdp::contract::Linear(2, 2));
  const std::string message = error_of([&] { typed(torch::ones({3})); });  // wrong shape for fc
  CHECK_THAT(message, Catch::Contains("while running child '1'"));
  CHECK_THAT(message, Catch::Contains("LinearImpl"));

  CHECK_THAT(error_of([&] { seq[5]; }), Catch::Contains("index 5 out of range"));
}

TEST_CASE("typed access to children") {
  fsdp::contract::Linear fc(2, 2);
  Sequential seq(fc, Add(1.0));
  CHECK(seq->at<fsdp::contract::Linear>(0).get() == fc.get());
  CHECK(seq->at<Add>(1)->value == 1.0);
  CHECK_THROWS_AS(seq->at<Add>(0), c10::Error);
  size_t visited = 0;
  for (const AnyHookableModule& child : *seq) {
    CHECK(child.is_callable());
    ++visited;
  }
  CHECK(visited == 2);
}

TEST_CASE("clone copies the children under the same names, without hooks") {
  Sequential seq(fsdp::contract::Linear(2, 2), Add(1.0));
  int pre_calls = 0;
  register_forward_pre_hook(*seq->ptr(0), [&](torch::nn::Module&, ForwardArgs&) {
    ++pre_calls;
  });
  auto copy = std::dynamic_pointer_cast<fsdp::contract::SequentialImpl>(seq->clone());
  REQUIRE(copy != nullptr);
  CHECK(copy->named_parameters().keys() == seq->named_parameters().keys());
  CHECK_FALSE(copy->named_parameters()[0].value().is_same(seq->named_parameters()[0].value()));
  torch::Tensor x = torch::randn({1, 2});
  CHECK(torch::allclose(copy->forward(x), seq->forward(x)));
  CHECK(pre_calls == 1);  // the original's call only
}

TEST_CASE("a Sequential inside a cloned parent is cloned consistently") {
  struct ParentImpl : torch::nn::Cloneable<ParentImpl> {
    ParentImpl() { reset(); }
    void reset() override {
      body = register_module("body", Sequential(fsdp::contract::Linear(2, 2), Add(1.0)));
    }
    torch::Tensor forward(torch::Tensor x) { return body(x); }
    Sequential body = nullptr;
  };
  auto parent = std::make_shared<ParentImpl>();
  auto copy = std::dynamic_pointer_cast<ParentImpl>(parent->clone());
  REQUIRE(copy != nullptr);
  torch::Tensor x = torch::randn({1, 2});
  CHECK(torch::allclose(copy->forward(x), parent->forward(x)));
  // The copy's container calls the copy's own children.
  CHECK(copy->body->ptr(0).get() == copy->named_children()["body"]->named_children()["0"].get());
}

// Sequential is a hook-able holder; LibTorch's is not (APIs relying on hooks refuse it).
static_assert(fsdp::contract::HookableHolder<Sequential>);
static_assert(!fsdp::contract::HookableHolder<torch::nn::Sequential>);
static_assert(!fsdp::contract::HookableHolder<torch::nn::ModuleList>);

TEST_CASE("a child's error meets the child's, then the Sequential's forward-exception hooks") {
  Sequential seq(Add(1.0), fsdp::contract::Linear(2, 2));
  Log log;
  fsdp::contract::register_forward_exception_hook(
      *seq->ptr(1), [&](torch::nn::Module& m, c10::Error&) { log.push_back("child " + m.name()); });
  fsdp::contract::register_forward_exception_hook(*seq, [&](torch::nn::Module&, c10::Error& error) {
    // The Sequential's own context about the failing child is already there.
    log.push_back("seq, context: " + error.context().back());
  });
  CHECK_THROWS(seq(torch::ones({3})));  // wrong shape for the Linear
  REQUIRE(log.size() == 2);
  CHECK(log[0] == "child torch::nn::LinearImpl");
  CHECK_THAT(log[1], Catch::Contains("while running child '1'"));
}
