#include "fsdp_cpp/fsdp/unit_tree.h"

#include <algorithm>

#include <torch/nn/module.h>

#include "fsdp_cpp/contract/module_state.h"
#include "fsdp_cpp/fsdp/fsdp_state.h"

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

}  // namespace fsdp
