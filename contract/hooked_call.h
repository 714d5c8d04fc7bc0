#pragma once

// Methods other than forward, run with a module's forward hooks around them: the C++ form of
// FSDP2's `register_fsdp_forward_method(module, "generate")`.
//
// [Note: hooked calls]
// APIs act on a module through its forward hooks ([Note: forward hooks] in
// contract/forward_hooks.h): fully_shard all-gathers a unit's parameters in its pre-forward hook
// and frees them in its post-forward hook. A method other than forward (`generate`, `encode`,
// `score`) computes on the same parameters but runs none of those hooks when called directly:
// under fully_shard it reads sharded parameters. Python rebinds the method by name; C++ has no
// lookup by name, so the caller names the call instead:
//
//   at::Tensor tokens = fsdp::contract::call_method(model, &GPTImpl::generate, prompt, 20, 0.0, 0);
//   auto summary = fsdp::contract::call_with_hooks(model, [&] { return model->summarize(x); });
//
// Either runs exactly what a hook-able forward call runs (run_forward), with the method in
// forward's place: the process-wide call checks, the pre-forward hooks, the forward wrappers
// around the method (the first registered outermost), the forward-exception hooks if it throws
// a c10::Error, then the post-forward hooks. Every API registered through the contract sees one
// forward call of the module, so nested units the method calls through their holders (or through
// call_method) run their own hooks inside it, as in forward.
//
// What the hooks see:
//   - call_method: the method's arguments, as forward's ([Note: forward values]): each is a
//     forward value seen as the method's parameter type, and a pre-forward hook may replace it by
//     one of the same stored type (mixed precision casts floating-point inputs; fully_shard routes
//     inputs that need a gradient through its post-backward function). The method is called
//     through the module's pointer and its member-function pointer, so a wrapper may keep it and
//     call it again after the call returned (activation checkpointing recomputes in backward).
//   - call_with_hooks: no arguments (the callable captures its own). A wrapper may run the
//     callable only while call_with_hooks has not returned: the callable may hold references to
//     the caller's frame, so running it later (activation checkpointing recomputing it in a
//     backward through the result) is refused with an error naming the module. Use call_method
//     when a module with such a wrapper must backpropagate through the call.
//   - The output: the result when its type is a forward value (tensors, tuples and vectors of
//     them, scalars, strings, ...), which a post-forward hook may replace by one of the same
//     stored type (and which fully_shard hooks for backward: gradients flow through it as through
//     forward's output). Any other result type (a struct, a map, void) is returned as the callable
//     made it and the hooks see None; a hook that replaces that None fails the call. Tensors that
//     backward must reach through the call must therefore be returned as forward values.
//
// The result is returned by value (a reference result is copied). Grad mode is the caller's: under
// c10::NoGradGuard nothing is kept for backward (fully_shard frees the parameters at the end of the
// call); with grad enabled, a result that needs a gradient keeps the call in the iteration until
// its backward, as a forward's output does.
//
// Calling the method directly (`model->generate(...)`) runs no hook of the module itself; inside
// a hooked call of an ancestor, a unit used that way is caught by fully_shard's first-iteration
// guards like a bypassed forward. With no hooks registered either helper is a direct call (one
// table lookup).

#include <concepts>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "fsdp_cpp/contract/forward_hooks.h"
#include "fsdp_cpp/contract/forward_values.h"

namespace fsdp::contract {

namespace detail {

// The parts of a pointer to a member function: its class, result and parameters.
template <typename Method>
struct MethodTraits {
  static constexpr bool valid = false;
};
#define FSDP_CONTRACT_METHOD_TRAITS(QUALIFIERS)                \
  template <typename C, typename R, typename... A>             \
  struct MethodTraits<R (C::*)(A...) QUALIFIERS> {             \
    static constexpr bool valid = true;                        \
    using Class = C;                                           \
    using Result = R;                                          \
    using Params = std::tuple<A...>;                           \
  };
FSDP_CONTRACT_METHOD_TRAITS()
FSDP_CONTRACT_METHOD_TRAITS(const)
FSDP_CONTRACT_METHOD_TRAITS(noexcept)
FSDP_CONTRACT_METHOD_TRAITS(const noexcept)
FSDP_CONTRACT_METHOD_TRAITS(&)
FSDP_CONTRACT_METHOD_TRAITS(const&)
#undef FSDP_CONTRACT_METHOD_TRAITS

// A parameter type call_method can pass through the hooks: a forward value, not a non-const
// lvalue reference (a hook's replacement could not be written back to the caller's variable).
template <typename P>
concept HookedParameter =
    ForwardValue<P> &&
    (!std::is_lvalue_reference_v<P> || std::is_const_v<std::remove_reference_t<P>>);

template <typename Params>
struct AllHookedParameters;
template <typename... P>
struct AllHookedParameters<std::tuple<P...>> {
  static constexpr bool value = (HookedParameter<P> && ...);
};

// The stored types of a method's parameters, as a tuple.
template <typename Params>
struct StoredParameters;
template <typename... P>
struct StoredParameters<std::tuple<P...>> {
  using type = std::tuple<stored_forward_value_t<P>...>;
};

// Throws the error for a value of the wrong type after the hooks: `what` is "argument" (replaced
// by a pre-forward hook; `index` is its position) or "output" (replaced by a post-forward hook).
// `api` is "call_method" or "call_with_hooks"; `callable` names the method's type or the
// callable's result type.
[[noreturn]] void throw_hooked_value_mismatch(const torch::nn::Module& module, const char* api,
                                              const char* callable, std::string_view what,
                                              size_t index, const char* expected,
                                              const c10::IValue& got, const c10::Error& error);

// Throws the error for a post-forward hook that replaced the None standing for a result that is
// not a forward value (or for no result).
[[noreturn]] void throw_output_replaced(const torch::nn::Module& module, const char* api,
                                        const char* result_type, const c10::IValue& got);

// Throws the error for a forward wrapper that returned without running the call, when the result
// is not a forward value (there is nothing to return).
[[noreturn]] void throw_call_not_run(const torch::nn::Module& module, const char* api);

// Throws the error for a wrapper running call_with_hooks' callable after the call returned.
// `module` is empty when the module was destroyed.
[[noreturn]] void throw_callable_expired(const std::weak_ptr<torch::nn::Module>& module);

// Converts `value` to stored type `S`, naming the module and the value on a mismatch.
template <typename S>
S hooked_value_as(const torch::nn::Module& module, const char* api, const char* callable,
                  const c10::IValue& value, std::string_view what, size_t index) {
  try {
    return c10::IValue(value).to<S>();
  } catch (const c10::Error& error) {
    throw_hooked_value_mismatch(module, api, callable, what, index, c10::demangle_type<S>(), value,
                                error);
  }
}

// `arg` converted to parameter type `P` as a direct call would convert it (implicitly).
template <typename P, typename Arg>
P as_method_parameter(const Arg& arg) {
  static_assert(std::is_convertible_v<const Arg&, P>,
                "fsdp::contract::call_method: an argument does not convert to the method's "
                "parameter type");
  return arg;
}

// The result of one hooked call as the post-forward hooks see it, and back.
template <typename Result>
c10::IValue box_result(Result& result) {
  if constexpr (ForwardValue<Result>) {
    return to_forward_ivalue(result);
  } else {
    return c10::IValue();
  }
}

template <typename Result>
Result unbox_result(const torch::nn::Module& module, const char* api, const char* callable,
                    const c10::IValue& boxed) {
  return from_stored<Result>(
      hooked_value_as<stored_forward_value_t<Result>>(module, api, callable, boxed, "output", 0));
}

// Where a call run by wrappers leaves a result that is not a forward value (unused otherwise).
template <typename Result>
using ResultSlot =
    std::optional<std::conditional_t<std::is_void_v<Result> || ForwardValue<Result>, bool, Result>>;

// After the post-forward hooks: the None standing for a result they cannot see must stay None.
inline void check_output_not_replaced(const torch::nn::Module& module, const char* api,
                                      const char* result_type, const c10::IValue& output) {
  if (!output.isNone()) throw_output_replaced(module, api, result_type, output);
}

// Runs one hooked call of `module` whose hooks are `hooks` and whose (possibly replaced) arguments
// are `values`. `direct()` runs the call on the caller's own arguments (used when no pre-forward
// hook could have replaced them); `on_values(args)` runs it on `args` and stays valid for the
// module's lifetime; `plain` is the call as a ForwardFunction (for wrappers) returning the boxed
// result, with `slot` receiving the result when it is not a forward value.
template <typename Result, typename Direct, typename OnValues>
Result run_hooked(torch::nn::Module& module, const ForwardHookLists& hooks, ForwardArgs& values,
                  const char* api, const char* callable, Direct&& direct, OnValues&& on_values,
                  ForwardFunction plain, const std::shared_ptr<ResultSlot<Result>>& slot) {
  const bool may_have_replaced_args = !hooks.pre.empty();
  run_forward_pre_hooks(hooks, module, values);
  if (!hooks.wrap.empty()) {  // the call crosses through IValues, run by the wrappers
    ForwardFunction wrapped = wrap_forward(hooks, module, std::move(plain));
    c10::IValue boxed = call_forward(hooks, module, [&] { return wrapped(values); });
    run_forward_post_hooks(hooks, module, values, boxed);
    if constexpr (std::is_void_v<Result>) {
      check_output_not_replaced(module, api, "void", boxed);
      return;
    } else if constexpr (ForwardValue<Result>) {
      return unbox_result<Result>(module, api, callable, boxed);
    } else {
      check_output_not_replaced(module, api, c10::demangle_type<Result>(), boxed);
      if (!slot->has_value()) throw_call_not_run(module, api);
      Result result = std::move(**slot);
      slot->reset();
      return result;
    }
  }
  auto invoke = [&]() -> Result {
    if (!may_have_replaced_args) return call_forward(hooks, module, direct);
    return call_forward(hooks, module, [&]() -> Result { return on_values(values); });
  };
  if constexpr (std::is_void_v<Result>) {
    invoke();
    c10::IValue output;
    run_forward_post_hooks(hooks, module, values, output);
    check_output_not_replaced(module, api, "void", output);
  } else {
    Result result = invoke();
    if (hooks.post.empty()) return result;
    c10::IValue boxed = box_result(result);
    run_forward_post_hooks(hooks, module, values, boxed);
    if constexpr (ForwardValue<Result>) {
      return unbox_result<Result>(module, api, callable, boxed);
    } else {
      check_output_not_replaced(module, api, c10::demangle_type<Result>(), boxed);
      return result;
    }
  }
}

// call_with_hooks' callable as its wrappers run it: refused once the call returned.
template <typename F, typename Result>
struct ExpiringCallable {
  F* fn;  // null once call_with_hooks returned
  std::weak_ptr<torch::nn::Module> module;
  std::shared_ptr<ResultSlot<Result>> slot;

  c10::IValue operator()(const ForwardArgs&) const {
    if (fn == nullptr) throw_callable_expired(module);
    if constexpr (std::is_void_v<Result>) {
      std::invoke(*fn);
      return c10::IValue();
    } else if constexpr (ForwardValue<Result>) {
      const Result result = std::invoke(*fn);
      return to_forward_ivalue(result);
    } else {
      slot->emplace(std::invoke(*fn));
      return c10::IValue();
    }
  }
};

}  // namespace detail

/// Runs `fn()` with `module`'s forward hooks around it, as one forward call of `module` without
/// arguments ([Note: hooked calls]), and returns its result by value. For a method that computes
/// on `module`'s parameters (or its children's) outside forward, with arguments the callable
/// captures; hooks see the result when it is a forward value, else None. A forward wrapper may run
/// `fn` only before call_with_hooks returns.
///
///   c10::NoGradGuard no_grad;
///   auto [text, scores] = fsdp::contract::call_with_hooks(model, [&] { return model->beam(x, 4); });
template <typename F>
  requires std::invocable<F&>
auto call_with_hooks(torch::nn::Module& module, F&& fn) -> std::decay_t<std::invoke_result_t<F&>> {
  using Result = std::decay_t<std::invoke_result_t<F&>>;
  if (detail::forward_call_checks_active.load(std::memory_order_relaxed)) [[unlikely]] {
    detail::run_forward_call_checks(module);
  }
  std::shared_ptr<const detail::ForwardHookLists> hooks = detail::forward_hooks_of(module);
  if (hooks == nullptr) return std::invoke(fn);
  detail::HookedForwardScope depth;
  const char* const callable = c10::demangle_type<Result>();
  ForwardArgs values;
  std::shared_ptr<detail::ResultSlot<Result>> slot;
  ForwardFunction plain;
  std::shared_ptr<detail::ExpiringCallable<std::remove_reference_t<F>, Result>> expiring;
  if (!hooks->wrap.empty()) {
    if constexpr (!std::is_void_v<Result> && !ForwardValue<Result>) {
      slot = std::make_shared<detail::ResultSlot<Result>>();
    }
    expiring = std::make_shared<detail::ExpiringCallable<std::remove_reference_t<F>, Result>>(
        detail::ExpiringCallable<std::remove_reference_t<F>, Result>{&fn, module.weak_from_this(),
                                                                     slot});
    plain = [expiring](const ForwardArgs& args) { return (*expiring)(args); };
  }
  struct Expire {  // a wrapper that kept the callable finds it expired, also after a throw
    detail::ExpiringCallable<std::remove_reference_t<F>, Result>* target;
    ~Expire() {
      if (target != nullptr) target->fn = nullptr;
    }
  } expire{expiring.get()};
  auto direct = [&]() -> Result { return std::invoke(fn); };
  return detail::run_hooked<Result>(module, *hooks, values, "call_with_hooks", callable, direct,
                                    [&](const ForwardArgs&) -> Result { return std::invoke(fn); },
                                    std::move(plain), slot);
}

/// call_with_hooks on the module a holder holds (any holder: FSDP_HOOKABLE_MODULE's, LibTorch's).
///
///   at::Tensor h = fsdp::contract::call_with_hooks(encoder, [&] { return encoder->encode(x); });
template <typename Contained, typename F>
  requires std::invocable<F&>
auto call_with_hooks(const torch::nn::ModuleHolder<Contained>& holder, F&& fn)
    -> std::decay_t<std::invoke_result_t<F&>> {
  return call_with_hooks(static_cast<torch::nn::Module&>(*holder.ptr()), std::forward<F>(fn));
}

/// Calls `(module.*method)(args...)` with `module`'s forward hooks around it, as one forward call
/// of `module` with these arguments ([Note: hooked calls]), and returns its result by value.
/// Every argument is passed through the hooks as the method's parameter type, which must be a
/// forward value and not a non-const lvalue reference (checked at compile time; for other
/// parameters use call_with_hooks); every parameter must be given (a member-function pointer
/// carries no default arguments). An overloaded method is named with a cast:
/// `static_cast<at::Tensor (ModelImpl::*)(at::Tensor)>(&ModelImpl::score)`.
///
///   at::Tensor tokens = fsdp::contract::call_method(*model, &GPTImpl::generate, prompt, 20, 0.0, 0);
template <typename M, typename Method, typename... Args>
  requires std::derived_from<M, torch::nn::Module> && std::is_member_function_pointer_v<Method>
auto call_method(M& module, Method method, Args&&... args)
    -> std::decay_t<typename detail::MethodTraits<Method>::Result> {
  using Traits = detail::MethodTraits<Method>;
  static_assert(Traits::valid, "fsdp::contract::call_method: expected a pointer to a member "
                               "function, e.g. &ModelImpl::generate");
  static_assert(std::is_base_of_v<typename Traits::Class, M>,
                "fsdp::contract::call_method: the method is not a member of the module's class");
  using Result = std::decay_t<typename Traits::Result>;
  using Params = typename Traits::Params;
  static_assert(std::tuple_size_v<Params> == sizeof...(Args),
                "fsdp::contract::call_method: pass one argument for every parameter of the method "
                "(a member-function pointer carries no default arguments)");
  static_assert(detail::AllHookedParameters<Params>::value,
                "fsdp::contract::call_method: every parameter of the method must be a forward "
                "value (tensors, bool, integers, floats, strings, at::Scalar, c10::IValue, or "
                "optionals, vectors, ArrayRefs and tuples of these; [Note: forward values] in "
                "contract/forward_values.h) and not a non-const lvalue reference; use "
                "call_with_hooks with a lambda for other methods");
  torch::nn::Module& base = module;
  if (detail::forward_call_checks_active.load(std::memory_order_relaxed)) [[unlikely]] {
    detail::run_forward_call_checks(base);
  }
  std::shared_ptr<const detail::ForwardHookLists> hooks = detail::forward_hooks_of(base);
  if (hooks == nullptr) return std::invoke(method, module, std::forward<Args>(args)...);
  detail::HookedForwardScope depth;
  const char* const callable = c10::demangle_type<Method>();

  ForwardArgs values;
  values.reserve(sizeof...(Args));
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (values.push_back(to_forward_ivalue(
         detail::as_method_parameter<std::decay_t<std::tuple_element_t<I, Params>>>(args))),
     ...);
  }(std::index_sequence_for<Args...>{});

  // The method on (possibly replaced) arguments; valid while the module lives, so a wrapper may
  // keep it.
  using Stored = typename detail::StoredParameters<Params>::type;
  auto on_values = [impl = &module, method, callable](const ForwardArgs& a) -> Result {
    Stored stored = [&]<std::size_t... I>(std::index_sequence<I...>) {
      return Stored(detail::hooked_value_as<std::tuple_element_t<I, Stored>>(
          *impl, "call_method", callable, a[I], "argument", I)...);
    }(std::make_index_sequence<std::tuple_size_v<Stored>>{});
    return std::apply(
        [&](auto&... x) -> Result { return std::invoke(method, *impl, std::move(x)...); }, stored);
  };
  std::shared_ptr<detail::ResultSlot<Result>> slot;
  ForwardFunction plain;
  if (!hooks->wrap.empty()) {
    if constexpr (!std::is_void_v<Result> && !ForwardValue<Result>) {
      slot = std::make_shared<detail::ResultSlot<Result>>();
    }
    plain = [on_values, slot](const ForwardArgs& a) -> c10::IValue {
      if constexpr (std::is_void_v<Result>) {
        on_values(a);
        return c10::IValue();
      } else if constexpr (ForwardValue<Result>) {
        const Result result = on_values(a);
        return to_forward_ivalue(result);
      } else {
        slot->emplace(on_values(a));
        return c10::IValue();
      }
    };
  }
  auto direct = [&]() -> Result { return std::invoke(method, module, std::forward<Args>(args)...); };
  return detail::run_hooked<Result>(base, *hooks, values, "call_method", callable, direct,
                                    on_values, std::move(plain), slot);
}

/// call_method on the module a holder holds (any holder: FSDP_HOOKABLE_MODULE's, LibTorch's).
///
///   at::Tensor tokens = fsdp::contract::call_method(model, &GPTImpl::generate, prompt, 20, 0.0, 0);
///   at::Tensor h = fsdp::contract::call_method(block, &BlockImpl::attend, x, mask);   // a child unit
template <typename Contained, typename Method, typename... Args>
  requires std::is_member_function_pointer_v<Method>
auto call_method(const torch::nn::ModuleHolder<Contained>& holder, Method method, Args&&... args)
    -> std::decay_t<typename detail::MethodTraits<Method>::Result> {
  return call_method(*holder.ptr(), method, std::forward<Args>(args)...);
}

}  // namespace fsdp::contract
