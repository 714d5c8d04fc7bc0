#pragma once
// FlatParamStorage: one FlatParameter's memory and the original parameters' views of it. Local
// only: no collective and no stream is touched here (FlatParamHandle issues the all-gather into
// padded_unsharded() and frees it through its streams).
//
// [Note: original parameters] The original parameters keep their identity (the same at::Tensor
// objects the module and the optimizer hold, with their names): only their data is re-pointed with
// `set_data`, so they stay leaves and keep requires_grad.
//   - sharded:   each original parameter is a flattened 1-D view of its slice of the local shard
//                (an empty view where this rank holds none of it); `.grad` is the matching 1-D
//                view of the sharded gradient (FlatParamGrad). The optimizer updates the shard in
//                place.
//   - unsharded: each original parameter is a full-shape view of the padded unsharded buffer
//                (filled by an all-gather of the local shards).
// Without sharding (NO_SHARD, and on one rank) the "shard" is the whole FlatParameter, parameters
// are always full-shape views of it, and sharded_shape(i) is the full shape.
//
// Invariants:
//   - local_shard() is 1-D [layout().shard_numel()] in the parameters' dtype, on the shard's
//     device (host memory with CPU offload), allocated once at construction and never replaced:
//     the optimizer's parameters are views of it.
//   - padded_unsharded() is 1-D [layout().padded_numel] in the compute dtype on the compute
//     device (size 0 when no unsharded buffer is needed: NO_SHARD in full precision without
//     offload). Its storage is freed on reshard and re-grown on unshard, in place (see
//     fsdp/storage_resize.h), so views autograd saved for backward stay valid across the two.
//   - is_unsharded() says which of the two forms the parameters are in; only use_sharded_views()
//     and use_unsharded_views() change it.
//   - Meta parameters become real at construction, sharded, in place: only this rank's slice of
//     their values is ever allocated.

#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/fsdp/flat_param_layout.h"
#include "fsdp_cpp/fsdp/flat_param_options.h"

namespace fsdp {

class FlatParamStorage {
 public:
  struct OrigParam {
    std::string fqn;   // relative to the unit's module
    at::Tensor param;  // the original parameter object
  };

  /// Takes over the storage of `params` (all of one dtype, one device, and one requires_grad;
  /// every rank holding the same full values): copies this rank's shard out of them and leaves
  /// them sharded, their `.grad` unset (what they held: take_initial_grads()). Parameters on the
  /// meta device (any mix with others) get their slices from `options.meta_values` and become
  /// real, sharded, in place. `comm` gives the world size and rank the FlatParameter is laid out
  /// for; `unit_fqn` names the unit in errors.
  FlatParamStorage(std::vector<OrigParam> params, const std::shared_ptr<comm::Communicator>& comm,
                   std::string unit_fqn, const FlatParamHandleOptions& options);

  FlatParamStorage(const FlatParamStorage&) = delete;
  FlatParamStorage& operator=(const FlatParamStorage&) = delete;

  /// The full-shape gradients the parameters held before construction (undefined where none),
  /// once: moved out.
  std::vector<at::Tensor> take_initial_grads() { return std::move(initial_grads_); }

  const FlatParamLayout& layout() const { return layout_; }
  const std::vector<OrigParam>& params() const { return params_; }
  /// Per original parameter, this rank's slice of it (maybe empty).
  const ShardSlice& slice(size_t i) const { return slices_[i]; }
  /// The shape of parameter i while sharded: 1-D slice, or the full shape without sharding.
  std::vector<int64_t> sharded_shape(size_t i) const;
  const std::string& unit_fqn() const { return unit_fqn_; }
  void set_unit_fqn(std::string fqn) { unit_fqn_ = std::move(fqn); }
  /// Sharded across more than one rank (false for NO_SHARD, and on one rank).
  bool sharded() const { return shard_; }
  bool requires_grad() const { return requires_grad_; }
  c10::ScalarType compute_dtype() const { return compute_dtype_; }
  at::Device compute_device() const { return compute_device_; }
  /// This rank's shard of the FlatParameter (1-D, layout().shard_numel() elements).
  const at::Tensor& local_shard() const { return local_shard_; }

  // --- The two forms of the parameters ---
  bool is_unsharded() const { return unsharded_; }
  /// Makes the original parameters views of the local shard.
  void use_sharded_views();
  /// Makes the original parameters full-shape views of the padded unsharded buffer.
  void use_unsharded_views();
  /// The same while the buffer's storage is freed (set_unshard_in_backward(false)): views built
  /// without LibTorch's bounds check, whose values must not be read (their data pointer is null:
  /// LibTorch refuses to read them) until the buffer is grown.
  void use_unsharded_views_without_data();
  /// Checks that requires_grad did not change and, while unsharded, that every parameter is still
  /// its view of the unsharded buffer.
  void check_params_unchanged() const;
  /// Copies the data of parameters replaced while sharded (same dtype, device and sharded shape)
  /// into the shard and makes them views of it again.
  void write_back_replaced_data();

  // --- The padded unsharded buffer ---
  /// Whether parameters need a buffer apart from the shard: sharded, mixed precision or offload.
  bool needs_unsharded_buffer() const;
  const at::Tensor& padded_unsharded() const { return padded_unsharded_; }
  /// Grows the unsharded buffer's storage to its full size (contents undefined).
  void grow_unsharded_buffer();
  /// The tensor to all-gather: the shard copied (asynchronously) into the compute dtype on the
  /// compute device when it is not that already (mixed precision, offload), else the shard.
  const at::Tensor& gather_input();
  /// Without sharding: fills the grown unsharded buffer from the shard (a cast or copy).
  void copy_shard_to_unsharded();
  /// Bytes held now by the padded unsharded buffer (0 when resharded).
  size_t unsharded_bytes() const;

  /// The version counters of the shard and of the parameters (which write it while sharded).
  int64_t shard_version() const;

  /// Whether `t` is the contiguous tensor of `shape` at element `offset` of `base`'s storage.
  static bool is_view_at(const at::Tensor& t, const at::Tensor& base, int64_t offset,
                         const std::vector<int64_t>& shape);
  /// A tensor of `shape` over elements from `offset` of `flat`'s storage that autograd does not
  /// track as a view: optimizers call `grad.detach_()` in zero_grad, which views refuse.
  static at::Tensor storage_slice(const at::Tensor& flat, int64_t offset,
                                  const std::vector<int64_t>& shape);

 private:
  std::string unit_fqn_;
  std::vector<OrigParam> params_;
  FlatParamLayout layout_;
  std::vector<ShardSlice> slices_;    // per original parameter, this rank's slice (maybe empty)
  at::Tensor local_shard_;            // 1-D [shard_numel]
  at::Tensor compute_shard_;          // 1-D [shard_numel] in compute_dtype_ on the compute device,
                                      // when the shard is not that already (mixed precision, offload)
  at::Device compute_device_ = at::kCPU;
  at::Tensor padded_unsharded_;       // 1-D [padded_numel]; storage freed while resharded
  std::vector<at::Tensor> initial_grads_;  // until take_initial_grads()
  c10::ScalarType compute_dtype_;
  bool mixed_precision_ = false;
  bool offload_to_cpu_ = false;
  bool unsharded_ = false;
  bool requires_grad_ = false;
  bool shard_ = true;                 // sharded across more than one rank
};

}  // namespace fsdp
