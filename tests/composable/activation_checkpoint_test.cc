// fsdp::checkpoint_activations (activation checkpointing), over MPI on every world size of the
// launch: gradients equal those without checkpointing (bit-exact on a plain model, with dropout:
// the recomputation replays the forward's RNG state), parity with the unsharded reference under
// fully_shard with every strategy and mixed precision (checkpoint_activations on the units'
// modules and on modules inside units), no extra all-gather, errors, and the activation memory
// saved, counted in bytes by a counting CPU allocator; the old names (composable/checkpoint.h).
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/optim/sgd.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/composable/activation_checkpoint.h"
#include "fsdp_cpp/composable/checkpoint.h"  // the old names, checked below
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/replicate.h"
#include "fsdp_cpp/contract/hookable_modules.h"
#include "fsdp_cpp/tests/composable/parity.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"
#include "fsdp_cpp/tools/bench/counting_allocator.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::testing::rank;
using fsdp::testing::world;

// x -> x + down(dropout(tanh(up(x)))): the activations a block keeps for backward are tanh's
// output, dropout's mask and output (4x the width), far more than its input.
struct AcBlockImpl : torch::nn::Module {
  AcBlockImpl(int64_t dim, double p) : p(p) {
    up = register_module("up", fsdp::contract::Linear(dim, 4 * dim));
    down = register_module("down", fsdp::contract::Linear(4 * dim, dim));
  }
  torch::Tensor forward(torch::Tensor x) {
    return x + down(torch::dropout(torch::tanh(up(x)), p, is_training()));
  }
  fsdp::contract::Linear up{nullptr}, down{nullptr};
  double p;
};
FSDP_HOOKABLE_MODULE(AcBlock);

struct AcStackImpl : torch::nn::Module {
  AcStackImpl(int64_t dim, int depth, double p) {
    for (int i = 0; i < depth; ++i) blocks.push_back(register_module("b" + std::to_string(i), AcBlock(dim, p)));
    head = register_module("head", fsdp::contract::Linear(dim, 3));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& b : blocks) x = b(x);
    return head(x);
  }
  std::vector<AcBlock> blocks;
  fsdp::contract::Linear head{nullptr};
};
FSDP_HOOKABLE_MODULE(AcStack);

// A forward with a non-tensor argument and a tuple output.
struct PairOutImpl : torch::nn::Module {
  explicit PairOutImpl(int64_t dim) { fc = register_module("fc", fsdp::contract::Linear(dim, dim)); }
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x, double scale) {
    auto h = torch::tanh(fc(x)) * scale;
    return {h, h.sum(1)};
  }
  fsdp::contract::Linear fc{nullptr};
};
FSDP_HOOKABLE_MODULE(PairOut);

std::vector<at::Tensor> gradients_of(torch::nn::Module& m) {
  std::vector<at::Tensor> grads;
  for (const auto& p : m.parameters()) grads.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
  return grads;
}

// Three SGD steps on fixed batches, dropout drawing from a generator seeded the same way for
// both models; returns the gradients of each step.
std::vector<std::vector<at::Tensor>> train(AcStack& model) {
  torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.05));
  std::vector<std::vector<at::Tensor>> grads;
  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(1000 + step);
    at::Tensor x = at::randn({5, 8});
    at::Tensor loss = model(x).pow(2).mean();
    optim.zero_grad();
    loss.backward();
    grads.push_back(gradients_of(*model));
    optim.step();
  }
  return grads;
}

void require_same(const std::vector<std::vector<at::Tensor>>& a, const std::vector<std::vector<at::Tensor>>& b) {
  REQUIRE(a.size() == b.size());
  for (size_t s = 0; s < a.size(); ++s) {
    REQUIRE(a[s].size() == b[s].size());
    for (size_t i = 0; i < a[s].size(); ++i) {
      INFO("step " << s << " parameter " << i);
      REQUIRE(a[s][i].defined() == b[s][i].defined());
      if (a[s][i].defined()) REQUIRE(torch::equal(a[s][i], b[s][i]));
    }
  }
}

}  // namespace

TEST_CASE("checkpoint_activations gives the gradients of the plain model, dropout included") {
  torch::manual_seed(3);
  AcStack plain(8, 3, 0.3);
  torch::manual_seed(3);
  AcStack ckpt(8, 3, 0.3);
  for (auto& b : ckpt->blocks) fsdp::checkpoint_activations(b);
  CHECK(fsdp::is_activation_checkpointed(*ckpt->blocks[0]));
  CHECK_FALSE(fsdp::is_activation_checkpointed(*ckpt));
  // The first block's input needs no gradient (data): its parameters still get theirs.
  require_same(train(plain), train(ckpt));
  auto names_plain = plain->named_parameters().keys();
  CHECK(names_plain == ckpt->named_parameters().keys());
}

TEST_CASE("checkpoint_activations nests, takes non-tensor arguments and returns tuples") {
  torch::manual_seed(4);
  AcStack plain(8, 2, 0.2);
  torch::manual_seed(4);
  AcStack nested(8, 2, 0.2);
  fsdp::checkpoint_activations(nested->blocks[0]);
  fsdp::checkpoint_activations(nested->blocks[0]->up);  // inside a checkpointed block
  fsdp::checkpoint_activations(nested->blocks[1]->down);
  require_same(train(plain), train(nested));

  torch::manual_seed(5);
  PairOut a(6);
  torch::manual_seed(5);
  PairOut b(6);
  fsdp::checkpoint_activations(b);
  at::Tensor x = torch::randn({3, 6}, torch::requires_grad());
  auto [ha, sa] = a(x, 0.5);
  (ha.pow(2).sum() + sa.sum()).backward();
  at::Tensor gx = x.grad().clone();
  x.mutable_grad() = at::Tensor();
  auto [hb, sb] = b(x, 0.5);
  (hb.pow(2).sum() + sb.sum()).backward();
  CHECK(torch::equal(gx, x.grad()));
  CHECK(torch::equal(a->fc->weight.grad(), b->fc->weight.grad()));
}

TEST_CASE("checkpoint_activations without grad mode runs forward as it is") {
  AcStack model(8, 2, 0.0);
  fsdp::checkpoint_activations(model->blocks[0]);
  torch::NoGradGuard no_grad;
  at::Tensor y = model(at::randn({2, 8}));
  CHECK_FALSE(y.requires_grad());
}

TEST_CASE("checkpoint_activations errors: applied twice, a second backward, a unit inside") {
  AcStack model(8, 2, 0.0);
  fsdp::checkpoint_activations(model->blocks[0]);
  CHECK_THROWS_WITH(fsdp::checkpoint_activations(model->blocks[0]), Contains("checkpoint") && Contains("AcBlockImpl"));

  at::Tensor loss = model(at::randn({2, 8})).sum();
  loss.backward();
  CHECK_THROWS(loss.backward());  // the saved inputs were freed by the first backward

  // A module that contains fully_shard units cannot be checkpointed: refused at its forward.
  AcStack sharded(8, 2, 0.0);
  auto opts = fsdp::FullyShardOptions().communicator(
      std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU));
  for (auto& b : sharded->blocks) fsdp::fully_shard(b, opts);
  fsdp::checkpoint_activations(sharded);
  fsdp::fully_shard(sharded, opts);
  CHECK_THROWS_WITH(sharded(at::randn({2, 8})),
                    Contains("fully_shard: unit") && Contains("b0") && Contains("activation checkpointing"));
}

namespace {

fsdp::testing::Scenario ac_scenario(std::string name, bool inside_units) {
  return {std::move(name), 8, 3, [inside_units] {
            auto model = AcStack(8, 3, 0.0);
            fsdp::testing::Instance inst;
            inst.module = model.ptr();
            inst.forward = [model](torch::Tensor x, int) mutable { return model(x); };
            inst.shard = [model, inside_units](const fsdp::FullyShardOptions& o) {
              std::vector<fsdp::FSDPModule> units;
              for (auto& b : model->blocks) {
                if (inside_units) {
                  fsdp::checkpoint_activations(b->up);
                  fsdp::checkpoint_activations(b->down);
                } else {
                  fsdp::checkpoint_activations(b);
                }
                units.push_back(fsdp::fully_shard(b, o));
              }
              units.push_back(fsdp::fully_shard(model, o));
              return units;
            };
            return inst;
          }};
}

}  // namespace

TEST_CASE("checkpoint_activations under fully_shard: parity with the unsharded reference") {
  for (bool inside : {false, true}) {
    for (auto strategy : {fsdp::ShardingStrategy::kFullShard, fsdp::ShardingStrategy::kShardGradOp,
                          fsdp::ShardingStrategy::kNoShard}) {
      DYNAMIC_SECTION("inside units " << inside << " strategy " << static_cast<int>(strategy)) {
        fsdp::testing::ParityOptions options;
        options.shard_options.strategy(strategy);
        // run_parity also checks the all-gathers and reduce-scatters per step against the
        // strategy's rule: the recomputation adds none.
        fsdp::testing::run_parity(ac_scenario("checkpoint", inside), options);
      }
    }
  }
}

namespace {

// What a few steps of distributed training gave on this rank.
struct ShardedRun {
  std::vector<std::vector<at::Tensor>> params;  // this rank's shards after each step
  std::vector<double> losses;
  int64_t all_gathers = 0;
};

// Three SGD steps, each rank on its own batch and dropout masks (seeded from `seed`): the losses,
// this rank's parameters (shards) after each step, and the all-gathers issued.
ShardedRun train_distributed(AcStack& model, fsdp::comm::Communicator& comm, int seed) {
  torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.05));
  ShardedRun run;
  comm.reset_stats();
  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(seed + 10 * step + rank());
    at::Tensor loss = model(at::randn({4, 8})).pow(2).mean();
    optim.zero_grad();
    loss.backward();
    optim.step();
    run.losses.push_back(loss.item<double>());
    std::vector<at::Tensor> params;
    for (const auto& p : model->parameters()) params.push_back(p.detach().clone());
    run.params.push_back(params);
  }
  run.all_gathers = comm.stats(fsdp::comm::CollectiveKind::kAllGather).calls;
  return run;
}

// fully_shard on every block and the root, with or without checkpoint_activations on the blocks;
// dropout on.
ShardedRun run_sharded(bool with_checkpoint, fsdp::ShardingStrategy strategy, bool bf16) {
  torch::manual_seed(11);
  AcStack model(8, 3, 0.25);
  auto comm = std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
  auto opts = fsdp::FullyShardOptions().communicator(comm).strategy(strategy);
  if (bf16) opts.mixed_precision(fsdp::MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat));
  for (auto& b : model->blocks) {
    if (with_checkpoint) fsdp::checkpoint_activations(b);
    fsdp::fully_shard(b, opts);
  }
  fsdp::fully_shard(model, opts);
  return train_distributed(model, *comm, 2000);
}

}  // namespace

TEST_CASE("checkpoint_activations under fully_shard with dropout equals fully_shard without it") {
  for (auto strategy : {fsdp::ShardingStrategy::kFullShard, fsdp::ShardingStrategy::kShardGradOp,
                        fsdp::ShardingStrategy::kNoShard}) {
    for (bool bf16 : {false, true}) {
    DYNAMIC_SECTION("strategy " << static_cast<int>(strategy) << " bf16 " << bf16) {
      const ShardedRun plain = run_sharded(false, strategy, bf16);
      const ShardedRun ckpt = run_sharded(true, strategy, bf16);
      CHECK(plain.losses == ckpt.losses);
      require_same(plain.params, ckpt.params);
      // The recomputation finds each unit unsharded by its pre-backward: no extra all-gather.
      CHECK(ckpt.all_gathers == plain.all_gathers);
    }
    }
  }
}

namespace {

struct Bytes {
  int64_t after_forward = 0;  // live bytes allocated since the start, after forward
  int64_t peak = 0;           // the allocator's peak over forward and backward, since the start
};

// One forward and backward of `model` on a fixed batch, counted from before the forward.
Bytes measure_step(AcStack& model, int64_t batch, int64_t dim) {
  auto& alloc = fsdp::bench::CountingAllocator::install();
  torch::manual_seed(9);
  at::Tensor x = at::randn({batch, dim});
  for (auto& p : model->parameters()) p.mutable_grad() = at::zeros_like(p);  // gradients exist before
  alloc.mark();
  alloc.reset_peak();
  Bytes bytes;
  at::Tensor loss = model(x).sum();
  bytes.after_forward = alloc.current_since_mark();
  loss.backward();
  loss = at::Tensor();
  bytes.peak = alloc.peak_since_mark();
  return bytes;
}

}  // namespace

TEST_CASE("checkpoint_activations frees each block's activations: bytes counted by the allocator") {
  fsdp::bench::CountingAllocator::install();
  constexpr int64_t kDim = 64, kBatch = 32;
  constexpr int kDepth = 8;
  // One block alone: what it keeps for backward beyond its input and output.
  torch::manual_seed(1);
  AcStack one(kDim, 1, 0.1);
  const Bytes single = measure_step(one, kBatch, kDim);
  torch::manual_seed(1);
  AcStack plain(kDim, kDepth, 0.1);
  torch::manual_seed(1);
  AcStack ckpt(kDim, kDepth, 0.1);
  for (auto& b : ckpt->blocks) fsdp::checkpoint_activations(b);
  const Bytes without = measure_step(plain, kBatch, kDim);
  const Bytes with = measure_step(ckpt, kBatch, kDim);
  const int64_t per_block = (without.after_forward - single.after_forward) / (kDepth - 1);
  // Per block: tanh's output (4 * dim floats per row), dropout's mask (bytes) and output.
  const int64_t expected_block = kBatch * 4 * kDim * (4 + 1 + 4);
  std::printf("activation bytes after forward: %lld without checkpoint, %lld with (per block %lld, "
              "expected %lld); step peak %lld without, %lld with\n",
              static_cast<long long>(without.after_forward), static_cast<long long>(with.after_forward),
              static_cast<long long>(per_block), static_cast<long long>(expected_block),
              static_cast<long long>(without.peak), static_cast<long long>(with.peak));
  CHECK(per_block >= expected_block);
  // Every block's activations are gone after forward: only the blocks' outputs remain.
  CHECK(without.after_forward - with.after_forward >= kDepth * expected_block);
  CHECK(with.after_forward < without.after_forward / 4);
  // The step's peak drops by all blocks' activations but the one recomputed at a time.
  CHECK(without.peak - with.peak >= (kDepth - 1) * expected_block);
}

TEST_CASE("checkpoint_activations_tree checkpoints the modules a policy selects") {
  torch::manual_seed(6);
  AcStack plain(8, 3, 0.2);
  torch::manual_seed(6);
  AcStack model(8, 3, 0.2);
  const auto selected = fsdp::checkpoint_activations_tree(*model, fsdp::WrapPolicy::module_types<AcBlockImpl>());
  REQUIRE(selected.size() == 3);
  CHECK(selected[0].fqn == "b0");
  CHECK(selected[2].fqn == "b2");
  for (const auto& b : model->blocks) CHECK(fsdp::is_activation_checkpointed(*b));
  CHECK_FALSE(fsdp::is_activation_checkpointed(*model->head));
  require_same(train(plain), train(model));
  // A second application is refused before anything is applied.
  CHECK_THROWS_WITH(fsdp::checkpoint_activations_tree(*model, fsdp::WrapPolicy::module_types<AcBlockImpl>()),
                    Contains("already has checkpoint applied"));
}

namespace {

// replicate on the root (small buckets: several all-reduces overlap backward), optionally
// fully_shard on the blocks, with or without checkpoint_activations on the blocks; dropout on.
ShardedRun run_replicated(bool with_checkpoint, bool shard_blocks) {
  torch::manual_seed(12);
  AcStack model(8, 3, 0.25);
  auto comm = std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
  for (auto& b : model->blocks) {
    if (with_checkpoint) fsdp::checkpoint_activations(b);
    if (shard_blocks) fsdp::fully_shard(b, fsdp::FullyShardOptions().communicator(comm));
  }
  fsdp::replicate(model, fsdp::ReplicateOptions().communicator(comm).bucket_cap_mb(1e-4));
  return train_distributed(model, *comm, 3000);
}

}  // namespace

TEST_CASE("checkpoint_activations under replicate (and fully_shard) equals the same run without it") {
  for (bool shard_blocks : {false, true}) {
    DYNAMIC_SECTION("fully_shard on the blocks " << shard_blocks) {
      const ShardedRun plain = run_replicated(false, shard_blocks);
      const ShardedRun ckpt = run_replicated(true, shard_blocks);
      CHECK(plain.losses == ckpt.losses);
      require_same(plain.params, ckpt.params);
      CHECK(ckpt.all_gathers == plain.all_gathers);
    }
  }
}

// composable/checkpoint.h keeps the names of before the rename working: the same API, the same
// registry entry.
TEST_CASE("the old names of composable/checkpoint.h still checkpoint activations") {
  torch::manual_seed(7);
  AcStack plain(8, 2, 0.2);
  torch::manual_seed(7);
  AcStack model(8, 2, 0.2);
  fsdp::checkpoint(model->blocks[0], fsdp::CheckpointOptions().preserve_rng_state(true));
  fsdp::checkpoint(*model->blocks[1]);
  for (const auto& b : model->blocks) CHECK(fsdp::is_activation_checkpointed(*b));
  CHECK(fsdp::is_checkpointed(*model->blocks[0]));
  CHECK_FALSE(fsdp::is_checkpointed(*model->head));
  CHECK(std::string(fsdp::kCheckpointApi) == fsdp::kActivationCheckpointApi);
  require_same(train(plain), train(model));
  AcStack other(8, 2, 0.2);
  CHECK(fsdp::checkpoint_tree(*other, fsdp::WrapPolicy::module_types<AcBlockImpl>()).size() == 2);
  CHECK(fsdp::is_activation_checkpointed(*other->blocks[1]));
}
