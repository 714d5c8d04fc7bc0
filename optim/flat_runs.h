#pragma once
// Runs: the parameters of one optimizer param group that an optimizer can step as one tensor.
//
// [Note: flat runs] A run is a maximal sequence of consecutive parameters of one param group,
// each with a defined, dense gradient and at least one element, such that:
//   - their data are contiguous tensors of one dtype on one device, in one storage, in order,
//     each starting at most 15 bytes after the previous one ends (`max_gap_bytes`);
//   - their gradients likewise lie in one storage (not the data's), contiguous, in the dtype of
//     the data, at the same offsets relative to the first gradient as the data's to the first
//     parameter's.
// A FlatParameter's shard (fsdp/flat_param_storage.h, [Note: original parameters]) is one such
// storage: while sharded, its original parameters are 1-D views of their slices, in order, with
// at most alignment padding between them (fsdp/flat_param_layout.h: each parameter starts at a
// multiple of 16 bytes), and their `.grad` are views of one flat sharded gradient
// (fsdp/flat_param_grad.h) at the same offsets. So are its full-shape views without sharding.
//
// The gaps between members are padding, stepped along with the members (the run's tensors span
// from the first member's first element to the last member's last). That is harmless:
//   - every op of the optimizers is elementwise, so no member's value depends on a padding
//     element, and the state views of the members (the per-parameter state torch::optim and the
//     state dicts see) never cover padding;
//   - a gap narrower than the 16-byte alignment cannot hold another parameter (a parameter the
//     optimizer does not hold, or holds in another group, starts at an aligned offset, so the
//     gap around it is at least 16 bytes wide and splits the run);
//   - in a FlatParameter the padding is zero in the shard (allocated with zeros, never viewed by
//     a parameter) and in the sharded gradient (flat_param_grad.cc writes zeros wherever no
//     parameter's gradient goes), and the runs' state buffers are allocated with zeros; with
//     zero data, gradient and state every update leaves the padding zero (Adam/AdamW:
//     exp_avg = exp_avg_sq = 0, denominator = eps > 0, update 0; SGD: update 0). With eps == 0
//     the denominator would be 0 and the padding NaN, so Adam and AdamW with eps == 0 allow no
//     gap at all (`max_gap_bytes` 0). Nothing reads the padding either way: the all-gather
//     copies it into the unsharded buffer's padding, which no parameter views.
// Parameters that share a storage with gaps narrower than 16 bytes outside fully_shard (a
// user's own flat buffer) are treated the same way: such gaps must hold nothing else.
//
// Everything else is a run of one parameter, stepped as torch::optim steps it, on its own
// tensors.

#include <cstddef>
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

namespace fsdp::optim {

/// Padding allowed between the members of a run, in bytes (below fsdp's 16-byte alignment).
inline constexpr int64_t kMaxRunGapBytes = 15;

/// Parameters of one param group stepped together ([Note: flat runs]).
struct ParamRun {
  std::vector<size_t> members;   // indices into the group's parameters, in order
  std::vector<int64_t> offsets;  // per member, the element offset of its data from the first's
  int64_t numel = 0;             // elements from the first member's first to the last's end
  /// One member: the parameter and its gradient themselves. Several: 1-D tensors over the span
  /// (sharing the storages; fresh version counters, autograd does not see them).
  at::Tensor param;
  at::Tensor grad;
  /// Whether the members could join a pack (optim/flat_packs.h): strided, contiguous, dense
  /// gradients of the data's dtype and device, in storages apart from the data's.
  bool packable = false;
  /// A pack: `param` and `grad` are copies (gathered), written back after the step.
  bool gathered = false;

  /// Stepped as one tensor: several members, or a pack.
  bool flat() const { return members.size() > 1 || gathered; }
};

/// The runs of `params` (one param group, in order); parameters without a gradient are in none.
/// A parameter with a sparse gradient is a run of its own (the optimizer refuses it as
/// torch::optim does).
std::vector<ParamRun> find_runs(const std::vector<at::Tensor>& params, int64_t max_gap_bytes = kMaxRunGapBytes);

/// A tensor of `sizes` (contiguous strides) over `base`'s storage from element `offset` of the
/// storage, of `base`'s dtype, that autograd does not track as a view. Built without the
/// dispatcher: the optimizers make a few per run and step.
at::Tensor storage_view(const at::Tensor& base, int64_t offset, c10::IntArrayRef sizes);

/// The part of a run from member `first` to member `last` (inclusive): its offset in the run and
/// its numel.
struct RunSegment {
  size_t first = 0;
  size_t last = 0;
  int64_t offset = 0;
  int64_t numel = 0;
};

/// The segment of `run` over members first..last, with `params` the group's parameters.
RunSegment run_segment(const ParamRun& run, const std::vector<at::Tensor>& params, size_t first, size_t last);

/// A 1-D view of `flat` (a run's flat tensor over its span) restricted to `segment`; `flat`
/// itself when the segment is the whole run.
at::Tensor segment_view(const at::Tensor& flat, const ParamRun& run, const RunSegment& segment);

}  // namespace fsdp::optim
