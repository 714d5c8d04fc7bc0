#include "composable/state_dict.h"

#include <unordered_map>

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include "fsdp/unit_tree.h"

namespace fsdp {
namespace {

// Every unit of `root`'s tree, once.
std::vector<FSDPState*> units_of(const FSDPModule& root) {
  std::vector<FSDPState*> units;
  for (const auto& unit : distinct_units_in_tree(root.module())) units.push_back(unit.get());
  return units;
}

struct Place {
  const FlatParamHandle* handle;
  int index;
};

std::unordered_map<const void*, Place> places_of(const std::vector<FSDPState*>& units) {
  std::unordered_map<const void*, Place> places;
  for (FSDPState* unit : units) {
    for (const auto& h : unit->handles()) {
      for (size_t i = 0; i < h->params().size(); ++i) {
        places[h->params()[i].param.unsafeGetTensorImpl()] = {h.get(), static_cast<int>(i)};
      }
    }
  }
  return places;
}

}  // namespace

torch::OrderedDict<std::string, at::Tensor> full_state_dict(const FSDPModule& root,
                                                            const FullStateDictOptions& options) {
  const auto units = units_of(root);
  const int rank = root.state().config().comm->rank();
  const bool keep = !options.rank0_only() || rank == 0;
  std::unordered_map<const void*, at::Tensor> values;  // parameter -> full value
  c10::NoGradGuard no_grad;
  for (FSDPState* unit : units) {
    for (const auto& h : unit->handles()) {
      // Full precision (the shards), even where the unsharded parameters are low-precision copies.
      const at::Tensor flat = h->gather_full_precision();
      if (!keep) continue;
      for (size_t i = 0; i < h->params().size(); ++i) {
        const auto& e = h->layout().entries[i];
        at::Tensor full = flat.narrow(0, e.offset, e.numel).view(e.shape);
        values[h->params()[i].param.unsafeGetTensorImpl()] = options.offload_to_cpu() ? full.cpu().clone() : full.clone();
      }
    }
  }
  torch::OrderedDict<std::string, at::Tensor> state;
  if (!keep) return state;
  for (const auto& item : root.module().named_parameters()) {
    const auto it = values.find(item.value().unsafeGetTensorImpl());
    at::Tensor value = it != values.end() ? it->second : item.value().detach().clone();
    state.insert(item.key(), options.offload_to_cpu() ? value.cpu() : value);
  }
  for (const auto& item : root.module().named_buffers()) {
    at::Tensor value = item.value().detach().clone();
    state.insert(item.key(), options.offload_to_cpu() ? value.cpu() : value);
  }
  return state;
}

void load_full_state_dict(const FSDPModule& root, const torch::OrderedDict<std::string, at::Tensor>& state) {
  const auto units = units_of(root);
  const auto places = places_of(units);
  const int rank = root.state().config().comm->rank();
  const auto params = root.module().named_parameters();
  const auto buffers = root.module().named_buffers();
  // Validate everything before changing anything.
  size_t expected = 0;
  for (const auto* dict : {&params, &buffers}) {
    for (const auto& item : *dict) {
      ++expected;
      const at::Tensor* value = state.find(item.key());
      TORCH_CHECK(value != nullptr, "fsdp::load_full_state_dict: missing key '", item.key(), "'");
      const auto it = places.find(item.value().unsafeGetTensorImpl());
      const std::vector<int64_t> shape =
          it != places.end() ? it->second.handle->layout().entries[it->second.index].shape : item.value().sizes().vec();
      TORCH_CHECK(value->sizes() == at::IntArrayRef(shape), "fsdp::load_full_state_dict: '", item.key(),
                  "' has shape ", value->sizes(), " in the state dict but ", at::IntArrayRef(shape),
                  " in the model");
    }
  }
  TORCH_CHECK(state.size() == expected, "fsdp::load_full_state_dict: the state dict has ", state.size(),
              " entries, the model ", expected, " (parameters and buffers); extra keys are not loaded");
  c10::NoGradGuard no_grad;
  for (const auto& item : params) {
    const at::Tensor& value = state[item.key()];
    const auto it = places.find(item.value().unsafeGetTensorImpl());
    if (it == places.end()) {
      item.value().copy_(value);
      continue;
    }
    const auto& handle = *it->second.handle;
    const auto slice = handle.layout().slice_of(it->second.index, handle.is_sharded_strategy() ? rank : 0);
    at::Tensor shard = handle.local_shard().narrow(0, slice.shard_offset, slice.size());
    shard.copy_(value.reshape({-1}).narrow(0, slice.param_begin, slice.size()));
  }
  for (const auto& item : buffers) item.value().copy_(state[item.key()]);
  // Units unsharded now (e.g. between forward and backward) see the new values at their next unshard.
}

}  // namespace fsdp
