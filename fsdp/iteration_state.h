#pragma once
// IterationState: where the root's tree is in the training loop: the phase ([Note: iteration
// phases]), the iteration counters, whether the root's forward is running, and the order in which
// units first ran their forward this iteration (it orders backward prefetch and gradient
// reduction) and in the last one (it orders forward prefetch).
//
// Invariants, kept by the transitions below (the only writers):
//  - forward_order() holds each unit at most once, in the order of its first call this iteration;
//    it is cleared only when an iteration begins or is discarded;
//  - previous_forward_order() is the forward order of the last iteration that ended (not of one
//    discarded);
//  - iterations() counts iterations that ended (a backward pass, or a forward after which none
//    could run); generation() counts iterations begun, so a hook carrying an older generation
//    comes from an earlier iteration's graph;
//  - in_root_forward() implies phase() == kForward.

#include <cstdint>
#include <vector>

namespace fsdp {

class FSDPState;

/// [Note: iteration phases] kIdle: no forward since the last backward pass ended (or none yet).
/// kForward: one or more forwards ran and no backward pass has started since. kBackward: a
/// backward pass is running; its end-of-backward callback returns to kIdle. The units' calls of
/// the iteration are kept in kIdle, so a second backward through a retained graph can run; the
/// next root forward from kIdle starts a new iteration.
enum class IterationPhase { kIdle, kForward, kBackward };

class IterationState {
 public:
  IterationPhase phase() const { return phase_; }
  /// Iterations begun (autograd hooks carry it, so a hook from an older graph is recognised).
  int64_t generation() const { return generation_; }
  /// Iterations ended (0: the first iteration, whose forward order and collectives are checked).
  int64_t iterations() const { return iterations_; }
  /// Between the root's pre-forward and post-forward (still set at the next root pre-forward: the
  /// previous forward threw).
  bool in_root_forward() const { return in_root_forward_; }
  /// The root's forward runs inside another module's hooked forward (a model under replicate whose
  /// blocks are fully_shard roots, or any outer module with hooks): the root is then not the last
  /// module of forward nor the first of backward, so it reshards after forward like any unit
  /// (FULL_SHARD) instead of staying unsharded until its backward. Set by each root pre-forward.
  bool root_nested() const { return root_nested_; }
  /// The first iteration's autograd graph check ([Note: sharded use guard]) ran.
  bool checked_sharded_use() const { return checked_sharded_use_; }
  /// Units in the order their pre-forward first ran this iteration, and in the last one.
  const std::vector<FSDPState*>& forward_order() const { return forward_order_; }
  const std::vector<FSDPState*>& previous_forward_order() const { return previous_forward_order_; }
  /// Whether `unit` ran its pre-forward this iteration.
  bool ran_forward(const FSDPState& unit) const;
  /// Backward passes that ended without ending this iteration (the root's is_last_backward false:
  /// [Note: backward passes within an iteration] in fsdp/backward.cc); 0 when none did.
  int passes_within_iteration() const { return passes_within_iteration_; }

  /// A new iteration begins: a new generation, no unit has run yet.
  void begin_iteration();
  /// The root's pre-forward: phase kForward, inside the root's forward; `nested`: root_nested().
  void enter_root_forward(bool nested);
  /// The root's post-forward.
  void exit_root_forward() { in_root_forward_ = false; }
  /// `unit`'s first call this iteration (its pre-forward; the caller knows it is the first, from
  /// the unit's UnitIteration): appended to the forward order.
  void record_first_call(FSDPState& unit) { forward_order_.push_back(&unit); }
  /// One rank (passthrough), where only the guards' errors read the order: appends `unit` unless
  /// it is there already; `restart` (the root's pre-forward) forgets the order first.
  void record_passthrough_call(FSDPState& unit, bool restart);
  /// The first pre-backward of a backward pass.
  void begin_backward() { phase_ = IterationPhase::kBackward; }
  /// The iteration ends (its backward pass ended, or its forward left nothing to backpropagate):
  /// its forward order becomes the previous one, phase kIdle, one more iteration counted.
  void end_iteration();
  /// A backward pass ended but the iteration goes on (the root's is_last_backward is false and
  /// graphs of the iteration's forwards are still live): phase kForward, so the next root forward
  /// continues the iteration and backward passes through those graphs stay valid.
  void end_pass_within_iteration() {
    phase_ = IterationPhase::kForward;
    ++passes_within_iteration_;
  }
  /// A passthrough backward pass ended (one rank: nothing is prefetched, so no order is kept):
  /// phase kIdle, one more iteration counted.
  void end_passthrough_iteration();
  /// Back to kIdle without ending the iteration: no backward can run through the root's forward
  /// any more, or a passthrough backward that threw was undone.
  void return_to_idle() { phase_ = IterationPhase::kIdle; }
  /// A forward or backward threw: the iteration's order is forgotten, phase kIdle, outside the
  /// root's forward. The counters stay.
  void discard();
  /// The graph check ran; the forwards no longer hide parameters ([Note: hidden parameters]).
  void mark_sharded_use_checked() { checked_sharded_use_ = true; }

 private:
  IterationPhase phase_ = IterationPhase::kIdle;
  int64_t generation_ = 0;
  int64_t iterations_ = 0;
  int passes_within_iteration_ = 0;
  bool in_root_forward_ = false;
  bool root_nested_ = false;
  bool checked_sharded_use_ = false;
  std::vector<FSDPState*> forward_order_;
  std::vector<FSDPState*> previous_forward_order_;
};

}  // namespace fsdp
