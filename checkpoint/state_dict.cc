#include "fsdp_cpp/checkpoint/state_dict.h"

#include <unordered_map>
#include <unordered_set>

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include "fsdp_cpp/checkpoint/state_dict_support.h"
#include "fsdp_cpp/composable/tensor_placement.h"
#include "fsdp_cpp/fsdp/unit_tree.h"

namespace fsdp {

ShardedStateDict sharded_state_dict(const FSDPModule& root) {
  ShardedStateDict state;
  for (const auto& p : parameter_placements(root)) {
    state.emplace_back(p.fqn, LocalShard{p.local(), p.global_shape, p.flat_offset, p.write, p.piece()});
  }
  const bool writer = writes_replicated(root);
  for (const auto& item : root.module().named_buffers()) {
    TORCH_CHECK(item.value().is_contiguous(), "fsdp::sharded_state_dict: buffer '", item.key(),
                "' is not contiguous, so it has no 1-D view to load into");
    state.emplace_back(item.key(), LocalShard{item.value().detach().view({-1}), item.value().sizes().vec(), 0, writer});
  }
  return state;
}

void for_each_full_value(const FSDPModule& root, const FullValueSink& sink, const FullStateDictOptions& options) {
  const auto units = distinct_units_in_tree(root.module());
  // World rank 0 (with hybrid sharding, not the first rank of every shard group; with tensor
  // parallelism, rank 0 of the TP group too).
  const bool keep = !options.rank0_only() || writes_replicated(root);
  // Every FQN of each parameter (a tied one has several), in named_parameters order.
  std::unordered_map<const void*, std::vector<std::string>> fqns;
  for (const auto& item : root.module().named_parameters()) fqns[item.value().unsafeGetTensorImpl()].push_back(item.key());
  c10::NoGradGuard no_grad;
  auto emit = [&](const at::Tensor& param, at::Tensor full, bool keep) {
    if (!keep) return;
    full = options.offload_to_cpu() ? full.cpu().clone() : full.clone();
    for (const auto& fqn : fqns[param.unsafeGetTensorImpl()]) sink(fqn, full);
  };
  // A tensor-parallel parameter's global value from this rank's piece: collective over its TP
  // group, so every rank gathers (the ranks of a TP group share the model, hence the order).
  auto global_of = [](const at::Tensor& param, const at::Tensor& piece) {
    const auto placement = tensor_placement(param);
    return placement && placement->sharded() ? gather_global(piece, *placement) : piece;
  };
  std::unordered_set<const void*> done;
  for (const auto& unit : units) {
    const bool keep_unit = !options.rank0_only() || writes_replicated(root, *unit);
    for (const auto& h : unit->handles()) {
      // Full precision (the shards), even where the unsharded parameters are low-precision copies.
      // One handle's full values at a time: they are freed before the next handle is gathered.
      const at::Tensor flat = h->gather_full_precision();
      for (size_t i = 0; i < h->params().size(); ++i) {
        const auto& e = h->layout().entries[i];
        const at::Tensor& param = h->params()[i].param;
        done.insert(param.unsafeGetTensorImpl());
        emit(param, global_of(param, flat.narrow(0, e.offset, e.numel).view(e.shape)), keep_unit);
      }
    }
  }
  // Parameters in no unit (tensor-parallel ones gathered over their group), in named_parameters
  // order (the same on every rank), then the buffers.
  for (const auto& item : root.module().named_parameters()) {
    if (!done.insert(item.value().unsafeGetTensorImpl()).second) continue;
    emit(item.value(), global_of(item.value(), item.value().detach()), keep);
  }
  if (!keep) return;
  for (const auto& item : root.module().named_buffers()) {
    at::Tensor value = item.value().detach().clone();
    sink(item.key(), options.offload_to_cpu() ? value.cpu() : value);
  }
}

std::vector<FullValueSpec> full_value_specs(const FSDPModule& root) {
  return full_value_specs(root, FullStateDictOptions().rank0_only(false));
}

std::vector<FullValueSpec> full_value_specs(const FSDPModule& root, const FullStateDictOptions& options) {
  std::vector<FullValueSpec> specs;
  const bool keep = !options.rank0_only() || writes_replicated(root);
  for (const auto& p : parameter_placements(root)) {
    if (!(p.unit ? !options.rank0_only() || writes_replicated(root, *p.unit) : keep)) continue;
    const c10::ScalarType dtype = p.handle ? p.handle->local_shard().scalar_type() : p.param.scalar_type();
    specs.push_back({p.fqn, dtype, p.global_shape});
  }
  if (!keep) return specs;
  for (const auto& item : root.module().named_buffers()) {
    specs.push_back({item.key(), item.value().scalar_type(), item.value().sizes().vec()});
  }
  return specs;
}

torch::OrderedDict<std::string, at::Tensor> full_state_dict(const FSDPModule& root,
                                                            const FullStateDictOptions& options) {
  std::unordered_map<std::string, at::Tensor> values;
  for_each_full_value(root, [&](const std::string& fqn, const at::Tensor& value) { values[fqn] = value; }, options);
  torch::OrderedDict<std::string, at::Tensor> state;
  if (values.empty()) return state;
  for (const auto& item : root.module().named_parameters()) state.insert(item.key(), values.at(item.key()));
  for (const auto& item : root.module().named_buffers()) state.insert(item.key(), values.at(item.key()));
  return state;
}

void load_full_state_dict(const FSDPModule& root, const torch::OrderedDict<std::string, at::Tensor>& state,
                          const LoadFullStateDictOptions& options) {
  using state_dict_detail::ExpectedValue;
  using state_dict_detail::LoadGroup;
  const auto placements = parameter_placements(root);
  std::vector<LoadGroup> groups;
  std::vector<ExpectedValue> aliases;
  std::unordered_map<const FlatParamHandle*, size_t> group_of;
  for (const auto& p : placements) {
    ExpectedValue value{p.fqn, p.global_shape, p.param.scalar_type(), p.tp};
    if (p.alias) {
      aliases.push_back(std::move(value));
      continue;
    }
    if (p.handle == nullptr) {
      LoadGroup g;
      g.values.push_back(std::move(value));
      const at::Tensor param = p.param;
      g.sink = [param](size_t, const at::Tensor& elements) { param.detach().copy_(elements.reshape(param.sizes())); };
      groups.push_back(std::move(g));
      continue;
    }
    // The handle's dtype (full precision under mixed precision, whatever the parameter holds now).
    value.dtype = p.handle->local_shard().scalar_type();
    auto [it, inserted] = group_of.emplace(p.handle, groups.size());
    if (inserted) {
      LoadGroup g;
      g.handle = p.handle;
      g.comm = p.unit->config().comm;
      groups.push_back(std::move(g));
    }
    LoadGroup& g = groups[it->second];
    g.entries.push_back(p.entry);
    g.values.push_back(std::move(value));
  }
  // Sinks of handle groups: copy each slice into the local shard.
  for (auto& g : groups) {
    if (g.handle == nullptr) continue;
    const FlatParamHandle* handle = g.handle;
    const int shard_rank = handle->is_sharded_strategy() ? g.comm->rank() : 0;
    const std::vector<int> entries = g.entries;
    g.sink = [handle, shard_rank, entries](size_t i, const at::Tensor& elements) {
      const ShardSlice slice = handle->layout().slice_of(entries[i], shard_rank);
      handle->local_shard().narrow(0, slice.shard_offset, slice.size()).copy_(elements);
    };
  }
  for (const auto& item : root.module().named_buffers()) {
    LoadGroup g;
    g.values.push_back(ExpectedValue{item.key(), item.value().sizes().vec(), item.value().scalar_type()});
    const at::Tensor buffer = item.value();
    g.sink = [buffer](size_t, const at::Tensor& value) { buffer.detach().copy_(value.reshape(buffer.sizes())); };
    groups.push_back(std::move(g));
  }
  std::vector<std::string> key_order;
  for (const auto& p : placements) key_order.push_back(p.fqn);
  for (const auto& item : root.module().named_buffers()) key_order.push_back(item.key());
  // Refused while the parameters are in use (parameters_in_use): a unit unsharded now would keep
  // computing with the values it gathered.
  state_dict_detail::load_full_groups(root, "fsdp::load_full_state_dict", groups, aliases, state, options, key_order,
                                      nullptr, /*replaces_parameters=*/true);
}

}  // namespace fsdp
