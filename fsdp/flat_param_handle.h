#pragma once
// FlatParamHandle: one FlatParameter as the engine sees it. It composes
//   - FlatParamStorage (fsdp/flat_param_storage.h): the padded shard, the unsharded buffer grown
//     and freed in place, and the original parameters' sharded and unsharded views ([Note:
//     original parameters]);
//   - FlatParamGrad (fsdp/flat_param_grad.h): the gradient lifecycle of a backward pass (the flat
//     buffer autograd accumulates into, the reduce-scatter or all-reduce, HSDP's replicate
//     all-reduce, the sharded gradient, the no-sync accumulator);
// and itself issues the all-gathers and keeps the stream bookkeeping of [Note: streams] (when the
// unshard stream must wait for the compute stream, which buffers are held until when). One handle
// per FlatParameter; FSDPState coordinates the handles of a unit.
//
// Without sharding (NO_SHARD) the "shard" is the whole FlatParameter, parameters are always
// full-shape views of it, and gradients are all-reduced instead of reduce-scattered. On one rank
// nothing is communicated: the handle runs as NO_SHARD and the flat gradient is the sharded
// gradient. The runtime finalizes each unit's reduction when it issues the next one, so at most two
// units' unsharded gradients are alive at once.
//
// [Note: post-forward group] With a post-forward group (FullyShardOptions::reshard_after_forward(
// int), FSDP2's reshard_after_forward=int, ZeRO++'s hpZ), resharding after forward keeps, beside
// the shard, this rank's 1/k slice of the padded unsharded buffer, k the group's size: the group
// is k consecutive ranks of the communicator, so the slices of its ranks, in group-rank order,
// are the whole buffer. The next all-gather gathers those slices inside the group (from a node's
// ranks instead of every rank) into the buffer, bit for bit what the all-gather of the shards
// gives, and frees the slice. It is used by the next unshard of the same iteration (backward, or
// an activation-checkpointing recompute, or a second call of the unit), and dropped when an
// iteration begins or ends (the optimizer may write the shard between iterations), so whether a
// gather runs inside the group depends only on the order of the runtime's calls, which every rank
// shares. Between forward and backward a rank holds padded bytes / k per such unit.

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/fsdp/comm_codec.h"
#include "fsdp_cpp/fsdp/device_streams.h"
#include "fsdp_cpp/fsdp/flat_param_grad.h"
#include "fsdp_cpp/fsdp/flat_param_layout.h"
#include "fsdp_cpp/fsdp/flat_param_options.h"
#include "fsdp_cpp/fsdp/flat_param_storage.h"

namespace fsdp {

class FlatParamHandle {
 public:
  using OrigParam = FlatParamStorage::OrigParam;

  /// Takes over the storage of `params` (all of one dtype, one device, and one requires_grad;
  /// every rank holding the same full values): copies this rank's shard out of them and leaves
  /// them sharded. Parameters on the meta device (any mix with others) get their slices from
  /// `options.meta_values` and become real, sharded, in place (the same tensor objects).
  /// `unit_fqn` names the unit in errors and traces.
  FlatParamHandle(std::vector<OrigParam> params, std::shared_ptr<comm::Communicator> comm,
                  std::string unit_fqn, FlatParamHandleOptions options = {});

  FlatParamHandle(const FlatParamHandle&) = delete;
  FlatParamHandle& operator=(const FlatParamHandle&) = delete;

  /// Issues the all-gather of the local shard without waiting (prefetch). No-op when unsharded,
  /// already in flight, or not sharded at all.
  void start_unshard();
  /// Makes the original parameters full-shape views of the all-gathered buffer (waits for an
  /// all-gather in flight, or issues one). Checks that the parameters were not replaced or had
  /// requires_grad changed since. An all-gather that fails (at issue or at its wait) leaves the
  /// handle resharded, its buffer freed, and rethrows (also from start_unshard() and reshard()).
  void unshard();
  /// Makes the original parameters views of the local shard and frees the unsharded buffer.
  /// `after_forward` with a post-forward group: keeps this rank's slice of the buffer for the
  /// next unshard ([Note: post-forward group]).
  void reshard(bool after_forward = false);
  /// [Note: unshard in backward]: makes the original parameters full-shape views of the padded
  /// unsharded buffer without gathering anything into it (its storage stays freed: reading a
  /// parameter's values fails with LibTorch's "data is not allocated yet"), so autograd can
  /// accumulate full-shape gradients. As unshard() when unsharded, all-gathering, or not sharded
  /// (no collective then).
  void use_unsharded_views_without_data();
  /// References to the padded unsharded buffer's storage beside the buffer itself (views autograd
  /// saved for backward, while the parameters are sharded). 0 when not sharded.
  long unsharded_buffer_references() const;
  /// Frees the post-forward slice (the start or end of an iteration). No-op without one.
  void drop_post_forward_shard();
  /// Whether the next all-gather runs inside the post-forward group.
  bool has_post_forward_shard() const { return post_forward_shard_.defined(); }
  /// The post-forward group, or null.
  const std::shared_ptr<comm::Communicator>& post_forward_group() const { return post_forward_group_; }
  bool is_unsharded() const { return storage_.is_unsharded(); }
  /// Start of a root's forward ([Note: streams]): the shard may have been written on the compute
  /// stream since it was last gathered (an optimizer step), so the next all-gather on this device
  /// waits for the compute stream; later ones in the iteration wait only if their shard was
  /// written again. No-op on the CPU.
  void begin_iteration();
  /// End of an iteration (also done by commit_gradients() and discard_gradients()): all-gathers
  /// wait for the compute stream again, and held resharded buffers are freed. No-op on the CPU.
  void end_iteration();
  /// Whether nothing is to be done around forward and backward: one rank in every group, in the
  /// parameters' own dtype and device. The parameters are full-shape views of the FlatParameter
  /// and autograd writes their gradients as in local training.
  bool passthrough() const;
  bool unshard_in_flight() const { return pending_unshard_.valid(); }
  /// Whether the parameters are sharded across ranks (false for NO_SHARD, and on one rank, where
  /// the shard is the whole FlatParameter and nothing is communicated).
  bool is_sharded_strategy() const { return storage_.sharded(); }
  /// The dtype the parameters are all-gathered and computed in, and the one gradients are reduced in.
  c10::ScalarType compute_dtype() const { return storage_.compute_dtype(); }
  c10::ScalarType reduce_dtype() const { return grad_.reduce_dtype(); }
  /// The codec the all-gather over the handle's communicator carries the shard in ([Note:
  /// communication codecs] in fsdp/comm_codec.h), or null (none, or not sharded across ranks).
  /// The all-gather inside the post-forward group is never encoded.
  const std::shared_ptr<const CommCodec>& all_gather_codec() const { return all_gather_codec_; }
  /// The codec gradients are reduced in ([Note: quantized gradient reduction] in
  /// fsdp/flat_param_grad.h), or null; reduces_encoded(): it is used (sharded over W > 1 ranks).
  const std::shared_ptr<const CommCodec>& reduce_codec() const { return grad_.reduce_codec(); }
  bool reduces_encoded() const { return grad_.reduces_encoded(); }
  /// Bytes of each row of the gradient all-to-all ([Note: quantized gradient reduction]), or 0.
  int64_t encoded_reduce_bytes() const { return grad_.encoded_reduce_bytes(); }

  /// Start of a backward pass: sets aside the sharded gradients the original parameters still
  /// hold (from an earlier backward without set_to_none, or replaced by the user: written back),
  /// and clears `.grad` so autograd can write full-shape gradients. Idempotent within one pass.
  void prepare_gradients_for_backward() { grad_.prepare_for_backward(); }
  /// At the handle's pre-backward, once unsharded: points each parameter's `.grad` at its place
  /// in a zeroed flat gradient buffer, so autograd accumulates into it in place (when gradients
  /// are reduced in the compute dtype). No-op when already done this pass.
  void prepare_gradient_buffer() { grad_.prepare_buffer(); }
  /// After this handle's backward. With `sync`: issues the reduce-scatter (all-reduce without
  /// sharding; nothing on one rank) of the unsharded gradients; `finalize_gradients()` waits for
  /// it and sets `.grad`. Without: accumulates them locally (in the reduce dtype: low precision
  /// with mixed precision), no collective.
  void reduce_gradients(bool sync = true) { grad_.reduce(sync); }
  /// Waits for the reduction issued by reduce_gradients(), frees its input and points `.grad` at
  /// the new sharded gradient (plus the set-aside one). No-op when none is pending.
  /// Without `finish`, under HSDP's asynchronous replicate all-reduce ([Note: asynchronous
  /// replicate all-reduce] in fsdp/flat_param_grad.h), only issues that all-reduce.
  void finalize_gradients(bool finish = true) { grad_.finalize(finish); }
  /// Whether no reduction is pending, or the pending one has completed (finalize would not wait).
  bool reduction_completed() const { return grad_.reduction_completed(); }
  /// End of a successful backward pass: forgets the set-aside gradient (restoring it as `.grad`
  /// when no synchronised reduction ran).
  void commit_gradients();
  /// A backward pass failed: waits for a reduction in flight, frees every gradient buffer of the
  /// pass and restores the gradients held before it (gradients accumulated without sync that this
  /// pass added to are dropped).
  void discard_gradients();
  /// The whole FlatParameter in the parameters' own dtype (full precision even with mixed
  /// precision), padded, on the shard's device: an all-gather of the shards (collective), or the
  /// shard itself without sharding. Parameter i is at layout().entries[i].offset. For state dicts.
  at::Tensor gather_full_precision() const;

  /// Drops the gradients accumulated without sync and the replicate partial, outside a backward
  /// pass ([Note: discarding accumulated gradients] in fsdp/zero_grad.h). Returns whether either
  /// held gradients.
  bool discard_accumulated_gradients() { return grad_.drop_accumulated(); }
  /// The version counters of the shard and of the parameters, summed: it grows whenever the shard
  /// is written (an optimizer step writes it through the parameters while they are sharded).
  int64_t shard_version() const { return storage_.shard_version(); }

  /// The gradients accumulated without sync and not reduced yet: this rank's own local sum over
  /// those backward passes, 1-D padded [padded_numel] in the reduce dtype on the compute device
  /// (parameter i at layout().entries[i].offset), or undefined when there are none. Read by
  /// summon_full_params (composable/summon_full_params.h); not to be modified.
  const at::Tensor& accumulated_grad() const { return grad_.accumulated(); }

  /// The per-unit gradient controls ([Note: gradient divide factor and replicate partial] in
  /// fsdp/flat_param_grad.h): a factor replacing the division by the data-parallel size (nullopt:
  /// that division), and whether HSDP's replicate all-reduce runs (false: the reduce-scattered
  /// gradient is kept in the replicate partial, 1-D [shard_numel] in the parameters' dtype, not
  /// in `.grad`).
  void set_gradient_divide_factor(std::optional<double> factor) { grad_.set_divide_factor(factor); }
  void set_requires_all_reduce(bool all_reduce) { grad_.set_requires_all_reduce(all_reduce); }
  const at::Tensor& replicate_partial_grad() const { return grad_.replicate_partial(); }

  /// Whether the parameters require gradients (a handle holds only trainable or only frozen ones).
  bool requires_grad() const { return storage_.requires_grad(); }

  const FlatParamLayout& layout() const { return storage_.layout(); }
  const std::vector<OrigParam>& params() const { return storage_.params(); }
  const std::string& unit_fqn() const { return storage_.unit_fqn(); }
  void set_unit_fqn(std::string fqn) { storage_.set_unit_fqn(std::move(fqn)); }
  /// This rank's shard of the FlatParameter (1-D, layout().shard_numel() elements).
  const at::Tensor& local_shard() const { return storage_.local_shard(); }
  /// The sharded gradient (1-D over the storage the parameters' `.grad` views share), or undefined
  /// when the parameters' `.grad` are not (all) such views (none yet, set to none by zero_grad,
  /// replaced by the user).
  at::Tensor sharded_grad() const { return grad_.sharded(); }
  /// Bytes held now by: the padded unsharded buffer (0 when resharded), the sharded gradient (or,
  /// when not one flat gradient, the parameters' `.grad`), the gradients accumulated without sync,
  /// the replicate partial.
  size_t unsharded_bytes() const { return storage_.unsharded_bytes(); }
  /// Bytes held now by the post-forward slice ([Note: post-forward group]; 0 when none).
  size_t post_forward_shard_bytes() const;
  size_t sharded_grad_bytes() const { return grad_.sharded_bytes(); }
  size_t accumulated_grad_bytes() const { return grad_.accumulated_bytes(); }
  size_t replicate_partial_grad_bytes() const { return grad_.replicate_partial_bytes(); }
  /// Bytes of the unsharded gradient buffers of a backward pass now alive: the flat buffer autograd
  /// accumulates into, and the input and output of a reduction not yet finalized.
  size_t gradient_buffer_bytes() const { return grad_.buffer_bytes(); }

 private:
  // Frees the padded unsharded buffer's storage (after the compute work enqueued so far).
  void release_unsharded_buffer();
  // Whether the shard was written since the last all-gather or begin_iteration() (asynchronous
  // streams only: false inline), and remembers the current version.
  bool shard_written_since_gathered();

  // Keeps this rank's slice of the unsharded buffer for the post-forward group.
  void keep_post_forward_shard();
  // [Note: communication codecs]: decodes the gathered rows into the unsharded buffer (once the
  // compute stream waited for the all-gather), and frees the encoded buffers.
  void decode_gathered();

  std::shared_ptr<comm::Communicator> comm_;
  std::shared_ptr<comm::Communicator> post_forward_group_;  // [Note: post-forward group], or null
  at::Tensor post_forward_shard_;  // 1-D [padded_numel / k] in the compute dtype, or undefined
  std::shared_ptr<const CommCodec> all_gather_codec_;  // [Note: communication codecs], or null
  at::Tensor encoded_shard_;     // all-gather in flight with a codec: [1 x encoded] uint8 sent
  at::Tensor encoded_gathered_;  // and [W x encoded] uint8 received, decoded by unshard()
  FlatParamStorage storage_;
  std::shared_ptr<DeviceStreams> streams_;  // [Note: streams]
  FlatParamGrad grad_;                      // refers to storage_
  comm::PendingCollective pending_unshard_;
  int64_t gathered_shard_version_ = -1;  // shard_version() at the last all-gather issue
};

}  // namespace fsdp
