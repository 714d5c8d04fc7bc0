#pragma once
// The fully_shard runtime: what happens at each of the four points per unit (pre-forward unshard,
// post-forward reshard, pre-backward unshard, post-backward reduce-scatter + reshard), plus the
// root's pre-forward (lazy initialisation, start of an iteration) and the end-of-backward callback.
//
// [Note: iteration] The root's pre-forward starts an iteration. Each unit's pre-forward unshards it
// and routes its grad-requiring inputs through RegisterPostBackward; its post-forward reshards it
// (FULL_SHARD; the root keeps its parameters until backward) and hooks the outputs that require
// grad (pre-backward). The first pre-backward of the iteration queues the end-of-backward callback
// and sets aside the sharded gradients of every unit that ran forward. A unit's pre-backward
// unshards it and prefetches the unit that ran before it in forward. Its post-backward reshards it
// and reduce-scatters its gradients, in reverse forward order on every rank (a unit whose turn has
// not come waits, so the collectives match across ranks). The end-of-backward callback reduces
// every unit that has not been (zeros for a unit that got no gradient on this rank: no rank
// hangs), waits for the reduce-scatters, points `.grad` at the sharded gradients, reshards every
// unit and ends the iteration. A forward with no backward to follow (grad mode off, or no output
// requiring grad) reshards every unit at the root's post-forward and ends the iteration.

#include "contract/forward_values.h"

namespace fsdp {

class FSDPState;

namespace runtime {

void pre_forward(FSDPState& state, contract::ForwardArgs& args);
void post_forward(FSDPState& state, c10::IValue& output);

}  // namespace runtime
}  // namespace fsdp
