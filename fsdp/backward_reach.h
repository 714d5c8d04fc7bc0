#pragma once
// [Note: backward reach] A unit's backward all-gather and gradient reduction are collectives, so
// every rank must issue them, in the same order, whether or not its own backward pass reaches the
// unit. Per rank, the pass may not reach a unit whose forward ran: an auxiliary head, a router
// loss or a tower whose output is in the loss on some ranks only (mixture-of-experts and
// multimodal recipes). When a backward pass begins (the first pre-backward of any unit, a point
// every rank reaches after the same forward collectives), the ranks agree, in one small
// all-reduce over the root's communicator (and the replicate group under hybrid sharding), on
// where the pass reaches each unit, from the autograd graph the pass runs:
//   - reached on every rank: as before, all-gathered at its pre-backward (or prefetched) and
//     reduced in its turn of the reverse forward order;
//   - reached on some ranks only: every rank all-gathers it right away, in forward order, keeps it
//     unsharded through the pass, and reduces it at the end of the pass (zeros on the ranks it was
//     not reached on: its gradient is the average over every rank's batch, as in DDP). Its hooks,
//     which run on some ranks only, prefetch nothing and reshard nothing, so every rank's
//     scheduler sees the same units unsharded when it decides a prefetch;
//   - reached on no rank: no all-gather, no reduction; its gradients stay as they were (None after
//     zero_grad(set_to_none)), as in local training and DDP.
// The same all-reduce carries, per unit, a hash of the controls that decide its backward
// collectives (FSDPState::controls_string: gradient sync, divide factor, replicate all-reduce,
// unshard and reshard in backward, and how many times zero_grad discarded its pending gradients:
// [Note: discarding accumulated gradients] in fsdp/zero_grad.h), so a control set on some ranks
// only is refused on every rank,
// naming the unit, in every iteration and before any gradient moves.
// The same all-reduce carries a hash of the units each rank ran in forward, in order, so a unit
// called on some ranks only (an expert that got no tokens and was skipped) is refused on every
// rank with one error naming the units, on any backend, before any gradient moves. (On the MPI
// backend, the forward all-gathers of such a unit already fail: [Note: MPI size check].)
// One rank: the same decisions, from this rank's graph alone, without communication.

namespace torch::autograd {
struct Node;
}

namespace fsdp {

class RootContext;

namespace runtime {

/// Whether autograd runs `node` in the backward pass now running: it is in the pass's graph and,
/// when the pass computes only some gradients (backward with inputs, autograd::grad), needed for
/// them (as torch.autograd.graph's _will_engine_execute_node decides). Asked only while the graph
/// task that began the pass runs; anything else is assumed to run.
bool runs_in_current_pass(const RootContext& context, torch::autograd::Node* node);

/// Decides each unit's PassReach for the backward pass that begins (collective when the root's
/// communicator or the replicate group has several ranks; every rank calls it at its first
/// pre-backward of the pass). Throws on every rank when the ranks ran different units in forward.
void agree_backward_reach(RootContext& context);

}  // namespace runtime
}  // namespace fsdp
