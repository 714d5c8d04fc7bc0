#pragma once
// Not a public header. The project's own layers above the engine (composable/, the state-dict and
// checkpoint code) and the tests that test the engine reach a unit's engine state (FSDPState,
// its FlatParamHandles, the root's context) through it. User code uses FSDPModule's accessors
// (composable/fully_shard.h) instead: the engine's types change without notice, and
// //composable:fully_shard_internal is visible to the project only.

#include <memory>
#include <vector>

#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/fsdp/fsdp_state.h"

namespace fsdp::detail {

struct FSDPModuleAccess {
  static FSDPState& state(const FSDPModule& unit) { return *unit.state_; }
};

/// The engine state of `unit`.
inline FSDPState& state_of(const FSDPModule& unit) { return FSDPModuleAccess::state(unit); }

/// The unit's FlatParamHandles (one per dtype and requires_grad).
inline const std::vector<std::unique_ptr<FlatParamHandle>>& handles_of(const FSDPModule& unit) {
  return state_of(unit).handles();
}

}  // namespace fsdp::detail
