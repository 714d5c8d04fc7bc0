#include "fsdp_cpp/composable/fully_shard_tree.h"

#include <string>
#include <unordered_set>

#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include "fsdp_cpp/composable/api_names.h"
#include "fsdp_cpp/contract/module_fqn.h"
#include "fsdp_cpp/contract/module_state.h"
#include "fsdp_cpp/fsdp/forward_errors.h"
#include "fsdp_cpp/fsdp/fsdp_state.h"

namespace fsdp {
namespace {

struct Target {
  std::string fqn;  // relative to the root ("" for the root)
  torch::nn::Module* module;
};

// Every check fully_shard makes on the module itself, for all targets before any changes.
void check_target(const Target& target, const WrapPolicy& policy, torch::nn::Module& root) {
  auto& registry = contract::ModuleStateRegistry::global();
  const std::string which = target.fqn.empty() ? std::string("the root ") + registry.describe(root)
                                               : "module '" + target.fqn + "', selected by policy " +
                                                     policy.description() + ",";
  TORCH_CHECK(!registry.contains(*target.module, kFullyShardApi), "fully_shard_tree: ", which,
              " already has fully_shard applied; expected modules without units (leave units made by hand "
              "out of the policy, or make them with fully_shard_tree)");
  for (const auto& other : registry.modules_with(kFullyShardApi)) {
    if (other.get() == target.module) continue;
    TORCH_CHECK(!contract::find_module_fqn(*other, *target.module).has_value(), "fully_shard_tree: ", which,
                " is inside ", registry.describe(*other), ", which already is a fully_shard unit; units are made "
                "bottom-up, so no unit may contain the modules fully_shard_tree shards");
  }
  try {
    registry.check_exclusions(*target.module, kFullyShardApi);  // replicate on it or inside it
    check_modules_can_run_hooks({target.module});
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "fully_shard_tree: ", which, " cannot be a unit: ", e.msg(),
                target.fqn.empty() ? "" : " Change the policy so that it does not select this module.");
  }
}

}  // namespace

std::vector<FSDPModule> fully_shard_tree(torch::nn::Module& root, const WrapPolicy& policy,
                                         const FullyShardOptions& options) {
  auto& registry = contract::ModuleStateRegistry::global();
  // Ignored parameters and modules: in the root's tree, or the error names them now.
  std::unordered_set<const void*> in_tree;
  for (const auto& p : root.parameters(/*recurse=*/true)) in_tree.insert(p.unsafeGetTensorImpl());
  for (size_t i = 0; i < options.ignored_params().size(); ++i) {
    const at::Tensor& p = options.ignored_params()[i];
    TORCH_CHECK(p.defined() && in_tree.count(p.unsafeGetTensorImpl()), "fully_shard_tree: ignored_params[", i,
                "] is not a parameter of the root ", registry.describe(root),
                " or of its submodules; expected parameters registered in the tree being sharded");
  }
  std::vector<const torch::nn::Module*> ignored_modules;
  for (size_t i = 0; i < options.ignored_modules().size(); ++i) {
    const auto& m = options.ignored_modules()[i];
    TORCH_CHECK(m != nullptr && m.get() != &root && contract::find_module_fqn(root, *m).has_value(),
                "fully_shard_tree: ignored_modules[", i, "] is ", m ? "not inside" : "null, not a module inside",
                " the root ", registry.describe(root), "; expected submodules of the root");
    for (const auto& item : m->named_modules("", /*include_self=*/true)) {
      TORCH_CHECK(!registry.contains(*item.value(), kFullyShardApi), "fully_shard_tree: ignored_modules[", i,
                  "] ", registry.describe(*m), " contains the fully_shard unit ", registry.describe(*item.value()),
                  "; an ignored module's parameters stay whole and local, so no unit can be inside it");
    }
    ignored_modules.push_back(m.get());
  }

  declare_api_exclusions();
  const auto selected = select_modules(root, policy, options.ignored_params(), ignored_modules);
  std::vector<Target> targets;
  for (const auto& s : selected) targets.push_back({s.fqn, s.module.get()});
  targets.push_back({"", &root});
  for (const auto& t : targets) check_target(t, policy, root);

  std::vector<FSDPModule> units;
  for (size_t k = 0; k < targets.size(); ++k) {
    const Target& t = targets[k];
    // Each unit ignores what lies in its own tree.
    FullyShardOptions unit_options = options;
    std::vector<at::Tensor> params;
    std::unordered_set<const void*> mine;
    for (const auto& p : t.module->parameters(/*recurse=*/true)) mine.insert(p.unsafeGetTensorImpl());
    for (const auto& p : options.ignored_params()) {
      if (mine.count(p.unsafeGetTensorImpl())) params.push_back(p);
    }
    std::vector<std::shared_ptr<torch::nn::Module>> modules;
    for (const auto& m : options.ignored_modules()) {
      if (m.get() != t.module && contract::find_module_fqn(*t.module, *m).has_value()) modules.push_back(m);
    }
    unit_options.ignored_params(std::move(params)).ignored_modules(std::move(modules));
    try {
      units.push_back(fully_shard(*t.module, unit_options));
    } catch (const c10::Error& e) {
      std::string made;
      for (size_t j = 0; j < k; ++j) made += (j ? ", '" : "'") + contract::display_fqn(targets[j].fqn) + "'";
      TORCH_CHECK(false, "fully_shard_tree: fully_shard on ",
                  t.fqn.empty() ? std::string("the root") : "module '" + t.fqn + "'", " (unit ", k + 1, " of ",
                  targets.size(), ", policy ", policy.description(), ") failed",
                  made.empty() ? std::string(", before any unit was made")
                               : "; the units made before it stay units (fully_shard cannot be undone): " + made,
                  ". The error: ", e.msg());
    }
  }
  return units;
}

}  // namespace fsdp
