// fsdp::plan over MPI on every world size of the launch. The plan's predictions are compared with
// what a training step really does, measured independently of the plan:
//  (a) bytes and calls per collective kind: the communicator's counters (summed over the shard and
//      replicate groups with HSDP) over one forward + backward + optimizer step, exactly;
//  (b) the sharded state (shards + gradients + optimizer state + low-precision shards): a counting
//      CPU allocator, marked after the model and its batch were built and before fully_shard: the
//      live bytes of the allocations made since the mark, after each of three optimizer steps,
//      once the loss and its graph are gone (and a barrier, see below), exactly;
//  (c) the unsharded parameters: the allocator watches the storages of every handle's padded
//      unsharded buffer; their peak live bytes over a training step are at most the plan's peak,
//      and equal to it when the largest units are the ones prefetched together; the unsharded
//      gradient buffers, sampled at every block boundary in backward, stay within the plan's bound;
//  (d) the printed plan: every unit's and parameter's FQN, and a golden text for a small model on
//      each world size and rank (its numbers worked out by hand below).
// Models: uneven layer sizes (padding on every world size), SHARD_GRAD_OP, NO_SHARD, HSDP, mixed
// strategies in one tree, mixed precision (bf16 reduced in bf16 or fp32), CPU offload, a frozen
// handle, a tied parameter, the example GPT.
#include <algorithm>
#include <cstdio>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "fsdp_cpp/comm/device_mesh.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/fully_shard_internal.h"
#include "fsdp_cpp/composable/plan.h"
#include "fsdp_cpp/examples/gpt_model.h"
#include "fsdp_cpp/tests/composable/test_models.h"
#include "fsdp_cpp/tools/bench/counting_allocator.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::FSDPModule;
using fsdp::FullyShardOptions;
using fsdp::PlanOptimizer;
using fsdp::PlanOptions;
using fsdp::ShardingStrategy;
using fsdp::comm::CollectiveKind;
using fsdp::testing::rank;
using fsdp::testing::world;
using fsdp::testing::world_size;

// x + fc2(tanh(fc1(x)))
struct PlanBlockImpl : torch::nn::Module {
  PlanBlockImpl(int64_t dim, int64_t hidden) {
    fc1 = register_module("fc1", fsdp::contract::Linear(dim, hidden));
    fc2 = register_module("fc2", fsdp::contract::Linear(hidden, dim));
  }
  torch::Tensor forward(torch::Tensor x) { return x + fc2(torch::tanh(fc1(x))); }
  fsdp::contract::Linear fc1{nullptr}, fc2{nullptr};
};
FSDP_HOOKABLE_MODULE(PlanBlock);

// in -> blocks (one hidden width each) -> head
struct PlanNetImpl : torch::nn::Module {
  PlanNetImpl(int64_t in_dim, int64_t dim, const std::vector<int64_t>& hidden, int64_t out_dim) {
    in = register_module("in", fsdp::contract::Linear(in_dim, dim));
    blocks = register_module("blocks", fsdp::contract::ModuleList());
    for (int64_t h : hidden) blocks->push_back(PlanBlock(dim, h));
    head = register_module("head", fsdp::contract::Linear(dim, out_dim));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = in(x);
    for (const auto& block : *blocks) {
      x = block.forward<torch::Tensor>(x);
      if (probe && x.requires_grad()) x.register_hook([p = probe](const at::Tensor&) { p(); });
    }
    return head(x);
  }
  // Runs in backward at every block boundary (after the block's own pre-backward).
  std::function<void()> probe;
  PlanBlock block(size_t i) const { return blocks->at<PlanBlock>(i); }
  fsdp::contract::Linear in{nullptr}, head{nullptr};
  fsdp::contract::ModuleList blocks{nullptr};
};
FSDP_HOOKABLE_MODULE(PlanNet);

// A model, its batch on this rank (built before the allocator's mark), and how to shard it.
struct Trainee {
  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor()> loss;
  std::function<std::vector<FSDPModule>(const FullyShardOptions&)> shard;  // the root last
};

struct Case {
  std::string name;
  std::function<Trainee()> make;
  FullyShardOptions options;
  PlanOptions plan;
  bool hybrid = false;  // HSDP: shard groups of 2 ranks where the world size is even, else of 1
};

constexpr int64_t kIn = 5, kDim = 7, kOut = 3;

// PlanNet(5, 7, hidden, 3): units per block (strategy per block, default the options'), the root.
std::function<Trainee()> plan_net(std::vector<int64_t> hidden, std::vector<ShardingStrategy> strategies = {},
                                  std::function<void(PlanNet&)> prepare = nullptr) {
  return [=] {
    torch::manual_seed(11);
    PlanNet model(kIn, kDim, hidden, kOut);
    if (prepare) prepare(model);
    Trainee t;
    t.module = model.ptr();
    const at::Tensor x = at::randn({4, kIn}), y = at::randn({4, kOut});
    t.loss = [model, x, y]() mutable { return torch::nn::functional::mse_loss(model(x), y); };
    t.shard = [model, strategies](const FullyShardOptions& o) {
      std::vector<FSDPModule> units;
      for (size_t i = 0; i < model->blocks->size(); ++i) {
        FullyShardOptions block_options = o;
        if (i < strategies.size()) block_options.strategy(strategies[i]);
        units.push_back(fsdp::fully_shard(model->block(i), block_options));
      }
      units.push_back(fsdp::fully_shard(model, o));
      return units;
    };
    return t;
  };
}

// proj(relu(mid(enc(x)))) with proj.weight tied to enc.weight; units: mid, the root.
std::function<Trainee()> tied_net() {
  return [] {
    torch::manual_seed(12);
    fsdp::testing::Tied model(6, 6);
    Trainee t;
    t.module = model.ptr();
    const at::Tensor x = at::randn({4, 6}), y = at::randn({4, 6});
    t.loss = [model, x, y]() mutable { return torch::nn::functional::mse_loss(model(x), y); };
    t.shard = [model](const FullyShardOptions& o) {
      return std::vector<FSDPModule>{fsdp::fully_shard(model->mid, o), fsdp::fully_shard(model, o)};
    };
    return t;
  };
}

// The example GPT: a unit per block, the root last.
fsdp::examples::GPTConfig small_gpt() {
  return fsdp::examples::GPTConfig(/*vocab_size=*/29).context_length(8).d_model(12).n_heads(2).n_layers(2);
}

std::function<Trainee()> gpt(fsdp::examples::GPTConfig config) {
  return [config] {
    torch::manual_seed(13);
    fsdp::examples::GPT model(config);
    Trainee t;
    t.module = model.ptr();
    const at::Tensor tokens = at::randint(config.vocab_size(), {2, config.context_length()}, at::kLong);
    const at::Tensor targets = at::randint(config.vocab_size(), {2, config.context_length()}, at::kLong);
    t.loss = [model, tokens, targets]() mutable { return fsdp::examples::next_token_loss(model(tokens), targets); };
    t.shard = [model](const FullyShardOptions& o) {
      std::vector<FSDPModule> units;
      for (auto& block : model->block_list()) units.push_back(fsdp::fully_shard(block, o));
      units.push_back(fsdp::fully_shard(model, o));
      return units;
    };
    return t;
  };
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const PlanOptions& plan, std::vector<at::Tensor> params) {
  switch (plan.optimizer()) {
    case PlanOptimizer::kNone:
    case PlanOptimizer::kSGD:
      return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1));
    case PlanOptimizer::kSGDMomentum:
      return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
    case PlanOptimizer::kAdam:
      return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-3).amsgrad(plan.amsgrad()));
    case PlanOptimizer::kAdamW:
      return std::make_unique<torch::optim::AdamW>(
          params, torch::optim::AdamWOptions(1e-3).weight_decay(0.01).amsgrad(plan.amsgrad()));
  }
  return nullptr;
}

at::ScalarType bf16 = at::kBFloat16;

std::vector<Case> cases() {
  const std::vector<int64_t> uneven = {9, 3, 11};
  auto o = [] { return FullyShardOptions(); };
  auto po = [](PlanOptimizer opt, bool amsgrad = false) { return PlanOptions().optimizer(opt).amsgrad(amsgrad); };
  auto freeze_block1_fc1 = [](PlanNet& m) {
    for (auto& p : m->block(1)->fc1->parameters()) p.set_requires_grad(false);
  };
  return {
      {"FULL_SHARD, AdamW", plan_net(uneven), o(), po(PlanOptimizer::kAdamW)},
      {"SHARD_GRAD_OP, SGD with momentum", plan_net(uneven), o().strategy(ShardingStrategy::kShardGradOp),
       po(PlanOptimizer::kSGDMomentum)},
      {"NO_SHARD, Adam", plan_net(uneven), o().strategy(ShardingStrategy::kNoShard), po(PlanOptimizer::kAdam)},
      {"mixed strategies per unit, plain SGD", plan_net(uneven, {ShardingStrategy::kFullShard,
                                                                 ShardingStrategy::kShardGradOp,
                                                                 ShardingStrategy::kNoShard}),
       o(), po(PlanOptimizer::kSGD)},
      {"a frozen handle, Adam", plan_net(uneven, {}, freeze_block1_fc1), o(), po(PlanOptimizer::kAdam)},
      {"mixed precision bf16, Adam amsgrad", plan_net(uneven),
       o().mixed_precision(fsdp::MixedPrecision().param_dtype(bf16)), po(PlanOptimizer::kAdam, true)},
      {"mixed precision bf16 reduced in fp32, SHARD_GRAD_OP, AdamW", plan_net(uneven),
       o().strategy(ShardingStrategy::kShardGradOp)
           .mixed_precision(fsdp::MixedPrecision().param_dtype(bf16).reduce_dtype(at::kFloat)),
       po(PlanOptimizer::kAdamW)},
      {"CPU offload, no optimizer state", plan_net(uneven), o().offload_to_cpu(true), po(PlanOptimizer::kNone)},
      {"HSDP, AdamW", plan_net(uneven), o(), po(PlanOptimizer::kAdamW), /*hybrid=*/true},
      {"HSDP with SHARD_GRAD_OP and a frozen handle, SGD with momentum", plan_net(uneven, {}, freeze_block1_fc1),
       o().strategy(ShardingStrategy::kShardGradOp), po(PlanOptimizer::kSGDMomentum), /*hybrid=*/true},
      {"tied parameter, Adam", tied_net(), o(), po(PlanOptimizer::kAdam)},
      // Quantized communication: the encoded bytes ([Note: communication codecs]).
      {"int8 all-gather and reduce codecs, AdamW", plan_net(uneven),
       o().all_gather_codec(fsdp::int8_block_codec(16)).reduce_codec(fsdp::int8_block_codec(8, bf16)),
       po(PlanOptimizer::kAdamW)},
      {"HSDP with SHARD_GRAD_OP, bf16 and int8 codecs, SGD with momentum", plan_net(uneven),
       o().strategy(ShardingStrategy::kShardGradOp)
           .mixed_precision(fsdp::MixedPrecision().param_dtype(bf16))
           .all_gather_codec(fsdp::int8_block_codec(32, bf16))
           .reduce_codec(fsdp::int8_block_codec(32)),
       po(PlanOptimizer::kSGDMomentum), /*hybrid=*/true},
      {"GPT, AdamW", gpt(small_gpt()), o(), po(PlanOptimizer::kAdamW)},
  };
}

// The communicators a case's collectives go through; sets them on `options`.
std::vector<std::shared_ptr<fsdp::comm::Communicator>> communicators(const Case& c, FullyShardOptions& options) {
  if (c.hybrid) {
    auto mesh = fsdp::comm::DeviceMesh::hybrid(world(), world_size() % 2 == 0 ? 2 : 1);
    options.mesh(mesh);
    return {mesh->shard_group(), mesh->replicate_group()};
  }
  auto comm = std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
  options.communicator(comm);
  return {comm};
}

fsdp::CommunicationPlan measured_since(const std::vector<std::shared_ptr<fsdp::comm::Communicator>>& comms) {
  fsdp::CommunicationPlan m;
  for (const auto& c : comms) {
    m.all_gather.calls += c->stats(CollectiveKind::kAllGather).calls;
    m.all_gather.bytes += c->stats(CollectiveKind::kAllGather).bytes;
    m.reduce_scatter.calls += c->stats(CollectiveKind::kReduceScatter).calls;
    m.reduce_scatter.bytes += c->stats(CollectiveKind::kReduceScatter).bytes;
    m.all_reduce.calls += c->stats(CollectiveKind::kAllReduce).calls;
    m.all_reduce.bytes += c->stats(CollectiveKind::kAllReduce).bytes;
    m.all_to_all.calls += c->stats(CollectiveKind::kAllToAll).calls;
    m.all_to_all.bytes += c->stats(CollectiveKind::kAllToAll).bytes;
    c->reset_stats();
  }
  return m;
}

void check_equal(const fsdp::CommunicationPlan& measured, const fsdp::CommunicationPlan& predicted) {
  CHECK(measured.all_gather.calls == predicted.all_gather.calls);
  CHECK(measured.all_gather.bytes == predicted.all_gather.bytes);
  CHECK(measured.reduce_scatter.calls == predicted.reduce_scatter.calls);
  CHECK(measured.reduce_scatter.bytes == predicted.reduce_scatter.bytes);
  CHECK(measured.all_reduce.calls == predicted.all_reduce.calls);
  CHECK(measured.all_reduce.bytes == predicted.all_reduce.bytes);
  CHECK(measured.all_to_all.calls == predicted.all_to_all.calls);
  CHECK(measured.all_to_all.bytes == predicted.all_to_all.bytes);
}

FSDP_RANKS_TEST_CASE("the plan's bytes per collective and sharded-state memory equal a training step's", "[plan]") {
  auto& alloc = fsdp::bench::CountingAllocator::install();
  const int W = world_size();
  for (const Case& c : cases()) {
    INFO(c.name << " on " << W << " ranks, rank " << rank());
    Trainee t = c.make();
    FullyShardOptions options = c.options;
    const auto comms = communicators(c, options);
    // Everything allocated from here on and alive after the step is the sharded state (the model's
    // own parameter storage and the batch were allocated before).
    alloc.mark();
    const auto units = t.shard(options);
    const fsdp::ShardingPlan plan = fsdp::plan(units.back(), c.plan);
    auto optimizer = make_optimizer(c.plan, t.module->parameters());
    measured_since(comms);  // reset
    const int64_t expected_state = plan.memory.sharded_state_bytes();
    for (int step = 0; step < 3; ++step) {
      INFO("step " << step);
      t.loss().backward();
      optimizer->step();
      const fsdp::CommunicationPlan measured = measured_since(comms);
      check_equal(measured, plan.communication);
      // The loss and its graph are gone: what is left is the sharded state. The barrier first:
      // the MPI progress thread drops its reference to the last collective's buffers (the root's
      // low-precision reduce-scatter output, a temporary) only after the caller's wait() returned.
      world().barrier();
      CHECK(alloc.current_since_mark() == expected_state);
      if (step == 1) optimizer->zero_grad(/*set_to_none=*/true);  // step 2 re-creates the gradients
    }
    // Every component is there (a zero would make the equality above weaker).
    CHECK(plan.memory.sharded_params > 0);
    const bool has_optimizer_state = c.plan.optimizer() != PlanOptimizer::kNone && c.plan.optimizer() != PlanOptimizer::kSGD;
    CHECK((plan.memory.optimizer_state > 0) == has_optimizer_state);
    CHECK(plan.memory.sharded_grads > 0);
    CHECK(plan.memory.optimizer_state <= plan.max_over_ranks.optimizer_state);
    if (W > 1) CHECK(plan.communication.all_gather.calls + plan.communication.all_reduce.calls > 0);
    if (rank() == 0) {
      std::fprintf(stderr, "[plan] W=%d %s: state %lld B, all-gather %lld B, reduce-scatter %lld B, all-reduce %lld B\n",
                   W, c.name.c_str(), static_cast<long long>(expected_state),
                   static_cast<long long>(plan.communication.all_gather.bytes),
                   static_cast<long long>(plan.communication.reduce_scatter.bytes),
                   static_cast<long long>(plan.communication.all_reduce.bytes));
    }
  }
}

// Closed-form numbers for one case, independent of the plan's code: PlanNet(5, 7, {9, 3, 11}, 3),
// FULL_SHARD in fp32 with Adam, on W ranks.
FSDP_RANKS_TEST_CASE("the plan's layout numbers match the closed form", "[plan]") {
  const int64_t W = world_size();
  auto comm = std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
  Trainee t = plan_net({9, 3, 11})();
  const auto units = t.shard(FullyShardOptions().communicator(comm));
  const auto plan = fsdp::plan(units.back(), PlanOptions().optimizer(PlanOptimizer::kAdam));
  REQUIRE(plan.units.size() == 4);
  auto pad = [](int64_t n, int64_t m) { return (n + m - 1) / m * m; };
  // Block with hidden h: fc1.weight [h, 7] at 0, fc1.bias [h] aligned to 4 elements, fc2.weight [7, h],
  // fc2.bias [7].
  auto block_aligned = [&](int64_t h) {
    int64_t n = 7 * h;
    n = pad(n, 4) + h;
    n = pad(n, 4) + 7 * h;
    return pad(n, 4) + 7;
  };
  // Root: in.weight [7, 5] = 35, in.bias 7 at 36, head.weight [3, 7] = 21 at 44, head.bias 3 at 68.
  const int64_t root_aligned = 71;
  CHECK(block_aligned(9) == 63 + 1 + 9 + 3 + 63 + 1 + 7);
  const std::vector<int64_t> aligned = {root_aligned, block_aligned(9), block_aligned(3), block_aligned(11)};
  const std::vector<std::string> names = {"<root>", "blocks.0", "blocks.1", "blocks.2"};
  int64_t shards = 0, gathered = 0, gathered_again = 0;
  for (size_t u = 0; u < 4; ++u) {
    INFO("unit " << names[u]);
    CHECK(plan.units[u].name() == names[u]);
    CHECK(plan.units[u].depth == (u == 0 ? 0 : 1));
    REQUIRE(plan.units[u].handles.size() == 1);
    const auto& h = plan.units[u].handles[0];
    CHECK(h.aligned_numel == aligned[u]);
    CHECK(h.padded_numel == pad(aligned[u], W));
    CHECK(h.shard_numel == pad(aligned[u], W) / W);
    shards += pad(aligned[u], W) / W;
    gathered += W > 1 ? pad(aligned[u], W) : 0;
    if (u > 0) gathered_again += W > 1 ? pad(aligned[u], W) : 0;
  }
  CHECK(plan.memory.sharded_params == 4 * shards);
  CHECK(plan.communication.all_gather.bytes == 4 * (gathered + gathered_again));
  CHECK(plan.communication.all_gather.calls == (W > 1 ? 7 : 0));
  CHECK(plan.communication.reduce_scatter.bytes == (W > 1 ? 4 * gathered : 0));
  // One per backward pass: where it reaches each unit and its controls ([Note: backward reach]),
  // 4 int64 per unit and 2.
  CHECK(plan.communication.all_reduce.calls == (W > 1 ? 1 : 0));
  CHECK(plan.communication.all_reduce.bytes == (W > 1 ? (4 * 4 + 2) * 8 : 0));
  // Adam: two fp32 tensors per element of the parameters; over all ranks, every element once.
  const int64_t numel = (35 + 7 + 21 + 3) + (2 * 63 + 9 + 7) + (2 * 21 + 3 + 7) + (2 * 77 + 11 + 7);
  at::Tensor all = at::tensor({plan.memory.optimizer_state}, at::kLong);
  comm->all_reduce(all).wait();
  CHECK(all.item<int64_t>() == 2 * 4 * numel);
}

// Peak of the padded unsharded buffers' live bytes over a training step (the watched storages).
struct UnshardedRun {
  int64_t measured_peak = 0;
  // The most bytes of unsharded gradient buffers alive at once (FlatParamHandle::
  // gradient_buffer_bytes summed over the handles), sampled at each block boundary in backward.
  int64_t sampled_grad_buffers = 0;
  fsdp::ShardingPlan plan;
};

UnshardedRun unsharded_peak(const std::function<Trainee()>& make, const FullyShardOptions& base) {
  auto& alloc = fsdp::bench::CountingAllocator::install();
  Trainee t = make();
  FullyShardOptions options = base;
  options.communicator(std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU));
  auto units = t.shard(options);
  UnshardedRun run;
  run.plan = fsdp::plan(units.back(), PlanOptions().optimizer(PlanOptimizer::kSGD));
  // The storage of each handle's padded unsharded buffer: an unsharded parameter views it.
  std::vector<const c10::StorageImpl*> storages;
  for (auto& unit : units) {
    unit.unshard();
    for (const auto& h : fsdp::detail::handles_of(unit)) {
      if (h->is_unsharded()) storages.push_back(h->params().front().param.storage().unsafeGetStorageImpl());
    }
    unit.reshard();
  }
  alloc.watch(storages);
  if (auto* net = dynamic_cast<PlanNetImpl*>(t.module.get())) {
    net->probe = [&run, &units] {
      int64_t bytes = 0;
      for (const auto& u : units) {
        for (const auto& h : fsdp::detail::handles_of(u)) bytes += static_cast<int64_t>(h->gradient_buffer_bytes());
      }
      run.sampled_grad_buffers = std::max(run.sampled_grad_buffers, bytes);
    };
  }
  torch::optim::SGD optimizer(t.module->parameters(), torch::optim::SGDOptions(0.01));
  for (int step = 0; step < 2; ++step) {  // the second step is measured
    alloc.reset_peak();
    CHECK(alloc.watched_current() == 0);  // nothing unsharded outside forward and backward
    t.loss().backward();
    optimizer.step();
    optimizer.zero_grad();
    run.measured_peak = alloc.watched_peak();
  }
  alloc.watch({});
  if (auto* net = dynamic_cast<PlanNetImpl*>(t.module.get())) net->probe = nullptr;
  return run;
}

FSDP_RANKS_TEST_CASE("the unsharded-parameter peak is at most the plan's, and equal when the largest units are prefetched", "[plan]") {
  const int W = world_size();
  struct PeakCase {
    std::string name;
    std::function<Trainee()> make;
    FullyShardOptions options;
    bool exact;  // the largest units are the ones unsharded together
  };
  const auto mp = fsdp::MixedPrecision().param_dtype(at::kBFloat16);
  const std::vector<PeakCase> peak_cases = {
      // Equal blocks: backward prefetch holds two of them (any two are the largest) besides the root.
      {"equal blocks, FULL_SHARD", plan_net({8, 8, 8, 8}), FullyShardOptions(), true},
      {"equal blocks, max_unshards_in_flight 1", plan_net({8, 8, 8, 8}), FullyShardOptions().max_unshards_in_flight(1), true},
      {"equal blocks, max_unshards_in_flight 3, forward prefetch", plan_net({8, 8, 8, 8}),
       FullyShardOptions().max_unshards_in_flight(3).forward_prefetch(true), false},
      {"equal blocks, mixed precision", plan_net({8, 8, 8, 8}), FullyShardOptions().mixed_precision(mp), true},
      // The two largest blocks are adjacent: backward prefetches one while the other computes.
      {"uneven blocks, the largest adjacent", plan_net({3, 12, 10, 2}), FullyShardOptions(), true},
      {"uneven blocks apart", plan_net({12, 3, 10, 2}), FullyShardOptions(), false},
      // SHARD_GRAD_OP keeps every block unsharded from forward to backward: all at once.
      {"SHARD_GRAD_OP", plan_net({9, 3, 11}), FullyShardOptions().strategy(ShardingStrategy::kShardGradOp), true},
      {"mixed strategies", plan_net({9, 3, 11, 5}, {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                                                   ShardingStrategy::kFullShard, ShardingStrategy::kNoShard}),
       FullyShardOptions(), false},
      {"NO_SHARD", plan_net({9, 3, 11}), FullyShardOptions().strategy(ShardingStrategy::kNoShard), true},
      {"GPT", gpt(small_gpt()), FullyShardOptions(), true},
  };
  for (const auto& c : peak_cases) {
    INFO(c.name << " on " << W << " ranks");
    const UnshardedRun run = unsharded_peak(c.make, c.options);
    const int64_t predicted = run.plan.unsharded_params.total();
    INFO("measured " << run.measured_peak << " B, predicted " << predicted << " B = root "
                     << run.plan.unsharded_params.root << " + kept " << run.plan.unsharded_params.kept
                     << " + in flight " << run.plan.unsharded_params.in_flight);
    CHECK(run.measured_peak <= predicted);
    // The unsharded gradients: below the plan's bound wherever sampled; something is sampled
    // when gradients go through the library's flat buffers (more than one rank, or a copy).
    CHECK(run.sampled_grad_buffers <= run.plan.unsharded_grads_bound);
    if (run.plan.unsharded_grads_bound > 0 && c.name != "GPT") CHECK(run.sampled_grad_buffers > 0);
    if (c.exact) CHECK(run.measured_peak == predicted);
    // Something is unsharded whenever parameters are gathered (or copied to bf16).
    if ((W > 1 && c.options.strategy() != ShardingStrategy::kNoShard) || c.options.mixed_precision().param_dtype()) {
      CHECK(run.measured_peak > 0);
    }
    if (rank() == 0) {
      std::fprintf(stderr, "[plan] W=%d unsharded peak, %s: measured %lld B, predicted %lld B; gradient buffers "
                   "sampled %lld B, bound %lld B\n", W, c.name.c_str(), static_cast<long long>(run.measured_peak),
                   static_cast<long long>(predicted), static_cast<long long>(run.sampled_grad_buffers),
                   static_cast<long long>(run.plan.unsharded_grads_bound));
    }
  }
}

std::string printed(const fsdp::ShardingPlan& plan) {
  std::ostringstream out;
  out << plan;
  return out.str();
}

FSDP_RANKS_TEST_CASE("the printed plan names every unit and parameter", "[plan]") {
  auto comm = std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
  Trainee t = plan_net({9, 3, 11}, {}, [](PlanNet& m) {
    for (auto& p : m->block(1)->fc1->parameters()) p.set_requires_grad(false);
  })();
  const auto units = t.shard(FullyShardOptions().communicator(comm));
  const std::string text = printed(fsdp::plan(*t.module, PlanOptions().list_parameters(true)));
  if (rank() == 0) std::fprintf(stderr, "[plan] with a frozen handle, listing parameters:\n%s", text.c_str());
  for (const auto& unit : {"<root> (PlanNetImpl) FULL_SHARD", "\n    blocks.0 (PlanBlockImpl) FULL_SHARD",
                           "\n    blocks.1 (PlanBlockImpl)", "\n    blocks.2 (PlanBlockImpl)"}) {
    CHECK_THAT(text, Contains(unit));
  }
  for (const auto& fqn : {"in.weight [7, 5]", "in.bias [7]", "head.weight [3, 7]", "fc1.weight [9, 7]", "fc2.bias [7]",
                          "fc1.weight [11, 7]"}) {
    CHECK_THAT(text, Contains(fqn));
  }
  CHECK_THAT(text, Contains("Float frozen, 2 params"));
  // The tied model lists its tied parameter and the unit holding it.
  auto tied = tied_net()();
  tied.shard(FullyShardOptions().communicator(comm));
  CHECK_THAT(printed(fsdp::plan(*tied.module)), Contains("enc.weight = proj.weight in unit <root>\n"));
}

// The golden text of PlanNet(5, 7, {3}, 3) (units: blocks.0, the root) with AdamW, per world size
// and rank. Worked out by hand, fp32 (alignment 4 elements):
//   root:     in.weight [0, 35), in.bias [36, 43), head.weight [44, 65), head.bias [68, 71): 66
//             elements, aligned 71, padded to a multiple of W: 72 on 2, 3 and 4 ranks.
//   blocks.0: fc1.weight [0, 21), fc1.bias [24, 27), fc2.weight [28, 49), fc2.bias [52, 59): 52
//             elements, aligned 59, padded 60 on 2, 3 and 4 ranks.
//   Elements of parameters per rank (rank r holds [r * shard, (r + 1) * shard) of each):
//     W=2: root 35 | 31 (shard 36), block 26 | 26 (shard 30)
//     W=3: root 24 | 22 | 20 (shard 24), block 20 | 16 | 16 (shard 20)
//     W=4: root 18 | 17 | 17 | 14 (shard 18), block 15 | 11 | 15 | 11 (shard 15)
//   Sharded params = gradients = (root + block shard) x 4 B; AdamW = 2 x 4 B x the rank's elements.
//   Unsharded peak: the root's 72 x 4 = 288 B + one block (the only unit in flight) 60 x 4 = 240 B.
//   Gradient bound: each unit's padded gradient + its shard-sized reduce-scatter output.
//   Per step: all-gathers 288 + 240 (forward) + 240 (the block in backward) = 768 B in 3 calls;
//   reduce-scatters 288 + 240 = 528 B in 2 calls.
//   W=1: nothing sharded or communicated; autograd's own gradients (66 + 52) x 4 = 472 B; AdamW
//   2 x 4 x 118 = 944 B; shards 71 + 59 elements = 520 B.
std::string golden_text(int W, int r) {
  auto row = [](const std::string& label, const std::string& value) {
    return "  " + label + std::string(62 - label.size(), ' ') + value + "\n";
  };
  auto note = [](int n) { return n == 0 ? std::string() : " (" + std::to_string(n) + " of them parameters on this rank)"; };
  std::string text = "FSDP sharding plan: 2 units on " + std::to_string(W) + (W == 1 ? " rank" : " ranks") +
                     ", seen from rank " + std::to_string(r) + "; optimizer AdamW; max_unshards_in_flight 2\n"
                     "Units (nesting by indentation). Per handle: dtype, trainable or frozen, parameters, elements "
                     "(numel / aligned / padded), elements per rank, bytes per rank\n"
                     "  <root> (PlanNetImpl) FULL_SHARD, root: unsharded from forward to the end of backward\n";
  if (W == 1) {
    return text +
           "    handle 0: Float trainable, 4 params, 66 / 71 / 71 elements, 71 per rank = 284 B per rank (one rank: "
           "not sharded)\n"
           "    blocks.0 (PlanBlockImpl) FULL_SHARD\n"
           "      handle 0: Float trainable, 4 params, 52 / 59 / 59 elements, 59 per rank = 236 B per rank (one rank: "
           "not sharded)\n"
           "Memory per rank (rank 0):\n" +
           row("sharded parameters", "520 B") + row("sharded gradients", "472 B") +
           row("optimizer state (AdamW exp_avg, exp_avg_sq)", "944 B") + row("= sharded state", "1,936 B (1.9 KiB)") +
           row("unsharded parameters, peak", "0 B = root 0 B + kept from forward to backward 0 B + 0 largest units in "
                                             "flight 0 B") +
           row("unsharded gradients, at most", "0 B") +
           "  (plus the step, an int64_t in each parameter's state; not tensor memory)\n"
           "Communication per step (forward + backward with gradient sync), per rank, as counted:\n"
           "  all_gather_into_tensor  0 calls, 0 B\n"
           "  reduce_scatter_tensor   0 calls, 0 B\n"
           "  all_reduce              0 calls, 0 B\n";
  }
  struct PerRank {
    int root_note, block_note;     // elements of parameters on this rank, when less than the shard
    std::string optimizer, total;  // with the maximum over ranks where this rank's is less
  };
  struct PerWorld {
    int root_shard, block_shard;
    std::string params, gradient_bound;
    std::vector<PerRank> ranks;
  };
  const PerWorld w =
      W == 2 ? PerWorld{36, 30, "264 B", "792 B",
                        {{35, 26, "488 B", "1,016 B"}, {31, 26, "456 B; max over ranks 488 B", "984 B; max over ranks 1,016 B"}}}
      : W == 3 ? PerWorld{24, 20, "176 B", "704 B",
                          {{0, 0, "352 B", "704 B"},
                           {22, 16, "304 B; max over ranks 352 B", "656 B; max over ranks 704 B"},
                           {20, 16, "288 B; max over ranks 352 B", "640 B; max over ranks 704 B"}}}
               : PerWorld{18, 15, "132 B", "660 B",
                          {{0, 0, "264 B", "528 B"},
                           {17, 11, "224 B; max over ranks 264 B", "488 B; max over ranks 528 B"},
                           {17, 0, "256 B; max over ranks 264 B", "520 B; max over ranks 528 B"},
                           {14, 11, "200 B; max over ranks 264 B", "464 B; max over ranks 528 B"}}};
  const PerRank& mine = w.ranks.at(static_cast<size_t>(r));
  return text + "    handle 0: Float trainable, 4 params, 66 / 71 / 72 elements, " + std::to_string(w.root_shard) +
         " per rank" + note(mine.root_note) + " = " + std::to_string(4 * w.root_shard) +
         " B per rank; unsharded 288 B\n"
         "    blocks.0 (PlanBlockImpl) FULL_SHARD\n"
         "      handle 0: Float trainable, 4 params, 52 / 59 / 60 elements, " + std::to_string(w.block_shard) +
         " per rank" + note(mine.block_note) + " = " + std::to_string(4 * w.block_shard) +
         " B per rank; unsharded 240 B\n"
         "Memory per rank (rank " + std::to_string(r) + "):\n" +
         row("sharded parameters", w.params) + row("sharded gradients", w.params) +
         row("optimizer state (AdamW exp_avg, exp_avg_sq)", mine.optimizer) + row("= sharded state", mine.total) +
         row("unsharded parameters, peak", "528 B = root 288 B + kept from forward to backward 0 B + 1 largest unit "
                                           "in flight 240 B") +
         row("unsharded gradients, at most", w.gradient_bound) +
         "  (plus the step, an int64_t in each parameter's state; not tensor memory)\n"
         "Communication per step (forward + backward with gradient sync), per rank, as counted:\n"
         "  all_gather_into_tensor  3 calls, 768 B\n"
         "  reduce_scatter_tensor   2 calls, 528 B\n"
         "  all_reduce              1 call,  80 B\n";  // where the backward pass reaches each unit
}

FSDP_RANKS_TEST_CASE("the printed plan of a small model (golden)", "[plan]") {
  auto comm = std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
  Trainee t = plan_net({3})();
  const auto units = t.shard(FullyShardOptions().communicator(comm));
  const std::string text = printed(fsdp::plan(units.back(), PlanOptions().optimizer(PlanOptimizer::kAdamW)));
  const std::string expected = golden_text(world_size(), rank());
  CHECK(text == expected);
  if (text != expected) std::fprintf(stderr, "[plan] golden mismatch on rank %d, got:\n%s", rank(), text.c_str());
}

FSDP_RANKS_TEST_CASE("the printed plan names the codecs and the encoded bytes", "[plan][quantized_comm]") {
  const int W = world_size();
  auto comm = std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
  Trainee t = plan_net({3})();
  auto codec = fsdp::int8_block_codec(16);
  const auto units = t.shard(FullyShardOptions().communicator(comm).all_gather_codec(codec).reduce_codec(codec));
  const fsdp::ShardingPlan plan = fsdp::plan(units.back());
  const std::string text = printed(plan);
  INFO(text);
  CHECK_THAT(text, Catch::Matchers::Contains("all-gather codec int8_block(16, Float scales), reduce codec "
                                             "int8_block(16, Float scales)"));
  // The golden model's handles (72 and 60 padded elements): W x encoded_bytes(shard) per
  // all-gather (the block gathered twice, the root once); per all-to-all W x the bytes of the
  // handle's row layout, its blocks aligned to its parameters ([Note: codec row layouts]).
  int64_t gathered = 0, reduced = 0;
  for (int64_t padded : {72, 60}) gathered += (padded == 72 ? 1 : 2) * W * codec->encoded_bytes(padded / W);
  for (const auto& unit : units) {
    for (const auto& h : fsdp::detail::handles_of(unit)) {
      fsdp::CodecRowLayout rows;
      rows.numel = h->layout().shard_numel();
      rows.shards = W;
      for (const auto& e : h->layout().entries) rows.tensor_starts.push_back(e.offset);
      reduced += W * codec->encoded_bytes_with_layout(rows);
    }
  }
  CHECK(plan.communication.all_gather.bytes == (W > 1 ? gathered : 0));
  CHECK(plan.communication.all_to_all.bytes == (W > 1 ? reduced : 0));
  CHECK(plan.communication.reduce_scatter.calls == 0);
  if (W > 1) {
    CHECK_THAT(text, Catch::Matchers::Contains("all_to_all_single       2 calls, " + std::to_string(reduced) + " B"));
  }
}

FSDP_RANKS_TEST_CASE("plan refuses a module that is not the root unit, naming it", "[plan]") {
  auto comm = std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
  Trainee t = plan_net({3, 4})();
  auto* model = dynamic_cast<PlanNetImpl*>(t.module.get());
  REQUIRE(model != nullptr);
  const std::string not_a_unit = fsdp::testing::error_of([&] { fsdp::plan(*t.module); });
  CHECK_THAT(not_a_unit, Contains("fsdp::plan: module '<root>' (") && Contains("PlanNetImpl) is not a fully_shard unit"));
  const auto units = t.shard(FullyShardOptions().communicator(comm));
  const std::string inner = fsdp::testing::error_of([&] { fsdp::plan(units.front()); });
  CHECK_THAT(inner, Contains("fsdp::plan: module 'blocks.0' (") && Contains("PlanBlockImpl) is inside unit '<root>' (") &&
                        Contains("call plan on '<root>'"));
  CHECK_THAT(fsdp::testing::error_of([&] { fsdp::plan(units.back()); }), Contains("(no error)"));
}

// docs/composable_apis.md's example: the GPT of examples/ (4 blocks, d_model 128) with AdamW, printed on rank 0
// (test.log), and checked against one step like the cases above.
FSDP_RANKS_TEST_CASE("the example GPT's plan", "[plan][gpt]") {
  auto& alloc = fsdp::bench::CountingAllocator::install();
  Case c{"GPT d_model 128, 4 blocks", gpt(fsdp::examples::GPTConfig(/*vocab_size=*/65).n_layers(4).d_model(128)),
         FullyShardOptions(), PlanOptions().optimizer(PlanOptimizer::kAdamW)};
  Trainee t = c.make();
  FullyShardOptions options;
  const auto comms = communicators(c, options);
  alloc.mark();
  const auto units = t.shard(options);
  const auto plan = fsdp::plan(units.back(), c.plan);
  const std::string text = printed(plan);
  if (rank() == 0) std::fprintf(stderr, "[plan] the example GPT on %d ranks:\n%s", world_size(), text.c_str());
  for (const auto& fqn : {"<root> (GPTImpl)", "blocks.0 (BlockImpl)", "blocks.3 (BlockImpl)"}) CHECK_THAT(text, Contains(fqn));
  auto optimizer = make_optimizer(c.plan, t.module->parameters());
  measured_since(comms);
  t.loss().backward();
  optimizer->step();
  check_equal(measured_since(comms), plan.communication);
  world().barrier();  // see the first test case
  CHECK(alloc.current_since_mark() == plan.memory.sharded_state_bytes());
}

}  // namespace
