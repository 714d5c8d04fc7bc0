#pragma once

// Pre-forward and post-forward hooks on LibTorch modules, and the call path that runs them.
//
// [Note: forward hooks]
// LibTorch's torch::nn::Module has no forward hooks and its `forward` is not virtual, so hooks
// live in a side table keyed by module identity and run only on the hook-able call paths:
//   - a hook-able holder's operator() (FSDP_HOOKABLE_MODULE, contract/hookable_module_holder.h,
//     and the holders in contract/hookable_modules.h),
//   - fsdp::contract::Sequential, ModuleList and AnyHookableModule, which call their children
//     through the hooks,
//   - run_forward(module, args...) and run_forward_ivalues(module, args, forward) below,
//   - call_method(module, &Impl::method, args...) and call_with_hooks(module, callable), around a
//     method other than forward ([Note: hooked calls] in contract/hooked_call.h).
// Calling `holder->forward(...)` or `impl.forward(...)` bypasses the hooks; that is unsupported on
// a module an API manages (the FSDP engine detects it through the autograd graph).
//
// One call runs: the pre-forward hooks in registration order (each may replace arguments), then
// forward with the (possibly replaced) arguments, wrapped by the forward wrappers (the first
// registered outermost; each decides how forward runs, e.g. activation checkpointing runs it
// without keeping activations and again in backward), then the post-forward hooks in registration
// order (each sees the arguments forward received and may replace the output). Wrappers are
// always inside the pre- and post-forward hooks, whatever the order of registration. `prepend = true`
// registers a hook before the existing ones. Hooks added or removed while a call runs take effect
// from the next call. If forward or a hook throws, the remaining hooks do not run.
// Hooks see values as IValues ([Note: forward values] in contract/forward_values.h).
//
// Hooks belong to the module object: every holder of the same Impl shares them, and clone()
// does not copy them. The table holds each module weakly and each hook strongly: a hook never
// keeps its module alive, unless it captures a std::shared_ptr to it (a cycle that lasts until
// the hook is removed; capture a raw pointer or weak_ptr instead). A destroyed module's hooks are
// released at the next registration of any hook, or by prune_forward_hooks(). Modules must be
// owned by a std::shared_ptr (every ModuleHolder is). All functions are thread-safe; hooks run
// outside the table's lock and may register or remove hooks.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <c10/util/FunctionRef.h>
#include <c10/util/Type.h>

#include "fsdp_cpp/contract/forward_values.h"

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace fsdp::contract {

/// A pre-forward hook: runs before `forward` and may replace `args` in place (same number of
/// arguments, each of the same stored type).
///
///   ForwardPreHook unshard = [&](torch::nn::Module& m, ForwardArgs& args) { handle.unshard(); };
using ForwardPreHook = std::function<void(torch::nn::Module& module, ForwardArgs& args)>;

/// A post-forward hook: runs after `forward`, sees the arguments `forward` received, and may
/// replace `output` in place (by a value of the same stored type).
///
///   ForwardHook reshard = [&](torch::nn::Module& m, const ForwardArgs& args, c10::IValue& out) {
///     handle.reshard();
///     for_each_tensor(out, [&](const at::Tensor& t) { /* register pre-backward hook */ });
///   };
using ForwardHook = std::function<void(torch::nn::Module& module, const ForwardArgs& args,
                                       c10::IValue& output)>;

/// A forward-exception hook: runs when `forward` throws a c10::Error after the call's pre-forward
/// hooks ran. It may add context to `error` (the same object is rethrown afterwards) or throw
/// another exception instead (which then propagates; later exception hooks do not run). A module
/// may be inside several calls with exception hooks (its parents'): each sees the error in turn,
/// innermost first, with the context the inner ones added.
///
///   ForwardExceptionHook explain = [](torch::nn::Module& m, c10::Error& error) {
///     error.add_context("fully_shard: ... while running " + m.name());
///   };
using ForwardExceptionHook = std::function<void(torch::nn::Module& module, c10::Error& error)>;

/// The module's forward on IValues, without its hooks (what a forward wrapper wraps). It stays
/// callable after the call returns, as long as the module lives, so a wrapper may keep it and
/// run forward again later (activation checkpointing recomputes the forward in backward).
using ForwardFunction = std::function<c10::IValue(const ForwardArgs& args)>;

/// A forward wrapper: runs in place of forward, between the pre- and post-forward hooks, and
/// returns the output (of the same stored type as forward's). It receives the arguments after
/// the pre-forward hooks and `forward`, the module's forward (already wrapped by the wrappers
/// registered after this one).
///
///   ForwardWrapper no_grad = [](torch::nn::Module&, const ForwardArgs& args,
///                               const ForwardFunction& forward) {
///     c10::NoGradGuard guard;
///     return forward(args);
///   };
using ForwardWrapper = std::function<c10::IValue(torch::nn::Module& module, const ForwardArgs& args,
                                                 const ForwardFunction& forward)>;

/// Base class of the module holders whose call operator runs forward hooks (HookableModuleHolder,
/// that is every holder declared with FSDP_HOOKABLE_MODULE or FSDP_HOOKABLE_MODULE_IMPL, the
/// holders of contract/hookable_modules.h, fsdp::contract::Sequential). LibTorch's holders
/// (TORCH_MODULE, torch::nn::Linear, torch::nn::Sequential, ...) call forward directly and do not
/// derive from it. A holder of one's own that runs the hooks (through run_forward) may derive
/// from it to be recognised as hook-able.
struct HookableHolderIndicator {};

/// True for holder types whose call operator runs forward hooks (see HookableHolderIndicator).
/// APIs that rely on hooks refuse other holders at compile time.
///
///   static_assert(fsdp::contract::HookableHolder<fsdp::contract::Linear>);
///   static_assert(!fsdp::contract::HookableHolder<torch::nn::Linear>);
template <typename Holder>
concept HookableHolder = std::is_base_of_v<HookableHolderIndicator, std::remove_cvref_t<Holder>>;

namespace detail {
class ForwardHookTable;
}  // namespace detail

/// Returned by the register functions; `remove()` unregisters the hook. Like Python's
/// `RemovableHandle`, destroying or copying the handle does not remove the hook; copies refer to
/// the same hook. A default-constructed handle refers to no hook.
///
///   auto handle = register_forward_pre_hook(*block, hook);
///   ...
///   handle.remove();   // idempotent; a no-op once the module is destroyed
class RemovableHandle {
 public:
  RemovableHandle() = default;

  /// Unregisters the hook. Idempotent; a no-op once the module is destroyed.
  void remove();

  /// True while the hook is registered on a live module.
  bool is_registered() const;

 private:
  friend class detail::ForwardHookTable;
  RemovableHandle(const torch::nn::Module* module, uint64_t id) : module_(module), id_(id) {}

  const torch::nn::Module* module_ = nullptr;  // key into the hook table, never dereferenced
  uint64_t id_ = 0;                            // unique across all modules and all time
};

/// Registers a pre-forward hook on `module` (after the existing ones, or first with `prepend`).
/// Throws c10::Error if `hook` is empty or `module` is not owned by a std::shared_ptr.
///
///   auto handle = fsdp::contract::register_forward_pre_hook(
///       *model->fc, [](torch::nn::Module&, ForwardArgs& args) {
///         args[0] = args[0].toTensor() * 2;   // replaces the input
///       });
RemovableHandle register_forward_pre_hook(torch::nn::Module& module, ForwardPreHook hook,
                                          bool prepend = false);

/// Registers a post-forward hook on `module` (after the existing ones, or first with `prepend`).
/// Throws c10::Error if `hook` is empty or `module` is not owned by a std::shared_ptr.
///
///   auto handle = fsdp::contract::register_forward_hook(
///       *model->fc, [](torch::nn::Module&, const ForwardArgs&, c10::IValue& out) {
///         out = out.toTensor().relu();         // replaces the output
///       });
RemovableHandle register_forward_hook(torch::nn::Module& module, ForwardHook hook,
                                      bool prepend = false);

/// Registers a forward-exception hook on `module` (after the existing ones, or first with
/// `prepend`). Throws c10::Error if `hook` is empty or `module` is not owned by a std::shared_ptr.
///
///   auto handle = fsdp::contract::register_forward_exception_hook(
///       *model, [](torch::nn::Module& m, c10::Error& error) {
///         error.add_context("while running the model");
///       });
RemovableHandle register_forward_exception_hook(torch::nn::Module& module,
                                                ForwardExceptionHook hook, bool prepend = false);

/// Registers a forward wrapper on `module` (innermost, or outermost with `prepend`). Throws
/// c10::Error if `wrapper` is empty or `module` is not owned by a std::shared_ptr.
///
///   auto handle = fsdp::contract::register_forward_wrapper(
///       *block, [](torch::nn::Module&, const ForwardArgs& args, const ForwardFunction& forward) {
///         return forward(args);   // run forward as it is
///       });
RemovableHandle register_forward_wrapper(torch::nn::Module& module, ForwardWrapper wrapper,
                                         bool prepend = false);

/// The number of forward wrappers registered on `module`.
size_t num_forward_wrappers(const torch::nn::Module& module);

/// The number of pre-forward hooks registered on `module`.
size_t num_forward_pre_hooks(const torch::nn::Module& module);

/// The number of post-forward hooks registered on `module`.
size_t num_forward_hooks(const torch::nn::Module& module);

/// The number of forward-exception hooks registered on `module`.
size_t num_forward_exception_hooks(const torch::nn::Module& module);

/// Releases the hooks of destroyed modules now (what they capture is destroyed), rather than at
/// the next registration. Returns the number of modules whose hooks were released.
///
///   model = nullptr;                          // destroy the model
///   fsdp::contract::prune_forward_hooks();    // and what its hooks captured
size_t prune_forward_hooks();

/// The number of calls through a module's hooks (pre-forward hook to post-forward hook) running
/// on this thread, counting the current one: 2 or more inside a hook means the module runs inside
/// another module's hooked forward (e.g. fully_shard's blocks inside a model under replicate).
/// Calls of modules without hooks are not counted.
size_t hooked_forward_depth();

/// A process-wide check run at the start of every call through a hook-able call path (hook-able
/// holders, run_forward, run_forward_ivalues and the containers that use them, call_method,
/// call_with_hooks), with or without hooks on the module, before its pre-forward hooks; it
/// refuses the call by throwing. For a library that needs to look at modules only in some
/// processes (e.g. a module whose tensors have no memory yet): while no check is registered a call
/// pays one relaxed atomic load. Checks cannot be removed; each should cost little once a module
/// passed it.
///
///   fsdp::contract::add_forward_call_check([](torch::nn::Module& m) { TORCH_CHECK(ok(m), ...); });
using ForwardCallCheck = void (*)(torch::nn::Module& module);
void add_forward_call_check(ForwardCallCheck check);

/// Identifies the hooks registered so far (hook ids grow monotonically).
using ForwardHookCheckpoint = uint64_t;

/// The current checkpoint: every hook registered later has a larger id.
ForwardHookCheckpoint forward_hook_checkpoint();

/// Removes the hooks registered after `checkpoint` on any of `modules`. `apply_api` uses it to
/// undo the hooks that a failed API application registered inside its module's tree.
void remove_forward_hooks_after(ForwardHookCheckpoint checkpoint,
                                const std::vector<const torch::nn::Module*>& modules);

/// Runs `forward(args)` with `module`'s hooks around it, on IValues: the type-erased call path of
/// containers (AnyHookableModule, Sequential). `forward` receives the arguments after the
/// pre-forward hooks; it must not modify them (the post-forward hooks see them). When `module`
/// has forward wrappers, `forward` is kept by them and must stay callable while the module lives
/// (capture by value).
///
///   c10::IValue out = run_forward_ivalues(*block, {c10::IValue(x)},
///       [&](const ForwardArgs& a) { return c10::IValue(block->forward(a[0].toTensor())); });
/// A c10::Error thrown by `forward` goes through the module's forward-exception hooks.
c10::IValue run_forward_ivalues(torch::nn::Module& module, ForwardArgs args,
                                const ForwardFunction& forward);

namespace detail {

// The signature of a plain forward: one non-template, non-overloaded, non-const member function
// (what torch::nn::AnyModule can store) whose parameters and output are forward values.
template <typename F>
struct ForwardSignature {
  static constexpr bool valid = false;
};
template <typename C, typename R, typename... A>
struct ForwardSignature<R (C::*)(A...)> {
  static constexpr bool valid =
      !std::is_void_v<R> && ForwardValue<R> && (ForwardValue<A> && ...) &&
      ((!std::is_lvalue_reference_v<A> || std::is_const_v<std::remove_reference_t<A>>) && ...);
  using Output = std::decay_t<R>;
  using Params = std::tuple<A...>;
};

}  // namespace detail

/// A module with a plain typed forward: one non-template, non-overloaded, non-const `forward`
/// whose parameter and output types are forward values and whose parameters are not non-const
/// lvalue references (what torch::nn::AnyModule can store).
template <typename M>
concept TypedForwardModule =
    requires { &M::forward; } && detail::ForwardSignature<decltype(&M::forward)>::valid;

/// Calls `module.forward(args...)` with `module`'s forward hooks around it: the typed call path
/// of hook-able holders. With no hooks registered it is a direct call (one table lookup); with
/// hooks, the arguments and output cross through IValues ([Note: forward values]), so every
/// argument type and the output type must be forward values (checked at compile time). When
/// forward is plain (TypedForwardModule), hooks see each argument as forward's parameter type
/// (an `int` passed for a `double` parameter is a Double); otherwise as the caller's type.
/// Returns forward's output by value.
///
///   torch::Tensor y = fsdp::contract::run_forward(*block, x);               // Tensor forward(Tensor)
///   auto [out, weights] = fsdp::contract::run_forward(*attn, q, k, v);     // tuple output
template <typename M, typename... Args>
auto run_forward(M& module, Args&&... args)
    -> std::decay_t<decltype(module.forward(std::forward<Args>(args)...))>;

// ----------------------------------------------------------------------------------------------
// Implementation details.

namespace detail {

// One module's hooks, in call order. Immutable once published: registering or removing a hook
// publishes a new copy, so a call iterates a consistent snapshot without holding a lock.
struct ForwardHookLists {
  struct PreHookEntry {
    uint64_t id;
    std::shared_ptr<const ForwardPreHook> hook;
  };
  struct HookEntry {
    uint64_t id;
    std::shared_ptr<const ForwardHook> hook;
  };
  struct ExceptionHookEntry {
    uint64_t id;
    std::shared_ptr<const ForwardExceptionHook> hook;
  };
  std::vector<PreHookEntry> pre;
  std::vector<HookEntry> post;
  std::vector<ExceptionHookEntry> exception;
  struct WrapperEntry {
    uint64_t id;
    std::shared_ptr<const ForwardWrapper> hook;
  };
  std::vector<WrapperEntry> wrap;
};

// The hooks of `module`, or nullptr when it has none.
std::shared_ptr<const ForwardHookLists> forward_hooks_of(const torch::nn::Module& module);

// Run the hooks of one call. The pre-forward runner checks that hooks keep the argument count.
void run_forward_pre_hooks(const ForwardHookLists& hooks, torch::nn::Module& module,
                           ForwardArgs& args);
void run_forward_post_hooks(const ForwardHookLists& hooks, torch::nn::Module& module,
                            const ForwardArgs& args, c10::IValue& output);
void run_forward_exception_hooks(const ForwardHookLists& hooks, torch::nn::Module& module,
                                 c10::Error& error);

// Set once a forward call check is registered (add_forward_call_check).
extern std::atomic<bool> forward_call_checks_active;
void run_forward_call_checks(torch::nn::Module& module);

// Counts a hooked call in hooked_forward_depth() for its lifetime.
class HookedForwardScope {
 public:
  HookedForwardScope();
  ~HookedForwardScope();
  HookedForwardScope(const HookedForwardScope&) = delete;
  HookedForwardScope& operator=(const HookedForwardScope&) = delete;
};

// `forward` wrapped by the module's forward wrappers (the first outermost).
ForwardFunction wrap_forward(const ForwardHookLists& hooks, torch::nn::Module& module,
                             ForwardFunction forward);

// Calls `forward()`; a c10::Error it throws goes through the exception hooks and is rethrown.
template <typename F>
auto call_forward(const ForwardHookLists& hooks, torch::nn::Module& module, F&& forward)
    -> decltype(forward()) {
  if (hooks.exception.empty()) {
    return forward();
  }
  try {
    return forward();
  } catch (c10::Error& error) {
    run_forward_exception_hooks(hooks, module, error);
    throw;
  }
}

// Throws the error for a forward value of the wrong type: `what` is "argument" (replaced by a
// pre-forward hook; `index` is its position), "output" (replaced by a post-forward hook) or
// "requested output" (a container's forward<Output> asked for another type than forward returns).
[[noreturn]] void throw_forward_value_mismatch(const torch::nn::Module& module,
                                               std::string_view what, size_t index,
                                               const char* expected, const c10::IValue& got,
                                               const c10::Error& error);

// Converts `value` to stored type `S`, naming the module and the value on a mismatch.
template <typename S>
S forward_value_as(const torch::nn::Module& module, const c10::IValue& value,
                   std::string_view what, size_t index) {
  try {
    return c10::IValue(value).to<S>();
  } catch (const c10::Error& error) {
    throw_forward_value_mismatch(module, what, index, c10::demangle_type<S>(), value, error);
  }
}

// The decayed types run_forward passes arguments as: forward's first sizeof...(Args) parameter
// types when forward is plain, else the caller's argument types.
template <typename M, typename... Args>
struct CallParameters {
  using type = std::tuple<std::decay_t<Args>...>;
};
template <typename M, typename... Args>
  requires TypedForwardModule<M> &&
           (sizeof...(Args) <=
            std::tuple_size_v<typename ForwardSignature<decltype(&M::forward)>::Params>)
struct CallParameters<M, Args...> {
  using Params = typename ForwardSignature<decltype(&M::forward)>::Params;
  using type = decltype([]<std::size_t... I>(std::index_sequence<I...>) {
    return std::tuple<std::decay_t<std::tuple_element_t<I, Params>>...>();
  }(std::index_sequence_for<Args...>{}));
};

// `arg` converted to parameter type `P` as the call would convert it (implicitly).
template <typename P, typename Arg>
P as_call_parameter(const Arg& arg) {
  static_assert(std::is_convertible_v<const Arg&, P>,
                "fsdp::contract::run_forward: an argument does not convert to forward's "
                "parameter type");
  return arg;
}

// The arguments as stored types, after the pre-forward hooks.
template <typename... S>
std::tuple<S...> stored_args_from(const torch::nn::Module& module, const ForwardArgs& args) {
  return [&]<std::size_t... I>(std::index_sequence<I...>) {
    return std::tuple<S...>(forward_value_as<S>(module, args[I], "argument", I)...);
  }(std::index_sequence_for<S...>{});
}

}  // namespace detail

template <typename M, typename... Args>
auto run_forward(M& module, Args&&... args)
    -> std::decay_t<decltype(module.forward(std::forward<Args>(args)...))> {
  using Output = std::decay_t<decltype(module.forward(std::forward<Args>(args)...))>;
  using Params = typename detail::CallParameters<M, Args...>::type;
  static_assert(ForwardValue<Params>,
                "fsdp::contract::run_forward: every argument of a hook-able forward call must be "
                "a forward value: tensors, bool, integers, floats, strings, at::Scalar, "
                "c10::IValue, or optionals, vectors, ArrayRefs and tuples of these "
                "([Note: forward values] in contract/forward_values.h)");
  static_assert(std::is_void_v<Output> || ForwardValue<Output>,
                "fsdp::contract::run_forward: the output of a hook-able forward must be void or "
                "a forward value ([Note: forward values] in contract/forward_values.h)");
  torch::nn::Module& base = module;
  if (detail::forward_call_checks_active.load(std::memory_order_relaxed)) [[unlikely]] {
    detail::run_forward_call_checks(base);
  }
  std::shared_ptr<const detail::ForwardHookLists> hooks = detail::forward_hooks_of(base);
  if (hooks == nullptr) {
    return module.forward(std::forward<Args>(args)...);
  }
  detail::HookedForwardScope depth;

  ForwardArgs values;
  values.reserve(sizeof...(Args));
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (values.push_back(to_forward_ivalue(
         detail::as_call_parameter<std::tuple_element_t<I, Params>>(args))),
     ...);
  }(std::index_sequence_for<Args...>{});
  const bool may_have_replaced_args = !hooks->pre.empty();
  detail::run_forward_pre_hooks(*hooks, base, values);
  if (!hooks->wrap.empty()) {  // forward crosses through IValues, called by the wrappers
    // By value: a wrapper may keep it to run forward again later.
    ForwardFunction plain = [impl = &module, self = &base](const ForwardArgs& a) -> c10::IValue {
      auto stored = [&]<std::size_t... I>(std::index_sequence<I...>) {
        return detail::stored_args_from<
            stored_forward_value_t<std::tuple_element_t<I, Params>>...>(*self, a);
      }(std::index_sequence_for<Args...>{});
      if constexpr (std::is_void_v<Output>) {
        std::apply([impl](auto&... x) { impl->forward(x...); }, stored);
        return c10::IValue();
      } else {
        return to_forward_ivalue(
            std::apply([impl](auto&... x) -> Output { return impl->forward(x...); }, stored));
      }
    };
    ForwardFunction wrapped = detail::wrap_forward(*hooks, base, std::move(plain));
    c10::IValue boxed = detail::call_forward(*hooks, base, [&] { return wrapped(values); });
    detail::run_forward_post_hooks(*hooks, base, values, boxed);
    if constexpr (std::is_void_v<Output>) {
      return;
    } else {
      return detail::from_stored<Output>(
          detail::forward_value_as<stored_forward_value_t<Output>>(base, boxed, "output", 0));
    }
  }
  auto invoke = [&]() -> Output {
    if (!may_have_replaced_args) {
      return detail::call_forward(*hooks, base, [&]() -> Output {
        return module.forward(std::forward<Args>(args)...);
      });
    }
    auto stored = [&]<std::size_t... I>(std::index_sequence<I...>) {
      return detail::stored_args_from<
          stored_forward_value_t<std::tuple_element_t<I, Params>>...>(base, values);
    }(std::index_sequence_for<Args...>{});
    return detail::call_forward(*hooks, base, [&]() -> Output {
      return std::apply([&module](auto&... a) -> Output { return module.forward(a...); }, stored);
    });
  };

  if constexpr (std::is_void_v<Output>) {
    invoke();
    c10::IValue output;  // None; a replacement has nowhere to go
    detail::run_forward_post_hooks(*hooks, base, values, output);
  } else {
    Output output = invoke();
    if (hooks->post.empty()) {
      return output;
    }
    c10::IValue boxed = to_forward_ivalue(output);
    detail::run_forward_post_hooks(*hooks, base, values, boxed);
    return detail::from_stored<Output>(
        detail::forward_value_as<stored_forward_value_t<Output>>(base, boxed, "output", 0));
  }
}

}  // namespace fsdp::contract
