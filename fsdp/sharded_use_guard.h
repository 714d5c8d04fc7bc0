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
// [Note: hidden parameters] A shard-shaped parameter behaves differently on each rank (its slice
// of the FlatParameter has another size, possibly 0, on each rank): a bypassed Linear fails with
// "mat2 must be a matrix" on one rank, computes a matrix-vector product on another, and the ranks
// then wait in different collectives; on one rank, where the "sharded" form is the full
// parameter, it computes correctly and nothing is reported. So in the forwards until the graph
// check above has run (normally only the first), every managed parameter outside its unit's
// forward holds an empty placeholder (shape [0], its own dtype and device) instead, on every rank
// and every world size alike: the root's pre-forward hides every other unit's parameters that are
// not unsharded, a unit's pre-forward shows its own again before it is gathered (and those of the
// units it prefetches), a unit's post-forward hides them again once resharded, and the root's
// post-forward (or its forward-exception hook, or the next root pre-forward after a forward that
// threw another exception) shows them all. A use outside the unit's forward then fails the same
// way on every rank (a shape error that explain_forward_error names the unit and parameter for),
// or records a [0]-shaped gradient accumulator that the graph check reports. Later forwards pay
// one flag test per hook.
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

class FSDPState;

/// Whether the forwards of `context` hide parameters outside their unit's forward ([Note: hidden
/// parameters]): until the graph check has run.
bool hides_params_outside_forward(const RootContext& context);
/// Replaces every parameter of `unit` whose FlatParameter is not unsharded by an empty placeholder,
/// keeping what it held. No-op for parameters hidden already.
void hide_params(FSDPState& unit);
/// Gives `unit`'s hidden parameters back what they held (those still holding the placeholder).
void show_params(FSDPState& unit);
/// show_params on every unit of `context`.
void show_all_params(const RootContext& context);

}  // namespace fsdp
