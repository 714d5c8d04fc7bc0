// clip_grad_norm_ across shards over MPI on every world size: the total norm and the clipped
// gradients equal torch::nn::utils::clip_grad_norm_ on the unsharded reference (gradients averaged
// over every rank's batch), for the 2-norm and the max norm, with and without clipping, sharded
// and replicated (NO_SHARD) units.
#include <limits>
#include <map>

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/utils/clip_grad.h>

#include "fsdp_cpp/composable/clip_grad_norm.h"
#include "fsdp_cpp/composable/fully_shard_internal.h"
#include "fsdp_cpp/tests/composable/parity.h"
#include "fsdp_cpp/tests/composable/test_models.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using fsdp::testing::rank;
using fsdp::testing::world;
using fsdp::testing::world_size;

at::Tensor batch(int q, int64_t cols, int salt) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(700 + 10 * salt + q));
  return at::randn({4, cols}, gen);
}

void check_clip(fsdp::ShardingStrategy strategy, double norm_type, double max_norm) {
  const int W = world_size();
  INFO("strategy " << static_cast<int>(strategy) << ", norm " << norm_type << ", max " << max_norm << ", " << W << " ranks");
  torch::manual_seed(31);
  auto model = fsdp::testing::MlpStack(6, 8, 16, 3, 3);
  torch::manual_seed(31);
  auto reference = fsdp::testing::MlpStack(6, 8, 16, 3, 3);
  auto comm = std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
  auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(comm).strategy(strategy));
  torch::nn::functional::mse_loss(model(batch(rank(), 6, 1)), batch(rank(), 3, 2)).backward();
  for (int q = 0; q < W; ++q) {
    (torch::nn::functional::mse_loss(reference(batch(q, 6, 1)), batch(q, 3, 2)) / W).backward();
  }
  const double norm = fsdp::clip_grad_norm_(units.back(), max_norm, norm_type);
  const double ref_norm = torch::nn::utils::clip_grad_norm_(reference->parameters(), max_norm, norm_type);
  CHECK(norm == Approx(ref_norm).epsilon(1e-5));
  const auto ref_params = reference->named_parameters();
  std::map<const void*, std::pair<const fsdp::FlatParamHandle*, int>> where;
  for (const auto& u : units) {
    for (const auto& h : fsdp::detail::handles_of(u)) {
      for (size_t i = 0; i < h->params().size(); ++i) where[h->params()[i].param.unsafeGetTensorImpl()] = {h.get(), static_cast<int>(i)};
    }
  }
  for (const auto& item : model->named_parameters()) {
    INFO(item.key());
    const auto [handle, index] = where.at(item.value().unsafeGetTensorImpl());
    const auto slice = handle->layout().slice_of(index, handle->is_sharded_strategy() ? rank() : 0);
    const at::Tensor expected = ref_params[item.key()].grad().reshape({-1}).narrow(0, slice.param_begin, slice.size());
    CHECK(at::allclose(item.value().grad().reshape({-1}), expected, 1e-5, 1e-7));
  }
}

}  // namespace

FSDP_RANKS_TEST_CASE("clip_grad_norm_ equals the unsharded model's, sharded units", "[clip_grad_norm]") {
  for (double norm_type : {2.0, 1.0, std::numeric_limits<double>::infinity()}) {
    check_clip(fsdp::ShardingStrategy::kFullShard, norm_type, 0.05);  // clips
    check_clip(fsdp::ShardingStrategy::kFullShard, norm_type, 1e6);   // does not
  }
}

FSDP_RANKS_TEST_CASE("clip_grad_norm_ equals the unsharded model's, replicated units", "[clip_grad_norm]") {
  check_clip(fsdp::ShardingStrategy::kNoShard, 2.0, 0.05);
  check_clip(fsdp::ShardingStrategy::kNoShard, std::numeric_limits<double>::infinity(), 0.05);
  check_clip(fsdp::ShardingStrategy::kShardGradOp, 2.0, 0.05);
}
