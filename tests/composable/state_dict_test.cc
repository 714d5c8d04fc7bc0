// Full state dicts over MPI on every world size: saving a trained sharded model gives the
// unsharded reference's parameters and buffers under the same keys (rank 0 only by default);
// loading a full state dict into a freshly initialised sharded model (any strategy, mixed
// precision too) makes it compute exactly what the source computes; bad state dicts are clear
// errors that leave the model unchanged.
#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include "composable/state_dict.h"
#include "tests/composable/parity.h"
#include "tests/composable/test_models.h"
#include "tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::testing::rank;
using fsdp::testing::world;
using fsdp::testing::world_size;

std::shared_ptr<fsdp::comm::Communicator> fresh_comm() {
  return std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
}

torch::OrderedDict<std::string, at::Tensor> unsharded_state(torch::nn::Module& m) {
  torch::OrderedDict<std::string, at::Tensor> state;
  for (const auto& item : m.named_parameters()) state.insert(item.key(), item.value().detach().clone());
  for (const auto& item : m.named_buffers()) state.insert(item.key(), item.value().detach().clone());
  return state;
}

}  // namespace

FSDP_RANKS_TEST_CASE("full_state_dict of a trained sharded model equals the unsharded reference's", "[state_dict]") {
  const int W = world_size();
  torch::manual_seed(41);
  auto model = fsdp::testing::MlpStack(6, 8, 16, 3, 3);
  torch::manual_seed(41);
  auto reference = fsdp::testing::MlpStack(6, 8, 16, 3, 3);
  auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(1e-2));
  for (int it = 0; it < 3; ++it) {
    auto gen = [&](int q, int salt) {
      auto g = at::detail::createCPUGenerator(static_cast<uint64_t>(100 * it + 10 * q + salt));
      return at::randn({4, salt == 1 ? 6 : 3}, g);
    };
    torch::nn::functional::mse_loss(model(gen(rank(), 1)), gen(rank(), 2)).backward();
    opt.step();
    opt.zero_grad();
    for (int q = 0; q < W; ++q) (torch::nn::functional::mse_loss(reference(gen(q, 1)), gen(q, 2)) / W).backward();
    ref_opt.step();
    ref_opt.zero_grad();
  }
  const auto state = fsdp::full_state_dict(units.back());
  if (rank() != 0) {
    CHECK(state.is_empty());
  } else {
    const auto expected = unsharded_state(*reference);
    REQUIRE(state.keys() == expected.keys());
    for (const auto& item : expected) {
      INFO(item.key());
      CHECK((W == 1 ? state[item.key()].equal(item.value()) : at::allclose(state[item.key()], item.value(), 1e-5, 1e-6)));
    }
  }
  for (const auto& u : units) {
    for (const auto& h : u.handles()) CHECK(h->unsharded_bytes() == 0);
  }
  const auto everywhere = fsdp::full_state_dict(units.back(), fsdp::FullStateDictOptions().rank0_only(false));
  CHECK(everywhere.size() == unsharded_state(*reference).size());
}

FSDP_RANKS_TEST_CASE("load_full_state_dict makes a fresh sharded model compute like the source", "[state_dict]") {
  torch::manual_seed(42);
  auto source = fsdp::testing::MlpStack(6, 8, 16, 3, 3);
  const auto state = unsharded_state(*source);
  for (auto strategy : {fsdp::ShardingStrategy::kFullShard, fsdp::ShardingStrategy::kShardGradOp,
                        fsdp::ShardingStrategy::kNoShard}) {
    INFO("strategy " << static_cast<int>(strategy));
    torch::manual_seed(1000 + rank());  // a different initialisation on every rank
    auto model = fsdp::testing::MlpStack(6, 8, 16, 3, 3);
    auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(fresh_comm()).strategy(strategy));
    fsdp::load_full_state_dict(units.back(), state);
    const at::Tensor x = at::randn({5, 6});
    CHECK(at::allclose(model(x), source(x), 1e-6, 1e-6));
    const auto round_trip = fsdp::full_state_dict(units.back(), fsdp::FullStateDictOptions().rank0_only(false));
    for (const auto& item : state) CHECK(round_trip[item.key()].equal(item.value()));
  }
}

FSDP_RANKS_TEST_CASE("a bad state dict is a clear error and changes nothing", "[state_dict]") {
  torch::manual_seed(43);
  auto model = fsdp::testing::MlpStack(6, 8, 16, 2, 3);
  auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
  const auto before = fsdp::full_state_dict(units.back(), fsdp::FullStateDictOptions().rank0_only(false));
  auto missing = before;
  missing.erase("head.bias");
  CHECK_THROWS_WITH(fsdp::load_full_state_dict(units.back(), missing), Contains("missing key 'head.bias'"));
  auto wrong = before;
  wrong["blocks.0.fc1.weight"] = at::zeros({3, 3});
  CHECK_THROWS_WITH(fsdp::load_full_state_dict(units.back(), wrong),
                    Contains("'blocks.0.fc1.weight' has shape [3, 3]") && Contains("[16, 8]"));
  auto extra = before;
  extra.insert("unknown.weight", at::zeros({1}));
  CHECK_THROWS_WITH(fsdp::load_full_state_dict(units.back(), extra), Contains("extra keys"));
  const auto after = fsdp::full_state_dict(units.back(), fsdp::FullStateDictOptions().rank0_only(false));
  for (const auto& item : before) CHECK(after[item.key()].equal(item.value()));
}

FSDP_RANKS_TEST_CASE("full_state_dict holds full-precision values under mixed precision", "[state_dict]") {
  torch::manual_seed(44);
  auto model = fsdp::testing::MlpStack(6, 8, 16, 2, 3);
  torch::manual_seed(44);
  auto reference = fsdp::testing::MlpStack(6, 8, 16, 2, 3);
  auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(fresh_comm()).mixed_precision(
                                                     fsdp::MixedPrecision().param_dtype(at::kBFloat16)));
  const auto state = fsdp::full_state_dict(units.back(), fsdp::FullStateDictOptions().rank0_only(false));
  for (const auto& item : reference->named_parameters()) {
    INFO(item.key());
    CHECK(state[item.key()].scalar_type() == at::kFloat);
    CHECK(state[item.key()].equal(item.value()));
  }
}
