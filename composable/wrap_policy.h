#pragma once
// Auto-wrap policies (FSDP1's auto_wrap_policy): which modules of a tree become units. A policy
// only selects modules; fsdp::fully_shard_tree (composable/fully_shard_tree.h) applies fully_shard
// to them, and fsdp::checkpoint_activations (activation checkpointing) uses the same policies.
//
//   // One unit per transformer block, then the root:
//   auto units = fsdp::fully_shard_tree(*model, fsdp::WrapPolicy::module_types<BlockImpl>());
//
//   // Every module whose parameters not already in a selected module below it number at least
//   // 1M elements (FSDP1's size_based_auto_wrap_policy):
//   auto by_size = fsdp::WrapPolicy::min_num_params(1'000'000);
//
//   // Anything else, and unions:
//   auto embeddings = fsdp::WrapPolicy::lambda(
//       [](const torch::nn::Module&, const std::string& fqn, int64_t) { return fqn == "tok_emb"; },
//       "the token embedding");
//   auto policy = fsdp::WrapPolicy::module_types<BlockImpl>() | embeddings;
//
//   for (const auto& selected : fsdp::select_modules(*model, policy)) std::cout << selected.fqn;
//
// [Note: module selection] select_modules walks the tree depth-first, children before their
// parent, as FSDP1's _recursive_wrap does: a module is offered to the policy after all its
// children, with `unselected_numel` = the parameter elements of its subtree (each tensor once)
// minus those inside selected modules below it. The root is never offered (the caller makes it a
// unit of its own), nor are containers without a forward (torch::nn::ModuleList, ModuleDict,
// ParameterList, ParameterDict, fsdp::contract::ModuleList), whose parameters count towards
// their parent. A module reachable by several paths is offered once, at its first path.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/Type.h>

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace fsdp {

/// Decides which modules of a tree become units (see the top of this file).
class WrapPolicy {
 public:
  /// module, its FQN relative to the root the policy is applied to, and the number of parameter
  /// elements in its subtree that are not in a module already selected below it.
  using Predicate =
      std::function<bool(const torch::nn::Module& module, const std::string& fqn, int64_t unselected_numel)>;

  /// A policy selecting the modules for which `predicate` returns true; `description` names it in
  /// errors.
  ///
  ///   fsdp::WrapPolicy policy(
  ///       [](const torch::nn::Module& m, const std::string&, int64_t) { return m.name() == "Block"; },
  ///       "modules named Block");
  WrapPolicy(Predicate predicate, std::string description);

  /// Selects the modules whose class is (or derives from) one of `Impls` (FSDP1's
  /// ModuleWrapPolicy): the Impl classes, not their holders.
  ///
  ///   auto policy = fsdp::WrapPolicy::module_types<BlockImpl, EmbeddingImpl>();
  template <typename... Impls>
  static WrapPolicy module_types();

  /// FSDP1's size_based_auto_wrap_policy(min_num_params=n): selects a module when its unselected
  /// parameter elements number at least `n`. Like FSDP1, it never looks into a module whose
  /// subtree holds fewer than `n` elements, and treats torch::nn::MultiheadAttention as a forced
  /// leaf: neither it nor its out_proj (which it reads directly) is selected, its parameters count
  /// for its parent (in a union, another policy that looks into it lets this one select it).
  ///
  ///   auto policy = fsdp::WrapPolicy::min_num_params(100'000'000);   // FSDP1's default size
  static WrapPolicy min_num_params(int64_t n);

  /// Selects the modules for which `fn` returns true (FSDP1's lambda_auto_wrap_policy).
  ///
  ///   auto policy = fsdp::WrapPolicy::lambda(
  ///       [](const torch::nn::Module&, const std::string& fqn, int64_t) { return fqn.ends_with("mlp"); });
  static WrapPolicy lambda(Predicate fn, std::string description = "lambda");

  /// The union: selects what either policy selects (FSDP1's _or_policy); descends where either
  /// descends.
  ///
  ///   auto policy = fsdp::WrapPolicy::module_types<BlockImpl>() | fsdp::WrapPolicy::min_num_params(1 << 20);
  friend WrapPolicy operator|(WrapPolicy a, WrapPolicy b);

  /// Whether the policy selects `module` (see Predicate for the arguments).
  bool selects(const torch::nn::Module& module, const std::string& fqn, int64_t unselected_numel) const;

  /// Whether select_modules looks inside `module`, whose subtree holds `subtree_numel` parameter
  /// elements (FSDP1's `recurse=True` call). True unless the policy says otherwise (min_num_params).
  bool descends_into(const torch::nn::Module& module, const std::string& fqn, int64_t subtree_numel) const;

  /// What the policy selects, in words (for errors and logs).
  const std::string& description() const;

 private:
  WrapPolicy(Predicate predicate, Predicate descend, std::string description);

  Predicate predicate_;
  Predicate descend_;  // null: always
  std::string description_;
};

/// A module select_modules chose, with its FQN relative to the root.
struct SelectedModule {
  std::string fqn;
  std::shared_ptr<torch::nn::Module> module;
};

/// The modules under `root` (root itself excluded) that `policy` selects, bottom-up (each selected
/// module after every selected module inside it), otherwise in module order. Containers without a
/// forward (torch::nn::ModuleList, ModuleDict, fsdp::contract::ModuleList) are never selected;
/// a module reachable by several paths is visited once. See [Note: module selection].
///
///   for (const auto& s : fsdp::select_modules(*model, policy)) fsdp::fully_shard(*s.module);
std::vector<SelectedModule> select_modules(torch::nn::Module& root, const WrapPolicy& policy);

/// As above, leaving out what FSDP leaves alone: `ignored_modules` (and everything inside them)
/// are neither selected nor descended into, and neither they nor `ignored_params` count in any
/// module's numel (FSDP1's _recursive_wrap with ignored modules and parameters).
///
///   fsdp::select_modules(*model, policy, {model->scale}, {model->head.ptr().get()});
std::vector<SelectedModule> select_modules(torch::nn::Module& root, const WrapPolicy& policy,
                                           const std::vector<at::Tensor>& ignored_params,
                                           const std::vector<const torch::nn::Module*>& ignored_modules);

// ----------------------------------------------------------------------------------------------
// Implementation of the templates.

template <typename... Impls>
WrapPolicy WrapPolicy::module_types() {
  static_assert(sizeof...(Impls) > 0, "fsdp::WrapPolicy::module_types: name at least one module class");
  std::string description = "module_types<";
  bool first = true;
  ((description += std::string(first ? "" : ", ") + c10::demangle_type<Impls>(), first = false), ...);
  description += ">";
  return WrapPolicy(
      [](const torch::nn::Module& module, const std::string&, int64_t) {
        return ((dynamic_cast<const Impls*>(&module) != nullptr) || ...);
      },
      std::move(description));
}

}  // namespace fsdp
