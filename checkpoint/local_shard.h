#pragma once
// [Note: sharded state dicts] A sharded state dict holds, per key, this rank's part of one tensor
// of the (unsharded) state: flattened elements [flat_offset, flat_offset + local.numel()) of a
// row-major tensor of `global_shape`. A FlatParameter shard gives each original parameter one such
// range (maybe empty); values every rank holds whole (buffers, NO_SHARD and one-rank parameters,
// optimizer steps and hyperparameters) are the full range on every rank, and exactly one rank has
// `write` set for each element, so a checkpoint stores every element once.
//
// No communication builds or consumes one: checkpoint files (checkpoint/distributed_checkpoint.h)
// are written from it by every rank at once, and loaded by filling `local` in place.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace fsdp {

struct LocalShard {
  /// 1-D, contiguous, this rank's elements (maybe empty), on the device the state lives on. For a
  /// model or optimizer state dict it is a view of the live tensor: writing into it loads.
  at::Tensor local;
  std::vector<int64_t> global_shape;
  int64_t flat_offset = 0;
  /// Whether this rank stores these elements when saving (one rank per element).
  bool write = true;

  /// Elements of the whole value: the product of global_shape (1 for a 0-d value such as an
  /// optimizer step, whose `local` holds one element).
  int64_t global_numel() const;
};

using ShardedStateDict = std::vector<std::pair<std::string, LocalShard>>;

}  // namespace fsdp
