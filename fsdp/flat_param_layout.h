#pragma once
// [Note: FlatParameter layout] Pure arithmetic, no tensors and no communication.
//
// A unit's parameters, in `named_parameters` order, are flattened into one 1-D buffer (the
// FlatParameter). Each parameter starts on a 16-byte boundary (padding is inserted before it), and
// the total is right-padded to a multiple of the world size, so that every rank holds an equal,
// contiguous shard (all-gather-into-tensor and reduce-scatter-tensor need equal sizes per rank).
//
// Example: three bias-free Linears 3->7, 7->5, 5->5 in fp32 (alignment 4 elements):
//   0.weight [0, 21)  pad [21, 24)  1.weight [24, 59)  pad [59, 60)  2.weight [60, 85)
// On 2 ranks the total pads to 86 (43 per rank): rank 0 holds 0.weight[0:21] and 1.weight[0:19].
// On 4 ranks it pads to 88 (22 per rank): rank 2 holds 1.weight[20:35] and 2.weight[0:6].

#include <cstdint>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>

namespace fsdp {

/// One original parameter's place in the unsharded FlatParameter.
struct FlatParamEntry {
  std::string fqn;             // relative to the module that owns the FlatParameter
  std::vector<int64_t> shape;  // original (unsharded) shape
  int64_t numel = 0;
  int64_t offset = 0;          // first element in the unsharded FlatParameter (aligned)
};

/// The part of one original parameter that one rank's shard holds: flattened elements
/// [param_begin, param_end) of entry `entry`, stored at [shard_offset, shard_offset + size) of the
/// rank's local shard.
struct ShardSlice {
  int entry = 0;
  int64_t param_begin = 0;
  int64_t param_end = 0;
  int64_t shard_offset = 0;
  int64_t size() const { return param_end - param_begin; }
};

struct FlatParamLayout {
  c10::ScalarType dtype = c10::ScalarType::Float;
  int world_size = 1;
  int64_t alignment = 1;        // in elements
  std::vector<FlatParamEntry> entries;
  int64_t unpadded_numel = 0;   // end of the last parameter
  int64_t padded_numel = 0;     // a multiple of world_size
  int64_t shard_numel() const { return padded_numel / world_size; }

  /// The slices of original parameters that `rank`'s shard holds, in entry order (parameters the
  /// rank holds nothing of are absent).
  std::vector<ShardSlice> slices_for_rank(int rank) const;

  /// The slice of entry `entry` that `rank` holds; size() == 0 when it holds none.
  ShardSlice slice_of(int entry, int rank) const;
};

struct FlatParamInput {
  std::string fqn;
  std::vector<int64_t> shape;
};

/// Lays out `params` (all of dtype `dtype`, in order) for `world_size` ranks, each parameter aligned
/// to `alignment_bytes`.
FlatParamLayout make_flat_param_layout(const std::vector<FlatParamInput>& params,
                                       c10::ScalarType dtype, int world_size,
                                       int64_t alignment_bytes = 16);

}  // namespace fsdp
