// Step time of fsdp::optim::Muon on a fully_shard model (tools/muon_benchmark.sh runs it on 2 ranks,
// beside tools/bench/muon_bench_torch.py for torch.optim.Muon unsharded on the same shapes).
//
// The matrices of a transformer's blocks (per layer: q, k, v, o [d, d], the MLP's up [4d, d] and down
// [d, 4d]; bias-free Linears, a fully_shard unit per layer and the root), with fixed random
// gradients written into the shards, timed over --steps steps after --warmup, in three ways:
//   owners:     fsdp::optim::Muon (each matrix orthogonalized by one owner rank, 3 collectives);
//   every_rank: every rank assembles and orthogonalizes every matrix (MuonDistribution::kEveryRank);
//   local:      Muon on an unsharded copy, on one rank alone (run it in a launch of its own: the other
//               ranks would wait in a busy-polling barrier meanwhile and take a core from it).
// Prints one line per way (median step ms, the slowest rank's; exchange and Newton-Schulz ms; bytes
// sent per rank) and, with --out, JSON.
//
//   mpirun -np 2 muon_bench [--d-model 256] [--layers 2] [--steps 5] [--warmup 1] [--out PATH.json]
//                           [--ways owners,every_rank,local]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/contract/hookable_module_list.h"
#include "fsdp_cpp/contract/hookable_modules.h"
#include "fsdp_cpp/optim/muon.h"

namespace {

struct LayerImpl : torch::nn::Module {
  explicit LayerImpl(int64_t d) {
    auto linear = [&](const char* name, int64_t in, int64_t out) {
      return register_module(name, fsdp::contract::Linear(torch::nn::LinearOptions(in, out).bias(false)));
    };
    q = linear("q", d, d);
    k = linear("k", d, d);
    v = linear("v", d, d);
    o = linear("o", d, d);
    up = linear("up", d, 4 * d);
    down = linear("down", 4 * d, d);
  }
  at::Tensor forward(at::Tensor x) { return down(up(o(q(x) + k(x) + v(x)))); }
  fsdp::contract::Linear q{nullptr}, k{nullptr}, v{nullptr}, o{nullptr}, up{nullptr}, down{nullptr};
};
FSDP_HOOKABLE_MODULE(Layer);

struct StackImpl : torch::nn::Module {
  StackImpl(int64_t d, int64_t layers) {
    blocks = register_module("blocks", fsdp::contract::ModuleList());
    for (int64_t i = 0; i < layers; ++i) blocks->push_back(Layer(d));
  }
  at::Tensor forward(at::Tensor x) {
    for (const auto& b : *blocks) x = b.forward<at::Tensor>(x);
    return x;
  }
  fsdp::contract::ModuleList blocks{nullptr};
};
FSDP_HOOKABLE_MODULE(Stack);

// Fixed random gradients of the parameters' current (sharded or whole) shapes: Muon's time does not
// depend on their values.
void set_gradients(Stack& stack, int rank) {
  int64_t seed = 1000 * rank;
  for (auto& p : stack->parameters()) {
    torch::manual_seed(++seed);
    p.mutable_grad() = torch::randn(p.sizes());
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int64_t d = 256, layers = 2;
  int steps = 5, warmup = 1;
  std::string out, which = "owners,every_rank,local";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "muon_bench: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--d-model") d = std::stoll(next());
    else if (a == "--layers") layers = std::stoll(next());
    else if (a == "--steps") steps = std::stoi(next());
    else if (a == "--warmup") warmup = std::stoi(next());
    else if (a == "--out") out = next();
    else if (a == "--ways") which = next();
    else {
      std::fprintf(stderr, "usage: mpirun -np 2 muon_bench [--d-model N] [--layers N] [--steps N] [--warmup N] [--out PATH]\n");
      return 2;
    }
  }
  auto pg = fsdp::comm::init_process_group();
  const auto& comm = pg.comm;
  const int rank = comm->rank(), world = comm->size();
  at::set_num_threads(1);
  at::NoGradGuard no_grad;

  struct Way {
    std::string name;
    double step_ms = 0, exchange_ms = 0, newton_schulz_ms = 0;
    int64_t bytes_sent = 0, collectives = 0;
  };
  std::vector<Way> ways;
  // Times `muon.step()` (the slowest rank's, median over the steps).
  auto time_steps = [&](fsdp::optim::Muon& muon, const std::string& name, bool collective) {
    std::vector<double> times, exchange, ns;
    for (int s = 0; s < warmup + steps; ++s) {
      if (collective) comm->barrier();
      const auto t0 = std::chrono::steady_clock::now();
      muon.step();
      double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (collective) {
        at::Tensor slowest = at::full({1}, ms, at::kDouble);
        comm->all_reduce(slowest, c10d::ReduceOp::MAX).wait();
        ms = slowest.item<double>();
      }
      if (s < warmup) continue;
      times.push_back(ms);
      exchange.push_back(muon.last_step().exchange_seconds * 1e3);
      ns.push_back(muon.last_step().newton_schulz_seconds * 1e3);
    }
    ways.push_back(Way{name, median(times), median(exchange), median(ns), muon.last_step().bytes_sent,
                       muon.last_step().collectives});
  };

  which = "," + which + ",";
  auto wanted = [&](const char* name) { return which.find("," + std::string(name) + ",") != std::string::npos; };
  for (auto distribution : {fsdp::optim::MuonDistribution::kOwners, fsdp::optim::MuonDistribution::kEveryRank}) {
    const bool owners = distribution == fsdp::optim::MuonDistribution::kOwners;
    if (!wanted(owners ? "owners" : "every_rank")) continue;
    torch::manual_seed(0);
    Stack stack(d, layers);
    for (const auto& b : *stack->blocks) fsdp::fully_shard(*b.ptr());
    fsdp::fully_shard(*stack);
    set_gradients(stack, rank);
    fsdp::optim::Muon muon(*stack, stack->parameters(), fsdp::optim::MuonOptions(0.02), comm, distribution);
    time_steps(muon, owners ? "owners" : "every_rank", true);
  }
  if (rank == 0 && wanted("local")) {
    torch::manual_seed(0);
    Stack stack(d, layers);
    set_gradients(stack, 0);
    fsdp::optim::Muon muon(*stack, stack->parameters(), fsdp::optim::MuonOptions(0.02));
    time_steps(muon, "local", false);
  }
  comm->barrier();

  if (rank == 0) {
    const int64_t matrices = 6 * layers;
    std::printf("muon_bench: W=%d, %lld matrices (d_model %lld, %lld layers), %d steps after %d warm-up, 1 thread\n",
                world, static_cast<long long>(matrices), static_cast<long long>(d), static_cast<long long>(layers),
                steps, warmup);
    for (const auto& w : ways) {
      std::printf("  %-10s step %9.2f ms  (exchange %8.2f ms, Newton-Schulz %9.2f ms)  %lld collectives, %lld bytes sent\n",
                  w.name.c_str(), w.step_ms, w.exchange_ms, w.newton_schulz_ms, static_cast<long long>(w.collectives),
                  static_cast<long long>(w.bytes_sent));
    }
    if (!out.empty()) {
      std::ofstream f(out);
      f << "{\"world\": " << world << ", \"d_model\": " << d << ", \"layers\": " << layers
        << ", \"steps\": " << steps << ", \"ways\": {";
      for (size_t i = 0; i < ways.size(); ++i) {
        const auto& w = ways[i];
        f << (i ? ", " : "") << "\"" << w.name << "\": {\"step_ms\": " << w.step_ms
          << ", \"exchange_ms\": " << w.exchange_ms << ", \"newton_schulz_ms\": " << w.newton_schulz_ms
          << ", \"collectives\": " << w.collectives << ", \"bytes_sent\": " << w.bytes_sent << "}";
      }
      f << "}}\n";
    }
  }
  fsdp::comm::destroy_process_group();
  return 0;
}
