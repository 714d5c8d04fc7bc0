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
//      offload), adds the set-aside gradient and points each `.grad` at its slice.
//   5. commit() (end of a successful pass) or discard() (a failed one): the set-aside gradient is
//      forgotten (restored when no synchronised reduction ran), or every buffer of the pass is
//      freed and the gradients held before it restored.
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

#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "fsdp_cpp/comm/communicator.h"
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
  /// Hybrid sharding with more than one replica: finalize() all-reduces across the replicas.
  bool replicated() const { return replicate_ && replicate_->size() > 1; }

  /// Step 1. Idempotent within one pass.
  void prepare_for_backward();
  /// Step 2. No-op when already done this pass.
  void prepare_buffer();
  /// Step 3.
  void reduce(bool sync);
  /// Step 4. No-op when no reduction is pending.
  void finalize();
  /// Whether no reduction is pending, or the pending one has completed (finalize would not wait).
  bool reduction_completed() const { return !pending_reduce_.valid() || pending_reduce_.completed(); }
  /// Step 5, success.
  void commit();
  /// Waits for a reduction in flight (the compute stream then waits for it too).
  void wait_for_reduction();
  /// Step 5, failure: waits for a reduction in flight, frees every gradient buffer of the pass and
  /// restores the gradients held before it (gradients accumulated without sync that this pass
  /// added to are dropped).
  void discard();

  /// The no-sync accumulator (see the invariants), or undefined.
  const at::Tensor& accumulated() const { return accumulated_grad_; }
  /// The sharded gradient (1-D over the storage the parameters' `.grad` views share), or undefined
  /// when the parameters' `.grad` are not (all) such views.
  at::Tensor sharded() const;
  /// Bytes of the sharded gradient (or, when not one flat gradient, of the parameters' `.grad`),
  /// of the no-sync accumulator, and of the unsharded buffers of a pass now alive (the flat buffer
  /// autograd accumulates into, the input and output of a reduction not yet finalized).
  size_t sharded_bytes() const;
  size_t accumulated_bytes() const;
  size_t buffer_bytes() const;

 private:
  void set_sharded_views(const at::Tensor& grad);
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
  comm::PendingCollective pending_reduce_;
  double post_divide_ = 1.0;          // the division left after the reduction in flight
  bool grads_prepared_ = false;
  bool accumulated_in_pass_ = false;  // this backward pass added to accumulated_grad_
  bool finalized_in_pass_ = false;    // this backward pass set a new sharded gradient
};

}  // namespace fsdp
