#pragma once
// The fully_shard runtime: what happens at each of the four points per unit (pre-forward unshard,
// post-forward reshard, pre-backward unshard, post-backward reduce-scatter + reshard), plus the
// root's pre-forward (lazy initialisation, start of an iteration) and the end-of-backward callback.
//
// [Note: iteration] The root's pre-forward starts an iteration (or continues it: several forwards
// may precede one backward, see fsdp/unit_iteration.h). Each unit's pre-forward records a call,
// unshards the unit and routes its grad-requiring inputs through RegisterPostBackward; its
// post-forward reshards it (FULL_SHARD; the root keeps its parameters until backward) and hooks
// the outputs that require grad (pre-backward). Backward is in fsdp/backward.h. A root forward
// after which no backward can run (grad mode off, or no output requiring grad) reshards every
// unit. A root forward or backward that threw leaves the context for the next root forward to
// clean up (fsdp/backward.h: discard_iteration).

#include "fsdp_cpp/contract/forward_values.h"

namespace fsdp {

class FSDPState;
class RootContext;

namespace runtime {

void pre_forward(FSDPState& state, contract::ForwardArgs& args);
void post_forward(FSDPState& state, c10::IValue& output);
/// Between root forwards (not inside one): whether a backward can still run through a forward of
/// `context`'s root (phase kForward, and some unit's outputs are in a live graph). When every such
/// graph was dropped (a loss never backpropagated), ends the iteration as a forward under
/// NoGradGuard does (every unit resharded and idle, phase kIdle) and returns false. Local: no
/// collective; the same on every rank that ran the same program.
bool settle_forward_phase(RootContext& context);
/// A unit's forward threw (its forward-exception hook): the root shows the parameters its forward
/// hid ([Note: hidden parameters] in fsdp/sharded_use_guard.h).
void forward_failed(FSDPState& state);

}  // namespace runtime
}  // namespace fsdp
