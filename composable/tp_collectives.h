#pragma once
// The collectives of tensor parallelism as autograd functions (Megatron's f/g operators and the
// sequence-parallel pairs), over a tensor-parallel group. Each runs under a profiler scope named
// "tensor_parallel::<op>" and is counted by the group's communicator like every collective.
//
// [Note: tensor-parallel gradients] Activations that every rank of the group holds whole
// (Replicate) carry whole gradients across module boundaries, as in Megatron: a module whose
// backward produces a partial gradient for a replicated input (a column-parallel layer: each rank
// sees only its output columns) sums it over the group where that input entered (copy_to_tp);
// a replicated value that was gathered from pieces takes its own piece of the whole gradient back
// (gather_from_tp). Sequence-sharded activations (Shard(1)) carry their piece's gradient.
//
//   at::Tensor x_in = fsdp::tp::copy_to_tp(x, group);          // forward: x;   backward: sum
//   at::Tensor y = fsdp::tp::reduce_from_tp(partial, group);   // forward: sum; backward: as is
//
// With a group of one rank every function returns its input.

#include <memory>

#include <ATen/core/Tensor.h>

#include "fsdp_cpp/comm/communicator.h"

namespace fsdp::tp {

using Group = std::shared_ptr<comm::Communicator>;

/// Forward: identity. Backward: all-reduce (sum) of the gradient. Where a replicated activation
/// enters a column-parallel region.
at::Tensor copy_to_tp(const at::Tensor& x, const Group& group);

/// Forward: all-reduce (sum). Backward: identity. Where a row-parallel region's partial sums
/// leave as a replicated activation.
at::Tensor reduce_from_tp(const at::Tensor& x, const Group& group);

/// Forward: all-gather of the pieces along `dim`. Backward: this rank's piece of the (whole,
/// replicated) gradient. Column-parallel outputs to Replicate.
at::Tensor gather_from_tp(const at::Tensor& x, int64_t dim, const Group& group);

/// Forward: this rank's piece along `dim` (the size must divide evenly). Backward: all-gather of
/// the gradient's pieces. Replicated inputs to a row-parallel layer or a sequence-parallel region.
at::Tensor split_to_tp(const at::Tensor& x, int64_t dim, const Group& group);

/// Forward: all-gather along `dim`. Backward: reduce-scatter (sum) along `dim`. Sequence-sharded
/// activations into a column-parallel layer (whose input gradient is partial).
at::Tensor all_gather_tp(const at::Tensor& x, int64_t dim, const Group& group);

/// Forward: reduce-scatter (sum) along `dim`. Backward: all-gather along `dim`. A row-parallel
/// layer's partial sums out to sequence-sharded activations.
at::Tensor reduce_scatter_tp(const at::Tensor& x, int64_t dim, const Group& group);

}  // namespace fsdp::tp
