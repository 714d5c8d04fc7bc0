// FSDPModule::set_is_last_backward ([Note: backward passes within an iteration] in
// fsdp/backward.cc), over MPI on every world size: microbatches whose forwards and backwards
// interleave as a 1F1B pipeline stage runs them (F0 F1 B0 F2 B1 F3 B2 B3) train like the unsharded
// model on the whole batch; without the control the backward through an earlier forward's graph
// is refused naming it; a rank that sets it differently is refused on every rank.
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/optim/sgd.h>

#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/summon_full_params.h"
#include "fsdp_cpp/tests/composable/test_models.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::testing::MlpStack;

MlpStack make_model() {
  torch::manual_seed(5);
  return MlpStack(/*in_dim=*/6, /*dim=*/8, /*hidden=*/12, /*depth=*/3, /*out_dim=*/4);
}

// Microbatch k of step `step` on rank q: 2 rows.
std::pair<at::Tensor, at::Tensor> microbatch(int step, int q, int k) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * step + 10 * q + k);
  return {at::randn({2, 6}, gen), at::randn({2, 4}, gen)};
}

at::Tensor loss_of(const at::Tensor& out, const at::Tensor& y) { return (out - y).pow(2).mean(); }

std::vector<fsdp::FSDPModule> shard(MlpStack& model, const std::shared_ptr<fsdp::comm::Communicator>& comm) {
  const auto opts = fsdp::FullyShardOptions().communicator(comm);
  std::vector<fsdp::FSDPModule> units;
  for (size_t i = 0; i < model->blocks->size(); ++i) units.push_back(fsdp::fully_shard(model->block(i), opts));
  units.push_back(fsdp::fully_shard(model, opts));
  return units;
}

}  // namespace

FSDP_RANKS_TEST_CASE("1F1B-interleaved microbatches with set_is_last_backward train like the whole batch", "[is_last_backward]") {
  const int w = fsdp::testing::world_size(), q = fsdp::testing::rank();
  auto comm = fsdp::testing::fresh_comm();
  MlpStack model = make_model();
  MlpStack reference = make_model();
  auto units = shard(model, comm);
  fsdp::FSDPModule root = units.back();
  torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD ref_optim(reference->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  constexpr int kMicrobatches = 4;
  for (int step = 0; step < 3; ++step) {
    // 1F1B on a stage with one warm-up forward: F0 F1 B0 F2 B1 F3 B2 B3, each backward on loss / m.
    std::vector<at::Tensor> losses(kMicrobatches);
    auto forward = [&](int k) {
      const auto [x, y] = microbatch(step, q, k);
      losses[k] = loss_of(model(x), y) / kMicrobatches;
    };
    auto backward = [&](int k) {
      root.set_is_last_backward(k == kMicrobatches - 1);
      losses[k].backward();
      losses[k] = at::Tensor();
    };
    forward(0);
    for (int k = 1; k < kMicrobatches; ++k) {
      forward(k);
      backward(k - 1);
    }
    backward(kMicrobatches - 1);
    CHECK(root.is_last_backward());
    // The reference: every rank's microbatches at once, the mean over ranks.
    at::Tensor ref_loss;
    for (int r = 0; r < w; ++r) {
      for (int k = 0; k < kMicrobatches; ++k) {
        const auto [x, y] = microbatch(step, r, k);
        const auto l = loss_of(reference(x), y) / (kMicrobatches * w);
        ref_loss = ref_loss.defined() ? ref_loss + l : l;
      }
    }
    ref_loss.backward();
    optim.step();
    optim.zero_grad();
    ref_optim.step();
    ref_optim.zero_grad();
  }
  fsdp::SummonFullParams full(root);
  const auto ref_params = reference->named_parameters();
  for (const auto& item : model->named_parameters()) {
    INFO(item.key());
    CHECK(at::allclose(item.value(), *ref_params.find(item.key()), 1e-5, 1e-6));
  }
}

FSDP_RANKS_TEST_CASE("without set_is_last_backward(false) a backward through an earlier forward's graph is refused", "[is_last_backward]") {
  if (fsdp::testing::world_size() == 1) return;  // one rank: nothing is sharded, every graph stays valid
  auto comm = fsdp::testing::fresh_comm();
  MlpStack model = make_model();
  shard(model, comm);
  const auto [x0, y0] = microbatch(0, fsdp::testing::rank(), 0);
  const auto [x1, y1] = microbatch(0, fsdp::testing::rank(), 1);
  auto l0 = loss_of(model(x0), y0);
  auto l1 = loss_of(model(x1), y1);
  l0.backward();
  auto l2 = loss_of(model(x0), y0);   // a new iteration begins
  const std::string e = fsdp::testing::error_of([&] { l1.backward(); });
  CHECK_THAT(e, Contains("graph of an earlier iteration") && Contains("set_is_last_backward(false)"));
  CHECK(fsdp::testing::same_on_every_rank(e));
}

FSDP_RANKS_TEST_CASE("set_is_last_backward set on some ranks only is refused on every rank", "[is_last_backward]") {
  if (fsdp::testing::world_size() == 1) return;  // nothing to compare
  auto comm = fsdp::testing::fresh_comm();
  MlpStack model = make_model();
  auto units = shard(model, comm);
  const auto [x, y] = microbatch(0, fsdp::testing::rank(), 0);
  units.back().set_is_last_backward(fsdp::testing::rank() != 0);
  auto l = loss_of(model(x), y);
  const std::string e = fsdp::testing::error_of([&] { l.backward(); });
  CHECK_THAT(e, Contains("the ranks set different controls") && Contains("is_last_backward"));
}
