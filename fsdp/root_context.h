#pragma once
// RootContext: what the root unit shares with every unit of its tree once lazily initialised: the
// list of units, the iteration's phase and forward order (which orders backward prefetch and
// gradient reduction), and the scheduling of all-gathers (unshard, prefetch, reshard).

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>

#include "comm/communicator.h"
#include "fsdp/divergence.h"

namespace fsdp {

class FSDPState;

/// [Note: iteration phases] kIdle: no forward since the last backward pass ended (or none yet).
/// kForward: one or more forwards ran and no backward pass has started since. kBackward: a
/// backward pass is running; its end-of-backward callback returns to kIdle. The units' calls of
/// the iteration are kept in kIdle, so a second backward through a retained graph can run; the
/// next root forward from kIdle starts a new iteration.
enum class IterationPhase { kIdle, kForward, kBackward };

class RootContext {
 public:
  FSDPState* root = nullptr;
  /// Every unit in the root's tree (the root first), in module order.
  std::vector<FSDPState*> states;
  std::shared_ptr<comm::Communicator> comm;
  /// For each unit, the units whose modules contain one of its modules (they run around it).
  std::unordered_map<const FSDPState*, std::vector<const FSDPState*>> ancestors;

  /// Units in the order their pre-forward first ran this iteration, and in the last one.
  std::vector<FSDPState*> forward_order;
  std::vector<FSDPState*> previous_forward_order;
  /// The most units unsharded (or being all-gathered) at once, beside the root, the units
  /// running around the current one and units kept unsharded by their strategy: an implicit
  /// prefetch is skipped rather than exceed it. Also the most all-gathers in flight at once:
  /// issuing one more first waits for the oldest.
  int max_unsharded = 2;
  /// Units whose all-gathers are in flight, oldest first.
  std::vector<FSDPState*> unshards_in_flight;
  /// Units this context unsharded (or is all-gathering) and has not resharded: what
  /// unsharded_count() looks at, so scheduling costs no walk over every unit.
  std::vector<FSDPState*> unsharded_units;

  /// Every handle of the tree is a passthrough (one rank, nothing to gather, copy or reduce): the
  /// hooks do nothing beyond checking that units run inside the root's forward.
  bool passthrough = false;
  /// Passthrough: each trainable parameter and the gradient it held when the backward pass began.
  std::vector<std::pair<at::Tensor, at::Tensor>> passthrough_saved_grads;

  IterationPhase phase = IterationPhase::kIdle;
  /// Bumped by every new iteration; autograd hooks carry it, so a hook from an older iteration's
  /// graph is recognised.
  int64_t generation = 0;
  /// The root's forward runs inside another module's hooked forward (a model under replicate whose
  /// blocks are fully_shard roots, or any outer module with hooks): the root is then not the last
  /// module of forward nor the first of backward, so it reshards after forward like any unit
  /// (FULL_SHARD) instead of staying unsharded until its backward. Set by each root pre-forward.
  bool root_nested = false;
  /// Between the root's pre-forward and post-forward (still set at the next root pre-forward:
  /// the previous forward threw).
  bool in_root_forward = false;
  /// Gradients are reduce-scattered in reverse forward order on every rank (the collectives then
  /// match across ranks); units before this index (from the back) are done this backward pass.
  size_t reduced_from_back = 0;
  /// The unit whose reduction was issued last and is not finalized yet (its gradient buffers are
  /// freed when the next unit's reduction is issued).
  FSDPState* awaiting_finalize = nullptr;
  /// Units whose backward end cannot be seen, reduced at the end of the pass (in this order).
  std::vector<FSDPState*> deferred_reductions;
  /// The autograd graph task that began this backward pass (its id; -1 outside a pass): only
  /// while it runs do its nodes tell which units the pass will still reach (a nested, reentrant
  /// backward sees only its own graph).
  int backward_graph_task = -1;
  bool checked_sharded_use = false;  // the first iteration's autograd graph check ran
  /// Backward passes completed (0: the first iteration, whose forward order is checked).
  int64_t iterations = 0;
  /// This iteration's collectives are checked across ranks ([Note: divergence check] in
  /// fsdp/divergence.h): the first iteration, and every one with FSDP_DEBUG=1. Set when an
  /// iteration starts; callers build a Fingerprint only when it is set.
  bool check_divergence = false;

  /// Exchanges `fingerprint` (with the iteration number and the sequence number) across the ranks
  /// of `comm` when check_divergence is set and there are several ranks; throws the same error on
  /// every rank if they differ.
  ///
  ///   if (context.check_divergence) context.check_ranks_agree(Fingerprint("finished its forward"));
  void check_ranks_agree(Fingerprint fingerprint);

  /// All-gathers `unit` now (waits for one in flight).
  void unshard(FSDPState& unit);
  /// Issues `unit`'s all-gather without waiting (within the in-flight limit).
  void start_unshard(FSDPState& unit);
  /// Issues `unit`'s all-gather without waiting, while `running` runs; an implicit prefetch
  /// (`bounded`) is skipped when it would exceed max_unsharded.
  void prefetch(FSDPState& unit, const FSDPState& running, bool bounded);
  /// Frees `unit`'s unsharded parameters (waits for an all-gather in flight first).
  void reshard(FSDPState& unit);
  /// Units counted against max_unsharded while `running` runs.
  int unsharded_count(const FSDPState& running) const;
  /// The most units counted at once since the last reset (for tests and benchmarks).
  int peak_unsharded() const { return peak_unsharded_; }
  void reset_peak_unsharded() { peak_unsharded_ = 0; }

 private:
  bool counted(const FSDPState& unit, const FSDPState& running) const;
  void forget_in_flight(FSDPState& unit);
  void note_unsharded_unit(FSDPState& unit);
  void note_unsharded(const FSDPState& running);
  int peak_unsharded_ = 0;
};

/// The units `unit` prefetches: `explicit_targets` if set, else the one next to it in `order`
/// (+1: forward, the unit that ran after it; -1: backward, the one that ran before it).
std::vector<FSDPState*> prefetch_targets(const FSDPState& unit,
                                         const std::vector<FSDPState*>* explicit_targets,
                                         const std::vector<FSDPState*>& order, int direction);

}  // namespace fsdp
