#include "fsdp_cpp/fsdp/flat_param_handle.h"

#include <ATen/record_function.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>

namespace fsdp {

FlatParamHandle::FlatParamHandle(std::vector<OrigParam> params,
                                 std::shared_ptr<comm::Communicator> comm, std::string unit_fqn,
                                 FlatParamHandleOptions options)
    : comm_(std::move(comm)),
      post_forward_group_(options.post_forward_group),
      storage_(std::move(params), comm_, std::move(unit_fqn), options),
      streams_(device_streams_for(storage_.compute_device())),
      grad_(storage_, options.reduce_group ? options.reduce_group : comm_, options, streams_,
            storage_.take_initial_grads()) {
  if (!storage_.sharded()) post_forward_group_ = nullptr;  // nothing is gathered: nothing to keep
  if (storage_.sharded()) all_gather_codec_ = options.all_gather_codec;
  if (post_forward_group_) {
    const int k = post_forward_group_->size();
    TORCH_CHECK(k >= 1 && comm_->size() % k == 0 && storage_.layout().padded_numel % k == 0,
                "fully_shard: the post-forward group of '", storage_.unit_fqn(), "' has ", k,
                " ranks, which does not divide the ", comm_->size(), " ranks it shards across");
  }
}

void FlatParamHandle::start_unshard() {
  if (storage_.is_unsharded() || pending_unshard_.valid() || !storage_.sharded()) return;
  RECORD_USER_SCOPE("FSDP::all_gather");
  storage_.write_back_replaced_data();
  // [Note: streams] The unshard stream waits for the compute stream only if the shard may have
  // been written there since the iteration began (or outside an iteration).
  const bool shard_written = shard_written_since_gathered();
  // [Note: post-forward group] The slice kept after forward was written on the compute stream.
  const bool from_post_forward = post_forward_shard_.defined();
  try {
    streams_->on_unshard_stream([&] {
      // Allocated while the unshard stream is current: the allocator orders its reuse on that stream.
      storage_.grow_unsharded_buffer();
      if (from_post_forward) {
        pending_unshard_ = post_forward_group_->all_gather_into_tensor(storage_.padded_unsharded(),
                                                                       post_forward_shard_, storage_.unit_fqn());
        return;
      }
      const at::Tensor& source = storage_.gather_input();
      if (all_gather_codec_) {  // [Note: communication codecs] in fsdp/comm_codec.h
        encoded_shard_ = encode_rows(*all_gather_codec_, source.view({1, source.numel()}),
                                     "fully_shard: unit '" + storage_.unit_fqn() + "': the all-gather codec");
        encoded_gathered_ = at::empty({comm_->size() * encoded_shard_.numel()}, encoded_shard_.options());
        pending_unshard_ = comm_->all_gather_into_tensor(encoded_gathered_, encoded_shard_.view({-1}),
                                                         storage_.unit_fqn());
        return;
      }
      pending_unshard_ =
          comm_->all_gather_into_tensor(storage_.padded_unsharded(), source, storage_.unit_fqn());
    }, shard_written || from_post_forward);
  } catch (...) {
    // The all-gather was never issued: nothing writes into the buffer grown for it, and nothing
    // else would free it (reshard() sees neither an unsharded handle nor a pending all-gather).
    pending_unshard_ = {};
    post_forward_shard_ = at::Tensor();
    encoded_shard_ = encoded_gathered_ = at::Tensor();
    release_unsharded_buffer();
    throw;
  }
}

void FlatParamHandle::use_unsharded_views_without_data() {
  // Not sharded (a local copy at most), already unsharded, or an all-gather in flight: as unshard().
  if (storage_.is_unsharded() || pending_unshard_.valid() || !storage_.sharded()) {
    unshard();
    return;
  }
  storage_.check_params_unchanged();
  storage_.write_back_replaced_data();
  storage_.use_unsharded_views_without_data();
}

long FlatParamHandle::unsharded_buffer_references() const {
  if (!storage_.sharded()) return 0;
  return static_cast<long>(storage_.padded_unsharded().storage().use_count()) - 1;
}

void FlatParamHandle::keep_post_forward_shard() {
  const int64_t chunk = storage_.layout().padded_numel / post_forward_group_->size();
  c10::NoGradGuard no_grad;
  post_forward_shard_ = storage_.padded_unsharded().narrow(0, post_forward_group_->rank() * chunk, chunk).clone();
}

void FlatParamHandle::drop_post_forward_shard() {
  if (!pending_unshard_.valid()) post_forward_shard_ = at::Tensor();  // else freed once its all-gather is waited for
}

size_t FlatParamHandle::post_forward_shard_bytes() const {
  return post_forward_shard_.defined() ? post_forward_shard_.nbytes() : 0;
}

void FlatParamHandle::decode_gathered() {
  at::Tensor gathered = std::move(encoded_gathered_);
  encoded_shard_ = encoded_gathered_ = at::Tensor();
  const int world = comm_->size();
  at::Tensor rows = storage_.padded_unsharded().view({world, storage_.layout().shard_numel()});
  try {
    decode_rows(*all_gather_codec_, gathered.view({world, -1}), rows,
                "fully_shard: unit '" + storage_.unit_fqn() + "': the all-gather codec");
  } catch (...) {
    release_unsharded_buffer();  // the parameters stay sharded
    throw;
  }
}

void FlatParamHandle::release_unsharded_buffer() {
  // Freed once the compute work enqueued so far is done with it (inline on the CPU: now).
  streams_->release_storage(*storage_.padded_unsharded().storage().unsafeGetStorageImpl());
}

void FlatParamHandle::unshard() {
  storage_.check_params_unchanged();
  if (!storage_.needs_unsharded_buffer()) {  // NO_SHARD in full precision: always "unsharded"
    storage_.write_back_replaced_data();
    return;
  }
  if (storage_.is_unsharded()) return;
  if (storage_.sharded()) {
    start_unshard();
    RECORD_USER_SCOPE("FSDP::all_gather_wait");
    try {
      streams_->hand_unshard_to_compute([&] { pending_unshard_.wait(); });
    } catch (...) {
      // The all-gather ended with an error (a collective still running never throws here: the
      // backend's timeout aborts the job): its buffer is freed, the parameters stay sharded.
      pending_unshard_ = {};
      post_forward_shard_ = at::Tensor();
      encoded_shard_ = encoded_gathered_ = at::Tensor();
      release_unsharded_buffer();
      throw;
    }
    pending_unshard_ = {};
    post_forward_shard_ = at::Tensor();  // gathered from: used once
    if (encoded_gathered_.defined()) decode_gathered();
  } else {  // NO_SHARD with mixed precision or offload: a copy, no collective
    storage_.write_back_replaced_data();
    storage_.grow_unsharded_buffer();
    storage_.copy_shard_to_unsharded();
  }
  storage_.use_unsharded_views();
}

void FlatParamHandle::reshard(bool after_forward) {
  if (!storage_.is_unsharded() && !pending_unshard_.valid()) return;
  RECORD_USER_SCOPE("FSDP::reshard");
  if (pending_unshard_.valid()) {  // never free a buffer a collective still writes into
    try {
      streams_->hand_unshard_to_compute([&] { pending_unshard_.wait(); });
    } catch (...) {
      // A prefetched all-gather that ended with an error: resharded all the same, then reported.
      pending_unshard_ = {};
      post_forward_shard_ = at::Tensor();
      encoded_shard_ = encoded_gathered_ = at::Tensor();
      storage_.use_sharded_views();
      release_unsharded_buffer();
      throw;
    }
    pending_unshard_ = {};
    post_forward_shard_ = at::Tensor();  // gathered from: used once
    encoded_shard_ = encoded_gathered_ = at::Tensor();  // never decoded: the buffer is freed
  }
  if (after_forward && post_forward_group_ && storage_.sharded() && storage_.is_unsharded()) {
    keep_post_forward_shard();
  }
  storage_.use_sharded_views();
  release_unsharded_buffer();
}

at::Tensor FlatParamHandle::gather_full_precision() const {
  const at::Tensor& shard = storage_.local_shard();
  if (!storage_.sharded()) return shard;
  at::Tensor source = shard.to(storage_.compute_device());
  at::Tensor full = at::empty({storage_.layout().padded_numel}, source.options());
  comm_->all_gather_into_tensor(full, source, storage_.unit_fqn() + " (full state)").wait();
  return full.to(shard.device());
}

bool FlatParamHandle::passthrough() const {
  return !storage_.sharded() && comm_->size() == 1 && !storage_.needs_unsharded_buffer() &&
         !grad_.replicated();
}

void FlatParamHandle::commit_gradients() {
  grad_.commit();
  drop_post_forward_shard();
  streams_->end_iteration();
}

void FlatParamHandle::discard_gradients() {
  grad_.wait_for_reduction();  // never free buffers a collective still uses
  drop_post_forward_shard();
  streams_->end_iteration();
  grad_.discard();
}

bool FlatParamHandle::shard_written_since_gathered() {
  if (!streams_->asynchronous()) return false;  // inline: program order
  const int64_t version = storage_.shard_version();
  const bool written = version != gathered_shard_version_;
  gathered_shard_version_ = version;
  return written;
}

void FlatParamHandle::begin_iteration() {
  if (!streams_->asynchronous()) return;
  gathered_shard_version_ = storage_.shard_version();  // covered by the stream's wait at the next issue
  streams_->begin_iteration();
}

void FlatParamHandle::end_iteration() {
  drop_post_forward_shard();
  streams_->end_iteration();
}

}  // namespace fsdp
