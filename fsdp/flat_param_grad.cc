#include "fsdp_cpp/fsdp/flat_param_grad.h"

#include <cmath>
#include <utility>

#include <ATen/record_function.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "fsdp_cpp/contract/shape_text.h"

namespace fsdp {
namespace {

// A division split into a factor before the reduction and one after, so a 16-bit sum neither
// overflows nor underflows (FSDP's predivide factor: the largest power of two dividing `total` up
// to about its square root); 1 and `total` otherwise. [Note: gradient divide factor and replicate
// partial]
std::pair<double, double> divide_factors(double total, c10::ScalarType reduce_dtype) {
  if (c10::elementSize(reduce_dtype) >= 4) return {1.0, total};
  double factor = 1.0;
  while (std::fmod(total, factor) == 0.0 && total / factor > factor) factor *= 2.0;
  return {factor, total / factor};
}

}  // namespace

FlatParamGrad::FlatParamGrad(const FlatParamStorage& storage,
                             std::shared_ptr<comm::Communicator> comm,
                             const FlatParamHandleOptions& options,
                             std::shared_ptr<DeviceStreams> streams,
                             std::vector<at::Tensor> initial_grads)
    : storage_(storage), comm_(std::move(comm)), replicate_(options.replicate),
      streams_(std::move(streams)),
      reduce_dtype_(options.reduce_dtype.value_or(storage.compute_dtype())),
      reduce_codec_(options.reduce_codec) {
  // Gradients the parameters already held (a backward before fully_shard) are sharded too.
  bool any_grad = false;
  for (const auto& g : initial_grads) any_grad |= g.defined();
  if (any_grad && storage_.requires_grad()) {
    const FlatParamLayout& layout = storage_.layout();
    at::Tensor sharded_grad = at::zeros({layout.shard_numel()}, storage_.local_shard().options());
    c10::NoGradGuard no_grad;
    for (size_t i = 0; i < initial_grads.size(); ++i) {
      const auto& s = storage_.slice(i);
      if (initial_grads[i].defined() && s.size() > 0) {
        sharded_grad.narrow(0, s.shard_offset, s.size())
            .copy_(initial_grads[i].reshape({-1}).narrow(0, s.param_begin, s.size()));
      }
    }
    set_sharded_views(sharded_grad);
  }
}

CodecRowLayout FlatParamGrad::reduce_rows() const {
  const FlatParamLayout& layout = storage_.layout();
  CodecRowLayout rows;
  rows.numel = layout.shard_numel();
  rows.shards = layout.world_size;
  for (const auto& e : layout.entries) rows.tensor_starts.push_back(e.offset);
  for (int64_t r = 0; r < rows.shards; ++r) rows.row_shards.push_back(r);
  return rows;
}

int64_t FlatParamGrad::encoded_reduce_bytes() const {
  return reduces_encoded() ? reduce_codec_->encoded_bytes_with_layout(reduce_rows()) : 0;
}

at::Tensor FlatParamGrad::sharded() const {
  // The parameters' `.grad` are the truth (nothing here keeps a reference, so zero_grad with
  // set_to_none frees the gradient): they are the sharded gradient when they are all views of
  // one flat storage at their places.
  const auto& params = storage_.params();
  const c10::StorageImpl* storage = nullptr;
  int64_t base_offset = 0;
  at::Tensor any;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& g = params[i].param.grad();
    if (!g.defined()) return {};
    if (g.numel() == 0) continue;
    if (!g.is_contiguous() || g.sizes() != at::IntArrayRef(storage_.sharded_shape(i))) return {};
    const int64_t offset = g.storage_offset() - storage_.slice(i).shard_offset;
    if (storage == nullptr) {
      storage = g.storage().unsafeGetStorageImpl();
      base_offset = offset;
      any = g;
    } else if (g.storage().unsafeGetStorageImpl() != storage || offset != base_offset) {
      return {};
    }
  }
  if (storage == nullptr) return {};  // this rank holds no element of any parameter
  const int64_t shard_numel = storage_.layout().shard_numel();
  if (static_cast<int64_t>(any.storage().nbytes()) <
      (base_offset + shard_numel) * static_cast<int64_t>(any.element_size())) {
    return {};
  }
  at::Tensor flat = at::empty({0}, any.options());
  flat.set_(any.storage(), base_offset, {shard_numel}, {1});
  return flat;
}

size_t FlatParamGrad::sharded_bytes() const {
  const at::Tensor g = sharded();
  if (g.defined()) return g.nbytes();
  size_t bytes = 0;  // gradients autograd wrote directly (passthrough), or replaced by the user
  for (const auto& p : storage_.params()) bytes += p.param.grad().defined() ? p.param.grad().nbytes() : 0;
  return bytes;
}

size_t FlatParamGrad::accumulated_bytes() const {
  return accumulated_grad_.defined() ? accumulated_grad_.nbytes() : 0;
}

size_t FlatParamGrad::replicate_partial_bytes() const {
  size_t bytes = replicate_partial_.defined() ? replicate_partial_.nbytes() : 0;
  if (partial_at_pass_start_.defined() && !partial_at_pass_start_.is_same(replicate_partial_)) {
    bytes += partial_at_pass_start_.nbytes();
  }
  return bytes;
}

size_t FlatParamGrad::buffer_bytes() const {
  size_t bytes = grad_buffer_.defined() ? grad_buffer_.nbytes() : 0;
  if (reduce_input_.defined()) bytes += reduce_input_.nbytes();
  if (encoded_input_.defined()) bytes += encoded_input_.nbytes();
  if (reduce_output_.defined() && !reduce_output_.is_same(reduce_input_)) bytes += reduce_output_.nbytes();
  if (replicate_output_.defined()) bytes += replicate_output_.nbytes();
  return bytes;
}

void FlatParamGrad::prepare_for_backward() {
  if (grads_prepared_ || !storage_.requires_grad()) return;
  grads_prepared_ = true;
  const auto& params = storage_.params();
  bool any = false;
  for (const auto& p : params) any |= p.param.grad().defined();
  at::Tensor held = any ? sharded() : at::Tensor();
  if (any && !held.defined()) {
    // Some gradients are missing (zeros) or were replaced by the user (written back).
    held = at::zeros({storage_.layout().shard_numel()}, storage_.local_shard().options());
    c10::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& g = params[i].param.grad();
      if (!g.defined()) continue;
      const auto& s = storage_.slice(i);
      const auto shape = storage_.sharded_shape(i);
      TORCH_CHECK(g.sizes() == at::IntArrayRef(shape), "fully_shard: the gradient of '",
                  params[i].fqn, "' in unit '", storage_.unit_fqn(), "' has shape ", g.sizes(),
                  " while sharded; expected this rank's shard of it, of shape ",
                  contract::shape_string(shape));
      held.narrow(0, s.shard_offset, s.size()).copy_(g.reshape({-1}));
    }
  }
  saved_grad_ = held;
  for (auto& p : params) p.param.mutable_grad() = at::Tensor();
  finalized_in_pass_ = false;
}

void FlatParamGrad::prepare_buffer() {
  if (!storage_.requires_grad() || !grads_prepared_ || grad_buffer_.defined()) return;
  // Autograd adds in place into a gradient that is already defined (outside grad mode), so each
  // parameter's gradient lands directly in its place of the flat buffer: no full-shape gradient
  // per parameter is kept, and none is copied. Only when gradients are reduced in the dtype
  // they are computed in; otherwise they are converted while being copied in.
  if (reduce_dtype_ != storage_.compute_dtype()) return;
  const FlatParamLayout& layout = storage_.layout();
  const auto options =
      storage_.local_shard().options().dtype(storage_.compute_dtype()).device(storage_.compute_device());
  grad_buffer_ = at::zeros({layout.padded_numel}, options);
  const auto& params = storage_.params();
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& e = layout.entries[i];
    params[i].param.mutable_grad() = FlatParamStorage::storage_slice(grad_buffer_, e.offset, e.shape);
  }
}

at::Tensor FlatParamGrad::take_unsharded() {
  c10::NoGradGuard no_grad;
  const FlatParamLayout& layout = storage_.layout();
  const auto& params = storage_.params();
  at::Tensor flat;
  if (grad_buffer_.defined()) {
    flat = std::move(grad_buffer_);
    grad_buffer_ = at::Tensor();
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor& g = params[i].param.mutable_grad();
      const auto& e = layout.entries[i];
      if (g.defined() && !FlatParamStorage::is_view_at(g, flat, e.offset, e.shape)) {  // replaced by the user
        TORCH_CHECK(g.numel() == e.numel, "fully_shard: the gradient of '", params[i].fqn,
                    "' in unit '", storage_.unit_fqn(), "' has ", g.numel(),
                    " elements after backward; expected the full parameter's ", e.numel);
        flat.narrow(0, e.offset, e.numel).copy_(g.reshape({-1}));
      }
      g = at::Tensor();
    }
    return flat.scalar_type() == reduce_dtype_ ? flat : flat.to(reduce_dtype_);
  }
  // The padded flat gradient: each parameter's gradient copied to its place, zeros only where
  // nothing is copied (alignment, tail, parameters without one).
  flat = at::empty({layout.padded_numel},
                   storage_.local_shard().options().dtype(reduce_dtype_).device(storage_.compute_device()));
  int64_t cursor = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor& g = params[i].param.mutable_grad();
    const auto& e = layout.entries[i];
    if (e.offset > cursor) flat.narrow(0, cursor, e.offset - cursor).zero_();
    cursor = e.offset + e.numel;
    at::Tensor region = flat.narrow(0, e.offset, e.numel);
    if (!g.defined()) {
      region.zero_();
      continue;
    }
    TORCH_CHECK(g.numel() == e.numel, "fully_shard: the gradient of '", params[i].fqn,
                "' in unit '", storage_.unit_fqn(), "' has ", g.numel(),
                " elements after backward; expected the full parameter's ", e.numel);
    region.copy_(g.reshape({-1}));
    g = at::Tensor();  // the unsharded gradient is not kept on the parameter
  }
  if (cursor < layout.padded_numel) flat.narrow(0, cursor, layout.padded_numel - cursor).zero_();
  return flat;
}

void FlatParamGrad::reduce(bool sync) {
  if (!storage_.requires_grad()) return;
  RECORD_USER_SCOPE("FSDP::reduce_scatter");
  finalize();  // one reduction in flight per handle
  at::Tensor flat = take_unsharded();
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
  // [Note: asynchronous replicate all-reduce] Under HSDP, with the all-reduce this pass and no
  // replicate partial to add, the replicate all-reduce runs on the reduce-scatter's output in the
  // reduce dtype and is divided once after it, by the whole data-parallel size. Otherwise: the
  // shard group's size, then the replicate group's after its all-reduce. Or the custom factor for
  // both ([Note: gradient divide factor and replicate partial]).
  replicate_in_reduce_dtype_ = replicated() && requires_all_reduce_ && !replicate_partial_.defined();
  const double replicas = replicate_in_reduce_dtype_ ? static_cast<double>(replicate_->size()) : 1.0;
  const auto [pre, post] =
      divide_factors(divide_factor_.value_or(static_cast<double>(world) * replicas), reduce_dtype_);
  if (pre != 1.0) flat.div_(pre);
  post_divide_ = post;
  replicate_divide_ = divide_factor_ || !replicated() || replicate_in_reduce_dtype_
                          ? 1.0
                          : static_cast<double>(replicate_->size());
  const bool shard = storage_.sharded();
  // Held until finalize(), after the compute stream waited for the reduction.
  reduce_input_ = flat;
  const std::string& tag = storage_.unit_fqn();
  if (reduces_encoded()) {
    // [Note: quantized gradient reduction]: W encoded chunks, chunk j to rank j, blocks aligned to
    // the parameters, rounded stochastically from this rank's stream of this reduction.
    const int64_t shard_numel = storage_.layout().shard_numel();
    CodecRowLayout rows = reduce_rows();
    const auto& entries = storage_.layout().entries;
    const int64_t data_rank =
        replicated() ? static_cast<int64_t>(replicate_->rank()) * world + comm_->rank() : comm_->rank();
    rows.rounding_seed = codec_rounding_seed(tag + "/" + (entries.empty() ? std::string() : entries.front().fqn),
                                             encoded_reductions_++, static_cast<uint64_t>(data_rank));
    streams_->on_reduce_stream([&] {
      encoded_input_ = encode_rows(*reduce_codec_, reduce_input_.view({world, shard_numel}), rows,
                                   "fully_shard: unit '" + tag + "': the reduce codec");
      reduce_output_ = at::empty_like(encoded_input_);
      reduce_encoded_ = true;
      pending_reduce_ = comm_->all_to_all_single(reduce_output_, encoded_input_, tag);
    });
    return;
  }
  reduce_output_ = shard ? at::empty({storage_.layout().shard_numel()}, flat.options()) : reduce_input_;
  if (world == 1) return;  // nothing to communicate: the flat gradient is the sharded one
  streams_->on_reduce_stream([&] {
    pending_reduce_ =
        shard ? comm_->reduce_scatter_tensor(reduce_output_, reduce_input_, c10d::ReduceOp::SUM, tag)
              : comm_->all_reduce(reduce_output_, c10d::ReduceOp::SUM, tag);
  });
}

void FlatParamGrad::finalize(bool finish) {
  if (reduce_output_.defined()) finish_reduction();
  if (finish && replicate_output_.defined()) finish_replicate_all_reduce();
}

void FlatParamGrad::finish_replicate_all_reduce() {
  RECORD_USER_SCOPE("FSDP::post_replicate_all_reduce");
  if (pending_replicate_.valid()) {
    streams_->hand_reduce_to_compute([&] { pending_replicate_.wait(); });
    pending_replicate_ = {};
  }
  c10::NoGradGuard no_grad;
  const at::Tensor& shard = storage_.local_shard();
  at::Tensor grad = replicate_output_.to(shard.scalar_type());
  replicate_output_ = at::Tensor();
  if (post_divide_ != 1.0) grad.div_(post_divide_);
  set_grad(grad.to(shard.device()));
}

void FlatParamGrad::set_grad(at::Tensor grad) {
  // The gradient set aside before backward is kept until the backward pass is committed, so that
  // a failed pass can restore it.
  if (saved_grad_.defined()) grad.add_(saved_grad_);
  set_sharded_views(grad);
  finalized_in_pass_ = true;
}

void FlatParamGrad::finish_reduction() {
  RECORD_USER_SCOPE("FSDP::post_reduce");
  if (pending_reduce_.valid()) {
    streams_->hand_reduce_to_compute([&] { pending_reduce_.wait(); });
    pending_reduce_ = {};
  }
  // Only now: the compute stream, where it was allocated, has waited for the reduction reading it.
  reduce_input_ = at::Tensor();
  encoded_input_ = at::Tensor();
  c10::NoGradGuard no_grad;
  const at::Tensor& shard = storage_.local_shard();
  if (reduce_encoded_) {
    // [Note: quantized gradient reduction]: the W chunks this rank received, summed in float32.
    reduce_encoded_ = false;
    at::Tensor received = std::move(reduce_output_);
    reduce_output_ = at::empty({received.size(0), storage_.layout().shard_numel()},
                               received.options().dtype(at::kFloat));
    // Every row received is this rank's shard, encoded by one rank.
    CodecRowLayout rows = reduce_rows();
    rows.row_shards.assign(rows.row_shards.size(), comm_->rank());
    decode_rows(*reduce_codec_, received, reduce_output_, rows,
                "fully_shard: unit '" + storage_.unit_fqn() + "': the reduce codec");
    reduce_output_ = reduce_output_.sum(0);
  }
  if (replicate_in_reduce_dtype_) {
    // [Note: asynchronous replicate all-reduce]: issued now, finished by finalize(finish=true).
    replicate_output_ = std::move(reduce_output_);
    reduce_output_ = at::Tensor();
    streams_->on_reduce_stream([&] {
      pending_replicate_ = replicate_->all_reduce(replicate_output_, c10d::ReduceOp::SUM, storage_.unit_fqn());
    });
    return;
  }
  // Gradients are in the parameters' dtype after sync, whatever dtype they were reduced in.
  at::Tensor grad = reduce_output_.to(shard.scalar_type());
  reduce_output_ = at::Tensor();
  if (post_divide_ != 1.0) grad.div_(post_divide_);
  if (replicated()) {
    // What the partial held when the pass began is kept until commit(), for discard().
    if (!partial_changed_in_pass_) partial_at_pass_start_ = replicate_partial_;
    partial_changed_in_pass_ = true;
    if (!requires_all_reduce_) {
      // HSDP micro-batch: kept for the next pass's all-reduce, `.grad` untouched (commit()
      // restores the set-aside gradient). Out of place: the partial the pass began with is kept.
      replicate_partial_ = replicate_partial_.defined() ? replicate_partial_.add(grad) : grad;
      return;
    }
    if (replicate_partial_.defined()) {
      grad.add_(replicate_partial_);
      replicate_partial_ = at::Tensor();
    }
    // Hybrid sharding: sum the shard-group gradients across the replicate group, then divide.
    replicate_->all_reduce(grad, c10d::ReduceOp::SUM, storage_.unit_fqn()).wait();
    if (replicate_divide_ != 1.0) grad.div_(replicate_divide_);
  }
  set_grad(grad.to(shard.device()));  // host memory with offload
}

void FlatParamGrad::commit() {
  if (!finalized_in_pass_ && saved_grad_.defined()) {
    // No synchronised reduction this pass (accumulating without sync): the set-aside gradient
    // is this handle's gradient again.
    set_sharded_views(saved_grad_);
  }
  finalized_in_pass_ = false;
  saved_grad_ = at::Tensor();
  grads_prepared_ = false;
  accumulated_in_pass_ = false;
  partial_at_pass_start_ = at::Tensor();
  partial_changed_in_pass_ = false;
}

void FlatParamGrad::wait_for_reduction() {
  if (pending_reduce_.valid()) {  // never free buffers a collective still uses
    streams_->hand_reduce_to_compute([&] { pending_reduce_.wait(); });
    pending_reduce_ = {};
  }
  if (pending_replicate_.valid()) {
    streams_->hand_reduce_to_compute([&] { pending_replicate_.wait(); });
    pending_replicate_ = {};
  }
}

void FlatParamGrad::discard() {
  wait_for_reduction();
  reduce_input_ = at::Tensor();
  encoded_input_ = at::Tensor();
  reduce_output_ = at::Tensor();
  replicate_output_ = at::Tensor();
  reduce_encoded_ = false;
  grad_buffer_ = at::Tensor();
  // The failed pass may have added into the gradients accumulated without sync: drop them all
  // rather than keep part of a backward pass.
  if (accumulated_in_pass_) accumulated_grad_ = at::Tensor();
  accumulated_in_pass_ = false;
  // The replicate partial is what it was before the failed pass (micro-batches kept there by
  // earlier passes are not lost).
  if (partial_changed_in_pass_) replicate_partial_ = partial_at_pass_start_;
  partial_at_pass_start_ = at::Tensor();
  partial_changed_in_pass_ = false;
  if (!grads_prepared_) return;
  // Back to the gradients held before the failed backward pass.
  if (saved_grad_.defined()) {
    set_sharded_views(saved_grad_);
  } else {
    for (const auto& p : storage_.params()) p.param.mutable_grad() = at::Tensor();
  }
  saved_grad_ = at::Tensor();
  grads_prepared_ = false;
  finalized_in_pass_ = false;
}

bool FlatParamGrad::drop_accumulated() {
  TORCH_CHECK(!grads_prepared_ && !pending_reduce_.valid() && !pending_replicate_.valid() && !reduce_output_.defined() &&
                  !replicate_output_.defined(),
              "FSDPModule::zero_grad: unit '", storage_.unit_fqn(), "': the accumulated gradients cannot be discarded while a backward "
              "pass holds them (expected no pass in progress, found one prepared or a reduction in flight)");
  const bool held = accumulated_grad_.defined() || replicate_partial_.defined();
  accumulated_grad_ = at::Tensor();
  replicate_partial_ = at::Tensor();
  return held;
}

void FlatParamGrad::set_sharded_views(const at::Tensor& grad) {
  const auto& params = storage_.params();
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].param.mutable_grad() =
        FlatParamStorage::storage_slice(grad, storage_.slice(i).shard_offset, storage_.sharded_shape(i));
  }
}

}  // namespace fsdp
