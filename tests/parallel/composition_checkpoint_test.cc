// Checkpoints of a composed job at one layout resume at another (parallel/checkpoint.h), over MPI
// on 1-4 ranks: 2 steps at layout A, save, a new job at layout B loads and trains 2 more steps;
// its parameters equal the unsharded reference trained 4 steps (clipping binds every step), and a
// plain fully_shard model over every rank loads the same checkpoint with dcp::load. The
// checkpoint's named values (CheckpointValues: a data loader's position) come back at the other
// layout, and values that differ between ranks are refused on every rank before anything is
// written. (tests/data/composed_resume_test.cc resumes a job mid-epoch of a TokenDataset, whose
// state is such a value, and checks that it reads the uninterrupted job's batches.)
#include <cmath>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/optim/adamw.h>
#include <torch/torch.h>

#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/examples/gpt_model.h"
#include "fsdp_cpp/examples/gpt_model_spec.h"
#include "fsdp_cpp/parallel/checkpoint.h"
#include "fsdp_cpp/parallel/parallel_model.h"
#include "fsdp_cpp/parallel/reference.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using fsdp::examples::GPTConfig;
using fsdp::parallel::ModelSpec;
using fsdp::parallel::ParallelDims;
using fsdp::parallel::ParallelOptions;

constexpr double kMaxNorm = 0.05;

// No dropout: the two layouts cut the model into different stages, whose forward seeds differ.
GPTConfig config() { return GPTConfig(24).context_length(8).d_model(48).n_heads(12).n_layers(4).tie_embeddings(false); }

ModelSpec spec() { return fsdp::examples::gpt_model_spec(config(), /*init_seed=*/21); }

fsdp::parallel::Batch batch_of(int64_t step, int q) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(500 * step + q);
  const at::Tensor t = at::randint(0, 24, {6, 9}, gen, at::kLong);  // 6 rows: 2 or 3 microbatches
  return {t.narrow(1, 0, 8).contiguous(), t.narrow(1, 1, 8).contiguous()};
}

torch::optim::AdamWOptions adamw() { return torch::optim::AdamWOptions(1e-3).weight_decay(0.1); }

void train(fsdp::parallel::ParallelModel& model, torch::optim::Optimizer& optim, int steps) {
  for (int i = 0; i < steps; ++i) {
    const auto b = batch_of(model.steps() + 1, model.mesh().data_rank());
    model.forward_backward(b.inputs, b.targets);
    CHECK(model.clip_grad_norm_(kMaxNorm) > kMaxNorm);
    optim.step();
    model.zero_grad();
  }
}

}  // namespace

FSDP_RANKS_TEST_CASE("a composed job's checkpoint resumes at another layout as the uninterrupted job", "[parallel]") {
  const int w = fsdp::testing::world_size();
  // (A, B) with the same data-parallel size: tp -> pp at 2 and 3 ranks; (dp_shard 2, tp 2) ->
  // (pp 2, dp_shard 2) at 4.
  const ParallelDims a = w == 4 ? ParallelDims{.dp_shard = 2, .tp = 2} : ParallelDims{.dp_shard = 1, .tp = w};
  const ParallelDims b = w == 4 ? ParallelDims{.dp_shard = 2, .pp = 2} : ParallelDims{.dp_shard = 1, .pp = w};
  const std::string dir = fsdp::testing::shared_tmpdir() + "/composed_ckpt";
  {
    auto model = fsdp::parallel::parallelize(fsdp::testing::fresh_comm(), spec(),
                                             ParallelOptions().dims(a).n_microbatches(std::max(2, a.pp)));
    torch::optim::AdamW optim(model.parameters(), adamw());
    train(model, optim, 2);
    // The data loader's position (here: the next step's batch key), the same on every rank.
    fsdp::parallel::save_checkpoint(dir, model, optim, {{"data", "next_step=" + std::to_string(model.steps() + 1)}});
  }
  auto model = fsdp::parallel::parallelize(fsdp::testing::fresh_comm(), spec(),
                                           ParallelOptions().dims(b).n_microbatches(std::max(2, b.pp)));
  torch::optim::AdamW optim(model.parameters(), adamw());
  fsdp::parallel::CheckpointValues values{{"stale", "dropped by the load"}};
  fsdp::parallel::load_checkpoint(dir, model, optim, &values);
  CHECK(model.steps() == 2);
  CHECK(values == fsdp::parallel::CheckpointValues{{"data", "next_step=3"}});
  train(model, optim, 2);

  // The reference: 4 steps on one process (microbatches do not change the mean loss's gradients).
  const int dp = b.dp_replicate * b.dp_shard;
  fsdp::parallel::UnshardedReference reference(spec(), ParallelOptions().dims(b).n_microbatches(std::max(2, b.pp)));
  torch::optim::AdamW ref_optim(reference.parameters(), adamw());
  for (int64_t step = 1; step <= 4; ++step) {
    std::vector<fsdp::parallel::Batch> global;
    for (int q = 0; q < dp; ++q) global.push_back(batch_of(step, q));
    reference.forward_backward(step, global);
    reference.clip_grad_norm_(kMaxNorm);
    ref_optim.step();
    reference.zero_grad();
  }
  for (size_t c = 0; c < model.parts().size(); ++c) {
    const auto full = fsdp::full_state_dict(model.roots()[c], fsdp::FullStateDictOptions().rank0_only(false));
    const auto expected = reference.parts()[model.stages()[c]].module->named_parameters();
    REQUIRE(full.size() == expected.size());
    for (const auto& item : expected) {
      INFO("parameter " << item.key());
      REQUIRE(full.contains(item.key()));
      CHECK((full[item.key()] - item.value()).abs().max().item<double>() < 2e-5);
    }
  }
}

FSDP_RANKS_TEST_CASE("checkpoint values that differ between ranks are refused on every rank before anything is written",
                     "[parallel]") {
  const int w = fsdp::testing::world_size();
  const std::string dir = fsdp::testing::shared_tmpdir() + "/composed_values_ckpt";
  auto model = fsdp::parallel::parallelize(fsdp::testing::fresh_comm(), spec(),
                                           ParallelOptions().dims({.dp_shard = w}).n_microbatches(2));
  torch::optim::AdamW optim(model.parameters(), adamw());
  train(model, optim, 1);
  const int rank = fsdp::testing::rank();
  if (w > 1) {
    // The last rank is one step ahead; another rank lacks a value.
    fsdp::parallel::CheckpointValues values{{"a", "1"}, {"data", rank == w - 1 ? "step=2" : "step=1"}};
    std::string expected = "the values to save differ between ranks: 'data' is 'step=1' on rank 0 and 'step=2' on rank " +
                           std::to_string(w - 1) + "; every rank passes the same CheckpointValues (nothing was written)";
    if (w > 2) {
      if (rank == 1) values.erase("a");
      expected = "the values to save differ between ranks: 'a' is '1' on rank 0 and absent on rank 1";
    }
    const std::string error = fsdp::testing::error_of([&] { fsdp::parallel::save_checkpoint(dir, model, optim, values); });
    CHECK_THAT(error, Catch::Matchers::Contains("fsdp::parallel::save_checkpoint: " + expected));
    CHECK(fsdp::testing::same_on_every_rank(error));
    CHECK(!std::filesystem::exists(dir));
  }
  CHECK_THAT(fsdp::testing::error_of([&] { fsdp::parallel::save_checkpoint(dir, model, optim, {{"", "x"}}); }),
             Catch::Matchers::Contains("a value with an empty name (nothing was written)"));
  CHECK(!std::filesystem::exists(dir));
  // Without values, a checkpoint loads with none.
  fsdp::parallel::save_checkpoint(dir, model, optim);
  fsdp::parallel::CheckpointValues values{{"stale", "x"}};
  fsdp::parallel::load_checkpoint(dir, model, optim, &values);
  CHECK(values.empty());
}
