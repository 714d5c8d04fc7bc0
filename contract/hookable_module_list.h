#pragma once

// fsdp::contract::ModuleList: a list of modules whose elements are called through their forward
// hooks. Iterating LibTorch's torch::nn::ModuleList yields std::shared_ptr<Module>, which cannot
// be called at all; this one yields AnyHookableModule, and at<Holder>(i) the typed hook-able
// holder.

#include <cstddef>
#include <cstdint>
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
///
/// [Note: pruned ModuleList] keep_only(begin, end) keeps the elements named "begin" .. "end - 1"
/// and unregisters the others, so a model cut into pieces (e.g. the stages of a pipeline) keeps
/// every parameter's FQN: after `blocks->keep_only(3, 5)` the list holds `blocks.3` and
/// `blocks.4` as before. Afterwards positions and names differ: size(), operator[], ptr, at,
/// holders and iteration count POSITIONS 0 .. size() - 1 over the kept elements in order
/// (`(*blocks)[0]` is the element named "3"), and name(i) gives the name of position i. A pruned
/// list refuses push_back (its next name would be taken by an element that lives elsewhere);
/// clone() keeps the names. A list that never lost an element has names equal to positions.
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

  /// Appends `module` under the name "<size()>". Refused (c10::Error) on a pruned list
  /// ([Note: pruned ModuleList]).
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

  /// Keeps only the elements named "begin" .. "end - 1" ([Note: pruned ModuleList]) and
  /// unregisters the others from this list; their modules are dropped from it (they live on while
  /// something else holds them). `begin` and `end` are names, not positions (the same on a list
  /// that never lost an element); [begin, end) must lie within the names the list holds, begin <=
  /// end (begin == end empties the list). Keeping every element changes nothing. Fails with a
  /// c10::Error naming the range and the names held, and changes nothing then.
  ///
  ///   model->blocks->keep_only(3, 5);   // blocks.3.*, blocks.4.* keep their FQNs
  void keep_only(int64_t begin, int64_t end);

  /// The name the element at position `index` is registered under (checked): std::to_string(index)
  /// until keep_only removed an element, then first_name() + index.
  std::string name(size_t index) const;

  /// The name of the element at position 0 as a number: 0 until keep_only, then its `begin`.
  int64_t first_name() const noexcept { return first_name_; }

  /// True once keep_only removed at least one element.
  bool is_pruned() const noexcept { return pruned_; }

  /// A deep copy (names, pruned or not, included); hooks are not copied.
  std::shared_ptr<torch::nn::Module> clone(
      const std::optional<torch::Device>& device = std::nullopt) const override;

  /// Elements are registered by push_back; there is nothing to reset.
  void reset() override {}

 private:
  std::vector<AnyHookableModule> modules_;
  int64_t first_name_ = 0;  // the element at position i is registered as first_name_ + i
  bool pruned_ = false;     // keep_only removed an element: push_back refused
};

/// The holder of ModuleListImpl (a list has no forward, so nothing to hook).
TORCH_MODULE(ModuleList);

}  // namespace fsdp::contract
