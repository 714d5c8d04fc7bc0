// Soak: trains the example GPT under fully_shard for many steps and reports, every --every steps,
// the process's resident set size and the bytes live in LibTorch's CPU allocator (counted by
// tools/bench/counting_allocator.h), so that growth over a long run shows. Every rank reports its
// own figures; rank 0 prints them all. Ends with the growth of each figure from the first report
// (after warm-up) to the last, and exits 1 when the allocator's live bytes grew or the RSS grew
// by more than --max-rss-growth-mib.
//
//   mpirun -np 2 soak [--steps 1000] [--every 100] [--strategy full|grad_op|no_shard]
//                     [--checkpoint-activations] [--layers 4] [--d-model 128] ...
//
// tools/soak.sh builds it with -c opt and launches it.
#include <cinttypes>
#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/ops/randint.h>
#include <torch/optim/adamw.h>
#include <unistd.h>

#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/composable/activation_checkpoint.h"
#include "fsdp_cpp/composable/fully_shard_tree.h"
#include "fsdp_cpp/examples/gpt_model.h"
#include "fsdp_cpp/tools/bench/counting_allocator.h"

namespace {

constexpr const char* kUsage = R"(usage: soak [flags]   (launch with mpirun; tools/soak.sh)
  --steps N (1000)  --every N (100)  --strategy full|grad_op|no_shard (full)
  --layers N (4)  --d-model N (128)  --heads N (4)  --context N (64)  --batch N (16)  --vocab N (65)
  --checkpoint-activations    fsdp::checkpoint_activations on every block
  --max-rss-growth-mib X (8)  the RSS growth from the first report to the last that fails the run
)";

struct Flags {
  int64_t steps = 1000, every = 100, layers = 4, d_model = 128, heads = 4, context = 64, batch = 16, vocab = 65;
  std::string strategy = "full";
  bool checkpoint_activations = false;
  double max_rss_growth_mib = 8.0;
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
    else if (a == "--every") f.every = std::stoll(next());
    else if (a == "--layers") f.layers = std::stoll(next());
    else if (a == "--d-model") f.d_model = std::stoll(next());
    else if (a == "--heads") f.heads = std::stoll(next());
    else if (a == "--context") f.context = std::stoll(next());
    else if (a == "--batch") f.batch = std::stoll(next());
    else if (a == "--vocab") f.vocab = std::stoll(next());
    else if (a == "--strategy") f.strategy = next();
    else if (a == "--checkpoint-activations") f.checkpoint_activations = true;
    else if (a == "--max-rss-growth-mib") f.max_rss_growth_mib = std::stod(next());
    else if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else {
      throw std::invalid_argument("unknown flag '" + a + "'\n" + kUsage);
    }
  }
  if (f.every < 1 || f.steps < 2 * f.every) throw std::invalid_argument("--steps must be at least 2 x --every");
  return f;
}

fsdp::ShardingStrategy strategy_of(const std::string& name) {
  if (name == "full") return fsdp::ShardingStrategy::kFullShard;
  if (name == "grad_op") return fsdp::ShardingStrategy::kShardGradOp;
  if (name == "no_shard") return fsdp::ShardingStrategy::kNoShard;
  throw std::invalid_argument("--strategy expects full, grad_op or no_shard (got '" + name + "')");
}

// Resident set size in bytes (/proc/self/statm: pages).
int64_t rss_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

int run(const Flags& f) {
  auto& alloc = fsdp::bench::CountingAllocator::install();
  at::set_num_threads(1);
  auto pg = fsdp::comm::init_process_group();
  auto& comm = *pg.comm;
  const int rank = comm.rank();
  const int world = comm.size();
  const auto config = fsdp::examples::GPTConfig(f.vocab)
                          .context_length(f.context)
                          .d_model(f.d_model)
                          .n_heads(f.heads)
                          .n_layers(f.layers);
  torch::manual_seed(0);
  fsdp::examples::GPT model(config);
  const auto blocks = fsdp::WrapPolicy::module_types<fsdp::examples::BlockImpl>();
  if (f.checkpoint_activations) fsdp::checkpoint_activations_tree(*model, blocks);
  fsdp::fully_shard_tree(*model, blocks, fsdp::FullyShardOptions().strategy(strategy_of(f.strategy)));
  torch::optim::AdamW optim(model->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(1000 + rank));

  if (rank == 0) {
    std::printf("soak: GPT (%" PRId64 " blocks, d_model %" PRId64 "), fully_shard(%s)%s, AdamW, %d rank(s), "
                "%" PRId64 " steps; every %" PRId64 " steps each rank's RSS and the CPU allocator's live "
                "bytes (after optimizer.step() and zero_grad())\n\n",
                f.layers, f.d_model, f.strategy.c_str(), f.checkpoint_activations ? " + checkpoint" : "", world,
                f.steps, f.every);
    std::printf("%6s", "step");
    for (int r = 0; r < world; ++r) std::printf("  rank %d RSS MiB  alloc bytes", r);
    std::printf("   loss\n");
  }
  std::vector<int64_t> first, last;  // per rank: RSS, allocator bytes (from the first report on)
  for (int64_t step = 1; step <= f.steps; ++step) {
    at::Tensor w = at::randint(0, f.vocab, {f.batch, f.context + 1}, gen);
    at::Tensor loss = fsdp::examples::next_token_loss(model(w.narrow(1, 0, f.context)), w.narrow(1, 1, f.context));
    loss.backward();
    optim.step();
    optim.zero_grad();
    const double loss_value = loss.item<double>();
    loss = at::Tensor();
    w = at::Tensor();
    if (step % f.every != 0) continue;
    comm.barrier();  // every rank's collectives of this step completed and released
    const int64_t mine[2] = {rss_bytes(), alloc.current()};
    std::vector<uint8_t> bytes(reinterpret_cast<const uint8_t*>(mine), reinterpret_cast<const uint8_t*>(mine) + sizeof(mine));
    const auto all = comm.all_gather_bytes(bytes, "soak report");
    std::vector<int64_t> figures;
    for (const auto& b : all) {
      const auto* v = reinterpret_cast<const int64_t*>(b.data());
      figures.push_back(v[0]);
      figures.push_back(v[1]);
    }
    if (first.empty()) first = figures;
    last = figures;
    if (rank == 0) {
      std::printf("%6" PRId64, step);
      for (int r = 0; r < world; ++r) {
        std::printf("  %15.2f  %11" PRId64, static_cast<double>(figures[2 * r]) / (1 << 20), figures[2 * r + 1]);
      }
      std::printf("   %.4f\n", loss_value);
      std::fflush(stdout);
    }
  }
  bool grew = false;
  if (rank == 0) std::printf("\ngrowth from step %" PRId64 " to step %" PRId64 ":\n", f.every, f.steps - f.steps % f.every);
  for (int r = 0; r < world; ++r) {
    const double rss_growth_mib = static_cast<double>(last[2 * r] - first[2 * r]) / (1 << 20);
    const int64_t alloc_growth = last[2 * r + 1] - first[2 * r + 1];
    const bool bad = alloc_growth > 0 || rss_growth_mib > f.max_rss_growth_mib;
    grew |= bad;
    if (rank == 0) {
      std::printf("  rank %d: RSS %+.2f MiB, allocator %+" PRId64 " bytes%s\n", r, rss_growth_mib, alloc_growth,
                  bad ? "  GROWTH" : "  (flat)");
    }
  }
  if (rank == 0) std::printf("%s\n", grew ? "soak: memory grew" : "soak: flat, no growth");
  return grew ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "soak: %s\n", e.what());
    return 2;
  }
}
