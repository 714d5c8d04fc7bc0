// Host memory and time to build and shard a large GPT with and without meta-device init: one mode
// per launch (the peak RSS is per process), every rank reports, rank 0 prints one line per rank.
//
//   mpirun -np 2 meta_init_bench --mode meta|eager [--layers 18] [--d-model 2048] [--vocab 32000]
//
// Figures per rank: allocator bytes (LibTorch's CPU allocator, counted by
// tools/bench/counting_allocator.h: live after sharding, and the peak over build + fully_shard),
// RSS (VmRSS after sharding, VmHWM: the process's peak), the seconds to build and to shard, the
// sharded state (bytes of this rank's shards) and the largest unit (bytes of its parameters
// unsharded). tools/meta_init_benchmark.sh runs W = 1, 2, 4 in both modes and prints the table.
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <string>

#include <ATen/Parallel.h>

#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/composable/fully_shard_tree.h"
#include "fsdp_cpp/examples/gpt_model.h"
#include "fsdp_cpp/init/meta_init.h"
#include "fsdp_cpp/tools/bench/counting_allocator.h"

namespace {

struct Flags {
  std::string mode = "meta";
  int64_t layers = 18, d_model = 2048, heads = 16, context = 1024, vocab = 32000;
};

Flags parse(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
    const std::string v = argv[++i];
    if (a == "--mode") f.mode = v;
    else if (a == "--layers") f.layers = std::stoll(v);
    else if (a == "--d-model") f.d_model = std::stoll(v);
    else if (a == "--heads") f.heads = std::stoll(v);
    else if (a == "--context") f.context = std::stoll(v);
    else if (a == "--vocab") f.vocab = std::stoll(v);
    else throw std::invalid_argument("unknown flag " + a);
  }
  if (f.mode != "meta" && f.mode != "eager") throw std::invalid_argument("--mode expects meta or eager");
  return f;
}

// A field of /proc/self/status in bytes (VmRSS, VmHWM).
int64_t status_bytes(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1)) * 1024;
  }
  return -1;
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

double gib(int64_t b) { return static_cast<double>(b) / (1 << 30); }

}  // namespace

int main(int argc, char** argv) {
  try {
    const Flags f = parse(argc, argv);
    at::set_num_threads(1);
    auto& alloc = fsdp::bench::CountingAllocator::install();
    auto group = fsdp::comm::init_process_group();
    auto& comm = *group.comm;
    const auto config = fsdp::examples::GPTConfig(f.vocab).context_length(f.context).d_model(f.d_model)
                            .n_heads(f.heads).n_layers(f.layers);
    const int64_t base_peak = alloc.peak();
    const auto build_start = std::chrono::steady_clock::now();
    torch::manual_seed(0);
    fsdp::examples::GPT model(nullptr);
    if (f.mode == "meta") {
      fsdp::MetaInitGuard meta;
      model = fsdp::examples::GPT(config);
    } else {
      model = fsdp::examples::GPT(config);
    }
    const double build_s = seconds_since(build_start);
    int64_t numel = 0, full_bytes = 0;
    for (const auto& p : model->parameters()) {
      numel += p.numel();
      full_bytes += p.numel() * p.element_size();
    }
    int64_t largest_unit = 0;
    for (const auto& block : *model->blocks) {
      int64_t b = 0;
      for (const auto& p : block.ptr()->parameters()) b += p.numel() * p.element_size();
      largest_unit = std::max(largest_unit, b);
    }
    const int64_t root_unit = full_bytes - largest_unit * f.layers;  // embeddings, ln_f, tied head
    largest_unit = std::max(largest_unit, root_unit);
    const int64_t after_build = alloc.current();
    const auto shard_start = std::chrono::steady_clock::now();
    auto units = fsdp::fully_shard_tree(*model, fsdp::WrapPolicy::module_types<fsdp::examples::BlockImpl>(),
                                        fsdp::FullyShardOptions().device(group.device));
    const double shard_s = seconds_since(shard_start);
    int64_t shard_bytes = 0;
    for (const auto& unit : units) shard_bytes += unit.sharded_param_bytes();
    const int64_t live = alloc.current(), peak = alloc.peak() - base_peak;
    const int64_t rss = status_bytes("VmRSS"), hwm = status_bytes("VmHWM");
    char line[512];
    std::snprintf(line, sizeof line,
                  "%-5s W=%d rank %d: %.3f B params (%.2f GiB), largest unit %.2f GiB | build %.2f s, "
                  "fully_shard %.2f s | allocator after build %.2f GiB, live after shard %.2f GiB, peak %.2f GiB | "
                  "RSS %.2f GiB, peak RSS %.2f GiB | shards %.2f GiB | peak / (shards + largest unit) %.2f",
                  f.mode.c_str(), comm.size(), comm.rank(), numel / 1e9, gib(full_bytes), gib(largest_unit),
                  build_s, shard_s, gib(after_build), gib(live), gib(peak), gib(rss), gib(hwm), gib(shard_bytes),
                  static_cast<double>(peak) / static_cast<double>(shard_bytes + largest_unit));
    for (int r = 0; r < comm.size(); ++r) {
      comm.barrier();
      if (r == comm.rank()) {
        std::printf("%s\n", line);
        std::fflush(stdout);
      }
    }
    comm.barrier();
    fsdp::comm::destroy_process_group();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "meta_init_bench: %s\n", e.what());
    return 1;
  }
}
