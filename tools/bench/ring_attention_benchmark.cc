// Ring attention (composable/context_parallel.h), one attention layer, forward + backward, at cp = 1
// (the whole sequence on each rank, a one-rank group) and cp = W (the world, head-tail layout), in
// one mpirun launch: time per forward and backward (median of the measured iterations, the slowest
// rank), the allocator's peak of live bytes per rank over forward + backward and the bytes held
// from the forward to the backward (the output and what the backward saves), both counted from
// just before the forward (inputs excluded), and the bytes sent against
// ring_attention_bytes_per_rank. Ratios against cp = 1 at the end. tools/ring_attention_benchmark.sh
// runs it next to tools/bench/torch_ring_attention_bench.py (PyTorch's ring on CPU/Gloo).
// usage: mpirun -np W ring_attention_benchmark [T=4096] [H=8] [HKV=8] [D=64] [ITERS=3]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "fsdp_cpp/comm/device_mesh.h"
#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/composable/context_parallel.h"
#include "fsdp_cpp/tools/bench/counting_allocator.h"

namespace {

struct Measured {
  double forward_ms = 0, backward_ms = 0;
  int64_t peak = 0, held = 0, sent = 0, formula = 0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double slowest(double x, fsdp::comm::Communicator& world) {
  at::Tensor t = at::full({1}, x, at::kDouble);
  world.all_reduce(t, c10d::ReduceOp::MAX).wait();
  return t.item<double>();
}

Measured measure(fsdp::comm::Communicator& cp, fsdp::comm::Communicator& world, int64_t T, int64_t H, int64_t Hkv,
                 int64_t D, int iters) {
  auto& alloc = fsdp::bench::CountingAllocator::install();
  auto gen = at::detail::createCPUGenerator(17);
  const int64_t B = 1;
  at::Tensor qf = at::randn({B, H, T, D}, gen), kf = at::randn({B, Hkv, T, D}, gen), vf = at::randn({B, Hkv, T, D}, gen);
  at::Tensor gf = at::randn({B, H, T, D}, gen);
  auto shard = [&](const at::Tensor& x) { return fsdp::cp::shard_sequence(x, 2, cp.size(), cp.rank()); };
  const at::Tensor q0 = shard(qf), k0 = shard(kf), v0 = shard(vf), g = shard(gf);
  Measured m;
  std::vector<double> fwd, bwd;
  for (int i = 0; i < 1 + iters; ++i) {
    at::Tensor q = q0.clone().requires_grad_(), k = k0.clone().requires_grad_(), v = v0.clone().requires_grad_();
    world.barrier();
    cp.reset_stats();
    alloc.mark();
    alloc.reset_peak();
    auto t0 = std::chrono::steady_clock::now();
    at::Tensor out = fsdp::cp::ring_attention(q, k, v, cp);
    auto t1 = std::chrono::steady_clock::now();
    const int64_t held = alloc.current_since_mark();
    out.backward(g);
    auto t2 = std::chrono::steady_clock::now();
    const int64_t peak = alloc.peak_since_mark();
    if (i == 0) continue;  // warm-up
    fwd.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    bwd.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
    m.peak = std::max(m.peak, peak);
    m.held = std::max(m.held, held);
    m.sent = cp.stats(fsdp::comm::CollectiveKind::kSend).bytes;
  }
  m.forward_ms = slowest(median(fwd), world);
  m.backward_ms = slowest(median(bwd), world);
  m.peak = static_cast<int64_t>(slowest(static_cast<double>(m.peak), world));
  m.held = static_cast<int64_t>(slowest(static_cast<double>(m.held), world));
  m.formula = fsdp::cp::ring_attention_bytes_per_rank(B, Hkv, q0.size(2), D, cp.size(), at::kFloat, true);
  return m;
}

double mib(int64_t b) { return static_cast<double>(b) / (1 << 20); }

}  // namespace

int main(int argc, char** argv) {
  const int64_t T = argc > 1 ? std::atoll(argv[1]) : 4096;
  const int64_t H = argc > 2 ? std::atoll(argv[2]) : 8;
  const int64_t Hkv = argc > 3 ? std::atoll(argv[3]) : 8;
  const int64_t D = argc > 4 ? std::atoll(argv[4]) : 64;
  const int iters = argc > 5 ? std::atoi(argv[5]) : 3;
  fsdp::bench::CountingAllocator::install();
  auto pg = fsdp::comm::init_process_group();
  auto& world = *pg.comm;
  const int W = world.size();
  {
    // A one-rank group per rank: (W, 1) mesh, the second dimension.
    auto mesh = fsdp::comm::DeviceMesh::create(world, {W, 1}, {"rest", "one"});
    const Measured one = measure(*mesh->group("one"), world, T, H, Hkv, D, iters);
    const Measured ring = measure(world, world, T, H, Hkv, D, iters);
    if (world.rank() == 0) {
      std::printf("ring_attention (fsdp-cpp), B=1 H=%lld Hkv=%lld D=%lld T=%lld float32, head-tail layout, "
                  "median of %d, slowest rank\n",
                  static_cast<long long>(H), static_cast<long long>(Hkv), static_cast<long long>(D),
                  static_cast<long long>(T), iters);
      std::printf("%-6s %10s %10s %14s %14s %14s %14s\n", "cp", "fwd ms", "bwd ms", "peak MiB/rank",
                  "held MiB/rank", "sent B/rank", "formula B");
      for (auto [cp, m] : {std::pair<int, Measured>{1, one}, {W, ring}}) {
        std::printf("%-6d %10.1f %10.1f %14.2f %14.2f %14lld %14lld\n", cp, m.forward_ms, m.backward_ms, mib(m.peak),
                    mib(m.held), static_cast<long long>(m.sent), static_cast<long long>(m.formula));
      }
      std::printf("ratios cp=%d / cp=1: fwd %.3f, bwd %.3f, fwd+bwd %.3f, peak %.3f, held %.3f\n", W,
                  ring.forward_ms / one.forward_ms, ring.backward_ms / one.backward_ms,
                  (ring.forward_ms + ring.backward_ms) / (one.forward_ms + one.backward_ms),
                  static_cast<double>(ring.peak) / one.peak, static_cast<double>(ring.held) / one.held);
      std::printf("bytes sent %s the closed form\n", ring.sent == ring.formula ? "equal" : "DIFFER FROM");
    }
  }
  fsdp::comm::destroy_process_group();
  return 0;
}
