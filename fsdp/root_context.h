#pragma once
// RootContext: what the root unit shares with every unit of its tree once lazily initialised. The
// tree's facts, fixed at lazy initialisation (the root, the list of units, the communicator,
// whether every handle is a passthrough), and the parts that change as the tree trains, each a
// class that keeps its own invariants:
//   - IterationState (fsdp/iteration_state.h): phase, iteration counters, forward order;
//   - UnshardScheduler (fsdp/unshard_scheduler.h): unshard, prefetch, reshard within a limit;
//   - BackwardReductionQueue (fsdp/backward_reduction_queue.h): the order gradients are reduced in;
//   - DivergenceCheck (fsdp/divergence_check.h): whether and how ranks compare what they do;
//   - SetAsideGradients (fsdp/set_aside_gradients.h): a passthrough backward's undo record;
//   - ShardSnapshot (fsdp/shard_snapshot.h): the shards when a pass ended within an iteration.
// The transitions that span several parts (an iteration begins, a backward pass begins or ends,
// an iteration is discarded) are methods here, so the parts always agree.

#include <cstdint>
#include <memory>
#include <vector>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/fsdp/backward_reduction_queue.h"
#include "fsdp_cpp/fsdp/divergence.h"
#include "fsdp_cpp/fsdp/divergence_check.h"
#include "fsdp_cpp/fsdp/iteration_state.h"
#include "fsdp_cpp/fsdp/set_aside_gradients.h"
#include "fsdp_cpp/fsdp/shard_snapshot.h"
#include "fsdp_cpp/fsdp/unshard_scheduler.h"

namespace fsdp {

class FSDPState;

class RootContext {
 public:
  /// `states`: every unit of `root`'s tree, the root first, in module order; `ancestors`: for each,
  /// the units running around it. The communicator and the all-gather limit are the root's.
  RootContext(FSDPState& root, std::vector<FSDPState*> states, UnitAncestors ancestors);
  RootContext(const RootContext&) = delete;
  RootContext& operator=(const RootContext&) = delete;

  FSDPState* root() const { return root_; }
  /// Every unit in the root's tree (the root first), in module order.
  const std::vector<FSDPState*>& states() const { return states_; }
  const std::shared_ptr<comm::Communicator>& comm() const { return comm_; }
  /// Every handle of the tree is a passthrough (one rank, nothing to gather, copy or reduce): the
  /// hooks do nothing beyond checking that units run inside the root's forward.
  bool passthrough() const { return passthrough_; }

  IterationState& iteration_state() { return iteration_; }
  const IterationState& iteration_state() const { return iteration_; }
  UnshardScheduler& scheduler() { return scheduler_; }
  const UnshardScheduler& scheduler() const { return scheduler_; }
  BackwardReductionQueue& reductions() { return reductions_; }
  const BackwardReductionQueue& reductions() const { return reductions_; }
  const DivergenceCheck& divergence() const { return divergence_; }
  /// Passthrough: each trainable parameter and the gradient it held when the backward pass began.
  SetAsideGradients& passthrough_saved_grads() { return passthrough_saved_grads_; }

  /// A new iteration begins (the root's pre-forward): a new generation, no unit has run or been
  /// reduced, every unit's calls forgotten, and whether its collectives are checked decided.
  void begin_iteration();
  /// The first pre-backward of a pass, run by autograd graph task `graph_task`.
  void begin_backward_pass(int graph_task);
  /// The end-of-backward callback reduced, finalized and resharded: the iteration ends, or with
  /// `ends_iteration` false it goes on ([Note: backward passes within an iteration]).
  void end_backward_pass(bool ends_iteration = true);
  /// Whether backward can still reach some unit of the tree (a live call whose outputs need a
  /// gradient).
  bool any_unit_may_get_gradients() const;
  /// [Note: open iterations] in fsdp/open_iteration.h: a backward pass ended without ending the
  /// iteration (the root's is_last_backward false), and a graph of its forwards is still live, so
  /// more backward passes of this iteration are expected; outside any forward or backward.
  bool iteration_left_open() const;
  /// Whether some unit's shard was written (an optimizer step) since the last backward pass that
  /// ended without ending the iteration (fsdp/shard_snapshot.h says what is seen). False when no
  /// such pass ended this iteration.
  bool shards_written_since_pass_within_iteration() const;
  /// A forward or backward threw (every unit already resharded and idle): nothing in flight,
  /// reduced or ordered, phase kIdle.
  void discard();

  /// Exchanges `fingerprint` (with the iteration number and the sequence number) across the ranks
  /// when this iteration is checked and there are several ranks; throws the same error on every
  /// rank if they differ.
  ///
  ///   if (context.divergence().enabled()) context.check_ranks_agree(Fingerprint("finished its forward"));
  void check_ranks_agree(Fingerprint fingerprint);
  /// The same for an event of `unit`: over the unit's own communicator when it is not the root's
  /// (a unit on a subset of the root's ranks, e.g. an expert: [Note: units on a subset of the
  /// root's ranks] in fsdp/lazy_init.cc), else over the root's.
  void check_ranks_agree(const FSDPState& unit, Fingerprint fingerprint);

  /// The scheduler's peak (for tests and benchmarks).
  int peak_unsharded() const { return scheduler_.peak_unsharded(); }
  void reset_peak_unsharded() { scheduler_.reset_peak_unsharded(); }

 private:
  FSDPState* root_;
  std::vector<FSDPState*> states_;
  std::shared_ptr<comm::Communicator> comm_;
  bool passthrough_;
  IterationState iteration_;
  UnshardScheduler scheduler_;
  BackwardReductionQueue reductions_;
  DivergenceCheck divergence_;
  SetAsideGradients passthrough_saved_grads_;
  ShardSnapshot shards_at_pass_end_;  // when the last pass within the iteration ended
};

/// The units `unit` prefetches: `explicit_targets` if set, else the one next to it in `order`
/// (+1: forward, the unit that ran after it; -1: backward, the one that ran before it).
std::vector<FSDPState*> prefetch_targets(const FSDPState& unit,
                                         const std::vector<FSDPState*>* explicit_targets,
                                         const std::vector<FSDPState*>& order, int direction);

}  // namespace fsdp
