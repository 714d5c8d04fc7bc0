#include "fsdp_cpp/contract/any_hookable_module.h"

#include <string>
#include <tuple>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>

#include "fsdp_cpp/contract/hookable_modules.h"
#include "fsdp_cpp/tests/testing/errors.h"

// Catch2 last: c10/util/Logging.h defines a CHECK macro of its own, and the last definition wins.
#include <catch2/catch.hpp>

namespace {

using fsdp::testing::error_of;
using fsdp::contract::AnyHookableModule;
using fsdp::contract::ForwardArgs;
using fsdp::contract::register_forward_hook;
using fsdp::contract::register_forward_pre_hook;

// A module that works on IValues directly (as fsdp::contract::Sequential does).
struct IValueDoublerImpl : torch::nn::Module {
  c10::IValue forward_ivalues(const ForwardArgs& args) {
    return c10::IValue(args.at(0).toTensor() * 2);
  }
};
TORCH_MODULE(IValueDoubler);

}  // namespace

TEST_CASE("AnyHookableModule calls a LibTorch module through its hooks") {
  torch::nn::Linear linear(3, 2);  // LibTorch's own holder: the container supplies the hooks
  AnyHookableModule any(linear);
  int pre_calls = 0;
  register_forward_pre_hook(*linear, [&](torch::nn::Module&, ForwardArgs&) {
    ++pre_calls;
  });
  register_forward_hook(
      *linear, [](torch::nn::Module&, const ForwardArgs&, c10::IValue& output) {
        output = output.toTensor() * 0;
      });
  torch::Tensor x = torch::randn({1, 3});

  CHECK(torch::equal(any(x), torch::zeros({1, 2})));
  CHECK(pre_calls == 1);
  c10::IValue boxed = any.forward_ivalues({c10::IValue(x)});
  CHECK(torch::equal(boxed.toTensor(), torch::zeros({1, 2})));
  CHECK(pre_calls == 2);
  CHECK(any.is_callable());
  CHECK(any.ptr().get() == linear.get());
}

TEST_CASE("forward<Output> returns tuples and fills in FORWARD_HAS_DEFAULT_ARGS defaults") {
  torch::nn::MultiheadAttention attention(4, 2);
  AnyHookableModule any(attention);
  size_t num_args_seen = 0;
  register_forward_pre_hook(*attention, [&](torch::nn::Module&, ForwardArgs& args) {
    num_args_seen = args.size();
  });
  torch::Tensor q = torch::randn({2, 1, 4});

  auto [out, weights] = any.forward<std::tuple<torch::Tensor, torch::Tensor>>(q, q, q);
  auto [expected_out, expected_weights] = attention->forward(q, q, q);
  CHECK(num_args_seen == 3);
  CHECK(torch::allclose(out, expected_out));
  CHECK(torch::allclose(weights, expected_weights));
}

TEST_CASE("argument count and type errors name the module") {
  AnyHookableModule any(torch::nn::Linear(3, 2));
  torch::Tensor x = torch::randn({1, 3});
  const std::string too_many = error_of([&] { any(x, x); });
  CHECK_THAT(too_many, Catch::Contains("LinearImpl::forward takes at most 1 argument(s), got 2"));

  const std::string too_few = error_of([&] { any(); });
  CHECK_THAT(too_few, Catch::Contains("expects 1 argument(s), but received 0"));

  const std::string wrong_type = error_of([&] { any(3); });
  CHECK_THAT(wrong_type, Catch::Contains("argument 0 of"));
  CHECK_THAT(wrong_type, Catch::Contains("expected a value of type at::Tensor, got Int"));

  const std::string wrong_output = error_of([&] { any.forward<int64_t>(x); });
  CHECK_THAT(wrong_output, Catch::Contains("requested type long"));
  CHECK_THAT(wrong_output, Catch::Contains("got Tensor"));
}

TEST_CASE("a module without a plain forward is held but cannot be called") {
  AnyHookableModule any(torch::nn::ModuleList{});
  CHECK_FALSE(any.is_callable());
  CHECK_FALSE(any.is_empty());
  CHECK_THAT(error_of([&] { any(torch::ones({1})); }), Catch::Contains("cannot be called"));

  AnyHookableModule empty;
  CHECK(empty.is_empty());
  CHECK_THAT(error_of([&] { empty(torch::ones({1})); }), Catch::Contains("empty module"));
}

TEST_CASE("ptr_as and as check the module's class") {
  fsdp::contract::Linear linear(2, 2);
  AnyHookableModule any(linear);
  CHECK(any.ptr_as<torch::nn::LinearImpl>().get() == linear.get());
  CHECK_THAT(error_of([&] { any.ptr_as<torch::nn::Conv2dImpl>(); }),
             Catch::Contains("is not a torch::nn::Conv2dImpl"));

  int pre_calls = 0;
  register_forward_pre_hook(*linear, [&](torch::nn::Module&, ForwardArgs&) {
    ++pre_calls;
  });
  fsdp::contract::Linear typed = any.as<fsdp::contract::Linear>();
  typed(torch::ones({1, 2}));
  CHECK(pre_calls == 1);
  CHECK_THROWS_AS(any.as<fsdp::contract::Conv2d>(), c10::Error);
}

TEST_CASE("clone copies the module, not its hooks") {
  fsdp::contract::Linear linear(2, 2);
  AnyHookableModule any(linear);
  int pre_calls = 0;
  register_forward_pre_hook(*linear, [&](torch::nn::Module&, ForwardArgs&) {
    ++pre_calls;
  });

  AnyHookableModule copy = any.clone();
  REQUIRE(copy.is_callable());
  auto cloned = copy.ptr_as<torch::nn::LinearImpl>();
  CHECK(cloned.get() != linear.get());
  CHECK_FALSE(cloned->weight.is_same(linear->weight));
  CHECK(torch::equal(cloned->weight, linear->weight));
  torch::Tensor x = torch::randn({1, 2});
  CHECK(torch::allclose(copy(x), linear->forward(x)));
  CHECK(pre_calls == 0);
}

TEST_CASE("an IValueForwardModule is called through forward_ivalues and its hooks") {
  STATIC_REQUIRE(fsdp::contract::IValueForwardModule<IValueDoublerImpl>);
  STATIC_REQUIRE(fsdp::contract::TypedForwardModule<torch::nn::LinearImpl>);
  STATIC_REQUIRE_FALSE(fsdp::contract::TypedForwardModule<torch::nn::ModuleListImpl>);
  IValueDoubler doubler;
  AnyHookableModule any(doubler);
  register_forward_pre_hook(*doubler, [](torch::nn::Module&, ForwardArgs& args) {
    args[0] = args[0].toTensor() + 1;
  });
  CHECK(torch::equal(any(torch::ones({2})), torch::full({2}, 4.0)));
}

TEST_CASE("a call through AnyHookableModule runs the module's forward-exception hooks") {
  torch::nn::Linear linear(3, 2);
  AnyHookableModule any(linear);
  int calls = 0;
  fsdp::contract::register_forward_exception_hook(*linear, [&](torch::nn::Module&, c10::Error& error) {
    ++calls;
    error.add_context("seen by the Linear's exception hook");
  });
  CHECK_THAT(error_of([&] { any(torch::randn({1, 4})); }),  // 4 features for a Linear(3, 2)
             Catch::Contains("seen by the Linear's exception hook"));
  CHECK(calls == 1);
  CHECK_NOTHROW(any(torch::randn({1, 3})));
  CHECK(calls == 1);
}
