// Checkpoints of a pipeline-parallel model, over MPI on 1-4 ranks: the stages of a GPT (each a
// fully_shard root over its dp group, keeping the whole model's FQNs) saved together with their
// AdamW state by fsdp::dcp into one checkpoint, resumed on another layout (pp=2 x dp=2 ->
// pp=1 x dp=4 -> unsharded, each rank the whole model), training on from it exactly as the
// whole model trained without interruption.
#include <memory>
#include <string>
#include <vector>

#include <torch/optim/adamw.h>
#include <torch/torch.h>

#include "fsdp_cpp/checkpoint/distributed_checkpoint.h"
#include "fsdp_cpp/checkpoint/optimizer_state_dict.h"
#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/comm/device_mesh.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/fully_shard_tree.h"
#include "fsdp_cpp/composable/summon_full_params.h"
#include "fsdp_cpp/composable/wrap_policy.h"
#include "fsdp_cpp/examples/gpt_model.h"
#include "fsdp_cpp/pipeline/schedule.h"
#include "fsdp_cpp/pipeline/stage_split.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using fsdp::examples::GPT;
using fsdp::examples::GPTConfig;

constexpr int64_t kVocab = 16, kContext = 8, kMicrobatches = 2;

GPTConfig config(int64_t layers = 4) {
  return GPTConfig(kVocab).context_length(kContext).d_model(16).n_heads(2).n_layers(layers).tie_embeddings(false);
}

torch::optim::AdamWOptions adamw() { return torch::optim::AdamWOptions(1e-2).weight_decay(0.1); }

// The global batch of `step` (the same on every rank and layout): `rows` sequences.
std::pair<torch::Tensor, torch::Tensor> batch(int step, int64_t rows) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  const auto tokens = torch::randint(kVocab, {rows, kContext + 1}, gen, torch::kLong);
  return {tokens.narrow(1, 0, kContext), tokens.narrow(1, 1, kContext)};
}

// A training layout: this rank's stages (one per rank) of a (pp, dp) mesh, each a fully_shard
// root over dp, with AdamW and a 1F1B schedule. pp = 1 is the whole model sharded over dp.
struct Layout {
  int pp = 1, dp = 1;
  GPT part{nullptr};
  fsdp::FSDPModule root{nullptr};
  std::unique_ptr<fsdp::pipeline::PipelineStage> stage;
  std::unique_ptr<fsdp::pipeline::PipelineSchedule> schedule;
  std::unique_ptr<torch::optim::AdamW> optim;
  int dp_rank = 0;

  Layout(int pp_size, int dp_size) : pp(pp_size), dp(dp_size) {
    auto& world = fsdp::testing::world();
    auto mesh = fsdp::comm::DeviceMesh::create(world, {pp, dp}, {"pp", "dp"});
    dp_rank = mesh->coordinate("dp");
    const int s = mesh->coordinate("pp");
    torch::manual_seed(7);
    part = GPT(config());
    part->keep_stage(fsdp::pipeline::split_blocks_evenly(4, pp)[s], s == 0, s == pp - 1);
    auto units = fsdp::fully_shard_tree(*part, fsdp::WrapPolicy::module_types<fsdp::examples::BlockImpl>(),
                                        fsdp::FullyShardOptions().communicator(mesh->group("dp")));
    root = units.back();
    stage = std::make_unique<fsdp::pipeline::PipelineStage>(
        [p = part](const at::Tensor& x) mutable { return p(x); }, s, pp, mesh->group("pp"));
    stage->set_fsdp_units({root});
    schedule = std::make_unique<fsdp::pipeline::PipelineSchedule>(
        std::vector<fsdp::pipeline::PipelineStage*>{stage.get()}, fsdp::examples::next_token_loss,
        fsdp::pipeline::ScheduleOptions().kind(fsdp::pipeline::ScheduleKind::k1F1B).n_microbatches(kMicrobatches));
    optim = std::make_unique<torch::optim::AdamW>(part->parameters(), adamw());
  }

  void train(int step, int64_t rows) {
    const auto [x, y] = batch(step, rows);
    const int64_t mine = rows / dp;
    schedule->step(x.narrow(0, dp_rank * mine, mine), y.narrow(0, dp_rank * mine, mine));
    optim->step();
    optim->zero_grad();
  }
};

// The whole model trained on the global batches of steps [0, steps).
GPT reference(int steps, int64_t rows, int64_t layers = 4) {
  torch::manual_seed(7);
  GPT model(config(layers));
  torch::optim::AdamW optim(model->parameters(), adamw());
  for (int step = 0; step < steps; ++step) {
    const auto [x, y] = batch(step, rows);
    // The mean of the microbatches' mean losses, as the schedule's scaled backward computes.
    fsdp::examples::next_token_loss(model(x), y).backward();
    optim.step();
    optim.zero_grad();
  }
  return model;
}

void check_against(const GPT& part, const fsdp::FSDPModule& root, const GPT& ref) {
  fsdp::SummonFullParams full(root);
  const auto ref_params = ref->named_parameters();
  for (const auto& item : part->named_parameters()) {
    INFO(item.key());
    const auto* r = ref_params.find(item.key());
    REQUIRE(r != nullptr);
    CHECK(torch::allclose(item.value(), *r, 1e-4, 1e-5));
  }
}

}  // namespace

FSDP_RANKS_TEST_CASE("a pipeline checkpoint resumes on another layout and unsharded, training on as the whole model", "[pipeline][checkpoint]") {
  auto& world = fsdp::testing::world();
  const int w = world.size();
  const int64_t rows = w == 3 ? 12 : 8;  // divisible by every dp x microbatches below
  auto world_comm = fsdp::testing::fresh_comm();
  const std::string dir = fsdp::testing::shared_tmpdir() + "/pipeline_ckpt";
  // Saved from every rank as a pipeline stage (pp = 2 x dp = 2 on 4 ranks) after 2 steps.
  const int save_pp = w == 4 ? 2 : w, save_dp = w / save_pp;
  {
    Layout saved(save_pp, save_dp);
    for (int step = 0; step < 2; ++step) saved.train(step, rows);
    fsdp::dcp::Extra extra;
    extra.values["step"] = "2";
    fsdp::dcp::save(dir, saved.root, saved.optim.get(), extra, fsdp::dcp::SaveOptions().communicator(world_comm));
    check_against(saved.part, saved.root, reference(2, rows));
  }
  const GPT after_4 = reference(4, rows);
  // Resumed as the whole model sharded over every rank (pp = 1, dp = W): 2 more steps.
  {
    Layout resumed(1, w);
    fsdp::dcp::Extra extra;
    fsdp::dcp::load(dir, resumed.root, resumed.optim.get(), &extra, fsdp::dcp::LoadOptions().communicator(world_comm));
    CHECK(extra.values.at("step") == "2");
    check_against(resumed.part, resumed.root, reference(2, rows));
    for (int step = 2; step < 4; ++step) resumed.train(step, rows);
    check_against(resumed.part, resumed.root, after_4);
  }
  // Resumed unsharded: every rank the whole model on a group of its own (a (W, 1) mesh's
  // second dimension), with its optimizer state, trained on alone.
  {
    auto solo = fsdp::comm::DeviceMesh::create(world, {w, 1}, {"ranks", "solo"});
    torch::manual_seed(123);  // other initial values: all must come from the checkpoint
    GPT whole(config());
    auto units = fsdp::fully_shard_tree(*whole, fsdp::WrapPolicy::module_types<fsdp::examples::BlockImpl>(),
                                        fsdp::FullyShardOptions().communicator(solo->group("solo")));
    torch::optim::AdamW optim(whole->parameters(), adamw());
    fsdp::dcp::load(dir, units.back(), &optim, nullptr, fsdp::dcp::LoadOptions().communicator(world_comm));
    for (int step = 2; step < 4; ++step) {
      const auto [x, y] = batch(step, rows);
      fsdp::examples::next_token_loss(whole(x), y).backward();
      optim.step();
      optim.zero_grad();
    }
    check_against(whole, units.back(), after_4);
  }
}

FSDP_RANKS_TEST_CASE("an interleaved pipeline (two stage chunks per rank) saved with save_state resumes on pure fully_shard", "[pipeline][checkpoint]") {
  auto& world = fsdp::testing::world();
  const int w = world.size();
  const int pp = w == 4 ? 2 : w, dp = w / pp, n_stages = 2 * pp;
  const int64_t layers = 6, rows = w == 3 ? 12 : 8;
  auto world_comm = fsdp::testing::fresh_comm();
  const std::string dir = fsdp::testing::shared_tmpdir() + "/interleaved_ckpt";
  auto mesh = fsdp::comm::DeviceMesh::create(world, {pp, dp}, {"pp", "dp"});
  const auto ranges = fsdp::pipeline::split_blocks_evenly(layers, n_stages);
  {
    std::vector<GPT> parts;
    std::vector<fsdp::FSDPModule> roots;
    std::vector<std::unique_ptr<fsdp::pipeline::PipelineStage>> stages;
    std::vector<fsdp::pipeline::PipelineStage*> stage_ptrs;
    std::vector<std::unique_ptr<torch::optim::AdamW>> optims;  // one per chunk: one per root
    for (int s : fsdp::pipeline::stages_of_rank(mesh->coordinate("pp"), pp, n_stages)) {
      torch::manual_seed(7);
      GPT part(config(layers));
      part->keep_stage(ranges[s], s == 0, s == n_stages - 1);
      auto units = fsdp::fully_shard_tree(*part, fsdp::WrapPolicy::module_types<fsdp::examples::BlockImpl>(),
                                          fsdp::FullyShardOptions().communicator(mesh->group("dp")));
      roots.push_back(units.back());
      stages.push_back(std::make_unique<fsdp::pipeline::PipelineStage>(
          [part](const at::Tensor& x) mutable { return part(x); }, s, n_stages, mesh->group("pp")));
      stages.back()->set_fsdp_units({units.back()});
      stage_ptrs.push_back(stages.back().get());
      optims.push_back(std::make_unique<torch::optim::AdamW>(part->parameters(), adamw()));
      parts.push_back(part);
    }
    fsdp::pipeline::PipelineSchedule schedule(
        stage_ptrs, fsdp::examples::next_token_loss,
        fsdp::pipeline::ScheduleOptions().kind(fsdp::pipeline::ScheduleKind::kInterleaved1F1B).n_microbatches(pp));
    for (int step = 0; step < 2; ++step) {
      const auto [x, y] = batch(step, rows);
      const int64_t mine = rows / dp;
      schedule.step(x.narrow(0, mesh->coordinate("dp") * mine, mine), y.narrow(0, mesh->coordinate("dp") * mine, mine));
      for (auto& o : optims) {
        o->step();
        o->zero_grad();
      }
    }
    // One checkpoint of the whole model: every chunk's model and optimizer state, merged.
    fsdp::ShardedStateDict merged;
    for (size_t c = 0; c < roots.size(); ++c) {
      for (auto& entry : fsdp::sharded_state_dict(roots[c])) merged.push_back(std::move(entry));
      for (auto& entry : fsdp::sharded_optimizer_state_dict(roots[c], *optims[c])) merged.push_back(std::move(entry));
    }
    fsdp::dcp::save_state(dir, merged, {}, fsdp::dcp::SaveOptions().communicator(world_comm));
  }
  // Resumed as the whole model sharded over every rank: 2 more steps, as the whole model trained.
  torch::manual_seed(7);
  GPT whole(config(layers));
  auto units = fsdp::fully_shard_tree(*whole, fsdp::WrapPolicy::module_types<fsdp::examples::BlockImpl>(),
                                      fsdp::FullyShardOptions().communicator(world_comm));
  torch::optim::AdamW optim(whole->parameters(), adamw());
  fsdp::dcp::load(dir, units.back(), &optim, nullptr, fsdp::dcp::LoadOptions().communicator(world_comm));
  check_against(whole, units.back(), reference(2, rows, layers));
  for (int step = 2; step < 4; ++step) {
    const auto [x, y] = batch(step, rows);
    const int64_t mine = rows / w;
    fsdp::examples::next_token_loss(whole(x.narrow(0, world.rank() * mine, mine)), y.narrow(0, world.rank() * mine, mine))
        .backward();
    optim.step();
    optim.zero_grad();
  }
  check_against(whole, units.back(), reference(4, rows, layers));
}
