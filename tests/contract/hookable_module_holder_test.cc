#include "fsdp_cpp/contract/hookable_module_holder.h"

#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "fsdp_cpp/tests/contract/fixtures.h"

// Catch2 last: c10/util/Logging.h defines a CHECK macro of its own, and the last definition wins.
#include <catch2/catch.hpp>

namespace {

using fsdp::contract::fixtures::Log;
using fsdp::contract::fixtures::log_post;
using fsdp::contract::fixtures::log_pre;
using fsdp::contract::ForwardArgs;
using fsdp::contract::register_forward_exception_hook;
using fsdp::contract::register_forward_hook;
using fsdp::contract::register_forward_pre_hook;

struct InnerImpl : torch::nn::Module {
  InnerImpl() { weight = register_parameter("weight", torch::full({1}, 3.0)); }
  torch::Tensor forward(torch::Tensor x) { return x * weight; }
  torch::Tensor weight;
};
FSDP_HOOKABLE_MODULE(Inner);

struct BlockImpl : torch::nn::Module {
  BlockImpl() { inner = register_module("inner", Inner()); }
  torch::Tensor forward(torch::Tensor x) { return inner(x) + 1; }  // through inner's hooks
  Inner inner = nullptr;
};
FSDP_HOOKABLE_MODULE(Block);

struct ScaleImpl : torch::nn::Module {
  torch::Tensor forward(torch::Tensor x, double scale = 3.0) { return x * scale; }
};
FSDP_HOOKABLE_MODULE(Scale);

// Fails inside forward for an input whose size is not a multiple of 3.
struct FailingImpl : torch::nn::Module {
  torch::Tensor forward(torch::Tensor x) { return x.view({-1, 3}); }
};
FSDP_HOOKABLE_MODULE(Failing);

}  // namespace

TEST_CASE("a FSDP_HOOKABLE_MODULE holder runs the hooks around forward") {
  Inner inner;
  torch::Tensor x = torch::ones({2});
  register_forward_pre_hook(*inner, [](torch::nn::Module&, ForwardArgs& args) {
    args[0] = args[0].toTensor() * 2;
  });
  register_forward_hook(
      *inner, [](torch::nn::Module&, const ForwardArgs&, c10::IValue& output) {
        output = output.toTensor() + 0.5;
      });
  CHECK(torch::equal(inner(x), torch::full({2}, 6.5)));  // (1 * 2) * 3 + 0.5
}

TEST_CASE("hook-able children called by a parent run inside the parent's hooks") {
  Log log;
  Block block;
  register_forward_pre_hook(*block, log_pre(log, "block.pre"));
  register_forward_hook(*block, log_post(log, "block.post"));
  register_forward_pre_hook(*block->inner, log_pre(log, "inner.pre"));
  register_forward_hook(*block->inner, log_post(log, "inner.post"));

  torch::Tensor y = block(torch::ones({1}));
  CHECK(log == Log{"block.pre", "inner.pre", "inner.post", "block.post"});
  CHECK(torch::equal(y, torch::full({1}, 4.0)));
}

TEST_CASE("holder->forward bypasses the hooks (documented as unsupported on managed modules)") {
  Log log;
  Inner inner;
  register_forward_pre_hook(*inner, log_pre(log, "pre"));
  inner->forward(torch::ones({1}));
  CHECK(log.empty());
  inner(torch::ones({1}));
  CHECK(log == Log{"pre"});
}

TEST_CASE("hook-able holders behave as ModuleHolders") {
  Block empty = nullptr;
  CHECK(empty.is_empty());

  auto impl = std::make_shared<BlockImpl>();
  Block from_ptr(impl);
  CHECK(from_ptr.get() == impl.get());
  CHECK(from_ptr->named_parameters().contains("inner.weight"));

  // Copies share the module, hence its hooks.
  Log log;
  Block copy = from_ptr;
  register_forward_pre_hook(*copy, log_pre(log, "pre"));
  from_ptr(torch::ones({1}));
  CHECK(log == Log{"pre"});
  STATIC_REQUIRE(std::is_same_v<Block::Impl, BlockImpl>);
  STATIC_REQUIRE(std::is_base_of_v<torch::nn::ModuleHolder<BlockImpl>, Block>);
}

TEST_CASE("hooks see the arguments the caller passed; forward fills in its defaults") {
  Scale scale;
  size_t num_args = 0;
  register_forward_pre_hook(*scale, [&](torch::nn::Module&, ForwardArgs& args) {
    num_args = args.size();
  });
  CHECK(torch::equal(scale(torch::ones({1})), torch::full({1}, 3.0)));
  CHECK(num_args == 1);
  CHECK(torch::equal(scale(torch::ones({1}), 5.0), torch::full({1}, 5.0)));
  CHECK(num_args == 2);
}

// LibTorch's holders call forward directly; APIs that rely on hooks refuse them at compile time.
static_assert(fsdp::contract::HookableHolder<Inner>);
static_assert(fsdp::contract::HookableHolder<const Block&>);
static_assert(!fsdp::contract::HookableHolder<torch::nn::ModuleHolder<InnerImpl>>);
static_assert(!fsdp::contract::HookableHolder<InnerImpl>);

TEST_CASE("HookableHolder tells hook-able holders from LibTorch's") {
  // Checked at compile time above; the run-time side: a plain holder runs no hooks.
  torch::nn::ModuleHolder<InnerImpl> plain(std::make_shared<InnerImpl>());
  int calls = 0;
  register_forward_pre_hook(*plain, [&](torch::nn::Module&, ForwardArgs&) { ++calls; });
  plain->forward(torch::ones({1}));
  CHECK(calls == 0);
  Inner hookable(plain.ptr());
  hookable(torch::ones({1}));
  CHECK(calls == 1);
}

TEST_CASE("a forward-exception hook runs when a hook-able holder's forward throws") {
  Failing failing;
  register_forward_exception_hook(*failing, [](torch::nn::Module& m, c10::Error& error) {
    error.add_context("while running " + m.name());
  });
  std::string message;
  try {
    failing(torch::ones({4}));
  } catch (const c10::Error& error) {
    message = error.what_without_backtrace();
  }
  CHECK_THAT(message, Catch::Contains("invalid for input of size 4"));
  CHECK_THAT(message, Catch::Contains("while running") && Catch::Contains("FailingImpl"));
  CHECK(failing(torch::ones({3})).sizes() == torch::IntArrayRef({1, 3}));
}
