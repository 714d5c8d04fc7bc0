#include "fsdp_cpp/fsdp/flat_param_storage.h"

#include <optional>

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "fsdp_cpp/contract/shape_text.h"
#include "fsdp_cpp/fsdp/storage_resize.h"
#include "fsdp_cpp/init/meta_init.h"

namespace fsdp {
namespace {

std::vector<FlatParamInput> layout_inputs(const std::vector<FlatParamStorage::OrigParam>& params) {
  std::vector<FlatParamInput> inputs;
  for (const auto& p : params) inputs.push_back({p.fqn, p.param.sizes().vec()});
  return inputs;
}

}  // namespace

bool FlatParamStorage::is_view_at(const at::Tensor& t, const at::Tensor& base, int64_t offset,
                                  const std::vector<int64_t>& shape) {
  if (!t.defined() || t.sizes() != at::IntArrayRef(shape)) return false;
  if (t.numel() == 0) return true;
  return t.is_contiguous() && t.data_ptr() == static_cast<char*>(base.data_ptr()) +
                                                  offset * static_cast<int64_t>(base.element_size());
}

at::Tensor FlatParamStorage::storage_slice(const at::Tensor& flat, int64_t offset,
                                           const std::vector<int64_t>& shape) {
  at::Tensor slice = at::empty({0}, flat.options());
  std::vector<int64_t> strides(shape.size(), 1);
  for (int64_t d = static_cast<int64_t>(shape.size()) - 2; d >= 0; --d) {
    strides[d] = strides[d + 1] * shape[d + 1];
  }
  slice.set_(flat.storage(), flat.storage_offset() + offset, shape, strides);
  return slice;
}

FlatParamStorage::FlatParamStorage(std::vector<OrigParam> params,
                                   const std::shared_ptr<comm::Communicator>& comm,
                                   std::string unit_fqn, const FlatParamHandleOptions& options)
    : unit_fqn_(std::move(unit_fqn)), params_(std::move(params)),
      offload_to_cpu_(options.offload_to_cpu) {
  TORCH_CHECK(!params_.empty(), "fully_shard: FlatParamHandle of '", unit_fqn_, "' has no parameters");
  TORCH_CHECK(comm != nullptr, "fully_shard: FlatParamHandle of '", unit_fqn_, "' has no communicator");
  const auto dtype = params_[0].param.scalar_type();
  // Meta parameters have no device of their own: they are materialized where the shard lives.
  std::optional<at::Device> real_device;
  for (const auto& p : params_) {
    if (!p.param.is_meta() && !real_device) real_device = p.param.device();
    TORCH_CHECK(!p.param.is_meta() || options.meta_values, "fully_shard: parameter '", p.fqn, "' of '",
                unit_fqn_, "' is on the meta device but no way to initialize it was given");
  }
  const auto device = real_device.value_or(options.device.value_or(at::Device(at::kCPU)));
  requires_grad_ = params_[0].param.requires_grad();
  for (const auto& p : params_) {
    TORCH_CHECK(p.param.scalar_type() == dtype && (p.param.is_meta() || p.param.device() == device) &&
                    p.param.requires_grad() == requires_grad_,
                "fully_shard: one FlatParameter of '", unit_fqn_,
                "' needs one dtype, device and requires_grad; '", p.fqn, "' is ",
                p.param.scalar_type(), " on ", p.param.device(), " (requires_grad ",
                p.param.requires_grad(), "), '", params_[0].fqn, "' is ", dtype, " on ", device,
                " (requires_grad ", requires_grad_, ")");
  }
  // One rank has nothing to communicate or free: it runs as NO_SHARD (the shard is the whole
  // FlatParameter, parameters are always full-shape views of it, no collective is issued).
  shard_ = options.shard && comm->size() > 1;
  const int world = shard_ ? comm->size() : 1;
  const int rank = shard_ ? comm->rank() : 0;
  compute_dtype_ = options.param_dtype.value_or(dtype);
  // The reduce dtype is FlatParamGrad's; it is checked here, with the compute dtype, before
  // anything is allocated or any parameter changes.
  const c10::ScalarType reduce_dtype = options.reduce_dtype.value_or(compute_dtype_);
  mixed_precision_ = compute_dtype_ != dtype;
  TORCH_CHECK(at::isFloatingType(compute_dtype_) && at::isFloatingType(reduce_dtype),
              "fully_shard: mixed precision of '", unit_fqn_, "' needs floating-point dtypes, got "
              "param_dtype ", compute_dtype_, " and reduce_dtype ", reduce_dtype);
  // Alignment in the compute dtype, so the all-gathered buffer's views start on 16-byte boundaries.
  layout_ = make_flat_param_layout(layout_inputs(params_), mixed_precision_ ? compute_dtype_ : dtype, world);
  layout_.dtype = dtype;
  compute_device_ = options.device.value_or(device);
  const at::Device shard_device = offload_to_cpu_ ? at::Device(at::kCPU) : compute_device_;
  const auto tensor_options = at::TensorOptions().dtype(dtype).device(shard_device);
  local_shard_ = at::zeros({layout_.shard_numel()}, tensor_options);
  if (offload_to_cpu_ && compute_device_.is_cuda()) local_shard_ = local_shard_.pin_memory();
  if (mixed_precision_ || shard_device != compute_device_) {
    compute_shard_ = at::empty({layout_.shard_numel()}, tensor_options.dtype(compute_dtype_).device(compute_device_));
  }
  // The unsharded buffer has its full size but no memory until the first unshard (the storage is
  // grown there, fsdp/storage_resize.h): building the handle holds the shard only.
  padded_unsharded_ = at::empty({0}, tensor_options.dtype(compute_dtype_).device(compute_device_));
  padded_unsharded_.unsafeGetTensorImpl()->set_sizes_contiguous({needs_unsharded_buffer() ? layout_.padded_numel : 0});
  initial_grads_.resize(params_.size());
  for (int i = 0; i < static_cast<int>(params_.size()); ++i) {
    slices_.push_back(layout_.slice_of(i, rank));
    const auto& s = slices_.back();
    initial_grads_[i] = params_[i].param.grad();
    const bool meta = params_[i].param.is_meta();
    if (s.size() > 0) {
      c10::NoGradGuard no_grad;
      const at::Tensor values = meta ? options.meta_values(params_[i].fqn, params_[i].param) : params_[i].param.detach();
      local_shard_.narrow(0, s.shard_offset, s.size()).copy_(values.reshape({-1}).narrow(0, s.param_begin, s.size()));
    }
    if (meta) adopt_values(params_[i].param, local_shard_.narrow(0, s.shard_offset, s.size()).view(sharded_shape(i)));
    params_[i].param.mutable_grad() = at::Tensor();
  }
  use_sharded_views();
  resize_storage(padded_unsharded_, 0);
}

std::vector<int64_t> FlatParamStorage::sharded_shape(size_t i) const {
  if (!shard_) return layout_.entries[i].shape;
  return {slices_[i].size()};
}

void FlatParamStorage::use_sharded_views() {
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& s = slices_[i];
    params_[i].param.set_data(local_shard_.narrow(0, s.shard_offset, s.size()).view(sharded_shape(i)));
  }
  unsharded_ = false;
}

void FlatParamStorage::use_unsharded_views() {
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& e = layout_.entries[i];
    params_[i].param.set_data(padded_unsharded_.narrow(0, e.offset, e.numel).view(e.shape));
  }
  unsharded_ = true;
}

void FlatParamStorage::use_unsharded_views_without_data() {
  c10::Storage storage = padded_unsharded_.storage();
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& e = layout_.entries[i];
    at::Tensor view = at::empty({0}, padded_unsharded_.options());
    c10::TensorImpl* impl = view.unsafeGetTensorImpl();
    impl->set_storage_keep_dtype(storage);
    impl->set_sizes_contiguous(e.shape);
    impl->set_storage_offset(padded_unsharded_.storage_offset() + e.offset);
    params_[i].param.set_data(view);
  }
  unsharded_ = true;
}

void FlatParamStorage::check_params_unchanged() const {
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i].param;
    TORCH_CHECK(p.requires_grad() == requires_grad_, "fully_shard: requires_grad of parameter '",
                params_[i].fqn, "' in unit '", unit_fqn_, "' changed from ", requires_grad_, " to ",
                p.requires_grad(),
                " after fully_shard. Set requires_grad before fully_shard: trainable and frozen "
                "parameters are kept in separate FlatParameters.");
    if (!unsharded_) continue;
    const auto& e = layout_.entries[i];
    TORCH_CHECK(is_view_at(p, padded_unsharded_, e.offset, e.shape), "fully_shard: parameter '",
                params_[i].fqn, "' of unit '", unit_fqn_,
                "' was replaced while unsharded (e.g. between forward and backward, which "
                "SHARD_GRAD_OP keeps it unsharded for); modify parameters in place, outside "
                "forward and backward");
  }
}

void FlatParamStorage::write_back_replaced_data() {
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& s = slices_[i];
    const at::Tensor& p = params_[i].param;
    const auto shape = sharded_shape(i);
    if (is_view_at(p, local_shard_, s.shard_offset, shape)) continue;
    TORCH_CHECK(p.scalar_type() == local_shard_.scalar_type() && p.device() == local_shard_.device(),
                "fully_shard: parameter '", params_[i].fqn, "' of unit '", unit_fqn_,
                "' was replaced while sharded by a tensor of dtype ", p.scalar_type(), " on ",
                p.device(), "; expected ", local_shard_.scalar_type(), " on ", local_shard_.device(),
                ". A sharded module's dtype and device are fixed by fully_shard (module->to(...) "
                "after fully_shard is unsupported): use FullyShardOptions::mixed_precision for "
                "low-precision compute, and FullyShardOptions::device to place the shards");
    TORCH_CHECK(p.sizes() == at::IntArrayRef(shape), "fully_shard: parameter '", params_[i].fqn,
                "' of unit '", unit_fqn_, "' was replaced while sharded by a tensor of shape ",
                p.sizes(), "; expected this rank's shard of it, of shape ", contract::shape_string(shape),
                " (modify parameters in place, or replace them with tensors of their sharded "
                "shape)");
    c10::NoGradGuard no_grad;
    local_shard_.narrow(0, s.shard_offset, s.size()).copy_(p.detach().reshape({-1}));
    params_[i].param.set_data(local_shard_.narrow(0, s.shard_offset, s.size()).view(shape));
  }
}

bool FlatParamStorage::needs_unsharded_buffer() const {
  return shard_ || mixed_precision_ || offload_to_cpu_;
}

void FlatParamStorage::grow_unsharded_buffer() {
  resize_storage(padded_unsharded_, layout_.padded_numel * padded_unsharded_.element_size());
}

const at::Tensor& FlatParamStorage::gather_input() {
  if (!compute_shard_.defined()) return local_shard_;
  c10::NoGradGuard no_grad;
  // In the compute dtype, on the compute device (from host memory with offload).
  compute_shard_.copy_(local_shard_, /*non_blocking=*/true);
  return compute_shard_;
}

void FlatParamStorage::copy_shard_to_unsharded() {
  c10::NoGradGuard no_grad;
  padded_unsharded_.copy_(local_shard_, /*non_blocking=*/true);
}

size_t FlatParamStorage::unsharded_bytes() const { return storage_nbytes(padded_unsharded_); }

int64_t FlatParamStorage::shard_version() const {
  // The shard is written through its own views (write-back, summon_full_params) or through the
  // parameters while sharded (optimizers: their version counters are their own after set_data).
  int64_t version = local_shard_.is_inference() ? 0 : local_shard_._version();
  for (const auto& p : params_) version += p.param.is_inference() ? 0 : p.param._version();
  return version;
}

}  // namespace fsdp
