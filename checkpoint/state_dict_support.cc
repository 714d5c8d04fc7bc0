#include "fsdp_cpp/checkpoint/state_dict_support.h"

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include "fsdp_cpp/comm/agreement.h"
#include "fsdp_cpp/composable/fully_shard_internal.h"
#include "fsdp_cpp/contract/module_state.h"
#include "fsdp_cpp/contract/shape_text.h"
#include "fsdp_cpp/fsdp/root_context.h"
#include "fsdp_cpp/fsdp/unit_tree.h"

namespace fsdp {
namespace {

using Dict = torch::OrderedDict<std::string, at::Tensor>;

// Every unit of `root`'s tree, once.
std::vector<FSDPState*> units_of(const FSDPModule& root) {
  std::vector<FSDPState*> units;
  for (const auto& unit : distinct_units_in_tree(root.module())) units.push_back(unit.get());
  return units;
}

struct Place {
  const FSDPState* unit;
  const FlatParamHandle* handle;
  int index;
};

std::unordered_map<const void*, Place> places_of(const std::vector<FSDPState*>& units) {
  std::unordered_map<const void*, Place> places;
  for (FSDPState* unit : units) {
    for (const auto& h : unit->handles()) {
      for (size_t i = 0; i < h->params().size(); ++i) {
        places[h->params()[i].param.unsafeGetTensorImpl()] = {unit, h.get(), static_cast<int>(i)};
      }
    }
  }
  return places;
}


// The root's communicator and, with hybrid sharding, its replicate group: together the
// data-parallel world; with tensor parallelism also the TP group: together the world.
struct WorldGroups {
  std::shared_ptr<comm::Communicator> shard;
  std::shared_ptr<comm::Communicator> replicate;  // null without hybrid sharding
  std::shared_ptr<comm::Communicator> tp;         // null without tensor parallelism (or on one rank)

  explicit WorldGroups(const FSDPModule& root)
      : shard(detail::state_of(root).config().comm),
        replicate(detail::state_of(root).config().replicate),
        tp(tensor_parallel_group(root.module())) {}
  /// The rank in the data-parallel world (0: the source of broadcasts within it).
  int dp_rank() const { return shard->rank() + (replicate ? replicate->rank() * shard->size() : 0); }
  int dp_size() const { return shard->size() * (replicate ? replicate->size() : 1); }
  int world_rank() const { return dp_rank() * (tp ? tp->size() : 1) + (tp ? tp->rank() : 0); }
  int world_size() const { return dp_size() * (tp ? tp->size() : 1); }
  at::Device device() const { return shard->device(); }

  void all_reduce_max(at::Tensor& t) const {
    shard->all_reduce(t, c10d::ReduceOp::MAX, "state_dict").wait();
    if (replicate) replicate->all_reduce(t, c10d::ReduceOp::MAX, "state_dict").wait();
    if (tp) tp->all_reduce(t, c10d::ReduceOp::MAX, "state_dict").wait();
  }
  // Data-parallel rank 0 -> the first rank of every shard group -> every rank of the dp world.
  void broadcast_over_dp(at::Tensor& t) const {
    if (replicate && shard->rank() == 0) replicate->broadcast(t, 0, "state_dict").wait();
    shard->broadcast(t, 0, "state_dict").wait();
  }
  // Over the TP group of data-parallel rank 0 (the ranks with dp_rank() == 0): from world rank 0.
  void broadcast_over_tp_of_dp_rank0(at::Tensor& t) const {
    if (tp && dp_rank() == 0) tp->broadcast(t, 0, "state_dict").wait();
  }
};

// This rank's piece of a global value (the value itself without tensor parallelism).
at::Tensor piece_of(const state_dict_detail::ExpectedValue& v, const at::Tensor& value) {
  if (!v.tp) return value;
  return v.tp->local_piece(value, v.tp->group->rank());
}

// Every rank learns whether any rank failed, and one failing rank's message (the lowest world
// rank's, naming the others: comm::agree_on_error over the shard, replicate and tp groups, which
// together span the world). Returns the message without the API and rank label agree_on_error
// puts before it (the messages name their rank themselves), "" when no rank failed.
std::string agreed_load_error(const WorldGroups& world, const std::string& local_error, const std::string& api) {
  const auto agreed = comm::agree_on_error({world.shard, world.replicate, world.tp},
                                           local_error.empty() ? std::nullopt : std::optional<std::string>(local_error),
                                           api);
  if (!agreed) return {};
  // "<api>: <rank label>: <message>": the label ("rank R", "group rank R") holds no ": ".
  const std::string prefix = api + ": ";
  if (agreed->compare(0, prefix.size(), prefix) != 0) return *agreed;
  const size_t label_end = agreed->find(": ", prefix.size());
  return label_end == std::string::npos ? agreed->substr(prefix.size()) : agreed->substr(label_end + 2);
}

// An exact, position-sensitive checksum of a tensor's bytes (integer arithmetic: the same on
// every rank whatever the reduction order), as a 0-d int64 tensor on `device`. Chunked, so that it
// needs little memory beyond the value itself.
at::Tensor checksum(const at::Tensor& value, at::Device device) {
  const auto longs = at::TensorOptions().dtype(at::kLong).device(device);
  at::Tensor total = at::zeros({}, longs);
  at::Tensor flat = value.detach().to(device).contiguous().view({-1});
  if (flat.numel() == 0) return total;
  c10::ScalarType bits = at::kLong;
  switch (flat.element_size()) {
    case 1: bits = at::kChar; break;
    case 2: bits = at::kShort; break;
    case 4: bits = at::kInt; break;
    default: bits = at::kLong; break;  // 8 bytes; 16-byte complex values become two words each
  }
  const at::Tensor words = flat.view(bits);
  constexpr int64_t kChunk = int64_t{1} << 20;
  const at::Tensor weights = at::arange(std::min(kChunk, words.numel()), longs).remainder_(251).add_(1);
  for (int64_t start = 0; start < words.numel(); start += kChunk) {
    const int64_t n = std::min(kChunk, words.numel() - start);
    // A copy, never the input: the products are computed in place.
    at::Tensor part = words.narrow(0, start, n).to(at::kLong, /*non_blocking=*/false, /*copy=*/true);
    total.add_(part.mul_(weights.narrow(0, 0, n)).sum());
  }
  return total;
}

std::string join_keys(const std::vector<std::string>& keys) {
  std::string out;
  for (size_t i = 0; i < keys.size(); ++i) out += (i ? ", '" : "'") + keys[i] + "'";
  return out;
}

// Problems of `state` against the expected values, all in one message ("" when none).
std::string validate(const std::vector<const state_dict_detail::ExpectedValue*>& expected, const Dict& state,
                     bool convert_dtype) {
  std::vector<std::string> missing, unexpected, problems;
  std::unordered_set<std::string> known;
  for (const auto* e : expected) {
    known.insert(e->key);
    const at::Tensor* value = state.find(e->key);
    if (value == nullptr) {
      missing.push_back(e->key);
      continue;
    }
    if (!value->defined()) {
      problems.push_back("'" + e->key + "' is an undefined tensor");
      continue;
    }
    if (value->sizes() != at::IntArrayRef(e->shape)) {
      problems.push_back("'" + e->key + "' has shape " + contract::shape_string(value->sizes()) + " in the state dict but " +
                         contract::shape_string(e->shape) + " in the model");
    }
    if (!convert_dtype && value->scalar_type() != e->dtype) {
      problems.push_back("'" + e->key + "' has dtype " + std::string(c10::toString(value->scalar_type())) +
                         " in the state dict but " + c10::toString(e->dtype) +
                         " in the model (LoadFullStateDictOptions().convert_dtype(true) converts it)");
    }
  }
  for (const auto& item : state) {
    if (!known.count(item.key())) unexpected.push_back(item.key());
  }
  std::string message;
  auto add = [&](const std::string& part) { message += (message.empty() ? "" : "; ") + part; };
  if (!missing.empty()) {
    add("missing " + std::to_string(missing.size()) + (missing.size() == 1 ? " key " : " keys ") + join_keys(missing));
  }
  if (!unexpected.empty()) {
    add("unexpected " + std::to_string(unexpected.size()) + (unexpected.size() == 1 ? " key " : " keys ") +
        join_keys(unexpected) + " (not in the model)");
  }
  for (const auto& p : problems) add(p);
  if (!message.empty() && state.is_empty()) {
    message += " (the dict is empty: a dict on rank 0 only, like full_state_dict's default, loads with "
               "LoadFullStateDictOptions().broadcast_from_rank0(true))";
  }
  return message;
}

}  // namespace

std::shared_ptr<comm::Communicator> tensor_parallel_group(const torch::nn::Module& module) {
  for (const auto& item : module.named_parameters()) {
    const auto placement = tensor_placement(item.value());
    if (placement && placement->group && placement->size() > 1) return placement->group;
  }
  return nullptr;
}

bool tensor_parallel_rank0(const torch::nn::Module& module) {
  for (const auto& item : module.named_parameters()) {
    const auto placement = tensor_placement(item.value());
    if (placement && placement->group && placement->group->rank() != 0) return false;
  }
  return true;
}

bool writes_replicated(const FSDPModule& root) {
  return WorldGroups(root).dp_rank() == 0 && tensor_parallel_rank0(root.module());
}

bool writes_replicated(const FSDPModule& root, const FSDPState& unit) {
  const auto& own = unit.config().comm;
  if (!own || own == detail::state_of(root).config().comm) return writes_replicated(root);
  const auto& replicate = unit.config().replicate;
  return own->rank() == 0 && (!replicate || replicate->rank() == 0) && tensor_parallel_rank0(root.module());
}

std::optional<TensorPiece> ParameterPlacement::piece() const {
  if (!tp) return std::nullopt;
  return TensorPiece{tp->dim, tp->global_ranges(tp->group->rank())};
}

std::string parameters_in_use(const FSDPModule& root) {
  const auto units = units_of(root);
  auto& registry = contract::ModuleStateRegistry::global();
  for (FSDPState* unit : units) {
    const RootContext* context = unit->root_context();
    if (context == nullptr) continue;
    bool graph_alive = false;
    for (const FSDPState* u : context->states()) graph_alive |= u->iteration().may_get_gradients();
    const char* phase = nullptr;
    if (context->iteration_state().in_root_forward()) {
      phase = "a forward of its root is running";
    } else if (context->iteration_state().phase() == IterationPhase::kBackward) {
      phase = "a backward is running";
    } else if (context->iteration_state().phase() == IterationPhase::kForward && graph_alive) {
      phase = "a forward ran and its backward has not";
    }
    if (phase != nullptr) {
      return "the model's parameters are in use: " + std::string(phase) + " (unit " + registry.describe(unit->module()) +
             "); units unsharded now would keep computing with the values they gathered. Expected a call "
             "outside forward and backward: before the forward or after its backward (or after a forward "
             "under torch::NoGradGuard)";
    }
  }
  for (FSDPState* unit : units) {
    if (unit->full_params_summoned()) {
      return "a SummonFullParams scope holds the full parameters of unit " + registry.describe(unit->module()) +
             " (its writeback would overwrite the values loaded); leave the scope first";
    }
    bool unsharded = unit->unshard_in_flight();
    for (const auto& h : unit->handles()) unsharded |= h->is_sharded_strategy() && h->is_unsharded();
    if (unsharded) {
      return "unit " + registry.describe(unit->module()) +
             " is unsharded (by FSDPModule::unshard(), set_reshard_after_backward(false), or a forward whose "
             "backward never ran), so it would keep computing with the values it gathered; expected every "
             "unit resharded: call reshard() on it first";
    }
  }
  return "";
}

at::Tensor ParameterPlacement::local() const {
  if (handle != nullptr) return handle->local_shard().narrow(0, slice.shard_offset, slice.size());
  TORCH_CHECK(param.is_contiguous(), "fsdp::sharded_state_dict: parameter '", fqn,
              "' (in no fully_shard unit) is not contiguous, so it has no 1-D view to load into");
  return param.detach().view({-1});
}

std::vector<ParameterPlacement> parameter_placements(const FSDPModule& root) {
  const auto places = places_of(units_of(root));
  const bool replicated_writer = writes_replicated(root);
  const bool tp_rank0 = tensor_parallel_rank0(root.module());
  std::unordered_set<const void*> seen;
  std::vector<ParameterPlacement> placements;
  for (const auto& item : root.module().named_parameters()) {
    ParameterPlacement p;
    p.fqn = item.key();
    p.param = item.value();
    p.alias = !seen.insert(p.param.unsafeGetTensorImpl()).second;
    const auto it = places.find(p.param.unsafeGetTensorImpl());
    if (it == places.end()) {
      p.piece_shape = p.param.sizes().vec();
      p.local_numel = p.param.numel();
      p.slice.param_end = p.local_numel;
      p.write = replicated_writer;
    } else {
      const Place& place = it->second;
      const auto& config = place.unit->config();
      p.handle = place.handle;
      p.unit = place.unit;
      p.entry = place.index;
      p.sliced = place.handle->is_sharded_strategy();
      p.slice = place.handle->layout().slice_of(place.index, p.sliced ? config.comm->rank() : 0);
      p.piece_shape = place.handle->layout().entries[place.index].shape;
      p.flat_offset = p.slice.param_begin;
      p.local_numel = p.slice.size();
      const bool first_replica = !config.replicate || config.replicate->rank() == 0;
      // Values the TP group holds whole (everything but its sharded parameters): its rank 0 writes.
      p.write = p.sliced ? first_replica : first_replica && config.comm->rank() == 0;
    }
    p.global_shape = p.piece_shape;
    if (auto placement = tensor_placement(p.param); placement && placement->sharded()) {
      TORCH_CHECK(placement->local_shape() == p.piece_shape, "fsdp state dicts: tensor-parallel parameter '", p.fqn,
                  "' (", placement->describe(), ") should hold a piece of shape ",
                  contract::shape_string(placement->local_shape()), " but holds ",
                  contract::shape_string(p.piece_shape));
      p.global_shape = placement->global_shape;
      p.tp = std::move(placement);
    } else if (p.handle != nullptr && !tp_rank0) {
      p.write = false;
    }
    placements.push_back(std::move(p));
  }
  return placements;
}

namespace state_dict_detail {

void load_full_groups(const FSDPModule& root, const std::string& api, const std::vector<LoadGroup>& groups,
                      const std::vector<ExpectedValue>& also_expected, const Dict& state,
                      const LoadFullStateDictOptions& options, const std::vector<std::string>& key_order,
                      const std::function<std::string(const Dict&)>& extra_check, bool replaces_parameters) {
  const WorldGroups world(root);
  const bool rank0 = world.world_rank() == 0;
  const bool dp_rank0 = world.dp_rank() == 0;  // the TP group of world rank 0
  const bool from_rank0 = options.broadcast_from_rank0();
  std::vector<const ExpectedValue*> expected;
  for (const auto& g : groups) {
    for (const auto& v : g.values) expected.push_back(&v);
  }
  for (const auto& v : also_expected) expected.push_back(&v);

  // 1. Every rank (rank 0 only, when loading from it) checks its dict; all agree on the outcome.
  std::string error;
  if (replaces_parameters) {
    // On every rank, also with broadcast_from_rank0: each rank's engine state is its own.
    const std::string busy = parameters_in_use(root);
    if (!busy.empty()) error = "on rank " + std::to_string(world.world_rank()) + ", " + busy;
  }
  if (error.empty() && (!from_rank0 || rank0)) {
    error = validate(expected, state, options.convert_dtype());
    if (error.empty() && extra_check) error = extra_check(state);
    if (!error.empty()) error = "the state dict of rank " + std::to_string(world.world_rank()) + " is not loadable: " + error;
  }
  const std::string agreed = agreed_load_error(world, error, api);
  TORCH_CHECK(agreed.empty(), api, ": ", agreed, ". Nothing was loaded on any rank");

  // 2. Every rank must have passed the same values.
  if (!from_rank0 && options.check_ranks_agree() && world.world_size() > 1) {
    // In the model's key order (the same on every rank, whatever the order of each rank's dict).
    std::vector<at::Tensor> sums;
    for (const auto& key : key_order) sums.push_back(checksum(*state.find(key), world.device()));
    const std::vector<std::string>& keys = key_order;
    if (!sums.empty()) {
      at::Tensor s = at::stack(sums);
      at::Tensor both = at::cat({s, s.neg()});
      world.all_reduce_max(both);
      const int64_t n = static_cast<int64_t>(sums.size());
      at::Tensor differs = both.narrow(0, 0, n).ne(both.narrow(0, n, n).neg()).cpu();
      for (int64_t i = 0; i < n; ++i) {
        TORCH_CHECK(!differs[i].item<bool>(), api, ": the ranks passed different values for '", keys[i],
                    "' (each rank must pass the same full state dict; to load one rank's dict, pass it on rank 0 "
                    "with LoadFullStateDictOptions().broadcast_from_rank0(true)). Nothing was loaded on any rank");
      }
    }
  }

  // 3. Load, one group at a time. With tensor parallelism each value reaches the TP group of world
  // rank 0 whole, each rank of it takes its piece, and the pieces travel over the dp world.
  c10::NoGradGuard no_grad;
  const auto on_device = at::TensorOptions().device(world.device());
  // World rank 0's value of `v` on every rank of its TP group (the others get an undefined tensor).
  auto value_on_tp_of_rank0 = [&](const ExpectedValue& v) -> at::Tensor {
    if (!dp_rank0) return {};
    at::Tensor value = rank0 ? state.find(v.key)->to(world.device(), v.dtype).contiguous().clone()
                             : at::empty(v.shape, on_device.dtype(v.dtype));
    if (value.numel() > 0) world.broadcast_over_tp_of_dp_rank0(value);
    return value;
  };
  for (const auto& g : groups) {
    if (g.handle != nullptr) {
      const FlatParamLayout& layout = g.handle->layout();
      const int shard_rank = g.handle->is_sharded_strategy() ? g.comm->rank() : 0;
      at::Tensor flat;
      if (from_rank0) {
        flat = at::zeros({layout.padded_numel}, on_device.dtype(g.values.front().dtype));
        if (dp_rank0) {
          for (size_t i = 0; i < g.values.size(); ++i) {
            const auto& e = layout.entries[g.entries[i]];
            const at::Tensor value = piece_of(g.values[i], value_on_tp_of_rank0(g.values[i]));
            flat.narrow(0, e.offset, e.numel).copy_(value.reshape({-1}));
          }
        }
        world.broadcast_over_dp(flat);
      }
      for (size_t i = 0; i < g.values.size(); ++i) {
        const ShardSlice slice = layout.slice_of(g.entries[i], shard_rank);
        if (from_rank0) {
          g.sink(i, flat.narrow(0, layout.entries[g.entries[i]].offset + slice.param_begin, slice.size()));
        } else {
          const at::Tensor value = piece_of(g.values[i], *state.find(g.values[i].key));
          g.sink(i, value.reshape({-1}).narrow(0, slice.param_begin, slice.size()).to(g.values[i].dtype));
        }
      }
    } else {
      const ExpectedValue& v = g.values.front();
      if (from_rank0) {
        at::Tensor value = dp_rank0 ? value_on_tp_of_rank0(v) : at::empty(v.shape, on_device.dtype(v.dtype));
        if (value.numel() > 0) world.broadcast_over_dp(value);
        g.sink(0, piece_of(v, value));
      } else {
        g.sink(0, piece_of(v, *state.find(v.key)).to(v.dtype));
      }
    }
  }
}

}  // namespace state_dict_detail

}  // namespace fsdp
