// The MPI backend's size check once a loop repeats ([Note: MPI size check] in comm/mpi_backend.cc):
// collectives that repeat what earlier iterations issued at the same point start beside their
// check instead of after it, and a mismatch in the 50th iteration of an unchanged loop is still
// named on every rank (not MPI_ERR_TRUNCATE, not a hang), whichever ranks started it; the group
// stays usable, and a loop whose sizes change on every rank alike keeps computing correctly.
//
// Run on 2, 3 and 4 ranks (tests/comm/BUILD.bazel); every case is symmetric in the world size.
#include <string>
#include <vector>

#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>

#include "fsdp_cpp/comm/issuing_api.h"
#include "fsdp_cpp/comm/mpi_backend.h"
#include "fsdp_cpp/comm/mpi_progress.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::testing::error_of;
using fsdp::testing::rank;
using fsdp::testing::world;
using fsdp::testing::world_size;

bool last_rank() { return rank() == world_size() - 1; }

fsdp::comm::MpiBackend& world_mpi() {
  auto* mpi = dynamic_cast<fsdp::comm::MpiBackend*>(world().backend().get());
  REQUIRE(mpi != nullptr);
  return *mpi;
}

// Sets the world backend's wait path for one test case and restores it after.
class WaitPath {
 public:
  explicit WaitPath(bool wait_drives_progress) : before_(world_mpi().wait_drives_progress()) {
    world_mpi().set_wait_drives_progress(wait_drives_progress);
  }
  ~WaitPath() { world_mpi().set_wait_drives_progress(before_); }

 private:
  bool before_;
};

// One iteration of a training-like loop over unit `unit` (the tag of its collectives): an
// all-gather of `count` elements per rank, a reduce-scatter issued without waiting, a loss
// all-reduce, then both waited, checked against their closed forms.
void iteration(const std::string& unit, int64_t count) {
  const int W = world_size();
  at::Tensor shard = at::arange(count, at::kFloat) + rank();
  at::Tensor gathered = at::empty({W * count});
  world().all_gather_into_tensor(gathered, shard, unit).wait();
  for (int r = 0; r < W; ++r) {
    REQUIRE(gathered.narrow(0, r * count, count).equal(at::arange(count, at::kFloat) + r));
  }
  at::Tensor grad_shard = at::empty({count});
  auto reduce = world().reduce_scatter_tensor(grad_shard, at::ones({W * count}), c10d::ReduceOp::SUM, unit);
  at::Tensor loss = at::ones({1});
  auto loss_sum = world().all_reduce(loss, c10d::ReduceOp::SUM, "loss");
  loss_sum.wait();
  reduce.wait();
  REQUIRE(grad_shard.equal(at::full({count}, W, at::kFloat)));
  REQUIRE(loss.item<float>() == static_cast<float>(W));
}

void check_group_still_works() {
  at::Tensor t = at::ones({3});
  world().all_reduce(t).wait();
  CHECK(t.equal(at::full({3}, world_size(), at::kFloat)));
}

}  // namespace

FSDP_RANKS_TEST_CASE("a size mismatch in iteration 50 of an unchanged loop is named on every rank",
                     "[comm][mpi][mismatch]") {
  const int W = world_size();
  const bool drives = GENERATE(true, false);
  WaitPath path(drives);
  INFO("wait_drives_progress " << drives);
  const std::string unit = std::string("blocks.3 (") + (drives ? "driven" : "progress thread") + ")";
  const auto before = fsdp::comm::mpi::progress_counters();
  for (int i = 1; i <= 49; ++i) iteration(unit, 16);
  const auto after_loop = fsdp::comm::mpi::progress_counters();
  // The loop repeats, so after its first iterations its collectives started beside their checks.
  CHECK(after_loop.speculative_starts - before.speculative_starts >= 40 * 2);
  CHECK(after_loop.check_mismatches == before.check_mismatches);
  // Iteration 50: the last rank's unit holds twice the parameters.
  const int64_t count = last_rank() ? 32 : 16;
  const std::string error = error_of([&] {
    fsdp::comm::IssuingApi api("fully_shard pre-forward of unit '" + unit + "'");
    at::Tensor out = at::empty({W * count});
    world().all_gather_into_tensor(out, at::ones({count}), unit).wait();
  });
  INFO(error);
  CHECK_THAT(error, Contains("all_gather_into_tensor #"));
  CHECK_THAT(error, Contains("(" + std::to_string(count) + " elements of Float per rank)"));
  CHECK_THAT(error, Contains("issued by fully_shard pre-forward of unit '" + unit + "'"));
  CHECK_THAT(error, Contains("the element count per rank differs across ranks: from 16 to 32 (this rank: " +
                             std::to_string(count) + ")"));
  // The others started it as predicted; the last rank ran a placeholder of that shape.
  CHECK_THAT(error, Contains("not run as issued") && Contains("outputs are not valid on any rank"));
  CHECK_THAT(error, Contains("FSDP_DEBUG=1"));
  CHECK_THAT(error, !Contains("MPI_ERR_TRUNCATE"));
  const auto after = fsdp::comm::mpi::progress_counters();
  CHECK(after.check_mismatches == after_loop.check_mismatches + 1);
  CHECK(after.mismatch_placeholders - after_loop.mismatch_placeholders == (last_rank() ? 1u : 0u));
  check_group_still_works();
  // The loop goes on, correct again.
  for (int i = 51; i <= 55; ++i) iteration(unit, 16);
}

FSDP_RANKS_TEST_CASE("another collective kind in iteration 50 is named on every rank",
                     "[comm][mpi][mismatch]") {
  const int W = world_size();
  const std::string unit = "blocks.4";
  for (int i = 1; i <= 49; ++i) iteration(unit, 8);
  // Iteration 50: the last rank reduces where the others gather (equal sizes).
  const std::string error = error_of([&] {
    fsdp::comm::IssuingApi api(last_rank() ? "fully_shard post-backward" : "fully_shard pre-forward");
    if (last_rank()) {
      world().reduce_scatter_tensor(at::empty({8}), at::ones({W * 8}), c10d::ReduceOp::SUM, unit).wait();
    } else {
      world().all_gather_into_tensor(at::empty({W * 8}), at::ones({8}), unit).wait();
    }
  });
  INFO(error);
  if (last_rank()) {
    CHECK_THAT(error, Contains("reduce_scatter_tensor #") &&
                          Contains("this rank issued reduce_scatter_tensor, another rank all_gather_into_tensor"));
  } else {
    CHECK_THAT(error, Contains("all_gather_into_tensor #") &&
                          Contains("this rank issued all_gather_into_tensor, another rank reduce_scatter_tensor"));
  }
  CHECK_THAT(error, Contains("FSDP_DEBUG=1") && !Contains("MPI_ERR_TRUNCATE"));
  check_group_still_works();
  for (int i = 51; i <= 53; ++i) iteration(unit, 8);
}

FSDP_RANKS_TEST_CASE("a dtype mismatch of the loss all-reduce in iteration 50 is named on every rank",
                     "[comm][mpi][mismatch]") {
  const std::string unit = "blocks.5";
  for (int i = 1; i <= 49; ++i) iteration(unit, 4);
  at::Tensor shard = at::ones({4});
  at::Tensor gathered = at::empty({world_size() * 4});
  world().all_gather_into_tensor(gathered, shard, unit).wait();
  at::Tensor grad = at::empty({4});
  world().reduce_scatter_tensor(grad, at::ones({world_size() * 4}), c10d::ReduceOp::SUM, unit).wait();
  const std::string error = error_of([&] {
    at::Tensor loss = at::ones({1}, last_rank() ? at::kDouble : at::kFloat);
    world().all_reduce(loss, c10d::ReduceOp::SUM, "loss").wait();
  });
  INFO(error);
  CHECK_THAT(error, Contains("allreduce #") && Contains("the dtype differs across ranks") &&
                        Contains(last_rank() ? "(this rank: Double)" : "(this rank: Float)"));
  CHECK_THAT(error, !Contains("MPI_ERR_TRUNCATE"));
  check_group_still_works();
}

FSDP_RANKS_TEST_CASE("a loop whose sizes change on every rank alike keeps computing correctly",
                     "[comm][mpi]") {
  const std::string unit = "blocks.6";
  // The order changes at iteration 30 on every rank (e.g. an evaluation step with other shapes),
  // then goes back: the collectives wait for their checks until the history knows them again.
  const auto before = fsdp::comm::mpi::progress_counters();
  for (int i = 1; i <= 60; ++i) iteration(unit, i == 30 ? 40 : i % 7 == 0 ? 6 : 10);
  const auto after = fsdp::comm::mpi::progress_counters();
  CHECK(after.check_mismatches == before.check_mismatches);
  CHECK(after.mismatch_placeholders == before.mismatch_placeholders);
  CHECK(after.speculative_starts > before.speculative_starts);
}
