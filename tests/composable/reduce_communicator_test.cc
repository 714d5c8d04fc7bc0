// FullyShardOptions::separate_reduce_communicator ([Note: reduce communicator] in
// fsdp/derived_groups.h), over MPI on every world size: parity with the unsharded reference for
// every strategy and for hybrid sharding, the reductions counted on the duplicate communicator
// (one per trainable handle and step) and none on the unit's own, one duplicate shared by the
// units, and ranks that disagree refused on every rank.
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/comm/device_mesh.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/fully_shard_internal.h"
#include "fsdp_cpp/tests/composable/parity.h"
#include "fsdp_cpp/tests/composable/test_models.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::ShardingStrategy;
using fsdp::comm::CollectiveKind;
using fsdp::testing::fresh_comm;
using fsdp::testing::MlpStack;
using fsdp::testing::rank;
using fsdp::testing::world;
using fsdp::testing::world_size;

FSDP_RANKS_TEST_CASE("gradient reductions on a separate communicator train like the reference",
                     "[reduce_communicator][parity]") {
  for (const auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard}) {
    INFO("strategy " << fsdp::to_string(strategy));
    fsdp::testing::ParityOptions options;
    options.shard_options.strategy(strategy).separate_reduce_communicator(true);
    fsdp::testing::run_parity(fsdp::testing::mlp_stack_scenario("mlp stack"), options);
  }
  if (world_size() % 2 == 0) {
    fsdp::testing::ParityOptions options;
    options.shard_options.mesh(fsdp::comm::DeviceMesh::hybrid(*fresh_comm(), 2)).separate_reduce_communicator(true);
    fsdp::testing::run_parity(fsdp::testing::mlp_stack_scenario("mlp stack, hybrid"), options);
  }
}

FSDP_RANKS_TEST_CASE("the reductions run on one duplicate shared by the units, none on the unit's communicator",
                     "[reduce_communicator][counts]") {
  const int W = world_size();
  torch::manual_seed(3);
  MlpStack model(6, 8, 16, 3, 3);
  auto comm = fresh_comm();
  const auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(comm).separate_reduce_communicator(true));
  std::shared_ptr<fsdp::comm::Communicator> group;
  int64_t handles = 0, reduced_bytes = 0;
  for (const auto& unit : units) {
    const auto& config = fsdp::detail::state_of(unit).config();
    REQUIRE((config.reduce_group != nullptr) == (W > 1));
    if (W == 1) continue;
    CHECK(config.reduce_group != comm);
    CHECK(config.reduce_group->size() == W);
    CHECK(config.reduce_group->rank() == rank());
    if (group) CHECK(config.reduce_group == group);
    group = config.reduce_group;
    for (const auto& h : fsdp::detail::handles_of(unit)) {
      handles += 1;
      reduced_bytes += h->layout().padded_numel * static_cast<int64_t>(sizeof(float));
    }
  }
  for (int step = 0; step < 2; ++step) {
    comm->reset_stats();
    if (group) group->reset_stats();
    auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(10 * step + rank()));
    torch::nn::functional::mse_loss(model(at::randn({4, 6}, gen)), at::randn({4, 3}, gen)).backward();
    CHECK(comm->stats(CollectiveKind::kReduceScatter).calls == 0);
    if (W > 1) {
      CHECK(group->stats(CollectiveKind::kReduceScatter).calls == handles);
      CHECK(group->stats(CollectiveKind::kReduceScatter).bytes == reduced_bytes);
      CHECK(group->stats(CollectiveKind::kAllGather).calls == 0);
      CHECK(comm->stats(CollectiveKind::kAllGather).calls > 0);
    }
    for (const auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
  }
}

FSDP_RANKS_TEST_CASE("ranks that disagree on separate_reduce_communicator are refused on every rank",
                     "[reduce_communicator][misuse]") {
  const int W = world_size();
  MlpStack model(6, 8, 16, 3, 3);
  auto comm = fresh_comm();
  for (size_t i = 0; i < model->blocks->size(); ++i) fsdp::fully_shard(model->block(i), fsdp::FullyShardOptions().communicator(comm));
  if (W == 1) {  // nothing to disagree with; and nothing to duplicate: the unit keeps its own
    const auto root = fsdp::fully_shard(model, fsdp::FullyShardOptions().communicator(comm).separate_reduce_communicator(true));
    CHECK(fsdp::detail::state_of(root).config().reduce_group == nullptr);
    return;
  }
  auto options = fsdp::FullyShardOptions().communicator(comm).separate_reduce_communicator(rank() == 0);
  CHECK_THROWS_WITH(fsdp::fully_shard(model, options),
                    Contains("options that differ across ranks") &&
                        Contains("rank 0: strategy FULL_SHARD, separate_reduce_communicator") &&
                        Contains("rank 1: strategy FULL_SHARD\n") );
  CHECK_FALSE(fsdp::fsdp_module_of(*model).has_value());
}

}  // namespace
