#pragma once
// FlatParamHandle: owns one FlatParameter's storage and moves the original parameters between
// their sharded and unsharded forms. One handle per FlatParameter;
// FSDPState coordinates the handles of a unit.
//
// [Note: original parameters] The original parameters keep their identity (the same at::Tensor
// objects the module and the optimizer hold, with their names): only their data is re-pointed with
// `set_data`, so they stay leaves and keep requires_grad.
//   - sharded:   each original parameter is a flattened 1-D view of its slice of the local shard
//                (an empty view where this rank holds none of it); `.grad` is the matching 1-D
//                view of the sharded gradient. The optimizer updates the shard in place.
//   - unsharded: each original parameter is a full-shape view of the padded unsharded buffer
//                (filled by an all-gather of the local shards).
// The padded unsharded buffer's storage is freed on reshard and re-grown on unshard, in place (see
// fsdp/storage_resize.h), so views autograd saved for backward stay valid across the two.
// Without sharding (NO_SHARD) the "shard" is the whole FlatParameter, parameters are always
// full-shape views of it, and gradients are all-reduced instead of reduce-scattered.
//
// Gradients: at the handle's pre-backward each unsharded parameter's `.grad` is pointed at its
// place in one zeroed flat buffer, and autograd accumulates into it in place (no full-shape
// gradient per parameter, no copy; with a reduce dtype other than the compute dtype, autograd's
// gradients are copied in instead). After the unit's backward, `reduce_gradients()` reduce-scatters
// that buffer (SUM, then divided by the world size), and `finalize_gradients()` frees it, adds the
// sharded gradient set aside before backward (accumulation without set_to_none, or several
// backward passes), and points each `.grad` at its slice of the new sharded gradient. The runtime
// finalizes each unit's reduction when it issues the next one, so at most two units' unsharded
// gradients are alive at once. Without gradient sync, the flat gradients are accumulated in a
// padded buffer that the next synchronised reduction adds in (no collective until then).
// On one rank nothing is communicated: the handle runs as NO_SHARD and the flat gradient is the
// sharded gradient.

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "comm/communicator.h"
#include "fsdp/device_streams.h"
#include "fsdp/flat_param_layout.h"

namespace fsdp {

struct FlatParamHandleOptions {
  /// false: NO_SHARD (replicated parameters, all-reduced gradients).
  bool shard = true;
  /// Where the shard lives (default: the parameters' device). A model built on the CPU moves only
  /// its shards to the target device.
  std::optional<at::Device> device;
  /// Hybrid sharding: the replicate group across which the sharded gradient is all-reduced after
  /// the reduce-scatter inside the handle's (shard group) communicator. Null otherwise.
  std::shared_ptr<comm::Communicator> replicate;
  /// Mixed precision: the dtype parameters are all-gathered and computed in (a low-precision copy
  /// of the shard; the shard itself, the gradients after sync and the optimizer state stay in the
  /// parameters' dtype). Unset: the parameters' dtype.
  std::optional<c10::ScalarType> param_dtype;
  /// The dtype gradients are reduced in. Unset: param_dtype if set, else the parameters' dtype.
  std::optional<c10::ScalarType> reduce_dtype;
  /// CPU offload: the shard and the sharded gradient live in host memory (pinned when computing on
  /// CUDA), so the optimizer steps on the host; the shard is copied to `device` to be all-gathered
  /// and the reduced gradient copied back.
  bool offload_to_cpu = false;
  /// Parameters on the meta device (built under fsdp::MetaInitGuard, init/meta_init.h): returns
  /// the full values of one (any device; `fqn` as in OrigParam). Called once per meta parameter
  /// this rank holds part of, while the shard is filled; nothing else of the parameter is ever
  /// allocated. Unset: meta parameters are refused.
  std::function<at::Tensor(const std::string& fqn, const at::Tensor& param)> meta_values;
};

class FlatParamHandle {
 public:
  struct OrigParam {
    std::string fqn;   // relative to the unit's module
    at::Tensor param;  // the original parameter object
  };

  /// Takes over the storage of `params` (all of one dtype, one device, and one requires_grad;
  /// every rank holding the same full values): copies this rank's shard out of them and leaves
  /// them sharded. Parameters on the meta device (any mix with others) get their slices from
  /// `options.meta_values` and become real, sharded, in place (the same tensor objects). `unit_fqn` names the unit in errors and traces.
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
  void reshard();
  bool is_unsharded() const { return unsharded_; }
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
  bool is_sharded_strategy() const { return shard_; }
  /// The dtype the parameters are all-gathered and computed in, and the one gradients are reduced in.
  c10::ScalarType compute_dtype() const { return compute_dtype_; }
  c10::ScalarType reduce_dtype() const { return reduce_dtype_; }

  /// Start of a backward pass: sets aside the sharded gradients the original parameters still
  /// hold (from an earlier backward without set_to_none, or replaced by the user: written back),
  /// and clears `.grad` so autograd can write full-shape gradients. Idempotent within one pass.
  void prepare_gradients_for_backward();
  /// At the handle's pre-backward, once unsharded: points each parameter's `.grad` at its place
  /// in a zeroed flat gradient buffer, so autograd accumulates into it in place (when gradients
  /// are reduced in the compute dtype). No-op when already done this pass.
  void prepare_gradient_buffer();
  /// After this handle's backward. With `sync`: issues the reduce-scatter (all-reduce without
  /// sharding; nothing on one rank) of the unsharded gradients; `finalize_gradients()` waits for
  /// it and sets `.grad`. Without: accumulates them locally (in the reduce dtype: low precision
  /// with mixed precision), no collective.
  void reduce_gradients(bool sync = true);
  /// Waits for the reduction issued by reduce_gradients(), frees its input and points `.grad` at
  /// the new sharded gradient (plus the set-aside one). No-op when none is pending.
  void finalize_gradients();
  /// Whether no reduction is pending, or the pending one has completed (finalize would not wait).
  bool reduction_completed() const { return !pending_reduce_.valid() || pending_reduce_.completed(); }
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

  /// The gradients accumulated without sync and not reduced yet: this rank's own local sum over
  /// those backward passes, 1-D padded [padded_numel] in the reduce dtype on the compute device
  /// (parameter i at layout().entries[i].offset), or undefined when there are none. Read by
  /// summon_full_params (composable/summon_full_params.h); not to be modified.
  const at::Tensor& accumulated_grad() const { return accumulated_grad_; }

  /// Whether the parameters require gradients (a handle holds only trainable or only frozen ones).
  bool requires_grad() const { return requires_grad_; }

  const FlatParamLayout& layout() const { return layout_; }
  const std::vector<OrigParam>& params() const { return params_; }
  const std::string& unit_fqn() const { return unit_fqn_; }
  void set_unit_fqn(std::string fqn) { unit_fqn_ = std::move(fqn); }
  /// This rank's shard of the FlatParameter (1-D, layout().shard_numel() elements).
  const at::Tensor& local_shard() const { return local_shard_; }
  /// The sharded gradient (1-D over the storage the parameters' `.grad` views share), or undefined
  /// when the parameters' `.grad` are not (all) such views (none yet, set to none by zero_grad,
  /// replaced by the user).
  at::Tensor sharded_grad() const;
  /// Bytes held now by: the padded unsharded buffer (0 when resharded), the sharded gradient, the
  /// gradients accumulated without sync.
  size_t unsharded_bytes() const;
  size_t sharded_grad_bytes() const;  // or, when not one flat gradient, the parameters' `.grad`
  size_t accumulated_grad_bytes() const;
  /// Bytes of the unsharded gradient buffers of a backward pass now alive: the flat buffer autograd
  /// accumulates into, and the input and output of a reduction not yet finalized.
  size_t gradient_buffer_bytes() const;

 private:
  bool needs_unsharded_buffer() const;
  // Frees the padded unsharded buffer's storage (after the compute work enqueued so far).
  void release_unsharded_buffer();
  void use_sharded_views();
  void use_unsharded_views();
  void write_back_replaced_data();
  void check_params_unchanged() const;
  void set_sharded_grad_views(const at::Tensor& grad);
  // Takes this pass's unsharded gradients out of the parameters as one padded flat tensor in the
  // reduce dtype (the preset buffer, or a copy), leaving `.grad` unset.
  at::Tensor take_unsharded_gradients();
  // The shape of parameter i while sharded: 1-D slice, or the full shape without sharding.
  std::vector<int64_t> sharded_shape(size_t i) const;
  // The version counters of the shard and of the parameters (which write it while sharded).
  int64_t shard_version() const;
  // Whether the shard was written since the last all-gather or begin_iteration() (asynchronous
  // streams only: false inline), and remembers the current version.
  bool shard_written_since_gathered();

  std::string unit_fqn_;
  std::vector<OrigParam> params_;
  std::shared_ptr<comm::Communicator> comm_;
  FlatParamHandleOptions options_;
  FlatParamLayout layout_;
  std::vector<ShardSlice> slices_;    // per original parameter, this rank's slice (maybe empty)
  at::Tensor local_shard_;            // 1-D [shard_numel]
  at::Tensor compute_shard_;          // 1-D [shard_numel] in compute_dtype_ on the compute device,
                                      // when the shard is not that already (mixed precision, offload)
  at::Device compute_device_ = at::kCPU;
  std::shared_ptr<DeviceStreams> streams_;  // [Note: streams]
  at::Tensor padded_unsharded_;       // 1-D [padded_numel]; storage freed while resharded
  at::Tensor saved_grad_;             // set aside before backward, added after the reduction
  at::Tensor grad_buffer_;            // 1-D [padded_numel]: autograd accumulates into it, or undefined
  at::Tensor accumulated_grad_;       // 1-D [padded_numel]: unsynchronised gradients, or undefined
  at::Tensor reduce_output_;          // reduction in flight: output
  at::Tensor reduce_input_;           // reduction in flight: padded unsharded gradient
  comm::PendingCollective pending_unshard_;
  comm::PendingCollective pending_reduce_;
  c10::ScalarType compute_dtype_;
  c10::ScalarType reduce_dtype_;
  bool mixed_precision_ = false;
  double post_divide_ = 1.0;          // the division left after the reduction in flight
  bool unsharded_ = false;
  bool grads_prepared_ = false;
  bool requires_grad_ = false;
  bool shard_ = true;                 // sharded across more than one rank
  bool accumulated_in_pass_ = false;  // this backward pass added to accumulated_grad_
  bool finalized_in_pass_ = false;    // this backward pass set a new sharded gradient
  int64_t gathered_shard_version_ = -1;  // shard_version() at the last all-gather issue
};

}  // namespace fsdp
