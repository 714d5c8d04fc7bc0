// A program of another Bazel workspace using the library (see examples/consumer/WORKSPACE): trains
// a two-layer MLP with fully_shard on each linear layer and on the root, under mpirun or alone,
// and checks every step's loss against an unsharded LibTorch copy of the model that sees every
// rank's batch (the mean of the ranks' losses, DDP semantics). Exits 1 on any mismatch.
//
//   bazel build //:train_tiny && mpirun --oversubscribe -np 2 bazel-bin/train_tiny

#include <cmath>
#include <cstdio>
#include <exception>
#include <vector>

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/contract/hookable_modules.h"
#include "fsdp_cpp/contract/hookable_sequential.h"

namespace {

constexpr int64_t kIn = 8, kHidden = 16, kOut = 4, kBatch = 4;
constexpr int kSteps = 6;
constexpr double kLr = 0.1;

// Rank q's batch of step s: the same numbers on every rank, whoever computes them.
std::pair<torch::Tensor, torch::Tensor> batch(int step, int q) {
  torch::manual_seed(1000 * step + q);
  torch::Tensor x = torch::randn({kBatch, kIn});
  return {x, torch::randn({kBatch, kOut})};
}

int run(const fsdp::comm::ProcessGroup& group) {
  const int rank = group.comm->rank(), world = group.comm->size();

  torch::manual_seed(0);
  fsdp::contract::Sequential model(fsdp::contract::Linear(kIn, kHidden), torch::nn::ReLU(),
                                   fsdp::contract::Linear(kHidden, kOut));
  // The reference: LibTorch's own modules with the same parameters (same FQNs: 0.*, 2.*).
  torch::nn::Sequential reference(torch::nn::Linear(kIn, kHidden), torch::nn::ReLU(),
                                  torch::nn::Linear(kHidden, kOut));
  {
    torch::NoGradGuard no_grad;
    auto source = model->named_parameters();
    for (auto& item : reference->named_parameters()) item.value().copy_(source[item.key()]);
  }

  fsdp::fully_shard(model[0].as<fsdp::contract::Linear>());
  fsdp::fully_shard(model[2].as<fsdp::contract::Linear>());
  fsdp::fully_shard(model);
  torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(kLr));
  torch::optim::SGD reference_optim(reference->parameters(), torch::optim::SGDOptions(kLr));

  int mismatches = 0;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step, rank);
    torch::Tensor loss = torch::nn::functional::mse_loss(model(x), y);
    loss.backward();
    optim.step();
    optim.zero_grad();

    std::vector<torch::Tensor> losses;
    for (int q = 0; q < world; ++q) {
      auto [xq, yq] = batch(step, q);
      losses.push_back(torch::nn::functional::mse_loss(reference->forward(xq), yq));
    }
    torch::stack(losses).mean().backward();
    reference_optim.step();
    reference_optim.zero_grad();

    const double got = loss.item<double>(), expected = losses[rank].item<double>();
    const bool ok = std::abs(got - expected) <= 1e-6 + 1e-5 * std::abs(expected);
    mismatches += ok ? 0 : 1;
    if (!ok || rank == 0) {
      std::printf("rank %d step %d: loss %.6f, unsharded reference %.6f%s\n", rank, step, got,
                  expected, ok ? "" : "  MISMATCH");
    }
  }
  if (rank == 0) {
    std::printf("train_tiny: %d steps of fully_shard on %d rank(s): %s\n", kSteps, world,
                mismatches == 0 ? "losses match the unsharded reference" : "MISMATCH");
  }
  return mismatches == 0 ? 0 : 1;
}

}  // namespace

int main() {
  try {
    fsdp::comm::ProcessGroup group = fsdp::comm::init_process_group();
    return run(group);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_tiny: %s\n", e.what());
  }
  return 1;
}
