#include "fsdp_cpp/contract/contract.h"

#include <torch/nn/module.h>

#include "fsdp_cpp/contract/forward_hooks.h"
#include "fsdp_cpp/contract/fqn_snapshot.h"

namespace fsdp::contract {
namespace detail {
namespace {

// `module` and every module in its tree, by identity.
void append_tree(const torch::nn::Module& module, std::vector<const torch::nn::Module*>& out) {
  out.push_back(&module);
  for (const auto& item : module.named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    out.push_back(item.value().get());
  }
}

}  // namespace

std::shared_ptr<ApiState> apply_api_erased(std::string_view api, torch::nn::Module& module,
                                           const ApiFunction& fn, ModuleStateRegistry& registry) {
  TORCH_CHECK(!api.empty(), "fsdp::contract::apply_api: expected a non-empty API name");
  TORCH_CHECK(!module.weak_from_this().expired(), api, ": module ", registry.describe(module),
              " is not owned by a std::shared_ptr; expected a module created through its holder "
              "(e.g. `Block block(...)`) or std::make_shared, got one on the stack or in a plain "
              "member");
  registry.check_not_applied(module, api);
  registry.check_exclusions(module, api);  // [Note: exclusive APIs]

  std::vector<const torch::nn::Module*> tree;  // before fn; fn may add or drop modules
  append_tree(module, tree);
  const ModuleFqns before = snapshot_fqns(module);
  const ModuleStateRegistry::Checkpoint registry_checkpoint = registry.checkpoint();
  const ForwardHookCheckpoint hook_checkpoint = forward_hook_checkpoint();
  try {
    std::shared_ptr<ApiState> state = fn(module);
    TORCH_CHECK(state != nullptr, api, ": module ", registry.describe(module),
                ": expected the API's implementation to return the module's state, got nullptr; "
                "hint: an API without state returns std::make_shared<fsdp::contract::ApiState>()");
    const ModuleFqns after = snapshot_fqns(module);
    if (!(after == before)) {  // describe() walks the registry: error path only
      check_fqns_unchanged(api, registry.describe(module), before, after);
    }
    registry.insert(module, api, state);
    return state;
  } catch (...) {
    append_tree(module, tree);
    registry.rollback(registry_checkpoint, tree);
    remove_forward_hooks_after(hook_checkpoint, tree);
    throw;
  }
}

}  // namespace detail
}  // namespace fsdp::contract
