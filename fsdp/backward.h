#pragma once
// The backward half of the runtime: the hooks that autograd runs (each unit's pre-backward on its
// outputs, its post-backward through RegisterPostBackward on its inputs), the reduction of
// gradients in reverse forward order, the end-of-backward callback, and the recovery from a
// forward or backward that threw.
//
// [Note: backward pass] The first pre-backward of a pass queues the end-of-backward callback and
// sets aside the sharded gradients of every unit that backward can reach. A call's pre-backward
// unshards its unit, points the parameters' `.grad` at the unit's flat gradient buffer and
// prefetches the unit that ran before it in forward. A call's post-backward reshards the unit
// (unless another of its calls is mid-backward, or its strategy keeps it unsharded until the
// unit's backward is complete). Once every call of a unit finished its backward, gradients are
// reduce-scattered in reverse forward order on every rank (a unit whose turn has not come waits,
// so the collectives match across ranks); issuing one unit's reduction finalizes the previous
// one's, so at most two units' unsharded gradients are alive at once. Units backward cannot reach
// (their outputs need no gradient, e.g. run under NoGradGuard) are skipped on every rank. The
// end-of-backward callback reduces every unit that has not been (zeros for a unit that got no
// gradient on this rank: no rank hangs), finalizes, reshards and returns to kIdle.

#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include "fsdp_cpp/contract/forward_values.h"

namespace fsdp {

class FSDPState;
class RootContext;

namespace runtime {

/// Pre-forward, grad mode on: routes the grad-requiring tensors of `args` through
/// RegisterPostBackward for call `call` of `unit`.
void route_inputs_for_post_backward(FSDPState& unit, size_t call, contract::ForwardArgs& args);

/// Post-forward: registers the pre-backward hook of the latest call on every output tensor that
/// requires grad, and records the call's end. Returns those tensors.
std::vector<at::Tensor> hook_outputs_for_backward(FSDPState& unit, c10::IValue& output);

/// A forward or backward pass threw (on every rank): waits for the collectives in flight, drops the
/// pass's gradient buffers, restores the gradients held before it, reshards every unit and
/// returns the context to kIdle.
void discard_iteration(RootContext& context);

/// One rank, nothing to gather or reduce ([Note: passthrough backward] in backward.cc): hooks the
/// root's outputs so a backward pass can be undone if it throws.
void hook_root_outputs_passthrough(RootContext& context, const c10::IValue& output);
/// Undoes a passthrough backward pass that threw: the parameters get back the gradients they held.
void discard_passthrough_backward(RootContext& context);

}  // namespace runtime
}  // namespace fsdp
