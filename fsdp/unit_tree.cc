#include "fsdp_cpp/fsdp/unit_tree.h"

#include <algorithm>

#include <torch/nn/module.h>

#include "fsdp_cpp/contract/module_fqn.h"
#include "fsdp_cpp/contract/module_state.h"
#include "fsdp_cpp/fsdp/fsdp_state.h"
#include "fsdp_cpp/fsdp/root_context.h"

namespace fsdp {

std::vector<UnitInTree> units_in_tree(torch::nn::Module& root, bool include_root) {
  auto& registry = contract::ModuleStateRegistry::global();
  std::vector<UnitInTree> units;
  for (const auto& item : root.named_modules("", include_root)) {
    auto state = registry.get_as<FSDPState>(*item.value(), kFullyShardApi);
    if (state) units.push_back({item.key(), item.value().get(), std::move(state)});
  }
  return units;
}

std::vector<std::shared_ptr<FSDPState>> distinct_units_in_tree(torch::nn::Module& root,
                                                               bool include_root) {
  std::vector<std::shared_ptr<FSDPState>> distinct;
  for (auto& unit : units_in_tree(root, include_root)) {
    if (std::find(distinct.begin(), distinct.end(), unit.state) == distinct.end()) {
      distinct.push_back(std::move(unit.state));
    }
  }
  return distinct;
}

const FSDPState* enclosing_unit(const FSDPState& unit) {
  if (const RootContext* context = unit.root_context()) {
    return context->root() == &unit ? nullptr : context->root();
  }
  auto& registry = contract::ModuleStateRegistry::global();
  for (const auto& other : registry.modules_with(kFullyShardApi)) {
    const auto state = registry.get_as<FSDPState>(*other, kFullyShardApi);
    if (!state || state.get() == &unit) continue;
    for (torch::nn::Module* module : unit.modules()) {
      if (contract::find_module_fqn(*other, *module).has_value()) return state.get();
    }
  }
  return nullptr;
}

}  // namespace fsdp
