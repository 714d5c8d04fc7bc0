#pragma once
// [Note: boxes] Pure arithmetic over row-major tensors, no I/O.
//
// A rank's shard of an original parameter is a range of its flattened elements. Checkpoint
// formats (torch.distributed.checkpoint, its Hugging Face safetensors layout) describe pieces of a
// tensor as boxes: an N-d chunk given by per-dimension offsets and sizes. A flat range that is not a
// box is split into the fewest boxes (at most 2*ndim - 1), in flat order; a box that does not span
// the trailing dimensions is read back as several contiguous runs.
//
// Example: shape [4, 5], flat range [7, 18) -> box {offsets [1, 2], sizes [1, 3]} (elements 7..9),
// box {[2, 0], [1, 5]} (10..14), box {[3, 0], [1, 3]} (15..17).

#include <cstdint>
#include <vector>

namespace fsdp::storage {

struct Box {
  std::vector<int64_t> offsets;  // per dimension; empty for a 0-d tensor
  std::vector<int64_t> sizes;
  int64_t numel() const;
  bool operator==(const Box& other) const = default;
};

/// Splits flattened elements [begin, end) of a row-major tensor of `shape` into the fewest boxes,
/// in flat order. An empty range gives no box; a 0-d tensor's range [0, 1) gives one empty box.
std::vector<Box> boxes_of_flat_range(const std::vector<int64_t>& shape, int64_t begin, int64_t end);

/// A contiguous run of a box's elements: `length` elements starting at flat index `global_begin`
/// of the whole tensor, stored at flat index `local_begin` of the box (the box's own row-major
/// order, as its data is laid out in a file).
struct Run {
  int64_t global_begin = 0;
  int64_t local_begin = 0;
  int64_t length = 0;
  bool operator==(const Run& other) const = default;
};

/// The runs of `box` (of a tensor of `shape`) that fall inside flat range [begin, end), in order,
/// merged where contiguous: a box spanning the trailing dimensions is one run per leading index.
std::vector<Run> runs_of_box(const std::vector<int64_t>& shape, const Box& box, int64_t begin, int64_t end);

}  // namespace fsdp::storage
