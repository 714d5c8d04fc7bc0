// replicate over MPI on every world size of the launch: training parity against an unsharded
// reference whose gradients are averaged over every rank's batch (DDP semantics, computed
// without the library), bucket layout and overlap, gradient accumulation, unused parameters,
// composition with fully_shard, errors and sync_module_states (broadcast_module_states).
#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/fully_shard_internal.h"
#include "fsdp_cpp/composable/replicate.h"
#include "fsdp_cpp/contract/forward_hooks.h"
#include "fsdp_cpp/contract/module_state.h"
#include "fsdp_cpp/tests/composable/test_models.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::comm::CollectiveKind;
using fsdp::testing::fresh_comm;
using fsdp::testing::rank;
using fsdp::testing::world;
using fsdp::testing::world_size;

enum class Optim { kSgdMomentum, kAdam };

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Optim kind, const std::vector<at::Tensor>& params) {
  if (kind == Optim::kSgdMomentum) {
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9));
  }
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2));
}

at::Tensor batch(int64_t step, int q, int64_t rows, int64_t cols, int salt) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(100000 * salt + 100 * step + q));
  return at::randn({rows, cols}, gen);
}

// A model and how to run it on rank q's batch.
struct Instance {
  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor(at::Tensor, int)> forward;
  std::vector<fsdp::FSDPModule> units;  // fully_shard units inside it, if any (composition)
};

struct Model {
  std::string name;
  int64_t in_dim;
  int64_t out_dim;
  std::function<Instance()> make;
  // Applies the APIs under test to a fresh instance (fully_shard units go into inst.units).
  std::function<fsdp::ReplicateModule(Instance&, const fsdp::ReplicateOptions&)> apply;
};

struct RunOptions {
  Optim optim = Optim::kAdam;
  int iterations = 4;
  /// Backward passes per optimizer step: all but the last without gradient sync.
  int micro_batches = 1;
  /// zero_grad after each step (false: gradients accumulate across steps, on both sides).
  bool zero_grad = true;
  bool set_to_none = true;
  double bucket_cap_mb = 25.0;
  /// Collectives per optimizer step beyond replicate's buckets (fully_shard units).
  int64_t extra_all_reduces = 0;
  int64_t all_gathers = 0;
  int64_t reduce_scatters = 0;
  /// Expected buckets issued at the end of backward per synced pass (-1: do not check).
  int64_t buckets_at_end = 0;
};

struct RunResult {
  size_t num_buckets = 0;
  fsdp::ReplicateStats stats;
};

// Trains the replicated model on this rank's batches and an unsharded reference on every rank's
// batches (loss / W per rank: the averaged gradient), and compares losses every iteration and
// parameters at the end: bit-exact on one rank, within fp32 tolerance otherwise.
RunResult run_parity(const Model& m, const RunOptions& o) {
  const int W = world_size();
  INFO(m.name << ", optimizer " << static_cast<int>(o.optim) << ", " << o.micro_batches
               << " micro-batch(es), zero_grad " << o.zero_grad << ", bucket_cap_mb " << o.bucket_cap_mb
               << ", " << W << " ranks");
  const bool exact = W == 1;
  auto close = [&](const at::Tensor& a, const at::Tensor& b) {
    return exact ? a.equal(b) : at::allclose(a, b, 1e-5, 1e-6);
  };
  torch::manual_seed(1234);
  Instance model = m.make();
  torch::manual_seed(1234);
  Instance reference = m.make();
  std::vector<std::string> keys_before;
  std::vector<const void*> impls_before;
  for (const auto& item : model.module->named_parameters()) {
    keys_before.push_back(item.key());
    impls_before.push_back(item.value().unsafeGetTensorImpl());
  }

  auto comm = fresh_comm();
  fsdp::ReplicateModule replicated =
      m.apply(model, fsdp::ReplicateOptions().communicator(comm).bucket_cap_mb(o.bucket_cap_mb));
  CHECK(fsdp::replicate_module_of(*model.module).has_value());
  auto opt = make_optimizer(o.optim, model.module->parameters());
  auto ref_opt = make_optimizer(o.optim, reference.module->parameters());

  const int64_t rows = 5;
  for (int64_t it = 0; it < o.iterations; ++it) {
    const auto ar_before = comm->stats(CollectiveKind::kAllReduce).calls;
    const auto ag_before = comm->stats(CollectiveKind::kAllGather).calls;
    const auto rs_before = comm->stats(CollectiveKind::kReduceScatter).calls;
    const auto stats_before = replicated.stats();
    at::Tensor loss;
    for (int mb = 0; mb < o.micro_batches; ++mb) {
      replicated.set_requires_gradient_sync(mb + 1 == o.micro_batches);
      for (auto& u : model.units) u.set_requires_gradient_sync(mb + 1 == o.micro_batches);
      const int64_t step = it * o.micro_batches + mb;
      loss = torch::nn::functional::mse_loss(model.forward(batch(step, rank(), rows, m.in_dim, 1), rank()),
                                             batch(step, rank(), rows, m.out_dim, 2));
      loss.backward();
      if (mb + 1 < o.micro_batches) {
        CHECK(comm->stats(CollectiveKind::kAllReduce).calls == ar_before);  // nothing without sync
      }
    }
    opt->step();
    if (o.zero_grad) opt->zero_grad(o.set_to_none);

    at::Tensor ref_loss;
    for (int mb = 0; mb < o.micro_batches; ++mb) {
      const int64_t step = it * o.micro_batches + mb;
      for (int q = 0; q < W; ++q) {
        at::Tensor lq = torch::nn::functional::mse_loss(reference.forward(batch(step, q, rows, m.in_dim, 1), q),
                                                        batch(step, q, rows, m.out_dim, 2));
        (lq / W).backward();
        if (q == rank()) ref_loss = lq.detach();
      }
    }
    ref_opt->step();
    if (o.zero_grad) ref_opt->zero_grad(o.set_to_none);

    INFO("iteration " << it << ": loss " << loss.item<double>() << ", reference " << ref_loss.item<double>());
    CHECK(close(loss.detach(), ref_loss));
    // One all-reduce per bucket per synced backward pass, and the units' own collectives; counted
    // from the second iteration (the first exchanges the units' forward order).
    const auto buckets = static_cast<int64_t>(replicated.num_buckets());
    CHECK(buckets > 0);
    if (it >= 1) {
      CHECK(comm->stats(CollectiveKind::kAllReduce).calls - ar_before == buckets + o.extra_all_reduces);
      CHECK(comm->stats(CollectiveKind::kAllGather).calls - ag_before == o.all_gathers);
      CHECK(comm->stats(CollectiveKind::kReduceScatter).calls - rs_before == o.reduce_scatters);
    }
    const auto stats = replicated.stats();
    CHECK(stats.synced_backward_passes - stats_before.synced_backward_passes == 1);
    if (o.buckets_at_end >= 0) {
      CHECK(stats.buckets_issued_at_end_of_backward - stats_before.buckets_issued_at_end_of_backward == o.buckets_at_end);
      CHECK(stats.buckets_issued_during_backward - stats_before.buckets_issued_during_backward ==
            buckets - o.buckets_at_end);
    }
    for (const auto& u : model.units) {
      for (const auto& h : fsdp::detail::handles_of(u)) CHECK(h->unsharded_bytes() == 0);
    }
  }

  // FQNs and parameter objects unchanged; values equal the reference's.
  std::vector<std::string> keys_after;
  std::vector<const void*> impls_after;
  for (const auto& item : model.module->named_parameters()) {
    keys_after.push_back(item.key());
    impls_after.push_back(item.value().unsafeGetTensorImpl());
  }
  CHECK(keys_after == keys_before);
  CHECK(impls_after == impls_before);
  for (auto& u : model.units) u.unshard();
  const auto ref_params = reference.module->named_parameters();
  for (const auto& item : model.module->named_parameters()) {
    INFO("parameter " << item.key());
    const at::Tensor& ref = ref_params[item.key()];
    REQUIRE(item.value().sizes() == ref.sizes());
    CHECK(close(item.value().detach(), ref.detach()));
    // Gradients: defined exactly where the reference's are (a parameter no rank used has none).
    if (!o.zero_grad || !o.set_to_none) CHECK(item.value().grad().defined() == ref.grad().defined());
  }
  for (auto& u : model.units) u.reshard();
  return {replicated.num_buckets(), replicated.stats()};
}

// MlpStack(6, 8, 16, 3, 3): in, three residual MLP blocks, head; 17 parameters.
Model mlp_stack() {
  return {"MLP stack", 6, 3,
          [] {
            auto model = fsdp::testing::MlpStack(6, 8, 16, 3, 3);
            return Instance{model.ptr(), [model](at::Tensor x, int) mutable { return model(x); }, {}};
          },
          [](Instance& inst, const fsdp::ReplicateOptions& o) {
            auto model = std::dynamic_pointer_cast<fsdp::testing::MlpStackImpl>(inst.module);
            return fsdp::replicate(fsdp::testing::MlpStack(model), o);
          }};
}

// Branch(4): v(gate(w(x))), where gate.fc runs only when `use(q)` holds on rank q.
Model branch(std::string name, std::function<bool(int)> use) {
  return {std::move(name), 4, 4,
          [use] {
            auto model = fsdp::testing::Branch(4);
            return Instance{model.ptr(), [model, use](at::Tensor x, int q) mutable { return model(x, use(q)); }, {}};
          },
          [](Instance& inst, const fsdp::ReplicateOptions& o) {
            auto model = std::dynamic_pointer_cast<fsdp::testing::BranchImpl>(inst.module);
            return fsdp::replicate(fsdp::testing::Branch(model), o);
          }};
}

// A float Linear scaled by a double parameter: two dtypes, so at least two buckets.
struct MixedDtypeImpl : torch::nn::Module {
  MixedDtypeImpl() {
    fc = register_module("fc", fsdp::contract::Linear(4, 4));
    scale = register_parameter("scale", torch::rand({4}, at::kDouble) + 0.5);
    out = register_module("out", fsdp::contract::Linear(4, 2));
  }
  torch::Tensor forward(torch::Tensor x) { return out(fc(x) * scale.to(at::kFloat)); }
  fsdp::contract::Linear fc{nullptr};
  torch::Tensor scale;
  fsdp::contract::Linear out{nullptr};
};
FSDP_HOOKABLE_MODULE(MixedDtype);

Model mixed_dtype() {
  return {"float and double parameters", 4, 2,
          [] {
            MixedDtype model;
            return Instance{model.ptr(), [model](at::Tensor x, int) mutable { return model(x); }, {}};
          },
          [](Instance& inst, const fsdp::ReplicateOptions& o) {
            return fsdp::replicate(MixedDtype(std::dynamic_pointer_cast<MixedDtypeImpl>(inst.module)), o);
          }};
}

// fully_shard on every block (before or after replicate on the root), replicate on the root.
Model composed(fsdp::ShardingStrategy strategy, bool shard_first) {
  return {std::string("fully_shard blocks + replicate root, strategy ") + std::to_string(static_cast<int>(strategy)) +
              (shard_first ? ", blocks first" : ", root first"),
          6, 3,
          [] {
            auto model = fsdp::testing::MlpStack(6, 8, 16, 3, 3);
            return Instance{model.ptr(), [model](at::Tensor x, int) mutable { return model(x); }, {}};
          },
          [strategy, shard_first](Instance& inst, const fsdp::ReplicateOptions& o) {
            fsdp::testing::MlpStack model(std::dynamic_pointer_cast<fsdp::testing::MlpStackImpl>(inst.module));
            const auto so = fsdp::FullyShardOptions().communicator(o.communicator()).strategy(strategy);
            auto shard_blocks = [&] {
              for (size_t i = 0; i < model->blocks->size(); ++i) inst.units.push_back(fsdp::fully_shard(model->block(i), so));
            };
            if (shard_first) shard_blocks();
            auto replicated = fsdp::replicate(model, o);
            if (!shard_first) shard_blocks();
            return replicated;
          }};
}

std::vector<std::string> keys_of(const torch::nn::Module& m) {
  std::vector<std::string> keys;
  for (const auto& item : m.named_parameters()) keys.push_back(item.key());
  return keys;
}

int64_t bytes_of(const torch::nn::Module& m, const std::string& fqn) {
  const at::Tensor p = m.named_parameters()[fqn];
  return p.numel() * static_cast<int64_t>(p.element_size());
}

}  // namespace

FSDP_RANKS_TEST_CASE("replicate: parity with several buckets and with one bucket", "[replicate][parity]") {
  for (Optim optim : {Optim::kSgdMomentum, Optim::kAdam}) {
    RunOptions o;
    o.optim = optim;
    o.bucket_cap_mb = 200.0 / (1024 * 1024);  // 200 bytes: several parameters per bucket
    const auto several = run_parity(mlp_stack(), o);
    CHECK(several.num_buckets > 2);
    o.bucket_cap_mb = 25;
    const auto one = run_parity(mlp_stack(), o);
    CHECK(one.num_buckets == 1);
    o.bucket_cap_mb = 1e-9;  // a bucket per parameter
    const auto each = run_parity(mlp_stack(), o);
    CHECK(each.num_buckets == 16);  // in, 3 blocks x (fc1, fc2) and head: weights and biases
  }
}

FSDP_RANKS_TEST_CASE("replicate: buckets in reverse registration order, closed at bucket_cap_mb", "[replicate][buckets]") {
  auto model = fsdp::testing::MlpStack(6, 8, 16, 3, 3);
  const int64_t cap = 200;
  auto replicated = fsdp::replicate(model, fsdp::ReplicateOptions().communicator(fresh_comm()).bucket_cap_mb(cap / 1048576.0));
  CHECK(replicated.num_buckets() == 0);  // decided at the first forward
  model(at::ones({2, 6}));
  auto keys = keys_of(*model);
  std::reverse(keys.begin(), keys.end());
  std::vector<std::string> in_buckets;
  const auto& buckets = replicated.buckets();
  for (size_t b = 0; b < buckets.size(); ++b) {
    INFO("bucket " << b);
    int64_t bytes = 0;
    int64_t numel = 0;
    for (const auto& fqn : buckets[b].fqns) {
      in_buckets.push_back(fqn);
      bytes += bytes_of(*model, fqn);
      numel += model->named_parameters()[fqn].numel();
    }
    CHECK(buckets[b].numel == numel);
    CHECK(buckets[b].dtype == at::kFloat);
    // Closed by the parameter that reached the cap; only the last may stay below it.
    CHECK(bytes - bytes_of(*model, buckets[b].fqns.back()) < cap);
    if (b + 1 < buckets.size()) CHECK(bytes >= cap);
  }
  CHECK(in_buckets == keys);
  CHECK(replicated.replicated_parameter_fqns() == keys_of(*model));
  // The first bucket holds the last parameters: head.bias (12 B), head.weight (96 B),
  // blocks.2.fc2.bias (32 B), blocks.2.fc2.weight (512 B) reach 200 bytes.
  CHECK(buckets.front().fqns ==
        std::vector<std::string>{"head.bias", "head.weight", "blocks.2.fc2.bias", "blocks.2.fc2.weight"});
}

FSDP_RANKS_TEST_CASE("replicate: buckets are issued during backward as soon as they are ready", "[replicate][overlap]") {
  RunOptions o;
  o.bucket_cap_mb = 200.0 / (1024 * 1024);
  o.buckets_at_end = 0;  // every parameter gets its gradient: no bucket waits for the end
  const auto r = run_parity(mlp_stack(), o);
  CHECK(r.stats.buckets_issued_during_backward == static_cast<int64_t>(r.num_buckets) * o.iterations);
}

FSDP_RANKS_TEST_CASE("replicate: gradient accumulation without sync over micro-batches", "[replicate][accumulation]") {
  for (Optim optim : {Optim::kSgdMomentum, Optim::kAdam}) {
    for (double cap : {200.0 / (1024 * 1024), 25.0}) {
      RunOptions o;
      o.optim = optim;
      o.micro_batches = 3;
      o.bucket_cap_mb = cap;
      run_parity(mlp_stack(), o);
    }
  }
}

FSDP_RANKS_TEST_CASE("replicate: gradients kept across steps accumulate averaged gradients", "[replicate][accumulation]") {
  for (Optim optim : {Optim::kSgdMomentum, Optim::kAdam}) {
    RunOptions o;
    o.optim = optim;
    o.bucket_cap_mb = 200.0 / (1024 * 1024);
    o.zero_grad = false;  // .grad from the previous step is defined when backward runs
    run_parity(mlp_stack(), o);
    o.zero_grad = true;
    o.set_to_none = false;  // zeroed in place
    run_parity(mlp_stack(), o);
  }
}

FSDP_RANKS_TEST_CASE("replicate: parameters unused in forward", "[replicate][unused]") {
  for (Optim optim : {Optim::kSgdMomentum, Optim::kAdam}) {
    for (bool set_to_none : {true, false}) {
      RunOptions o;
      o.optim = optim;
      o.set_to_none = set_to_none;
      o.bucket_cap_mb = 1e-9;  // a bucket per parameter: w.weight, w.bias, gate.fc.*, v.* reversed
      // gate.fc unused on every rank: its .grad stays undefined (set_to_none) as in the reference;
      // its buckets and the two after them (w.*) wait for the end of backward.
      o.buckets_at_end = 4;
      run_parity(branch("gate.fc unused on every rank", [](int) { return false; }), o);
      // gate.fc unused on rank 0 only: rank 0 contributes zeros (on 1 rank: unused everywhere).
      o.buckets_at_end = -1;
      run_parity(branch("gate.fc unused on rank 0", [](int q) { return q != 0; }), o);
      o.bucket_cap_mb = 25;
      o.buckets_at_end = 1;
      run_parity(branch("gate.fc unused on every rank, one bucket", [](int) { return false; }), o);
    }
  }
}

FSDP_RANKS_TEST_CASE("replicate: parameters of several dtypes go to separate buckets", "[replicate][buckets]") {
  RunOptions o;
  const auto r = run_parity(mixed_dtype(), o);
  CHECK(r.num_buckets == 2);
  MixedDtype model;
  auto replicated = fsdp::replicate(model, fsdp::ReplicateOptions().communicator(fresh_comm()));
  model(at::ones({1, 4}));
  REQUIRE(replicated.num_buckets() == 2);
  CHECK(replicated.buckets()[0].dtype == at::kFloat);
  CHECK(replicated.buckets()[0].fqns == std::vector<std::string>{"out.bias", "out.weight", "fc.bias", "fc.weight"});
  CHECK(replicated.buckets()[1].dtype == at::kDouble);
  CHECK(replicated.buckets()[1].fqns == std::vector<std::string>{"scale"});
}

FSDP_RANKS_TEST_CASE("replicate on the root + fully_shard on the blocks", "[replicate][composition]") {
  const int W = world_size();
  for (auto strategy : {fsdp::ShardingStrategy::kFullShard, fsdp::ShardingStrategy::kShardGradOp,
                        fsdp::ShardingStrategy::kNoShard}) {
    for (bool shard_first : {true, false}) {
      for (Optim optim : {Optim::kSgdMomentum, Optim::kAdam}) {
        RunOptions o;
        o.optim = optim;
        o.bucket_cap_mb = 1e-9;  // in.weight, in.bias, head.weight, head.bias: 4 buckets
        // Each block is its own fully_shard root (no unit above it) running inside the replicated
        // model's forward, so it reshards after forward like any unit: FULL_SHARD all-gathers
        // it in forward and again in backward, SHARD_GRAD_OP once; one reduce-scatter; NO_SHARD:
        // one all-reduce. On one rank a unit communicates nothing. Each root's backward pass
        // also begins with one small all-reduce ([Note: backward reach] in fsdp/backward_reach.h).
        const int64_t blocks = W > 1 ? 3 : 0;
        if (strategy == fsdp::ShardingStrategy::kNoShard) {
          o.extra_all_reduces = 2 * blocks;
        } else {
          o.extra_all_reduces = blocks;
          o.all_gathers = strategy == fsdp::ShardingStrategy::kFullShard ? 2 * blocks : blocks;
          o.reduce_scatters = blocks;
        }
        const Model m = composed(strategy, shard_first);
        run_parity(m, o);
      }
    }
  }
  // Only the root's own parameters are replicated.
  auto comm = fresh_comm();
  auto model = fsdp::testing::MlpStack(6, 8, 16, 3, 3);
  for (size_t i = 0; i < 3; ++i) fsdp::fully_shard(model->block(i), fsdp::FullyShardOptions().communicator(comm));
  auto replicated = fsdp::replicate(model, fsdp::ReplicateOptions().communicator(comm));
  model(at::ones({2, 6})).sum().backward();
  CHECK(replicated.replicated_parameter_fqns() ==
        std::vector<std::string>{"in.weight", "in.bias", "head.weight", "head.bias"});
}

FSDP_RANKS_TEST_CASE("replicate errors name the APIs and leave the model unchanged", "[replicate][errors]") {
  auto comm = fresh_comm();
  const auto o = fsdp::ReplicateOptions().communicator(comm);
  auto& registry = fsdp::contract::ModuleStateRegistry::global();
  auto snapshot = [](const torch::nn::Module& m) {
    std::vector<at::Tensor> values;
    for (const auto& p : m.parameters()) values.push_back(p.detach().clone());
    return values;
  };
  auto same = [](const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i) {
      if (!a[i].equal(b[i])) return false;
    }
    return true;
  };

  {  // Twice: the contract's error.
    auto model = fsdp::testing::MlpStack(4, 8, 8, 2, 2);
    fsdp::replicate(model, o);
    const auto values = snapshot(*model);
    const size_t hooks = fsdp::contract::num_forward_pre_hooks(*model);
    CHECK_THROWS_WITH(fsdp::replicate(model, o), Contains("replicate: module '<root>' (fsdp::testing::MlpStackImpl) already has "
                                                          "replicate applied"));
    CHECK(fsdp::contract::num_forward_pre_hooks(*model) == hooks);
    CHECK(same(values, snapshot(*model)));
  }
  {  // On a module with fully_shard: names both APIs.
    auto model = fsdp::testing::MlpStack(4, 8, 8, 2, 2);
    fsdp::fully_shard(model, fsdp::FullyShardOptions().communicator(comm));
    const auto keys = keys_of(*model);
    const auto values = snapshot(*model);
    const size_t hooks = fsdp::contract::num_forward_pre_hooks(*model);
    CHECK_THROWS_WITH(fsdp::replicate(model, o), Contains("replicate: module '<root>' (fsdp::testing::MlpStackImpl) already has "
                                                          "fully_shard applied"));
    CHECK(keys_of(*model) == keys);
    CHECK(same(values, snapshot(*model)));
    CHECK(fsdp::contract::num_forward_pre_hooks(*model) == hooks);
    CHECK(registry.apis_of(*model) == std::vector<std::string>{"fully_shard"});
    // Inside a fully_shard unit.
    auto block = model->block(1);
    CHECK_THROWS_WITH(fsdp::replicate(block, o), Contains("replicate: module 'blocks.1' (fsdp::testing::MlpBlockImpl) is inside "
                                                          "'<root>' (fsdp::testing::MlpStackImpl), which fully_shard"));
    CHECK(registry.apis_of(*block).empty());
    // The model still trains.
    model(at::ones({2, 4})).sum().backward();
  }
  {  // Nested replicate, both ways.
    auto model = fsdp::testing::MlpStack(4, 8, 8, 2, 2);
    fsdp::replicate(model->block(0), o);
    CHECK_THROWS_WITH(fsdp::replicate(model, o), Contains("replicate: module '<root>' (fsdp::testing::MlpStackImpl) contains "
                                                          "'blocks.0' (fsdp::testing::MlpBlockImpl), which replicate"));
    auto other = fsdp::testing::MlpStack(4, 8, 8, 2, 2);
    fsdp::replicate(other, o);
    CHECK_THROWS_WITH(fsdp::replicate(other->block(1), o), Contains("is inside '<root>' (fsdp::testing::MlpStackImpl), which replicate"));
    CHECK(registry.apis_of(*other->block(1)).empty());
  }
  {  // fully_shard inside after replicate's first forward: refused at the next forward.
    auto model = fsdp::testing::MlpStack(4, 8, 8, 2, 2);
    fsdp::replicate(model, o);
    model(at::ones({2, 4})).sum().backward();
    fsdp::fully_shard(model->block(0), fsdp::FullyShardOptions().communicator(comm));
    CHECK_THROWS_WITH(model(at::ones({2, 4})), Contains("replicate: parameter 'blocks.0.fc1.weight'") &&
                                                   Contains("fully_shard unit") && Contains("applied later"));
  }
}

TEST_CASE("ReplicateOptions: broadcast_module_states is another name of sync_module_states", "[replicate][options]") {
  fsdp::ReplicateOptions options;
  CHECK(options.sync_module_states());  // on by default, as DDP broadcasts at construction
  CHECK(options.broadcast_module_states() == options.sync_module_states());
  options.broadcast_module_states(false);
  CHECK_FALSE(options.sync_module_states());
  options.sync_module_states(true);
  CHECK(options.broadcast_module_states());
  CHECK_FALSE(fsdp::ReplicateOptions().bucket_cap_mb(4).broadcast_module_states(false).sync_module_states());
}

FSDP_RANKS_TEST_CASE("replicate: sync_module_states makes differently initialised ranks start equal",
                     "[replicate][broadcast]") {
  auto comm = fresh_comm();
  const int W = world_size();
  auto make = [](int seed) {
    torch::manual_seed(seed);
    return fsdp::testing::WithBuffer(5);
  };
  auto rank0 = make(1000);  // what every rank should start from
  auto model = make(1000 + rank());
  fsdp::replicate(model, fsdp::ReplicateOptions().communicator(comm));
  CHECK(model->fc->weight.equal(rank0->fc->weight));
  CHECK(model->fc->bias.equal(rank0->fc->bias));
  CHECK(model->running.equal(rank0->running));
  CHECK(comm->stats(CollectiveKind::kBroadcast).calls == 1);  // one dtype: one broadcast

  // Trains like an unsharded model started from rank 0's values.
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD ref_opt(rank0->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int64_t step = 0; step < 3; ++step) {
    model(batch(step, rank(), 3, 5, 1)).pow(2).mean().backward();
    opt.step();
    opt.zero_grad();
    for (int q = 0; q < W; ++q) (rank0(batch(step, q, 3, 5, 1)).pow(2).mean() / W).backward();
    ref_opt.step();
    ref_opt.zero_grad();
  }
  CHECK(at::allclose(model->fc->weight, rank0->fc->weight, 1e-5, 1e-6));
  CHECK(at::allclose(model->fc->bias, rank0->fc->bias, 1e-5, 1e-6));

  // Without the broadcast, each rank keeps its own values.
  auto own = make(1000 + rank());
  const at::Tensor before = own->fc->weight.detach().clone();
  fsdp::replicate(own, fsdp::ReplicateOptions().communicator(comm).sync_module_states(false));
  CHECK(own->fc->weight.equal(before));
  CHECK(comm->stats(CollectiveKind::kBroadcast).calls == 1);
}

FSDP_RANKS_TEST_CASE("replicate: forwards without backward communicate nothing", "[replicate][eval]") {
  auto comm = fresh_comm();
  auto model = fsdp::testing::MlpStack(4, 8, 8, 2, 2);
  auto replicated = fsdp::replicate(model, fsdp::ReplicateOptions().communicator(comm).bucket_cap_mb(1e-9));
  {
    torch::NoGradGuard no_grad;
    model(at::ones({2, 4}));
  }
  model(at::ones({2, 4}));  // grad mode on, but no backward
  CHECK(comm->stats(CollectiveKind::kAllReduce).calls == 0);
  CHECK(replicated.num_buckets() == 12);
  // The next backward syncs once: one all-reduce per bucket, every gradient averaged.
  model(batch(0, rank(), 2, 4, 1)).sum().backward();
  CHECK(comm->stats(CollectiveKind::kAllReduce).calls == 12);
  CHECK(replicated.stats().synced_backward_passes == 1);
  // Closed form for head.bias: d(sum)/d(bias) = rows on every rank, so the average is rows too.
  CHECK(model->head->bias.grad().equal(at::full({2}, 2.0)));
}
