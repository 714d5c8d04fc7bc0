#pragma once
// BackwardReductionQueue: the order in which one backward pass reduces the units' gradients.
//
// Gradients are reduce-scattered in reverse forward order on every rank, so the collectives match
// across ranks whatever order autograd finishes the units in. A unit whose turn has not come
// waits; a unit whose backward end cannot be seen (a call's inputs needed no gradient) is
// deferred to the end of the pass rather than hold up the units before it, and the deferred are
// reduced then, in the order they were deferred. Deferral depends only on the units (never on when
// the walk reaches them), so every rank issues the same order: the others in reverse forward
// order, then the deferred.
//
// Invariants, kept by the methods below (the only writers):
//  - reduced_from_back() units, counted from the back of the forward order, have had their turn
//    this pass (reduced, skipped or deferred); it only grows during a pass;
//  - deferred() holds each deferred unit once and is emptied when the end of the pass reduces it;
//  - graph_task() is the autograd graph task that began the pass, -1 outside a pass;
//  - awaiting_finalize() is the unit whose reduction was issued last and not finalized yet (its
//    gradient buffers are freed when the next unit's reduction is issued), null outside a pass.

#include <cstddef>
#include <vector>

namespace fsdp {

class FSDPState;

class BackwardReductionQueue {
 public:
  /// What a unit's turn does.
  enum class Turn {
    kSkip,    // nothing to reduce (no gradients can reach it, or nothing trainable)
    kDefer,   // reduced at the end of the pass
    kReduce,  // reduced now, once ready (at the end of the pass whether ready or not)
  };

  /// A new iteration: nothing reduced, nothing deferred or awaiting (the graph task is kept: an
  /// iteration begins outside a pass).
  void begin_iteration();
  /// The first pre-backward of a pass, run by autograd graph task `graph_task`.
  void begin_pass(int graph_task);
  /// The end-of-backward callback finished: outside a pass.
  void end_pass();
  /// A forward or backward threw: as after end_pass, and nothing reduced or deferred.
  void discard();

  /// Gives the units of `order` (the forward order) their turn from the back, as far as it goes:
  /// with `final` (the end of the pass) every unit, then every deferred one; else only while
  /// the next one to reduce is ready. `steps` provides
  ///   Turn turn(FSDPState&);  bool ready(FSDPState&);  (asked only before the end of the pass)
  ///   void reduce(FSDPState&);  void skip(FSDPState&);
  template <class Steps>
  void advance(const std::vector<FSDPState*>& order, bool final, Steps& steps);

  size_t reduced_from_back() const { return reduced_from_back_; }
  const std::vector<FSDPState*>& deferred() const { return deferred_; }
  int graph_task() const { return graph_task_; }
  FSDPState* awaiting_finalize() const { return awaiting_finalize_; }
  /// The unit whose reduction was just issued and must be finalized later (null: none).
  void set_awaiting_finalize(FSDPState* unit) { awaiting_finalize_ = unit; }

 private:
  size_t reduced_from_back_ = 0;
  std::vector<FSDPState*> deferred_;
  FSDPState* awaiting_finalize_ = nullptr;
  int graph_task_ = -1;
};

template <class Steps>
void BackwardReductionQueue::advance(const std::vector<FSDPState*>& order, bool final, Steps& steps) {
  const size_t n = order.size();
  while (reduced_from_back_ < n) {
    FSDPState& unit = *order[n - 1 - reduced_from_back_];
    switch (steps.turn(unit)) {
      case Turn::kSkip:
        steps.skip(unit);
        break;
      case Turn::kDefer:
        deferred_.push_back(&unit);
        break;
      case Turn::kReduce:
        if (!final && !steps.ready(unit)) return;
        steps.reduce(unit);
        break;
    }
    ++reduced_from_back_;
  }
  if (!final) return;
  for (FSDPState* unit : deferred_) steps.reduce(*unit);
  deferred_.clear();
}

}  // namespace fsdp
