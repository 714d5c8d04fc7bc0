#pragma once
// [Note: open iterations] With the root's is_last_backward false (FSDP2's set_is_last_backward,
// [Note: backward passes within an iteration] in fsdp/backward.cc), a backward pass ends without
// ending the iteration while a graph of its forwards is still live: the iteration is left open,
// the next root forward continues it, and later backward passes go through the earlier forwards'
// graphs. Pipeline schedules do this within one optimizer step and set it back to true before the
// step's last backward. What the engine refuses, because it is a mistake, not a schedule:
//   - set_is_last_backward(false) on a unit that is not a root (only the root's is read): refused
//     by the setter, naming the unit (FSDPModule::set_is_last_backward);
//   - the shards written while the iteration is open (an optimizer step between two backward
//     passes of one iteration: the earlier forwards' graphs would be backpropagated with other
//     parameters, and slices kept for the post-forward group would be stale; fsdp/shard_snapshot.h
//     says which writes are seen, the check costs a small sample per FlatParameter at the end of
//     each such pass and when the next forward or pass begins): refused at the next
//     root forward that would continue the iteration, or the next backward pass that would begin
//     in it, whichever comes first; the iteration is discarded (local, as after a forward that
//     threw), so training can go on. The refusal happens before any collective of that forward or
//     pass, on every rank that ran the same program;
//   - fsdp::clip_grad_norm_ while the iteration is open (a backward pass of the step is still
//     expected, so the gradients are not the step's yet), on every rank.
// FSDPModule::zero_grad on an open iteration abandons it (a failed or abandoned step: its graphs
// are then refused as an earlier iteration's), see [Note: discarding accumulated gradients] in
// fsdp/zero_grad.h.
// Open means: a pass ended within the iteration and the iteration has not ended since; the calls
// a pass reached count as live until the next pass begins, so dropping the outputs does not close
// it, only a backward with is_last_backward true, a forward that threw, or zero_grad do. Not
// detected: one rank (every handle a passthrough: each backward pass ends its iteration, nothing
// is kept between passes, and is_last_backward is not read).

#include <string>

namespace fsdp {

class RootContext;

namespace runtime {

/// At a root forward that continues an open iteration, or the first pre-backward of a pass in one
/// (`event` says which): if a shard was written since the last backward pass of the iteration
/// ended, discards the iteration and throws a c10::Error naming the root and set_is_last_backward.
void check_no_step_in_open_iteration(RootContext& context, const std::string& event);

/// "" unless the root's iteration is left open (RootContext::iteration_left_open); else why an API
/// that needs the step's gradients (fsdp::clip_grad_norm_, which prefixes its name) refuses it,
/// naming the root and set_is_last_backward.
std::string open_iteration_error(const RootContext& context);

}  // namespace runtime
}  // namespace fsdp
