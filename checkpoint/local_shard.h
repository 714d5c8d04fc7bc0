#pragma once
// [Note: sharded state dicts] A sharded state dict holds, per key, this rank's part of one tensor
// of the (unsharded) state: flattened elements [flat_offset, flat_offset + local.numel()) of a
// row-major tensor of `global_shape`. A FlatParameter shard gives each original parameter one such
// range (maybe empty); values every rank holds whole (buffers, NO_SHARD and one-rank parameters,
// optimizer steps and hyperparameters) are the full range on every rank, and exactly one rank has
// `write` set for each element, so a checkpoint stores every element once.
//
// [Note: tensor-parallel pieces] With tensor parallelism (composable/tensor_placement.h) a rank's
// parameter is a piece of the global value: the global ranges `piece->ranges` of dimension
// `piece->dim`, concatenated in that order (several ranges: a fused projection's blocks). Then
// `flat_offset` and `local` index the flattened elements of the piece (of shape piece_shape()),
// while `global_shape` stays the global value's; global_boxes() and global_runs() translate to the
// global tensor's coordinates, which is what checkpoint files hold, so a checkpoint is independent
// of the (data-parallel, tensor-parallel) layout that saved it.
//
// No communication builds or consumes one: checkpoint files (checkpoint/distributed_checkpoint.h)
// are written from it by every rank at once, and loaded by filling `local` in place.

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "fsdp_cpp/storage/boxes.h"

namespace fsdp {

/// The part of a global tensor a tensor-parallel rank holds (see the note above).
struct TensorPiece {
  /// The dimension of the global tensor the piece is cut along.
  int64_t dim = 0;
  /// Global ranges [start, end) along `dim`, concatenated in this order along `dim` of the piece.
  std::vector<std::pair<int64_t, int64_t>> ranges;
  bool operator==(const TensorPiece&) const = default;
};

struct LocalShard {
  /// 1-D, contiguous, this rank's elements (maybe empty), on the device the state lives on. For a
  /// model or optimizer state dict it is a view of the live tensor: writing into it loads.
  at::Tensor local;
  std::vector<int64_t> global_shape;
  int64_t flat_offset = 0;
  /// Whether this rank stores these elements when saving (one rank per element).
  bool write = true;
  /// Set for a tensor-parallel piece: `flat_offset` and `local` then index the piece's elements.
  std::optional<TensorPiece> piece;

  /// Elements of the whole value: the product of global_shape (1 for a 0-d value such as an
  /// optimizer step, whose `local` holds one element).
  int64_t global_numel() const;
  /// The shape `flat_offset` indexes: the piece's (global_shape with dimension `piece->dim` the
  /// total length of its ranges), or global_shape without a piece.
  std::vector<int64_t> piece_shape() const;
  int64_t piece_numel() const;
};

using ShardedStateDict = std::vector<std::pair<std::string, LocalShard>>;

/// A box of the global tensor that a shard holds, with its elements (a view of `local`, strided
/// when the box does not span the piece's trailing dimensions).
struct GlobalBox {
  storage::Box box;
  at::Tensor data;
};

/// The shard's elements as boxes of the global tensor, in the piece's flat order: the fewest boxes
/// of its flat range (storage/boxes.h), each split where it crosses from one range of the piece to
/// the next. Empty when `local` is empty.
std::vector<GlobalBox> global_boxes(const LocalShard& shard);

/// A contiguous run of a shard's elements in the global tensor's flat order: `length` elements
/// from flat index `global_begin` of the global tensor, at index `local_begin` of `local`.
struct GlobalRun {
  int64_t global_begin = 0;
  int64_t local_begin = 0;
  int64_t length = 0;
};

/// The shard's elements as contiguous runs of the global tensor (merged where both sides are
/// contiguous; one run without a piece), in the order of `local`.
std::vector<GlobalRun> global_runs(const LocalShard& shard);

}  // namespace fsdp
