#pragma once

// fsdp::contract::Sequential: a sequential container that calls each child through its forward
// hooks. LibTorch's torch::nn::Sequential calls `Impl::forward` directly (through AnyModule) and
// so bypasses them.

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include "fsdp_cpp/contract/any_hookable_module.h"
#include "fsdp_cpp/contract/forward_hooks.h"
#include "fsdp_cpp/contract/hookable_module_holder.h"

namespace fsdp::contract {

/// Runs its children in order, each through its forward hooks (its holder's call operator does
/// the same for the Sequential's own hooks): the first child receives the Sequential's
/// arguments, every later child one argument, the previous child's output. Children are
/// registered as submodules "0", "1", ... (or under the names given), so FQNs are those of
/// torch::nn::Sequential. Children need a callable forward (see AnyHookableModule): one plain
/// `forward`, or another fsdp::contract::Sequential.
///
///   fsdp::contract::Sequential seq(fsdp::contract::Linear(4, 8), torch::nn::ReLU(),
///                                  fsdp::contract::Linear(8, 2));
///   torch::Tensor y = seq(x);               // hooks of seq, then of "0", "1", "2" in turn
///   auto fc = seq[0].as<fsdp::contract::Linear>();
class SequentialImpl : public torch::nn::Cloneable<SequentialImpl> {
 public:
  using Iterator = std::vector<AnyHookableModule>::const_iterator;

  SequentialImpl() = default;

  /// Pushes back each of `modules` (holders, std::shared_ptrs to modules, AnyHookableModules).
  ///
  ///   SequentialImpl seq(fsdp::contract::Linear(4, 4), torch::nn::ReLU());
  template <typename... Modules>
    requires(sizeof...(Modules) > 0 && (HookableContainerChild<Modules> && ...))
  explicit SequentialImpl(Modules&&... modules) {
    (push_back(std::forward<Modules>(modules)), ...);
  }

  /// Appends `module` under the name "<size()>".
  ///
  ///   seq->push_back(fsdp::contract::Linear(4, 4));
  template <typename M>
  void push_back(const torch::nn::ModuleHolder<M>& module) {
    push_back(std::to_string(size()), module);
  }
  template <typename M>
  void push_back(std::shared_ptr<M> module) {
    push_back(std::to_string(size()), std::move(module));
  }
  void push_back(AnyHookableModule module);

  /// Appends `module` under `name` (its FQN prefix; must be unique and contain no dot).
  ///
  ///   seq->push_back("proj", fsdp::contract::Linear(4, 4));
  template <typename M>
  void push_back(std::string name, const torch::nn::ModuleHolder<M>& module) {
    push_back(std::move(name), module.ptr());
  }
  template <typename M>
  void push_back(std::string name, std::shared_ptr<M> module) {
    static_assert(TypedForwardModule<M> || IValueForwardModule<M>,
                  "fsdp::contract::Sequential: a child needs one plain forward (non-template, "
                  "non-overloaded, non-const, with forward-value types) or a forward_ivalues "
                  "member; see AnyHookableModule");
    push_back(std::move(name), AnyHookableModule(std::move(module)));
  }
  void push_back(std::string name, AnyHookableModule module);

  /// Runs the children in order, each through its hooks; `Output` names the last child's
  /// output type. Called through the Sequential's holder, the Sequential's own hooks run too.
  ///
  ///   torch::Tensor y = seq->forward(x);   // children's hooks only
  ///   torch::Tensor z = seq(x);            // the Sequential's hooks as well
  template <typename Output = torch::Tensor, typename... Args>
  Output forward(Args&&... args);

  /// forward() on IValues (makes the Sequential an IValueForwardModule, callable from inside
  /// other containers). Throws c10::Error if empty; errors in a child name the child.
  c10::IValue forward_ivalues(const ForwardArgs& args);

  /// The number of children.
  size_t size() const noexcept { return modules_.size(); }

  /// True when there are no children.
  bool is_empty() const noexcept { return modules_.empty(); }

  /// The children, in order.
  Iterator begin() const { return modules_.begin(); }
  Iterator end() const { return modules_.end(); }

  /// The child at `index` (checked).
  const AnyHookableModule& operator[](size_t index) const;

  /// The child at `index` as the module itself (checked).
  std::shared_ptr<torch::nn::Module> ptr(size_t index) const;

  /// The child at `index` as the hook-able holder `Holder` (checked).
  ///
  ///   fsdp::contract::Linear fc = seq->at<fsdp::contract::Linear>(0);
  template <typename Holder>
  Holder at(size_t index) const {
    return (*this)[index].template as<Holder>();
  }

  /// A deep copy with the same child names; hooks are not copied.
  std::shared_ptr<torch::nn::Module> clone(
      const std::optional<torch::Device>& device = std::nullopt) const override;

  /// Children are registered by push_back; there is nothing to reset.
  void reset() override {}

 private:
  std::vector<AnyHookableModule> modules_;
  std::vector<std::string> names_;
};

/// The hook-able holder of SequentialImpl.
FSDP_HOOKABLE_MODULE(Sequential);

template <typename Output, typename... Args>
Output SequentialImpl::forward(Args&&... args) {
  static_assert((ForwardValue<Args> && ...) && ForwardValue<Output>,
                "fsdp::contract::Sequential::forward: arguments and Output must be forward "
                "values ([Note: forward values] in contract/forward_values.h)");
  ForwardArgs values;
  values.reserve(sizeof...(Args));
  (values.push_back(to_forward_ivalue(args)), ...);
  c10::IValue output = forward_ivalues(values);
  return detail::from_stored<Output>(detail::forward_value_as<stored_forward_value_t<Output>>(
      *this, output, "requested output", 0));
}

}  // namespace fsdp::contract
