#include "fsdp_cpp/fsdp/root_context.h"

#include <algorithm>

#include "fsdp_cpp/fsdp/fsdp_state.h"

namespace fsdp {
namespace {

bool all_passthrough(const std::vector<FSDPState*>& states) {
  bool passthrough = true;
  for (const FSDPState* unit : states) {
    for (const auto& h : unit->handles()) passthrough &= h->passthrough();
  }
  return passthrough;
}

}  // namespace

RootContext::RootContext(FSDPState& root, std::vector<FSDPState*> states, UnitAncestors ancestors)
    : root_(&root), states_(std::move(states)), comm_(root.config().comm),
      passthrough_(all_passthrough(states_)),
      scheduler_(&root, std::move(ancestors), root.config().options.max_unshards_in_flight()),
      divergence_(comm_) {}

void RootContext::begin_iteration() {
  iteration_.begin_iteration();
  shards_at_pass_end_.clear();
  reductions_.begin_iteration();
  for (FSDPState* unit : states_) unit->iteration().reset();
  divergence_.begin_iteration(iteration_.iterations());
}

void RootContext::begin_backward_pass(int graph_task) {
  iteration_.begin_backward();
  reductions_.begin_pass(graph_task);
}

void RootContext::end_backward_pass(bool ends_iteration) {
  reductions_.end_pass();
  if (ends_iteration) {
    iteration_.end_iteration();
    shards_at_pass_end_.clear();
  } else {
    iteration_.end_pass_within_iteration();
    shards_at_pass_end_.take(states_);
  }
}

bool RootContext::iteration_left_open() const {
  return iteration_.phase() == IterationPhase::kForward && !iteration_.in_root_forward() &&
         iteration_.passes_within_iteration() > 0 && any_unit_may_get_gradients();
}

bool RootContext::shards_written_since_pass_within_iteration() const {
  return iteration_.passes_within_iteration() > 0 && shards_at_pass_end_.changed(states_);
}

bool RootContext::any_unit_may_get_gradients() const {
  for (const FSDPState* unit : states_) {
    if (unit->iteration().may_get_gradients()) return true;
  }
  return false;
}

void RootContext::discard() {
  reductions_.discard();
  scheduler_.forget_in_flight();
  iteration_.discard();
  shards_at_pass_end_.clear();
}

void RootContext::check_ranks_agree(Fingerprint fingerprint) {
  divergence_.check(std::move(fingerprint), iteration_.iterations());
}

void RootContext::check_ranks_agree(const FSDPState& unit, Fingerprint fingerprint) {
  const auto& own = unit.config().comm;
  if (own && own != comm_) {
    divergence_.check(*own, std::move(fingerprint), iteration_.iterations());
  } else {
    divergence_.check(std::move(fingerprint), iteration_.iterations());
  }
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
