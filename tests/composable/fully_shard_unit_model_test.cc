// The full unit model over MPI on every world size: sharding strategies, frozen and mixed handles,
// sibling units, tied parameters, a module called twice, parameter-free units, parameter groups,
// gradient accumulation without sync, the forward-order check, sync_module_states. Parity against
// the unsharded reference of tests/composable/parity.h wherever training is involved.
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/fully_shard_internal.h"
#include "fsdp_cpp/fsdp/flat_param_layout.h"
#include "fsdp_cpp/tests/composable/parity.h"
#include "fsdp_cpp/tests/composable/test_models.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::ShardingStrategy;
using fsdp::comm::CollectiveKind;
using fsdp::testing::fresh_comm;
using fsdp::testing::Instance;
using fsdp::testing::Optim;
using fsdp::testing::ParityOptions;
using fsdp::testing::Scenario;
using fsdp::testing::rank;
using fsdp::testing::world;
using fsdp::testing::world_size;

Scenario mlp_stack(std::string name, std::function<void(fsdp::testing::MlpStack&)> freeze = nullptr) {
  return fsdp::testing::mlp_stack_scenario(std::move(name), std::move(freeze));
}

// Block 0 entirely frozen; every other block's fc1 frozen (mixed units); the input layer frozen.
void freeze_some(fsdp::testing::MlpStack& model) {
  for (auto& p : model->block(0)->parameters()) p.requires_grad_(false);
  for (size_t i = 1; i < model->blocks->size(); ++i) {
    for (auto& p : model->block(i)->fc1->parameters()) p.requires_grad_(false);
  }
  for (auto& p : model->in->parameters()) p.requires_grad_(false);
}

ParityOptions strategy(ShardingStrategy s, Optim optim = Optim::kAdamW) {
  ParityOptions o;
  o.optim = optim;
  o.shard_options.strategy(s);
  return o;
}

size_t total(const std::vector<fsdp::FSDPModule>& units, size_t (fsdp::FlatParamHandle::*bytes)() const) {
  size_t sum = 0;
  for (const auto& u : units) {
    for (const auto& h : fsdp::detail::handles_of(u)) sum += ((*h).*bytes)();
  }
  return sum;
}

}  // namespace

FSDP_RANKS_TEST_CASE("strategies: SHARD_GRAD_OP and NO_SHARD train like the reference", "[unit_model][strategy]") {
  fsdp::testing::run_parity(mlp_stack("SHARD_GRAD_OP"), strategy(ShardingStrategy::kShardGradOp));
  fsdp::testing::run_parity(mlp_stack("NO_SHARD"), strategy(ShardingStrategy::kNoShard, Optim::kSgdMomentum));
  auto zero_grad_kept = strategy(ShardingStrategy::kNoShard, Optim::kAdam);
  zero_grad_kept.set_to_none = false;
  fsdp::testing::run_parity(mlp_stack("NO_SHARD, zero_grad keeping gradients"), zero_grad_kept);
}

FSDP_RANKS_TEST_CASE("SHARD_GRAD_OP: a parameter replaced between forward and backward is a clear error", "[unit_model][strategy]") {
  torch::manual_seed(1);
  auto model = fsdp::testing::MlpStack(4, 8, 8, 2, 2);
  const auto o = fsdp::FullyShardOptions().communicator(fresh_comm()).strategy(ShardingStrategy::kShardGradOp);
  fsdp::testing::shard_stack(model, o);
  at::Tensor out = model(at::randn({2, 4}));
  model->block(1)->fc1->weight.set_data(at::zeros({8, 8}));
  if (world_size() == 1) return;  // one rank: parameters are never unsharded copies
  CHECK_THROWS_WITH(out.sum().backward(), Contains("fc1.weight") && Contains("blocks.1") &&
                                              Contains("replaced while unsharded"));
}

FSDP_RANKS_TEST_CASE("frozen parameters: trainable and frozen handles, parity, no gradient memory", "[unit_model][frozen]") {
  // Block 0 is frozen and its input needs no gradient: backward never reaches it (no all-gather).
  auto frozen = mlp_stack("frozen and mixed units", freeze_some);
  frozen.unreachable_backward_all_gathers = world_size() > 1 ? 1 : 0;
  fsdp::testing::run_parity(frozen, strategy(ShardingStrategy::kFullShard));
  fsdp::testing::run_parity(mlp_stack("frozen and mixed units, SHARD_GRAD_OP", freeze_some),
                            strategy(ShardingStrategy::kShardGradOp, Optim::kSgdMomentum));
}

FSDP_RANKS_TEST_CASE("frozen split: gradient bytes drop by exactly the frozen parameters' share", "[unit_model][frozen]") {
  auto train_once = [](bool freeze) {
    torch::manual_seed(2);
    auto model = fsdp::testing::MlpStack(6, 8, 16, 3, 3);
    if (freeze) freeze_some(model);
    const auto o = fsdp::FullyShardOptions().communicator(fresh_comm());
    auto units = fsdp::testing::shard_stack(model, o);
    model(at::randn({4, 6})).pow(2).mean().backward();
    // The frozen share: per unit, what its trainable FlatParameter's shard would grow by if the
    // frozen parameters were in it (the layout of all parameters vs. of the trainable ones).
    int64_t frozen_share = 0;
    int64_t frozen_handles = 0;
    for (const auto& u : units) {
      std::vector<fsdp::FlatParamInput> all, trainable;
      for (const auto& h : fsdp::detail::handles_of(u)) {
        frozen_handles += h->requires_grad() ? 0 : 1;
        for (size_t i = 0; i < h->params().size(); ++i) {
          all.push_back({h->params()[i].fqn, h->layout().entries[i].shape});
          if (h->requires_grad()) trainable.push_back(all.back());
        }
      }
      const auto W = world_size();
      const int64_t all_shard = fsdp::make_flat_param_layout(all, at::kFloat, W).shard_numel();
      const int64_t trainable_shard =
          trainable.empty() ? 0 : fsdp::make_flat_param_layout(trainable, at::kFloat, W).shard_numel();
      frozen_share += (all_shard - trainable_shard) * 4;
      for (const auto& h : fsdp::detail::handles_of(u)) {
        if (!h->requires_grad()) CHECK(h->sharded_grad_bytes() == 0);
      }
    }
    return std::make_tuple(total(units, &fsdp::FlatParamHandle::sharded_grad_bytes), frozen_share, frozen_handles);
  };
  const auto [all_trainable_bytes, none, no_frozen] = train_once(false);
  const auto [split_bytes, frozen_share, frozen_handles] = train_once(true);
  CHECK(none == 0);
  CHECK(no_frozen == 0);
  CHECK(frozen_handles == 4);  // block 0, fc1 of blocks 1 and 2, the root's input layer
  CHECK(static_cast<int64_t>(all_trainable_bytes - split_bytes) == frozen_share);
  CHECK(frozen_share > 0);
}

FSDP_RANKS_TEST_CASE("changing requires_grad after fully_shard is a clear error", "[unit_model][frozen]") {
  torch::manual_seed(1);
  auto model = fsdp::testing::MlpStack(4, 8, 8, 2, 2);
  const auto o = fsdp::FullyShardOptions().communicator(fresh_comm());
  fsdp::testing::shard_stack(model, o);
  model(at::randn({2, 4})).sum().backward();
  model->block(0)->fc2->bias.requires_grad_(false);
  CHECK_THROWS_WITH(model(at::randn({2, 4})),
                    Contains("requires_grad of parameter 'fc2.bias'") && Contains("blocks.0") &&
                        Contains("before fully_shard"));
}

FSDP_RANKS_TEST_CASE("sibling modules as one unit", "[unit_model][siblings]") {
  Scenario siblings{"siblings a+b as one unit", 4, 4, [] {
                      auto model = fsdp::testing::Siblings(4);
                      Instance inst;
                      inst.module = model.ptr();
                      inst.forward = [model](torch::Tensor x, int) mutable { return model(x); };
                      inst.shard = [model](const fsdp::FullyShardOptions& o) {
                        std::vector<fsdp::FSDPModule> units;
                        units.push_back(fsdp::fully_shard({model->a.ptr().get(), model->b.ptr().get()}, o));
                        units.push_back(fsdp::fully_shard(model, o));
                        return units;
                      };
                      return inst;
                    }};
  fsdp::testing::run_parity(siblings, strategy(ShardingStrategy::kFullShard));
  // One FlatParameter over both modules: a and b's parameters, in order.
  torch::manual_seed(3);
  auto model = fsdp::testing::Siblings(4);
  auto unit = fsdp::fully_shard({model->a.ptr().get(), model->b.ptr().get()},
                                fsdp::FullyShardOptions().communicator(fresh_comm()));
  REQUIRE(fsdp::detail::handles_of(unit).size() == 1);
  CHECK(fsdp::detail::handles_of(unit)[0]->params().size() == 4);
  CHECK(fsdp::detail::handles_of(*fsdp::fsdp_module_of(*model->b))[0].get() == fsdp::detail::handles_of(unit)[0].get());
  CHECK_THROWS_WITH(fsdp::fully_shard({model.ptr().get(), model->c.ptr().get()},
                                      fsdp::FullyShardOptions().communicator(fresh_comm())),
                    Contains("siblings"));
}

FSDP_RANKS_TEST_CASE("a tied parameter lives in the innermost unit containing every module using it", "[unit_model][tied]") {
  Scenario tied{"tied encoder/projection", 4, 4, [] {
                  auto model = fsdp::testing::Tied(4, 6);
                  Instance inst;
                  inst.module = model.ptr();
                  inst.forward = [model](torch::Tensor x, int) mutable { return model(x); };
                  inst.shard = [model](const fsdp::FullyShardOptions& o) {
                    std::vector<fsdp::FSDPModule> units;
                    units.push_back(fsdp::fully_shard(model->enc, o));
                    units.push_back(fsdp::fully_shard(model->mid, o));
                    units.push_back(fsdp::fully_shard(model, o));
                    return units;
                  };
                  return inst;
                }};
  fsdp::testing::run_parity(tied, strategy(ShardingStrategy::kFullShard, Optim::kSgdMomentum));
  // Never two copies: after the first forward the tied weight is in the root's FlatParameter only.
  torch::manual_seed(4);
  auto model = fsdp::testing::Tied(4, 6);
  const auto o = fsdp::FullyShardOptions().communicator(fresh_comm());
  auto enc = fsdp::fully_shard(model->enc, o);
  fsdp::fully_shard(model->mid, o);
  auto root = fsdp::fully_shard(model, o);
  model(at::randn({2, 4})).sum().backward();
  int copies = 0;
  for (const auto* unit : {&enc, &root}) {
    for (const auto& h : fsdp::detail::handles_of(*unit)) {
      for (const auto& p : h->params()) copies += p.param.is_same(model->enc->weight) ? 1 : 0;
    }
  }
  CHECK(copies == 1);
  CHECK(root.manages(model->enc->weight));
  CHECK_FALSE(enc.manages(model->enc->weight));
  CHECK(model->proj->weight.is_same(model->enc->weight));
}

FSDP_RANKS_TEST_CASE("a module called twice in one forward, and a parameter-free unit", "[unit_model][twice]") {
  Scenario twice{"shared layer applied twice", 4, 4, [] {
                   auto model = fsdp::testing::Twice(4);
                   Instance inst;
                   inst.module = model.ptr();
                   inst.forward = [model](torch::Tensor x, int) mutable { return model(x); };
                   inst.shard = [model](const fsdp::FullyShardOptions& o) {
                     std::vector<fsdp::FSDPModule> units;
                     units.push_back(fsdp::fully_shard(model->shared, o));
                     units.push_back(fsdp::fully_shard(model, o));
                     return units;
                   };
                   return inst;
                 },
                 /*extra_forward_calls=*/1};
  fsdp::testing::run_parity(twice, strategy(ShardingStrategy::kFullShard));
  torch::manual_seed(5);
  auto model = fsdp::testing::Twice(4);
  torch::manual_seed(5);
  auto reference = fsdp::testing::Twice(4);
  const auto o = fsdp::FullyShardOptions().communicator(fresh_comm());
  auto act = fsdp::fully_shard(model->act, o);
  CHECK(fsdp::detail::handles_of(act).empty());
  fsdp::fully_shard(model->shared, o);
  fsdp::fully_shard(model, o);
  const at::Tensor x = at::randn({3, 4});
  CHECK(at::allclose(model(x), reference(x), 1e-6, 1e-6));
}

FSDP_RANKS_TEST_CASE("parameter groups sharing one FlatParameter, optimizer built before or after", "[unit_model][optim]") {
  for (bool before : {false, true}) {
    ParityOptions o = strategy(ShardingStrategy::kFullShard);
    o.optimizer_before_shard = before;
    o.make_optimizer = [](torch::nn::Module& m) {
      std::vector<at::Tensor> weights, biases;
      for (const auto& item : m.named_parameters()) {
        (item.key().find("bias") != std::string::npos ? biases : weights).push_back(item.value());
      }
      std::vector<torch::optim::OptimizerParamGroup> groups;
      groups.emplace_back(weights, std::make_unique<torch::optim::AdamWOptions>(
                                       torch::optim::AdamWOptions(1e-2).weight_decay(0.1)));
      groups.emplace_back(biases, std::make_unique<torch::optim::AdamWOptions>(
                                      torch::optim::AdamWOptions(5e-3).weight_decay(0.0)));
      return std::make_unique<torch::optim::AdamW>(groups, torch::optim::AdamWOptions(1e-3));
    };
    fsdp::testing::run_parity(mlp_stack(before ? "param groups, optimizer before fully_shard"
                                               : "param groups, optimizer after fully_shard"), o);
  }
}

FSDP_RANKS_TEST_CASE("gradient accumulation without sync equals one large batch", "[unit_model][accumulation]") {
  const int W = world_size();
  const int M = 3;
  for (bool keep_unsharded : {false, true}) {
    INFO("reshard_after_backward " << !keep_unsharded);
    torch::manual_seed(6);
    auto model = fsdp::testing::MlpStack(4, 8, 8, 2, 2);
    torch::manual_seed(6);
    auto reference = fsdp::testing::MlpStack(4, 8, 8, 2, 2);
    auto comm = fresh_comm();
    const auto o = fsdp::FullyShardOptions().communicator(comm);
    auto units = fsdp::testing::shard_stack(model, o);
    auto& root = units.back();
    auto data = [](int m, int q) {
      auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(77 + 10 * m + q));
      return std::make_pair(at::randn({3, 4}, gen), at::randn({3, 2}, gen));
    };
    root.set_requires_gradient_sync(false);
    root.set_reshard_after_backward(!keep_unsharded);
    for (int m = 0; m < M; ++m) {
      if (m == M - 1) {
        root.set_requires_gradient_sync(true);
        root.set_reshard_after_backward(true);
      }
      const auto rs_before = comm->stats(CollectiveKind::kReduceScatter).calls;
      const auto ag_before = comm->stats(CollectiveKind::kAllGather).calls;
      auto [x, y] = data(m, rank());
      (torch::nn::functional::mse_loss(model(x), y) / M).backward();
      const auto rs = comm->stats(CollectiveKind::kReduceScatter).calls - rs_before;
      const auto ag = comm->stats(CollectiveKind::kAllGather).calls - ag_before;
      if (m < M - 1) {
        CHECK(rs == 0);  // no reduce-scatter while sync is off
        for (const auto& u : units) {
          // One rank: autograd accumulates in `.grad` itself, as in local training.
          for (const auto& h : fsdp::detail::handles_of(u)) CHECK((h->accumulated_grad_bytes() > 0) == (W > 1));
        }
      } else {
        CHECK(rs == (W > 1 ? 3 : 0));  // one rank communicates nothing
      }
      // Kept unsharded after an unsynchronised backward, the next forward all-gathers nothing;
      // FULL_SHARD still reshards the two blocks after forward, so backward re-gathers them.
      if (m >= 1 && W > 1) CHECK(ag == (keep_unsharded ? 2 : 5));
      if (W == 1) CHECK(ag == 0);
    }
    for (const auto& u : units) {
      for (const auto& h : fsdp::detail::handles_of(u)) {
        CHECK(h->unsharded_bytes() == 0);
        CHECK(h->accumulated_grad_bytes() == 0);
      }
    }
    // Reference: one large batch of every rank's micro-batches.
    for (int m = 0; m < M; ++m) {
      for (int q = 0; q < W; ++q) {
        auto [x, y] = data(m, q);
        (torch::nn::functional::mse_loss(reference(x), y) / (M * W)).backward();
      }
    }
    std::map<const void*, std::pair<const fsdp::FlatParamHandle*, int>> where;
    for (const auto& u : units) {
      for (const auto& h : fsdp::detail::handles_of(u)) {
        for (size_t i = 0; i < h->params().size(); ++i) where[h->params()[i].param.unsafeGetTensorImpl()] = {h.get(), static_cast<int>(i)};
      }
    }
    const auto ref_params = reference->named_parameters();
    for (const auto& item : model->named_parameters()) {
      INFO(item.key());
      const auto [handle, index] = where.at(item.value().unsafeGetTensorImpl());
      const auto slice = handle->layout().slice_of(index, rank());
      REQUIRE(item.value().grad().defined());
      CHECK(at::allclose(item.value().grad().reshape({-1}),
                         ref_params[item.key()].grad().reshape({-1}).narrow(0, slice.param_begin, slice.size()),
                         1e-5, 1e-6));
    }
  }
}

FSDP_RANKS_TEST_CASE("a forward order that differs across ranks is a clear error", "[unit_model][order]") {
  torch::manual_seed(8);
  auto model = fsdp::testing::Order(4);
  const auto o = fsdp::FullyShardOptions().communicator(fresh_comm());
  fsdp::fully_shard(model->a, o);
  fsdp::fully_shard(model->b, o);
  fsdp::fully_shard(model, o);
  const bool swap = rank() != 0;
  if (world_size() == 1) {  // nothing to differ from
    CHECK_NOTHROW(model(at::randn({2, 4}), swap).sum().backward());
    return;
  }
  CHECK_THROWS_WITH(model(at::randn({2, 4}), swap),
                    Contains("forward order differs across ranks") && Contains("rank 0: ran 'a'") &&
                        Contains("rank 1: ran 'b'"));
}

FSDP_RANKS_TEST_CASE("sync_module_states starts every rank from rank 0's parameters and buffers", "[unit_model][sync]") {
  torch::manual_seed(100 + rank());  // every rank initialises differently
  auto model = fsdp::testing::WithBuffer(4);
  torch::manual_seed(100);  // rank 0's initialisation
  auto rank0 = fsdp::testing::WithBuffer(4);
  auto unit = fsdp::fully_shard(model, fsdp::FullyShardOptions().communicator(fresh_comm()).sync_module_states(true));
  unit.unshard();
  CHECK(model->fc->weight.equal(rank0->fc->weight));
  CHECK(model->fc->bias.equal(rank0->fc->bias));
  unit.reshard();
  CHECK(model->running.equal(rank0->running));
  const at::Tensor x = at::randn({2, 4});
  CHECK(at::allclose(model(x), rank0(x), 1e-6, 1e-6));
}

FSDP_RANKS_TEST_CASE("hybrid sharding trains like the reference on every mesh of the world", "[unit_model][hybrid]") {
  const int W = world_size();
  for (int shard_size = 1; shard_size <= W; ++shard_size) {
    if (W % shard_size != 0) continue;
    INFO("mesh " << W / shard_size << " replicate groups x " << shard_size << " ranks per shard group");
    auto mesh = fsdp::comm::DeviceMesh::hybrid(world(), shard_size);
    CHECK(mesh->shard_group()->size() == shard_size);
    CHECK(mesh->replicate_group()->size() == W / shard_size);
    CHECK(mesh->shard_group()->rank() == rank() % shard_size);
    ParityOptions o = strategy(ShardingStrategy::kFullShard, Optim::kAdamW);
    o.shard_options.mesh(mesh);
    fsdp::testing::run_parity(mlp_stack("HSDP"), o);
  }
  if (W == 4) {
    CHECK_THROWS_WITH(fsdp::comm::DeviceMesh::hybrid(world(), 3),
                      Contains("shard size 3 does not divide the world size 4") && Contains("1, 2, 4"));
  }
}

FSDP_RANKS_TEST_CASE("CPU offload keeps shards and gradients in host memory and trains like the reference", "[unit_model][offload]") {
  // On a CPU-only machine the compute device is the CPU too, so this checks the offload path's
  // bookkeeping (copies to the compute device, gradients back) and parity; tools/gpu_check.sh
  // runs it with CUDA compute.
  ParityOptions o = strategy(ShardingStrategy::kFullShard, Optim::kAdamW);
  o.shard_options.offload_to_cpu(true);
  fsdp::testing::run_parity(mlp_stack("CPU offload"), o);
  ParityOptions mp = strategy(ShardingStrategy::kNoShard, Optim::kAdam);
  mp.shard_options.offload_to_cpu(true);
  fsdp::testing::run_parity(mlp_stack("CPU offload, NO_SHARD"), mp);
  torch::manual_seed(1);
  auto model = fsdp::testing::MlpStack(4, 8, 8, 2, 2);
  auto unit = fsdp::fully_shard(model, fsdp::FullyShardOptions().communicator(fresh_comm()).offload_to_cpu(true));
  model(at::randn({2, 4})).sum().backward();
  CHECK(fsdp::detail::handles_of(unit)[0]->local_shard().device().is_cpu());
  CHECK(model->head->weight.grad().device().is_cpu());
}
