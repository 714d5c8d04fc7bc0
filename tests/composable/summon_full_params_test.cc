// SummonFullParams over MPI on every world size, against an unsharded reference model with the same
// initial weights (its gradients averaged over every rank's batch, DDP semantics): full values and
// shapes inside the scope, exact restoration after it, writeback of edits (and training parity
// after them), writeback off, rank0_only, offload_to_cpu, full gradients (synchronised and
// accumulated without sync), mixed precision, refused nesting and use inside an iteration, and
// unsharded_shape on every rank (ranks holding none of a parameter too).
#include <functional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/composable/fully_shard_internal.h"
#include "fsdp_cpp/composable/summon_full_params.h"
#include "fsdp_cpp/tests/composable/parity.h"
#include "fsdp_cpp/tests/composable/test_models.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::testing::fresh_comm;
using fsdp::testing::MlpStack;
using fsdp::testing::rank;
using fsdp::testing::world;
using fsdp::testing::world_size;

fsdp::FullyShardOptions options(fsdp::ShardingStrategy strategy = fsdp::ShardingStrategy::kFullShard) {
  return fsdp::FullyShardOptions().communicator(fresh_comm()).strategy(strategy);
}

at::Tensor batch(int iteration, int q, int64_t cols, int salt) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(1000 * salt + 10 * iteration + q));
  return at::randn({4, cols}, gen);
}

// A sharded MlpStack (a unit per block and the root) and an unsharded copy with the same weights.
struct Pair {
  MlpStack model{nullptr};
  MlpStack reference{nullptr};
  std::vector<fsdp::FSDPModule> units;  // the root last
  fsdp::FSDPModule& root() { return units.back(); }
};

Pair make_pair(uint64_t seed, const fsdp::FullyShardOptions& opts) {
  Pair p;
  torch::manual_seed(seed);
  p.model = MlpStack(6, 8, 16, 3, 3);
  torch::manual_seed(seed);
  p.reference = MlpStack(6, 8, 16, 3, 3);
  p.units = fsdp::testing::shard_stack(p.model, opts);
  return p;
}

// This rank's loss, backpropagated through the sharded model.
void backward_sharded(MlpStack& model, int iteration) {
  torch::nn::functional::mse_loss(model(batch(iteration, rank(), 6, 1)), batch(iteration, rank(), 3, 2)).backward();
}

// Every rank's loss, averaged, backpropagated through the reference (DDP's averaged gradients).
void backward_reference(MlpStack& reference, int iteration) {
  const int W = world_size();
  for (int q = 0; q < W; ++q) {
    (torch::nn::functional::mse_loss(reference(batch(iteration, q, 6, 1)), batch(iteration, q, 3, 2)) / W).backward();
  }
}

bool close(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && at::allclose(a, b, 1e-5, 1e-6);
}

// Inside a with_grads scope, every full gradient equals the reference's.
void check_full_grads_match_reference(Pair& p) {
  fsdp::SummonFullParams grads(p.root(), fsdp::SummonFullParamsOptions().with_grads(true).writeback(false));
  const auto ref = p.reference->named_parameters();
  for (const auto& item : p.model->named_parameters()) {
    INFO(item.key());
    CHECK(close(item.value().grad(), ref[item.key()].grad()));
  }
}

// What a parameter and its gradient look like (to check the scope restores them exactly).
struct Snapshot {
  std::vector<const void*> data, grad;
  std::vector<std::vector<int64_t>> shape, grad_shape;
};

Snapshot snapshot(torch::nn::Module& m) {
  Snapshot s;
  for (const auto& p : m.parameters()) {
    s.data.push_back(p.data_ptr());
    s.shape.push_back(p.sizes().vec());
    s.grad.push_back(p.grad().defined() ? p.grad().data_ptr() : nullptr);
    s.grad_shape.push_back(p.grad().defined() ? p.grad().sizes().vec() : std::vector<int64_t>{-1});
  }
  return s;
}

void check_restored(torch::nn::Module& m, const Snapshot& before) {
  const Snapshot after = snapshot(m);
  CHECK(after.data == before.data);
  CHECK(after.shape == before.shape);
  CHECK(after.grad == before.grad);
  CHECK(after.grad_shape == before.grad_shape);
}

void check_no_unsharded_storage(const std::vector<fsdp::FSDPModule>& units) {
  for (const auto& u : units) {
    for (const auto& h : fsdp::detail::handles_of(u)) CHECK(h->unsharded_bytes() == 0);
  }
}

const std::vector<fsdp::ShardingStrategy> kStrategies = {
    fsdp::ShardingStrategy::kFullShard, fsdp::ShardingStrategy::kShardGradOp, fsdp::ShardingStrategy::kNoShard};

}  // namespace

FSDP_RANKS_TEST_CASE("inside the scope every parameter has its original shape and full values", "[summon]") {
  for (auto strategy : kStrategies) {
    INFO("strategy " << static_cast<int>(strategy));
    Pair p = make_pair(51, options(strategy));
    // Train a step so values differ from the initialisation, then compare with the reference.
    torch::optim::SGD opt(p.model->parameters(), torch::optim::SGDOptions(0.1));
    torch::optim::SGD ref_opt(p.reference->parameters(), torch::optim::SGDOptions(0.1));
    backward_sharded(p.model, 0);
    backward_reference(p.reference, 0);
    opt.step();
    ref_opt.step();
    const auto state = fsdp::full_state_dict(p.root(), fsdp::FullStateDictOptions().rank0_only(false));
    const Snapshot before = snapshot(*p.model);
    {
      fsdp::SummonFullParams full(p.root());
      CHECK(full.active());
      const auto params = p.model->named_parameters();
      const auto expected = p.reference->named_parameters();
      REQUIRE(params.keys() == expected.keys());
      for (const auto& item : params) {
        INFO(item.key());
        CHECK(item.value().sizes() == expected[item.key()].sizes());
        CHECK(item.value().scalar_type() == at::kFloat);
        CHECK(item.value().equal(state[item.key()]));
        CHECK(close(item.value(), expected[item.key()]));
      }
      // The module members are the same objects.
      CHECK(p.model->head->weight.sizes() == at::IntArrayRef({3, 8}));
      CHECK(p.model->block(1)->fc1->weight.sizes() == at::IntArrayRef({16, 8}));
    }
    check_restored(*p.model, before);
    if (strategy == fsdp::ShardingStrategy::kFullShard) check_no_unsharded_storage(p.units);
    // Training goes on as before.
    opt.zero_grad();
    ref_opt.zero_grad();
    backward_sharded(p.model, 1);
    backward_reference(p.reference, 1);
    opt.step();
    ref_opt.step();
    const at::Tensor x = batch(7, 0, 6, 3);
    CHECK(close(p.model(x), p.reference(x)));
  }
}

FSDP_RANKS_TEST_CASE("edits with writeback reach every rank's shard and training continues in parity", "[summon]") {
  for (auto strategy : kStrategies) {
    INFO("strategy " << static_cast<int>(strategy));
    Pair p = make_pair(52, options(strategy));
    const auto edit = [](MlpStack& m) {
      torch::NoGradGuard no_grad;
      m->head->weight.mul_(0.5);
      m->block(0)->fc1->bias.add_(1.0);
      m->block(2)->fc2->weight.copy_(at::arange(16 * 8, at::kFloat).view({8, 16}) / 100.0);
      m->in->bias.fill_(-0.25);
    };
    {
      fsdp::SummonFullParams full(p.root());
      edit(p.model);
      // Replacing a full parameter by a tensor of the same shape is written back too.
      p.model->block(1)->fc2->bias.set_data(at::full({8}, 0.75));
    }
    edit(p.reference);
    {
      torch::NoGradGuard no_grad;
      p.reference->block(1)->fc2->bias.fill_(0.75);
    }
    const at::Tensor x = batch(3, 1, 6, 4);
    CHECK(close(p.model(x), p.reference(x)));
    torch::optim::SGD opt(p.model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    torch::optim::SGD ref_opt(p.reference->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int it = 0; it < 2; ++it) {
      backward_sharded(p.model, it);
      backward_reference(p.reference, it);
      opt.step();
      ref_opt.step();
      opt.zero_grad();
      ref_opt.zero_grad();
    }
    CHECK(close(p.model(x), p.reference(x)));
    const auto state = fsdp::full_state_dict(p.root(), fsdp::FullStateDictOptions().rank0_only(false));
    for (const auto& item : p.reference->named_parameters()) {
      INFO(item.key());
      CHECK(close(state[item.key()], item.value()));
    }
  }
}

FSDP_RANKS_TEST_CASE("without writeback edits are discarded", "[summon]") {
  for (auto strategy : kStrategies) {
    INFO("strategy " << static_cast<int>(strategy));
    Pair p = make_pair(53, options(strategy));
    const Snapshot before = snapshot(*p.model);
    {
      fsdp::SummonFullParams full(p.root(), fsdp::SummonFullParamsOptions().writeback(false));
      torch::NoGradGuard no_grad;
      for (auto& param : p.model->parameters()) param.mul_(3.0).add_(1.0);
      p.model->head->bias.set_data(at::zeros({3}));
    }
    check_restored(*p.model, before);
    const auto state = fsdp::full_state_dict(p.root(), fsdp::FullStateDictOptions().rank0_only(false));
    for (const auto& item : p.reference->named_parameters()) {
      INFO(item.key());
      CHECK(state[item.key()].equal(item.value()));
    }
    const at::Tensor x = batch(2, 0, 6, 5);
    CHECK(close(p.model(x), p.reference(x)));
  }
}

FSDP_RANKS_TEST_CASE("rank0_only: rank 0 sees the full parameters, the others keep their shards", "[summon]") {
  Pair p = make_pair(54, options());
  const Snapshot before = snapshot(*p.model);
  CHECK_THROWS_WITH(fsdp::SummonFullParams(p.root(), fsdp::SummonFullParamsOptions().rank0_only(true)),
                    Contains("fsdp::SummonFullParams") && Contains("expected writeback(false) with rank0_only(true)"));
  check_restored(*p.model, before);
  {
    fsdp::SummonFullParams full(p.root(), fsdp::SummonFullParamsOptions().rank0_only(true).writeback(false));
    if (rank() == 0) {
      for (const auto& item : p.reference->named_parameters()) {
        INFO(item.key());
        CHECK(p.model->named_parameters()[item.key()].equal(item.value()));
      }
    } else {
      check_restored(*p.model, before);
    }
  }
  check_restored(*p.model, before);
  const at::Tensor x = batch(1, 0, 6, 6);
  CHECK(close(p.model(x), p.reference(x)));
}

FSDP_RANKS_TEST_CASE("offload_to_cpu: the full parameters are distinct host copies, written back", "[summon]") {
  for (auto strategy : kStrategies) {
    INFO("strategy " << static_cast<int>(strategy));
    Pair p = make_pair(55, options(strategy));
    {
      fsdp::SummonFullParams full(p.root(), fsdp::SummonFullParamsOptions().offload_to_cpu(true));
      for (const auto& unit : p.units) {
        for (const auto& h : fsdp::detail::handles_of(unit)) {
          for (const auto& orig : h->params()) {
            INFO(orig.fqn);
            CHECK(orig.param.device().is_cpu());
            CHECK(!orig.param.is_alias_of(h->local_shard()));
          }
        }
      }
      for (const auto& item : p.reference->named_parameters()) {
        CHECK(p.model->named_parameters()[item.key()].equal(item.value()));
      }
      torch::NoGradGuard no_grad;
      p.model->block(1)->fc1->weight.mul_(-1.0);
    }
    {
      torch::NoGradGuard no_grad;
      p.reference->block(1)->fc1->weight.mul_(-1.0);
    }
    const at::Tensor x = batch(4, 2, 6, 7);
    CHECK(close(p.model(x), p.reference(x)));
  }
}

FSDP_RANKS_TEST_CASE("without offload, NO_SHARD's full parameters are the replicas themselves", "[summon]") {
  Pair p = make_pair(56, options(fsdp::ShardingStrategy::kNoShard));
  const Snapshot before = snapshot(*p.model);
  {
    fsdp::SummonFullParams full(p.root());
    check_restored(*p.model, before);  // already full: the same storage
    torch::NoGradGuard no_grad;
    p.model->in->weight.zero_();
  }
  check_restored(*p.model, before);
  CHECK(p.model->in->weight.abs().sum().item<float>() == 0.0f);
}

FSDP_RANKS_TEST_CASE("with_grads shows the averaged gradients, then restores the sharded ones", "[summon]") {
  for (auto strategy : kStrategies) {
    INFO("strategy " << static_cast<int>(strategy));
    Pair p = make_pair(57, options(strategy));
    {  // no gradient anywhere yet: none shown
      fsdp::SummonFullParams full(p.root(), fsdp::SummonFullParamsOptions().with_grads(true));
      for (const auto& param : p.model->parameters()) CHECK(!param.grad().defined());
    }
    backward_sharded(p.model, 0);
    backward_reference(p.reference, 0);
    const Snapshot before = snapshot(*p.model);
    for (bool offload : {false, true}) {
      INFO("offload " << offload);
      fsdp::SummonFullParams full(p.root(),
                                  fsdp::SummonFullParamsOptions().with_grads(true).offload_to_cpu(offload));
      for (const auto& item : p.reference->named_parameters()) {
        INFO(item.key());
        const at::Tensor& param = p.model->named_parameters()[item.key()];
        REQUIRE(param.grad().defined());
        CHECK(close(param.grad(), item.value().grad()));
        CHECK(close(param, item.value()));
        // Editing the shown gradient changes nothing after the scope.
        param.grad().fill_(123.0);
      }
      full.exit();
      CHECK(!full.active());
      check_restored(*p.model, before);
    }
    // The optimizer steps on the sharded gradients, unchanged by the scopes.
    torch::optim::SGD opt(p.model->parameters(), torch::optim::SGDOptions(0.1));
    torch::optim::SGD ref_opt(p.reference->parameters(), torch::optim::SGDOptions(0.1));
    opt.step();
    ref_opt.step();
    const at::Tensor x = batch(5, 0, 6, 8);
    CHECK(close(p.model(x), p.reference(x)));
  }
}

FSDP_RANKS_TEST_CASE("with_grads adds this rank's gradients accumulated without sync", "[summon]") {
  const int W = world_size();
  Pair p = make_pair(58, options());
  // Synchronised backward A, then B without sync.
  backward_sharded(p.model, 0);
  p.root().set_requires_gradient_sync(false);
  backward_sharded(p.model, 1);
  // Expected: mean over ranks of A's gradients + this rank's own B gradients (not divided).
  backward_reference(p.reference, 0);
  std::vector<at::Tensor> averaged_a;
  for (const auto& param : p.reference->parameters()) averaged_a.push_back(param.grad().clone());
  for (auto& param : p.reference->parameters()) param.mutable_grad() = at::Tensor();
  torch::nn::functional::mse_loss(p.reference(batch(1, rank(), 6, 1)), batch(1, rank(), 3, 2)).backward();
  std::vector<at::Tensor> local_b;
  for (const auto& param : p.reference->parameters()) local_b.push_back(param.grad().clone());
  const Snapshot before = snapshot(*p.model);
  {
    fsdp::SummonFullParams full(p.root(), fsdp::SummonFullParamsOptions().with_grads(true).writeback(false));
    const auto params = p.model->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      INFO("parameter " << i);
      REQUIRE(params[i].grad().defined());
      CHECK(close(params[i].grad(), averaged_a[i] + local_b[i]));
    }
  }
  check_restored(*p.model, before);
  // The accumulation is untouched: a synchronised backward C reduces B + C.
  p.root().set_requires_gradient_sync(true);
  backward_sharded(p.model, 2);
  for (auto& param : p.reference->parameters()) param.mutable_grad() = at::Tensor();
  for (int q = 0; q < W; ++q) {
    for (int it : {1, 2}) {
      (torch::nn::functional::mse_loss(p.reference(batch(it, q, 6, 1)), batch(it, q, 3, 2)) / W).backward();
    }
  }
  {
    fsdp::SummonFullParams full(p.root(), fsdp::SummonFullParamsOptions().with_grads(true).writeback(false));
    const auto params = p.model->parameters();
    const auto ref = p.reference->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      INFO("parameter " << i);
      CHECK(close(params[i].grad(), averaged_a[i] + ref[i].grad()));
    }
  }
}

FSDP_RANKS_TEST_CASE("mixed precision: full-precision values, also for units kept unsharded", "[summon]") {
  auto opts = options().mixed_precision(fsdp::MixedPrecision().param_dtype(at::kBFloat16));
  Pair p = make_pair(59, opts);
  {
    fsdp::SummonFullParams full(p.root());
    for (const auto& item : p.reference->named_parameters()) {
      INFO(item.key());
      const at::Tensor& param = p.model->named_parameters()[item.key()];
      CHECK(param.scalar_type() == at::kFloat);
      CHECK(param.equal(item.value()));
    }
  }
  // Accumulating without sync and without resharding after backward keeps units unsharded (their
  // parameters are bf16 views then).
  p.root().set_requires_gradient_sync(false);
  p.root().set_reshard_after_backward(false);
  backward_sharded(p.model, 0);
  std::vector<bool> was_unsharded;
  for (const auto& u : p.units) {
    for (const auto& h : fsdp::detail::handles_of(u)) was_unsharded.push_back(h->is_unsharded());
  }
  {
    fsdp::SummonFullParams full(p.root());
    for (const auto& item : p.reference->named_parameters()) {
      INFO(item.key());
      const at::Tensor& param = p.model->named_parameters()[item.key()];
      CHECK(param.scalar_type() == at::kFloat);
      CHECK(param.equal(item.value()));
    }
    torch::NoGradGuard no_grad;
    p.model->block(0)->fc2->weight.mul_(2.0);
    p.model->head->bias.fill_(0.5);
  }
  {
    torch::NoGradGuard no_grad;
    p.reference->block(0)->fc2->weight.mul_(2.0);
    p.reference->head->bias.fill_(0.5);
  }
  size_t k = 0;
  for (const auto& u : p.units) {
    for (const auto& h : fsdp::detail::handles_of(u)) {
      INFO(u.fqn());
      CHECK(h->is_unsharded() == was_unsharded[k++]);
      if (!h->is_unsharded()) continue;
      for (const auto& orig : h->params()) {  // unsharded again, from the edited shards
        const at::Tensor expected = p.reference->named_parameters()[u.fqn() == "<root>"
                                                                        ? orig.fqn
                                                                        : u.fqn() + "." + orig.fqn];
        CHECK(orig.param.scalar_type() == at::kBFloat16);
        CHECK(orig.param.equal(expected.to(at::kBFloat16)));
      }
    }
  }
  const auto state = fsdp::full_state_dict(p.root(), fsdp::FullStateDictOptions().rank0_only(false));
  for (const auto& item : p.reference->named_parameters()) CHECK(state[item.key()].equal(item.value()));
}

FSDP_RANKS_TEST_CASE("nesting on a summoned unit is refused; disjoint units may nest", "[summon]") {
  Pair p = make_pair(60, options());
  {
    torch::NoGradGuard no_grad;  // lazy initialisation names the units relative to the root
    p.model(batch(0, 0, 6, 9));
  }
  const Snapshot before = snapshot(*p.model);
  {
    fsdp::SummonFullParams outer(p.root());
    CHECK_THROWS_WITH(fsdp::SummonFullParams(p.root()),
                      Contains("fsdp::SummonFullParams: unit '<root>' already has its full parameters summoned"));
    CHECK_THROWS_WITH(fsdp::SummonFullParams(p.units[1]),
                      Contains("unit 'blocks.1' already has its full parameters summoned"));
    // The outer scope still holds the full values.
    for (const auto& item : p.reference->named_parameters()) {
      CHECK(p.model->named_parameters()[item.key()].equal(item.value()));
    }
  }
  check_restored(*p.model, before);
  {
    // recurse(false): only the root's own parameters; a block can be summoned inside.
    fsdp::SummonFullParams outer(p.root(), fsdp::SummonFullParamsOptions().recurse(false));
    CHECK(p.model->head->weight.sizes() == at::IntArrayRef({3, 8}));
    CHECK(p.model->in->weight.sizes() == at::IntArrayRef({8, 6}));
    CHECK(p.model->block(0)->fc1->weight.sizes() == before.shape[2]);  // still its shard
    {
      fsdp::SummonFullParams inner(p.units[0]);
      CHECK(p.model->block(0)->fc1->weight.equal(p.reference->block(0)->fc1->weight));
      CHECK(p.model->block(1)->fc1->weight.sizes() == before.shape[6]);
    }
  }
  check_restored(*p.model, before);
}

namespace {

/// fc(x), running `probe` first (inside the unit's forward).
struct ProbeImpl : torch::nn::Module {
  ProbeImpl() { fc = register_module("fc", fsdp::contract::Linear(4, 4)); }
  torch::Tensor forward(torch::Tensor x) {
    if (probe) probe();
    return fc(x);
  }
  std::function<void()> probe;
  fsdp::contract::Linear fc{nullptr};
};
FSDP_HOOKABLE_MODULE(Probe);

}  // namespace

FSDP_RANKS_TEST_CASE("entering inside a forward, or before the backward of a forward, is refused", "[summon]") {
  for (bool offload : {false, true}) {  // offload: not a passthrough tree even on one rank
    INFO("offload " << offload);
    torch::manual_seed(61);
    auto model = Probe();
    const at::Tensor w = model->fc->weight.detach().clone();
    const at::Tensor b = model->fc->bias.detach().clone();
    auto unit = fsdp::fully_shard(model, options().offload_to_cpu(offload));
    std::string message;
    model->probe = [&] {
      try {
        fsdp::SummonFullParams full(unit);
      } catch (const c10::Error& e) {
        message = e.what();
      }
    };
    const at::Tensor x = batch(0, rank(), 4, 10);
    at::Tensor out = model(x);
    CHECK_THAT(message, Contains("fsdp::SummonFullParams: unit '<root>' is inside a forward") &&
                            Contains("expected to be entered outside forward and backward"));
    CHECK(close(out, at::linear(x, w, b)));
    model->probe = nullptr;
    // One rule on every world size, one rank (a passthrough tree) included.
    CHECK_THROWS_WITH(fsdp::SummonFullParams(unit),
                      Contains("unit '<root>' is after a forward whose backward has not run yet"));
    out.sum().backward();
    // The gradient is the reference's (the refused scopes changed nothing).
    fsdp::SummonFullParams full(unit, fsdp::SummonFullParamsOptions().with_grads(true));
    at::Tensor expected = at::zeros({4, 4});
    for (int q = 0; q < world_size(); ++q) expected += at::ones({4, 1}) * batch(0, q, 4, 10).sum(0, true);
    CHECK(close(model->fc->weight.grad(), expected / world_size()));
    CHECK(model->fc->weight.equal(w));
  }
}

FSDP_RANKS_TEST_CASE("after a forward whose graph was dropped, or a backward that retained it, the scope is entered", "[summon]") {
  // As after a forward under NoGradGuard: no backward can run through a dropped graph, so its
  // iteration ends (units resharded) when the scope is entered, on every world size.
  for (bool offload : {false, true}) {
    INFO("offload " << offload);
    Pair p = make_pair(62, options().offload_to_cpu(offload));
    const Snapshot before = snapshot(*p.model);
    { p.model(batch(0, rank(), 6, 9)).pow(2).sum(); }  // the loss is dropped: its graph is freed
    {
      fsdp::SummonFullParams full(p.root());
      for (const auto& item : p.reference->named_parameters()) {
        INFO(item.key());
        CHECK(p.model->named_parameters()[item.key()].equal(item.value()));
      }
    }
    check_restored(*p.model, before);
    // A loss kept alive still blocks it; its backward (even retaining the graph) releases it.
    at::Tensor loss = p.model(batch(0, rank(), 6, 9)).pow(2).sum();
    CHECK_THROWS_WITH(fsdp::SummonFullParams(p.root()),
                      Contains("unit '<root>' is after a forward whose backward has not run yet"));
    loss.backward(/*gradient=*/{}, /*retain_graph=*/true);
    { fsdp::SummonFullParams full(p.root(), fsdp::SummonFullParamsOptions().writeback(false)); }
    loss = at::Tensor();
    // Training goes on in parity with the reference.
    p.model->zero_grad();
    backward_sharded(p.model, 1);
    backward_reference(p.reference, 1);
    check_full_grads_match_reference(p);
  }
}

FSDP_RANKS_TEST_CASE("a throw or a wrong-shape edit on one rank writes back nothing anywhere and is named on every rank", "[summon]") {
  // Leaving decides writeback (and the all-gathers that re-unshard units kept unsharded) from
  // what every rank reports, so no rank issues a collective the others skip.
  const int last = world_size() - 1;
  for (bool kept_unsharded : {false, true}) {
    INFO("kept unsharded " << kept_unsharded);
    Pair p = make_pair(63, options());
    if (kept_unsharded) {
      p.root().set_requires_gradient_sync(false);
      p.root().set_reshard_after_backward(false);
      backward_sharded(p.model, 0);
    } else {
      torch::NoGradGuard no_grad;
      p.model(batch(0, 0, 6, 9));
    }
    std::vector<bool> was_unsharded;
    for (const auto& u : p.units) {
      for (const auto& h : fsdp::detail::handles_of(u)) was_unsharded.push_back(h->is_unsharded());
    }
    const Snapshot shapes = snapshot(*p.model);
    const auto before = fsdp::full_state_dict(p.root(), fsdp::FullStateDictOptions().rank0_only(false));
    // Sharded values are unchanged. Without sharding (one rank) the full parameters are the
    // replicas themselves, so the in-place edit of head.bias (`edit`) stays there.
    auto check_unchanged = [&](float edit) {
      check_restored(*p.model, shapes);
      size_t k = 0;
      for (const auto& u : p.units) {
        for (const auto& h : fsdp::detail::handles_of(u)) CHECK(h->is_unsharded() == was_unsharded[k++]);
      }
      const auto after = fsdp::full_state_dict(p.root(), fsdp::FullStateDictOptions().rank0_only(false));
      for (const auto& item : before) {
        INFO(item.key());
        if (item.key() == "head.bias" && world_size() == 1) {
          CHECK(at::equal(after[item.key()], at::full({3}, edit)));
        } else {
          CHECK(at::equal(item.value(), after[item.key()]));
        }
      }
    };

    // The last rank throws inside the scope; the others leave it normally (exit() throws there).
    std::string error, thrown;
    try {
      fsdp::SummonFullParams full(p.root());
      torch::NoGradGuard no_grad;
      p.model->head->bias.fill_(7.0);
      if (rank() == last) throw std::runtime_error("a user error on the last rank");
      full.exit();
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    } catch (const std::runtime_error& e) {
      thrown = e.what();
    }
    if (rank() == last) {
      CHECK(thrown == "a user error on the last rank");
    } else {
      CHECK_THAT(error, Contains("fsdp::SummonFullParams: leaving the scope of unit '<root>': nothing was "
                                 "written back on any rank") &&
                            Contains("rank " + std::to_string(last) + ": left the scope by an exception"));
    }
    check_unchanged(7.0f);

    // A full parameter replaced by another shape on the last rank only: the same error everywhere.
    std::string message;
    {
      fsdp::SummonFullParams full(p.root());
      torch::NoGradGuard no_grad;
      p.model->head->bias.fill_(3.0);
      if (rank() == last) p.model->head->bias.set_data(at::zeros({5}));
      message = fsdp::testing::error_of([&] { full.exit(); });
    }
    CHECK_THAT(message, Contains("nothing was written back on any rank") &&
                            Contains("rank " + std::to_string(last) + ": parameter 'head.bias' of unit '<root>' was "
                                     "replaced inside the scope by a tensor of shape [5]; expected its full shape [3]"));
    CHECK(fsdp::testing::same_on_every_rank(message));
    check_unchanged(3.0f);
  }
}

FSDP_RANKS_TEST_CASE("a forward inside the scope is refused before it runs", "[summon]") {
  for (bool child : {false, true}) {
    INFO((child ? "scope on a block" : "scope on the root"));
    Pair p = make_pair(29, options());
    backward_sharded(p.model, 0);  // lazy initialisation done, one iteration behind
    const auto before = fsdp::full_state_dict(p.root(), fsdp::FullStateDictOptions().rank0_only(false));
    {
      fsdp::SummonFullParams scope(child ? p.units[1] : p.root());
      std::string message;
      try {
        p.model(batch(1, rank(), 6, 1));
      } catch (const c10::Error& e) {
        message = e.what_without_backtrace();
      }
      CHECK_THAT(message, Contains("while a SummonFullParams scope holds the full parameters of unit") &&
                              Contains(child ? "blocks.1" : "<root>"));
    }
    // The refused forward left nothing behind: training continues in parity.
    const auto after = fsdp::full_state_dict(p.root(), fsdp::FullStateDictOptions().rank0_only(false));
    for (const auto& item : before) CHECK(at::equal(item.value(), after[item.key()]));
    backward_reference(p.reference, 0);
    p.reference->zero_grad();
    p.model->zero_grad();
    backward_sharded(p.model, 1);
    backward_reference(p.reference, 1);
    check_full_grads_match_reference(p);
  }
}

FSDP_RANKS_TEST_CASE("unsharded_shape gives the original shape on every rank", "[summon]") {
  // Tiny: parameters smaller than the world size (some ranks hold none of them).
  auto model = fsdp::testing::Tiny();
  const auto shapes = [&] {
    std::vector<std::vector<int64_t>> s;
    for (const auto& param : model->parameters()) s.push_back(param.sizes().vec());
    return s;
  }();
  auto unit_a = fsdp::fully_shard(model->a, options());
  // b is not in any unit yet: its own shape.
  CHECK(fsdp::unsharded_shape(*model, model->b->weight) == std::vector<int64_t>{1, 1});
  CHECK(fsdp::unsharded_shape(unit_a, model->b->weight) == std::vector<int64_t>{1, 1});
  CHECK(fsdp::unsharded_shape(unit_a, model->a->weight) == std::vector<int64_t>{3, 3});
  auto root = fsdp::fully_shard(model, options());
  const auto params = model->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    INFO("parameter " << i << " of sharded shape " << params[i].sizes());
    if (world_size() > 1) CHECK(params[i].dim() == 1);
    CHECK(fsdp::unsharded_shape(*model, params[i]) == shapes[i]);
    CHECK(fsdp::unsharded_shape(root, params[i]) == shapes[i]);
  }
  // The ranks' slices add up to each parameter (with several ranks, some hold none of b's).
  at::Tensor held = at::zeros({static_cast<int64_t>(params.size())});
  for (size_t i = 0; i < params.size(); ++i) held[static_cast<int64_t>(i)] = params[i].numel();
  world().all_reduce(held).wait();
  for (size_t i = 0; i < params.size(); ++i) {
    int64_t numel = 1;
    for (int64_t d : shapes[i]) numel *= d;
    CHECK(held[static_cast<int64_t>(i)].item<int64_t>() == numel);
  }
  if (world_size() == 4) CHECK((model->b->weight.numel() == 0 || model->b->bias.numel() == 0));
  {
    fsdp::SummonFullParams full(root);
    for (size_t i = 0; i < params.size(); ++i) {
      CHECK(params[i].sizes().vec() == shapes[i]);
      CHECK(fsdp::unsharded_shape(root, params[i]) == shapes[i]);
    }
  }
  const at::Tensor other = at::zeros({2, 5});
  CHECK(fsdp::unsharded_shape(root, other) == std::vector<int64_t>{2, 5});
}
