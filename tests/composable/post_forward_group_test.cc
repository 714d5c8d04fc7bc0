// Resharding after forward to a smaller group (FullyShardOptions::reshard_after_forward(int),
// [Note: post-forward group] in fsdp/flat_param_handle.h), over MPI on every world size, against
// an independent reference (an unsharded copy trained on every rank's batches):
//   - parity for every group size that divides the world (k == W is plain FULL_SHARD), with
//     mixed precision, hybrid sharding, several micro-batches, and an activation-checkpointed
//     unit; collective counts per step on the shard group and on the post-forward groups;
//   - the memory between forward and backward (each unit's post-forward slice, padded bytes / k,
//     and no unsharded buffer) and the bytes each group moves, against the closed form and
//     against fsdp::plan's prediction; nothing kept after backward or after a forward without
//     grad;
//   - refused sizes (not dividing the shard group, 1), a contradicting strategy, and ranks given
//     different sizes: the same error on every rank, naming the module, the model unchanged.
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/comm/device_mesh.h"
#include "fsdp_cpp/composable/activation_checkpoint.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/fully_shard_internal.h"
#include "fsdp_cpp/composable/plan.h"
#include "fsdp_cpp/tests/composable/parity.h"
#include "fsdp_cpp/tests/composable/test_models.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::comm::CollectiveKind;
using fsdp::testing::fresh_comm;
using fsdp::testing::MlpStack;
using fsdp::testing::rank;
using fsdp::testing::world;
using fsdp::testing::world_size;

// Group sizes of reshard_after_forward(int) valid on this world: the divisors from 2 up.
std::vector<int> group_sizes() {
  std::vector<int> sizes;
  for (int k = 2; k <= world_size(); ++k) {
    if (world_size() % k == 0) sizes.push_back(k);
  }
  return sizes;
}

at::Tensor batch(int64_t step, int q, int64_t cols, int salt) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(1000 * salt + 10 * step + q));
  return at::randn({5, cols}, gen);
}

FSDP_RANKS_TEST_CASE("reshard_after_forward(int) trains like the unsharded reference",
                     "[post_forward_group][parity]") {
  for (int k : group_sizes()) {
    for (int variant = 0; variant < 2; ++variant) {
      INFO("group size " << k << ", variant " << variant);
      fsdp::testing::ParityOptions options;
      options.shard_options.reshard_after_forward(k);
      if (variant == 1) {
        options.micro_batches = 2;
        options.optim = fsdp::testing::Optim::kAdamW;
      }
      fsdp::testing::run_parity(fsdp::testing::mlp_stack_scenario("mlp stack"), options);
    }
  }
}

// The backward all-gather inside the group gives bit for bit what the all-gather over the whole
// shard group gives: the same training as FULL_SHARD, also in bf16 mixed precision.
FSDP_RANKS_TEST_CASE("reshard_after_forward(int) equals FULL_SHARD bit for bit, with bf16 mixed precision",
                     "[post_forward_group][mixed_precision]") {
  for (int k : group_sizes()) {
    INFO("group size " << k);
    std::vector<std::vector<at::Tensor>> shards;
    for (const bool grouped : {false, true}) {
      torch::manual_seed(11);
      MlpStack model(6, 8, 16, 3, 3);
      auto options = fsdp::FullyShardOptions().communicator(fresh_comm()).mixed_precision(
          fsdp::MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat));
      if (grouped) options.reshard_after_forward(k);
      const auto units = fsdp::testing::shard_stack(model, options);
      torch::optim::AdamW optim(model->parameters(), torch::optim::AdamWOptions(1e-2));
      for (int step = 0; step < 3; ++step) {
        optim.zero_grad();
        torch::nn::functional::mse_loss(model(batch(step, rank(), 6, 1)), batch(step, rank(), 3, 2)).backward();
        optim.step();
      }
      std::vector<at::Tensor> mine;
      for (const auto& p : model->parameters()) mine.push_back(p.detach().clone());
      shards.push_back(std::move(mine));
    }
    REQUIRE(shards[0].size() == shards[1].size());
    for (size_t i = 0; i < shards[0].size(); ++i) CHECK(torch::equal(shards[0][i], shards[1][i]));
  }
}

FSDP_RANKS_TEST_CASE("reshard_after_forward(int) inside the shard groups of a hybrid mesh",
                     "[post_forward_group][parity][hsdp]") {
  // Every mesh whose shard group has a group size below it: on 4 ranks, 1 x 4 with k = 2.
  for (int shard = 2; shard <= world_size(); ++shard) {
    if (world_size() % shard != 0) continue;
    for (int k = 2; k < shard; ++k) {
      if (shard % k != 0) continue;
      INFO("mesh " << world_size() / shard << " x " << shard << ", group size " << k);
      auto mesh = fsdp::comm::DeviceMesh::hybrid(*fresh_comm(), shard);
      fsdp::testing::ParityOptions options;
      options.shard_options.mesh(mesh).reshard_after_forward(k);
      fsdp::testing::run_parity(fsdp::testing::mlp_stack_scenario("mlp stack, hybrid"), options);
    }
  }
}

// One training step by hand: the memory after forward, the groups' collectives, the plan.
FSDP_RANKS_TEST_CASE("between forward and backward each unit keeps padded bytes / k, and backward gathers inside the group",
                     "[post_forward_group][memory]") {
  for (int k : group_sizes()) {
    INFO("group size " << k);
    torch::manual_seed(7);
    MlpStack model(6, 8, 16, 3, 3);
    auto comm = fresh_comm();
    const auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(comm).reshard_after_forward(k));
    const auto predicted = fsdp::plan(units.back());
    const bool grouped = k < world_size();  // k == W: FULL_SHARD, no group
    int64_t slice_bytes = 0, gathered_bytes = 0;
    std::shared_ptr<fsdp::comm::Communicator> group;
    for (size_t u = 0; u + 1 < units.size(); ++u) {
      for (const auto& h : fsdp::detail::handles_of(units[u])) {
        REQUIRE((h->post_forward_group() != nullptr) == grouped);
        if (!grouped) continue;
        CHECK(h->post_forward_group()->size() == k);
        CHECK(h->post_forward_group()->rank() == rank() % k);
        if (group) CHECK(h->post_forward_group() == group);  // one group shared by the units
        group = h->post_forward_group();
        const int64_t padded = h->layout().padded_numel * static_cast<int64_t>(sizeof(float));
        slice_bytes += padded / k;
        gathered_bytes += padded;
      }
    }
    for (int step = 0; step < 3; ++step) {
      INFO("step " << step);
      comm->reset_stats();
      if (group) group->reset_stats();
      const at::Tensor loss = torch::nn::functional::mse_loss(model(batch(step, rank(), 6, 1)), batch(step, rank(), 3, 2));
      for (size_t u = 0; u + 1 < units.size(); ++u) {
        for (const auto& h : fsdp::detail::handles_of(units[u])) {
          CHECK(h->unsharded_bytes() == 0);
          CHECK(h->post_forward_shard_bytes() ==
                (grouped ? static_cast<size_t>(h->layout().padded_numel / k * static_cast<int64_t>(sizeof(float))) : 0));
        }
      }
      const size_t units_gathered = units.size() - 1;
      CHECK(comm->stats(CollectiveKind::kAllGather).calls == static_cast<int64_t>(units.size()));
      loss.backward();
      for (size_t u = 0; u + 1 < units.size(); ++u) {
        for (const auto& h : fsdp::detail::handles_of(units[u])) CHECK(h->post_forward_shard_bytes() == 0);
      }
      // Forward: every non-root unit and the root over the shard group; backward: the non-root
      // units inside the post-forward group (the root stays unsharded).
      const int64_t world_gathers = static_cast<int64_t>(units.size()) + (grouped ? 0 : static_cast<int64_t>(units_gathered));
      CHECK(comm->stats(CollectiveKind::kAllGather).calls == world_gathers);
      if (grouped) {
        CHECK(group->stats(CollectiveKind::kAllGather).calls == static_cast<int64_t>(units_gathered));
        CHECK(group->stats(CollectiveKind::kAllGather).bytes == gathered_bytes);
        CHECK(predicted.communication.post_forward_all_gather.calls == static_cast<int64_t>(units_gathered));
        CHECK(predicted.communication.post_forward_all_gather.bytes == gathered_bytes);
        CHECK(predicted.unsharded_params.post_forward == slice_bytes);
      } else {
        CHECK(predicted.communication.post_forward_all_gather.calls == 0);
        CHECK(predicted.unsharded_params.post_forward == 0);
      }
      CHECK(predicted.communication.all_gather.calls == world_gathers);
      for (const auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
    }
    // A forward without grad keeps nothing once it ends.
    {
      c10::NoGradGuard no_grad;
      model(batch(9, rank(), 6, 1));
    }
    for (size_t u = 0; u + 1 < units.size(); ++u) {
      for (const auto& h : fsdp::detail::handles_of(units[u])) CHECK(h->post_forward_shard_bytes() == 0);
    }
    if (grouped) {
      std::ostringstream printed;
      printed << predicted;
      CHECK_THAT(printed.str(), Contains("resharded after forward to groups of " + std::to_string(k) + " ranks"));
      CHECK_THAT(printed.str(), Contains("post-forward slices"));
    }
  }
}

FSDP_RANKS_TEST_CASE("an activation-checkpointed unit resharded to a group recomputes and trains like the reference",
                     "[post_forward_group][activation_checkpointing]") {
  for (int k : group_sizes()) {
    INFO("group size " << k);
    auto scenario = fsdp::testing::mlp_stack_scenario("mlp stack, block 1 checkpointed", [](MlpStack& model) {
      fsdp::checkpoint_activations(*model->block(1));
    });
    fsdp::testing::ParityOptions options;
    options.shard_options.reshard_after_forward(k);
    fsdp::testing::run_parity(scenario, options);
  }
}

FSDP_RANKS_TEST_CASE("refused post-forward group sizes name the module on every rank and change nothing",
                     "[post_forward_group][misuse]") {
  const int W = world_size();
  struct Bad {
    int k;
    std::string expected;
  };
  std::vector<Bad> bad = {{1, "use reshard_after_forward(false)"}, {0, "at least 2"}};
  if (W > 1) bad.push_back({W + 1, "divides the " + std::to_string(W) + " ranks"});
  if (W == 4) bad.push_back({3, "here: 2, 4"});
  for (const auto& b : bad) {
    INFO("k = " << b.k);
    MlpStack model(6, 8, 16, 3, 3);
    std::vector<at::Tensor> values;
    for (const auto& p : model->parameters()) values.push_back(p.detach().clone());
    CHECK_THROWS_WITH(fsdp::fully_shard(model->block(0), fsdp::FullyShardOptions().communicator(fresh_comm()).reshard_after_forward(b.k)),
                      Contains("fully_shard: ") && Contains("module '") && Contains("MlpBlock") &&
                          Contains("reshard_after_forward(" + std::to_string(b.k) + ")") &&
                          Contains(b.expected));
    CHECK_FALSE(fsdp::fsdp_module_of(*model->block(0)).has_value());
    size_t i = 0;
    for (const auto& p : model->parameters()) CHECK(p.equal(values[i++]));
  }
  // A contradicting strategy.
  MlpStack model(6, 8, 16, 3, 3);
  CHECK_THROWS_WITH(fsdp::fully_shard(model->block(0), fsdp::FullyShardOptions()
                                                           .communicator(fresh_comm())
                                                           .strategy(fsdp::ShardingStrategy::kShardGradOp)
                                                           .reshard_after_forward(2)),
                    Contains("strategy SHARD_GRAD_OP with reshard_after_forward(2)"));
  // The bool setter after the int one forgets the group.
  CHECK_FALSE(fsdp::FullyShardOptions().reshard_after_forward(2).reshard_after_forward(true).post_forward_group_size());
}

FSDP_RANKS_TEST_CASE("ranks given different post-forward group sizes are refused on every rank",
                     "[post_forward_group][misuse][divergence]") {
  const int W = world_size();
  if (W < 2) {  // one rank has nothing to disagree with, and no group size is valid on it
    MlpStack model(6, 8, 16, 3, 3);
    CHECK_THROWS_WITH(fsdp::fully_shard(model, fsdp::FullyShardOptions().communicator(fresh_comm()).reshard_after_forward(2)),
                      Contains("none does on one rank"));
    return;
  }
  MlpStack model(6, 8, 16, 3, 3);
  auto comm = fresh_comm();
  for (size_t i = 0; i < model->blocks->size(); ++i) fsdp::fully_shard(model->block(i), fsdp::FullyShardOptions().communicator(comm));
  // Rank 0 asks for groups of W ranks (FULL_SHARD's groups), the others for plain FULL_SHARD:
  // the root has units inside, so every rank compares.
  auto options = fsdp::FullyShardOptions().communicator(comm);
  if (rank() == 0) options.reshard_after_forward(W);
  CHECK_THROWS_WITH(fsdp::fully_shard(model, options),
                    Contains("options that differ across ranks") && Contains("rank 0: strategy FULL_SHARD, reshard_after_forward(" + std::to_string(W) + ")") &&
                        Contains("rank 1: strategy FULL_SHARD"));
  CHECK_FALSE(fsdp::fsdp_module_of(*model).has_value());
  // Agreeing, it works.
  const auto root = fsdp::fully_shard(model, fsdp::FullyShardOptions().communicator(comm).reshard_after_forward(W));
  CHECK(fsdp::fsdp_module_of(*model).has_value());
}

}  // namespace
