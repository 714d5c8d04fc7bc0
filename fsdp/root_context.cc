#include "fsdp/root_context.h"

#include <algorithm>

#include "fsdp/fsdp_state.h"

namespace fsdp {

bool RootContext::counted(const FSDPState& unit, const FSDPState& running) const {
  if (&unit == root || &unit == &running || !unit.config().reshard_after_forward()) return false;
  const auto it = ancestors.find(&running);
  if (it != ancestors.end() && std::find(it->second.begin(), it->second.end(), &unit) != it->second.end()) {
    return false;
  }
  bool gathers = false;  // a unit with nothing to all-gather holds no unsharded memory
  for (const auto& h : unit.handles()) gathers |= h->is_sharded_strategy();
  return gathers && (unit.unshard_in_flight() || unit.is_unsharded());
}

int RootContext::unsharded_count(const FSDPState& running) const {
  int count = 0;
  for (const FSDPState* unit : unsharded_units) count += counted(*unit, running) ? 1 : 0;
  return count;
}

void RootContext::note_unsharded_unit(FSDPState& unit) {
  if (std::find(unsharded_units.begin(), unsharded_units.end(), &unit) == unsharded_units.end()) {
    unsharded_units.push_back(&unit);
  }
}

void RootContext::note_unsharded(const FSDPState& running) {
  // The running unit itself counts when its strategy reshards it.
  int count = unsharded_count(running);
  if (&running != root && running.config().reshard_after_forward()) {
    for (const auto& h : running.handles()) {
      if (h->is_sharded_strategy()) {
        ++count;
        break;
      }
    }
  }
  peak_unsharded_ = std::max(peak_unsharded_, count);
}

void RootContext::forget_in_flight(FSDPState& unit) {
  unshards_in_flight.erase(std::remove(unshards_in_flight.begin(), unshards_in_flight.end(), &unit),
                           unshards_in_flight.end());
}

void RootContext::unshard(FSDPState& unit) {
  unit.unshard();
  forget_in_flight(unit);
  note_unsharded_unit(unit);
  note_unsharded(unit);
}

void RootContext::start_unshard(FSDPState& unit) {
  if (unit.is_unsharded() || unit.unshard_in_flight()) return;
  while (static_cast<int>(unshards_in_flight.size()) >= max_unsharded) {
    FSDPState* oldest = unshards_in_flight.front();
    oldest->unshard();
    forget_in_flight(*oldest);
  }
  unit.start_unshard();
  if (unit.unshard_in_flight()) unshards_in_flight.push_back(&unit);
  note_unsharded_unit(unit);
}

void RootContext::prefetch(FSDPState& unit, const FSDPState& running, bool bounded) {
  if (unit.is_unsharded() || unit.unshard_in_flight()) return;
  const bool running_counts = &running != root && running.config().reshard_after_forward();
  if (bounded && unit.config().reshard_after_forward() &&
      unsharded_count(running) + (running_counts ? 1 : 0) >= max_unsharded) {
    return;
  }
  start_unshard(unit);
  note_unsharded(running);
}

void RootContext::reshard(FSDPState& unit) {
  unit.reshard();  // waits for an all-gather in flight first
  forget_in_flight(unit);
  unsharded_units.erase(std::remove(unsharded_units.begin(), unsharded_units.end(), &unit),
                        unsharded_units.end());
}

void RootContext::check_ranks_agree(Fingerprint fingerprint) {
  if (!check_divergence || comm == nullptr || comm->size() == 1) return;
  fsdp::check_ranks_agree(*comm, std::move(fingerprint), iterations);
}

std::vector<FSDPState*> prefetch_targets(const FSDPState& unit,
                                         const std::vector<FSDPState*>* explicit_targets,
                                         const std::vector<FSDPState*>& order, int direction) {
  if (explicit_targets) return *explicit_targets;
  const auto it = std::find(order.begin(), order.end(), &unit);
  if (it == order.end()) return {};
  const auto index = (it - order.begin()) + direction;
  if (index < 0 || index >= static_cast<std::ptrdiff_t>(order.size())) return {};
  return {order[static_cast<size_t>(index)]};
}

}  // namespace fsdp
