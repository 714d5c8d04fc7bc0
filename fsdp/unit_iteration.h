#pragma once
// UnitIteration: what one unit did in the current iteration, as the runtime's forward and backward
// phases see it. The root's pre-forward resets it when a new iteration starts.
//
// [Note: forward calls] A unit may run several times before a backward (a module called twice, two
// root forwards whose losses are added, a forward whose graph is dropped before any backward).
// Each pre-forward records a call; its post-forward says whether the call's outputs need a
// gradient (else backward can never reach it) and keeps a weak reference to their autograd node
// (expired: the graph was freed, the call is ignored). A call whose inputs need a gradient is
// routed through RegisterPostBackward, whose backward marks the end of that call's backward; the
// end of a call whose inputs need no gradient cannot be seen before the end of the backward pass.
// The unit's gradients are ready for reduction when every live call that backward can reach has
// finished its backward.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/function.h>

namespace fsdp {

/// Where the backward pass now running reaches a unit, agreed across the ranks when it began
/// ([Note: backward reach] in fsdp/backward_reach.h).
enum class PassReach {
  kNowhere,    // on no rank: nothing to all-gather or reduce in this pass
  kSomeRanks,  // on some ranks only: every rank all-gathers it when the pass begins and reduces it
               // at the end of the pass (zeros where it was not reached)
  kEveryRank,  // on every rank: all-gathered at its pre-backward, reduced in its turn
};

class UnitIteration {
 public:
  /// A new iteration: no calls, nothing reduced.
  void reset();

  /// Pre-forward: records a call and returns its index. `first` is set when it is the unit's
  /// first call this iteration.
  size_t begin_call(bool grad_enabled, bool* first);
  /// The call's inputs were routed through RegisterPostBackward (its end can be seen).
  void set_post_backward_visible(size_t call);
  /// Post-forward of the latest call: whether its outputs need a gradient, and their autograd
  /// nodes (the call is live while one of them is).
  void end_call(bool outputs_need_grad, const std::vector<c10::intrusive_ptr<torch::autograd::Node>>& nodes);
  /// The latest call's index (post-forward belongs to it: a unit's calls do not nest).
  size_t latest_call() const { return calls_.size() - 1; }
  /// The first autograd sequence number of the latest call: nodes from this number on were
  /// created during it (this thread's counter; forward runs on one thread).
  uint64_t latest_call_first_node() const { return calls_.back().first_node; }
  bool ran_forward() const { return !calls_.empty(); }
  /// Siblings: counts post-forwards; true after the last module of the unit ran.
  bool last_module_ran(size_t modules);

  /// Whether backward can reach this unit (a live call whose outputs need a gradient).
  bool may_get_gradients() const;

  /// A backward pass starts: every call is waiting for it again, nothing reduced yet.
  void begin_backward_pass();
  /// The call's pre-backward ran (its outputs' gradients are being computed): it is live.
  void call_pre_backward(size_t call);
  /// The call's RegisterPostBackward ran.
  void call_post_backward(size_t call);
  /// Whether a call's backward is running (pre-backward ran, post-backward not yet).
  bool backward_running() const;
  /// Whether the backward pass now running reaches this unit on this rank: a live call whose
  /// pre-backward ran this pass, or whose outputs' nodes `runs_in_pass` holds for (a call whose
  /// outputs are leaves counts as reached).
  bool reached_in_pass(const std::function<bool(torch::autograd::Node*)>& runs_in_pass) const;
  /// The reach agreed when this pass began (kEveryRank until then).
  PassReach pass_reach() const { return pass_reach_; }
  void set_pass_reach(PassReach reach) { pass_reach_ = reach; }

  /// Whether every live call that backward can reach has finished its backward this pass.
  bool backward_complete() const;
  /// backward_complete(), except that a live call this pass has not reached counts as finished
  /// when `runs_in_pass` holds for none of its outputs' nodes: this pass will never reach it (an
  /// auxiliary head whose output the caller holds but the loss does not use). A call whose
  /// outputs are leaves (no nodes) is never counted so.
  bool backward_complete(const std::function<bool(torch::autograd::Node*)>& runs_in_pass) const;
  /// Whether a live call's backward end cannot be seen (its inputs needed no gradient): the unit
  /// is complete only at the end of the backward pass.
  bool completes_at_end_of_backward() const;

  /// This pass's reduction was issued (or skipped for a unit that cannot get gradients).
  bool reduced() const { return reduced_; }
  void set_reduced() { reduced_ = true; }

 private:
  struct Call {
    bool grad_enabled = false;
    uint64_t first_node = 0;
    bool post_backward_visible = false;
    bool outputs_need_grad = false;
    // The outputs' nodes (none: the outputs are leaves, live while the unit is).
    std::vector<c10::weak_intrusive_ptr<torch::autograd::Node>> nodes;
    bool reached = false;  // a pre-backward of this call ran this pass: live whatever the nodes
    bool running = false;  // pre-backward ran, post-backward not yet (this pass)
    bool done = false;     // post-backward ran (this pass)
  };
  bool live(const Call& call) const;

  std::vector<Call> calls_;
  size_t post_forwards_ = 0;
  bool reduced_ = false;
  PassReach pass_reach_ = PassReach::kEveryRank;
};

}  // namespace fsdp
