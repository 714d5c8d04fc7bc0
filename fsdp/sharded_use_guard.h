#pragma once
// [Note: sharded use guard] A sharded parameter is a 1-D slice of the local shard, and some ops
// compute silently on it (at::linear with a 1-D weight is a matrix-vector product). Hooks are
// bypassed by `->forward(x)`, by torch::nn::Sequential (its AnyModule calls Impl::forward), and by
// parents that read a child's parameter without calling the child. So in the first iteration the
// runtime walks the autograd graph of the root's outputs: a parameter's gradient accumulator is
// created with the parameter's shape at its first use in the graph, so an accumulator whose shape
// is not the parameter's unsharded shape means the parameter was used while sharded.

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace fsdp {

class RootContext;

/// The root-relative FQNs of managed parameters that the graph of `outputs` used while sharded.
std::vector<std::string> find_params_used_while_sharded(const std::vector<at::Tensor>& outputs,
                                                        const RootContext& context);

/// Runs the check on every rank and, if any rank found a parameter used while sharded, fails on
/// every rank with an error naming the parameters and ranks (so no rank is left waiting).
void check_no_sharded_use(const std::vector<at::Tensor>& outputs, const RootContext& context);

}  // namespace fsdp
