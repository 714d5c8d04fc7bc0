#pragma once
// Gradients of parameters touched outside their unit's forward, caught in the first iteration.
//
// [Note: first-iteration gradient guard] Parameters touched outside any unit's forward (an L2
// penalty over `model->parameters()` after the forward, a parameter read after its unit resharded)
// are shard-shaped views (or, for units unsharded from forward to backward, full-shape views whose
// gradient arrives outside the unit's backward). Their gradients would reach autograd's
// AccumulateGrad with the shard's shape (a raw broadcast error, or a silent broadcast into the
// unit's flat gradient buffer) or at a time the unit does not expect one. In the first iteration:
//  - after each unit's pre-forward and post-forward (whenever it unshards or reshards), the
//    parameters' cached gradient accumulators are dropped, so each use gets an accumulator of the
//    shape it used (autograd would otherwise reject the shard-shaped gradient with a raw error
//    before any hook runs);
//  - the root's first pre-forward installs a gradient hook on every trainable managed parameter
//    (it runs before AccumulateGrad, with the incoming gradient): a gradient whose shape is not
//    the unsharded shape, or that arrives while the parameter's unit is not in its backward and
//    the unit's parameters are sharded across ranks, is recorded and dropped, so backward
//    completes with every collective matched (without sharding, e.g. on one rank, the sharded
//    form is the full one and such a gradient is kept and correct);
//  - at the end of that backward (a callback queued from the root's outputs, after the runtime's
//    end-of-backward), the findings are exchanged and every rank fails with one error naming the
//    parameters per rank. The hooks are then removed: later iterations pay nothing.
// The guard's hooks are appended after any hook the user registered on a parameter
// (param.register_hook(...) before the first iteration runs first, with the incoming gradient,
// and keeps running afterwards); only the guard's own are removed.
// The guard's state is kept in the contract's registry on the root's module (API
// kFirstIterationGuardApi), so it dies with the model.

#include <ATen/core/ivalue.h>

namespace fsdp {

class FSDPState;
class RootContext;

/// The API name the first-iteration gradient guard keeps its state under, on the root's module.
inline constexpr const char* kFirstIterationGuardApi = "fully_shard (first-iteration guard)";

/// First-iteration gradient guard ([Note: first-iteration gradient guard]). Call at the end of
/// every pre-forward of `unit` (after it is unsharded). In the root's first pre-forward it creates
/// the guard and installs the gradient hooks. A single atomic load once every guard finished.
void guard_after_pre_forward(FSDPState& unit);

/// Call at the end of every post-forward of `unit` (after it is resharded and its outputs hooked
/// for backward). On the root, queues check_first_iteration_gradients() for the end of the
/// backward through `output`. A single atomic load once every guard finished.
void guard_after_post_forward(FSDPState& unit, const c10::IValue& output);

/// Exchanges the gradient guard's findings (collective on every rank of `context`), removes the
/// guard's hooks and, if any rank found a parameter touched outside its unit's forward, fails on
/// every rank naming them. No-op when the guard is not installed or has finished. Called from a
/// callback at the end of the first backward (guard_after_post_forward queues it); the runtime may
/// call it itself at the end of its end-of-backward callback.
void check_first_iteration_gradients(RootContext& context);

/// Whether the root of `context` has a gradient guard that has not finished (for tests).
bool first_iteration_guard_active(const RootContext& context);

}  // namespace fsdp
