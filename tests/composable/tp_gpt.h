#pragma once
// Shared by the tensor-parallel tests (tests/composable/tensor_parallel_test.cc,
// tests/checkpoint/tensor_parallel_checkpoint_test.cc): the small example GPT whose every
// dimension divides over 1-4 tp ranks, its batches, the (dp, tp) meshes of the launch's world, and
// the comparison rule for the one parameter part that no two summation orders train alike.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/utils.h>

#include "fsdp_cpp/examples/gpt_model.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace fsdp::testing::tp {

inline constexpr int64_t kVocab = 24;    // divisible by 1, 2, 3, 4
inline constexpr int64_t kContext = 12;  // divisible by 1, 2, 3, 4 (sequence parallelism)

/// The (dp, tp) meshes of the world: (W, 1), ..., (1, W).
inline std::vector<std::pair<int, int>> meshes_of_world() {
  std::vector<std::pair<int, int>> out;
  for (int tp = 1; tp <= world_size(); ++tp) {
    if (world_size() % tp == 0) out.emplace_back(world_size() / tp, tp);
  }
  return out;
}

/// Token ids [2, kContext] of step `step` for data-parallel batch `q` (`salt` tells inputs from
/// targets and one test's batches from another's).
inline at::Tensor tokens(int64_t step, int q, int salt) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(7000 * salt + 50 * step + q));
  return at::randint(kVocab, {2, kContext}, gen);
}

/// The GPT every tp size of 1-4 divides: d_model 24, 12 heads of 2, 2 blocks.
inline examples::GPT make_gpt(int64_t vocab = kVocab, uint64_t seed = 42) {
  torch::manual_seed(seed);
  return examples::GPT(examples::GPTConfig(vocab).context_length(kContext).d_model(24).n_heads(12).n_layers(2));
}

/// `a` and `b` (values of parameter `fqn`) as compared: without the key third of a qkv bias. The
/// key bias has an exactly-zero gradient (softmax ignores a per-row constant), whose rounding
/// noise AdamW normalizes into lr-sized steps that no two summation orders share.
inline std::pair<at::Tensor, at::Tensor> comparable(const std::string& fqn, at::Tensor a, at::Tensor b) {
  if (fqn.find("qkv.bias") == std::string::npos) return {a, b};
  const int64_t d = a.numel() / 3;
  return {at::cat({a.narrow(0, 0, d), a.narrow(0, 2 * d, d)}), at::cat({b.narrow(0, 0, d), b.narrow(0, 2 * d, d)})};
}

}  // namespace fsdp::testing::tp
