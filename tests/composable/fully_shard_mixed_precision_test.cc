// Mixed precision over MPI on every world size: parity against an unsharded reference that
// performs the same casts (computes with low-precision copies of its fp32 parameters, reduces the
// per-rank low-precision gradients in the reduce dtype, steps in fp32), the collective byte
// counters in the communication dtype, fp32 gradients after sync, buffers and forward inputs.
#include <map>
#include <memory>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/fully_shard_internal.h"
#include "fsdp_cpp/tests/composable/parity.h"
#include "fsdp_cpp/tests/composable/test_models.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using fsdp::comm::CollectiveKind;
using fsdp::testing::rank;
using fsdp::testing::world;
using fsdp::testing::world_size;

at::Tensor data(int64_t it, int q, int64_t cols, int salt) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(9000 * salt + 30 * it + q));
  return at::randn({4, cols}, gen);
}

// One reference step: every rank's batch with low-precision copies of the fp32 parameters; the
// low-precision gradients summed over ranks in `reduce`, divided by W, stepped in fp32.
at::Tensor reference_step(fsdp::testing::MlpStack& model, torch::optim::Optimizer& opt, int64_t it,
                          at::ScalarType param_dtype, at::ScalarType reduce) {
  const int W = world_size();
  std::vector<at::Tensor> params = model->parameters();
  std::vector<at::Tensor> masters, sums;
  for (auto& p : params) {
    masters.push_back(p.detach().clone());
    sums.push_back(at::zeros(p.sizes(), p.options().dtype(reduce)));
  }
  at::Tensor my_loss;
  for (int q = 0; q < W; ++q) {
    for (size_t i = 0; i < params.size(); ++i) params[i].set_data(masters[i].to(param_dtype));
    at::Tensor loss = torch::nn::functional::mse_loss(model(data(it, q, 6, 1).to(param_dtype)).to(at::kFloat),
                                                      data(it, q, 3, 2));
    loss.backward();
    for (size_t i = 0; i < params.size(); ++i) {
      sums[i].add_(params[i].grad().to(reduce));
      params[i].mutable_grad() = at::Tensor();
    }
    if (q == rank()) my_loss = loss.detach();
  }
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].set_data(masters[i]);
    params[i].mutable_grad() = sums[i].to(at::kFloat) / W;
  }
  opt.step();
  opt.zero_grad();
  return my_loss;
}

void run_mixed_precision_parity(at::ScalarType param_dtype, at::ScalarType reduce, double rtol, double atol) {
  const int W = world_size();
  INFO("param_dtype " << param_dtype << ", reduce_dtype " << reduce << ", " << W << " ranks");
  torch::manual_seed(11);
  auto model = fsdp::testing::MlpStack(6, 8, 16, 2, 3);
  torch::manual_seed(11);
  auto reference = fsdp::testing::MlpStack(6, 8, 16, 2, 3);
  auto comm = std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
  auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(comm).mixed_precision(
                                      fsdp::MixedPrecision().param_dtype(param_dtype).reduce_dtype(reduce)));
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(1e-2));
  const bool exact = W == 1 && c10::elementSize(reduce) == 4;
  for (int64_t it = 0; it < 4; ++it) {
    comm->reset_stats();
    at::Tensor out = model(data(it, rank(), 6, 1));
    CHECK(out.scalar_type() == param_dtype);  // computed in the low precision
    at::Tensor loss = torch::nn::functional::mse_loss(out.to(at::kFloat), data(it, rank(), 3, 2));
    loss.backward();
    // All-gathers and reduce-scatters carry the low-precision dtypes.
    int64_t ag_bytes = 0, rs_bytes = 0;
    for (size_t u = 0; u < units.size(); ++u) {
      const auto& h = fsdp::detail::handles_of(units[u])[0];
      const int64_t calls = u + 1 == units.size() ? 1 : 2;
      ag_bytes += calls * h->layout().padded_numel * static_cast<int64_t>(c10::elementSize(param_dtype));
      rs_bytes += h->layout().padded_numel * static_cast<int64_t>(c10::elementSize(reduce));
      CHECK(h->compute_dtype() == param_dtype);
      // fp32 gradients after sync, and fp32 shards.
      for (const auto& p : h->params()) {
        CHECK(p.param.scalar_type() == at::kFloat);
        REQUIRE(p.param.grad().defined());
        CHECK(p.param.grad().scalar_type() == at::kFloat);
      }
    }
    // One rank communicates nothing (the casts are local copies).
    CHECK(comm->stats(CollectiveKind::kAllGather).bytes == (W > 1 ? ag_bytes : 0));
    CHECK(comm->stats(CollectiveKind::kReduceScatter).bytes == (W > 1 ? rs_bytes : 0));
    opt.step();
    opt.zero_grad();
    at::Tensor ref_loss = reference_step(reference, ref_opt, it, param_dtype, reduce);
    INFO("iteration " << it << ": loss " << loss.item<double>() << ", reference " << ref_loss.item<double>());
    CHECK((exact ? loss.equal(ref_loss) : at::allclose(loss, ref_loss, rtol, atol)));
  }
  for (auto& u : units) u.unshard();
  const auto ref_params = reference->named_parameters();
  for (const auto& item : model->named_parameters()) {
    INFO("parameter " << item.key());
    // Unsharded for compute: the low-precision copy of the fp32 shard.
    const at::Tensor expected = ref_params[item.key()].detach().to(param_dtype);
    CHECK((exact ? item.value().equal(expected) : at::allclose(item.value().to(at::kFloat), expected.to(at::kFloat), rtol, atol)));
  }
  for (auto& u : units) u.reshard();
}

struct AssertInputDtypeImpl : torch::nn::Module {
  AssertInputDtypeImpl() { fc = register_module("fc", fsdp::contract::Linear(4, 4)); }
  torch::Tensor forward(torch::Tensor x) {
    seen = x.scalar_type();
    return fc(x);
  }
  fsdp::contract::Linear fc{nullptr};
  at::ScalarType seen = at::kFloat;
};
FSDP_HOOKABLE_MODULE(AssertInputDtype);

}  // namespace

FSDP_RANKS_TEST_CASE("mixed precision bf16 compute, fp32 reduction: parity with the same casts", "[mixed_precision]") {
  run_mixed_precision_parity(at::kBFloat16, at::kFloat, 1e-5, 1e-6);
}

FSDP_RANKS_TEST_CASE("mixed precision bf16 compute and bf16 reduction", "[mixed_precision]") {
  // The reduction itself rounds to bf16 (8 bits of mantissa) in an order the reference cannot
  // reproduce: compared at bf16 resolution.
  run_mixed_precision_parity(at::kBFloat16, at::kBFloat16, 2e-2, 2e-2);
}

FSDP_RANKS_TEST_CASE("mixed precision fp16 compute and fp16 reduction", "[mixed_precision]") {
  run_mixed_precision_parity(at::kHalf, at::kHalf, 5e-3, 5e-3);
}

FSDP_RANKS_TEST_CASE("mixed precision casts forward inputs and buffers", "[mixed_precision]") {
  torch::manual_seed(12);
  auto model = AssertInputDtype();
  auto buffered = fsdp::testing::WithBuffer(4);
  auto comm = std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
  const auto mp = fsdp::MixedPrecision().param_dtype(at::kBFloat16).buffer_dtype(at::kBFloat16);
  fsdp::fully_shard(model, fsdp::FullyShardOptions().communicator(comm).mixed_precision(mp));
  fsdp::fully_shard(buffered, fsdp::FullyShardOptions().communicator(comm).mixed_precision(mp));
  model(at::randn({2, 4})).sum().backward();
  CHECK(model->seen == at::kBFloat16);
  CHECK(buffered->running.scalar_type() == at::kBFloat16);
  CHECK(buffered(at::randn({2, 4})).scalar_type() == at::kBFloat16);

  auto kept = AssertInputDtype();
  fsdp::fully_shard(kept, fsdp::FullyShardOptions().communicator(comm).mixed_precision(
                              fsdp::MixedPrecision().param_dtype(at::kBFloat16).cast_forward_inputs(false)));
  CHECK_THROWS(kept(at::randn({2, 4})));  // fp32 input, bf16 weights: the caller must cast
  CHECK(kept->seen == at::kFloat);
  kept(at::randn({2, 4}).to(at::kBFloat16)).sum().backward();
  CHECK(kept->fc->weight.grad().scalar_type() == at::kFloat);
}

FSDP_RANKS_TEST_CASE("mixed precision: gradients accumulate without sync in the reduce dtype", "[mixed_precision]") {
  torch::manual_seed(13);
  auto model = fsdp::testing::MlpStack(6, 8, 16, 2, 3);
  auto comm = std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
  auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(comm).mixed_precision(
                                      fsdp::MixedPrecision().param_dtype(at::kBFloat16)));
  units.back().set_requires_gradient_sync(false);
  model(at::randn({3, 6})).to(at::kFloat).pow(2).mean().backward();
  for (const auto& u : units) {
    const auto& h = fsdp::detail::handles_of(u)[0];
    CHECK(h->reduce_dtype() == at::kBFloat16);
    CHECK(h->accumulated_grad_bytes() == static_cast<size_t>(h->layout().padded_numel * 2));
  }
  CHECK(comm->stats(CollectiveKind::kReduceScatter).calls == 0);
  units.back().set_requires_gradient_sync(true);
  model(at::randn({3, 6})).to(at::kFloat).pow(2).mean().backward();
  CHECK(comm->stats(CollectiveKind::kReduceScatter).calls == (world_size() > 1 ? 3 : 0));  // one rank: none
  CHECK(model->head->weight.grad().scalar_type() == at::kFloat);
}
