#include "fsdp_cpp/fsdp/flat_param_layout.h"

#include <algorithm>

#include <c10/util/Exception.h>

namespace fsdp {

FlatParamLayout make_flat_param_layout(const std::vector<FlatParamInput>& params,
                                       c10::ScalarType dtype, int world_size,
                                       int64_t alignment_bytes) {
  TORCH_CHECK(world_size >= 1, "FlatParameter layout: world size must be at least 1, got ", world_size);
  const int64_t element_size = static_cast<int64_t>(c10::elementSize(dtype));
  TORCH_CHECK(alignment_bytes >= element_size && alignment_bytes % element_size == 0,
              "FlatParameter layout: alignment of ", alignment_bytes,
              " bytes is not a multiple of the element size ", element_size, " of ", dtype);
  FlatParamLayout layout;
  layout.dtype = dtype;
  layout.world_size = world_size;
  layout.alignment = alignment_bytes / element_size;
  int64_t cursor = 0;
  for (const auto& p : params) {
    int64_t numel = 1;
    for (int64_t d : p.shape) {
      TORCH_CHECK(d >= 0, "FlatParameter layout: parameter '", p.fqn, "' has a negative dimension");
      numel *= d;
    }
    cursor = (cursor + layout.alignment - 1) / layout.alignment * layout.alignment;
    layout.entries.push_back({p.fqn, p.shape, numel, cursor});
    cursor += numel;
  }
  layout.unpadded_numel = cursor;
  layout.padded_numel = (cursor + world_size - 1) / world_size * world_size;
  return layout;
}

ShardSlice FlatParamLayout::slice_of(int entry, int rank) const {
  const auto& e = entries.at(entry);
  const int64_t shard_begin = static_cast<int64_t>(rank) * shard_numel();
  const int64_t shard_end = shard_begin + shard_numel();
  const int64_t begin = std::max(e.offset, shard_begin);
  const int64_t end = std::min(e.offset + e.numel, shard_end);
  ShardSlice slice;
  slice.entry = entry;
  if (begin >= end) {
    // Holds none of it: an empty slice placed where it would start (keeps views well-formed).
    slice.param_begin = slice.param_end = 0;
    slice.shard_offset = std::clamp(e.offset - shard_begin, int64_t{0}, shard_numel());
    return slice;
  }
  slice.param_begin = begin - e.offset;
  slice.param_end = end - e.offset;
  slice.shard_offset = begin - shard_begin;
  return slice;
}

std::vector<ShardSlice> FlatParamLayout::slices_for_rank(int rank) const {
  TORCH_CHECK(rank >= 0 && rank < world_size, "FlatParameter layout: rank ", rank,
              " is outside the world of ", world_size);
  std::vector<ShardSlice> slices;
  for (int i = 0; i < static_cast<int>(entries.size()); ++i) {
    ShardSlice s = slice_of(i, rank);
    if (s.size() > 0) slices.push_back(s);
  }
  return slices;
}

}  // namespace fsdp
