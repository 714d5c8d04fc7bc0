#pragma once
// [Note: tensor placement] Where the pieces of a tensor-parallel parameter live. LibTorch has no
// DTensor, so parallelize_module (composable/tensor_parallel.h) replaces a parameter's value by
// this rank's piece in place (the same tensor object, FQN and optimizer entry) and records its
// placement here, keyed by the parameter's TensorImpl (set_data keeps it, so fully_shard's views
// keep it too). Everything that reads parameters as global values asks this table: full state
// dicts (global values), clip_grad_norm_ (sharded gradients counted once, replicated ones once),
// the plan printer (local and global shapes).
//
// A sharded placement splits dimension `dim` of the global tensor evenly over the group. With
// `chunks` > 1 the dimension is `chunks` equal blocks (a fused q/k/v projection: [q; k; v]) and
// each block is split evenly: rank r holds rows [c*B + r*B/n, c*B + (r+1)*B/n) of every block c
// (B = global size / chunks, n = group size), concatenated in block order. A replicated placement
// (dim = -1) marks a parameter every rank of the group holds whole (a row-parallel bias, a
// sequence-parallel LayerNorm).
//
//   if (auto p = fsdp::tensor_placement(param)) {
//     at::Tensor global = fsdp::gather_global(param.detach(), *p);   // collective over p->group
//   }

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "fsdp_cpp/comm/communicator.h"

namespace fsdp {

struct TensorPlacement {
  /// The tensor-parallel group (its size n, this rank's rank r in it).
  std::shared_ptr<comm::Communicator> group;
  /// The mesh dimension's name the group came from ("tp" unless given), for messages.
  std::string mesh_dim = "tp";
  /// The sharded dimension of the global tensor, or -1 when every rank holds it whole.
  int64_t dim = -1;
  /// Equal blocks of `dim`, each split over the group (see the note above); 1 for a plain shard.
  int64_t chunks = 1;
  /// The global tensor's shape.
  std::vector<int64_t> global_shape;

  bool sharded() const { return dim >= 0; }
  int size() const { return group ? group->size() : 1; }
  /// The shape rank `rank` holds (every rank the same: dimensions divide evenly).
  std::vector<int64_t> local_shape() const;
  /// The global ranges [start, end) along `dim` that rank `rank` holds, one per block.
  std::vector<std::pair<int64_t, int64_t>> global_ranges(int rank) const;
  /// Rank `rank`'s piece of `global` (a contiguous copy).
  at::Tensor local_piece(const at::Tensor& global, int rank) const;
  /// The global tensor from every rank's piece (pieces[r] is rank r's).
  at::Tensor assemble(const std::vector<at::Tensor>& pieces) const;
  /// "Shard(0) over tp=2, global [96, 32]", "Replicate over tp=2", "Shard(0, 3 blocks) ...".
  std::string describe() const;
};

/// Records `param`'s placement (parallelize_module does this).
void set_tensor_placement(const at::Tensor& param, TensorPlacement placement);
/// The placement of `param`, if parallelize_module placed it.
std::optional<TensorPlacement> tensor_placement(const at::Tensor& param);
/// Forgets `param`'s placement (undo of a failed parallelize_module).
void clear_tensor_placement(const at::Tensor& param);

/// The global value of a sharded tensor from this rank's piece `local`: collective over
/// placement.group (every rank of it calls it, in the same order). A replicated placement returns
/// `local` as it is.
at::Tensor gather_global(const at::Tensor& local, const TensorPlacement& placement);

}  // namespace fsdp
