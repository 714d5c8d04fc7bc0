// The GPU checks in one program (tools/gpu_check.sh runs it): NCCL through LibTorch's
// ProcessGroupNCCL at world size 1, the example's GPT trained with fully_shard on cuda:0 against
// the same model trained unsharded on cuda:0 (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, bf16 mixed
// precision, CPU offload), with step time and peak CUDA memory per configuration. Where no CUDA
// device is visible it says so and exits 0.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/optim/adamw.h>

#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/comm/nccl_backend.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/examples/gpt_model.h"
#include "fsdp_cpp/fsdp/device_streams.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Config {
  std::string name;
  fsdp::FullyShardOptions options;
  double rtol;
};

struct Result {
  double first_loss = 0, last_loss = 0, step_ms = 0;
  int64_t peak_bytes = 0;
};

at::Tensor tokens(int64_t step, int salt, int64_t vocab, at::Device device) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(1000 * salt + step));
  return at::randint(vocab, {8, 64}, gen).to(device);
}

Result train(bool sharded, const fsdp::FullyShardOptions& options, at::Device device, int steps) {
  const auto config = fsdp::examples::GPTConfig(65).context_length(64).d_model(256).n_heads(8).n_layers(4);
  torch::manual_seed(0);
  fsdp::examples::GPT model(config);
  if (sharded) {
    for (auto& block : model->block_list()) fsdp::fully_shard(block, options);
    fsdp::fully_shard(model, options);
  } else {
    model->to(device);
  }
  torch::optim::AdamW optim(model->parameters(), torch::optim::AdamWOptions(1e-3));
  c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
  Result r;
  std::vector<double> times;
  for (int64_t step = 0; step < steps; ++step) {
    c10::cuda::device_synchronize();
    const auto t0 = Clock::now();
    at::Tensor loss = fsdp::examples::next_token_loss(model(tokens(step, 1, 65, device)), tokens(step, 2, 65, device));
    loss.backward();
    optim.step();
    optim.zero_grad();
    c10::cuda::device_synchronize();
    times.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    if (step == 0) r.first_loss = loss.item<double>();
    r.last_loss = loss.item<double>();
  }
  std::sort(times.begin() + 1, times.end());
  r.step_ms = times[1 + (times.size() - 1) / 2];
  r.peak_bytes = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index())
                     .allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)]
                     .peak;
  return r;
}

}  // namespace

int main() {
  if (!fsdp::comm::cuda_device_available()) {
    std::printf("gpu_check: no CUDA device visible: the GPU checks were not run\n");
    return 0;
  }
  const at::Device device(at::kCUDA, 0);
  fsdp::comm::InitOptions init;
  init.device = device;
  auto pg = fsdp::comm::init_process_group(init);
  std::printf("gpu_check: %s, backend %s, CUDA streams %s\n", device.str().c_str(),
              pg.comm->backend()->getBackendName().c_str(),
              fsdp::device_streams_for(device)->asynchronous() ? "on (unshard + reduce-scatter)" : "OFF");
  const int steps = 12;
  const auto base = fsdp::FullyShardOptions().device(device);
  std::vector<Config> configs = {
      {"FULL_SHARD", base, 1e-4},
      {"SHARD_GRAD_OP", fsdp::FullyShardOptions(base).strategy(fsdp::ShardingStrategy::kShardGradOp), 1e-4},
      {"NO_SHARD", fsdp::FullyShardOptions(base).strategy(fsdp::ShardingStrategy::kNoShard), 1e-4},
      {"FULL_SHARD + CPU offload", fsdp::FullyShardOptions(base).offload_to_cpu(true), 1e-4},
      {"FULL_SHARD + bf16 mixed precision", fsdp::FullyShardOptions(base).mixed_precision(
           fsdp::MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat)), 3e-2},
      {"FULL_SHARD + bf16 + offload", fsdp::FullyShardOptions(base).offload_to_cpu(true).mixed_precision(
           fsdp::MixedPrecision().param_dtype(at::kBFloat16)), 3e-2},
  };
  const Result reference = train(false, base, device, steps);
  std::printf("\n%-36s %10s %10s %10s %14s  %s\n", "configuration", "loss 1", "loss 12", "step ms", "peak CUDA B", "parity");
  std::printf("%-36s %10.5f %10.5f %10.2f %14lld  %s\n", "unsharded reference", reference.first_loss,
              reference.last_loss, reference.step_ms, static_cast<long long>(reference.peak_bytes), "-");
  int failures = 0;
  for (const auto& c : configs) {
    const Result r = train(true, c.options, device, steps);
    const bool ok = std::abs(r.first_loss - reference.first_loss) <= c.rtol * std::abs(reference.first_loss) &&
                    std::abs(r.last_loss - reference.last_loss) <= c.rtol * std::abs(reference.last_loss) * 10;
    failures += ok ? 0 : 1;
    std::printf("%-36s %10.5f %10.5f %10.2f %14lld  %s\n", c.name.c_str(), r.first_loss, r.last_loss,
                r.step_ms, static_cast<long long>(r.peak_bytes), ok ? "ok" : "MISMATCH");
  }
  std::printf("\n%d passed, %d failed\n", static_cast<int>(configs.size()) - failures, failures);
  return failures == 0 ? 0 : 1;
}
