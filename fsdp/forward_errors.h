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
