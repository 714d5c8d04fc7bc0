// Test cases with known outcomes, run by harness_selftest.sh to check the multi-rank harness itself:
// that a failure on any one rank fails the test case on every rank, that later cases still run, and
// that a rank failing while the others wait in a collective ends the job through the timeout.
#include <ATen/ATen.h>

#include "fsdp_cpp/tests/testing/multi_rank.h"

using fsdp::testing::rank;
using fsdp::testing::world;
using fsdp::testing::world_size;

FSDP_RANKS_TEST_CASE("probe: passes on every rank", "[probe]") {
  at::Tensor t = at::ones({2});
  world().all_reduce(t).wait();
  CHECK(t[0].item<float>() == world_size());
}

FSDP_RANKS_TEST_CASE("probe: a CHECK fails on the last rank only", "[probe]") {
  CHECK(rank() != world_size() - 1);
}

FSDP_RANKS_TEST_CASE("probe: an exception on rank 0 only", "[probe]") {
  if (rank() == 0) throw std::runtime_error("probe exception on rank 0");
}

FSDP_RANKS_TEST_CASE("probe: runs after the failures and passes", "[probe]") {
  at::Tensor t = at::full({1}, rank(), at::kInt);
  world().all_reduce(t, c10d::ReduceOp::MAX).wait();
  CHECK(t.item<int>() == world_size() - 1);
}

FSDP_RANKS_TEST_CASE("probe: the last rank fails a REQUIRE while the others all-reduce", "[hang]") {
  REQUIRE(rank() != world_size() - 1);
  at::Tensor t = at::ones({1});
  world().all_reduce(t).wait();  // the last rank never arrives: the timeout ends the job
}
