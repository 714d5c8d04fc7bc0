#include "fsdp_cpp/composable/wrap_policy.h"

#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/parameterdict.h>
#include <torch/nn/modules/container/parameterlist.h>

#include "fsdp_cpp/contract/hookable_module_list.h"
#include "fsdp_cpp/contract/module_fqn.h"

namespace fsdp {
namespace {

// Containers without a forward: never selected ([Note: module selection]).
bool is_container(const torch::nn::Module& module) {
  return dynamic_cast<const torch::nn::ModuleListImpl*>(&module) != nullptr ||
         dynamic_cast<const torch::nn::ModuleDictImpl*>(&module) != nullptr ||
         dynamic_cast<const torch::nn::ParameterListImpl*>(&module) != nullptr ||
         dynamic_cast<const torch::nn::ParameterDictImpl*>(&module) != nullptr ||
         dynamic_cast<const contract::ModuleListImpl*>(&module) != nullptr;
}

// FSDP1's _recursive_wrap over a LibTorch tree, selecting instead of wrapping.
class Selection {
 public:
  Selection(torch::nn::Module& root, const WrapPolicy& policy, const std::vector<at::Tensor>& ignored_params,
            const std::vector<const torch::nn::Module*>& ignored_modules)
      : root_(&root), policy_(policy), ignored_modules_(ignored_modules.begin(), ignored_modules.end()) {
    for (const auto& p : ignored_params) {
      if (p.defined()) ignored_params_.insert(p.unsafeGetTensorImpl());
    }
    for (const torch::nn::Module* m : ignored_modules) {
      if (m == nullptr) continue;
      for (const auto& p : m->parameters(/*recurse=*/true)) ignored_params_.insert(p.unsafeGetTensorImpl());
    }
  }

  std::vector<SelectedModule> run() {
    visit(*root_, nullptr, "");
    return std::move(selected_);
  }

 private:
  // The parameter elements of `module`'s subtree that are not ignored, each tensor once.
  int64_t subtree_numel(const torch::nn::Module& module) const {
    std::unordered_set<const void*> seen;
    int64_t numel = 0;
    for (const auto& p : module.parameters(/*recurse=*/true)) {
      const void* impl = p.unsafeGetTensorImpl();
      if (ignored_params_.count(impl) || !seen.insert(impl).second) continue;
      numel += p.numel();
    }
    return numel;
  }

  // Returns the parameter elements of `module`'s subtree now inside selected modules.
  int64_t visit(torch::nn::Module& module, const std::shared_ptr<torch::nn::Module>& holder, const std::string& fqn) {
    const auto known = wrapped_.find(&module);
    if (known != wrapped_.end()) return known->second;  // reached again by another path
    wrapped_[&module] = 0;
    const int64_t numel = subtree_numel(module);
    if (!policy_.descends_into(module, fqn, numel)) return 0;
    int64_t wrapped_below = 0;
    for (const auto& child : module.named_children()) {
      if (ignored_modules_.count(child.value().get())) continue;
      wrapped_below += visit(*child.value(), child.value(), contract::join_fqn(fqn, child.key()));
    }
    const int64_t remainder = numel - wrapped_below;
    if (&module != root_ && !is_container(module) && policy_.selects(module, fqn, remainder)) {
      selected_.push_back({fqn, holder});
      wrapped_[&module] = numel;
      return numel;
    }
    wrapped_[&module] = wrapped_below;
    return wrapped_below;
  }

  torch::nn::Module* root_;
  const WrapPolicy& policy_;
  std::unordered_set<const void*> ignored_params_;
  std::unordered_set<const torch::nn::Module*> ignored_modules_;
  std::unordered_map<const torch::nn::Module*, int64_t> wrapped_;
  std::vector<SelectedModule> selected_;
};

}  // namespace

WrapPolicy::WrapPolicy(Predicate predicate, std::string description)
    : WrapPolicy(std::move(predicate), nullptr, std::move(description)) {}

WrapPolicy::WrapPolicy(Predicate predicate, Predicate descend, std::string description)
    : predicate_(std::move(predicate)), descend_(std::move(descend)), description_(std::move(description)) {
  TORCH_CHECK(predicate_ != nullptr, "fsdp::WrapPolicy: the predicate of policy '", description_,
              "' is empty; expected a callable (module, fqn, unselected_numel) -> bool");
}

WrapPolicy WrapPolicy::min_num_params(int64_t n) {
  TORCH_CHECK(n >= 0, "fsdp::WrapPolicy::min_num_params: expected a number of elements >= 0, got ", n);
  return WrapPolicy(
      [n](const torch::nn::Module&, const std::string&, int64_t unselected_numel) { return unselected_numel >= n; },
      [n](const torch::nn::Module& module, const std::string&, int64_t subtree_numel) {
        // FSDP1's FORCE_LEAF_MODULES: MultiheadAttention reads out_proj's weight itself.
        return subtree_numel >= n && dynamic_cast<const torch::nn::MultiheadAttentionImpl*>(&module) == nullptr;
      },
      "min_num_params(" + std::to_string(n) + ")");
}

WrapPolicy WrapPolicy::lambda(Predicate fn, std::string description) {
  return WrapPolicy(std::move(fn), std::move(description));
}

WrapPolicy operator|(WrapPolicy a, WrapPolicy b) {
  WrapPolicy::Predicate select = [a, b](const torch::nn::Module& m, const std::string& fqn, int64_t numel) {
    return a.selects(m, fqn, numel) || b.selects(m, fqn, numel);
  };
  WrapPolicy::Predicate descend;
  if (a.descend_ && b.descend_) {
    descend = [a, b](const torch::nn::Module& m, const std::string& fqn, int64_t numel) {
      return a.descends_into(m, fqn, numel) || b.descends_into(m, fqn, numel);
    };
  }
  std::string description = "(" + a.description_ + " | " + b.description_ + ")";
  return WrapPolicy(std::move(select), std::move(descend), std::move(description));
}

bool WrapPolicy::selects(const torch::nn::Module& module, const std::string& fqn, int64_t unselected_numel) const {
  return predicate_(module, fqn, unselected_numel);
}

bool WrapPolicy::descends_into(const torch::nn::Module& module, const std::string& fqn, int64_t subtree_numel) const {
  return descend_ == nullptr || descend_(module, fqn, subtree_numel);
}

const std::string& WrapPolicy::description() const { return description_; }

std::vector<SelectedModule> select_modules(torch::nn::Module& root, const WrapPolicy& policy) {
  return Selection(root, policy, {}, {}).run();
}

std::vector<SelectedModule> select_modules(torch::nn::Module& root, const WrapPolicy& policy,
                                           const std::vector<at::Tensor>& ignored_params,
                                           const std::vector<const torch::nn::Module*>& ignored_modules) {
  return Selection(root, policy, ignored_params, ignored_modules).run();
}

}  // namespace fsdp
