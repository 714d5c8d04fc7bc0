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

#include "contract/forward_values.h"

namespace fsdp {

class FSDPState;

namespace runtime {

void pre_forward(FSDPState& state, contract::ForwardArgs& args);
void post_forward(FSDPState& state, c10::IValue& output);

}  // namespace runtime
}  // namespace fsdp
