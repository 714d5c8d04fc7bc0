#pragma once
// Modules whose hooks cannot run, and errors thrown while a unit computed on sharded parameters.
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
// It also names the units inside that ran their forward in this iteration and were resharded
// after it (their parameters again not in their forward form: 1-D views of this rank's shard, or
// the empty placeholders of [Note: hidden parameters] in the first iteration), at most four of
// them: a method other than forward called directly on such a unit (`block->generate(x)` instead
// of fsdp::contract::call_method(block, &BlockImpl::generate, x)) computes on its sharded
// parameters. The added context tells to call the method through call_method (or unshard()).
// What is detected, exactly: an error (c10::Error) raised inside a unit's forward or hooked
// method (call_method, call_with_hooks) while a unit inside it holds parameters not in their
// forward form. Not detected: a computation that does not throw (after the first iteration a
// shard may happen to have a shape an op accepts on some rank: the graph check of the first
// iteration names those, [Note: sharded use guard]), and a method called with no hooked call of
// any unit around it (`model->block->generate(x)` at the top level of a program): no library code
// runs there, and LibTorch gives its own error (e.g. 'addmm: mat2 must be a matrix').
//

#include <vector>

#include <c10/util/Exception.h>

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace fsdp {

class FSDPState;

/// Fails (c10::Error naming the module and what to use instead) if one of `modules` is one of
/// LibTorch's containers, whose forward hooks could never run ([Note: refused modules]). Call
/// before anything is changed.
void check_modules_can_run_hooks(const std::vector<torch::nn::Module*>& modules);

/// The forward-exception hook of `unit` ([Note: forward errors]): adds context to `error` naming
/// the units inside `unit` that did not run their pre-forward. No-op when there are none, when
/// `unit` is not initialised, when an inner unit already explained the error, or for fully_shard's
/// own errors.
void explain_forward_error(const FSDPState& unit, c10::Error& error);

}  // namespace fsdp
