#include "fsdp_cpp/contract/recompute_region.h"

namespace fsdp::contract {
namespace {
thread_local RecomputeRegion current_region;
}  // namespace

RecomputeRegion current_recompute_region() { return current_region; }

RecomputeRegionGuard::RecomputeRegionGuard(RecomputePhase phase, const torch::nn::Module& module)
    : previous_(current_region) {
  current_region = RecomputeRegion{phase, &module};
}

RecomputeRegionGuard::~RecomputeRegionGuard() { current_region = previous_; }

}  // namespace fsdp::contract
