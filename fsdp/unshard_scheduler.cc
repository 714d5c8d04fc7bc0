#include "fsdp_cpp/fsdp/unshard_scheduler.h"

#include <algorithm>

#include "fsdp_cpp/fsdp/fsdp_state.h"

namespace fsdp {
namespace {

// A unit with nothing to all-gather holds no unsharded memory.
bool gathers(const FSDPState& unit) {
  for (const auto& h : unit.handles()) {
    if (h->is_sharded_strategy()) return true;
  }
  return false;
}

}  // namespace

UnshardScheduler::UnshardScheduler(const FSDPState* root, UnitAncestors ancestors, int max_unsharded)
    : root_(root), ancestors_(std::move(ancestors)), max_unsharded_(std::max(1, max_unsharded)) {}

bool UnshardScheduler::counted(const FSDPState& unit, const FSDPState& running) const {
  if (&unit == root_ || &unit == &running || !unit.config().reshard_after_forward()) return false;
  const auto it = ancestors_.find(&running);
  if (it != ancestors_.end() && std::find(it->second.begin(), it->second.end(), &unit) != it->second.end()) {
    return false;
  }
  return gathers(unit) && (unit.unshard_in_flight() || unit.is_unsharded());
}

int UnshardScheduler::unsharded_count(const FSDPState& running) const {
  int count = 0;
  for (const FSDPState* unit : unsharded_units_) count += counted(*unit, running) ? 1 : 0;
  return count;
}

void UnshardScheduler::note_unsharded_unit(FSDPState& unit) {
  if (std::find(unsharded_units_.begin(), unsharded_units_.end(), &unit) == unsharded_units_.end()) {
    unsharded_units_.push_back(&unit);
  }
}

void UnshardScheduler::note_unsharded(const FSDPState& running) {
  // The running unit itself counts when its strategy reshards it.
  int count = unsharded_count(running);
  if (&running != root_ && running.config().reshard_after_forward() && gathers(running)) ++count;
  peak_unsharded_ = std::max(peak_unsharded_, count);
}

void UnshardScheduler::forget_in_flight(FSDPState& unit) {
  in_flight_.erase(std::remove(in_flight_.begin(), in_flight_.end(), &unit), in_flight_.end());
}

void UnshardScheduler::unshard(FSDPState& unit) {
  unit.unshard();
  forget_in_flight(unit);
  note_unsharded_unit(unit);
  note_unsharded(unit);
}

void UnshardScheduler::start_unshard(FSDPState& unit) {
  if (unit.is_unsharded() || unit.unshard_in_flight()) return;
  while (static_cast<int>(in_flight_.size()) >= max_unsharded_) {
    FSDPState* oldest = in_flight_.front();
    oldest->unshard();
    forget_in_flight(*oldest);
  }
  unit.start_unshard();
  if (unit.unshard_in_flight()) in_flight_.push_back(&unit);
  note_unsharded_unit(unit);
}

bool UnshardScheduler::would_prefetch(const FSDPState& unit, const FSDPState& running, bool bounded) const {
  if (unit.is_unsharded() || unit.unshard_in_flight()) return false;
  const bool running_counts = &running != root_ && running.config().reshard_after_forward();
  return !(bounded && unit.config().reshard_after_forward() &&
           unsharded_count(running) + (running_counts ? 1 : 0) >= max_unsharded_);
}

void UnshardScheduler::prefetch(FSDPState& unit, const FSDPState& running, bool bounded) {
  if (!would_prefetch(unit, running, bounded)) return;
  start_unshard(unit);
  note_unsharded(running);
}

void UnshardScheduler::reshard(FSDPState& unit, bool after_forward) {
  unit.reshard(after_forward);  // waits for an all-gather in flight first
  forget_in_flight(unit);
  unsharded_units_.erase(std::remove(unsharded_units_.begin(), unsharded_units_.end(), &unit),
                         unsharded_units_.end());
}

}  // namespace fsdp
