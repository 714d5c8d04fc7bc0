#pragma once
// [Note: discarding accumulated gradients] FSDPModule::zero_grad: what nn.Module::zero_grad means
// for a sharded model. Besides the parameters' `.grad` (the sharded gradients), a unit holds
// gradients of backward passes that are not reduced yet: the no-sync accumulator
// (set_requires_gradient_sync(false): this rank's unsharded sum, reduce-scattered by the next pass
// with sync) and HSDP's replicate partial (set_requires_all_reduce(false): the shard group's sum,
// all-reduced across the replicas by the next pass with the all-reduce), fsdp/flat_param_grad.h.
// optimizer.zero_grad() sees neither, so a step abandoned after some microbatches (a bad batch, a
// NaN check, a throwing pipeline stage) would leak into the next update. zero_grad drops both for
// every unit of the tree (the unit's and every unit inside its modules) and sets every
// parameter's `.grad` of the unit's modules to none (or zeroes it), ignored parameters included.
//
// It is local: no collective, so it can run in a failure path that other ranks may not reach at
// the same point. Ranks must still agree: a rank that dropped a unit's pending gradients while its
// peers kept theirs would reduce different sums (every rank's model would silently differ from the
// one intended). So each unit counts the discards that dropped something (FSDPState::
// gradient_discards), and the count is one of the controls the ranks compare when the next
// backward pass begins ([Note: backward reach] in fsdp/backward_reach.h): ranks that disagree are
// refused on every rank, naming the unit, before any gradient moves. A discard with nothing to
// drop is not counted (a rank calling it where its peers called optimizer.zero_grad() changes
// nothing they would reduce). One rank, or units without pending gradients: nothing to compare.
//
// When it may run: not inside a forward or a backward pass of the tree (refused, naming the API
// and the unit). Between a forward and its backward it drops only gradients (the common
// "forward; zero_grad; backward" order). A forward or backward that threw, and an iteration left
// open by set_is_last_backward(false) ([Note: open iterations] in fsdp/open_iteration.h), are
// abandoned first, as the next root forward would after a throw: collectives in flight waited for,
// buffers freed, every unit resharded, and graphs of the abandoned iteration refused afterwards as
// an earlier iteration's (one rank, every handle a passthrough: a backward pass that threw gets
// its gradients back, and graphs stay usable as in local training).

#include <string>

namespace fsdp {

class FSDPState;

namespace runtime {

/// [Note: discarding accumulated gradients]: `unit` and every unit inside its modules drop their
/// pending gradients; every parameter of the unit's modules gets `.grad` set to none
/// (`set_to_none`) or zeroed in place. `api` names the caller in errors.
void zero_grad(FSDPState& unit, bool set_to_none, const std::string& api);

}  // namespace runtime
}  // namespace fsdp
