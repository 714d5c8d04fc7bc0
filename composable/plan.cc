#include "fsdp_cpp/composable/plan.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <ostream>
#include <sstream>
#include <unordered_map>

#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include "fsdp_cpp/composable/tensor_placement.h"
#include "fsdp_cpp/contract/module_fqn.h"
#include "fsdp_cpp/contract/module_state.h"
#include "fsdp_cpp/contract/shape_text.h"
#include "fsdp_cpp/fsdp/fsdp_state.h"
#include "fsdp_cpp/fsdp/tied_parameters.h"
#include "fsdp_cpp/fsdp/unit_tree.h"

namespace fsdp {
namespace {

int64_t element_size(c10::ScalarType dtype) { return static_cast<int64_t>(c10::elementSize(dtype)); }

// Whether the module at `inner` is strictly inside the module at `outer` (FQNs from the root).
bool strictly_inside(const std::string& outer, const std::string& inner) {
  if (inner == outer) return false;
  return outer.empty() || (inner.size() > outer.size() && inner.compare(0, outer.size(), outer) == 0 &&
                           inner[outer.size()] == '.');
}

// "fsdp::examples::BlockImpl" -> "BlockImpl".
std::string class_name(const torch::nn::Module& module) {
  const std::string name = module.name();
  const auto colon = name.rfind("::");
  return colon == std::string::npos ? name : name.substr(colon + 2);
}

int optimizer_tensors_per_param(const PlanOptions& options) {
  switch (options.optimizer()) {
    case PlanOptimizer::kNone:
    case PlanOptimizer::kSGD: return 0;
    case PlanOptimizer::kSGDMomentum: return 1;
    case PlanOptimizer::kAdam:
    case PlanOptimizer::kAdamW: return options.amsgrad() ? 3 : 2;
  }
  return 0;
}

// The root unit of `module`'s tree: `module` must carry fully_shard and lie in no other unit.
std::shared_ptr<FSDPState> root_state_of(torch::nn::Module& module) {
  auto& registry = contract::ModuleStateRegistry::global();
  auto state = registry.get_as<FSDPState>(module, kFullyShardApi);
  TORCH_CHECK(state != nullptr, "fsdp::plan: module ", registry.describe(module),
              " is not a fully_shard unit; expected the root module fully_shard was applied to "
              "last (apply fully_shard bottom-up, then call plan on the root)");
  for (const auto& other : registry.modules_with(kFullyShardApi)) {
    if (other.get() == &module) continue;
    TORCH_CHECK(!contract::find_module_fqn(*other, module).has_value(), "fsdp::plan: module ",
                registry.describe(module), " is inside unit ", registry.describe(*other),
                "; expected the root unit (the outermost module fully_shard was applied to): call "
                "plan on ", registry.describe(*other), " or the module containing it");
  }
  return state;
}

HandlePlan plan_handle(const FlatParamHandle& handle, const FSDPConfig& config) {
  HandlePlan h;
  const FlatParamLayout& layout = handle.layout();
  h.dtype = layout.dtype;
  h.compute_dtype = handle.compute_dtype();
  h.reduce_dtype = handle.reduce_dtype();
  h.trainable = handle.requires_grad();
  h.sharded = handle.is_sharded_strategy();
  h.offload_to_cpu = config.options.offload_to_cpu();
  const bool mixed_precision = h.compute_dtype != h.dtype;
  // As FlatParamHandle keeps them (flat_param_handle.cc: needs_unsharded_buffer, compute_shard_).
  h.unsharded_buffer = h.sharded || mixed_precision || h.offload_to_cpu;
  const at::Device compute_device = config.device;
  h.compute_copy = mixed_precision || (h.offload_to_cpu && !compute_device.is_cpu());
  h.num_params = static_cast<int64_t>(layout.entries.size());
  for (const auto& e : layout.entries) h.numel += e.numel;
  h.aligned_numel = layout.unpadded_numel;
  h.padded_numel = layout.padded_numel;
  h.shard_numel = layout.shard_numel();
  // [Note: communication codecs]: used only when sharded across ranks.
  if (h.sharded && handle.all_gather_codec()) {
    h.encoded_gather_bytes = handle.all_gather_codec()->encoded_bytes(h.shard_numel);
  }
  if (h.sharded && h.trainable && handle.reduce_codec()) {
    h.encoded_reduce_bytes = handle.encoded_reduce_bytes();  // the FlatParameter's row layout
  }
  for (size_t i = 0; i < handle.params().size(); ++i) {
    std::string text = handle.params()[i].fqn + " " + contract::shape_string(layout.entries[i].shape);
    if (auto placement = tensor_placement(handle.params()[i].param)) text += " (" + placement->describe() + ")";
    h.params.push_back(std::move(text));
  }
  return h;
}

// Elements of original parameters in `rank`'s shard of `handle` (a handle not sharded: all).
int64_t rank_numel(const FlatParamHandle& handle, int rank) {
  const FlatParamLayout& layout = handle.layout();
  if (layout.world_size == 1) {
    int64_t n = 0;
    for (const auto& e : layout.entries) n += e.numel;
    return n;
  }
  int64_t n = 0;
  for (const auto& s : layout.slices_for_rank(rank)) n += s.size();
  return n;
}

// The `count` largest of `values`, summed.
int64_t sum_of_largest(std::vector<int64_t> values, size_t count) {
  std::sort(values.begin(), values.end(), std::greater<int64_t>());
  int64_t sum = 0;
  for (size_t i = 0; i < std::min(count, values.size()); ++i) sum += values[i];
  return sum;
}

}  // namespace

const char* to_string(PlanOptimizer optimizer) {
  switch (optimizer) {
    case PlanOptimizer::kNone: return "none";
    case PlanOptimizer::kSGD: return "SGD";
    case PlanOptimizer::kSGDMomentum: return "SGD with momentum";
    case PlanOptimizer::kAdam: return "Adam";
    case PlanOptimizer::kAdamW: return "AdamW";
  }
  return "?";
}

const char* to_string(PlannedStrategy strategy) {
  switch (strategy) {
    case PlannedStrategy::kFullShard: return "FULL_SHARD";
    case PlannedStrategy::kShardGradOp: return "SHARD_GRAD_OP";
    case PlannedStrategy::kNoShard: return "NO_SHARD";
    case PlannedStrategy::kHybridShard: return "HYBRID_SHARD";
    case PlannedStrategy::kHybridShardZero2: return "HYBRID_SHARD_ZERO2";
  }
  return "?";
}

std::string UnitPlan::name() const {
  std::string name;
  for (const auto& m : module_fqns) name += (name.empty() ? "" : "+") + contract::display_fqn(m);
  return name;
}

int64_t UnitPlan::unsharded_bytes() const {
  int64_t bytes = 0;
  for (const auto& h : handles) bytes += h.unsharded_bytes();
  return bytes;
}

int64_t UnitPlan::shard_bytes() const {
  int64_t bytes = 0;
  for (const auto& h : handles) bytes += h.shard_bytes();
  return bytes;
}

ShardingPlan plan(const FSDPModule& root, const PlanOptions& options) {
  return plan(root.module(), options);
}

namespace {

// The phases of plan(), in order: the units of the root's tree, each unit's settings, each
// handle's memory and communication, then the tree-wide figures (unsharded peaks, tied and
// unmanaged parameters).

// The units, as lazy initialisation will see them (fsdp/lazy_init.cc): one per state, named by
// the FQNs of its modules in the root's tree. Returns the states, in the order of result.units.
std::vector<std::shared_ptr<FSDPState>> plan_units(torch::nn::Module& root_module, ShardingPlan& result) {
  std::vector<std::shared_ptr<FSDPState>> states;
  std::unordered_map<const FSDPState*, size_t> index;
  for (const auto& unit : units_in_tree(root_module)) {
    auto it = index.find(unit.state.get());
    if (it == index.end()) {
      it = index.emplace(unit.state.get(), states.size()).first;
      states.push_back(unit.state);
      result.units.emplace_back();
      result.units.back().module_class = class_name(*unit.module);
    }
    result.units[it->second].module_fqns.push_back(unit.fqn);
  }
  return states;
}

// Whether one of `outer`'s modules strictly contains one of `inner`'s.
bool contains(const UnitPlan& outer, const UnitPlan& inner) {
  bool found = false;
  for (const auto& o : outer.module_fqns) {
    for (const auto& i : inner.module_fqns) found |= strictly_inside(o, i);
  }
  return found;
}

// FSDP's name for what the unit's options give (HSDP with a mesh).
PlannedStrategy planned_strategy(const FSDPConfig& config) {
  const bool hybrid = config.replicate != nullptr;
  switch (config.options.strategy()) {
    case ShardingStrategy::kNoShard: return PlannedStrategy::kNoShard;
    case ShardingStrategy::kShardGradOp: return hybrid ? PlannedStrategy::kHybridShardZero2 : PlannedStrategy::kShardGradOp;
    case ShardingStrategy::kFullShard: return hybrid ? PlannedStrategy::kHybridShard : PlannedStrategy::kFullShard;
  }
  return PlannedStrategy::kFullShard;
}

// A unit's settings, from its options (and whether it is the root) and its place in the tree.
void plan_unit_settings(UnitPlan& unit, const FSDPState& state, bool is_root, const std::vector<UnitPlan>& units) {
  const FSDPConfig& config = state.config();
  unit.is_root = is_root;
  for (const auto& other : units) {
    if (&other != &unit && contains(other, unit)) unit.depth += 1;
  }
  unit.strategy = planned_strategy(config);
  unit.reshards_after_forward = !unit.is_root && config.reshard_after_forward();
  if (unit.reshards_after_forward && config.post_forward_group) {
    unit.post_forward_group_size = config.post_forward_group->size();
  }
  unit.shard_group_size = config.comm->size();
  unit.replicate_group_size = config.replicate ? config.replicate->size() : 1;
  unit.param_dtype = config.options.mixed_precision().param_dtype();
  unit.reduce_dtype = config.options.mixed_precision().reduce_dtype();
  unit.offload_to_cpu = config.options.offload_to_cpu();
  if (config.options.all_gather_codec()) unit.all_gather_codec = config.options.all_gather_codec()->name();
  if (config.options.reduce_codec()) unit.reduce_codec = config.options.reduce_codec()->name();
}

// What the whole tree shares while planning the handles.
struct HandleTally {
  bool passthrough = true;  // every handle of the tree runs as a passthrough
  int tensors_per_param = 0;
  int shard_size = 1;
  std::vector<int64_t> optimizer_per_rank;
  std::vector<int64_t> offloaded_optimizer_per_rank;
};

// One handle of `unit`: its layout, this rank's memory for it and its collectives per step.
void plan_handle_memory_and_communication(const FlatParamHandle& handle, const FSDPConfig& config, UnitPlan& unit,
                                          HandleTally& tally, ShardingPlan& result) {
  HandlePlan h = plan_handle(handle, config);
  h.rank_numel = rank_numel(handle, h.sharded ? config.comm->rank() : 0);
  for (int r = 0; r < (h.sharded ? config.comm->size() : 1); ++r) {
    h.max_rank_numel = std::max(h.max_rank_numel, rank_numel(handle, r));
  }
  const int64_t shard_bytes = h.shard_bytes();
  const int64_t param_element = element_size(h.dtype);

  // Memory of this rank.
  MemoryEstimate& m = result.memory;
  m.sharded_params += shard_bytes;
  int64_t grad_bytes = 0, optimizer_bytes = 0;
  if (h.trainable) {
    grad_bytes = tally.passthrough ? h.numel * param_element : shard_bytes;
    optimizer_bytes = tally.tensors_per_param * h.rank_numel * param_element;
    for (int r = 0; r < tally.shard_size; ++r) {
      const int handle_rank = h.sharded && handle.layout().world_size == tally.shard_size ? r : 0;
      const int64_t bytes = tally.tensors_per_param * rank_numel(handle, handle_rank) * param_element;
      tally.optimizer_per_rank[static_cast<size_t>(r)] += bytes;
      if (h.offload_to_cpu) tally.offloaded_optimizer_per_rank[static_cast<size_t>(r)] += bytes;
    }
  }
  m.sharded_grads += grad_bytes;
  m.optimizer_state += optimizer_bytes;
  const int64_t low_precision = h.compute_copy ? h.shard_numel * element_size(h.compute_dtype) : 0;
  m.low_precision_shards += low_precision;
  if (h.offload_to_cpu) m.offloaded += shard_bytes + grad_bytes + optimizer_bytes;

  // Communication per step.
  CommunicationPlan& c = result.communication;
  if (h.sharded) {
    const int64_t unencoded = h.padded_numel * element_size(h.compute_dtype);
    // Over the shard group: the encoded shards with an all-gather codec.
    const int64_t gathered =
        h.encoded_gather_bytes > 0 ? h.encoded_gather_bytes * handle.layout().world_size : unencoded;
    const int gathers = unit.reshards_after_forward ? 2 : 1;  // forward, and again in backward
    if (unit.post_forward_group_size > 0) {  // backward's inside the post-forward group, unencoded
      c.all_gather.calls += 1;
      c.all_gather.bytes += gathered;
      c.post_forward_all_gather.calls += 1;
      c.post_forward_all_gather.bytes += unencoded;
      result.unsharded_params.post_forward += unencoded / unit.post_forward_group_size;
    } else {
      c.all_gather.calls += gathers;
      c.all_gather.bytes += gathers * gathered;
    }
  }
  if (h.trainable) {
    const int64_t reduced = h.padded_numel * element_size(h.reduce_dtype);
    if (h.sharded && h.encoded_reduce_bytes > 0) {  // [Note: quantized gradient reduction]
      c.all_to_all.calls += 1;
      c.all_to_all.bytes += h.encoded_reduce_bytes * handle.layout().world_size;
    } else if (h.sharded) {
      c.reduce_scatter.calls += 1;
      c.reduce_scatter.bytes += reduced;
    } else if (config.comm->size() > 1) {
      c.all_reduce.calls += 1;
      c.all_reduce.bytes += reduced;
    }
    if (unit.replicate_group_size > 1) {
      // HSDP: the reduce-scatter's output, in the reduce dtype (float32 after a quantized
      // reduction's decode: [Note: asynchronous replicate all-reduce] in fsdp/flat_param_grad.h).
      // Passes that add a replicate partial (set_requires_all_reduce) all-reduce in the
      // parameters' dtype instead.
      const c10::ScalarType dtype = h.sharded && h.encoded_reduce_bytes > 0 ? c10::ScalarType::Float : h.reduce_dtype;
      c.all_reduce.calls += 1;
      c.all_reduce.bytes += h.shard_numel * element_size(dtype);
    }
  }
  unit.handles.push_back(std::move(h));
}

// Unsharded parameters: the root, the units kept unsharded from forward to backward, and the
// largest of the units resharded after forward that can be unsharded at once.
void plan_unsharded_params(ShardingPlan& result) {
  std::vector<int64_t> transient;
  bool prefetchable = false;
  int nesting = 0;
  for (const auto& unit : result.units) {
    const int64_t bytes = unit.unsharded_bytes();
    if (unit.is_root) {
      result.unsharded_params.root += bytes;
    } else if (!unit.reshards_after_forward) {
      result.unsharded_params.kept += bytes;
    } else if (bytes > 0) {
      transient.push_back(bytes);
      for (const auto& h : unit.handles) prefetchable |= h.sharded;
      // Its ancestors that are resharded after forward too: unsharded around it, not counted
      // against the limit.
      int ancestors = 0;
      for (const auto& other : result.units) {
        if (&other == &unit || !other.reshards_after_forward || other.unsharded_bytes() == 0) continue;
        ancestors += contains(other, unit) ? 1 : 0;
      }
      nesting = std::max(nesting, ancestors);
    }
  }
  // Units that cannot be prefetched (nothing to all-gather: one rank, a low-precision copy only)
  // are unsharded one at a time.
  const size_t at_once = static_cast<size_t>((prefetchable ? result.max_unshards_in_flight : 1) + nesting);
  result.unsharded_params.units_in_flight = static_cast<int>(std::min(at_once, transient.size()));
  result.unsharded_params.in_flight = sum_of_largest(transient, at_once);
}

// Unsharded gradients: the root's flat gradient through the whole backward, and the two largest
// other units' (one computing, one reducing), with their reduction outputs and, when reduced in
// another dtype, autograd's gradients in the compute dtype. None when every handle is a passthrough.
void plan_unsharded_grads(ShardingPlan& result) {
  std::vector<int64_t> others;
  for (const auto& unit : result.units) {
    int64_t bytes = 0;
    for (const auto& h : unit.handles) {
      if (!h.trainable) continue;
      bytes += h.padded_numel * element_size(h.reduce_dtype);
      if (h.sharded) bytes += h.shard_numel * element_size(h.reduce_dtype);
      if (h.reduce_dtype != h.compute_dtype) bytes += h.numel * element_size(h.compute_dtype);
    }
    if (unit.is_root) {
      result.unsharded_grads_bound += bytes;
    } else {
      others.push_back(bytes);
    }
  }
  result.unsharded_grads_bound += sum_of_largest(others, 2);
}

// Tied parameters (registered by several modules) and parameters no unit manages. fully_shard
// already placed every tied parameter in the innermost unit containing all modules using it
// (fsdp/tied_parameters.h): none moves at lazy initialisation, which only checks the placement
// with the same rule (use_outside_unit).
void plan_tied_and_unmanaged(torch::nn::Module& root_module, const std::vector<std::shared_ptr<FSDPState>>& states,
                             ShardingPlan& result) {
  for (const RegisteredParameter& registered : registered_parameters(root_module)) {
    const UnitPlan* owner = nullptr;
    for (size_t i = 0; i < states.size(); ++i) {
      if (states[i]->manages(registered.param)) owner = &result.units[i];
    }
    if (owner == nullptr) {
      result.unmanaged_parameters.push_back(registered.uses.front().param_fqn);
      continue;
    }
    if (registered.uses.size() < 2) continue;
    TiedParameterPlacement tied;
    tied.unit = owner->name();
    for (const auto& use : registered.uses) tied.fqns.push_back(use.param_fqn);
    if (const ParameterUse* outside = use_outside_unit(registered.uses, owner->module_fqns)) {
      tied.problem = "module '" + contract::display_fqn(outside->module_fqn) + "' uses it outside unit '" +
                     tied.unit + "': lazy initialisation will refuse the model; apply fully_shard "
                     "to a module containing every module using it";
    }
    result.tied_parameters.push_back(std::move(tied));
  }
}

// The tensor-parallel placements of the tree's parameters (one tp group: parallelize_module's).
void plan_tensor_parallel(torch::nn::Module& root_module, ShardingPlan& result) {
  auto& tp = result.tensor_parallel;
  for (const auto& param : root_module.parameters()) {
    const auto placement = tensor_placement(param);
    if (!placement) continue;
    tp.size = std::max(tp.size, placement->size());
    tp.mesh_dim = placement->mesh_dim;
    if (placement->sharded()) {
      ++tp.sharded_params;
      int64_t global = 1;
      for (int64_t d : placement->global_shape) global *= d;
      tp.global_numel += global;
      tp.local_numel += global / placement->size();
    } else {
      ++tp.whole_params;
    }
  }
}

}  // namespace

ShardingPlan plan(torch::nn::Module& root_module, const PlanOptions& options) {
  const std::shared_ptr<FSDPState> root = root_state_of(root_module);
  ShardingPlan result;
  result.options = options;
  const FSDPConfig& root_config = root->config();
  result.rank = root_config.comm->rank();
  const int shard_size = root_config.comm->size();
  result.world_size = shard_size * (root_config.replicate ? root_config.replicate->size() : 1);
  result.max_unshards_in_flight = std::max(1, root_config.options.max_unshards_in_flight());

  const std::vector<std::shared_ptr<FSDPState>> states = plan_units(root_module, result);

  // Whether every handle of the tree runs as a passthrough (one rank, nothing to gather or copy):
  // then autograd writes the parameters' gradients itself, without the FlatParameter's padding.
  HandleTally tally;
  for (const auto& state : states) {
    for (const auto& h : state->handles()) tally.passthrough &= h->passthrough();
  }
  tally.tensors_per_param = optimizer_tensors_per_param(options);
  tally.shard_size = shard_size;
  tally.optimizer_per_rank.assign(static_cast<size_t>(shard_size), 0);
  tally.offloaded_optimizer_per_rank.assign(static_cast<size_t>(shard_size), 0);
  for (size_t u = 0; u < states.size(); ++u) {
    UnitPlan& unit = result.units[u];
    plan_unit_settings(unit, *states[u], states[u] == root, result.units);
    for (const auto& handle : states[u]->handles()) {
      plan_handle_memory_and_communication(*handle, states[u]->config(), unit, tally, result);
    }
  }
  // Only the optimizer state differs between ranks (it holds no padding).
  result.max_over_ranks = result.memory;
  result.max_over_ranks.optimizer_state =
      *std::max_element(tally.optimizer_per_rank.begin(), tally.optimizer_per_rank.end());
  result.max_over_ranks.offloaded +=
      *std::max_element(tally.offloaded_optimizer_per_rank.begin(), tally.offloaded_optimizer_per_rank.end()) -
      tally.offloaded_optimizer_per_rank[static_cast<size_t>(result.rank)];

  // Each backward pass begins with the ranks agreeing where it reaches the units ([Note: backward
  // reach] in fsdp/backward_reach.h): 4 int64 per unit and 2 more, over each group of several ranks.
  if (!tally.passthrough) {
    const int64_t agreement_bytes = (4 * static_cast<int64_t>(states.size()) + 2) * 8;
    for (const int group_size : {shard_size, root_config.replicate ? root_config.replicate->size() : 1}) {
      if (group_size < 2) continue;
      result.communication.all_reduce.calls += 1;
      result.communication.all_reduce.bytes += agreement_bytes;
    }
  }
  plan_unsharded_params(result);
  if (!tally.passthrough) plan_unsharded_grads(result);
  plan_tied_and_unmanaged(root_module, states, result);
  plan_tensor_parallel(root_module, result);
  return result;
}

namespace {

// "1,234,567 B (1.18 MiB)".
std::string bytes_string(int64_t bytes) {
  std::string digits = std::to_string(bytes < 0 ? -bytes : bytes);
  std::string grouped;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) grouped += ',';
    grouped += digits[i];
  }
  std::string s = (bytes < 0 ? "-" : "") + grouped + " B";
  const double b = static_cast<double>(bytes);
  char human[32];
  if (bytes >= (int64_t{1} << 30)) {
    std::snprintf(human, sizeof(human), " (%.2f GiB)", b / (1 << 30));
    s += human;
  } else if (bytes >= (int64_t{1} << 20)) {
    std::snprintf(human, sizeof(human), " (%.2f MiB)", b / (1 << 20));
    s += human;
  } else if (bytes >= 1024) {
    std::snprintf(human, sizeof(human), " (%.1f KiB)", b / 1024);
    s += human;
  }
  return s;
}

std::string pad_right(const std::string& s, size_t width) {
  return s.size() >= width ? s : s + std::string(width - s.size(), ' ');
}

std::string optimizer_state_label(const PlanOptions& options) {
  switch (options.optimizer()) {
    case PlanOptimizer::kNone: return "optimizer state (none)";
    case PlanOptimizer::kSGD: return "optimizer state (SGD: none)";
    case PlanOptimizer::kSGDMomentum: return "optimizer state (SGD momentum_buffer)";
    case PlanOptimizer::kAdam:
    case PlanOptimizer::kAdamW:
      return std::string("optimizer state (") + to_string(options.optimizer()) + " exp_avg, exp_avg_sq" +
             (options.amsgrad() ? ", max_exp_avg_sq" : "") + ")";
  }
  return "optimizer state";
}

}  // namespace

std::ostream& operator<<(std::ostream& out, const ShardingPlan& plan) {
  std::ostringstream s;
  s << "FSDP sharding plan: " << plan.units.size() << (plan.units.size() == 1 ? " unit" : " units") << " on "
    << plan.world_size << (plan.world_size == 1 ? " rank" : " ranks") << ", seen from rank " << plan.rank
    << "; optimizer " << to_string(plan.options.optimizer()) << (plan.options.amsgrad() ? " (amsgrad)" : "")
    << "; max_unshards_in_flight " << plan.max_unshards_in_flight << "\n";
  s << "Units (nesting by indentation). Per handle: dtype, trainable or frozen, parameters, elements "
       "(numel / aligned / padded), elements per rank, bytes per rank\n";
  for (const auto& unit : plan.units) {
    const std::string indent(2 + 2 * static_cast<size_t>(unit.depth), ' ');
    s << indent << unit.name() << " (" << unit.module_class << ") " << to_string(unit.strategy);
    if (unit.replicate_group_size > 1 || unit.strategy == PlannedStrategy::kHybridShard ||
        unit.strategy == PlannedStrategy::kHybridShardZero2) {
      s << " (shard group of " << unit.shard_group_size << " x " << unit.replicate_group_size << " replicas)";
    }
    if (unit.is_root) s << ", root: unsharded from forward to the end of backward";
    if (unit.post_forward_group_size > 0) {
      s << ", resharded after forward to groups of " << unit.post_forward_group_size << " ranks";
    }
    if (unit.param_dtype || unit.reduce_dtype) {
      s << ", mixed precision: param " << (unit.param_dtype ? c10::toString(*unit.param_dtype) : "-")
        << " reduce " << (unit.reduce_dtype ? c10::toString(*unit.reduce_dtype) : unit.param_dtype ? c10::toString(*unit.param_dtype) : "-");
    }
    if (unit.offload_to_cpu) s << ", CPU offload";
    if (!unit.all_gather_codec.empty()) s << ", all-gather codec " << unit.all_gather_codec;
    if (!unit.reduce_codec.empty()) s << ", reduce codec " << unit.reduce_codec;
    s << "\n";
    if (unit.handles.empty()) s << indent << "  no parameters of its own\n";
    for (size_t i = 0; i < unit.handles.size(); ++i) {
      const HandlePlan& h = unit.handles[i];
      s << indent << "  handle " << i << ": " << c10::toString(h.dtype) << (h.trainable ? " trainable" : " frozen")
        << ", " << h.num_params << (h.num_params == 1 ? " param" : " params") << ", " << h.numel << " / "
        << h.aligned_numel << " / " << h.padded_numel << " elements, " << h.shard_numel << " per rank";
      if (h.sharded && h.rank_numel != h.shard_numel) s << " (" << h.rank_numel << " of them parameters on this rank)";
      s << " = " << bytes_string(h.shard_bytes()) << " per rank";
      if (!h.sharded) s << (unit.shard_group_size > 1 ? " (replicated)" : " (one rank: not sharded)");
      if (h.unsharded_buffer) s << "; unsharded " << bytes_string(h.unsharded_bytes());
      if (h.compute_dtype != h.dtype) s << " in " << c10::toString(h.compute_dtype);
      s << "\n";
      if (plan.options.list_parameters()) {
        for (const auto& p : h.params) s << indent << "    " << p << "\n";
      }
    }
  }
  if (plan.tensor_parallel.sharded_params + plan.tensor_parallel.whole_params > 0) {
    const auto& tp = plan.tensor_parallel;
    s << "Tensor parallel over " << tp.mesh_dim << "=" << tp.size << " (parallelize_module): " << tp.sharded_params
      << " parameters split over the group (this rank holds " << tp.local_numel << " of their " << tp.global_numel
      << " elements; every figure here counts this rank's pieces), " << tp.whole_params
      << " whole on every rank of it. Its collectives move activations (batch-dependent, not below).\n";
  }
  if (!plan.tied_parameters.empty()) {
    s << "Tied parameters (placed by fully_shard; none moves at lazy initialisation):\n";
    for (const auto& t : plan.tied_parameters) {
      s << "  ";
      for (size_t i = 0; i < t.fqns.size(); ++i) s << (i ? " = " : "") << t.fqns[i];
      s << " in unit " << t.unit;
      if (!t.problem.empty()) s << "; PROBLEM: " << t.problem;
      s << "\n";
    }
  }
  if (!plan.unmanaged_parameters.empty()) {
    s << "Parameters no unit manages (ignored, or registered after fully_shard; not sharded, not counted "
         "above):";
    for (const auto& p : plan.unmanaged_parameters) s << " " << p;
    s << "\n";
  }
  const MemoryEstimate& m = plan.memory;
  const MemoryEstimate& x = plan.max_over_ranks;
  constexpr size_t kLabel = 62;
  auto row = [&](const std::string& label, int64_t mine, int64_t most) {
    s << "  " << pad_right(label, kLabel) << bytes_string(mine);
    if (most != mine) s << "; max over ranks " << bytes_string(most);
    s << "\n";
  };
  s << "Memory per rank (rank " << plan.rank << "):\n";
  row("sharded parameters", m.sharded_params, x.sharded_params);
  row("sharded gradients", m.sharded_grads, x.sharded_grads);
  row(optimizer_state_label(plan.options), m.optimizer_state, x.optimizer_state);
  if (m.low_precision_shards > 0) row("low-precision shards", m.low_precision_shards, x.low_precision_shards);
  row("= sharded state", m.sharded_state_bytes(), x.sharded_state_bytes());
  if (m.offloaded > 0) row("  of which in host memory (CPU offload)", m.offloaded, x.offloaded);
  const UnshardedPeak& u = plan.unsharded_params;
  s << "  " << pad_right("unsharded parameters, peak", kLabel) << bytes_string(u.total()) << " = root "
    << bytes_string(u.root) << " + kept from forward to backward " << bytes_string(u.kept) << " + "
    << u.units_in_flight << " largest " << (u.units_in_flight == 1 ? "unit" : "units") << " in flight "
    << bytes_string(u.in_flight);
  if (u.post_forward > 0) s << " + post-forward slices " << bytes_string(u.post_forward);
  s << "\n";
  s << "  " << pad_right("unsharded gradients, at most", kLabel) << bytes_string(plan.unsharded_grads_bound)
    << "\n";
  if (plan.options.optimizer() == PlanOptimizer::kAdam || plan.options.optimizer() == PlanOptimizer::kAdamW) {
    s << "  (plus the step, an int64_t in each parameter's state; not tensor memory)\n";
  }
  const CommunicationPlan& c = plan.communication;
  s << "Communication per step (forward + backward with gradient sync), per rank, as counted:\n";
  auto comm_row = [&](const char* kind, const CollectivePlan& p) {
    s << "  " << pad_right(kind, 24) << p.calls << (p.calls == 1 ? " call,  " : " calls, ") << bytes_string(p.bytes)
      << "\n";
  };
  comm_row("all_gather_into_tensor", c.all_gather);
  comm_row("reduce_scatter_tensor", c.reduce_scatter);
  comm_row("all_reduce", c.all_reduce);
  if (c.all_to_all.calls > 0) comm_row("all_to_all_single", c.all_to_all);  // reduce codecs
  if (c.post_forward_all_gather.calls > 0) {
    comm_row("all_gather_into_tensor", c.post_forward_all_gather);
    s << "    (the line above: backward all-gathers inside the post-forward groups, not in the first line)\n";
  }
  return out << s.str();
}

}  // namespace fsdp
