#include "composable/fully_shard.h"

#include <map>
#include <unordered_set>

#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include "comm/init.h"
#include "contract/contract.h"
#include "contract/forward_hooks.h"
#include "contract/module_fqn.h"
#include "fsdp/runtime.h"

namespace fsdp {
namespace {

// Parameters of `module`'s tree that units below it already manage (applied bottom-up).
std::unordered_set<const void*> params_of_units_below(torch::nn::Module& module) {
  auto& registry = contract::ModuleStateRegistry::global();
  std::unordered_set<const void*> owned;
  for (const auto& item : module.named_modules("", /*include_self=*/false)) {
    auto state = registry.get_as<FSDPState>(*item.value(), kFullyShardApi);
    if (!state) continue;
    for (const auto& handle : state->handles()) {
      for (const auto& p : handle->params()) owned.insert(p.param.unsafeGetTensorImpl());
    }
  }
  return owned;
}

void check_no_unit_above(torch::nn::Module& module) {
  auto& registry = contract::ModuleStateRegistry::global();
  for (const auto& other : registry.modules_with(kFullyShardApi)) {
    if (other.get() == &module) continue;
    TORCH_CHECK(!contract::find_module_fqn(*other, module).has_value(), "fully_shard: module ",
                registry.describe(module), " is inside ", registry.describe(*other),
                ", which fully_shard was already applied to. Apply fully_shard bottom-up: "
                "submodules first, the root last.");
  }
}

}  // namespace

FSDPModule fully_shard(torch::nn::Module& module, const FullyShardOptions& options) {
  auto& registry = contract::ModuleStateRegistry::global();
  registry.check_not_applied(module, kFullyShardApi);
  check_no_unit_above(module);
  std::shared_ptr<comm::Communicator> comm = options.communicator();
  if (!comm) comm = comm::default_process_group().comm;
  const std::string fqn = registry.describe(module);

  // Rule 1: every parameter of the tree not already in a unit below, in named_parameters order,
  // once per tensor (a tied parameter's first FQN owns it); one FlatParameter per dtype.
  const auto owned = params_of_units_below(module);
  std::unordered_set<const void*> seen;
  std::vector<c10::ScalarType> dtype_order;
  std::map<c10::ScalarType, std::vector<FlatParamHandle::OrigParam>> by_dtype;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    const void* impl = p.unsafeGetTensorImpl();
    if (owned.count(impl) || !seen.insert(impl).second) continue;
    TORCH_CHECK(p.device().type() == comm->device().type(), "fully_shard: module ", fqn,
                " has parameter '", item.key(), "' on ", p.device(),
                " but the communicator works on ", comm->device(),
                "; move the module to that device type first");
    TORCH_CHECK(at::isFloatingType(p.scalar_type()), "fully_shard: module ", fqn,
                " has parameter '", item.key(), "' of dtype ", p.scalar_type(),
                "; only floating-point parameters can be sharded");
    if (!by_dtype.count(p.scalar_type())) dtype_order.push_back(p.scalar_type());
    by_dtype[p.scalar_type()].push_back({item.key(), p});
  }

  FSDPConfig config;
  config.comm = comm;
  config.reshard_after_forward = options.reshard_after_forward();
  auto state = contract::apply_api(kFullyShardApi, module, [&](torch::nn::Module& m) {
    std::vector<std::unique_ptr<FlatParamHandle>> handles;
    for (auto dtype : dtype_order) {
      handles.push_back(std::make_unique<FlatParamHandle>(by_dtype[dtype], comm, fqn));
    }
    auto unit = std::make_shared<FSDPState>(m, fqn, config, std::move(handles));
    FSDPState* raw = unit.get();  // owned by the registry for the module's lifetime
    contract::register_forward_pre_hook(
        m, [raw](torch::nn::Module&, contract::ForwardArgs& args) { runtime::pre_forward(*raw, args); });
    contract::register_forward_hook(
        m, [raw](torch::nn::Module&, const contract::ForwardArgs&, c10::IValue& output) {
          runtime::post_forward(*raw, output);
        });
    return unit;
  });
  return FSDPModule(std::move(state));
}

std::optional<FSDPModule> fsdp_module_of(const torch::nn::Module& module) {
  auto state = contract::ModuleStateRegistry::global().get_as<FSDPState>(module, kFullyShardApi);
  if (!state) return std::nullopt;
  return FSDPModule(std::move(state));
}

}  // namespace fsdp
