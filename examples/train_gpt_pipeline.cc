// train_gpt_pipeline: the GPT of examples/gpt_model.h trained with pipeline parallelism composed
// with fully_shard (and optionally tensor parallelism) on a (pp, dp[, tp]) mesh over MPI ranks:
// each pipeline rank holds one stage of the model (or several, interleaved), keeping the whole
// model's FQNs (GPT::keep_stage); inside each stage every block and the stage's root are
// fully_shard units over the dp group; a schedule (GPipe, 1F1B, interleaved 1F1B) runs the
// microbatches. Prints the layout, a line per step, the schedule's measured bubble next to its
// closed form, the bytes sent between stages, and the final loss next to the same training run
// unsharded on one process.
//
//   tools/example.sh --np 4 --pp 2 --microbatches 4 --schedule 1f1b        # (pp, dp) = (2, 2)
//   tools/example.sh --np 4 --pp 2 --tp 2 --microbatches 4                 # (pp, dp, tp) = (2, 1, 2)
//   tools/example.sh --np 2 --pp 2 --stages-per-rank 2 --schedule interleaved_1f1b --microbatches 4
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/optim/adamw.h>
#include <torch/torch.h>

#include "fsdp_cpp/comm/device_mesh.h"
#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/composable/activation_checkpoint.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/fully_shard_tree.h"
#include "fsdp_cpp/composable/wrap_policy.h"
#include "fsdp_cpp/examples/char_corpus.h"
#include "fsdp_cpp/examples/example_main.h"
#include "fsdp_cpp/examples/flags.h"
#include "fsdp_cpp/examples/gpt_model.h"
#include "fsdp_cpp/examples/gpt_tensor_parallel.h"
#include "fsdp_cpp/pipeline/schedule.h"
#include "fsdp_cpp/pipeline/stage_split.h"

namespace {

using fsdp::examples::parse_double_flag;
using fsdp::examples::parse_int_flag;

using fsdp::examples::GPT;
using fsdp::examples::GPTConfig;
using fsdp::pipeline::ScheduleKind;

constexpr const char* kUsage = R"(usage: train_gpt_pipeline --pp P [options]   (launched by tools/example.sh --pp P)
  --pp P                 pipeline ranks (the ranks form (pp, dp[, tp]) = (P, np / (P * T)[, T]))
  --tp T                 tensor parallel size inside each stage (default 1)
  --stages-per-rank V    stages (chunks) per pipeline rank (default 1; more needs interleaved_1f1b)
  --schedule S           gpipe, 1f1b or interleaved_1f1b (default 1f1b)
  --microbatches M       microbatches per step (default 4; must divide --batch)
  --reduce-every-microbatch  reduce-scatter gradients in every microbatch's backward (default: once
                         per step, in the last microbatch's)
  --checkpoint-activations   activation checkpointing on each block
  --steps S --layers L --d-model D --heads H --context T --batch B (per data-parallel replica)
  --lr X --seed N --threads N
  --check-unsharded 0|1  train the whole model on one process too and compare (default 1)
)";

struct Flags {
  int64_t pp = 0, tp = 1, stages_per_rank = 1, microbatches = 4;
  std::string schedule = "1f1b";
  bool reduce_every_microbatch = false, checkpoint_activations = false, check_unsharded = true;
  int64_t steps = 20, layers = 4, d_model = 64, heads = 4, context = 32, batch = 8, threads = 1;
  double lr = 3e-3;
  uint64_t seed = 0;
};

Flags parse_flags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string name = argv[i];
    if (name == "--help" || name == "-h") throw std::invalid_argument("help");
    if (name == "--reduce-every-microbatch") { f.reduce_every_microbatch = true; continue; }
    if (name == "--checkpoint-activations") { f.checkpoint_activations = true; continue; }
    if (i + 1 >= argc) throw std::invalid_argument(name + " expects a value");
    const std::string value = argv[++i];
    if (name == "--pp") f.pp = parse_int_flag(name, value, 1);
    else if (name == "--tp") f.tp = parse_int_flag(name, value, 1);
    else if (name == "--stages-per-rank") f.stages_per_rank = parse_int_flag(name, value, 1);
    else if (name == "--microbatches") f.microbatches = parse_int_flag(name, value, 1);
    else if (name == "--schedule") f.schedule = value;
    else if (name == "--steps") f.steps = parse_int_flag(name, value, 1);
    else if (name == "--layers") f.layers = parse_int_flag(name, value, 1);
    else if (name == "--d-model") f.d_model = parse_int_flag(name, value, 1);
    else if (name == "--heads") f.heads = parse_int_flag(name, value, 1);
    else if (name == "--context") f.context = parse_int_flag(name, value, 1);
    else if (name == "--batch") f.batch = parse_int_flag(name, value, 1);
    else if (name == "--threads") f.threads = parse_int_flag(name, value, 1);
    else if (name == "--seed") f.seed = static_cast<uint64_t>(parse_int_flag(name, value, 0));
    else if (name == "--check-unsharded") f.check_unsharded = parse_int_flag(name, value, 0) != 0;
    else if (name == "--lr") {
      f.lr = std::stod(value);
      if (!(f.lr > 0)) throw std::invalid_argument("--lr expects a positive number (got '" + value + "')");
    } else {
      throw std::invalid_argument("unknown argument '" + name + "'");
    }
  }
  if (f.pp < 1) throw std::invalid_argument("--pp is required (the number of pipeline ranks)");
  fsdp::pipeline::parse_schedule(f.schedule);  // a c10::Error naming the schedules
  if (f.batch % f.microbatches != 0) {
    throw std::invalid_argument("--microbatches " + std::to_string(f.microbatches) + " does not divide --batch " +
                                std::to_string(f.batch));
  }
  return f;
}

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

GPTConfig model_config(const Flags& f, int64_t vocab) {
  return GPTConfig(vocab)
      .context_length(f.context)
      .d_model(f.d_model)
      .n_heads(f.heads)
      .n_layers(f.layers)
      .tie_embeddings(false);  // the embedding and the output layer live on different stages
}

// The whole model trained on one process on every replica's batch (the mean of their losses):
// what (pp, dp[, tp]) training must reproduce. Returns each step's loss.
std::vector<double> train_unsharded(const fsdp::examples::CharCorpus& corpus, const GPTConfig& config,
                                    const Flags& f, int dp) {
  torch::manual_seed(f.seed);
  GPT model(config);
  torch::optim::AdamW optim(model->parameters(), torch::optim::AdamWOptions(f.lr).weight_decay(0.1));
  std::vector<double> losses;
  for (int64_t step = 1; step <= f.steps; ++step) {
    at::Tensor loss;
    for (int q = 0; q < dp; ++q) {
      const auto b = corpus.sample_batch({.seed = f.seed, .step = step, .rank = q}, f.batch, f.context);
      const auto l = fsdp::examples::next_token_loss(model(b.inputs), b.targets);
      loss = q == 0 ? l : loss + l;
    }
    loss = loss / dp;
    loss.backward();
    optim.step();
    optim.zero_grad();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

int run(const Flags& f, const fsdp::comm::ProcessGroup& group) {
  fsdp::comm::Communicator& world = *group.comm;
  const int w = world.size();
  TORCH_CHECK(w % (f.pp * f.tp) == 0, "train_gpt_pipeline: --pp ", f.pp, " x --tp ", f.tp,
              " does not divide the number of ranks ", w);
  const int pp_size = static_cast<int>(f.pp), tp_size = static_cast<int>(f.tp), dp_size = w / (pp_size * tp_size);
  auto mesh = tp_size > 1 ? fsdp::comm::DeviceMesh::create(world, {pp_size, dp_size, tp_size}, {"pp", "dp", "tp"})
                          : fsdp::comm::DeviceMesh::create(world, {pp_size, dp_size}, {"pp", "dp"});
  const auto& pp = mesh->group("pp");
  const auto& dp = mesh->group("dp");
  const bool main_rank = world.rank() == 0;
  const ScheduleKind kind = fsdp::pipeline::parse_schedule(f.schedule);
  const int n_stages = pp_size * static_cast<int>(f.stages_per_rank);
  fsdp::pipeline::check_schedule(kind, pp_size, n_stages, static_cast<int>(f.microbatches));
  const auto ranges = fsdp::pipeline::split_blocks_evenly(f.layers, n_stages);

  const auto corpus = fsdp::examples::CharCorpus::embedded();
  const int64_t vocab = (corpus.tokenizer().vocab_size() + tp_size - 1) / tp_size * tp_size;
  const GPTConfig config = model_config(f, vocab);
  if (main_rank) {
    std::printf("train_gpt_pipeline: %d ranks as %s; schedule %s, %" PRId64 " microbatches of %" PRId64
                " x %" PRId64 " tokens per data-parallel replica; %d stages:",
                w, mesh->describe().c_str(), f.schedule.c_str(), f.microbatches, f.batch / f.microbatches,
                f.context, n_stages);
    for (int s = 0; s < n_stages; ++s) {
      std::printf(" %d: blocks [%" PRId64 ", %" PRId64 ")%s%s (pipeline rank %d)%s", s, ranges[s].begin,
                  ranges[s].end, s == 0 ? " + embeddings" : "", s == n_stages - 1 ? " + ln_f, head, loss" : "",
                  s % pp_size, s + 1 < n_stages ? ";" : "\n");
    }
    std::printf("inside each stage: fully_shard on each block and the stage's root over dp (%d ranks)%s%s; "
                "gradients reduced %s\n\n",
                dp_size, tp_size > 1 ? ", tensor parallel over tp" : "",
                f.checkpoint_activations ? ", activation checkpointing on each block" : "",
                f.reduce_every_microbatch ? "in every microbatch's backward" : "once per step (last microbatch)");
    std::fflush(stdout);
  }

  // This rank's stages: the whole model built from the seed, pruned to the stage.
  std::vector<GPT> parts;
  std::vector<std::unique_ptr<fsdp::pipeline::PipelineStage>> stages;
  std::vector<fsdp::pipeline::PipelineStage*> stage_ptrs;
  std::vector<at::Tensor> params;
  fsdp::examples::GptLossFunction loss_of = fsdp::examples::next_token_loss;
  const auto blocks = fsdp::WrapPolicy::module_types<fsdp::examples::BlockImpl>();
  for (int s : fsdp::pipeline::stages_of_rank(pp->rank(), pp_size, n_stages)) {
    torch::manual_seed(f.seed);
    GPT part(config);
    part->keep_stage(ranges[s], s == 0, s == n_stages - 1);
    if (f.checkpoint_activations) fsdp::checkpoint_activations_tree(*part, blocks);
    if (tp_size > 1) {
      auto fn = fsdp::examples::parallelize_gpt(part, mesh->group("tp"));
      if (s == n_stages - 1) loss_of = fn;
    }
    auto units = fsdp::fully_shard_tree(*part, blocks, fsdp::FullyShardOptions().communicator(dp));
    auto stage = std::make_unique<fsdp::pipeline::PipelineStage>(
        [part](const at::Tensor& x) mutable { return part(x); }, s, n_stages, pp);
    stage->set_fsdp_units({units.back()});
    for (const auto& p : part->parameters()) params.push_back(p);
    parts.push_back(part);
    stage_ptrs.push_back(stage.get());
    stages.push_back(std::move(stage));
  }
  torch::optim::AdamW optim(params, torch::optim::AdamWOptions(f.lr).weight_decay(0.1));
  fsdp::pipeline::PipelineSchedule schedule(
      stage_ptrs, [&](const at::Tensor& logits, const at::Tensor& y) { return loss_of(logits, y); },
      fsdp::pipeline::ScheduleOptions()
          .kind(kind)
          .n_microbatches(static_cast<int>(f.microbatches))
          .reduce_every_microbatch(f.reduce_every_microbatch));

  // Metrics go over a communicator of their own, so the mesh's groups count only training.
  fsdp::comm::Communicator metrics(world.backend(), group.device);
  const bool holds_last = stage_ptrs.back()->is_last();
  std::vector<double> losses;
  double compute = 0, step_time = 0;
  int64_t measured = 0;
  for (int64_t step = 1; step <= f.steps; ++step) {
    const auto b = corpus.sample_batch({.seed = f.seed, .step = step, .rank = mesh->coordinate("dp")}, f.batch,
                                       f.context);
    std::vector<at::Tensor> mb_losses;
    const auto t0 = Clock::now();
    schedule.step(b.inputs, b.targets, &mb_losses);
    optim.step();
    optim.zero_grad();
    const double seconds = seconds_since(t0);
    // The step's loss: the mean over microbatches on the last stage, averaged over replicas (and
    // counted once per tp group).
    at::Tensor l = at::zeros({1}, at::kDouble);
    if (holds_last && (tp_size == 1 || mesh->coordinate("tp") == 0)) {
      l += at::stack(mb_losses).mean().to(at::kDouble) / dp_size;
    }
    metrics.all_reduce(l).wait();
    losses.push_back(l.item<double>());
    if (step > 1) {  // the first step agrees shapes and warms up
      const auto& st = schedule.last_step_stats();
      compute += st.compute_seconds;
      step_time += st.step_seconds;
      ++measured;
    }
    if (main_rank && (step == 1 || step % 5 == 0 || step == f.steps)) {
      std::printf("step %3" PRId64 "  loss %.4f  %.1f ms\n", step, losses.back(), seconds * 1e3);
      std::fflush(stdout);
    }
  }

  // Per rank: the share of the step spent outside forwards and backwards (the bubble, plus
  // transfers), next to the schedule's closed form and its simulation.
  const auto& st = schedule.last_step_stats();
  at::Tensor per_rank = at::tensor({measured ? 1.0 - compute / step_time : 0.0,
                                    static_cast<double>(st.send_bytes), static_cast<double>(st.peak_live_microbatches)},
                                   at::kDouble);
  std::vector<at::Tensor> gathered(w);
  for (auto& g : gathered) g = at::empty_like(per_rank);
  metrics.all_gather(gathered, per_rank).wait();
  if (main_rank) {
    const int p = pp_size, m = static_cast<int>(f.microbatches), v = static_cast<int>(f.stages_per_rank);
    const double closed = kind == ScheduleKind::kInterleaved1F1B ? static_cast<double>(p - 1) / (v * m + p - 1)
                                                                 : static_cast<double>(p - 1) / (m + p - 1);
    const auto sim = fsdp::pipeline::simulate_schedule(kind, p, n_stages, m, /*backward_cost=*/2);
    std::printf("\nschedule %s, p = %d, m = %d: bubble closed form %.3f (forward = backward), simulated %.3f "
                "(backward = 2 forwards)\n",
                f.schedule.c_str(), p, m, closed, sim.bubble_fraction);
    for (int r = 0; r < w; ++r) {
      const auto g = gathered[r];
      std::printf("  rank %d (pipeline rank %d): outside forward/backward %.1f%% of the step (mean over "
                  "%" PRId64 " steps), sent %.0f bytes point-to-point in the last step, at most %.0f microbatches "
                  "held per stage\n",
                  r, r / (dp_size * tp_size), 100 * g[0].item<double>(), measured, g[1].item<double>(),
                  g[2].item<double>());
    }
  }
  if (f.check_unsharded && main_rank) {
    const auto reference = train_unsharded(corpus, config, f, dp_size);
    const double diff = std::abs(reference.back() - losses.back());
    std::printf("\nfinal loss %.6f; the same training unsharded on one process %.6f (|difference| %.2e): %s\n",
                losses.back(), reference.back(), diff, diff < 1e-3 ? "match" : "MISMATCH");
    std::fflush(stdout);
    if (diff >= 1e-3) return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return fsdp::examples::example_main<Flags>("train_gpt_pipeline", kUsage, argc, argv, parse_flags, run);
}
