#include "fsdp_cpp/contract/forward_hooks.h"

#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "fsdp_cpp/tests/contract/fixtures.h"
#include "fsdp_cpp/tests/testing/errors.h"

// Catch2 last: c10/util/Logging.h defines a CHECK macro of its own, and the last definition wins.
#include <catch2/catch.hpp>

namespace {

using fsdp::testing::error_of;
using fsdp::contract::fixtures::Log;
using fsdp::contract::fixtures::log_post;
using fsdp::contract::fixtures::log_pre;
using fsdp::contract::ForwardArgs;
using fsdp::contract::RemovableHandle;
using fsdp::contract::register_forward_exception_hook;
using fsdp::contract::register_forward_hook;
using fsdp::contract::register_forward_pre_hook;
using fsdp::contract::run_forward;
using fsdp::contract::run_forward_ivalues;

// y = 2x + 1, logging each call and keeping the input it received.
struct AffineImpl : torch::nn::Module {
  explicit AffineImpl(Log* log = nullptr) : log_(log) {}
  torch::Tensor forward(torch::Tensor x) {
    if (log_ != nullptr) log_->push_back("forward");
    ++calls;
    last_input = x;
    return x * 2 + 1;
  }
  Log* log_;
  int calls = 0;
  torch::Tensor last_input;
};
TORCH_MODULE(Affine);

struct PairImpl : torch::nn::Module {
  std::tuple<torch::Tensor, torch::Tensor> forward(const torch::Tensor& a, const torch::Tensor& b) {
    return {a + b, a - b};
  }
};
TORCH_MODULE(Pair);

struct MixedImpl : torch::nn::Module {
  torch::Tensor forward(const torch::Tensor& x, double scale, bool negate,
                        std::optional<torch::Tensor> bias) {
    torch::Tensor y = x * scale;
    if (negate) y = -y;
    if (bias) y = y + *bias;
    return y;
  }
};
TORCH_MODULE(Mixed);

// Throws from forward: an index error (a c10::Error subclass) when `index` is out of range, else a
// std::runtime_error when `index` is negative; otherwise returns x.
struct ThrowerImpl : torch::nn::Module {
  torch::Tensor forward(torch::Tensor x, int64_t index) {
    if (index < 0) throw std::runtime_error("not a c10::Error");
    TORCH_CHECK_INDEX(index < x.size(0), "index ", index, " is out of range for size ", x.size(0));
    return x;
  }
};
TORCH_MODULE(Thrower);

// Calls `inner` through its hooks, so an error of the inner forward crosses this one.
struct OuterImpl : torch::nn::Module {
  explicit OuterImpl(Thrower inner) : inner_(register_module("inner", std::move(inner))) {}
  torch::Tensor forward(torch::Tensor x, int64_t index) {
    return run_forward(*inner_, x, index) + 1;
  }
  Thrower inner_;
};
TORCH_MODULE(Outer);

struct SinkImpl : torch::nn::Module {
  void forward(const torch::Tensor& x) { received = x; }
  torch::Tensor received;
};
TORCH_MODULE(Sink);

}  // namespace

TEST_CASE("without hooks run_forward is forward") {
  Affine affine;
  torch::Tensor x = torch::arange(3.0);
  CHECK(torch::equal(run_forward(*affine, x), x * 2 + 1));
  CHECK(affine->last_input.is_same(x));
  CHECK(fsdp::contract::num_forward_pre_hooks(*affine) == 0);
  CHECK(fsdp::contract::num_forward_hooks(*affine) == 0);
}

TEST_CASE("pre-forward hooks, forward, post-forward hooks run in registration order") {
  Log log;
  Affine affine(&log);
  register_forward_pre_hook(*affine, log_pre(log, "pre1"));
  register_forward_hook(*affine, log_post(log, "post1"));
  register_forward_pre_hook(*affine, log_pre(log, "pre2"));
  register_forward_hook(*affine, log_post(log, "post2"));
  CHECK(fsdp::contract::num_forward_pre_hooks(*affine) == 2);
  CHECK(fsdp::contract::num_forward_hooks(*affine) == 2);

  run_forward(*affine, torch::ones({1}));
  CHECK(log == Log{"pre1", "pre2", "forward", "post1", "post2"});
}

TEST_CASE("prepend registers a hook before the existing ones") {
  Log log;
  Affine affine(&log);
  register_forward_pre_hook(*affine, log_pre(log, "pre1"));
  register_forward_pre_hook(*affine, log_pre(log, "pre0"), /*prepend=*/true);
  register_forward_hook(*affine, log_post(log, "post1"));
  register_forward_hook(*affine, log_post(log, "post0"), /*prepend=*/true);
  run_forward(*affine, torch::ones({1}));
  CHECK(log == Log{"pre0", "pre1", "forward", "post0", "post1"});
}

TEST_CASE("pre-forward hooks replace inputs; later hooks and forward see the replacement") {
  Affine affine;
  torch::Tensor x = torch::arange(3.0);
  torch::Tensor seen_by_second;
  register_forward_pre_hook(*affine, [](torch::nn::Module&, ForwardArgs& args) {
    args[0] = args[0].toTensor() + 10;
  });
  register_forward_pre_hook(*affine, [&](torch::nn::Module&, ForwardArgs& args) {
    seen_by_second = args[0].toTensor();
  });

  torch::Tensor y = run_forward(*affine, x);
  CHECK(torch::equal(seen_by_second, x + 10));
  CHECK(torch::equal(affine->last_input, x + 10));
  CHECK(torch::equal(y, (x + 10) * 2 + 1));
}

TEST_CASE("post-forward hooks see forward's arguments and replace the output in turn") {
  Affine affine;
  torch::Tensor x = torch::arange(3.0);
  torch::Tensor args_seen;
  torch::Tensor output_seen_by_second;
  register_forward_pre_hook(*affine, [](torch::nn::Module&, ForwardArgs& args) {
    args[0] = args[0].toTensor() * 0;
  });
  register_forward_hook(
      *affine, [&](torch::nn::Module& module, const ForwardArgs& args, c10::IValue& output) {
        CHECK(&module == affine.get());
        args_seen = args.at(0).toTensor();
        output = output.toTensor() + 100;
      });
  register_forward_hook(
      *affine, [&](torch::nn::Module&, const ForwardArgs&, c10::IValue& output) {
        output_seen_by_second = output.toTensor();
      });

  torch::Tensor y = run_forward(*affine, x);
  CHECK(torch::equal(args_seen, torch::zeros({3})));  // after the pre-forward hook
  CHECK(torch::equal(output_seen_by_second, torch::full({3}, 101.0)));
  CHECK(torch::equal(y, torch::full({3}, 101.0)));
}

TEST_CASE("multi-tensor inputs and tuple outputs cross the hooks") {
  Pair pair;
  torch::Tensor a = torch::full({2}, 5.0);
  torch::Tensor b = torch::full({2}, 3.0);
  size_t num_args = 0;
  register_forward_pre_hook(*pair, [&](torch::nn::Module&, ForwardArgs& args) {
    num_args = args.size();
    args[1] = args[1].toTensor() * 0;  // b := 0
  });
  register_forward_hook(
      *pair, [](torch::nn::Module&, const ForwardArgs&, c10::IValue& output) {
        auto elements = output.toTupleRef().elements().vec();
        elements[1] = elements[1].toTensor() * -1;
        output = c10::ivalue::Tuple::create(std::move(elements));
      });

  auto [sum, difference] = run_forward(*pair, a, b);
  CHECK(num_args == 2);
  CHECK(torch::equal(sum, a));
  CHECK(torch::equal(difference, -a));
}

TEST_CASE("non-tensor arguments reach hooks as IValues and go back to forward's types") {
  Mixed mixed;
  torch::Tensor x = torch::ones({2});
  std::vector<std::string> kinds;
  register_forward_pre_hook(*mixed, [&](torch::nn::Module&, ForwardArgs& args) {
    for (const auto& arg : args) kinds.push_back(arg.tagKind());
    CHECK(args[1].toDouble() == 3.0);
    args[1] = 0.5;                          // scale
    args[2] = false;                        // negate
    args[3] = torch::full({2}, 10.0);       // bias: None -> tensor
  });

  torch::Tensor y = run_forward(*mixed, x, 3, true, std::optional<torch::Tensor>());
  // Hooks see forward's parameter types: the int 3 arrives as the double 3.0.
  CHECK(kinds == std::vector<std::string>{"Tensor", "Double", "Bool", "None"});
  CHECK(torch::equal(y, torch::full({2}, 10.5)));
}

TEST_CASE("a hook that keeps the arguments leaves forward's result unchanged") {
  Mixed mixed;
  torch::Tensor x = torch::randn({2});
  torch::Tensor bias = torch::randn({2});
  register_forward_pre_hook(*mixed, [](torch::nn::Module&, ForwardArgs&) {});
  torch::Tensor hooked = run_forward(*mixed, x, 3, true, std::optional<torch::Tensor>(bias));
  CHECK(torch::equal(hooked, mixed->forward(x, 3, true, bias)));
}

TEST_CASE("remove() unregisters a hook; it is idempotent") {
  Log log;
  Affine affine(&log);
  RemovableHandle pre = register_forward_pre_hook(*affine, log_pre(log, "pre"));
  RemovableHandle post = register_forward_hook(*affine, log_post(log, "post"));
  CHECK(pre.is_registered());
  pre.remove();
  CHECK_FALSE(pre.is_registered());
  CHECK(post.is_registered());
  pre.remove();  // no-op
  run_forward(*affine, torch::ones({1}));
  CHECK(log == Log{"forward", "post"});

  RemovableHandle copy = post;  // copies refer to the same hook
  copy.remove();
  CHECK_FALSE(post.is_registered());
  log.clear();
  run_forward(*affine, torch::ones({1}));
  CHECK(log == Log{"forward"});
  CHECK_FALSE(RemovableHandle().is_registered());
  CHECK_NOTHROW(RemovableHandle().remove());
}

TEST_CASE("hooks added or removed during a call take effect from the next call") {
  Log log;
  Affine affine(&log);
  RemovableHandle second;
  RemovableHandle added;
  register_forward_pre_hook(*affine, [&](torch::nn::Module& m, ForwardArgs&) {
    log.push_back("first");
    second.remove();
    if (!added.is_registered()) added = register_forward_hook(m, log_post(log, "added"));
  });
  second = register_forward_pre_hook(*affine, log_pre(log, "second"));

  run_forward(*affine, torch::ones({1}));
  CHECK(log == Log{"first", "second", "forward"});
  log.clear();
  run_forward(*affine, torch::ones({1}));
  CHECK(log == Log{"first", "forward", "added"});
}

TEST_CASE("a pre-forward hook may not change the number of arguments") {
  Affine affine;
  register_forward_pre_hook(*affine, [](torch::nn::Module&, ForwardArgs& args) {
    args.push_back(c10::IValue(1));
  });
  const std::string message = error_of([&] { run_forward(*affine, torch::ones({1})); });
  CHECK_THAT(message, Catch::Contains("pre-forward hook #0 of module"));
  CHECK_THAT(message, Catch::Contains("AffineImpl"));
  CHECK_THAT(message, Catch::Contains("expected 1, got 2"));
  CHECK(affine->calls == 0);
}

TEST_CASE("a hook that replaces a value by one of another type fails naming it") {
  Affine affine;
  auto pre = register_forward_pre_hook(*affine, [](torch::nn::Module&, ForwardArgs& args) {
    args[0] = c10::IValue(2.5);
  });
  const std::string message = error_of([&] { run_forward(*affine, torch::ones({1})); });
  CHECK_THAT(message, Catch::Contains("argument 0 of"));
  CHECK_THAT(message, Catch::Contains("AffineImpl::forward"));
  CHECK_THAT(message, Catch::Contains("expected a value of type at::Tensor, got Double"));
  pre.remove();

  register_forward_hook(
      *affine, [](torch::nn::Module&, const ForwardArgs&, c10::IValue& output) {
        output = c10::IValue("not a tensor");
      });
  const std::string output_message = error_of([&] { run_forward(*affine, torch::ones({1})); });
  CHECK_THAT(output_message, Catch::Contains("the output of"));
  CHECK_THAT(output_message, Catch::Contains("got String"));
}

TEST_CASE("hooks belong to one module object, not to its class") {
  Log log;
  Affine hooked(&log);
  Affine plain(&log);
  register_forward_pre_hook(*hooked, log_pre(log, "pre"));
  run_forward(*plain, torch::ones({1}));
  CHECK(log == Log{"forward"});
  log.clear();
  run_forward(*hooked, torch::ones({1}));
  CHECK(log == Log{"pre", "forward"});
}

TEST_CASE("the hook table does not keep modules alive") {
  Affine affine;
  std::weak_ptr<AffineImpl> weak = affine.ptr();
  auto token = std::make_shared<int>(0);  // captured by the hook
  RemovableHandle handle = register_forward_pre_hook(
      *affine, [token](torch::nn::Module&, ForwardArgs&) { ++*token; });
  CHECK(token.use_count() == 2);
  affine = nullptr;
  CHECK(weak.expired());
  CHECK_FALSE(handle.is_registered());

  // What the hook captured is released by prune_forward_hooks() (or the next registration).
  CHECK(token.use_count() == 2);
  CHECK(fsdp::contract::prune_forward_hooks() >= 1);
  CHECK(token.use_count() == 1);
  CHECK_NOTHROW(handle.remove());

  // A new module, possibly at the same address, starts without hooks.
  Affine fresh;
  CHECK(fsdp::contract::num_forward_pre_hooks(*fresh) == 0);
}

TEST_CASE("register rejects an empty hook and a module not owned by a shared_ptr") {
  Affine affine;
  CHECK_THAT(error_of([&] { register_forward_pre_hook(*affine, nullptr); }),
             Catch::Contains("empty std::function"));
  AffineImpl on_stack;
  CHECK_THAT(error_of([&] {
               register_forward_hook(on_stack,
                                     [](torch::nn::Module&, const ForwardArgs&, c10::IValue&) {});
             }),
             Catch::Contains("not owned by a std::shared_ptr"));
}

TEST_CASE("a void forward runs its hooks with a None output") {
  Sink sink;
  bool saw_none = false;
  register_forward_hook(
      *sink, [&](torch::nn::Module&, const ForwardArgs&, c10::IValue& output) {
        saw_none = output.isNone();
      });
  torch::Tensor x = torch::ones({1});
  run_forward(*sink, x);
  CHECK(saw_none);
  CHECK(sink->received.is_same(x));
}

TEST_CASE("run_forward_ivalues runs the hooks around an IValue forward") {
  Log log;
  Affine affine(&log);
  register_forward_pre_hook(*affine, [&](torch::nn::Module&, ForwardArgs& args) {
    log.push_back("pre");
    args[0] = args[0].toTensor() + 1;
  });
  register_forward_hook(*affine, log_post(log, "post"));
  c10::IValue out = run_forward_ivalues(*affine, {c10::IValue(torch::zeros({1}))},
                                        [&](const ForwardArgs& args) {
                                          return c10::IValue(affine->forward(args[0].toTensor()));
                                        });
  CHECK(log == Log{"pre", "forward", "post"});
  CHECK(torch::equal(out.toTensor(), torch::full({1}, 3.0)));
}

TEST_CASE("remove_forward_hooks_after removes only later hooks on the given modules") {
  Affine a;
  Affine b;
  auto early = register_forward_pre_hook(*a, [](torch::nn::Module&, ForwardArgs&) {});
  const auto checkpoint = fsdp::contract::forward_hook_checkpoint();
  auto late = register_forward_hook(*a, [](torch::nn::Module&, const ForwardArgs&, c10::IValue&) {});
  auto other = register_forward_pre_hook(*b, [](torch::nn::Module&, ForwardArgs&) {});

  fsdp::contract::remove_forward_hooks_after(checkpoint, {a.get()});
  CHECK(early.is_registered());
  CHECK_FALSE(late.is_registered());
  CHECK(other.is_registered());
}

TEST_CASE("threads with their own modules register hooks and run forward concurrently") {
  // Ranks-as-threads tests do this. Catch2 is not thread-safe: assert on the main thread.
  constexpr int kThreads = 4;
  constexpr int kCalls = 200;
  std::vector<int> pre_calls(kThreads, 0);
  std::vector<int> correct_outputs(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([t, &pre_calls, &correct_outputs] {
      Affine affine;
      for (int i = 0; i < kCalls; ++i) {
        RemovableHandle handle = register_forward_pre_hook(
            *affine, [&pre_calls, t](torch::nn::Module&, ForwardArgs&) { ++pre_calls[t]; });
        torch::Tensor y = run_forward(*affine, torch::full({1}, static_cast<double>(i)));
        correct_outputs[t] += y.item<double>() == 2.0 * i + 1 ? 1 : 0;
        handle.remove();
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) {
    CHECK(pre_calls[t] == kCalls);
    CHECK(correct_outputs[t] == kCalls);
  }
}

TEST_CASE("forward-exception hooks see forward's error, may add context, and it is rethrown") {
  Thrower thrower;
  Log log;
  register_forward_exception_hook(*thrower, [&](torch::nn::Module& m, c10::Error& error) {
    log.push_back(std::string("exception1 ") + (m.name().find("ThrowerImpl") != std::string::npos ? "ThrowerImpl" : m.name()));
    error.add_context("first hook's context");
  });
  register_forward_exception_hook(*thrower, [&](torch::nn::Module&, c10::Error& error) {
    log.push_back("exception2");
    CHECK(error.context().size() == 1);  // sees the first hook's context
    error.add_context("second hook's context");
  });
  CHECK(fsdp::contract::num_forward_exception_hooks(*thrower) == 2);

  // The same error object, with its type, is rethrown.
  std::string message;
  try {
    run_forward(*thrower, torch::ones({2}), int64_t{5});
  } catch (const c10::IndexError& error) {
    message = error.what_without_backtrace();
  }
  CHECK(log == Log{"exception1 ThrowerImpl", "exception2"});
  CHECK_THAT(message, Catch::Contains("index 5 is out of range for size 2"));
  CHECK_THAT(message, Catch::Contains("first hook's context"));
  CHECK_THAT(message, Catch::Contains("second hook's context"));

  // A forward that does not throw runs no exception hook.
  log.clear();
  CHECK(torch::equal(run_forward(*thrower, torch::ones({2}), int64_t{1}), torch::ones({2})));
  CHECK(log.empty());
}

TEST_CASE("forward-exception hooks do not run for a hook's error or an exception that is not a c10::Error") {
  Thrower thrower;
  int exception_hook_calls = 0;
  register_forward_exception_hook(*thrower,
                                  [&](torch::nn::Module&, c10::Error&) { ++exception_hook_calls; });
  auto pre = register_forward_pre_hook(*thrower, [](torch::nn::Module&, ForwardArgs&) {
    TORCH_CHECK(false, "the pre-forward hook failed");
  });
  CHECK_THAT(error_of([&] { run_forward(*thrower, torch::ones({2}), int64_t{0}); }),
             Catch::Contains("the pre-forward hook failed"));
  pre.remove();
  auto post = register_forward_hook(*thrower, [](torch::nn::Module&, const ForwardArgs&, c10::IValue&) {
    TORCH_CHECK(false, "the post-forward hook failed");
  });
  CHECK_THAT(error_of([&] { run_forward(*thrower, torch::ones({2}), int64_t{0}); }),
             Catch::Contains("the post-forward hook failed"));
  post.remove();
  CHECK_THROWS_AS(run_forward(*thrower, torch::ones({2}), int64_t{-1}), std::runtime_error);
  CHECK(exception_hook_calls == 0);
}

TEST_CASE("a forward-exception hook may throw another error instead") {
  Thrower thrower;
  int later_calls = 0;
  register_forward_exception_hook(*thrower, [](torch::nn::Module&, c10::Error& error) {
    TORCH_CHECK(false, "replaced: ", error.msg());
  });
  register_forward_exception_hook(*thrower, [&](torch::nn::Module&, c10::Error&) { ++later_calls; });
  const std::string message = error_of([&] { run_forward(*thrower, torch::ones({2}), int64_t{9}); });
  CHECK_THAT(message, Catch::StartsWith("replaced: index 9 is out of range"));
  CHECK(later_calls == 0);
}

TEST_CASE("an error crossing nested calls meets the inner module's exception hooks first") {
  Outer outer(Thrower{});
  Log log;
  register_forward_exception_hook(*outer, [&](torch::nn::Module&, c10::Error& error) {
    log.push_back("outer sees " + std::to_string(error.context().size()) + " context line(s)");
    error.add_context("outer");
  });
  register_forward_exception_hook(*outer->inner_, [&](torch::nn::Module&, c10::Error& error) {
    log.push_back("inner");
    error.add_context("inner");
  });
  // Hooks of the same call that ran before the error still ran; post-forward hooks do not.
  register_forward_pre_hook(*outer, log_pre(log, "outer pre"));
  register_forward_hook(*outer, log_post(log, "outer post"));
  const std::string message = error_of([&] { run_forward(*outer, torch::ones({2}), int64_t{3}); });
  CHECK(log == Log{"outer pre", "inner", "outer sees 1 context line(s)"});
  CHECK_THAT(message, Catch::Contains("index 3 is out of range"));
  CHECK(message.find("inner") < message.find("outer"));
}

TEST_CASE("run_forward_ivalues runs the forward-exception hooks") {
  Thrower thrower;
  int calls = 0;
  register_forward_exception_hook(*thrower, [&](torch::nn::Module&, c10::Error& error) {
    ++calls;
    error.add_context("seen by the hook");
  });
  const std::string message = error_of([&] {
    run_forward_ivalues(*thrower, {c10::IValue(torch::ones({1})), c10::IValue(int64_t{4})},
                        [&](const ForwardArgs& args) {
                          return c10::IValue(thrower->forward(args[0].toTensor(), args[1].toInt()));
                        });
  });
  CHECK(calls == 1);
  CHECK_THAT(message, Catch::Contains("seen by the hook"));
}

TEST_CASE("forward-exception hooks are removed like the other hooks") {
  Thrower thrower;
  int calls = 0;
  auto hook = [&](torch::nn::Module&, c10::Error&) { ++calls; };
  RemovableHandle handle = register_forward_exception_hook(*thrower, hook);
  CHECK(handle.is_registered());
  handle.remove();
  CHECK_FALSE(handle.is_registered());
  CHECK(fsdp::contract::num_forward_exception_hooks(*thrower) == 0);
  CHECK_THROWS(run_forward(*thrower, torch::ones({1}), int64_t{1}));
  CHECK(calls == 0);

  const auto checkpoint = fsdp::contract::forward_hook_checkpoint();
  RemovableHandle late = register_forward_exception_hook(*thrower, hook);
  fsdp::contract::remove_forward_hooks_after(checkpoint, {thrower.get()});
  CHECK_FALSE(late.is_registered());
  CHECK_THAT(error_of([&] { register_forward_exception_hook(*thrower, nullptr); }),
             Catch::Contains("register_forward_exception_hook") && Catch::Contains("empty std::function"));
}

TEST_CASE("forward wrappers run inside the pre- and post-forward hooks, the first outermost") {
  using fsdp::contract::ForwardFunction;
  using fsdp::contract::register_forward_wrapper;
  Log log;
  Affine affine(&log);
  auto wrap = [&log](std::string name) {
    return [&log, name](torch::nn::Module&, const ForwardArgs& args, const ForwardFunction& forward) {
      log.push_back(name + " in");
      c10::IValue out = forward(args);
      log.push_back(name + " out");
      return c10::IValue(out.toTensor() * 10);
    };
  };
  // Registered before the hooks: still inside them.
  register_forward_wrapper(*affine, wrap("outer"));
  RemovableHandle inner = register_forward_wrapper(*affine, wrap("inner"));
  register_forward_pre_hook(*affine, [&](torch::nn::Module&, ForwardArgs&) { log.push_back("pre"); });
  register_forward_hook(*affine, log_post(log, "post"));
  CHECK(fsdp::contract::num_forward_wrappers(*affine) == 2);
  torch::Tensor y = run_forward(*affine, torch::ones({1}));
  CHECK(log == Log{"pre", "outer in", "inner in", "forward", "inner out", "outer out", "post"});
  CHECK(torch::equal(y, torch::full({1}, 300.0)));

  // The IValue call path runs them the same way.
  log.clear();
  c10::IValue out = run_forward_ivalues(*affine, {c10::IValue(torch::ones({1}))},
                                        [a = affine](const ForwardArgs& args) mutable {
                                          return c10::IValue(a->forward(args[0].toTensor()));
                                        });
  CHECK(log == Log{"pre", "outer in", "inner in", "forward", "inner out", "outer out", "post"});
  CHECK(torch::equal(out.toTensor(), torch::full({1}, 300.0)));

  inner.remove();
  CHECK(fsdp::contract::num_forward_wrappers(*affine) == 1);
  CHECK(torch::equal(run_forward(*affine, torch::ones({1})), torch::full({1}, 30.0)));
}

TEST_CASE("a forward wrapper may keep forward and run it again after the call") {
  using fsdp::contract::ForwardFunction;
  Affine affine;
  std::optional<ForwardFunction> kept;
  ForwardArgs kept_args;
  fsdp::contract::register_forward_wrapper(
      *affine, [&](torch::nn::Module&, const ForwardArgs& args, const ForwardFunction& forward) {
        kept = forward;
        kept_args = args;
        return forward(args);
      });
  run_forward(*affine, torch::full({1}, 2.0));
  CHECK(affine->calls == 1);
  c10::IValue again = (*kept)(kept_args);  // the call has returned: forward still runs
  CHECK(affine->calls == 2);
  CHECK(torch::equal(again.toTensor(), torch::full({1}, 5.0)));
  c10::IValue other = (*kept)({c10::IValue(torch::zeros({1}))});
  CHECK(torch::equal(other.toTensor(), torch::ones({1})));
}

TEST_CASE("a forward wrapper sees the arguments the pre-forward hooks replaced") {
  using fsdp::contract::ForwardFunction;
  Mixed mixed;
  register_forward_pre_hook(*mixed, [](torch::nn::Module&, ForwardArgs& args) { args[1] = 3.0; });
  double seen = 0;
  fsdp::contract::register_forward_wrapper(
      *mixed, [&](torch::nn::Module&, const ForwardArgs& args, const ForwardFunction& forward) {
        seen = args[1].toDouble();
        return forward(args);
      });
  torch::Tensor y = run_forward(*mixed, torch::ones({2}), 1.0, true, std::optional<torch::Tensor>());
  CHECK(seen == 3.0);
  CHECK(torch::equal(y, torch::full({2}, -3.0)));
}
