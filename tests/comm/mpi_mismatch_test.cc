// Ranks that issue different collectives (divergence: an extra forward on one rank, an exception
// caught on one rank) get, on every rank, an error naming the collective, this rank's sizes, the
// API that issued it and FSDP_DEBUG=1, instead of MPI_ERR_TRUNCATE on some ranks and a hang on
// the others; the collective runs on no rank, so the group stays usable afterwards.
//
// Run on 2, 3 and 4 ranks (tests/comm/BUILD.bazel); every case is symmetric in the world size.
#include <string>
#include <vector>

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>

#include "fsdp_cpp/comm/issuing_api.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::testing::error_of;
using fsdp::testing::rank;
using fsdp::testing::world;
using fsdp::testing::world_size;

// After a refused collective the same group still computes correctly.
void check_group_still_works() {
  at::Tensor t = at::ones({3});
  world().all_reduce(t).wait();
  CHECK(t.equal(at::full({3}, world_size(), at::kFloat)));
}

bool last_rank() { return rank() == world_size() - 1; }

}  // namespace

FSDP_RANKS_TEST_CASE("an all-gather whose size differs on one rank fails on every rank with its sizes and API",
                     "[comm][mpi][mismatch]") {
  const int W = world_size();
  // The last rank gathers twice as much, as a rank whose unit holds other parameters would.
  const int64_t count = last_rank() ? 32 : 16;
  const std::string error = error_of([&] {
    fsdp::comm::IssuingApi api("fully_shard pre-forward of unit 'blocks.1'");
    at::Tensor out = at::empty({W * count});
    world().all_gather_into_tensor(out, at::ones({count}), "blocks.1").wait();
  });
  INFO(error);
  CHECK_THAT(error, Contains("all_gather_into_tensor #"));
  CHECK_THAT(error, Contains("(" + std::to_string(count) + " elements of Float per rank)"));
  CHECK_THAT(error, Contains("issued by fully_shard pre-forward of unit 'blocks.1' > collective tagged 'blocks.1'"));
  CHECK_THAT(error, Contains("the element count per rank differs across ranks: from 16 to 32 (this rank: " +
                             std::to_string(count) + ")"));
  CHECK_THAT(error, Contains("not run on any rank"));
  CHECK_THAT(error, Contains("FSDP_DEBUG=1"));
  CHECK_THAT(error, !Contains("MPI_ERR_TRUNCATE"));
  check_group_still_works();
}

FSDP_RANKS_TEST_CASE("a reduce-scatter on one rank against an all-gather on the others is named on every rank",
                     "[comm][mpi][mismatch]") {
  const int W = world_size();
  const std::string error = error_of([&] {
    fsdp::comm::IssuingApi api(last_rank() ? "fully_shard post-backward" : "fully_shard pre-backward");
    if (last_rank()) {
      world().reduce_scatter_tensor(at::empty({8}), at::ones({W * 8})).wait();
    } else {
      world().all_gather_into_tensor(at::empty({W * 8}), at::ones({8})).wait();
    }
  });
  INFO(error);
  if (last_rank()) {
    CHECK_THAT(error, Contains("reduce_scatter_tensor #") && Contains("issued by fully_shard post-backward") &&
                          Contains("this rank issued reduce_scatter_tensor, another rank all_gather_into_tensor"));
  } else {
    CHECK_THAT(error, Contains("all_gather_into_tensor #") && Contains("issued by fully_shard pre-backward") &&
                          Contains("this rank issued all_gather_into_tensor, another rank reduce_scatter_tensor"));
  }
  CHECK_THAT(error, Contains("FSDP_DEBUG=1"));
  check_group_still_works();
}

FSDP_RANKS_TEST_CASE("an extra collective on one rank (an extra forward) is named where the ranks part",
                     "[comm][mpi][mismatch]") {
  const int W = world_size();
  // The last rank runs an extra all-gather before the all-reduce every rank runs; the others' all-
  // reduce meets it. Afterwards the last rank's all-reduce pairs with one more all-reduce of the
  // others, so the group is in step again for the next case.
  std::string error;
  if (last_rank()) {
    error = error_of([&] {
      fsdp::comm::IssuingApi api("extra forward");
      world().all_gather_into_tensor(at::empty({W * 4}), at::ones({4})).wait();
    });
  } else {
    error = error_of([&] {
      fsdp::comm::IssuingApi api("clip_grad_norm_");
      at::Tensor t = at::ones({4});
      world().all_reduce(t).wait();
    });
  }
  INFO(error);
  CHECK_THAT(error, Contains(last_rank() ? "issued by extra forward" : "issued by clip_grad_norm_"));
  CHECK_THAT(error, Contains(last_rank() ? "this rank issued all_gather_into_tensor, another rank allreduce"
                                         : "this rank issued allreduce, another rank all_gather_into_tensor"));
  at::Tensor t = at::ones({4});
  world().all_reduce(t).wait();
  CHECK(t.equal(at::full({4}, W, at::kFloat)));
}

FSDP_RANKS_TEST_CASE("a broadcast from different roots and an all-reduce of another dtype are refused",
                     "[comm][mpi][mismatch]") {
  const int W = world_size();
  {
    const std::string error = error_of([&] { world().broadcast(at::ones({5}), last_rank() ? 1 : 0).wait(); });
    INFO(error);
    CHECK_THAT(error, Contains("broadcast #") && Contains("the root rank differs across ranks: from 0 to 1 (this rank: " +
                                                          std::string(last_rank() ? "1" : "0") + ")"));
    CHECK_THAT(error, Contains("issued by an API that did not name itself"));
  }
  {
    const std::string error = error_of([&] {
      at::Tensor t = at::ones({5}, last_rank() ? at::kDouble : at::kFloat);
      world().all_reduce(t).wait();
    });
    INFO(error);
    CHECK_THAT(error, Contains("allreduce #") && Contains("the dtype differs across ranks") &&
                          Contains(last_rank() ? "(this rank: Double)" : "(this rank: Float)"));
  }
  check_group_still_works();
  (void)W;
}

FSDP_RANKS_TEST_CASE("equal-sized all-gathers of different units fail on every rank, each naming its own unit",
                     "[comm][mpi][mismatch]") {
  const int W = world_size();
  // As when a unit is called on some ranks only: the others gather the next unit, of the same size.
  const std::string unit = last_rank() ? "experts.2" : "experts.1";
  const std::string error = error_of([&] {
    fsdp::comm::IssuingApi api("fully_shard pre-forward of unit '" + unit + "'");
    world().all_gather_into_tensor(at::empty({W * 8}), at::ones({8}), unit).wait();
  });
  INFO(error);
  CHECK_THAT(error, Contains("all_gather_into_tensor #") && Contains("collective tagged '" + unit + "'"));
  CHECK_THAT(error, Contains("the tag differs across ranks (this rank: '" + unit + "'"));
  CHECK_THAT(error, Contains("called on some ranks only"));
  CHECK_THAT(error, !Contains("element count"));
  // The same tag on every rank passes.
  at::Tensor out = at::empty({W * 8});
  world().all_gather_into_tensor(out, at::ones({8}), "experts.1").wait();
  CHECK(out.equal(at::ones({W * 8})));
  check_group_still_works();
}

FSDP_RANKS_TEST_CASE("an all-to-all on one rank against a reduce-scatter on the others is named on every rank",
                     "[comm][mpi][mismatch]") {
  // A unit with a reduce codec on the last rank only, outside the checked iterations: the size
  // check names both collectives and the unit's tag instead of a hang.
  const int W = world_size();
  const std::string error = error_of([&] {
    fsdp::comm::IssuingApi api("fully_shard post-backward of unit 'blocks.1'");
    if (last_rank()) {
      world().all_to_all_single(at::empty({W, 12}, at::kByte), at::ones({W, 12}, at::kByte), "blocks.1").wait();
    } else {
      world().reduce_scatter_tensor(at::empty({12}), at::ones({W * 12}), c10d::ReduceOp::SUM, "blocks.1").wait();
    }
  });
  INFO(error);
  if (last_rank()) {
    CHECK_THAT(error, Contains("all_to_all_single #") && Contains("(12 elements of Byte per rank and destination)") &&
                          Contains("this rank issued all_to_all_single, another rank reduce_scatter_tensor"));
  } else {
    CHECK_THAT(error, Contains("reduce_scatter_tensor #") &&
                          Contains("this rank issued reduce_scatter_tensor, another rank all_to_all_single"));
  }
  CHECK_THAT(error, Contains("collective tagged 'blocks.1'") && Contains("not run on any rank"));
  check_group_still_works();
}
