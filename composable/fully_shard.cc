#include "composable/fully_shard.h"

#include <unordered_set>

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include "comm/init.h"
#include "contract/contract.h"
#include "contract/forward_hooks.h"
#include "contract/module_fqn.h"
#include "fsdp/runtime.h"
#include "fsdp/forward_errors.h"
#include "fsdp/gradient_guard.h"
#include "fsdp/tied_parameters.h"
#include "fsdp/unit_tree.h"

namespace fsdp {
namespace {

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

// Rank 0's values everywhere: one broadcast per dtype over the flattened tensors.
void broadcast_from_rank0(const std::vector<at::Tensor>& tensors, comm::Communicator& comm) {
  std::vector<c10::ScalarType> dtypes;
  for (const auto& t : tensors) {
    if (std::find(dtypes.begin(), dtypes.end(), t.scalar_type()) == dtypes.end()) dtypes.push_back(t.scalar_type());
  }
  c10::NoGradGuard no_grad;
  for (auto dtype : dtypes) {
    std::vector<at::Tensor> group;
    for (const auto& t : tensors) {
      if (t.scalar_type() == dtype) group.push_back(t.detach().reshape({-1}).to(comm.device()));
    }
    at::Tensor flat = at::cat(group);
    comm.broadcast(flat, 0, "sync_module_states").wait();
    int64_t offset = 0;
    for (const auto& t : tensors) {
      if (t.scalar_type() != dtype) continue;
      t.detach().copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

}  // namespace

FSDPModule fully_shard(const std::vector<torch::nn::Module*>& modules, const FullyShardOptions& options) {
  TORCH_CHECK(!modules.empty(), "fully_shard: expected at least one module, got none");
  auto& registry = contract::ModuleStateRegistry::global();
  for (size_t i = 0; i < modules.size(); ++i) {
    TORCH_CHECK(modules[i] != nullptr, "fully_shard: module ", i, " of the unit is null");
    registry.check_not_applied(*modules[i], kFullyShardApi);
    check_no_unit_above(*modules[i]);
    for (size_t j = 0; j < modules.size(); ++j) {
      TORCH_CHECK(i == j || !contract::find_module_fqn(*modules[j], *modules[i]).has_value(),
                  "fully_shard: the modules of one unit must be siblings, but ",
                  registry.describe(*modules[i]), " is inside ", registry.describe(*modules[j]));
    }
  }
  check_modules_can_run_hooks(modules);  // [Note: refused modules] in fsdp/forward_errors.h
  TORCH_CHECK(!(options.mesh() && options.communicator()), "fully_shard: give either a "
              "communicator or a mesh (hybrid sharding), not both");
  std::shared_ptr<comm::Communicator> comm =
      options.mesh() ? options.mesh()->shard_group() : options.communicator();
  if (!comm) comm = comm::default_process_group().comm;
  TORCH_CHECK(!options.mesh() || options.strategy() != ShardingStrategy::kNoShard,
              "fully_shard: NO_SHARD with a mesh: use a mesh of shard size 1 instead");
  std::string fqn;
  for (auto* m : modules) fqn += (fqn.empty() ? "" : " + ") + registry.describe(*m);

  // Every parameter of the trees not already in another unit, in named_parameters order
  // (module by module), once per tensor (a tied parameter's first FQN owns it). A tied parameter
  // another unit manages moves here when this is the innermost unit containing every module using
  // it ([Note: tied parameters] in fsdp/tied_parameters.h); deciding changes nothing.
  const TiedParameterPlan tied = plan_tied_parameters(modules, fqn);
  const auto& owned = tied.stay;
  std::unordered_set<const void*> seen;
  std::vector<FlatParamHandle::OrigParam> params;
  std::vector<at::Tensor> buffers;
  const at::Device target = options.device().value_or(comm->device());
  for (size_t i = 0; i < modules.size(); ++i) {
    const std::string prefix = modules.size() > 1 ? std::to_string(i) + ":" : "";
    for (const auto& item : modules[i]->named_parameters(/*recurse=*/true)) {
      const at::Tensor& p = item.value();
      const void* impl = p.unsafeGetTensorImpl();
      if (owned.count(impl) || !seen.insert(impl).second) continue;
      TORCH_CHECK(at::isFloatingType(p.scalar_type()), "fully_shard: module ", fqn,
                  " has parameter '", item.key(), "' of dtype ", p.scalar_type(),
                  "; only floating-point parameters can be sharded");
      TORCH_CHECK(p.device().type() == target.type() || p.device().is_cpu(), "fully_shard: module ",
                  fqn, " has parameter '", item.key(), "' on ", p.device(), " but its shards go to ",
                  target, "; build the model on the CPU or on ", target.type());
      params.push_back({prefix + item.key(), p});
    }
    for (const auto& b : modules[i]->buffers(/*recurse=*/true)) buffers.push_back(b);
  }
  TORCH_CHECK(target.type() == comm->device().type(), "fully_shard: module ", fqn,
              " would keep its shards on ", target, " but the communicator works on ", comm->device());

  FSDPConfig config;
  config.comm = comm;
  config.handle.shard = options.strategy() != ShardingStrategy::kNoShard;
  config.handle.device = target;
  if (options.mesh()) config.handle.replicate = options.mesh()->replicate_group();
  const MixedPrecision& mp = options.mixed_precision();
  config.handle.param_dtype = mp.param_dtype();
  config.handle.reduce_dtype = mp.reduce_dtype();
  if (mp.param_dtype() && mp.cast_forward_inputs()) config.cast_forward_inputs_to = mp.param_dtype();
  config.handle.offload_to_cpu = options.offload_to_cpu();
  config.forward_prefetch = options.forward_prefetch();
  config.backward_prefetch = options.backward_prefetch();
  TORCH_CHECK(options.max_unshards_in_flight() >= 1, "fully_shard: max_unshards_in_flight must be "
              "at least 1, got ", options.max_unshards_in_flight());
  config.max_unshards_in_flight = options.max_unshards_in_flight();
  config.reshard_after_forward = options.strategy() == ShardingStrategy::kFullShard;

  // Tied parameters moving into this unit get their full-precision values back, and the units
  // they leave are rebuilt (collective). After every check: errors above change nothing.
  take_tied_parameters(tied);

  if (options.sync_module_states()) {
    std::vector<at::Tensor> tensors;
    for (const auto& p : params) tensors.push_back(p.param);
    tensors.insert(tensors.end(), buffers.begin(), buffers.end());
    // With a mesh: world rank 0 -> the first rank of every shard group -> every rank.
    if (options.mesh()) broadcast_from_rank0(tensors, *options.mesh()->replicate_group());
    broadcast_from_rank0(tensors, *comm);
  }
  {
    c10::NoGradGuard no_grad;
    for (auto& b : buffers) {
      const bool cast = mp.buffer_dtype() && at::isFloatingType(b.scalar_type());
      if (b.device() != target || cast) b.set_data(b.to(target, cast ? *mp.buffer_dtype() : b.scalar_type()));
    }
  }

  std::shared_ptr<FSDPState> state;
  for (torch::nn::Module* module : modules) {
    state = contract::apply_api(kFullyShardApi, *module, [&](torch::nn::Module& m) {
      if (!state) {
        state = std::make_shared<FSDPState>(modules, fqn, config, FSDPState::make_handles(params, config, fqn));
      }
      FSDPState* raw = state.get();  // owned by the registry for the modules' lifetime
      // The guard calls: [Note: first-iteration gradient guard] and [Note: forward errors] in
      // fsdp/gradient_guard.h and fsdp/forward_errors.h.
      contract::register_forward_pre_hook(
          m, [raw](torch::nn::Module&, contract::ForwardArgs& args) {
            runtime::pre_forward(*raw, args);
            guard_after_pre_forward(*raw);
          });
      contract::register_forward_hook(
          m, [raw](torch::nn::Module&, const contract::ForwardArgs&, c10::IValue& output) {
            runtime::post_forward(*raw, output);
            guard_after_post_forward(*raw, output);
          });
      contract::register_forward_exception_hook(
          m, [raw](torch::nn::Module&, c10::Error& error) { explain_forward_error(*raw, error); });
      return state;
    });
  }
  return FSDPModule(std::move(state));
}

FSDPModule fully_shard(torch::nn::Module& module, const FullyShardOptions& options) {
  return fully_shard(std::vector<torch::nn::Module*>{&module}, options);
}

void FSDPModule::set_requires_gradient_sync(bool sync, bool recurse) {
  for_each_unit(recurse, [sync](FSDPState& unit) { unit.requires_gradient_sync = sync; });
}

namespace {
std::vector<FSDPState*> states_of(const std::vector<FSDPModule>& units) {
  std::vector<FSDPState*> states;
  for (const auto& u : units) states.push_back(&u.state());
  return states;
}
}  // namespace

void FSDPModule::set_modules_to_forward_prefetch(const std::vector<FSDPModule>& units) {
  state_->forward_prefetch_targets = states_of(units);
}

void FSDPModule::set_modules_to_backward_prefetch(const std::vector<FSDPModule>& units) {
  state_->backward_prefetch_targets = states_of(units);
}

void FSDPModule::set_reshard_after_backward(bool reshard, bool recurse) {
  for_each_unit(recurse, [reshard](FSDPState& unit) { unit.reshard_after_backward = reshard; });
}

void FSDPModule::for_each_unit(bool recurse, const std::function<void(FSDPState&)>& fn) const {
  fn(*state_);
  if (!recurse) return;
  for (torch::nn::Module* module : state_->modules()) {
    for (const auto& unit : distinct_units_in_tree(*module, /*include_root=*/false)) {
      if (unit != state_) fn(*unit);
    }
  }
}

std::optional<FSDPModule> fsdp_module_of(const torch::nn::Module& module) {
  auto state = contract::ModuleStateRegistry::global().get_as<FSDPState>(module, kFullyShardApi);
  if (!state) return std::nullopt;
  return FSDPModule(std::move(state));
}

}  // namespace fsdp
