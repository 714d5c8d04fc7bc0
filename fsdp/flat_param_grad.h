#pragma once
// FlatParamGrad: the gradients of one FlatParameter through a backward pass, from the flat buffer
// autograd accumulates into to the sharded gradient the optimizer reads. FlatParamHandle owns one
// beside its FlatParamStorage and calls it at the points the runtime reaches.
//
// The lifecycle of one backward pass:
//   1. prepare_for_backward() (start of the pass): the sharded gradient the parameters still hold
//      (an earlier backward without set_to_none, or one the user replaced: written back) is set
//      aside, and `.grad` cleared so autograd can write full-shape gradients.
//   2. prepare_buffer() (the handle's pre-backward, once unsharded): each parameter's `.grad` is
//      pointed at its place in one zeroed flat buffer, and autograd accumulates into it in place
//      (no full-shape gradient per parameter, no copy). Only when gradients are reduced in the
//      compute dtype; otherwise autograd's gradients are copied in, converted, at step 3.
//   3. reduce(sync) (after the unit's backward): the flat gradient is taken out of the parameters.
//      With sync it is reduce-scattered (SUM, pre-divided for 16-bit dtypes; all-reduced without
//      sharding; nothing on one rank) on the reduce stream, together with the gradients
//      accumulated without sync. Without sync it is added to the padded no-sync accumulator in the
//      reduce dtype, and no collective is issued.
//   4. finalize() (when the runtime issues the next unit's reduction, or at the end of backward):
//      waits for the reduction, frees its input, casts to the parameters' dtype, divides what is
//      left, all-reduces across the replicate group (HSDP), moves to the shard's device (host with
//      offload), adds the set-aside gradient and points each `.grad` at its slice. Under HSDP
//      without requires_all_reduce, the gradient is added to the replicate partial instead (no
//      all-reduce, `.grad` untouched); the next finalize() with it adds the partial in before the
//      all-reduce.
//   5. commit() (end of a successful pass) or discard() (a failed one): the set-aside gradient is
//      forgotten (restored when no synchronised reduction set `.grad`), or every buffer of the
//      pass is freed and the gradients held before it restored (the replicate partial too).
//
// Invariants:
//   - At most one reduction is in flight per FlatParameter: reduce() finalizes the previous one
//     first. Its input is held until the compute stream has waited for it ([Note: streams]).
//   - The parameters' `.grad` are the truth about the sharded gradient (nothing here keeps a
//     reference to it, so zero_grad with set_to_none frees it): sharded() reads it back from them.
//   - The set-aside gradient lives from prepare_for_backward() to commit() or discard(), so a
//     failed pass can restore it.
//   - accumulated() is this rank's own sum over the passes without sync, padded, in the reduce
//     dtype on the compute device; the next synchronised reduce() adds it in and drops it.
//   - replicate_partial() ([Note: gradient divide factor and replicate partial]) is the sum of
//     the shard-group gradients of this rank's shard (already divided as the shard group divides
//     them) over the passes that skipped the replicate all-reduce, shard-sized, in the parameters'
//     dtype on the compute device, never part of `.grad`; the next finalize() with the all-reduce
//     adds it in. What it held before a pass changed it is kept until the pass is committed, so
//     that discard() restores it.
//
// [Note: asynchronous replicate all-reduce] Under HSDP, a pass that all-reduces across the
// replicate group (requires_all_reduce) with no replicate partial to add issues that all-reduce
// on the reduce-scatter's output itself, in the reduce dtype (half the bytes of the parameters'
// dtype with a 16-bit reduce dtype), when the runtime finalizes the unit (as the next unit's
// reduction is issued), without waiting; the end of backward waits for it, casts, divides and
// sets `.grad`. The division covers the whole data-parallel size (shard x replicate ranks, or the
// custom factor): a power-of-two part before the reduce-scatter for 16-bit dtypes, the rest after
// the all-reduce. A pass with a replicate partial to add all-reduces as before: in the
// parameters' dtype, after finalize's cast, waited for inline.
//
// [Note: gradient divide factor and replicate partial] By default a FlatParameter's reduced
// gradient is the sum over the data-parallel ranks divided by their number: the shard group's
// size S (split into a factor before the reduction and one after it for 16-bit reduce dtypes, so
// the sum neither overflows nor underflows), then the replicate group's size R under HSDP, after
// its all-reduce. set_divide_factor(f) replaces that whole division (S x R under HSDP) by f: the
// gradient is the sum over every data-parallel rank divided by f, split the same way (f's largest
// power-of-two factor up to about its square root before a 16-bit reduction, the rest after the
// reduction in the parameters' dtype), and nothing is divided after the replicate all-reduce. The
// factor in effect when a pass's reduction is issued is the one that pass's gradients get.
// set_requires_all_reduce(false) (HSDP micro-batches): the reduce-scatter inside the shard group
// still runs every pass, but finalize() adds its divided output to the replicate partial instead
// of all-reducing it across the replicate group, and leaves `.grad` as it was (gradients already
// fully reduced, e.g. kept from an earlier step without zero_grad, are never all-reduced again).
// The next pass with the all-reduce adds the partial to its own output, all-reduces the sum once,
// divides, and adds the set-aside gradient. Gradients accumulated without sync (reduce(false))
// are not reduce-scattered at all, so the flag does not apply to them; they enter the next
// synchronised pass's reduce-scatter and through it the partial or the all-reduce. Without a
// replicate group (replicated() false) the flag changes nothing.
//
// [Note: quantized gradient reduction] With a reduce codec (FlatParamHandleOptions::reduce_codec;
// DeepSpeed ZeRO++'s qgZ) and a shard group of W > 1 ranks, step 3 replaces the reduce-scatter by
// an all-to-all: the padded flat gradient (reduce dtype, after the pre-division) is encoded as W
// rows of shard_numel elements, row j being rank j's shard ([Note: communication codecs] in
// fsdp/comm_codec.h), and comm::Communicator::all_to_all_single sends row j to rank j. The codec
// is given the FlatParameter's row layout (reduce_rows(): W shards of shard_numel, a tensor start
// at each parameter's offset; [Note: codec row layouts]), the same on every rank since it derives
// from the FlatParameter's layout only, and a rounding seed (codec_rounding_seed of the unit's and
// the first parameter's FQNs, this FlatParameter's count of encoded reductions, and this rank's
// data-parallel index, replicate rank x W + shard rank: [Note: stochastic rounding of
// gradients]); every row of both directions has encoded_reduce_bytes() bytes. Step 4 decodes the
// W rows this rank received (each one its own shard, as rank r encoded it) into float32 and sums
// them (in float32, whatever the reduce dtype), then goes on as after a reduce-scatter: the cast
// to the parameters' dtype, the post-division, HSDP's replicate partial or all-reduce (not
// encoded), offload, the set-aside gradient. Everything else is unchanged: gradients accumulated
// without sync are added (in the reduce dtype, unencoded) before encoding, so one rounding covers
// the whole accumulation; the divide factor splits as before; discard() drops the encoded buffers
// with the rest (stochastic rounding keeps no state: nothing to checkpoint or to discard). Bytes:
// the all-to-all carries W x encoded_reduce_bytes() where the reduce-scatter carried padded_numel
// x the reduce dtype's size. Error, with int8_block_codec: blocks never span two parameters, and
// each element of the reduced gradient is the exact one plus
//   (1 / divisor) x sum over the shard group's ranks r of e_r,
// e_r independent across ranks and steps, zero-mean, |e_r| < absmax_r(block) / 127 and
// E[e_r^2] <= (absmax_r(block) / 127)^2 / 4 (absmax_r(block): the largest magnitude in the
// element's block of rank r's pre-divided gradient chunk, a block lying within one parameter;
// divisor: the post-division, the data-parallel size by default; bfloat16 scales 2^-7 more; plus
// float32 rounding). So the reduced gradient is unbiased, within the mean over ranks of the
// block's absmax / 127 in every step, and after T steps of SGD at learning rate lr (gradients
// that do not depend on the parameters' path, or to first order) a parameter is off the
// unquantized run by a zero-mean sum whose standard deviation is at most
//   lr / (2 x divisor) x sqrt(sum over steps t and ranks r of (absmax_{r,t}(block) / 127)^2).
// quantized_comm_bias_test checks both against the unquantized run. Under HSDP the replicate
// all-reduce sums R such errors. On one rank (and NO_SHARD, which refuses codecs) nothing is
// encoded.

#include <memory>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/fsdp/comm_codec.h"
#include "fsdp_cpp/fsdp/device_streams.h"
#include "fsdp_cpp/fsdp/flat_param_options.h"
#include "fsdp_cpp/fsdp/flat_param_storage.h"

namespace fsdp {

class FlatParamGrad {
 public:
  /// `storage` must outlive this object; `comm` is the group gradients are reduced in (the shard
  /// group), `options` gives the reduce dtype and the replicate group. `initial_grads` (full-shape,
  /// per parameter, undefined where none: FlatParamStorage::take_initial_grads()) become the
  /// sharded gradient when the parameters require gradients.
  FlatParamGrad(const FlatParamStorage& storage, std::shared_ptr<comm::Communicator> comm,
                const FlatParamHandleOptions& options, std::shared_ptr<DeviceStreams> streams,
                std::vector<at::Tensor> initial_grads);

  FlatParamGrad(const FlatParamGrad&) = delete;
  FlatParamGrad& operator=(const FlatParamGrad&) = delete;

  c10::ScalarType reduce_dtype() const { return reduce_dtype_; }
  /// The codec gradients are reduced in ([Note: quantized gradient reduction]), or null; also when
  /// set but unused (not sharded across more than one rank).
  const std::shared_ptr<const CommCodec>& reduce_codec() const { return reduce_codec_; }
  /// Whether step 3 is an all-to-all of encoded chunks (a reduce codec, sharded over W > 1 ranks).
  bool reduces_encoded() const { return reduce_codec_ && storage_.sharded() && comm_->size() > 1; }
  /// The row layout the reduce codec encodes with ([Note: quantized gradient reduction]): W shards
  /// of shard_numel, a tensor start at each parameter's offset, rows 0..W-1, no seed.
  CodecRowLayout reduce_rows() const;
  /// Bytes of each row the all-to-all sends and receives, 0 unless reduces_encoded().
  int64_t encoded_reduce_bytes() const;
  /// Hybrid sharding with more than one replica: finalize() all-reduces across the replicas.
  bool replicated() const { return replicate_ && replicate_->size() > 1; }

  /// [Note: gradient divide factor and replicate partial]. `factor` (finite, > 0; checked by the
  /// caller) replaces the division by the data-parallel size; nullopt restores it.
  void set_divide_factor(std::optional<double> factor) { divide_factor_ = factor; }
  const std::optional<double>& divide_factor() const { return divide_factor_; }
  /// Whether finalize() all-reduces across the replicate group (HSDP); false keeps the
  /// reduce-scattered gradient in the replicate partial. No effect without a replicate group.
  void set_requires_all_reduce(bool all_reduce) { requires_all_reduce_ = all_reduce; }
  bool requires_all_reduce() const { return requires_all_reduce_; }

  /// Step 1. Idempotent within one pass.
  void prepare_for_backward();
  /// Step 2. No-op when already done this pass.
  void prepare_buffer();
  /// Step 3.
  void reduce(bool sync);
  /// Step 4. No-op when no reduction is pending. Under HSDP with the all-reduce this pass and no
  /// replicate partial ([Note: asynchronous replicate all-reduce]), the first call waits for the
  /// reduce-scatter and issues the replicate all-reduce without waiting; `finish` (the end of
  /// backward) waits for it and sets `.grad`. Without `finish` `.grad` may not be set yet.
  void finalize(bool finish = true);
  /// Whether no reduction is pending, or the pending one has completed (finalize would not wait).
  bool reduction_completed() const {
    return (!pending_reduce_.valid() || pending_reduce_.completed()) &&
           (!pending_replicate_.valid() || pending_replicate_.completed());
  }
  /// Step 5, success.
  void commit();
  /// Waits for a reduction in flight (the compute stream then waits for it too).
  void wait_for_reduction();
  /// Step 5, failure: waits for a reduction in flight, frees every gradient buffer of the pass and
  /// restores the gradients held before it (gradients accumulated without sync that this pass
  /// added to are dropped; the replicate partial is what it was before the pass).
  void discard();

  /// [Note: discarding accumulated gradients] in fsdp/zero_grad.h: drops the no-sync accumulator
  /// and the replicate partial (the gradients of backward passes not yet reduced, or not yet
  /// all-reduced across the replicas), outside a backward pass (nothing prepared or in flight:
  /// refused otherwise, naming the unit). Local. Returns whether either held gradients. `.grad`
  /// is the caller's (FSDPModule::zero_grad sets it to none or zeroes it).
  bool drop_accumulated();

  /// The no-sync accumulator (see the invariants), or undefined.
  const at::Tensor& accumulated() const { return accumulated_grad_; }
  /// The replicate partial (see the invariants), or undefined.
  const at::Tensor& replicate_partial() const { return replicate_partial_; }
  /// The sharded gradient (1-D over the storage the parameters' `.grad` views share), or undefined
  /// when the parameters' `.grad` are not (all) such views.
  at::Tensor sharded() const;
  /// Bytes of the sharded gradient (or, when not one flat gradient, of the parameters' `.grad`),
  /// of the no-sync accumulator, of the replicate partial (during a pass that changed it, plus the
  /// one it began with, until commit()), and of the unsharded buffers of a pass
  /// now alive (the flat buffer autograd accumulates into, the input and output of a reduction not
  /// yet finalized).
  size_t sharded_bytes() const;
  size_t accumulated_bytes() const;
  size_t replicate_partial_bytes() const;
  size_t buffer_bytes() const;

 private:
  void set_sharded_views(const at::Tensor& grad);
  // finalize()'s steps: the reduction's output into `.grad` (or, under the asynchronous replicate
  // all-reduce, into its issue); that all-reduce's output into `.grad`.
  void finish_reduction();
  void finish_replicate_all_reduce();
  // `grad` (the new sharded gradient, on the shard's device) plus the set-aside one, as `.grad`.
  void set_grad(at::Tensor grad);
  // Takes this pass's unsharded gradients out of the parameters as one padded flat tensor in the
  // reduce dtype (the preset buffer, or a copy), leaving `.grad` unset.
  at::Tensor take_unsharded();

  const FlatParamStorage& storage_;
  std::shared_ptr<comm::Communicator> comm_;
  std::shared_ptr<comm::Communicator> replicate_;  // HSDP's replicate group, or null
  std::shared_ptr<DeviceStreams> streams_;          // [Note: streams]
  c10::ScalarType reduce_dtype_;
  at::Tensor saved_grad_;             // set aside before backward, added after the reduction
  at::Tensor grad_buffer_;            // 1-D [padded_numel]: autograd accumulates into it, or undefined
  at::Tensor accumulated_grad_;       // 1-D [padded_numel]: unsynchronised gradients, or undefined
  at::Tensor reduce_output_;          // reduction in flight: output
  at::Tensor reduce_input_;           // reduction in flight: padded unsharded gradient
  at::Tensor encoded_input_;          // quantized reduction in flight: [W x encoded] uint8 sent
  std::shared_ptr<const CommCodec> reduce_codec_;  // [Note: quantized gradient reduction], or null
  bool reduce_encoded_ = false;       // reduce_output_ holds [W x encoded] received rows to decode
  uint64_t encoded_reductions_ = 0;   // encoded reductions issued: the rounding streams' step
  at::Tensor replicate_partial_;      // 1-D [shard_numel]: HSDP passes without the all-reduce, or undefined
  comm::PendingCollective pending_reduce_;
  at::Tensor replicate_output_;       // asynchronous replicate all-reduce in flight: its tensor
  comm::PendingCollective pending_replicate_;
  bool replicate_in_reduce_dtype_ = false;  // this pass's reduction all-reduces asynchronously
  std::optional<double> divide_factor_;  // replaces the division by the data-parallel size
  double post_divide_ = 1.0;          // the division left after the reduction in flight
  double replicate_divide_ = 1.0;     // the division after the replicate all-reduce in flight
  bool requires_all_reduce_ = true;
  at::Tensor partial_at_pass_start_;     // replicate_partial_ before this pass changed it
  bool partial_changed_in_pass_ = false;  // this backward pass added to or all-reduced the partial
  bool grads_prepared_ = false;
  bool accumulated_in_pass_ = false;  // this backward pass added to accumulated_grad_
  bool finalized_in_pass_ = false;    // this backward pass set a new sharded gradient
};

}  // namespace fsdp
