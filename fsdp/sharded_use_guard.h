#pragma once
// Guards against computing on sharded parameters. Outside its unit's forward and backward, a
// managed parameter is a 1-D view of this rank's shard, and some ops compute silently on it
// (at::linear with a 1-D weight is a matrix-vector product) while others fail with raw shape
// errors ("addmm: mat2 must be a matrix, got 1-D tensor"). The guards turn both into errors that
// name the API, the unit and parameter FQNs, what was expected and what was found, and say what to
// do. Each is raised on every rank at the same point.
//
// [Note: sharded use guard] Hooks are bypassed by `->forward(x)`, by torch::nn::Sequential (its
// AnyModule calls Impl::forward), and by parents that read a child's parameter without calling
// the child. So in the first iteration the runtime walks the autograd graph of the root's
// outputs: a parameter's gradient accumulator records the parameter's shape at its use, so an
// accumulator whose shape is not the parameter's unsharded shape means the parameter was used
// while sharded. (The first-iteration gradient guard below gives every use its own accumulator.)
//
// [Note: refused modules] fully_shard's holder overload refuses, at compile time, holders that
// cannot run forward hooks (LibTorch's). For a torch::nn::Module&, check_modules_can_run_hooks()
// refuses LibTorch's containers: torch::nn::Sequential calls its children around their hooks,
// ModuleList / ModuleDict / ParameterList / ParameterDict have no forward at all.
//
// [Note: forward errors] A module called around its hooks computes on sharded parameters and
// usually throws a shape error. explain_forward_error() is every unit's forward-exception hook
// (contract/forward_hooks.h): when a unit's forward throws, it adds to the error the units inside
// it whose pre-forward did not run in this iteration while their parameters are not in their
// forward form, with their parameters' expected and current shapes, and how to call them. The
// innermost unit the error crosses explains it; the units around it leave it as it is. Nothing is
// communicated: every rank runs the same forward and throws at the same point.
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
// The guard's state is kept in the contract's registry on the root's module (API
// kFirstIterationGuardApi), so it dies with the model.

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace fsdp {

class FSDPState;
class RootContext;

/// The API name the first-iteration gradient guard keeps its state under, on the root's module.
inline constexpr const char* kFirstIterationGuardApi = "fully_shard (first-iteration guard)";

/// The root-relative FQNs of managed parameters that the graph of `outputs` used while sharded,
/// each followed by its unit and whether the unit's pre-forward ran.
std::vector<std::string> find_params_used_while_sharded(const std::vector<at::Tensor>& outputs,
                                                        const RootContext& context);

/// Runs the check on every rank and, if any rank found a parameter used while sharded, fails on
/// every rank with an error naming the parameters and ranks (so no rank is left waiting).
void check_no_sharded_use(const std::vector<at::Tensor>& outputs, const RootContext& context);

/// Fails (c10::Error naming the module and what to use instead) if one of `modules` is one of
/// LibTorch's containers, whose forward hooks could never run ([Note: refused modules]). Call
/// before anything is changed.
void check_modules_can_run_hooks(const std::vector<torch::nn::Module*>& modules);

/// The forward-exception hook of `unit` ([Note: forward errors]): adds context to `error` naming
/// the units inside `unit` that did not run their pre-forward. No-op when there are none, when
/// `unit` is not initialised, when an inner unit already explained the error, or for fully_shard's
/// own errors.
void explain_forward_error(const FSDPState& unit, c10::Error& error);

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
