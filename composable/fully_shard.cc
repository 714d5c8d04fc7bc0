#include "fsdp_cpp/composable/fully_shard.h"

#include <algorithm>
#include <numeric>
#include <optional>
#include <sstream>
#include <unordered_set>

#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include "fsdp_cpp/composable/api_names.h"
#include "fsdp_cpp/composable/tensor_placement.h"
#include "fsdp_cpp/comm/agreement.h"
#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/comm/issuing_api.h"
#include "fsdp_cpp/contract/contract.h"
#include "fsdp_cpp/contract/forward_hooks.h"
#include "fsdp_cpp/contract/module_fqn.h"
#include "fsdp_cpp/contract/shape_text.h"
#include "fsdp_cpp/fsdp/runtime.h"
#include "fsdp_cpp/fsdp/forward_errors.h"
#include "fsdp_cpp/fsdp/fsdp_state.h"
#include "fsdp_cpp/fsdp/gradient_guard.h"
#include "fsdp_cpp/fsdp/derived_groups.h"
#include "fsdp_cpp/fsdp/tied_parameters.h"
#include "fsdp_cpp/fsdp/unit_tree.h"
#include "fsdp_cpp/fsdp/zero_grad.h"

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

// The parameters and buffers a new unit leaves alone ([Note: ignored parameters] in
// docs/architecture.md), checked before anything changes.
struct IgnoredStates {
  std::vector<at::Tensor> params;  // named_parameters order of the unit's trees, once each
  std::unordered_set<const void*> param_impls;
  std::vector<at::Tensor> buffers;
  std::unordered_set<const void*> buffer_impls;
};

IgnoredStates resolve_ignored(const std::vector<torch::nn::Module*>& modules, const FullyShardOptions& options,
                              const std::string& fqn) {
  auto& registry = contract::ModuleStateRegistry::global();
  std::unordered_set<const void*> wanted;          // parameters to ignore (TensorImpl*)
  std::unordered_set<const void*> wanted_buffers;  // buffers of ignored modules
  for (size_t i = 0; i < options.ignored_modules().size(); ++i) {
    const auto& ignored = options.ignored_modules()[i];
    TORCH_CHECK(ignored != nullptr, "fully_shard: ignored_modules[", i, "] of module ", fqn, " is null");
    bool inside = false;
    for (torch::nn::Module* root : modules) {
      TORCH_CHECK(ignored.get() != root, "fully_shard: module ", fqn, " lists itself in ignored_modules; "
                  "expected modules inside it (a module whose parameters should all stay local needs no "
                  "fully_shard; list its submodules instead)");
      inside |= contract::find_module_fqn(*root, *ignored).has_value();
    }
    TORCH_CHECK(inside, "fully_shard: ignored_modules[", i, "] (", ignored->name(), ") is not inside module ",
                fqn, "; expected a submodule of the module(s) fully_shard is applied to");
    std::string name;  // relative to the unit's module
    for (torch::nn::Module* root : modules) {
      if (auto found = contract::find_module_fqn(*root, *ignored)) name = *found;
    }
    for (const auto& item : ignored->named_modules("", /*include_self=*/true)) {
      TORCH_CHECK(!registry.contains(*item.value(), kFullyShardApi), "fully_shard: module ", fqn,
                  " ignores module '", name, "' (", ignored->name(), "), but ",
                  item.key().empty() ? std::string("it") : "its submodule '" + name + "." + item.key() + "'",
                  " is a fully_shard unit; an ignored module's parameters stay whole and local, so no unit can be "
                  "inside it. Remove it from ignored_modules, or do not apply fully_shard inside it");
    }
    for (const auto& p : ignored->parameters(/*recurse=*/true)) wanted.insert(p.unsafeGetTensorImpl());
    for (const auto& b : ignored->buffers(/*recurse=*/true)) wanted_buffers.insert(b.unsafeGetTensorImpl());
  }
  for (size_t i = 0; i < options.ignored_params().size(); ++i) {
    TORCH_CHECK(options.ignored_params()[i].defined(), "fully_shard: ignored_params[", i, "] of module ", fqn,
                " is an undefined tensor");
    wanted.insert(options.ignored_params()[i].unsafeGetTensorImpl());
  }
  // What the units already made ignore stays ignored (a tied parameter too, whichever unit).
  for (const auto& other : registry.modules_with(kFullyShardApi)) {
    const auto state = registry.get_as<FSDPState>(*other, kFullyShardApi);
    if (!state) continue;
    for (const auto& p : state->ignored_params()) wanted.insert(p.unsafeGetTensorImpl());
    for (const auto& b : state->ignored_buffers()) wanted_buffers.insert(b.unsafeGetTensorImpl());
  }
  IgnoredStates ignored;
  std::unordered_set<const void*> in_tree;
  for (size_t i = 0; i < modules.size(); ++i) {
    const std::string prefix = modules.size() > 1 ? std::to_string(i) + ":" : "";
    for (const auto& item : modules[i]->named_parameters(/*recurse=*/true)) {
      const void* impl = item.value().unsafeGetTensorImpl();
      in_tree.insert(impl);
      if (!wanted.count(impl) || !ignored.param_impls.insert(impl).second) continue;
      ignored.params.push_back(item.value());
      for (const auto& other : registry.modules_with(kFullyShardApi)) {
        const auto state = registry.get_as<FSDPState>(*other, kFullyShardApi);
        if (!state || !state->manages(item.value())) continue;
        const auto inner = contract::find_module_fqn(*modules[i], *other);
        TORCH_CHECK(false, "fully_shard: module ", fqn, " ignores parameter '", prefix + item.key(), "', but ",
                    inner ? "the unit of its submodule '" + prefix + *inner + "'"
                          : "unit " + registry.describe(*other),
                    " already manages it (sharded); ignore it in that unit's fully_shard instead (ignored_params "
                    "or ignored_modules), which keeps it ignored for every unit above");
      }
    }
    for (const auto& b : modules[i]->buffers(/*recurse=*/true)) {
      const void* impl = b.unsafeGetTensorImpl();
      if (wanted_buffers.count(impl) && ignored.buffer_impls.insert(impl).second) ignored.buffers.push_back(b);
    }
  }
  for (size_t i = 0; i < options.ignored_params().size(); ++i) {
    const at::Tensor& p = options.ignored_params()[i];
    TORCH_CHECK(in_tree.count(p.unsafeGetTensorImpl()), "fully_shard: ignored_params[", i, "] (shape ",
                contract::shape_string(p.sizes()), ", ", p.scalar_type(), ") is not a parameter of module ", fqn,
                " or of its submodules; expected parameters registered in the tree fully_shard is applied to");
  }
  return ignored;
}

// Whether a unit already exists strictly inside one of `modules` (its tied parameters may move
// into the new unit: a collective).
bool has_unit_inside(const std::vector<torch::nn::Module*>& modules) {
  for (const auto& other : contract::ModuleStateRegistry::global().modules_with(kFullyShardApi)) {
    for (torch::nn::Module* m : modules) {
      if (other.get() != m && contract::find_module_fqn(*m, *other).has_value()) return true;
    }
  }
  return false;
}

// Whether parallelize_module placed a parameter of `modules` over a group of several ranks (the
// check of [Note: fully_shard over tensor-parallel groups] is then exchanged across ranks).
bool has_tensor_parallel_params(const std::vector<torch::nn::Module*>& modules) {
  for (torch::nn::Module* m : modules) {
    for (const auto& p : m->parameters(/*recurse=*/true)) {
      const auto placement = tensor_placement(p);
      if (placement && placement->sharded() && placement->size() > 1) return true;
    }
  }
  return false;
}

// Mixed precision computes, all-gathers and reduces in these dtypes (the FlatParamHandle would
// refuse them only after the model was changed).
void check_mixed_precision(const MixedPrecision& mp, const std::string& fqn) {
  auto check = [&](const char* name, const std::optional<c10::ScalarType>& dtype) {
    TORCH_CHECK(!dtype || at::isFloatingType(*dtype), "fully_shard: module ", fqn,
                ": mixed precision needs floating-point dtypes; got ", name, " ", *dtype,
                " (MixedPrecision::", name, "). Expected a floating-point dtype such as at::kBFloat16, "
                "at::kHalf or at::kFloat, or none");
  };
  check("param_dtype", mp.param_dtype());
  check("reduce_dtype", mp.reduce_dtype());
  check("buffer_dtype", mp.buffer_dtype());
}

// One FlatParameter per (dtype, requires_grad) holds one device's parameters (meta ones have no
// device: they are materialized where the shard goes; parameters moving in from another unit are
// given their full values by the move).
void check_one_device_per_flat_param(const std::vector<FlatParamHandle::OrigParam>& params,
                                     const std::unordered_set<const void*>& moving, const std::string& fqn) {
  struct First {
    c10::ScalarType dtype;
    bool requires_grad;
    const FlatParamHandle::OrigParam* param;
  };
  std::vector<First> firsts;
  for (const auto& p : params) {
    if (p.param.is_meta() || moving.count(p.param.unsafeGetTensorImpl())) continue;
    const auto it = std::find_if(firsts.begin(), firsts.end(), [&](const First& f) {
      return f.dtype == p.param.scalar_type() && f.requires_grad == p.param.requires_grad();
    });
    if (it == firsts.end()) {
      firsts.push_back({p.param.scalar_type(), p.param.requires_grad(), &p});
      continue;
    }
    TORCH_CHECK(it->param->param.device() == p.param.device(), "fully_shard: module ", fqn,
                ": the parameters of one FlatParameter (one per dtype and requires_grad) must be on one "
                "device; parameter '", p.fqn, "' (", p.param.scalar_type(), ", requires_grad ",
                p.param.requires_grad(), ") is on ", p.param.device(), " but '", it->param->fqn, "' is on ",
                it->param->param.device(), ". Build the model on the CPU (FullyShardOptions::device "
                "places the shards) or on one device");
  }
}

// The options that decide which collectives a unit issues and over which groups, as the ranks
// compare them when fully_shard communicates.
std::string collective_settings(const FullyShardOptions& options) {
  std::string settings = std::string("strategy ") + to_string(options.strategy());
  if (const auto& group = options.post_forward_group_size()) {
    settings += ", reshard_after_forward(" + std::to_string(*group) + ")";
  }
  if (options.separate_reduce_communicator()) settings += ", separate_reduce_communicator";
  return settings;
}

// The options that decide the unit's collectives (collective_settings), compared over `groups`
// (each group of several ranks: one all_gather_bytes): "" when every rank of every group was given
// the same, else an error listing each rank's. Every rank of a group finds the same difference;
// comm::agree_on_error then spreads it across the groups.
std::string settings_difference(const std::vector<std::shared_ptr<comm::Communicator>>& groups,
                                const std::string& settings, const std::string& fqn) {
  for (const auto& group : groups) {
    if (!group || group->size() < 2) continue;
    const auto all = group->all_gather_bytes(std::vector<uint8_t>(settings.begin(), settings.end()),
                                             "fully_shard settings");
    std::vector<std::string> ranks_settings;
    for (const auto& bytes : all) ranks_settings.emplace_back(bytes.begin(), bytes.end());
    if (std::all_of(ranks_settings.begin(), ranks_settings.end(),
                    [&](const std::string& x) { return x == ranks_settings[0]; })) {
      continue;
    }
    const auto world_ranks = group->world_ranks();
    std::ostringstream message;
    message << "fully_shard: module " << fqn << " was given options that differ across ranks (nothing was "
            << "changed on any rank); every rank must shard a unit alike:";
    for (size_t r = 0; r < ranks_settings.size(); ++r) {
      message << "\n  rank " << (world_ranks ? (*world_ranks)[r] : static_cast<int>(r)) << ": " << ranks_settings[r];
    }
    message << "\nGive every rank the same options for this unit.";
    return message.str();
  }
  return "";
}

// The phases of fully_shard, in order (each one a function below): check the modules, resolve the
// options, decide the unit's contents (every check: [Note: all-or-nothing]), take tied parameters
// over, materialize meta buffers and ignored parameters, sync module states, place buffers, make
// the unit and register its hooks. Only the phases after decide_unit change anything.

// The modules may become one unit: not null, not under replicate or fully_shard, no unit above
// them, siblings, and run through hook-able holders.
void check_modules(const std::vector<torch::nn::Module*>& modules) {
  TORCH_CHECK(!modules.empty(), "fully_shard: expected at least one module, got none");
  auto& registry = contract::ModuleStateRegistry::global();
  declare_api_exclusions();
  for (size_t i = 0; i < modules.size(); ++i) {
    TORCH_CHECK(modules[i] != nullptr, "fully_shard: module ", i, " of the unit is null");
    registry.check_exclusions(*modules[i], kFullyShardApi);  // replicate on it or inside it
    registry.check_not_applied(*modules[i], kFullyShardApi);
    check_no_unit_above(*modules[i]);
    for (size_t j = 0; j < modules.size(); ++j) {
      TORCH_CHECK(i == j || !contract::find_module_fqn(*modules[j], *modules[i]).has_value(),
                  "fully_shard: the modules of one unit must be siblings, but ",
                  registry.describe(*modules[i]), " is inside ", registry.describe(*modules[j]));
    }
  }
  check_modules_can_run_hooks(modules);  // [Note: refused modules] in fsdp/forward_errors.h
}

// The unit's name in errors: its modules' descriptions, joined by " + ".
std::string unit_fqn(const std::vector<torch::nn::Module*>& modules) {
  auto& registry = contract::ModuleStateRegistry::global();
  std::string fqn;
  for (auto* m : modules) fqn += (fqn.empty() ? "" : " + ") + registry.describe(*m);
  return fqn;
}

// Options that contradict each other, refused alike on every rank (they are the same everywhere).
void check_options(const FullyShardOptions& options, const std::string& fqn) {
  TORCH_CHECK(!(options.mesh() && options.communicator()), "fully_shard: give either a "
              "communicator or a mesh (hybrid sharding), not both");
  TORCH_CHECK(!options.mesh() || options.strategy() != ShardingStrategy::kNoShard,
              "fully_shard: NO_SHARD with a mesh: use a mesh of shard size 1 instead");
  const std::string conflict = strategy_conflict(options);
  TORCH_CHECK(conflict.empty(), "fully_shard: module ", fqn, " was given ", conflict,
              ", which contradict each other (FULL_SHARD reshards after forward; SHARD_GRAD_OP and "
              "NO_SHARD do not). Give one of them: reshard_after_forward(...) alone is the shorthand "
              "for FULL_SHARD (true) or SHARD_GRAD_OP (false)");
  check_codecs_fit_strategy(options, fqn);  // before anything changes ([Note: all-or-nothing])
}

// The options, whole, with what they resolve to: the communicators, the shards' device and how
// meta tensors get their values. Changes nothing.
FSDPConfig resolve_config(const FullyShardOptions& options, const std::string& fqn) {
  FSDPConfig config;
  config.options = options;
  config.comm = options.mesh() ? options.mesh()->shard_group() : options.communicator();
  if (!config.comm) config.comm = comm::default_process_group().comm;
  if (options.mesh()) config.replicate = options.mesh()->replicate_group();
  config.device = options.device().value_or(config.comm->device());
  const TensorInitFn init_fn = options.param_init_fn();
  config.meta_values = [init_fn, fqn](const std::string& name, const at::Tensor& t) {
    if (!init_fn) return materialize_values(t, fqn + " '" + name + "'");
    at::Tensor values = at::empty(t.sizes(), at::TensorOptions().dtype(t.scalar_type()));
    init_fn(name, values);
    return values;
  };
  return config;
}

// What a new unit consists of, decided before anything changes.
struct UnitContents {
  IgnoredStates ignored;
  TiedParameterPlan tied;
  std::vector<FlatParamHandle::OrigParam> params;  // what its FlatParameters will hold
  std::vector<at::Tensor> buffers;                 // not ignored: moved to the device and cast
  std::vector<std::pair<std::string, at::Tensor>> meta_tensors;  // parameters and buffers, with their FQNs
};

// Every parameter of the trees not already in another unit, in named_parameters order (module by
// module), once per tensor (a tied parameter's first FQN owns it). A tied parameter another unit
// manages moves here when this is the innermost unit containing every module using it ([Note:
// tied parameters] in fsdp/tied_parameters.h); deciding changes nothing.
UnitContents collect_contents(const std::vector<torch::nn::Module*>& modules, const FSDPConfig& config,
                              const std::string& fqn) {
  UnitContents unit;
  const at::Device target = config.device;
  unit.ignored = resolve_ignored(modules, config.options, fqn);
  unit.tied = plan_tied_parameters(modules, fqn);
  const auto& owned = unit.tied.stay;
  std::unordered_set<const void*> seen;
  for (size_t i = 0; i < modules.size(); ++i) {
    const std::string prefix = modules.size() > 1 ? std::to_string(i) + ":" : "";
    for (const auto& item : modules[i]->named_parameters(/*recurse=*/true)) {
      const at::Tensor& p = item.value();
      const void* impl = p.unsafeGetTensorImpl();
      if (owned.count(impl) || unit.ignored.param_impls.count(impl) || !seen.insert(impl).second) continue;
      TORCH_CHECK(at::isFloatingType(p.scalar_type()), "fully_shard: module ", fqn,
                  " has parameter '", item.key(), "' of dtype ", p.scalar_type(),
                  "; only floating-point parameters can be sharded (list it in FullyShardOptions::ignored_params "
                  "to keep it whole and local)");
      TORCH_CHECK(p.is_meta() || p.device().type() == target.type() || p.device().is_cpu(), "fully_shard: module ",
                  fqn, " has parameter '", item.key(), "' on ", p.device(), " but its shards go to ",
                  target, "; build the model on the CPU or on ", target.type());
      unit.params.push_back({prefix + item.key(), p});
    }
    for (const auto& item : modules[i]->named_buffers(/*recurse=*/true)) {
      const at::Tensor& b = item.value();
      if (!unit.ignored.buffer_impls.count(b.unsafeGetTensorImpl())) unit.buffers.push_back(b);
      if (b.is_meta()) unit.meta_tensors.push_back({prefix + item.key(), b});
    }
    for (const auto& item : modules[i]->named_parameters(/*recurse=*/true)) {
      if (item.value().is_meta()) unit.meta_tensors.push_back({prefix + item.key(), item.value()});
    }
  }
  return unit;
}

// [Note: fully_shard over tensor-parallel groups] A parameter that parallelize_module placed
// (composable/tensor_placement.h) is this rank's piece of a global tensor; the ranks of its tp group
// hold different pieces. fully_shard averages gradients over its communicator (and, with a mesh,
// its replicate group): a group containing two ranks of one tp group would average different
// pieces' gradients with each other and flatten them as if they were replicas, training a wrong
// model with no error. Refused before anything changes, through the all-or-nothing exchange: the
// unit is refused when a sharded placement's group shares two or more world ranks with one of
// fully_shard's groups. The world ranks are Communicator::world_ranks(), or, for a communicator
// made directly from a backend (which does not know them), those of the default process group when
// it is the same backend. What cannot be proved is accepted: when either side's world ranks stay
// unknown, the unit is refused only if fully_shard's group is the tp group itself (the same
// communicator or backend). Replicated placements (a row-parallel bias) are whole on every tp rank
// and not checked.
std::optional<std::vector<int>> known_world_ranks(const std::shared_ptr<comm::Communicator>& group) {
  if (!group) return std::nullopt;
  if (auto ranks = group->world_ranks()) return ranks;
  if (comm::is_initialized()) {
    const auto& world = comm::default_process_group().comm;
    if (world && world->backend().get() == group->backend().get()) {
      if (auto ranks = world->world_ranks()) return ranks;
      std::vector<int> all(world->size());
      std::iota(all.begin(), all.end(), 0);
      return all;
    }
  }
  return std::nullopt;
}

std::string ranks_text(const std::vector<int>& ranks) {
  std::string out = "{";
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out + "}";
}

void check_tensor_parallel_groups(const UnitContents& unit, const FSDPConfig& config, const std::string& fqn) {
  struct Group {
    const char* name;
    std::shared_ptr<comm::Communicator> comm;
  };
  const std::vector<Group> groups = {
      {config.options.mesh() ? "its mesh's shard group" : "its communicator", config.comm},
      {"its mesh's replicate group", config.replicate}};
  for (const auto& p : unit.params) {
    const auto placement = tensor_placement(p.param);
    if (!placement || !placement->sharded() || !placement->group || placement->group->size() < 2) continue;
    const auto& tp = placement->group;
    for (const auto& g : groups) {
      if (!g.comm || g.comm->size() < 2) continue;
      const auto tp_ranks = known_world_ranks(tp);
      const auto fsdp_ranks = known_world_ranks(g.comm);
      std::vector<int> shared;
      if (tp_ranks && fsdp_ranks) {
        for (int r : *fsdp_ranks) {
          if (std::find(tp_ranks->begin(), tp_ranks->end(), r) != tp_ranks->end()) shared.push_back(r);
        }
      } else if (g.comm == tp || g.comm->backend().get() == tp->backend().get()) {
        shared.resize(2);  // the tp group itself: every rank of it
      }
      if (shared.size() < 2) continue;
      auto text = [](const std::optional<std::vector<int>>& ranks) {
        return ranks ? "world ranks " + ranks_text(*ranks) : std::string("world ranks unknown (the same group)");
      };
      TORCH_CHECK(false, "fully_shard: module ", fqn, " has parameter '", p.fqn, "' placed by tensor parallel (",
                  placement->describe(), ", mesh dimension '", placement->mesh_dim, "': ", text(tp_ranks), "), but ",
                  g.name, " (", text(fsdp_ranks), ") contains ",
                  tp_ranks && fsdp_ranks ? std::to_string(shared.size()) + " ranks of that tp group " + ranks_text(shared)
                                         : std::string("the ranks of that tp group"),
                  ". Expected a data-parallel group with at most one rank of each tp group: fully_shard would "
                  "average the gradients of different tensor-parallel pieces as if they were replicas and "
                  "train a wrong model. Pass the data-parallel group: FullyShardOptions().communicator(mesh->group(\"dp\")) "
                  "(or, for hybrid sharding, a mesh over the data-parallel dimensions only)");
    }
  }
}

// The checks of the contents that the later phases (and the FlatParamHandle constructor) would
// otherwise fail only after the model was changed.
void check_contents(const UnitContents& unit, const FSDPConfig& config, const std::string& fqn) {
  const FullyShardOptions& options = config.options;
  // [Note: meta-device models]: every meta tensor must have a way to get its values.
  for (const auto& [name, t] : unit.meta_tensors) {
    TORCH_CHECK(options.param_init_fn() || has_recorded_init(t), "fully_shard: module ", fqn, " has '",
                name, "' on the meta device with no recorded initialization (it was not built inside an "
                "fsdp::MetaInitGuard); give FullyShardOptions::param_init_fn to initialize it");
  }
  TORCH_CHECK(config.device.type() == config.comm->device().type(), "fully_shard: module ", fqn,
              " would keep its shards on ", config.device, " but the communicator works on ", config.comm->device());
  check_mixed_precision(options.mixed_precision(), fqn);
  std::unordered_set<const void*> moving;
  for (const auto& move : unit.tied.moves) moving.insert(move.param);
  check_one_device_per_flat_param(unit.params, moving, fqn);
  check_tensor_parallel_groups(unit, config, fqn);  // [Note: fully_shard over tensor-parallel groups]
  if (const auto& group = options.post_forward_group_size()) {
    const std::string error = post_forward_group_size_error(*group, config.comm->size());
    TORCH_CHECK(error.empty(), "fully_shard: module ", fqn, ": ", error);
  }
  TORCH_CHECK(options.max_unshards_in_flight() >= 1, "fully_shard: max_unshards_in_flight must be "
              "at least 1, got ", options.max_unshards_in_flight());
}

// [Note: all-or-nothing] Everything that can refuse the call is checked before anything changes
// (the tied-parameter moves, meta materialization, the sync broadcast, buffer casts and the
// FlatParameters come after), including what only the FlatParamHandle constructor used to check
// (floating-point mixed-precision dtypes, one device per FlatParameter). When this call
// communicates (several ranks, and sync_module_states, a mesh, reshard_after_forward(int),
// separate_reduce_communicator, units below whose tied parameters may move here, or parameters
// placed by tensor parallel), the ranks first compare the options that decide the unit's
// collectives (collective_settings), then agree on the outcome of the checks with
// comm::throw_if_any_error over the shard and replicate groups ([Note: error agreement]), so a
// check that fails on some ranks only fails on every rank before any collective, with the same
// error ("fully_shard: rank R: ...", the lowest world rank's), and ranks given different options
// are refused alike. A rank that does not communicate cannot be
// compared here: on the MPI backend its next collective fails on every rank ([Note: MPI size
// check]), on others the divergence check of the first iteration names it.
UnitContents decide_unit(const std::vector<torch::nn::Module*>& modules, const FSDPConfig& config,
                         const std::string& fqn) {
  const FullyShardOptions& options = config.options;
  const bool several_ranks = config.comm->size() > 1 || (config.replicate && config.replicate->size() > 1);
  const bool may_communicate = several_ranks && (options.sync_module_states() || options.mesh() ||
                                                           options.post_forward_group_size() ||
                                                           options.separate_reduce_communicator() ||
                                                           has_unit_inside(modules) ||
                                                           has_tensor_parallel_params(modules));
  UnitContents unit;
  std::string refused;  // this rank's error, when may_communicate
  try {
    unit = collect_contents(modules, config, fqn);
    check_contents(unit, config, fqn);
  } catch (const c10::Error& error) {
    if (!may_communicate) throw;
    refused = error.what_without_backtrace();
  }
  if (may_communicate) {
    // [Note: error agreement] in comm/agreement.h, over the shard group and, with a mesh, the
    // replicate group (the sync broadcast crosses both): every rank refuses with the same error
    // (the lowest world rank's) or none does. A rank whose checks passed reports options that
    // differ from its peers' instead.
    const std::vector<std::shared_ptr<comm::Communicator>> groups = {config.comm, config.replicate};
    std::string error = settings_difference(groups, collective_settings(options), fqn);
    if (!refused.empty()) error = refused;
    comm::throw_if_any_error(groups, error.empty() ? std::nullopt : std::optional<std::string>(error), "fully_shard");
  }
  return unit;
}

// Meta buffers and ignored parameters are materialized whole, where the shards go (ignored ones
// have no device of their own to stay on). Meta parameters are materialized by their handles.
void materialize_unsharded_meta(const UnitContents& unit, const FSDPConfig& config) {
  c10::NoGradGuard no_grad;
  std::unordered_set<const void*> sharded;
  for (const auto& p : unit.params) sharded.insert(p.param.unsafeGetTensorImpl());
  for (const auto& [name, t] : unit.meta_tensors) {
    if (t.is_meta() && !sharded.count(t.unsafeGetTensorImpl())) {
      adopt_values(t, config.meta_values(name, t).to(config.device));
    }
  }
}

// sync_module_states: rank 0's parameters and buffers everywhere. Meta parameters need none:
// their materialization gives every rank the same values.
void sync_module_states(const UnitContents& unit, const FSDPConfig& config) {
  std::vector<at::Tensor> tensors;
  for (const auto& p : unit.params) {
    if (!p.param.is_meta()) tensors.push_back(p.param);
  }
  tensors.insert(tensors.end(), unit.buffers.begin(), unit.buffers.end());
  // With a mesh: world rank 0 -> the first rank of every shard group -> every rank.
  if (config.replicate) broadcast_from_rank0(tensors, *config.replicate);
  broadcast_from_rank0(tensors, *config.comm);
}

// The unit's buffers go where the shards go, floating-point ones cast to the buffer dtype.
void place_buffers(const std::vector<at::Tensor>& buffers, const FSDPConfig& config) {
  c10::NoGradGuard no_grad;
  const auto& buffer_dtype = config.options.mixed_precision().buffer_dtype();
  for (const auto& b : buffers) {
    const bool cast = buffer_dtype && at::isFloatingType(b.scalar_type());
    if (b.device() != config.device || cast) {
      b.set_data(b.to(config.device, cast ? *buffer_dtype : b.scalar_type()));
    }
  }
}

// Makes the FlatParameters (sharding the parameters) and registers the unit's state and forward
// hooks on each of its modules.
std::shared_ptr<FSDPState> register_unit(const std::vector<torch::nn::Module*>& modules, const std::string& fqn,
                                         const FSDPConfig& config, const UnitContents& unit) {
  std::shared_ptr<FSDPState> state;
  for (torch::nn::Module* module : modules) {
    state = contract::apply_api(kFullyShardApi, *module, [&](torch::nn::Module& m) {
      if (!state) {
        state = std::make_shared<FSDPState>(modules, fqn, config, FSDPState::make_handles(unit.params, config, fqn));
        state->set_ignored(unit.ignored.params, unit.ignored.buffers);
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
          m, [raw](torch::nn::Module&, c10::Error& error) {
            explain_forward_error(*raw, error);  // reads the parameters as the forward left them
            runtime::forward_failed(*raw);
          });
      return state;
    });
  }
  return state;
}

}  // namespace

FSDPModule fully_shard(const std::vector<torch::nn::Module*>& modules, const FullyShardOptions& options) {
  comm::IssuingApi issuing_api("fully_shard");
  check_modules(modules);
  const std::string fqn = unit_fqn(modules);
  check_options(options, fqn);
  FSDPConfig config = resolve_config(options, fqn);
  const UnitContents unit = decide_unit(modules, config, fqn);
  // Collective over the shard group the first time (every rank agreed on the size above).
  const auto& group = options.post_forward_group_size();
  if (group && *group < config.comm->size()) config.post_forward_group = post_forward_group(config.comm, *group);
  if (options.separate_reduce_communicator() && config.comm->size() > 1) config.reduce_group = reduce_group(config.comm);
  // After every check: errors above change nothing. Tied parameters moving into this unit get
  // their full-precision values back, and the units they leave are rebuilt (collective).
  take_tied_parameters(unit.tied);
  materialize_unsharded_meta(unit, config);
  if (options.sync_module_states()) sync_module_states(unit, config);
  place_buffers(unit.buffers, config);
  return FSDPModule(register_unit(modules, fqn, config, unit));
}

FSDPModule fully_shard(torch::nn::Module& module, const FullyShardOptions& options) {
  return fully_shard(std::vector<torch::nn::Module*>{&module}, options);
}

FSDPModule::FSDPModule(std::shared_ptr<FSDPState> state) : state_(std::move(state)) {}

void FSDPModule::unshard() { state_->unshard(); }

void FSDPModule::reshard() { state_->reshard(); }

torch::nn::Module& FSDPModule::module() const { return state_->module(); }

const std::vector<torch::nn::Module*>& FSDPModule::modules() const { return state_->modules(); }

const std::string& FSDPModule::fqn() const { return state_->fqn(); }

const FullyShardOptions& FSDPModule::options() const { return state_->config().options; }

bool FSDPModule::manages(const at::Tensor& param) const { return state_->manages(param); }

bool FSDPModule::ignores(const at::Tensor& param) const { return state_->ignores(param); }

int64_t FSDPModule::sharded_param_bytes() const {
  int64_t bytes = 0;
  for (const auto& h : state_->handles()) bytes += static_cast<int64_t>(h->local_shard().nbytes());
  return bytes;
}

int64_t FSDPModule::sharded_grad_bytes() const {
  int64_t bytes = 0;
  for (const auto& h : state_->handles()) bytes += static_cast<int64_t>(h->sharded_grad_bytes());
  return bytes;
}

void FSDPModule::set_requires_gradient_sync(bool sync, bool recurse) {
  for_each_unit(recurse, [sync](FSDPState& unit) { unit.set_requires_gradient_sync(sync); });
}

void FSDPModule::set_gradient_divide_factor(double factor, bool recurse) {
  // This unit first: a refused factor leaves every unit as it was.
  for_each_unit(recurse, [factor](FSDPState& unit) { unit.set_gradient_divide_factor(factor); });
}

void FSDPModule::set_requires_all_reduce(bool all_reduce, bool recurse) {
  for_each_unit(recurse, [all_reduce](FSDPState& unit) { unit.set_requires_all_reduce(all_reduce); });
}

std::optional<double> FSDPModule::gradient_divide_factor() const { return state_->gradient_divide_factor(); }

bool FSDPModule::requires_all_reduce() const { return state_->requires_all_reduce(); }

void FSDPModule::set_unshard_in_backward(bool unshard) { state_->set_unshard_in_backward(unshard); }

bool FSDPModule::unshard_in_backward() const { return state_->unshard_in_backward(); }

std::vector<FSDPState*> FSDPModule::states_of(const std::vector<FSDPModule>& units) {
  std::vector<FSDPState*> states;
  for (const auto& u : units) states.push_back(u.state_.get());
  return states;
}

void FSDPModule::set_modules_to_forward_prefetch(const std::vector<FSDPModule>& units) {
  state_->set_forward_prefetch_targets(states_of(units));
}

void FSDPModule::set_modules_to_backward_prefetch(const std::vector<FSDPModule>& units) {
  state_->set_backward_prefetch_targets(states_of(units));
}

void FSDPModule::set_reshard_after_backward(bool reshard, bool recurse) {
  for_each_unit(recurse, [reshard](FSDPState& unit) { unit.set_reshard_after_backward(reshard); });
}

void FSDPModule::set_is_last_backward(bool last) {
  // [Note: open iterations] in fsdp/open_iteration.h: only the root's is read.
  if (!last) {
    if (const FSDPState* above = enclosing_unit(*state_)) {
      TORCH_CHECK(false, "FSDPModule::set_is_last_backward: unit '", state_->fqn(), "' is not a root (it is "
                  "inside unit '", above->fqn().empty() ? "<root>" : above->fqn(), "'); only the root's "
                  "is_last_backward decides whether a backward pass ends the iteration, so setting it to false here "
                  "would be ignored. Expected the root unit (the outermost module fully_shard was applied to, or each "
                  "pipeline stage's root)");
    }
  }
  state_->set_is_last_backward(last);
}

void FSDPModule::zero_grad(bool set_to_none) { runtime::zero_grad(*state_, set_to_none, "FSDPModule::zero_grad"); }

bool FSDPModule::is_last_backward() const { return state_->is_last_backward(); }

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
