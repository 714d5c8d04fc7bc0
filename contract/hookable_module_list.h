#pragma once

// fsdp::contract::ModuleList: a list of modules whose elements are called through their forward
// hooks. Iterating LibTorch's torch::nn::ModuleList yields std::shared_ptr<Module>, which cannot
// be called at all; this one yields AnyHookableModule, and at<Holder>(i) the typed hook-able
// holder.

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include "fsdp_cpp/contract/any_hookable_module.h"

namespace fsdp::contract {

/// Holds modules under the names "0", "1", ... (FQNs as in torch::nn::ModuleList). A parent's
/// forward calls its elements through their hooks:
///
///   struct ModelImpl : torch::nn::Module {
///     ModelImpl() {
///       blocks = register_module("blocks", fsdp::contract::ModuleList());
///       for (int i = 0; i < 4; ++i) blocks->push_back(Block(16));
///     }
///     torch::Tensor forward(torch::Tensor x) {
///       for (const auto& block : *blocks) x = block(x);      // each block's hooks run
///       return x;
///     }
///     fsdp::contract::ModuleList blocks = nullptr;
///   };
///
///   fully_shard(model->blocks->at<Block>(0), opts);           // typed holder, hooks included
///
/// Elements need not be callable (a ModuleList may hold anything); calling one that is not
/// throws c10::Error. The list itself has no forward.
class ModuleListImpl : public torch::nn::Cloneable<ModuleListImpl> {
 public:
  using Iterator = std::vector<AnyHookableModule>::const_iterator;

  ModuleListImpl() = default;

  /// Pushes back each of `modules` (holders, std::shared_ptrs to modules, AnyHookableModules).
  template <typename... Modules>
    requires(sizeof...(Modules) > 0 && (HookableContainerChild<Modules> && ...))
  explicit ModuleListImpl(Modules&&... modules) {
    (push_back(std::forward<Modules>(modules)), ...);
  }

  /// Appends `module` under the name "<size()>".
  ///
  ///   list->push_back(Block(16));
  template <typename M>
  void push_back(const torch::nn::ModuleHolder<M>& module) {
    push_back(AnyHookableModule(module));
  }
  template <typename M>
  void push_back(std::shared_ptr<M> module) {
    push_back(AnyHookableModule(std::move(module)));
  }
  void push_back(AnyHookableModule module);

  /// The number of elements.
  size_t size() const noexcept { return modules_.size(); }

  /// True when there are no elements.
  bool is_empty() const noexcept { return modules_.empty(); }

  /// The elements, in order, as AnyHookableModule (callable through their hooks).
  Iterator begin() const { return modules_.begin(); }
  Iterator end() const { return modules_.end(); }

  /// The element at `index` (checked).
  ///
  ///   torch::Tensor y = (*list)[0](x);
  const AnyHookableModule& operator[](size_t index) const;

  /// The element at `index` as the module itself (checked).
  std::shared_ptr<torch::nn::Module> ptr(size_t index) const;

  /// The element at `index` as the hook-able holder `Holder` (checked, also for its class).
  ///
  ///   Block block = list->at<Block>(2);
  ///   torch::Tensor y = block(x);   // runs the hooks
  template <typename Holder>
  Holder at(size_t index) const {
    return (*this)[index].template as<Holder>();
  }

  /// All elements as the hook-able holder `Holder` (checked: every element must be a
  /// `Holder::Impl`).
  ///
  ///   for (Block& block : list->holders<Block>()) x = block(x);
  template <typename Holder>
  std::vector<Holder> holders() const {
    std::vector<Holder> out;
    out.reserve(modules_.size());
    for (const AnyHookableModule& module : modules_) {
      out.push_back(module.template as<Holder>());
    }
    return out;
  }

  /// A deep copy; hooks are not copied.
  std::shared_ptr<torch::nn::Module> clone(
      const std::optional<torch::Device>& device = std::nullopt) const override;

  /// Elements are registered by push_back; there is nothing to reset.
  void reset() override {}

 private:
  std::vector<AnyHookableModule> modules_;
};

/// The holder of ModuleListImpl (a list has no forward, so nothing to hook).
TORCH_MODULE(ModuleList);

}  // namespace fsdp::contract
