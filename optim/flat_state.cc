#include "fsdp_cpp/optim/flat_state.h"

#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

namespace fsdp::optim {
namespace {

// Whether `slot` is the view of one buffer spanning `run` at member i's place (see flat_state).
bool is_member_view(const at::Tensor& slot, const at::Tensor& buffer_holder, const at::Tensor& param, int64_t offset,
                    c10::ScalarType dtype) {
  return slot.defined() && slot.has_storage() &&
         slot.storage().unsafeGetStorageImpl() == buffer_holder.storage().unsafeGetStorageImpl() &&
         slot.storage_offset() == offset && slot.sizes() == param.sizes() && slot.is_contiguous() &&
         slot.scalar_type() == dtype;
}

}  // namespace

at::Tensor flat_state(const ParamRun& run, const std::vector<at::Tensor>& params,
                      const std::vector<at::Tensor*>& slots, int64_t& adopted,
                      std::optional<c10::ScalarType> dtype) {
  const at::Tensor& first_param = params[run.members.front()];
  const c10::ScalarType state_dtype = dtype.value_or(first_param.scalar_type());
  const at::Tensor& first = *slots.front();
  bool reuse = first.defined() && first.has_storage() && first.device() == first_param.device() &&
               first.storage().nbytes() == static_cast<size_t>(run.numel) * c10::elementSize(state_dtype);
  for (size_t i = 0; reuse && i < slots.size(); ++i) {
    reuse = is_member_view(*slots[i], first, params[run.members[i]], run.offsets[i], state_dtype);
  }
  if (reuse) return storage_view(first, 0, {run.numel});

  at::Tensor buffer = at::zeros({run.numel}, first_param.options().dtype(state_dtype));
  for (size_t i = 0; i < slots.size(); ++i) {
    const at::Tensor& p = params[run.members[i]];
    at::Tensor view = storage_view(buffer, run.offsets[i], p.sizes());
    at::Tensor& slot = *slots[i];
    if (slot.defined()) {
      TORCH_CHECK(slot.numel() == p.numel(), "fsdp::optim: a state tensor of a parameter of shape ", p.sizes(),
                  " has shape ", slot.sizes(), "; expected the parameter's (was the state loaded for another model?)");
      view.copy_(slot.reshape(p.sizes()));
    }
    slot = view;
  }
  ++adopted;
  return buffer;
}

}  // namespace fsdp::optim
