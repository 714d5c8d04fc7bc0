// call_method and call_with_hooks: methods other than forward run with the module's forward hooks
// around them ([Note: hooked calls] in contract/hooked_call.h).
#include "fsdp_cpp/contract/hooked_call.h"

#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "fsdp_cpp/contract/forward_hooks.h"
#include "fsdp_cpp/contract/hookable_module_holder.h"
#include "fsdp_cpp/tests/contract/fixtures.h"
#include "fsdp_cpp/tests/testing/errors.h"

// Catch2 last: c10/util/Logging.h defines a CHECK macro of its own, and the last definition wins.
#include <catch2/catch.hpp>

namespace {

using Catch::Matchers::Contains;
using fsdp::contract::call_method;
using fsdp::contract::call_with_hooks;
using fsdp::contract::ForwardArgs;
using fsdp::contract::ForwardFunction;
using fsdp::contract::register_forward_exception_hook;
using fsdp::contract::register_forward_hook;
using fsdp::contract::register_forward_pre_hook;
using fsdp::contract::register_forward_wrapper;
using fsdp::contract::fixtures::Log;
using fsdp::contract::fixtures::log_post;
using fsdp::contract::fixtures::log_pre;
using fsdp::testing::error_of;

// Not a forward value: hooks see None.
struct Summary {
  at::Tensor total;
  std::map<std::string, int64_t> counts;
};

// A module with methods besides forward, logging what runs.
struct ScorerImpl : torch::nn::Module {
  explicit ScorerImpl(Log* log = nullptr) : log_(log) {}
  at::Tensor forward(at::Tensor x) { return x; }
  at::Tensor score(const at::Tensor& x, double scale) {
    note("score");
    ++calls;
    last_input = x;
    last_scale = scale;
    return x * scale;
  }
  std::tuple<at::Tensor, int64_t> count(at::Tensor x) const { return {x.sum(), x.numel()}; }
  Summary summarize(at::Tensor x) {
    note("summarize");
    ++calls;
    return {x.sum(), {{"elements", x.numel()}}};
  }
  void reset(int64_t value) {
    note("reset");
    calls = value;
  }
  at::Tensor fail(at::Tensor x) {
    TORCH_CHECK(false, "ScorerImpl::fail always fails");
    return x;
  }
  void note(const std::string& what) {
    if (log_ != nullptr) log_->push_back(what);
    depth_seen = fsdp::contract::hooked_forward_depth();
  }
  Log* log_;
  int64_t calls = 0;
  at::Tensor last_input;
  double last_scale = 0.0;
  size_t depth_seen = 0;
};
TORCH_MODULE(Scorer);                                  // LibTorch's holder: no hooks of its own
FSDP_HOOKABLE_MODULE_IMPL(HookableScorer, ScorerImpl);  // a hook-able holder of the same class

// A wrapper that logs around the call it wraps and keeps it in `kept`.
auto keeping_wrapper(Log& log, ForwardFunction& kept) {
  return [&log, &kept](torch::nn::Module&, const ForwardArgs& args, const ForwardFunction& forward) {
    log.push_back("wrap in");
    kept = forward;
    c10::IValue out = forward(args);
    log.push_back("wrap out");
    return out;
  };
}

}  // namespace

TEST_CASE("without hooks call_method and call_with_hooks are direct calls") {
  Scorer scorer;
  const at::Tensor x = at::arange(3.0);
  CHECK(at::equal(call_method(scorer, &ScorerImpl::score, x, 2), x * 2));
  CHECK(scorer->last_input.is_same(x));
  CHECK(scorer->depth_seen == 0);
  auto [sum, n] = call_method(*scorer, &ScorerImpl::count, x);  // a const method, by the module
  CHECK(sum.item<double>() == 3.0);
  CHECK(n == 3);
  call_method(scorer, &ScorerImpl::reset, 7);
  CHECK(scorer->calls == 7);
  Summary s = call_with_hooks(scorer, [&] { return scorer->summarize(x); });
  CHECK(s.counts.at("elements") == 3);
}

TEST_CASE("call_method runs pre-forward hooks, wrappers, the method, then post-forward hooks") {
  Log log;
  HookableScorer scorer(&log);
  ForwardFunction kept;
  register_forward_hook(*scorer, log_post(log, "post"));
  register_forward_wrapper(*scorer, keeping_wrapper(log, kept));
  register_forward_pre_hook(*scorer, log_pre(log, "pre"));
  const at::Tensor x = at::arange(3.0);
  at::Tensor y = call_method(scorer, &ScorerImpl::score, x, 2);
  CHECK(log == Log{"pre", "wrap in", "score", "wrap out", "post"});
  CHECK(at::equal(y, x * 2));
  CHECK(scorer->depth_seen == 1);  // counted as one hooked call
  // Calling forward through the holder runs the same hooks around forward.
  log.clear();
  scorer(x);
  CHECK(log == Log{"pre", "wrap in", "wrap out", "post"});
}

TEST_CASE("hooks see the method's arguments as its parameter types and may replace them") {
  HookableScorer scorer;
  std::vector<std::string> kinds;
  register_forward_pre_hook(*scorer, [&](torch::nn::Module&, ForwardArgs& args) {
    for (const auto& arg : args) kinds.push_back(arg.tagKind());
    args[0] = args[0].toTensor() + 10;
    args[1] = 0.5;
  });
  at::Tensor input_seen_after;
  register_forward_hook(*scorer, [&](torch::nn::Module&, const ForwardArgs& args, c10::IValue& out) {
    input_seen_after = args[0].toTensor();
    out = out.toTensor() * -1;
  });
  const at::Tensor x = at::zeros({2});
  at::Tensor y = call_method(scorer, &ScorerImpl::score, x, 3);  // an int for a double parameter
  CHECK(kinds == std::vector<std::string>{"Tensor", "Double"});
  CHECK(scorer->last_scale == 0.5);
  CHECK(at::equal(scorer->last_input, at::full({2}, 10.0)));
  CHECK(at::equal(input_seen_after, at::full({2}, 10.0)));
  CHECK(at::equal(y, at::full({2}, -5.0)));
}

TEST_CASE("a forward-value result crosses the hooks; tuples keep their element types") {
  HookableScorer scorer;
  c10::IValue seen;
  size_t num_args = 0;
  register_forward_hook(*scorer, [&](torch::nn::Module&, const ForwardArgs& args, c10::IValue& out) {
    num_args = args.size();
    seen = out;
  });
  auto [sum, n] = call_method(scorer, &ScorerImpl::count, at::ones({4}));
  CHECK(num_args == 1);
  CHECK(n == 4);
  CHECK(sum.item<double>() == 4.0);
  REQUIRE(seen.isTuple());
  CHECK(seen.toTupleRef().elements()[1].toInt() == 4);

  // call_with_hooks: no arguments; a tensor result is seen and may be replaced.
  ForwardArgs args_seen{c10::IValue(1)};
  register_forward_pre_hook(*scorer, [&](torch::nn::Module&, ForwardArgs& args) { args_seen = args; });
  register_forward_hook(*scorer, [](torch::nn::Module&, const ForwardArgs&, c10::IValue& out) {
    if (out.isTensor()) out = out.toTensor() + 1;
  });
  at::Tensor t = call_with_hooks(scorer, [&] { return scorer->score(at::ones({2}), 2.0); });
  CHECK(args_seen.empty());
  CHECK(num_args == 0);
  CHECK(at::equal(t, at::full({2}, 3.0)));
}

TEST_CASE("a result that is not a forward value is returned as made; hooks see None") {
  HookableScorer scorer;
  std::vector<std::string> seen;
  auto record = [&](torch::nn::Module&, const ForwardArgs&, c10::IValue& out) {
    seen.push_back(out.tagKind());
  };
  register_forward_hook(*scorer, record);
  Summary s = call_method(scorer, &ScorerImpl::summarize, at::ones({5}));
  CHECK(s.counts.at("elements") == 5);
  s = call_with_hooks(scorer, [&] { return scorer->summarize(at::ones({2})); });
  CHECK(s.counts.at("elements") == 2);
  call_method(scorer, &ScorerImpl::reset, 3);
  call_with_hooks(scorer, [&] { scorer->reset(4); });
  CHECK(scorer->calls == 4);
  CHECK(seen == std::vector<std::string>{"None", "None", "None", "None"});

  // A hook replacing that None would lose its replacement: refused, naming the module.
  register_forward_hook(*scorer, [](torch::nn::Module&, const ForwardArgs&, c10::IValue& out) {
    out = at::ones({1});
  });
  const std::string message = error_of([&] { call_method(scorer, &ScorerImpl::summarize, at::ones({2})); });
  CHECK_THAT(message, Contains("fsdp::contract::call_method: a post-forward hook of module ") &&
                          Contains("ScorerImpl)") && Contains("replaced the output by a Tensor") &&
                          Contains("Summary"));
  CHECK_THAT(error_of([&] { call_with_hooks(scorer, [&] { scorer->reset(1); }); }),
             Contains("fsdp::contract::call_with_hooks: a post-forward hook") && Contains("void"));
}

TEST_CASE("results that are not forward values come back through wrappers") {
  Log log;
  HookableScorer scorer(&log);
  ForwardFunction kept;
  register_forward_wrapper(*scorer, keeping_wrapper(log, kept));
  Summary s = call_method(scorer, &ScorerImpl::summarize, at::ones({3}));
  CHECK(s.counts.at("elements") == 3);
  s = call_with_hooks(scorer, [&] { return scorer->summarize(at::ones({6})); });
  CHECK(s.counts.at("elements") == 6);
  call_with_hooks(scorer, [&] { scorer->reset(9); });
  CHECK(scorer->calls == 9);
  CHECK(log == Log{"wrap in", "summarize", "wrap out", "wrap in", "summarize", "wrap out", "wrap in",
                   "reset", "wrap out"});
}

TEST_CASE("a wrapper that does not run the call has no result to return") {
  HookableScorer scorer;
  register_forward_wrapper(*scorer, [](torch::nn::Module&, const ForwardArgs&, const ForwardFunction&) {
    return c10::IValue();
  });
  CHECK_THAT(error_of([&] { call_method(scorer, &ScorerImpl::summarize, at::ones({3})); }),
             Contains("fsdp::contract::call_method: the forward wrappers of module") &&
                 Contains("returned without running the call"));
}

TEST_CASE("a wrapper may run call_method's call again later, but not call_with_hooks' callable") {
  Log log;
  HookableScorer scorer(&log);
  ForwardFunction kept;
  register_forward_wrapper(*scorer, keeping_wrapper(log, kept));
  const at::Tensor x = at::ones({2});
  call_method(scorer, &ScorerImpl::score, x, 2.0);
  REQUIRE(kept);
  // As activation checkpointing recomputes in backward: the method on the kept arguments.
  const c10::IValue again = kept(ForwardArgs{c10::IValue(x * 3), c10::IValue(2.0)});
  CHECK(at::equal(again.toTensor(), at::full({2}, 6.0)));
  CHECK(scorer->calls == 2);

  kept = nullptr;
  call_with_hooks(scorer, [&] { return scorer->score(x, 2.0); });
  REQUIRE(kept);
  const std::string message = error_of([&] { kept(ForwardArgs{}); });
  CHECK_THAT(message, Contains("fsdp::contract::call_with_hooks: a forward wrapper of module ") &&
                          Contains("ScorerImpl)") &&
                          Contains("ran the callable again after call_with_hooks returned") &&
                          Contains("fsdp::contract::call_method"));
  CHECK(scorer->calls == 3);
}

TEST_CASE("an argument replaced by another type is named with the method") {
  HookableScorer scorer;
  register_forward_pre_hook(*scorer, [](torch::nn::Module&, ForwardArgs& args) { args[1] = "two"; });
  const std::string message = error_of([&] { call_method(scorer, &ScorerImpl::score, at::ones({1}), 2.0); });
  CHECK_THAT(message, Contains("fsdp::contract::call_method: argument 1 of method at::Tensor (") &&
                          Contains("ScorerImpl::*)(at::Tensor const&, double) on module '<root>'") &&
                          Contains("expected a value of type double, got String"));
}

TEST_CASE("a method that throws runs the forward-exception hooks") {
  Log log;
  HookableScorer scorer(&log);
  register_forward_pre_hook(*scorer, log_pre(log, "pre"));
  register_forward_hook(*scorer, log_post(log, "post"));
  register_forward_exception_hook(*scorer, [&](torch::nn::Module&, c10::Error& error) {
    log.push_back("exception");
    error.add_context("while scoring");
  });
  const std::string message = error_of([&] { call_method(scorer, &ScorerImpl::fail, at::ones({1})); });
  CHECK_THAT(message, Contains("ScorerImpl::fail always fails") && Contains("while scoring"));
  CHECK(log == Log{"pre", "exception"});
  log.clear();
  CHECK_THAT(error_of([&] { call_with_hooks(scorer, [&] { return scorer->fail(at::ones({1})); }); }),
             Contains("while scoring"));
  CHECK(log == Log{"pre", "exception"});
  // Other exceptions propagate as they are.
  CHECK_THROWS_AS(call_with_hooks(scorer, []() -> int { throw std::runtime_error("plain"); }),
                  std::runtime_error);
}

TEST_CASE("grad mode is the caller's") {
  HookableScorer scorer;
  bool grad_in_hook = true;
  register_forward_pre_hook(*scorer, [&](torch::nn::Module&, ForwardArgs&) {
    grad_in_hook = c10::GradMode::is_enabled();
  });
  const at::Tensor x = at::ones({2}).requires_grad_();
  CHECK(call_method(scorer, &ScorerImpl::score, x, 2.0).requires_grad());
  CHECK(grad_in_hook);
  c10::NoGradGuard no_grad;
  CHECK_FALSE(call_with_hooks(scorer, [&] { return scorer->score(x, 2.0); }).requires_grad());
  CHECK_FALSE(grad_in_hook);
}
