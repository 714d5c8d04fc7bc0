#include "fsdp/flat_param_handle.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "fsdp/storage_resize.h"

namespace fsdp {
namespace {

std::vector<FlatParamInput> layout_inputs(const std::vector<FlatParamHandle::OrigParam>& params) {
  std::vector<FlatParamInput> inputs;
  for (const auto& p : params) inputs.push_back({p.fqn, p.param.sizes().vec()});
  return inputs;
}

bool is_view_at(const at::Tensor& t, const at::Tensor& base, int64_t offset, int64_t numel) {
  if (!t.defined() || t.numel() != numel) return false;
  if (numel == 0) return true;
  return t.is_contiguous() && t.data_ptr() == static_cast<char*>(base.data_ptr()) +
                                                  offset * static_cast<int64_t>(base.element_size());
}

// A 1-D tensor over elements [offset, offset + size) of `flat`'s storage that autograd does not
// track as a view: optimizers call `grad.detach_()` in zero_grad, which views refuse.
at::Tensor storage_slice(const at::Tensor& flat, int64_t offset, int64_t size) {
  at::Tensor slice = at::empty({0}, flat.options());
  slice.set_(flat.storage(), flat.storage_offset() + offset, {size}, {1});
  return slice;
}

}  // namespace

FlatParamHandle::FlatParamHandle(std::vector<OrigParam> params,
                                 std::shared_ptr<comm::Communicator> comm, std::string unit_fqn)
    : unit_fqn_(std::move(unit_fqn)), params_(std::move(params)), comm_(std::move(comm)) {
  TORCH_CHECK(!params_.empty(), "fully_shard: FlatParamHandle of '", unit_fqn_, "' has no parameters");
  TORCH_CHECK(comm_ != nullptr, "fully_shard: FlatParamHandle of '", unit_fqn_, "' has no communicator");
  const auto dtype = params_[0].param.scalar_type();
  const auto device = params_[0].param.device();
  for (const auto& p : params_) {
    TORCH_CHECK(p.param.scalar_type() == dtype && p.param.device() == device,
                "fully_shard: one FlatParameter of '", unit_fqn_, "' needs one dtype and device; '",
                p.fqn, "' is ", p.param.scalar_type(), " on ", p.param.device(), ", '",
                params_[0].fqn, "' is ", dtype, " on ", device);
    requires_grad_ |= p.param.requires_grad();
  }
  layout_ = make_flat_param_layout(layout_inputs(params_), dtype, comm_->size());
  const auto options = at::TensorOptions().dtype(dtype).device(device);
  local_shard_ = at::zeros({layout_.shard_numel()}, options);
  padded_unsharded_ = at::empty({layout_.padded_numel}, options);
  for (int i = 0; i < static_cast<int>(params_.size()); ++i) {
    slices_.push_back(layout_.slice_of(i, comm_->rank()));
    const auto& s = slices_.back();
    if (s.size() > 0) {
      c10::NoGradGuard no_grad;
      local_shard_.narrow(0, s.shard_offset, s.size())
          .copy_(params_[i].param.detach().reshape({-1}).narrow(0, s.param_begin, s.size()));
    }
  }
  use_sharded_views();
  resize_storage(padded_unsharded_, 0);
  // Gradients the parameters already hold (a backward before fully_shard) are sharded too.
  bool any_grad = false;
  for (const auto& p : params_) any_grad |= p.param.grad().defined();
  if (any_grad) {
    sharded_grad_ = at::zeros({layout_.shard_numel()}, options);
    c10::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) {
      const at::Tensor& g = params_[i].param.grad();
      const auto& s = slices_[i];
      if (g.defined() && s.size() > 0) {
        sharded_grad_.narrow(0, s.shard_offset, s.size())
            .copy_(g.reshape({-1}).narrow(0, s.param_begin, s.size()));
      }
      params_[i].param.mutable_grad() = at::Tensor();
    }
    set_sharded_grad_views();
  }
}

void FlatParamHandle::use_sharded_views() {
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& s = slices_[i];
    params_[i].param.set_data(local_shard_.narrow(0, s.shard_offset, s.size()));
  }
}

void FlatParamHandle::use_unsharded_views() {
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& e = layout_.entries[i];
    params_[i].param.set_data(padded_unsharded_.narrow(0, e.offset, e.numel).view(e.shape));
  }
}

void FlatParamHandle::write_back_replaced_data() {
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& s = slices_[i];
    const at::Tensor& p = params_[i].param;
    if (is_view_at(p, local_shard_, s.shard_offset, s.size())) continue;
    TORCH_CHECK(p.dim() == 1 && p.numel() == s.size(), "fully_shard: parameter '", params_[i].fqn, "' of unit '",
                unit_fqn_, "' was replaced while sharded by a tensor of shape ", p.sizes(),
                "; expected this rank's shard of it, a 1-D tensor of ", s.size(),
                " elements (modify parameters in place, or replace them with tensors of their "
                "sharded shape)");
    c10::NoGradGuard no_grad;
    local_shard_.narrow(0, s.shard_offset, s.size()).copy_(p.detach().reshape({-1}));
    params_[i].param.set_data(local_shard_.narrow(0, s.shard_offset, s.size()));
  }
}

void FlatParamHandle::start_unshard() {
  if (unsharded_ || pending_unshard_.valid()) return;
  write_back_replaced_data();
  resize_storage(padded_unsharded_, layout_.padded_numel * padded_unsharded_.element_size());
  pending_unshard_ = comm_->all_gather_into_tensor(padded_unsharded_, local_shard_, unit_fqn_);
}

void FlatParamHandle::unshard() {
  if (unsharded_) return;
  start_unshard();
  pending_unshard_.wait();
  pending_unshard_ = {};
  use_unsharded_views();
  unsharded_ = true;
}

void FlatParamHandle::reshard() {
  if (!unsharded_ && !pending_unshard_.valid()) return;
  if (pending_unshard_.valid()) {  // never free a buffer a collective still writes into
    pending_unshard_.wait();
    pending_unshard_ = {};
  }
  use_sharded_views();
  resize_storage(padded_unsharded_, 0);
  unsharded_ = false;
}

size_t FlatParamHandle::unsharded_bytes() const { return storage_nbytes(padded_unsharded_); }

void FlatParamHandle::prepare_gradients_for_backward() {
  if (grads_prepared_ || !requires_grad_) return;
  grads_prepared_ = true;
  bool all_ours = true;
  bool any = false;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& g = params_[i].param.grad();
    if (!g.defined()) {
      all_ours = false;
      continue;
    }
    any = true;
    all_ours &= sharded_grad_.defined() &&
                is_view_at(g, sharded_grad_, slices_[i].shard_offset, slices_[i].size());
  }
  if (!any) {
    saved_grad_ = at::Tensor();
  } else if (all_ours) {
    saved_grad_ = sharded_grad_;
  } else {
    // Some gradients are missing (zeros) or were replaced by the user (written back).
    saved_grad_ = at::zeros({layout_.shard_numel()}, local_shard_.options());
    c10::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) {
      const at::Tensor& g = params_[i].param.grad();
      if (!g.defined()) continue;
      const auto& s = slices_[i];
      TORCH_CHECK(g.dim() == 1 && g.numel() == s.size(), "fully_shard: the gradient of '", params_[i].fqn,
                  "' in unit '", unit_fqn_, "' has shape ", g.sizes(),
                  " while sharded; expected this rank's shard of it, a 1-D tensor of ", s.size(),
                  " elements");
      saved_grad_.narrow(0, s.shard_offset, s.size()).copy_(g.reshape({-1}));
    }
  }
  for (auto& p : params_) p.param.mutable_grad() = at::Tensor();
  sharded_grad_ = at::Tensor();
}

void FlatParamHandle::reduce_gradients() {
  if (!requires_grad_) return;
  finalize_gradients();  // one reduce-scatter in flight per handle
  at::Tensor flat = at::zeros({layout_.padded_numel}, local_shard_.options());
  {
    c10::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) {
      at::Tensor& g = params_[i].param.mutable_grad();
      if (!g.defined()) continue;
      const auto& e = layout_.entries[i];
      TORCH_CHECK(g.numel() == e.numel, "fully_shard: the gradient of '", params_[i].fqn,
                  "' in unit '", unit_fqn_, "' has ", g.numel(),
                  " elements after backward; expected the full parameter's ", e.numel);
      flat.narrow(0, e.offset, e.numel).copy_(g.reshape({-1}));
      g = at::Tensor();  // the unsharded gradient is not kept
    }
  }
  reduce_input_ = flat;
  reduce_output_ = at::empty({layout_.shard_numel()}, local_shard_.options());
  pending_reduce_ = comm_->reduce_scatter_tensor(reduce_output_, reduce_input_,
                                                 c10d::ReduceOp::SUM, unit_fqn_);
}

void FlatParamHandle::finalize_gradients() {
  if (!pending_reduce_.valid()) return;
  pending_reduce_.wait();
  pending_reduce_ = {};
  reduce_input_ = at::Tensor();
  c10::NoGradGuard no_grad;
  reduce_output_.div_(comm_->size());
  if (saved_grad_.defined()) reduce_output_.add_(saved_grad_);
  sharded_grad_ = reduce_output_;
  reduce_output_ = at::Tensor();
  saved_grad_ = at::Tensor();
  grads_prepared_ = false;
  set_sharded_grad_views();
}

void FlatParamHandle::set_sharded_grad_views() {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].param.requires_grad()) continue;
    params_[i].param.mutable_grad() = storage_slice(sharded_grad_, slices_[i].shard_offset, slices_[i].size());
  }
}

}  // namespace fsdp
