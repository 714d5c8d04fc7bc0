// The pipeline step agreement ([Note: pipeline step agreement] in pipeline/schedule.h) over the
// pipeline group and the stages' data-parallel groups, on 2 ranks (pp=2) and 4 ranks (pp=2 x dp=2
// with fully_shard or HSDP inside the stages): a bad batch on one replica is refused by every rank of the
// job with the same error within seconds, and the next step runs normally everywhere (the
// parameters then equal the unsharded model trained on the good steps alone); ranks whose
// schedule kind, number of microbatches, scale_grads, reduce_every_microbatch or stage chunks
// differ, across the pipeline group or across data-parallel replicas, get one error naming the cause
// instead of a transfer's timeout.
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/optim/sgd.h>
#include <torch/torch.h>

#include "fsdp_cpp/comm/device_mesh.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/summon_full_params.h"
#include "fsdp_cpp/contract/hookable_module_holder.h"
#include "fsdp_cpp/contract/hookable_modules.h"
#include "fsdp_cpp/pipeline/schedule.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::pipeline::ScheduleKind;
using fsdp::testing::error_of;
using fsdp::testing::same_on_every_rank;
using fsdp::testing::world;
using fsdp::testing::world_size;

constexpr int64_t kDim = 6;

struct BlockImpl : torch::nn::Module {
  BlockImpl() { fc = register_module("fc", fsdp::contract::Linear(kDim, kDim)); }
  torch::Tensor forward(torch::Tensor x) { return x + torch::tanh(fc(x)); }
  fsdp::contract::Linear fc{nullptr};
};
FSDP_HOOKABLE_MODULE(Block);

// Blocks under their index in the whole model ("3.fc.weight" on every layout).
struct ChainImpl : torch::nn::Module {
  ChainImpl(const std::vector<Block>& all, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) blocks.push_back(register_module(std::to_string(i), all[i]));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& block : blocks) x = block(x);
    return x;
  }
  std::vector<Block> blocks;
};
FSDP_HOOKABLE_MODULE(Chain);

std::vector<Block> make_blocks(int64_t n) {
  torch::manual_seed(1234);
  std::vector<Block> blocks;
  for (int64_t i = 0; i < n; ++i) blocks.emplace_back();
  return blocks;
}

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& y) { return (out - y).pow(2).mean(); }

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// One rank's part of a (pp, dp) job: its stages (one block each, `chunks` per rank), fully_shard
// over the dp group inside each stage, and its schedule.
struct Job {
  std::shared_ptr<fsdp::comm::DeviceMesh> mesh;
  std::vector<Chain> parts;
  std::vector<fsdp::FSDPModule> roots;
  std::vector<std::unique_ptr<fsdp::pipeline::PipelineStage>> stages;
  std::unique_ptr<fsdp::pipeline::PipelineSchedule> schedule;
  std::vector<torch::Tensor> params;
  int n_blocks = 0;

  // `hsdp`: the dp dimension replicates (HSDP over a (replicate = dp, shard = 1) submesh: the units
  // communicate over the replicate group in backward) instead of sharding.
  Job(int pp, int dp, int chunks, const fsdp::pipeline::ScheduleOptions& options, bool hsdp = false) {
    mesh = hsdp ? fsdp::comm::DeviceMesh::create(world(), {pp, dp, 1}, {"pp", "dp", "shard"})
                : fsdp::comm::DeviceMesh::create(world(), {pp, dp}, {"pp", "dp"});
    auto pp_group = mesh->group("pp");
    const int n_stages = pp * chunks;
    n_blocks = n_stages;
    auto blocks = make_blocks(n_blocks);
    std::vector<fsdp::pipeline::PipelineStage*> ptrs;
    for (int chunk = 0; chunk < chunks; ++chunk) {
      const int s = chunk * pp + pp_group->rank();
      Chain part(blocks, s, s + 1);
      auto stage = std::make_unique<fsdp::pipeline::PipelineStage>(
          [part](const at::Tensor& x) mutable { return part(x); }, s, n_stages, pp_group);
      // fully_shard inside every stage (over a one-rank group on 2 ranks).
      auto opts = hsdp ? fsdp::FullyShardOptions().mesh(mesh->submesh({"dp", "shard"}))
                       : fsdp::FullyShardOptions().communicator(mesh->group("dp"));
      roots.push_back(fsdp::fully_shard(part, opts));
      stage->set_fsdp_units({roots.back()});
      for (const auto& p : part->parameters()) params.push_back(p);
      parts.push_back(part);
      ptrs.push_back(stage.get());
      stages.push_back(std::move(stage));
    }
    schedule = std::make_unique<fsdp::pipeline::PipelineSchedule>(ptrs, mse, options);
  }
  bool holds_first() const { return stages.front()->is_first(); }
  bool holds_last() const { return stages.back()->is_last(); }
};

// The batch of step `step` for every replica at once ([dp * rows, kDim]), inputs and targets.
std::pair<torch::Tensor, torch::Tensor> global_batch(int step, int dp, int64_t rows) {
  torch::manual_seed(100 + step);
  auto x = torch::randn({dp * rows, kDim});
  auto y = torch::randn({dp * rows, kDim});
  return {x, y};
}

// pp=2 on 2 ranks, pp=2 x dp=2 on 4: a bad batch on the last replica, at a step between two good
// ones, refused on every rank with the same error; the parameters after the good steps equal the
// unsharded model's trained on the good steps alone.
void check_bad_batch(int dp, ScheduleKind kind, const std::string& bad, bool hsdp = false) {
  INFO("pp=2 dp=" << dp << (hsdp ? " (HSDP: replicated)" : "") << " " << fsdp::pipeline::schedule_name(kind)
                  << ", bad batch: " << bad);
  const int m = 2;
  const int64_t rows = 4;
  Job job(2, dp, 1, fsdp::pipeline::ScheduleOptions().kind(kind).n_microbatches(m), hsdp);
  auto dp_group = job.mesh->group("dp");
  const int q = dp_group->rank();
  auto ref_blocks = make_blocks(job.n_blocks);
  Chain reference(ref_blocks, 0, job.n_blocks);
  torch::optim::SGD ref_optim(reference->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD optim(job.params, torch::optim::SGDOptions(0.1));
  for (int step = 0; step < 3; ++step) {
    auto [x_all, y_all] = global_batch(step, dp, rows);
    at::Tensor x = x_all.narrow(0, q * rows, rows), y = y_all.narrow(0, q * rows, rows);
    const bool bad_step = step == 1;
    if (bad_step && q == dp - 1) {
      if (bad == "inputs") x = x.narrow(0, 0, 3);             // 3 rows for 2 microbatches
      if (bad == "targets") y = at::Tensor();                 // the last stage got none
      if (bad == "rows") y = torch::randn({2 * rows, kDim});  // 8 target rows for 4 input rows
    }
    const auto t0 = std::chrono::steady_clock::now();
    const std::string error = error_of([&] { job.schedule->step(x, y); });
    if (!bad_step) {
      REQUIRE(error == fsdp::testing::kNoError);
      (mse(reference(x_all), y_all)).backward();
      optim.step();
      optim.zero_grad();
      ref_optim.step();
      ref_optim.zero_grad();
      continue;
    }
    CHECK(seconds_since(t0) < 5.0);
    // The rank that found it: the first stage's rank (pipeline rank 0) of the last replica for
    // the inputs, its last stage's rank (pipeline rank 1) for the targets. Mesh (pp, dp): world
    // rank = pp_rank * dp + q.
    const int finder = (bad == "inputs" ? 0 : dp) + (dp - 1);
    std::string expected = bad == "inputs"    ? "pipeline rank 0: the first stage's inputs of shape [3, 6] cannot be split into 2"
                           : bad == "targets" ? "pipeline rank 1: the last stage's rank got no targets"
                                              : "pipeline rank 1: the inputs have 4 rows but the targets 8";
    CHECK_THAT(error, Contains("fsdp::pipeline::PipelineSchedule::step: rank " + std::to_string(finder) + ": " + expected) &&
                          Contains("refused on every pipeline rank and on every rank of the stages' data-parallel "
                                   "groups, before anything ran"));
    CHECK(same_on_every_rank(error));
  }
  for (size_t k = 0; k < job.parts.size(); ++k) {
    fsdp::SummonFullParams full(job.roots[k]);
    for (const auto& item : job.parts[k]->named_parameters()) {
      INFO(item.key());
      CHECK(torch::allclose(item.value(), *reference->named_parameters().find(item.key()), 1e-4, 1e-6));
    }
  }
}

}  // namespace

FSDP_RANKS_TEST_CASE("a bad batch on one data-parallel replica is refused by every rank of the job, and the next step runs", "[pipeline][agreement]") {
  const int dp = world_size() / 2;  // pp=2 on 2 ranks, pp=2 x dp=2 on 4
  for (ScheduleKind kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B}) {
    for (const std::string bad : {"inputs", "targets", "rows"}) check_bad_batch(dp, kind, bad);
  }
  // HSDP inside the stages: the replicate group is agreed over too.
  if (dp > 1) check_bad_batch(dp, ScheduleKind::k1F1B, "inputs", /*hsdp=*/true);
}

FSDP_RANKS_TEST_CASE("pipeline ranks that disagree on the schedule or the stage layout get one error naming the cause", "[pipeline][agreement]") {
  const int W = world_size();
  const int dp = W / 2;
  auto mesh = fsdp::comm::DeviceMesh::create(world(), {2, dp}, {"pp", "dp"});
  const int pp_rank = mesh->coordinate("pp");
  // The disagreeing rank: pipeline rank 1 of the last replica (world rank 2 * dp - 1).
  const bool odd = pp_rank == 1 && mesh->coordinate("dp") == dp - 1;
  const int odd_rank = 2 * dp - 1;
  struct Variant {
    std::string what;
    std::function<void(fsdp::pipeline::ScheduleOptions&, int&)> change;  // options, chunks
    std::string mine, theirs;
  };
  const std::vector<Variant> variants = {
      {"the schedule kind", [](auto& o, int&) { o.kind(ScheduleKind::kGPipe); }, "gpipe, 2 microbatches", "1f1b, 2 microbatches"},
      {"the number of microbatches", [](auto& o, int&) { o.n_microbatches(4); }, "1f1b, 4 microbatches", "1f1b, 2 microbatches"},
      {"scale_grads", [](auto& o, int&) { o.scale_grads(false); }, "scale_grads false", "scale_grads true"},
      {"reduce_every_microbatch", [](auto& o, int&) { o.reduce_every_microbatch(true); }, "reduce_every_microbatch true",
       "reduce_every_microbatch false"},
      {"the stage chunks", [](auto& o, int& chunks) { o.kind(ScheduleKind::kInterleaved1F1B); chunks = 2; },
       "interleaved_1f1b, 2 microbatches, scale_grads true, reduce_every_microbatch false, 4 stages, 2 per pipeline rank",
       "1f1b, 2 microbatches, scale_grads true, reduce_every_microbatch false, 2 stages, 1 per pipeline rank"},
  };
  for (const auto& v : variants) {
    INFO("rank " << odd_rank << " differs in " << v.what << " (pp=2 dp=" << dp << ")");
    auto options = fsdp::pipeline::ScheduleOptions().kind(ScheduleKind::k1F1B).n_microbatches(2);
    int chunks = 1;
    if (odd) v.change(options, chunks);
    Job job(2, dp, chunks, options);
    auto x = torch::randn({4, kDim}), y = torch::randn({4, kDim});
    const auto t0 = std::chrono::steady_clock::now();
    const std::string error = error_of([&] { job.schedule->step(x, y); });
    CHECK(seconds_since(t0) < 5.0);
    CHECK_THAT(error, Contains("fsdp::pipeline::PipelineSchedule::step: rank " + std::to_string(odd_rank) +
                               ": pipeline rank 1 runs (") &&
                          Contains(v.mine) && Contains("but pipeline rank 0 runs (") && Contains(v.theirs) &&
                          Contains("must build its PipelineSchedule with the same kind"));
    CHECK(same_on_every_rank(error));
  }
  // A whole data-parallel replica (both of its pipeline ranks) with another number of microbatches:
  // its pipeline group agrees with itself, the data-parallel groups find it.
  if (dp > 1) {
    const bool odd_replica = mesh->coordinate("dp") == dp - 1;
    Job job(2, dp, 1, fsdp::pipeline::ScheduleOptions().kind(ScheduleKind::k1F1B).n_microbatches(odd_replica ? 4 : 2));
    const auto t0 = std::chrono::steady_clock::now();
    const std::string error = error_of([&] { job.schedule->step(torch::randn({4, kDim}), torch::randn({4, kDim})); });
    CHECK(seconds_since(t0) < 5.0);
    // World rank 1 (pipeline rank 0 of replica 1) is the lowest that finds it.
    CHECK_THAT(error, Contains("fsdp::pipeline::PipelineSchedule::step: rank 1: pipeline rank 0 runs (1f1b, 4 "
                               "microbatches") &&
                          Contains("but rank 0 of its stages' data-parallel group runs (1f1b, 2 microbatches"));
    CHECK(same_on_every_rank(error));
  }
  // The same options everywhere: the step runs.
  Job job(2, dp, 1, fsdp::pipeline::ScheduleOptions().kind(ScheduleKind::k1F1B).n_microbatches(2));
  CHECK(error_of([&] { job.schedule->step(torch::randn({4, kDim}), torch::randn({4, kDim})); }) == fsdp::testing::kNoError);
}
