#pragma once

// AnyHookableModule: a type-erased module called through its forward hooks (the hook-able
// counterpart of torch::nn::AnyModule), the element type of fsdp::contract::Sequential and
// ModuleList.

#include <concepts>
#include <cstddef>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

#include "fsdp_cpp/contract/forward_hooks.h"
#include "fsdp_cpp/contract/hookable_module_holder.h"

namespace fsdp::contract {

/// A module whose forward works on IValues directly: `c10::IValue forward_ivalues(const
/// ForwardArgs&)`. Containers whose `forward` is a template (fsdp::contract::Sequential) provide
/// it so that they can be called, hooks included, from inside other containers.
template <typename M>
concept IValueForwardModule = requires(M& module, const ForwardArgs& args) {
  { module.forward_ivalues(args) } -> std::same_as<c10::IValue>;
};

class AnyHookableModule;

/// What a hook-able container (Sequential, ModuleList) accepts as a child: a module holder, a
/// std::shared_ptr to a module, or an AnyHookableModule.
template <typename T>
concept HookableContainerChild =
    std::is_base_of_v<torch::detail::ModuleHolderIndicator, std::decay_t<T>> ||
    std::is_same_v<std::decay_t<T>, AnyHookableModule> ||
    requires(const std::decay_t<T>& ptr) {
      { std::shared_ptr<torch::nn::Module>(ptr) };
    };

/// A module of any class, called through its forward hooks ([Note: forward hooks] in
/// contract/forward_hooks.h). Calls are type-erased: arguments and output cross as IValues
/// ([Note: forward values]). A module is callable if its forward is a plain member function (one
/// non-template, non-overloaded, non-const `forward`, as torch::nn::AnyModule requires; defaults
/// declared with FORWARD_HAS_DEFAULT_ARGS are filled in) or if it is an IValueForwardModule.
/// Other modules (e.g. a ModuleList) may be held but not called. Copies refer to the same module.
///
///   fsdp::contract::AnyHookableModule any(fsdp::contract::Linear(4, 8));
///   torch::Tensor y = any(x);                                         // output type Tensor
///   auto [out, w] = attn_any.forward<std::tuple<torch::Tensor, torch::Tensor>>(q, k, v);
class AnyHookableModule {
 public:
  /// An empty module: not callable, `is_empty()` is true.
  AnyHookableModule() = default;

  /// Holds `module` (which must not be null).
  template <typename M>
  explicit AnyHookableModule(std::shared_ptr<M> module);

  /// Holds the module of `holder` (LibTorch's holders and hook-able holders alike).
  template <typename M>
  explicit AnyHookableModule(const torch::nn::ModuleHolder<M>& holder)
      : AnyHookableModule(holder.ptr()) {}

  /// Calls forward with the module's hooks around it, on IValues. Throws c10::Error if the
  /// module is empty or not callable, or the arguments do not match forward's parameters.
  ///
  ///   c10::IValue out = any.forward_ivalues({c10::IValue(x)});
  c10::IValue forward_ivalues(const ForwardArgs& args) const;

  /// Calls forward with the module's hooks around it; `Output` names forward's output type.
  ///
  ///   torch::Tensor y = any.forward(x);
  ///   auto pair = any.forward<std::tuple<torch::Tensor, torch::Tensor>>(q, k, v);
  template <typename Output = torch::Tensor, typename... Args>
  Output forward(Args&&... args) const;

  /// Same as forward<Output>(args...).
  template <typename Output = torch::Tensor, typename... Args>
  Output operator()(Args&&... args) const {
    return forward<Output>(std::forward<Args>(args)...);
  }

  /// True when no module is held.
  bool is_empty() const noexcept { return module_ == nullptr; }

  /// True when the held module can be called (see the class comment).
  bool is_callable() const noexcept { return invoke_ != nullptr; }

  /// The held module.
  const std::shared_ptr<torch::nn::Module>& ptr() const;

  /// The held module as `M`; throws c10::Error naming both classes if it is not an `M`.
  ///
  ///   std::shared_ptr<torch::nn::LinearImpl> fc = any.ptr_as<torch::nn::LinearImpl>();
  template <typename M>
  std::shared_ptr<M> ptr_as() const;

  /// The held module as the hook-able holder `Holder` (declared with FSDP_HOOKABLE_MODULE);
  /// throws c10::Error if the module is not a `Holder::Impl`.
  ///
  ///   fsdp::contract::Linear fc = any.as<fsdp::contract::Linear>();
  ///   torch::Tensor y = fc(x);   // runs the hooks
  template <typename Holder>
  Holder as() const;

  /// A deep copy of the module (its class's clone()), callable like this one. Hooks are not
  /// copied: they belong to the original module.
  AnyHookableModule clone(const std::optional<torch::Device>& device = std::nullopt) const;

 private:
  using Invoke = c10::IValue (*)(const AnyHookableModule& self, const ForwardArgs& args);
  using Clone = AnyHookableModule (*)(const AnyHookableModule& self,
                                      const std::optional<torch::Device>& device);

  template <typename M>
  static c10::IValue invoke_ivalue_forward(const AnyHookableModule& self,
                                           const ForwardArgs& args);
  template <typename M>
  static c10::IValue invoke_typed_forward(const AnyHookableModule& self, const ForwardArgs& args);
  template <typename M>
  static AnyHookableModule clone_as(const AnyHookableModule& self,
                                    const std::optional<torch::Device>& device);

  std::shared_ptr<torch::nn::Module> module_;
  std::shared_ptr<torch::nn::AnyModule> any_module_;  // the typed forward path only
  Invoke invoke_ = nullptr;                           // forward without hooks; null: not callable
  Clone clone_ = nullptr;
};

// ----------------------------------------------------------------------------------------------
// Implementation of the templates.

namespace detail {

// A stored value as forward's (decayed) parameter type `P`: views (IntArrayRef) point into
// `stored`, which must outlive the call.
template <typename P, typename S>
P as_parameter(S& stored) {
  if constexpr (std::is_same_v<P, S>) {
    return std::move(stored);
  } else if constexpr (std::is_constructible_v<P, S&>) {
    return P(stored);
  } else {
    return from_stored<P>(std::move(stored));
  }
}

template <std::size_t... I>
torch::nn::AnyValue any_forward_first(torch::nn::AnyModule& module,
                                      std::vector<torch::nn::AnyValue>& values,
                                      std::index_sequence<I...>) {
  return module.any_forward(std::move(values[I])...);
}

// AnyModule::any_forward is variadic: dispatch the runtime argument count to 0..max arguments.
template <std::size_t... N>
torch::nn::AnyValue any_forward_dispatch(torch::nn::AnyModule& module,
                                         std::vector<torch::nn::AnyValue>& values,
                                         std::index_sequence<N...>) {
  std::optional<torch::nn::AnyValue> output;
  (void)((values.size() == N &&
          (output.emplace(any_forward_first(module, values, std::make_index_sequence<N>{})),
           true)) ||
         ...);
  TORCH_INTERNAL_ASSERT(output.has_value());
  return std::move(*output);
}

// Calls forward through `any` (which fills in FORWARD_HAS_DEFAULT_ARGS defaults) with `args`
// converted to forward's parameter types; returns the output as an IValue.
template <typename Output, typename... Params>
c10::IValue call_any_module(torch::nn::AnyModule& any, const torch::nn::Module& module,
                            const ForwardArgs& args, std::type_identity<std::tuple<Params...>>) {
  constexpr std::size_t kArity = sizeof...(Params);
  TORCH_CHECK(args.size() <= kArity, "fsdp::contract: ", module.name(), "::forward takes at most ",
              kArity, " argument(s), got ", args.size());
  std::tuple<stored_forward_value_t<Params>...> stored;
  std::vector<torch::nn::AnyValue> values;
  values.reserve(args.size());
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    ((I < args.size()
          ? (void)(std::get<I>(stored) = forward_value_as<stored_forward_value_t<Params>>(
                       module, args[I], "argument", I),
                   values.emplace_back(as_parameter<std::decay_t<Params>>(std::get<I>(stored))))
          : void()),
     ...);
  }(std::index_sequence_for<Params...>{});
  torch::nn::AnyValue output =
      any_forward_dispatch(any, values, std::make_index_sequence<kArity + 1>{});
  return to_forward_ivalue(output.get<Output>());
}

}  // namespace detail

template <typename M>
AnyHookableModule::AnyHookableModule(std::shared_ptr<M> module) : module_(module) {
  static_assert(std::is_base_of_v<torch::nn::Module, M>,
                "fsdp::contract::AnyHookableModule holds torch::nn::Module subclasses only");
  TORCH_CHECK(module_ != nullptr,
              "fsdp::contract::AnyHookableModule: expected a module, got nullptr (an empty "
              "holder?)");
  clone_ = &clone_as<M>;
  if constexpr (IValueForwardModule<M>) {
    invoke_ = &invoke_ivalue_forward<M>;
  } else if constexpr (TypedForwardModule<M>) {
    any_module_ = std::make_shared<torch::nn::AnyModule>(std::move(module));
    invoke_ = &invoke_typed_forward<M>;
  }
}

template <typename M>
c10::IValue AnyHookableModule::invoke_ivalue_forward(const AnyHookableModule& self,
                                                     const ForwardArgs& args) {
  return static_cast<M&>(*self.module_).forward_ivalues(args);
}

template <typename M>
c10::IValue AnyHookableModule::invoke_typed_forward(const AnyHookableModule& self,
                                                    const ForwardArgs& args) {
  using Signature = detail::ForwardSignature<decltype(&M::forward)>;
  return detail::call_any_module<typename Signature::Output>(
      *self.any_module_, *self.module_, args,
      std::type_identity<typename Signature::Params>{});
}

template <typename M>
AnyHookableModule AnyHookableModule::clone_as(const AnyHookableModule& self,
                                              const std::optional<torch::Device>& device) {
  std::shared_ptr<torch::nn::Module> copy = self.module_->clone(device);
  auto typed = std::dynamic_pointer_cast<M>(copy);
  TORCH_CHECK(typed != nullptr, "fsdp::contract: clone() of module ", self.module_->name(),
              " returned a module of class ", copy->name(), "; expected ",
              c10::demangle_type<M>());
  return AnyHookableModule(std::move(typed));
}

template <typename Output, typename... Args>
Output AnyHookableModule::forward(Args&&... args) const {
  static_assert((ForwardValue<Args> && ...) && ForwardValue<Output>,
                "fsdp::contract::AnyHookableModule::forward: arguments and Output must be "
                "forward values ([Note: forward values] in contract/forward_values.h)");
  ForwardArgs values;
  values.reserve(sizeof...(Args));
  (values.push_back(to_forward_ivalue(args)), ...);
  c10::IValue output = forward_ivalues(values);
  return detail::from_stored<Output>(detail::forward_value_as<stored_forward_value_t<Output>>(
      *module_, output, "requested output", 0));
}

template <typename M>
std::shared_ptr<M> AnyHookableModule::ptr_as() const {
  auto typed = std::dynamic_pointer_cast<M>(ptr());
  TORCH_CHECK(typed != nullptr, "fsdp::contract::AnyHookableModule: module ", module_->name(),
              " is not a ", c10::demangle_type<M>());
  return typed;
}

template <typename Holder>
Holder AnyHookableModule::as() const {
  using Impl = typename Holder::ContainedType;
  static_assert(std::is_base_of_v<HookableModuleHolder<Impl>, Holder>,
                "fsdp::contract::AnyHookableModule::as<Holder>: Holder must be a hook-able holder "
                "(FSDP_HOOKABLE_MODULE); LibTorch's holders would bypass the hooks. Use "
                "ptr_as<Impl>() for the module itself");
  return Holder(ptr_as<Impl>());
}

}  // namespace fsdp::contract
