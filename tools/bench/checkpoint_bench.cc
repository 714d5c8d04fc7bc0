// Checkpoint throughput and memory: fsdp::dcp save and load of a model of --size-mb MB (Linear
// layers of 2048x2048 fp32, one unit each) on this launch's ranks, against nothing but the clock:
// tools/checkpoint_benchmark.sh puts the figures next to the disk's own bandwidth (dd) and Python
// DCP's save/load of the same bytes.
//
//   checkpoint_bench --dir DIR [--size-mb 300 (MiB)] [--repeats 3] [--drop-caches 0|1]
//
// Prints one line per measurement (rank 0), e.g.
//   fsdp_dcp save W=2 bytes=302006272 seconds=0.51 GB/s=0.59
// Warm loads are measured twice, alternated: as a program loads (checksums verified before anything is
// written) and with LoadOptions::verify_checksums(false), which shows what the verification costs.
// Throughput is the checkpoint's bytes (every rank's shards together) over the wall time of the
// whole collective call (barrier to barrier), fsync and commit included. Memory, on rank 0, next to
// the largest single entry: peak_extra_bytes = LibTorch's CPU allocator's peak over the call minus
// the bytes live before it (the sharded state); rss_extra_bytes = the process's resident-set high
// water mark over the call (reset through /proc/self/clear_refs) minus its resident set before,
// which also counts malloc'ed buffers, thread stacks and mapped file pages. save_async copies the
// whole sharded state by design.

#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <unistd.h>
#include <string>

#include <torch/torch.h>

#include "fsdp_cpp/checkpoint/distributed_checkpoint.h"
#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/contract/hookable_modules.h"
#include "fsdp_cpp/contract/hookable_sequential.h"
#include "fsdp_cpp/tools/bench/counting_allocator.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Flags {
  std::string dir;
  int64_t size_mb = 300;
  int repeats = 3;
  bool drop_caches = true;
};

Flags parse(int argc, char** argv) {
  Flags f;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string name = argv[i], value = argv[i + 1];
    if (name == "--dir") f.dir = value;
    else if (name == "--size-mb") f.size_mb = std::stoll(value);
    else if (name == "--repeats") f.repeats = std::stoi(value);
    else if (name == "--drop-caches") f.drop_caches = value != "0";
    else throw std::invalid_argument("unknown flag " + name);
  }
  if (f.dir.empty()) throw std::invalid_argument("--dir is required");
  return f;
}

// Drops the page cache (root only) so that a load reads from the disk; false when not allowed.
bool drop_page_cache() {
  ::sync();
  std::ofstream f("/proc/sys/vm/drop_caches");
  if (!f) return false;
  f << "3\n";
  f.flush();
  return static_cast<bool>(f);
}

// Resident set now and its high-water mark (kB lines of /proc/self/status), in bytes.
int64_t status_bytes(const char* field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const std::string prefix = std::string(field) + ":";
  while (std::getline(f, line)) {
    if (line.rfind(prefix, 0) == 0) return std::stoll(line.substr(prefix.size())) * 1024;
  }
  return -1;
}

// Restarts the high-water mark at the current resident set (Linux >= 4.0); false if not allowed.
bool reset_rss_peak() {
  std::ofstream f("/proc/self/clear_refs");
  if (!f) return false;
  f << "5\n";
  f.flush();
  return static_cast<bool>(f);
}

}  // namespace

int main(int argc, char** argv) {
  auto& alloc = fsdp::bench::CountingAllocator::install();
  auto group = fsdp::comm::init_process_group();
  auto& comm = *group.comm;
  const Flags f = parse(argc, argv);
  const int W = comm.size();
  const bool main_rank = comm.rank() == 0;

  constexpr int64_t kDim = 2048;
  const int64_t layer_bytes = (kDim * kDim + kDim) * 4;
  const int64_t layers = std::max<int64_t>(1, f.size_mb * (int64_t{1} << 20) / layer_bytes);
  torch::manual_seed(0);
  fsdp::contract::Sequential model;
  std::vector<fsdp::contract::Linear> linears;
  for (int64_t i = 0; i < layers; ++i) {
    linears.emplace_back(kDim, kDim);
    model->push_back(linears.back());
  }
  for (const auto& linear : linears) fsdp::fully_shard(linear);
  auto root = fsdp::fully_shard(model);
  int64_t total_bytes = 0;
  for (int64_t i = 0; i < layers; ++i) total_bytes += layer_bytes;
  const int64_t largest_entry = kDim * kDim * 4;

  struct Measure {
    double seconds = 0;
    int64_t peak_extra = 0;
    int64_t rss_extra = -1;
  };
  auto report = [&](const char* what, const Measure& m) {
    if (!main_rank) return;
    std::printf("fsdp_dcp %s W=%d bytes=%" PRId64 " seconds=%.4f GB/s=%.3f peak_extra_bytes=%" PRId64
                " rss_extra_bytes=%" PRId64 " largest_entry_bytes=%" PRId64 "\n",
                what, W, total_bytes, m.seconds, static_cast<double>(total_bytes) / m.seconds / 1e9, m.peak_extra,
                m.rss_extra, largest_entry);
    std::fflush(stdout);
  };
  auto timed = [&](const std::function<void()>& fn) {
    Measure m;
    comm.barrier();
    alloc.mark();
    const bool rss = reset_rss_peak();
    const int64_t rss_before = status_bytes("VmRSS");
    const auto start = Clock::now();
    fn();
    comm.barrier();
    m.seconds = std::chrono::duration<double>(Clock::now() - start).count();
    m.peak_extra = alloc.peak_since_mark();
    if (rss) m.rss_extra = status_bytes("VmHWM") - rss_before;
    return m;
  };

  // Saves into new folders (step-N checkpoints), then over one folder (a "latest" checkpoint: the
  // replaced one is removed in the background while the next is written).
  const std::string dir = f.dir + "/ckpt";
  for (int r = 0; r < f.repeats; ++r) {
    const std::string fresh = f.dir + "/step-" + std::to_string(r);
    report("save(new folder)", timed([&] { fsdp::dcp::save(fresh, root); }));
  }
  for (int r = 0; r < f.repeats; ++r) {
    if (main_rank) std::filesystem::remove_all(f.dir + "/step-" + std::to_string(r));
  }
  comm.barrier();
  for (int r = 0; r < f.repeats; ++r) {
    report("save(replacing)", timed([&] { fsdp::dcp::save(dir, root); }));
  }
  // Warm loads with the checksums verified (the default) and without, alternated so that both see the
  // same machine: the difference is what verify-before-write costs (a second read of every byte).
  const auto unverified = fsdp::dcp::LoadOptions().verify_checksums(false);
  for (int r = 0; r < f.repeats; ++r) {
    report("load(page cache warm)", timed([&] { fsdp::dcp::load(dir, root); }));
    report("load(page cache warm, checksums off)",
           timed([&] { fsdp::dcp::load(dir, root, nullptr, nullptr, unverified); }));
  }
  if (f.drop_caches) {
    for (int r = 0; r < f.repeats; ++r) {
      bool dropped = true;
      if (main_rank) dropped = drop_page_cache();
      comm.barrier();
      if (!dropped) {
        if (main_rank) std::printf("fsdp_dcp load(cold) W=%d skipped: cannot write /proc/sys/vm/drop_caches\n", W);
        break;
      }
      report("load(cold)", timed([&] { fsdp::dcp::load(dir, root); }));
    }
  }
  for (int r = 0; r < f.repeats; ++r) {
    double blocking = 0;
    report("save_async(total)", timed([&] {
             const auto start = Clock::now();
             auto pending = fsdp::dcp::save_async(dir, root);
             blocking = std::chrono::duration<double>(Clock::now() - start).count();
             pending.wait();
           }));
    if (main_rank) std::printf("fsdp_dcp save_async(blocking part) W=%d seconds=%.4f\n", W, blocking);
  }
  return 0;
}
