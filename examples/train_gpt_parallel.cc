// train_gpt_parallel: the GPT of examples/gpt_model.h trained through the composition root
// (parallel/parallel_model.h) on any (dp_replicate, dp_shard, tp, pp) layout of the MPI ranks:
// tensor parallel -> activation checkpointing -> fully_shard (HSDP with --dp-replicate) ->
// pipeline stages, with dropout and gradient clipping on by default. Prints the layout, a line per
// step (loss, clipped norm, tokens/s), and at the end every step's loss next to the same training
// run unsharded on one process with the same seeds (parallel/reference.h), which it must match.
//
//   tools/example.sh --np 4 --dp 2 --tp 2                  # fully_shard x tensor parallel
//   tools/example.sh --np 4 --pp 2 --dp 2                  # pipeline x fully_shard
//   tools/example.sh --np 4 --pp 2 --tp 2                  # pipeline x tensor parallel
//   tools/example.sh --np 4 --dp-replicate 2 --dp 2       # HSDP
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/optim/adamw.h>
#include <torch/torch.h>

#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/examples/char_corpus.h"
#include "fsdp_cpp/examples/example_main.h"
#include "fsdp_cpp/examples/flags.h"
#include "fsdp_cpp/examples/gpt_model.h"
#include "fsdp_cpp/examples/gpt_model_spec.h"
#include "fsdp_cpp/parallel/parallel_model.h"
#include "fsdp_cpp/parallel/reference.h"

namespace {

using fsdp::examples::parse_double_flag;
using fsdp::examples::parse_int_flag;

using fsdp::examples::GPTConfig;

constexpr const char* kUsage = R"(usage: train_gpt_parallel [options]   (launched by tools/example.sh --dp/--tp/--pp ...)
  --dp-replicate R       data-parallel replicas (HSDP's replicate dimension; default 1)
  --dp D                 ranks each replica is sharded over (default: the ranks left)
  --tp T                 tensor-parallel ranks (default 1)
  --pp P                 pipeline ranks (default 1)
  --stages-per-rank V    stage chunks per pipeline rank (default 1; more needs interleaved_1f1b)
  --schedule S           gpipe, 1f1b or interleaved_1f1b (default 1f1b)
  --microbatches M       microbatches per step (default: 2, or pp x stages-per-rank with a pipeline)
  --dropout X            dropout probability (default 0.1)
  --clip X               gradient clipping's max norm, 0: off (default 1.0)
  --checkpoint-activations   activation checkpointing on each block
  --steps S --layers L --d-model D --heads H --context T --batch B (per data rank)
  --lr X --seed N --threads N
  --check-unsharded 0|1  train the unsharded model on one process too and compare (default 1)
)";

struct Flags {
  int dp_replicate = 1, dp = -1, tp = 1, pp = 1, stages_per_rank = 1, microbatches = 0;
  std::string schedule = "1f1b";
  double dropout = 0.1, clip = 1.0, lr = 3e-3;
  bool checkpoint_activations = false, check_unsharded = true;
  int64_t steps = 20, layers = 4, d_model = 64, heads = 4, context = 32, batch = 8, threads = 1;
  uint64_t seed = 0;
};

Flags parse_flags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string name = argv[i];
    if (name == "--help" || name == "-h") throw std::invalid_argument("help");
    if (name == "--checkpoint-activations") { f.checkpoint_activations = true; continue; }
    if (i + 1 >= argc) throw std::invalid_argument(name + " expects a value");
    const std::string value = argv[++i];
    if (name == "--dp-replicate") f.dp_replicate = static_cast<int>(parse_int_flag(name, value, 1));
    else if (name == "--dp") f.dp = static_cast<int>(parse_int_flag(name, value, 1));
    else if (name == "--tp") f.tp = static_cast<int>(parse_int_flag(name, value, 1));
    else if (name == "--pp") f.pp = static_cast<int>(parse_int_flag(name, value, 1));
    else if (name == "--stages-per-rank") f.stages_per_rank = static_cast<int>(parse_int_flag(name, value, 1));
    else if (name == "--microbatches") f.microbatches = static_cast<int>(parse_int_flag(name, value, 1));
    else if (name == "--schedule") f.schedule = value;
    else if (name == "--dropout") f.dropout = parse_double_flag(name, value, 0.0);
    else if (name == "--clip") f.clip = parse_double_flag(name, value, 0.0);
    else if (name == "--lr") f.lr = parse_double_flag(name, value, 1e-12);
    else if (name == "--steps") f.steps = parse_int_flag(name, value, 1);
    else if (name == "--layers") f.layers = parse_int_flag(name, value, 1);
    else if (name == "--d-model") f.d_model = parse_int_flag(name, value, 1);
    else if (name == "--heads") f.heads = parse_int_flag(name, value, 1);
    else if (name == "--context") f.context = parse_int_flag(name, value, 1);
    else if (name == "--batch") f.batch = parse_int_flag(name, value, 1);
    else if (name == "--threads") f.threads = parse_int_flag(name, value, 1);
    else if (name == "--seed") f.seed = static_cast<uint64_t>(parse_int_flag(name, value, 0));
    else if (name == "--check-unsharded") f.check_unsharded = parse_int_flag(name, value, 0) != 0;
    else throw std::invalid_argument("unknown argument '" + name + "'");
  }
  if (f.microbatches == 0) f.microbatches = f.pp > 1 ? f.pp * f.stages_per_rank : 2;
  fsdp::pipeline::parse_schedule(f.schedule);  // a c10::Error naming the schedules
  return f;
}

using Clock = std::chrono::steady_clock;

int run(const Flags& f, const fsdp::comm::ProcessGroup& group) {
  const auto corpus = fsdp::examples::CharCorpus::embedded();
  // The vocabulary padded to a multiple of tp (the head and the embedding split it).
  const int64_t vocab = (corpus.tokenizer().vocab_size() + f.tp - 1) / f.tp * f.tp;
  const GPTConfig config = GPTConfig(vocab)
                               .context_length(f.context)
                               .d_model(f.d_model)
                               .n_heads(f.heads)
                               .n_layers(f.layers)
                               .dropout(f.dropout)
                               .tie_embeddings(false);  // embedding and head may live on different stages
  const uint64_t init_seed = f.seed + 1;

  const fsdp::parallel::ModelSpec spec = fsdp::examples::gpt_model_spec(config, init_seed);
  const auto options = fsdp::parallel::ParallelOptions()
                           .dims({.dp_replicate = f.dp_replicate, .dp_shard = f.dp, .tp = f.tp, .pp = f.pp})
                           .schedule(fsdp::pipeline::parse_schedule(f.schedule))
                           .stages_per_rank(f.stages_per_rank)
                           .n_microbatches(f.microbatches)
                           .checkpoint_activations(f.checkpoint_activations)
                           .seed(f.seed);
  auto model = fsdp::parallel::parallelize(group.comm, spec, options);
  const auto& mesh = model.mesh();
  const bool main_rank = group.comm->rank() == 0;
  if (main_rank) {
    std::printf("train_gpt_parallel: %s\n", model.describe().c_str());
    std::printf("model: %" PRId64 " layers, d_model %" PRId64 ", %" PRId64 " heads, vocabulary %" PRId64
                ", dropout %.2f; batch %" PRId64 " x %" PRId64 " tokens per data rank, %d data ranks; clip %.2f\n\n",
                f.layers, f.d_model, f.heads, vocab, f.dropout, f.batch, f.context, mesh.data_world(), f.clip);
    std::fflush(stdout);
  }
  torch::optim::AdamW optim(model.parameters(), torch::optim::AdamWOptions(f.lr).weight_decay(0.1));
  std::vector<double> losses;
  for (int64_t step = 1; step <= f.steps; ++step) {
    // The data by data rank: the ranks of a tp group and of a pipeline read the same batch.
    const auto b = corpus.sample_batch({.seed = f.seed, .step = step, .rank = mesh.data_rank()}, f.batch, f.context);
    const auto t0 = Clock::now();
    const at::Tensor loss = model.forward_backward(b.inputs, b.targets);
    const double norm = f.clip > 0 ? model.clip_grad_norm_(f.clip) : 0.0;
    optim.step();
    model.zero_grad();
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    losses.push_back(model.global_loss(loss));
    if (main_rank && (step == 1 || step % 5 == 0 || step == f.steps)) {
      const double tokens = static_cast<double>(f.batch * f.context * mesh.data_world());
      std::printf("step %3" PRId64 "  loss %.4f  grad norm %.4f%s  %.0f tokens/s\n", step, losses.back(), norm,
                  f.clip > 0 && norm > f.clip ? " (clipped)" : "", tokens / seconds);
      std::fflush(stdout);
    }
  }
  if (!f.check_unsharded || !main_rank) return 0;
  // The same training, unsharded on this process, with the composition root's seeds.
  fsdp::parallel::UnshardedReference reference(spec, options);
  return fsdp::examples::unsharded_difference(
      reference, torch::optim::AdamWOptions(f.lr).weight_decay(0.1), f.clip, losses,
      "same seeds, same dropout masks", [&](int64_t step) {
        std::vector<fsdp::parallel::Batch> global;
        for (int q = 0; q < mesh.data_world(); ++q) {
          const auto b = corpus.sample_batch({.seed = f.seed, .step = step, .rank = q}, f.batch, f.context);
          global.push_back({b.inputs, b.targets});
        }
        return global;
      });
}

}  // namespace

int main(int argc, char** argv) {
  return fsdp::examples::example_main<Flags>("train_gpt_parallel", kUsage, argc, argv, parse_flags, run);
}
