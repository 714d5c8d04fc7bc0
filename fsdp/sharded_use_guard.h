#pragma once
// Guards against computing on sharded parameters. Outside its unit's forward and backward, a
// managed parameter is a 1-D view of this rank's shard, and some ops compute silently on it
// (at::linear with a 1-D weight is a matrix-vector product) while others fail with raw shape
// errors ("addmm: mat2 must be a matrix, got 1-D tensor"). The guards turn both into errors that
// name the API, the unit and parameter FQNs, what was expected and what was found, and say what to
// do. Each is raised on every rank at the same point. This file: the first-iteration check of the
// autograd graph; fsdp/forward_errors.h: refused modules and forward errors explained;
// fsdp/gradient_guard.h: gradients of parameters touched outside their unit's forward.
//
// [Note: sharded use guard] Hooks are bypassed by `->forward(x)`, by torch::nn::Sequential (its
// AnyModule calls Impl::forward), and by parents that read a child's parameter without calling
// the child. So in the first iteration the runtime walks the autograd graph of the root's
// outputs: a parameter's gradient accumulator records the parameter's shape at its use, so an
// accumulator whose shape is not the parameter's unsharded shape means the parameter was used
// while sharded. (The first-iteration gradient guard below gives every use its own accumulator.)
//

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace fsdp {

class RootContext;

/// The root-relative FQNs of managed parameters that the graph of `outputs` used while sharded,
/// each followed by its unit and whether the unit's pre-forward ran.
std::vector<std::string> find_params_used_while_sharded(const std::vector<at::Tensor>& outputs,
                                                        const RootContext& context);

/// Runs the check on every rank and, if any rank found a parameter used while sharded, fails on
/// every rank with an error naming the parameters and ranks (so no rank is left waiting).
void check_no_sharded_use(const std::vector<at::Tensor>& outputs, const RootContext& context);

}  // namespace fsdp
