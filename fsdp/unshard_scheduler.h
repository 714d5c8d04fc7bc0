#pragma once
// UnshardScheduler: when the units of one root's tree all-gather (unshard, prefetch) and free
// (reshard) their parameters, within a limit on how many are unsharded or in flight at once.
//
// Invariants, kept by its four operations (the only way the runtime unshards or reshards a unit):
//  - in_flight() lists, oldest first and each once, the units whose all-gather was issued without
//    waiting and not yet waited for; it never holds more than max_unsharded() units: issuing one
//    more first waits for the oldest;
//  - unsharded_units() lists, each once, every unit the scheduler unsharded (or is all-gathering)
//    and has not resharded: a superset of in_flight(), and what unsharded_count() looks at, so
//    scheduling costs no walk over every unit;
//  - peak_unsharded() is the most units counted at once since the last reset.

#include <unordered_map>
#include <vector>

namespace fsdp {

class FSDPState;

/// For each unit, the units whose modules contain one of its modules (they run around it).
using UnitAncestors = std::unordered_map<const FSDPState*, std::vector<const FSDPState*>>;

class UnshardScheduler {
 public:
  /// `max_unsharded`: the most units unsharded (or being all-gathered) at once, beside `root`, the
  /// units running around the current one and units kept unsharded by their strategy: an implicit
  /// prefetch is skipped rather than exceed it. Also the most all-gathers in flight at once. At
  /// least 1 (smaller values count as 1).
  UnshardScheduler(const FSDPState* root, UnitAncestors ancestors, int max_unsharded);

  int max_unsharded() const { return max_unsharded_; }

  /// All-gathers `unit` now (waits for one in flight).
  void unshard(FSDPState& unit);
  /// Issues `unit`'s all-gather without waiting (within the in-flight limit).
  void start_unshard(FSDPState& unit);
  /// Issues `unit`'s all-gather without waiting, while `running` runs; an implicit prefetch
  /// (`bounded`) is skipped when it would exceed max_unsharded().
  void prefetch(FSDPState& unit, const FSDPState& running, bool bounded);
  /// Whether prefetch(unit, running, bounded) would issue an all-gather now.
  bool would_prefetch(const FSDPState& unit, const FSDPState& running, bool bounded) const;
  /// Frees `unit`'s unsharded parameters (waits for an all-gather in flight first); after its
  /// forward, keeping its post-forward slices ([Note: post-forward group]).
  void reshard(FSDPState& unit, bool after_forward = false);
  /// A forward or backward threw and every unit was resharded: nothing is in flight.
  void forget_in_flight() { in_flight_.clear(); }

  /// Units counted against max_unsharded() while `running` runs: those unsharded or in flight
  /// whose strategy reshards them and that have something to all-gather, except the root,
  /// `running` itself and the units around it.
  int unsharded_count(const FSDPState& running) const;
  /// The most units counted at once since the last reset (for tests and benchmarks), `running`
  /// included when its strategy reshards it.
  int peak_unsharded() const { return peak_unsharded_; }
  void reset_peak_unsharded() { peak_unsharded_ = 0; }

  const std::vector<FSDPState*>& in_flight() const { return in_flight_; }
  const std::vector<FSDPState*>& unsharded_units() const { return unsharded_units_; }

 private:
  bool counted(const FSDPState& unit, const FSDPState& running) const;
  void forget_in_flight(FSDPState& unit);
  void note_unsharded_unit(FSDPState& unit);
  void note_unsharded(const FSDPState& running);

  const FSDPState* root_;
  UnitAncestors ancestors_;
  int max_unsharded_;
  std::vector<FSDPState*> in_flight_;        // oldest first
  std::vector<FSDPState*> unsharded_units_;  // unsharded or in flight, not resharded since
  int peak_unsharded_ = 0;
};

}  // namespace fsdp
