#include "fsdp/flat_param_handle.h"

#include <ATen/record_function.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "contract/shape_text.h"
#include "fsdp/storage_resize.h"
#include "init/meta_init.h"

namespace fsdp {
namespace {

std::vector<FlatParamInput> layout_inputs(const std::vector<FlatParamHandle::OrigParam>& params) {
  std::vector<FlatParamInput> inputs;
  for (const auto& p : params) inputs.push_back({p.fqn, p.param.sizes().vec()});
  return inputs;
}

// Whether `t` is the contiguous tensor of `shape` at element `offset` of `base`'s storage.
bool is_view_at(const at::Tensor& t, const at::Tensor& base, int64_t offset,
                const std::vector<int64_t>& shape) {
  if (!t.defined() || t.sizes() != at::IntArrayRef(shape)) return false;
  if (t.numel() == 0) return true;
  return t.is_contiguous() && t.data_ptr() == static_cast<char*>(base.data_ptr()) +
                                                  offset * static_cast<int64_t>(base.element_size());
}

// A tensor of `shape` over elements from `offset` of `flat`'s storage that autograd does not track
// as a view: optimizers call `grad.detach_()` in zero_grad, which views refuse.
at::Tensor storage_slice(const at::Tensor& flat, int64_t offset, const std::vector<int64_t>& shape) {
  at::Tensor slice = at::empty({0}, flat.options());
  std::vector<int64_t> strides(shape.size(), 1);
  for (int64_t d = static_cast<int64_t>(shape.size()) - 2; d >= 0; --d) {
    strides[d] = strides[d + 1] * shape[d + 1];
  }
  slice.set_(flat.storage(), flat.storage_offset() + offset, shape, strides);
  return slice;
}

}  // namespace

FlatParamHandle::FlatParamHandle(std::vector<OrigParam> params,
                                 std::shared_ptr<comm::Communicator> comm, std::string unit_fqn,
                                 FlatParamHandleOptions options)
    : unit_fqn_(std::move(unit_fqn)), params_(std::move(params)), comm_(std::move(comm)),
      options_(options) {
  TORCH_CHECK(!params_.empty(), "fully_shard: FlatParamHandle of '", unit_fqn_, "' has no parameters");
  TORCH_CHECK(comm_ != nullptr, "fully_shard: FlatParamHandle of '", unit_fqn_, "' has no communicator");
  const auto dtype = params_[0].param.scalar_type();
  // Meta parameters have no device of their own: they are materialized where the shard lives.
  std::optional<at::Device> real_device;
  for (const auto& p : params_) {
    if (!p.param.is_meta() && !real_device) real_device = p.param.device();
    TORCH_CHECK(!p.param.is_meta() || options_.meta_values, "fully_shard: parameter '", p.fqn, "' of '",
                unit_fqn_, "' is on the meta device but no way to initialize it was given");
  }
  const auto device = real_device.value_or(options_.device.value_or(at::Device(at::kCPU)));
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
  shard_ = options_.shard && comm_->size() > 1;
  const int world = shard_ ? comm_->size() : 1;
  const int rank = shard_ ? comm_->rank() : 0;
  compute_dtype_ = options_.param_dtype.value_or(dtype);
  reduce_dtype_ = options_.reduce_dtype.value_or(compute_dtype_);
  mixed_precision_ = compute_dtype_ != dtype;
  TORCH_CHECK(at::isFloatingType(compute_dtype_) && at::isFloatingType(reduce_dtype_),
              "fully_shard: mixed precision of '", unit_fqn_, "' needs floating-point dtypes, got "
              "param_dtype ", compute_dtype_, " and reduce_dtype ", reduce_dtype_);
  // Alignment in the compute dtype, so the all-gathered buffer's views start on 16-byte boundaries.
  layout_ = make_flat_param_layout(layout_inputs(params_), mixed_precision_ ? compute_dtype_ : dtype, world);
  layout_.dtype = dtype;
  compute_device_ = options_.device.value_or(device);
  streams_ = device_streams_for(compute_device_);
  const at::Device shard_device = options_.offload_to_cpu ? at::Device(at::kCPU) : compute_device_;
  const auto tensor_options = at::TensorOptions().dtype(dtype).device(shard_device);
  local_shard_ = at::zeros({layout_.shard_numel()}, tensor_options);
  if (options_.offload_to_cpu && compute_device_.is_cuda()) local_shard_ = local_shard_.pin_memory();
  if (mixed_precision_ || shard_device != compute_device_) {
    compute_shard_ = at::empty({layout_.shard_numel()}, tensor_options.dtype(compute_dtype_).device(compute_device_));
  }
  // The unsharded buffer has its full size but no memory until the first unshard (the storage is
  // grown there, fsdp/storage_resize.h): building the handle holds the shard only.
  padded_unsharded_ = at::empty({0}, tensor_options.dtype(compute_dtype_).device(compute_device_));
  padded_unsharded_.unsafeGetTensorImpl()->set_sizes_contiguous({needs_unsharded_buffer() ? layout_.padded_numel : 0});
  std::vector<at::Tensor> full_grads(params_.size());
  for (int i = 0; i < static_cast<int>(params_.size()); ++i) {
    slices_.push_back(layout_.slice_of(i, rank));
    const auto& s = slices_.back();
    full_grads[i] = params_[i].param.grad();
    const bool meta = params_[i].param.is_meta();
    if (s.size() > 0) {
      c10::NoGradGuard no_grad;
      const at::Tensor values = meta ? options_.meta_values(params_[i].fqn, params_[i].param) : params_[i].param.detach();
      local_shard_.narrow(0, s.shard_offset, s.size()).copy_(values.reshape({-1}).narrow(0, s.param_begin, s.size()));
    }
    if (meta) adopt_values(params_[i].param, local_shard_.narrow(0, s.shard_offset, s.size()).view(sharded_shape(i)));
    params_[i].param.mutable_grad() = at::Tensor();
  }
  use_sharded_views();
  resize_storage(padded_unsharded_, 0);
  // Gradients the parameters already held (a backward before fully_shard) are sharded too.
  bool any_grad = false;
  for (const auto& g : full_grads) any_grad |= g.defined();
  if (any_grad && requires_grad_) {
    at::Tensor sharded_grad = at::zeros({layout_.shard_numel()}, local_shard_.options());
    c10::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) {
      const auto& s = slices_[i];
      if (full_grads[i].defined() && s.size() > 0) {
        sharded_grad.narrow(0, s.shard_offset, s.size())
            .copy_(full_grads[i].reshape({-1}).narrow(0, s.param_begin, s.size()));
      }
    }
    set_sharded_grad_views(sharded_grad);
  }
}

std::vector<int64_t> FlatParamHandle::sharded_shape(size_t i) const {
  if (!shard_) return layout_.entries[i].shape;
  return {slices_[i].size()};
}

void FlatParamHandle::use_sharded_views() {
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& s = slices_[i];
    params_[i].param.set_data(local_shard_.narrow(0, s.shard_offset, s.size()).view(sharded_shape(i)));
  }
}

void FlatParamHandle::use_unsharded_views() {
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& e = layout_.entries[i];
    params_[i].param.set_data(padded_unsharded_.narrow(0, e.offset, e.numel).view(e.shape));
  }
}

void FlatParamHandle::check_params_unchanged() const {
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

void FlatParamHandle::write_back_replaced_data() {
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

void FlatParamHandle::start_unshard() {
  if (unsharded_ || pending_unshard_.valid() || !shard_) return;
  RECORD_USER_SCOPE("FSDP::all_gather");
  write_back_replaced_data();
  // [Note: streams] The unshard stream waits for the compute stream only if the shard may have
  // been written there since the iteration began (or outside an iteration).
  const bool shard_written = shard_written_since_gathered();
  try {
    streams_->on_unshard_stream([&] {
      // Allocated while the unshard stream is current: the allocator orders its reuse on that stream.
      resize_storage(padded_unsharded_, layout_.padded_numel * padded_unsharded_.element_size());
      const at::Tensor* source = &local_shard_;
      if (compute_shard_.defined()) {
        c10::NoGradGuard no_grad;
        // In the compute dtype, on the compute device (from host memory with offload).
        compute_shard_.copy_(local_shard_, /*non_blocking=*/true);
        source = &compute_shard_;
      }
      pending_unshard_ = comm_->all_gather_into_tensor(padded_unsharded_, *source, unit_fqn_);
    }, shard_written);
  } catch (...) {
    // The all-gather was never issued: nothing writes into the buffer grown for it, and nothing
    // else would free it (reshard() sees neither an unsharded handle nor a pending all-gather).
    pending_unshard_ = {};
    release_unsharded_buffer();
    throw;
  }
}

void FlatParamHandle::release_unsharded_buffer() {
  // Freed once the compute work enqueued so far is done with it (inline on the CPU: now).
  streams_->release_storage(*padded_unsharded_.storage().unsafeGetStorageImpl());
}

void FlatParamHandle::unshard() {
  check_params_unchanged();
  if (!needs_unsharded_buffer()) {  // NO_SHARD in full precision: always "unsharded"
    write_back_replaced_data();
    return;
  }
  if (unsharded_) return;
  if (shard_) {
    start_unshard();
    RECORD_USER_SCOPE("FSDP::all_gather_wait");
    try {
      streams_->hand_unshard_to_compute([&] { pending_unshard_.wait(); });
    } catch (...) {
      // The all-gather ended with an error (a collective still running never throws here: the
      // backend's timeout aborts the job): its buffer is freed, the parameters stay sharded.
      pending_unshard_ = {};
      release_unsharded_buffer();
      throw;
    }
    pending_unshard_ = {};
  } else {  // NO_SHARD with mixed precision or offload: a copy, no collective
    write_back_replaced_data();
    resize_storage(padded_unsharded_, layout_.padded_numel * padded_unsharded_.element_size());
    c10::NoGradGuard no_grad;
    padded_unsharded_.copy_(local_shard_, /*non_blocking=*/true);
  }
  use_unsharded_views();
  unsharded_ = true;
}

bool FlatParamHandle::needs_unsharded_buffer() const {
  return shard_ || mixed_precision_ || options_.offload_to_cpu;
}

void FlatParamHandle::reshard() {
  if (!unsharded_ && !pending_unshard_.valid()) return;
  RECORD_USER_SCOPE("FSDP::reshard");
  if (pending_unshard_.valid()) {  // never free a buffer a collective still writes into
    try {
      streams_->hand_unshard_to_compute([&] { pending_unshard_.wait(); });
    } catch (...) {
      // A prefetched all-gather that ended with an error: resharded all the same, then reported.
      pending_unshard_ = {};
      use_sharded_views();
      release_unsharded_buffer();
      unsharded_ = false;
      throw;
    }
    pending_unshard_ = {};
  }
  use_sharded_views();
  release_unsharded_buffer();
  unsharded_ = false;
}

at::Tensor FlatParamHandle::gather_full_precision() const {
  if (!shard_) return local_shard_;
  at::Tensor source = local_shard_.to(compute_device_);
  at::Tensor full = at::empty({layout_.padded_numel}, source.options());
  comm_->all_gather_into_tensor(full, source, unit_fqn_ + " (full state)").wait();
  return full.to(local_shard_.device());
}

size_t FlatParamHandle::unsharded_bytes() const { return storage_nbytes(padded_unsharded_); }

at::Tensor FlatParamHandle::sharded_grad() const {
  // The parameters' `.grad` are the truth (the handle keeps no reference, so zero_grad with
  // set_to_none frees the gradient): they are the sharded gradient when they are all views of
  // one flat storage at their places.
  const c10::StorageImpl* storage = nullptr;
  int64_t base_offset = 0;
  at::Tensor any;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& g = params_[i].param.grad();
    if (!g.defined()) return {};
    if (g.numel() == 0) continue;
    if (!g.is_contiguous() || g.sizes() != at::IntArrayRef(sharded_shape(i))) return {};
    const int64_t offset = g.storage_offset() - slices_[i].shard_offset;
    if (storage == nullptr) {
      storage = g.storage().unsafeGetStorageImpl();
      base_offset = offset;
      any = g;
    } else if (g.storage().unsafeGetStorageImpl() != storage || offset != base_offset) {
      return {};
    }
  }
  if (storage == nullptr) return {};  // this rank holds no element of any parameter
  if (static_cast<int64_t>(any.storage().nbytes()) <
      (base_offset + layout_.shard_numel()) * static_cast<int64_t>(any.element_size())) {
    return {};
  }
  at::Tensor flat = at::empty({0}, any.options());
  flat.set_(any.storage(), base_offset, {layout_.shard_numel()}, {1});
  return flat;
}

size_t FlatParamHandle::sharded_grad_bytes() const {
  const at::Tensor g = sharded_grad();
  if (g.defined()) return g.nbytes();
  size_t bytes = 0;  // gradients autograd wrote directly (passthrough), or replaced by the user
  for (const auto& p : params_) bytes += p.param.grad().defined() ? p.param.grad().nbytes() : 0;
  return bytes;
}

bool FlatParamHandle::passthrough() const {
  return !shard_ && comm_->size() == 1 && !needs_unsharded_buffer() &&
         !(options_.replicate && options_.replicate->size() > 1);
}

size_t FlatParamHandle::accumulated_grad_bytes() const {
  return accumulated_grad_.defined() ? accumulated_grad_.nbytes() : 0;
}

void FlatParamHandle::prepare_gradients_for_backward() {
  if (grads_prepared_ || !requires_grad_) return;
  grads_prepared_ = true;
  bool any = false;
  for (const auto& p : params_) any |= p.param.grad().defined();
  at::Tensor held = any ? sharded_grad() : at::Tensor();
  if (any && !held.defined()) {
    // Some gradients are missing (zeros) or were replaced by the user (written back).
    held = at::zeros({layout_.shard_numel()}, local_shard_.options());
    c10::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) {
      const at::Tensor& g = params_[i].param.grad();
      if (!g.defined()) continue;
      const auto& s = slices_[i];
      const auto shape = sharded_shape(i);
      TORCH_CHECK(g.sizes() == at::IntArrayRef(shape), "fully_shard: the gradient of '",
                  params_[i].fqn, "' in unit '", unit_fqn_, "' has shape ", g.sizes(),
                  " while sharded; expected this rank's shard of it, of shape ", contract::shape_string(shape));
      held.narrow(0, s.shard_offset, s.size()).copy_(g.reshape({-1}));
    }
  }
  saved_grad_ = held;
  for (auto& p : params_) p.param.mutable_grad() = at::Tensor();
  finalized_in_pass_ = false;
}

void FlatParamHandle::prepare_gradient_buffer() {
  if (!requires_grad_ || !grads_prepared_ || grad_buffer_.defined()) return;
  // Autograd adds in place into a gradient that is already defined (outside grad mode), so each
  // parameter's gradient lands directly in its place of the flat buffer: no full-shape gradient
  // per parameter is kept, and none is copied. Only when gradients are reduced in the dtype
  // they are computed in; otherwise they are converted while being copied in.
  if (reduce_dtype_ != compute_dtype_) return;
  grad_buffer_ = at::zeros({layout_.padded_numel}, local_shard_.options().dtype(compute_dtype_).device(compute_device_));
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& e = layout_.entries[i];
    params_[i].param.mutable_grad() = storage_slice(grad_buffer_, e.offset, e.shape);
  }
}

namespace {

// The division by the world size split into a factor before the reduction and one after, so a
// 16-bit sum neither overflows nor underflows (FSDP's predivide factor); 1 and W otherwise.
std::pair<double, double> divide_factors(int world, c10::ScalarType reduce_dtype) {
  if (c10::elementSize(reduce_dtype) >= 4) return {1.0, static_cast<double>(world)};
  int factor = 1;
  while (world % factor == 0 && world / factor > factor) factor *= 2;
  return {static_cast<double>(factor), static_cast<double>(world) / factor};
}

}  // namespace

at::Tensor FlatParamHandle::take_unsharded_gradients() {
  c10::NoGradGuard no_grad;
  at::Tensor flat;
  if (grad_buffer_.defined()) {
    flat = std::move(grad_buffer_);
    grad_buffer_ = at::Tensor();
    for (size_t i = 0; i < params_.size(); ++i) {
      at::Tensor& g = params_[i].param.mutable_grad();
      const auto& e = layout_.entries[i];
      if (g.defined() && !is_view_at(g, flat, e.offset, e.shape)) {  // replaced by the user
        TORCH_CHECK(g.numel() == e.numel, "fully_shard: the gradient of '", params_[i].fqn,
                    "' in unit '", unit_fqn_, "' has ", g.numel(),
                    " elements after backward; expected the full parameter's ", e.numel);
        flat.narrow(0, e.offset, e.numel).copy_(g.reshape({-1}));
      }
      g = at::Tensor();
    }
    return flat.scalar_type() == reduce_dtype_ ? flat : flat.to(reduce_dtype_);
  }
  // The padded flat gradient: each parameter's gradient copied to its place, zeros only where
  // nothing is copied (alignment, tail, parameters without one).
  flat = at::empty({layout_.padded_numel}, local_shard_.options().dtype(reduce_dtype_).device(compute_device_));
  int64_t cursor = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& g = params_[i].param.mutable_grad();
    const auto& e = layout_.entries[i];
    if (e.offset > cursor) flat.narrow(0, cursor, e.offset - cursor).zero_();
    cursor = e.offset + e.numel;
    at::Tensor region = flat.narrow(0, e.offset, e.numel);
    if (!g.defined()) {
      region.zero_();
      continue;
    }
    TORCH_CHECK(g.numel() == e.numel, "fully_shard: the gradient of '", params_[i].fqn,
                "' in unit '", unit_fqn_, "' has ", g.numel(),
                " elements after backward; expected the full parameter's ", e.numel);
    region.copy_(g.reshape({-1}));
    g = at::Tensor();  // the unsharded gradient is not kept on the parameter
  }
  if (cursor < layout_.padded_numel) flat.narrow(0, cursor, layout_.padded_numel - cursor).zero_();
  return flat;
}

void FlatParamHandle::reduce_gradients(bool sync) {
  if (!requires_grad_) return;
  RECORD_USER_SCOPE("FSDP::reduce_scatter");
  finalize_gradients();  // one reduction in flight per handle
  at::Tensor flat = take_unsharded_gradients();
  if (!sync) {
    // Accumulated across backward passes in the reduce dtype; reduced by the next synchronised one.
    accumulated_in_pass_ = true;
    if (accumulated_grad_.defined()) {
      accumulated_grad_.add_(flat);
    } else {
      accumulated_grad_ = flat;
    }
    return;
  }
  if (accumulated_grad_.defined()) {
    flat.add_(accumulated_grad_);
    accumulated_grad_ = at::Tensor();
  }
  const int world = comm_->size();
  const auto [pre, post] = divide_factors(world, reduce_dtype_);
  if (pre != 1.0) flat.div_(pre);
  post_divide_ = post;
  // Held until finalize_gradients(), after the compute stream waited for the reduction.
  reduce_input_ = flat;
  reduce_output_ = shard_ ? at::empty({layout_.shard_numel()}, flat.options()) : reduce_input_;
  if (world == 1) return;  // nothing to communicate: the flat gradient is the sharded one
  streams_->on_reduce_stream([&] {
    pending_reduce_ = shard_
                          ? comm_->reduce_scatter_tensor(reduce_output_, reduce_input_, c10d::ReduceOp::SUM, unit_fqn_)
                          : comm_->all_reduce(reduce_output_, c10d::ReduceOp::SUM, unit_fqn_);
  });
}

void FlatParamHandle::finalize_gradients() {
  if (!reduce_output_.defined()) return;
  RECORD_USER_SCOPE("FSDP::post_reduce");
  if (pending_reduce_.valid()) {
    streams_->hand_reduce_to_compute([&] { pending_reduce_.wait(); });
    pending_reduce_ = {};
  }
  // Only now: the compute stream, where it was allocated, has waited for the reduction reading it.
  reduce_input_ = at::Tensor();
  c10::NoGradGuard no_grad;
  // Gradients are in the parameters' dtype after sync, whatever dtype they were reduced in.
  at::Tensor grad = reduce_output_.to(local_shard_.scalar_type());
  reduce_output_ = at::Tensor();
  if (post_divide_ != 1.0) grad.div_(post_divide_);
  if (options_.replicate && options_.replicate->size() > 1) {
    // Hybrid sharding: average the shard-group gradients across the replicate group.
    options_.replicate->all_reduce(grad, c10d::ReduceOp::SUM, unit_fqn_).wait();
    grad.div_(options_.replicate->size());
  }
  grad = grad.to(local_shard_.device());  // host memory with offload
  // The gradient set aside before backward is kept until the backward pass is committed, so that
  // a failed pass can restore it.
  if (saved_grad_.defined()) grad.add_(saved_grad_);
  set_sharded_grad_views(grad);
  finalized_in_pass_ = true;
}

void FlatParamHandle::commit_gradients() {
  if (!finalized_in_pass_ && saved_grad_.defined()) {
    // No synchronised reduction this pass (accumulating without sync): the set-aside gradient
    // is this handle's gradient again.
    set_sharded_grad_views(saved_grad_);
  }
  finalized_in_pass_ = false;
  saved_grad_ = at::Tensor();
  grads_prepared_ = false;
  accumulated_in_pass_ = false;
  streams_->end_iteration();
}

void FlatParamHandle::discard_gradients() {
  if (pending_reduce_.valid()) {  // never free buffers a collective still uses
    streams_->hand_reduce_to_compute([&] { pending_reduce_.wait(); });
    pending_reduce_ = {};
  }
  streams_->end_iteration();
  reduce_input_ = at::Tensor();
  reduce_output_ = at::Tensor();
  grad_buffer_ = at::Tensor();
  // The failed pass may have added into the gradients accumulated without sync: drop them all
  // rather than keep part of a backward pass.
  if (accumulated_in_pass_) accumulated_grad_ = at::Tensor();
  accumulated_in_pass_ = false;
  if (!grads_prepared_) return;
  // Back to the gradients held before the failed backward pass.
  if (saved_grad_.defined()) {
    set_sharded_grad_views(saved_grad_);
  } else {
    for (auto& p : params_) p.param.mutable_grad() = at::Tensor();
  }
  saved_grad_ = at::Tensor();
  grads_prepared_ = false;
  finalized_in_pass_ = false;
}

int64_t FlatParamHandle::shard_version() const {
  // The shard is written through its own views (write-back, summon_full_params) or through the
  // parameters while sharded (optimizers: their version counters are their own after set_data).
  int64_t version = local_shard_.is_inference() ? 0 : local_shard_._version();
  for (const auto& p : params_) version += p.param.is_inference() ? 0 : p.param._version();
  return version;
}

bool FlatParamHandle::shard_written_since_gathered() {
  if (!streams_->asynchronous()) return false;  // inline: program order
  const int64_t version = shard_version();
  const bool written = version != gathered_shard_version_;
  gathered_shard_version_ = version;
  return written;
}

void FlatParamHandle::begin_iteration() {
  if (!streams_->asynchronous()) return;
  gathered_shard_version_ = shard_version();  // covered by the stream's wait at the next issue
  streams_->begin_iteration();
}

void FlatParamHandle::end_iteration() { streams_->end_iteration(); }

size_t FlatParamHandle::gradient_buffer_bytes() const {
  size_t bytes = grad_buffer_.defined() ? grad_buffer_.nbytes() : 0;
  if (reduce_input_.defined()) bytes += reduce_input_.nbytes();
  if (reduce_output_.defined() && !reduce_output_.is_same(reduce_input_)) bytes += reduce_output_.nbytes();
  return bytes;
}

void FlatParamHandle::set_sharded_grad_views(const at::Tensor& grad) {
  for (size_t i = 0; i < params_.size(); ++i) {
    params_[i].param.mutable_grad() = storage_slice(grad, slices_[i].shard_offset, sharded_shape(i));
  }
}

}  // namespace fsdp
