#include "fsdp_cpp/fsdp/lazy_init.h"

#include <ATen/record_function.h>
#include <algorithm>

#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include "fsdp_cpp/contract/module_fqn.h"
#include "fsdp_cpp/contract/module_state.h"
#include "fsdp_cpp/fsdp/fsdp_state.h"
#include "fsdp_cpp/fsdp/root_context.h"
#include "fsdp_cpp/fsdp/tied_parameters.h"
#include "fsdp_cpp/fsdp/unit_tree.h"

namespace fsdp::runtime {
namespace {

// Whether the module at `inner` is strictly inside the module at `outer` (FQNs from the root).
bool contains_module(const std::string& outer, const std::string& inner) {
  if (inner == outer) return false;
  return outer.empty() || (inner.size() > outer.size() && inner.compare(0, outer.size(), outer) == 0 &&
                           inner[outer.size()] == '.');
}

}  // namespace

void lazy_init(FSDPState& state) {
  RECORD_USER_SCOPE("FSDP::lazy_init");
  auto& registry = contract::ModuleStateRegistry::global();
  for (const auto& other : registry.modules_with(kFullyShardApi)) {
    if (other.get() == &state.module()) continue;
    if (contract::find_module_fqn(*other, state.module()).has_value()) {
      TORCH_CHECK(false, "fully_shard: module ", registry.describe(state.module()),
                  " ran its forward before its root ", registry.describe(*other),
                  " did: the root's first forward initialises every unit inside it. Call the "
                  "root module (the outermost one fully_shard was applied to) first.");
    }
  }
  // [Note: meta-device models] in docs/architecture.md: no meta tensor may reach a forward.
  for (torch::nn::Module* module : state.modules()) {
    auto check = [&](const std::string& kind, const std::string& name, const at::Tensor& t) {
      TORCH_CHECK(!t.defined() || !t.is_meta(), "fully_shard: ", kind, " '", name, "' of ",
                  registry.describe(*module), " is still on the meta device at the root's first forward: "
                  "apply fully_shard to a module that contains it, or materialize it with "
                  "fsdp::materialize_module");
    };
    for (const auto& item : module->named_parameters(/*recurse=*/true)) check("parameter", item.key(), item.value());
    for (const auto& item : module->named_buffers(/*recurse=*/true)) check("buffer", item.key(), item.value());
  }
  UnitModuleFqns unit_fqns;
  std::vector<FSDPState*> states;
  for (const auto& unit : units_in_tree(state.module())) {
    TORCH_CHECK(unit.state->config().comm == state.config().comm, "fully_shard: unit ",
                registry.describe(*unit.module),
                " uses another communicator than its root; every unit of one model must use the "
                "same one");
    auto& names = unit_fqns[unit.state.get()];
    if (names.empty()) states.push_back(unit.state.get());  // siblings: one unit, several modules
    names.push_back(unit.fqn);
  }
  UnitAncestors ancestors;
  for (FSDPState* unit : states) {
    auto& above = ancestors[unit];
    for (FSDPState* other : states) {
      if (other == unit) continue;
      bool contains = false;
      for (const auto& outer : unit_fqns[other]) {
        for (const auto& inner : unit_fqns[unit]) contains |= contains_module(outer, inner);
      }
      if (contains) above.push_back(other);
    }
  }
  auto context = std::make_shared<RootContext>(state, std::move(states), std::move(ancestors));
  for (FSDPState* unit : context->states()) {
    unit->set_root_context(context);
    std::string name;
    for (const auto& n : unit_fqns[unit]) name += (name.empty() ? "" : "+") + (n.empty() ? std::string("<root>") : n);
    unit->set_fqn(name);
  }
  place_tied_parameters(*context, unit_fqns);
}

}  // namespace fsdp::runtime
