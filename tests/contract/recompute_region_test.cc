#include "fsdp_cpp/contract/recompute_region.h"

#include <thread>

#include <torch/nn/module.h>

// Catch2 last: c10/util/Logging.h defines a CHECK macro of its own, and the last definition wins.
#include <catch2/catch.hpp>

using fsdp::contract::RecomputePhase;
using fsdp::contract::RecomputeRegionGuard;
using fsdp::contract::current_recompute_region;

TEST_CASE("recompute regions nest per thread and end with their guard") {
  torch::nn::Module outer, inner;
  CHECK(current_recompute_region().phase == RecomputePhase::kNone);
  CHECK(current_recompute_region().module == nullptr);
  {
    RecomputeRegionGuard a(RecomputePhase::kDiscarding, outer);
    CHECK(current_recompute_region().phase == RecomputePhase::kDiscarding);
    CHECK(current_recompute_region().module == &outer);
    {
      RecomputeRegionGuard b(RecomputePhase::kRecomputing, inner);
      CHECK(current_recompute_region().phase == RecomputePhase::kRecomputing);
      CHECK(current_recompute_region().module == &inner);
      RecomputePhase other_thread = RecomputePhase::kDiscarding;
      std::thread([&] { other_thread = current_recompute_region().phase; }).join();
      CHECK(other_thread == RecomputePhase::kNone);
    }
    CHECK(current_recompute_region().module == &outer);
  }
  CHECK(current_recompute_region().phase == RecomputePhase::kNone);
}
