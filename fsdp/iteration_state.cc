#include "fsdp_cpp/fsdp/iteration_state.h"

#include <algorithm>

namespace fsdp {

bool IterationState::ran_forward(const FSDPState& unit) const {
  return std::find(forward_order_.begin(), forward_order_.end(), &unit) != forward_order_.end();
}

void IterationState::begin_iteration() {
  ++generation_;
  forward_order_.clear();
  passes_within_iteration_ = 0;
}

void IterationState::enter_root_forward(bool nested) {
  phase_ = IterationPhase::kForward;
  in_root_forward_ = true;
  root_nested_ = nested;
}

void IterationState::record_passthrough_call(FSDPState& unit, bool restart) {
  if (restart) forward_order_.clear();
  if (!ran_forward(unit)) forward_order_.push_back(&unit);
}

void IterationState::end_iteration() {
  previous_forward_order_ = forward_order_;
  phase_ = IterationPhase::kIdle;
  ++iterations_;
  passes_within_iteration_ = 0;
}

void IterationState::end_passthrough_iteration() {
  phase_ = IterationPhase::kIdle;
  ++iterations_;
}

void IterationState::discard() {
  forward_order_.clear();
  phase_ = IterationPhase::kIdle;
  in_root_forward_ = false;
  passes_within_iteration_ = 0;
}

}  // namespace fsdp
