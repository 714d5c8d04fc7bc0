// Pipeline schedules against an unsharded reference, over MPI on 1-4 ranks: GPipe, 1F1B and
// interleaved 1F1B with 1-8 microbatches on every (pipeline, data-parallel) layout that fits the
// launch, with fully_shard inside the stages (gradients reduced once per step or every
// microbatch) and activation checkpointing; losses, parameters after several optimizer steps,
// activations held per stage and bytes sent against their formulas; bad steps refused on every
// rank alike.
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/optim/sgd.h>
#include <torch/torch.h>

#include "fsdp_cpp/comm/device_mesh.h"
#include "fsdp_cpp/composable/activation_checkpoint.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/summon_full_params.h"
#include "fsdp_cpp/contract/hookable_module_holder.h"
#include "fsdp_cpp/contract/hookable_modules.h"
#include "fsdp_cpp/pipeline/schedule.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using fsdp::pipeline::ScheduleKind;

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

// Stage s of n holds blocks [begin, end): the first (n_blocks mod n) stages one more.
std::pair<int64_t, int64_t> block_range(int64_t n_blocks, int s, int n) {
  const int64_t base = n_blocks / n, extra = n_blocks % n;
  const int64_t begin = s * base + std::min<int64_t>(s, extra);
  return {begin, begin + base + (s < extra ? 1 : 0)};
}

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& y) { return (out - y).pow(2).mean(); }

struct Case {
  ScheduleKind kind = ScheduleKind::k1F1B;
  int pp = 1, dp = 1;
  int chunks = 1;  // stages per pipeline rank
  int microbatches = 1;
  bool fsdp = false;
  bool reduce_every_microbatch = false;
  bool checkpoint = false;
  bool keep_unsharded = false;      // reshard_after_forward(false): unsharded from forward to backward
  bool double_compute = false;      // mixed precision: parameters and activations in float64
  std::string name() const {
    return fsdp::pipeline::schedule_name(kind) + " pp=" + std::to_string(pp) + " dp=" + std::to_string(dp) +
           " stages=" + std::to_string(pp * chunks) + " m=" + std::to_string(microbatches) +
           (fsdp ? (reduce_every_microbatch ? " fully_shard(reduce every microbatch)" : " fully_shard") : "") +
           (checkpoint ? " +AC" : "") + (keep_unsharded ? " reshard_after_forward(false)" : "") +
           (double_compute ? " param_dtype(float64)" : "");
  }
};

// Trains `c` for a few steps and compares with the unsharded model trained on the whole batch.
void check_case(const Case& c) {
  INFO(c.name());
  auto& world = fsdp::testing::world();
  REQUIRE(c.pp * c.dp == world.size());
  auto mesh = fsdp::comm::DeviceMesh::create(world, {c.pp, c.dp}, {"pp", "dp"});
  auto pp = mesh->group("pp");
  auto dp = mesh->group("dp");
  const int n_stages = c.pp * c.chunks;
  const int64_t n_blocks = n_stages + 1;
  const int64_t rows = 2 * c.microbatches;  // per data-parallel replica
  const int steps = 3;

  auto ref_blocks = make_blocks(n_blocks);
  Chain reference(ref_blocks, 0, n_blocks);
  torch::optim::SGD ref_optim(reference->parameters(), torch::optim::SGDOptions(0.1));
  auto blocks = make_blocks(n_blocks);

  std::vector<Chain> parts;
  std::vector<std::unique_ptr<fsdp::pipeline::PipelineStage>> stages;
  std::vector<fsdp::pipeline::PipelineStage*> stage_ptrs;
  std::vector<torch::Tensor> params;
  std::vector<fsdp::FSDPModule> roots;
  for (int chunk = 0; chunk < c.chunks; ++chunk) {
    const int s = chunk * c.pp + pp->rank();
    const auto [begin, end] = block_range(n_blocks, s, n_stages);
    Chain part(blocks, begin, end);
    if (c.checkpoint) {
      for (auto& b : part->blocks) fsdp::checkpoint_activations(b);
    }
    auto stage = std::make_unique<fsdp::pipeline::PipelineStage>(
        [part](const at::Tensor& x) mutable { return part(x); }, s, n_stages, pp);
    if (c.fsdp) {
      auto opts = fsdp::FullyShardOptions().communicator(dp);
      if (c.keep_unsharded) opts.reshard_after_forward(false);
      if (c.double_compute) opts.mixed_precision(fsdp::MixedPrecision().param_dtype(at::kDouble));
      for (auto& b : part->blocks) fsdp::fully_shard(b, opts);
      roots.push_back(fsdp::fully_shard(part, opts));
      stage->set_fsdp_units({roots.back()});
    }
    for (const auto& p : part->parameters()) params.push_back(p);
    parts.push_back(part);
    stage_ptrs.push_back(stage.get());
    stages.push_back(std::move(stage));
  }
  torch::optim::SGD optim(params, torch::optim::SGDOptions(0.1));
  fsdp::pipeline::PipelineSchedule schedule(
      stage_ptrs, mse,
      fsdp::pipeline::ScheduleOptions()
          .kind(c.kind)
          .n_microbatches(c.microbatches)
          .reduce_every_microbatch(c.reduce_every_microbatch));

  const bool holds_last = stage_ptrs.back()->is_last();
  for (int step = 0; step < steps; ++step) {
    torch::manual_seed(100 + step);
    const auto x_all = torch::randn({c.dp * rows, kDim});
    const auto y_all = torch::randn({c.dp * rows, kDim});
    const auto x = x_all.narrow(0, dp->rank() * rows, rows);
    const auto y = y_all.narrow(0, dp->rank() * rows, rows);

    std::vector<torch::Tensor> losses;
    const auto out = schedule.step(x, y, &losses);

    // Reference: the whole batch of every replica at once.
    const auto ref_out = reference(x_all);
    const auto ref_loss = mse(ref_out, y_all);
    ref_loss.backward();
    const auto& stats = schedule.last_step_stats();
    CHECK(stats.forwards == c.microbatches * c.chunks);
    CHECK(stats.backwards == c.microbatches * c.chunks);
    if (holds_last) {
      REQUIRE(losses.size() == static_cast<size_t>(c.microbatches));
      const auto mine = torch::stack(losses).mean().to(torch::kFloat);
      const auto expected = mse(ref_out.narrow(0, dp->rank() * rows, rows), y).detach();
      CHECK(torch::allclose(mine, expected, 1e-5, 1e-6));
      CHECK(torch::allclose(out.to(torch::kFloat), ref_out.narrow(0, dp->rank() * rows, rows).detach(), 1e-5, 1e-6));
    } else {
      CHECK(losses.empty());
      CHECK(!out.defined());
    }
    // Activations held per stage: GPipe all microbatches, 1F1B at most p - s.
    if (c.kind == ScheduleKind::kGPipe) CHECK(stats.peak_live_microbatches == c.microbatches);
    if (c.kind == ScheduleKind::k1F1B) {
      CHECK(stats.peak_live_microbatches == std::min(c.pp - pp->rank(), c.microbatches));
    }
    // Bytes sent: each microbatch's activation forward and its gradient backward, across every
    // boundary to another rank (plus the shapes, at the first step).
    if (step > 0) {
      int64_t expected = 0;
      const int64_t bytes = (rows / c.microbatches) * kDim * (c.double_compute ? 8 : 4);
      for (auto* st : stage_ptrs) {
        const int s = st->stage_index();
        if (!st->is_last() && st->rank_of(s + 1) != pp->rank()) expected += c.microbatches * bytes;
        if (!st->is_first() && st->rank_of(s - 1) != pp->rank()) expected += c.microbatches * bytes;
      }
      CHECK(stats.send_bytes == expected);
      CHECK(stats.recv_bytes == expected);
    }
    // Gradients, then parameters after the step, against the reference.
    const auto ref_params = reference->named_parameters();
    for (size_t k = 0; k < parts.size(); ++k) {
      std::optional<fsdp::SummonFullParams> full;
      if (c.fsdp) full.emplace(roots[k], fsdp::SummonFullParamsOptions().with_grads(true));
      for (const auto& item : parts[k]->named_parameters()) {
        const std::string& name = item.key();
        const torch::Tensor& p = item.value();
        INFO(name);
        const auto* ref_p = ref_params.find(name);
        REQUIRE(ref_p != nullptr);
        REQUIRE(p.grad().defined());
        CHECK(torch::allclose(p.grad(), ref_p->grad(), 1e-4, 1e-6));
      }
    }
    optim.step();
    optim.zero_grad();
    ref_optim.step();
    ref_optim.zero_grad();
  }
  for (size_t k = 0; k < parts.size(); ++k) {
    std::optional<fsdp::SummonFullParams> full;
    if (c.fsdp) full.emplace(roots[k]);
    for (const auto& item : parts[k]->named_parameters()) {
      const std::string& name = item.key();
      const torch::Tensor& p = item.value();
      INFO(name);
      CHECK(torch::allclose(p, *reference->named_parameters().find(name), 1e-4, 1e-6));
    }
  }
}

std::vector<int> microbatch_counts(ScheduleKind kind, int pp) {
  if (kind != ScheduleKind::kInterleaved1F1B) return {1, 2, 4, 8};
  return pp == 4 ? std::vector<int>{4, 8} : std::vector<int>{pp, 2 * pp};
}

}  // namespace

FSDP_RANKS_TEST_CASE("every schedule over every rank as a pipeline stage matches the unsharded model", "[pipeline]") {
  const int w = fsdp::testing::world_size();
  for (ScheduleKind kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved1F1B}) {
    for (int m : microbatch_counts(kind, w)) {
      Case c;
      c.kind = kind;
      c.pp = w;
      c.chunks = kind == ScheduleKind::kInterleaved1F1B ? 2 : 1;
      c.microbatches = m;
      check_case(c);
    }
  }
}

FSDP_RANKS_TEST_CASE("fully_shard inside the stages: reduced once per step or every microbatch, with and without activation checkpointing", "[pipeline]") {
  const int w = fsdp::testing::world_size();
  // (pp, dp) layouts of this world size: every rank one stage (dp 1), and pp 2 x dp 2 on 4.
  std::vector<std::pair<int, int>> layouts{{w, 1}};
  if (w == 4) layouts.push_back({2, 2});
  if (w == 2) layouts.push_back({1, 2});
  for (const auto& [pp, dp] : layouts) {
    for (ScheduleKind kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved1F1B}) {
      for (bool every : {false, true}) {
        Case c;
        c.kind = kind;
        c.pp = pp;
        c.dp = dp;
        c.chunks = kind == ScheduleKind::kInterleaved1F1B ? 2 : 1;
        c.microbatches = kind == ScheduleKind::kInterleaved1F1B ? 2 * pp : 4;
        c.fsdp = true;
        c.reduce_every_microbatch = every;
        c.checkpoint = every;  // activation checkpointing on half the cases
        check_case(c);
      }
    }
    // Units kept unsharded between each microbatch's forward and backward; mixed precision whose
    // activations (float64) go between stages in the compute dtype.
    for (int variant = 0; variant < 2; ++variant) {
      Case c;
      c.kind = ScheduleKind::k1F1B;
      c.pp = pp;
      c.dp = dp;
      c.microbatches = 4;
      c.fsdp = true;
      c.keep_unsharded = variant == 0;
      c.double_compute = variant == 1;
      check_case(c);
    }
  }
}

FSDP_RANKS_TEST_CASE("a bad step is refused on every pipeline rank with the same error, and the next step runs", "[pipeline]") {
  auto& world = fsdp::testing::world();
  const int p = world.size();
  auto pp = fsdp::testing::fresh_comm();
  auto blocks = make_blocks(p);
  const auto [begin, end] = block_range(p, pp->rank(), p);
  Chain part(blocks, begin, end);
  fsdp::pipeline::PipelineStage stage([part](const at::Tensor& x) mutable { return part(x); }, pp->rank(), p, pp);
  fsdp::pipeline::PipelineSchedule schedule({&stage}, mse,
                                            fsdp::pipeline::ScheduleOptions().kind(ScheduleKind::k1F1B).n_microbatches(2));
  const auto x = torch::randn({5, kDim}), y = torch::randn({5, kDim});
  auto e = fsdp::testing::error_of([&] { schedule.step(x, y); });
  CHECK_THAT(e, Catch::Contains("refused on every pipeline rank") && Catch::Contains("pipeline rank 0") &&
                    Catch::Contains("[5, 6]") && Catch::Contains("2 equal microbatches"));
  CHECK(fsdp::testing::same_on_every_rank(e));
  // Targets missing on the last stage's rank.
  e = fsdp::testing::error_of([&] { schedule.step(torch::randn({4, kDim}), at::Tensor()); });
  CHECK_THAT(e, Catch::Contains("pipeline rank " + std::to_string(p - 1) + ": the last stage's rank got no targets"));
  CHECK(fsdp::testing::same_on_every_rank(e));
  // Inputs and targets of different batch sizes.
  e = fsdp::testing::error_of([&] { schedule.step(torch::randn({4, kDim}), torch::randn({6, kDim})); });
  CHECK_THAT(e, Catch::Contains("the inputs have 4 rows but the targets 6"));
  CHECK(fsdp::testing::same_on_every_rank(e));
  // Nothing ran: the next step works, and a new input shape is agreed again.
  std::vector<torch::Tensor> losses;
  schedule.step(torch::randn({4, kDim}), torch::randn({4, kDim}), &losses);
  schedule.step(torch::randn({6, kDim}), torch::randn({6, kDim}), &losses);
  CHECK(losses.size() == (stage.is_last() ? 2u : 0u));
  // A stage placed on the wrong rank, a schedule without its stage.
  if (p > 1) {
    e = fsdp::testing::error_of([&] {
      fsdp::pipeline::PipelineStage wrong([part](const at::Tensor& x) mutable { return part(x); }, (pp->rank() + 1) % p, p, pp);
    });
    CHECK_THAT(e, Catch::Contains("lives on pipeline rank") && Catch::Contains("this is pipeline rank"));
  }
  e = fsdp::testing::error_of([&] {
    fsdp::pipeline::PipelineSchedule bad({&stage}, mse,
                                         fsdp::pipeline::ScheduleOptions().kind(ScheduleKind::k1F1B).n_microbatches(0));
  });
  CHECK_THAT(e, Catch::Contains("at least 1 microbatch"));
}
