// replicate_bench: the step time of replicate (DDP-style bucketed all-reduce overlapping backward)
// against fully_shard NO_SHARD (one all-reduce per unit) on the GPT of //examples:gpt_model, in
// one run (tools/replicate_benchmark.sh builds it with -c opt and launches it):
//
//   mpirun -np 2 replicate_bench [--steps N] [--warmup N] [--layers N] [--d-model N] ...
//
// Both variants start from the same weights (torch::manual_seed) and train on the same per-rank
// batches with AdamW; their steps alternate (variant A's step i, then B's step i), so load on the
// shared machine affects both alike. A step is zero_grad + forward + backward + optimizer step;
// rank 0 prints the median step time of each variant, the ratio replicate / NO_SHARD, the
// collectives per step and the largest loss difference between the two variants (both are DDP
// semantics: the losses agree to fp32 rounding).

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/randint.h>
#include <c10/util/Exception.h>
#include <torch/optim/adamw.h>
#include <torch/utils.h>

#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/replicate.h"
#include "fsdp_cpp/examples/gpt_model.h"

namespace {

using Clock = std::chrono::steady_clock;
using fsdp::comm::CollectiveKind;

constexpr const char* kUsage = R"(usage: mpirun -np W replicate_bench [flags]
  --steps N (20)  --warmup N (3)  --layers N (4)  --d-model N (128)  --heads N (4)
  --context N (64)  --batch N (16)  --vocab N (65)  --bucket-cap-mb X (25)  --threads N (1)
)";

struct Flags {
  int64_t steps = 20, warmup = 3, layers = 4, d_model = 128, heads = 4, context = 64, batch = 16, vocab = 65;
  double bucket_cap_mb = 25;
  int64_t threads = 1;
};

Flags parse(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--steps") f.steps = std::stoll(next());
    else if (a == "--warmup") f.warmup = std::stoll(next());
    else if (a == "--layers") f.layers = std::stoll(next());
    else if (a == "--d-model") f.d_model = std::stoll(next());
    else if (a == "--heads") f.heads = std::stoll(next());
    else if (a == "--context") f.context = std::stoll(next());
    else if (a == "--batch") f.batch = std::stoll(next());
    else if (a == "--vocab") f.vocab = std::stoll(next());
    else if (a == "--bucket-cap-mb") f.bucket_cap_mb = std::stod(next());
    else if (a == "--threads") f.threads = std::stoll(next());
    else if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else {
      throw std::invalid_argument("unknown flag '" + a + "'\n" + kUsage);
    }
  }
  return f;
}

struct Variant {
  std::string name;
  fsdp::examples::GPT model{nullptr};
  std::shared_ptr<fsdp::comm::Communicator> comm;  // its own, so that its counters are its own
  std::unique_ptr<torch::optim::AdamW> optim;
  std::vector<double> step_ms;
  std::vector<double> losses;
  int64_t buckets_or_units = 0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int run(const Flags& f) {
  at::set_num_threads(static_cast<int>(f.threads));
  auto pg = fsdp::comm::init_process_group();
  const int rank = pg.comm->rank();
  const auto config = fsdp::examples::GPTConfig(f.vocab)
                          .context_length(f.context)
                          .d_model(f.d_model)
                          .n_heads(f.heads)
                          .n_layers(f.layers);

  Variant rep{"replicate (root)"}, ns{"fully_shard NO_SHARD (blocks + root)"};
  for (Variant* v : {&rep, &ns}) {
    torch::manual_seed(0);
    v->model = fsdp::examples::GPT(config);
    v->comm = std::make_shared<fsdp::comm::Communicator>(pg.comm->backend(), pg.device);
  }
  auto replicated = fsdp::replicate(rep.model, fsdp::ReplicateOptions().communicator(rep.comm).bucket_cap_mb(f.bucket_cap_mb));
  const auto no_shard = fsdp::FullyShardOptions().communicator(ns.comm).strategy(fsdp::ShardingStrategy::kNoShard);
  for (auto& block : ns.model->block_list()) fsdp::fully_shard(block, no_shard);
  fsdp::fully_shard(ns.model, no_shard);
  ns.buckets_or_units = f.layers + 1;
  for (Variant* v : {&rep, &ns}) {
    v->optim = std::make_unique<torch::optim::AdamW>(v->model->parameters(),
                                                     torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
  }

  // Per-rank batches: [batch, context + 1] token windows.
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(1000 + rank));
  const int64_t total = f.warmup + f.steps;
  std::vector<at::Tensor> windows;
  for (int64_t i = 0; i < total; ++i) windows.push_back(at::randint(0, f.vocab, {f.batch, f.context + 1}, gen));

  auto step = [&](Variant& v, int64_t i) {
    const auto t0 = Clock::now();
    v.optim->zero_grad();
    const at::Tensor& w = windows[i];
    at::Tensor loss = fsdp::examples::next_token_loss(v.model(w.narrow(1, 0, f.context)), w.narrow(1, 1, f.context));
    loss.backward();
    v.optim->step();
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    if (i >= f.warmup) v.step_ms.push_back(ms);
    v.losses.push_back(loss.item<double>());
  };
  int64_t rep_ar = 0, rep_ar_bytes = 0, ns_ar = 0, ns_ar_bytes = 0;
  for (int64_t i = 0; i < total; ++i) {
    if (i == f.warmup) {
      rep.comm->reset_stats();
      ns.comm->reset_stats();
    }
    step(rep, i);
    step(ns, i);
  }
  rep_ar = rep.comm->stats(CollectiveKind::kAllReduce).calls;
  rep_ar_bytes = rep.comm->stats(CollectiveKind::kAllReduce).bytes;
  ns_ar = ns.comm->stats(CollectiveKind::kAllReduce).calls;
  ns_ar_bytes = ns.comm->stats(CollectiveKind::kAllReduce).bytes;
  rep.buckets_or_units = static_cast<int64_t>(replicated.num_buckets());

  double max_loss_diff = 0;
  for (size_t i = 0; i < rep.losses.size(); ++i) max_loss_diff = std::max(max_loss_diff, std::abs(rep.losses[i] - ns.losses[i]));
  int64_t params = 0;
  for (const auto& p : rep.model->parameters()) params += p.numel();
  if (rank == 0) {
    std::printf("replicate_bench: GPT %lld layers, d_model %lld, context %lld, batch %lld, vocab %lld (%lld parameters), "
                "world size %d, %d thread(s) per rank, %lld warm-up + %lld measured steps, bucket_cap_mb %g\n",
                (long long)f.layers, (long long)f.d_model, (long long)f.context, (long long)f.batch,
                (long long)f.vocab, (long long)params, pg.comm->size(), at::get_num_threads(),
                (long long)f.warmup, (long long)f.steps, f.bucket_cap_mb);
    const double steps = static_cast<double>(f.steps);
    std::printf("  %-40s median step %8.2f ms  (%lld buckets; all-reduces/step %.1f, MB/step %.2f)\n",
                rep.name.c_str(), median(rep.step_ms), (long long)rep.buckets_or_units, rep_ar / steps,
                rep_ar_bytes / steps / 1e6);
    std::printf("  %-40s median step %8.2f ms  (%lld units;   all-reduces/step %.1f, MB/step %.2f)\n",
                ns.name.c_str(), median(ns.step_ms), (long long)ns.buckets_or_units, ns_ar / steps,
                ns_ar_bytes / steps / 1e6);
    std::printf("  ratio replicate / NO_SHARD: %.3f\n", median(rep.step_ms) / median(ns.step_ms));
    std::printf("  largest loss difference between the variants over %zu steps: %.3g\n", rep.losses.size(),
                max_loss_diff);
    const auto stats = replicated.stats();
    std::printf("  replicate buckets issued during backward: %lld, at its end: %lld\n",
                (long long)stats.buckets_issued_during_backward, (long long)stats.buckets_issued_at_end_of_backward);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "replicate_bench: %s\n", e.what());
    return 1;
  }
}
