// A stage that throws mid-step ([Note: pipeline step failures] in pipeline/schedule.h), on 2-4
// ranks: the loss on the last stage, a forward on a middle stage, a backward (the first stage's
// last one, which owes no transfer) throw on one rank; every rank of the pipeline group gets the
// same error within seconds (not the collective timeout), and the next step runs normally: the
// parameters after the good steps equal the unsharded model trained on the good steps alone
// (fully_shard inside every stage discarded the failed step's gradients). On 4 ranks also pp=2 x
// dp=2 with fully_shard over the dp group, every replica failing alike. And keep_outputs(false):
// the last stage holds one microbatch's output at a time, with the same losses and gradients.
#include <chrono>
#include <functional>
#include <memory>
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
constexpr int64_t kRowsPerMicrobatch = 2;

struct BlockImpl : torch::nn::Module {
  BlockImpl() { fc = register_module("fc", fsdp::contract::Linear(kDim, kDim)); }
  torch::Tensor forward(torch::Tensor x) { return x + torch::tanh(fc(x)); }
  fsdp::contract::Linear fc{nullptr};
};
FSDP_HOOKABLE_MODULE(Block);

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
  torch::manual_seed(4321);
  std::vector<Block> blocks;
  for (int64_t i = 0; i < n; ++i) blocks.emplace_back();
  return blocks;
}

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& y) { return (out - y).pow(2).mean(); }

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Where a step fails: the pass ("loss function", "forward", "backward"), the stage and the
// microbatch; on every data-parallel replica alike.
struct Fault {
  std::string pass;
  int stage = 0;
  int microbatch = 0;
};

// One rank's part of a (pp, dp) job: `chunks` stages of one block each, fully_shard over the dp
// group inside each stage (`fsdp` true), and its schedule; `fault` armed makes the named pass
// throw.
struct Job {
  std::shared_ptr<fsdp::comm::DeviceMesh> mesh;
  std::vector<Chain> parts;
  std::vector<fsdp::FSDPModule> roots;
  std::vector<std::unique_ptr<fsdp::pipeline::PipelineStage>> stages;
  std::unique_ptr<fsdp::pipeline::PipelineSchedule> schedule;
  std::vector<torch::Tensor> params;
  int n_blocks = 0;
  std::optional<Fault> fault;                      // armed for the current step
  std::shared_ptr<std::vector<int>> calls;         // forward calls per stage in this step
  std::shared_ptr<int> loss_calls = std::make_shared<int>(0);

  Job(int pp, int dp, int chunks, const fsdp::pipeline::ScheduleOptions& options, bool fsdp_units = true) {
    mesh = fsdp::comm::DeviceMesh::create(world(), {pp, dp}, {"pp", "dp"});
    auto pp_group = mesh->group("pp");
    const int n_stages = pp * chunks;
    n_blocks = n_stages;
    calls = std::make_shared<std::vector<int>>(n_stages, 0);
    auto blocks = make_blocks(n_blocks);
    std::vector<fsdp::pipeline::PipelineStage*> ptrs;
    for (int chunk = 0; chunk < chunks; ++chunk) {
      const int s = chunk * pp + pp_group->rank();
      Chain part(blocks, s, s + 1);
      auto stage = std::make_unique<fsdp::pipeline::PipelineStage>(
          [this, part, s](const at::Tensor& x) mutable {
            const int mb = (*calls)[s]++;
            if (fault && fault->stage == s && fault->microbatch == mb) {
              if (fault->pass == "forward") throw std::runtime_error("forward boom");
              if (fault->pass == "backward") {
                at::Tensor out = part(x);
                out.register_hook([](at::Tensor) -> at::Tensor { throw std::runtime_error("backward boom"); });
                return out;
              }
            }
            return part(x);
          },
          s, n_stages, pp_group);
      if (fsdp_units) {
        roots.push_back(fsdp::fully_shard(part, fsdp::FullyShardOptions().communicator(mesh->group("dp"))));
        stage->set_fsdp_units({roots.back()});
      }
      for (const auto& p : part->parameters()) params.push_back(p);
      parts.push_back(part);
      ptrs.push_back(stage.get());
      stages.push_back(std::move(stage));
    }
    schedule = std::make_unique<fsdp::pipeline::PipelineSchedule>(
        ptrs,
        [this, n_stages](const at::Tensor& out, const at::Tensor& y) {
          const int mb = (*loss_calls)++;
          if (fault && fault->pass == "loss function" && fault->stage == n_stages - 1 && fault->microbatch == mb) {
            throw std::runtime_error("loss boom");
          }
          return mse(out, y);
        },
        options);
  }
  void begin_step(std::optional<Fault> f) {
    fault = std::move(f);
    std::fill(calls->begin(), calls->end(), 0);
    *loss_calls = 0;
  }
};

std::pair<torch::Tensor, torch::Tensor> global_batch(int step, int64_t rows) {
  torch::manual_seed(200 + step);
  auto x = torch::randn({rows, kDim});
  auto y = torch::randn({rows, kDim});
  return {x, y};
}

// Steps 0 and 2 good, step 1 fails as `fault` says on every replica; checks the error on every
// rank and the parameters against the unsharded model trained on steps 0 and 2.
void check_failure(int pp, int dp, int chunks, ScheduleKind kind, int m, const Fault& fault) {
  const int n_stages = pp * chunks;
  INFO("pp=" << pp << " dp=" << dp << " " << fsdp::pipeline::schedule_name(kind) << ", " << m << " microbatches, "
             << n_stages << " stages: " << fault.pass << " of stage " << fault.stage << " microbatch "
             << fault.microbatch << " throws");
  Job job(pp, dp, chunks, fsdp::pipeline::ScheduleOptions().kind(kind).n_microbatches(m));
  const int q = job.mesh->coordinate("dp");
  const int64_t rows = m * kRowsPerMicrobatch;
  auto ref_blocks = make_blocks(job.n_blocks);
  Chain reference(ref_blocks, 0, job.n_blocks);
  torch::optim::SGD ref_optim(reference->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD optim(job.params, torch::optim::SGDOptions(0.1));
  for (int step = 0; step < 3; ++step) {
    auto [x_all, y_all] = global_batch(step, dp * rows);
    at::Tensor x = x_all.narrow(0, q * rows, rows), y = y_all.narrow(0, q * rows, rows);
    const bool failing = step == 1;
    job.begin_step(failing ? std::optional<Fault>(fault) : std::nullopt);
    const auto t0 = std::chrono::steady_clock::now();
    const std::string error = error_of([&] { job.schedule->step(x, y); });
    if (!failing) {
      REQUIRE(error == fsdp::testing::kNoError);
      mse(reference(x_all), y_all).backward();
      optim.step();
      optim.zero_grad();
      ref_optim.step();
      ref_optim.zero_grad();
      continue;
    }
    CHECK(seconds_since(t0) < 5.0);  // the collective timeout is 120 s
    // The failing stage's rank in this replica: mesh (pp, dp), world rank = pp_rank * dp + q.
    const int pp_rank = fault.stage % pp;
    const int failing_rank = pp_rank * dp + q;
    const std::string what = fault.pass == "loss function" ? "loss boom"
                             : fault.pass == "forward"     ? "forward boom"
                                                           : "backward boom";
    CHECK_THAT(error, Contains("fsdp::pipeline::PipelineSchedule::step: rank " + std::to_string(failing_rank) +
                               ": stage " + std::to_string(fault.stage) + " of " + std::to_string(n_stages) +
                               " (pipeline rank " + std::to_string(pp_rank) + ") failed in the " + fault.pass +
                               " of microbatch " + std::to_string(fault.microbatch) + ": " + what) &&
                          Contains("Every rank of the pipeline group ends this step with this error"));
    CHECK_THAT(error, !Contains("did not complete within"));
    // The same on every rank, up to the world rank that names the failing replica's rank.
    std::string normalized = error;
    const std::string named = "rank " + std::to_string(failing_rank) + ":";
    if (auto at = normalized.find(named); at != std::string::npos) normalized.replace(at, named.size(), "rank R:");
    CHECK(same_on_every_rank(normalized));
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

FSDP_RANKS_TEST_CASE("a stage that throws fails the step on every pipeline rank with the same error, and the next step runs", "[pipeline][failure]") {
  const int pp = world_size();
  for (ScheduleKind kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B}) {
    const int m = 4;
    check_failure(pp, 1, 1, kind, m, {"loss function", pp - 1, 1});
    check_failure(pp, 1, 1, kind, m, {"forward", pp / 2, 2});  // a middle stage (stage 1 on 2 ranks)
    check_failure(pp, 1, 1, kind, m, {"backward", 0, m - 1});  // owes no transfer: only the agreement tells
    check_failure(pp, 1, 1, kind, m, {"forward", 0, 0});
  }
  // Interleaved: two stages per rank, the forward of a stage in the second chunk.
  check_failure(pp, 1, 2, ScheduleKind::kInterleaved1F1B, pp, {"forward", pp + pp / 2, pp - 1});
  check_failure(pp, 1, 2, ScheduleKind::kInterleaved1F1B, pp, {"loss function", 2 * pp - 1, 0});
}

FSDP_RANKS_TEST_CASE("pp=2 x dp=2 with fully_shard over dp: a failure on every replica reaches every rank of the job", "[pipeline][failure]") {
  if (world_size() != 4) return;  // the layout needs 4 ranks; 2 and 3 run the case above
  for (ScheduleKind kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B}) {
    check_failure(2, 2, 1, kind, 2, {"loss function", 1, 1});
    check_failure(2, 2, 1, kind, 2, {"forward", 1, 0});
    check_failure(2, 2, 1, kind, 2, {"backward", 0, 1});
  }
}

FSDP_RANKS_TEST_CASE("keep_outputs(false): the last stage releases each output after its backward, same losses and gradients", "[pipeline][keep_outputs]") {
  const int pp = world_size();
  const int m = 4;
  const int64_t rows = m * kRowsPerMicrobatch;
  auto [x, y] = global_batch(0, rows);
  std::vector<std::vector<torch::Tensor>> grads(2);
  std::vector<std::vector<at::Tensor>> losses(2);
  for (bool keep : {true, false}) {
    for (ScheduleKind kind : {ScheduleKind::k1F1B, ScheduleKind::kGPipe}) {
      INFO("keep_outputs " << keep << ", " << fsdp::pipeline::schedule_name(kind));
      Job job(pp, 1, 1, fsdp::pipeline::ScheduleOptions().kind(kind).n_microbatches(m).keep_outputs(keep),
              /*fsdp_units=*/false);
      job.begin_step(std::nullopt);
      std::vector<at::Tensor> step_losses;
      at::Tensor out = job.schedule->step(x, y, &step_losses);
      const auto& stats = job.schedule->last_step_stats();
      const int64_t output_bytes = kRowsPerMicrobatch * kDim * static_cast<int64_t>(sizeof(float));
      if (!job.stages.back()->is_last()) {
        CHECK(!out.defined());
        CHECK(stats.peak_output_bytes == 0);
        CHECK(stats.output_bytes_kept == 0);
      } else if (keep) {
        CHECK(out.sizes() == at::IntArrayRef({rows, kDim}));
        CHECK(stats.output_bytes_kept == m * output_bytes);
        CHECK(stats.peak_output_bytes == m * output_bytes);
      } else {
        CHECK(!out.defined());
        CHECK(stats.output_bytes_kept == 0);
        // 1F1B: the last stage runs F(mb) then B(mb), one output at a time; GPipe holds all m
        // until the backwards start, whatever the option.
        CHECK(stats.peak_output_bytes == (kind == ScheduleKind::k1F1B ? 1 : m) * output_bytes);
      }
      if (kind != ScheduleKind::k1F1B) continue;
      losses[keep ? 0 : 1] = step_losses;
      for (const auto& p : job.params) grads[keep ? 0 : 1].push_back(p.grad().clone());
    }
  }
  REQUIRE(grads[0].size() == grads[1].size());
  for (size_t i = 0; i < grads[0].size(); ++i) CHECK(grads[0][i].equal(grads[1][i]));
  REQUIRE(losses[0].size() == losses[1].size());
  for (size_t i = 0; i < losses[0].size(); ++i) CHECK(losses[0][i].equal(losses[1][i]));
}
