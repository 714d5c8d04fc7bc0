// Tied parameters across units over MPI on every world size. A parameter registered by several
// modules (an embedding tied to the output projection, a weight shared by three layers) ends up
// in the innermost unit containing every module that uses it, whatever units fully_shard made
// around them: sibling units, a unit and its parent, a unit of siblings, three users, a weight
// that moves twice. It moves when fully_shard reaches that unit (the root's fully_shard at the
// latest), never at the first forward, so:
//   - training matches an unsharded reference (same initial weights, gradients averaged over the
//     ranks' batches as DDP would): losses every iteration, parameters after training; bit-exact
//     on 1 rank, close otherwise;
//   - under mixed precision (bf16, fp16; with and without CPU offload) the shards, the gradients
//     after sync and the optimizer state stay fp32;
//   - optimizer state created before the first forward (a step on gradients held before
//     fully_shard, or a checkpoint loaded) matches the parameters for good.
// Arrangements no unit can hold (no unit contains every user) are refused at the first forward,
// naming the modules and the fully_shard call to add, leaving the model as it was.
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/serialize.h>

#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/fully_shard_internal.h"
#include "fsdp_cpp/tests/composable/parity.h"
#include "fsdp_cpp/tests/composable/test_models.h"
#include "fsdp_cpp/tests/composable/tied_models.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::FSDPModule;
using fsdp::FullyShardOptions;
using fsdp::ShardingStrategy;
using fsdp::testing::fresh_comm;
using fsdp::testing::Instance;
using fsdp::testing::Optim;
using fsdp::testing::ParityOptions;
using fsdp::testing::Scenario;
using fsdp::testing::rank;
using fsdp::testing::world;
using fsdp::testing::world_size;

constexpr int64_t kIn = 6;
constexpr int64_t kHidden = 8;

// Each parameter tensor of `m` once (LibTorch lists a tied tensor under every module using it).
std::vector<at::Tensor> unique_parameters(const torch::nn::Module& m) {
  std::vector<at::Tensor> unique;
  for (const auto& p : m.parameters()) {
    const bool seen = std::any_of(unique.begin(), unique.end(), [&](const at::Tensor& u) { return u.is_same(p); });
    if (!seen) unique.push_back(p);
  }
  return unique;
}

// How many FlatParameters of `units` hold `param`.
int copies_of(const std::vector<FSDPModule>& units, const at::Tensor& param) {
  int copies = 0;
  for (const auto& u : units) {
    for (const auto& h : fsdp::detail::handles_of(u)) {
      for (const auto& p : h->params()) copies += p.param.is_same(param) ? 1 : 0;
    }
  }
  return copies;
}

// Every parameter of `m` is in exactly one FlatParameter, and `tied` is in unit `owner`'s.
void check_placement(const torch::nn::Module& m, const std::vector<FSDPModule>& units, const at::Tensor& tied,
                     size_t owner) {
  for (const auto& item : m.named_parameters()) {
    INFO("parameter " << item.key());
    CHECK(copies_of(units, item.value()) == 1);
  }
  INFO("the tied parameter belongs to unit #" << owner);
  CHECK(units.at(owner).manages(tied));
}

// A run_parity scenario over `model` (built by `make`), sharded by `shard`, which also returns the
// tied tensor and the index of the unit that must hold it; placement is checked right after
// fully_shard, before the first forward.
template <typename Model>
Scenario tied_scenario(std::string name, std::function<Model()> make,
                       std::function<std::pair<std::vector<FSDPModule>, size_t>(Model&, const FullyShardOptions&)> shard,
                       std::function<at::Tensor(Model&)> tied) {
  return {std::move(name), kIn, kIn, [make, shard, tied] {
            Model model = make();
            Instance inst;
            inst.module = model.ptr();
            inst.forward = [model](torch::Tensor x, int) mutable { return model(x); };
            inst.shard = [model, shard, tied](const FullyShardOptions& o) mutable {
              auto [units, owner] = shard(model, o);
              check_placement(*model, units, tied(model), owner);
              return units;
            };
            return inst;
          }};
}

// --- The arrangements -----------------------------------------------------------------------

// emb, body and head units, then the root: the weight of emb (a unit) and head (another unit)
// moves to the root. `frozen`: the tied weight does not require gradients.
Scenario siblings(bool frozen = false) {
  return tied_scenario<fsdp::testing::TiedSiblings>(
      frozen ? "emb, head and root units, frozen tied weight" : "emb, head and root units: the weight moves to the root",
      [frozen] {
        auto model = fsdp::testing::TiedSiblings(kIn, kHidden);
        if (frozen) model->emb->weight.requires_grad_(false);
        return model;
      },
      [](fsdp::testing::TiedSiblings& m, const FullyShardOptions& o) {
        std::vector<FSDPModule> units;
        units.push_back(fsdp::fully_shard(m->emb, o));
        units.push_back(fsdp::fully_shard(m->body, o));
        units.push_back(fsdp::fully_shard(m->head, o));
        units.push_back(fsdp::fully_shard(m, o));
        return std::make_pair(units, units.size() - 1);
      },
      [](fsdp::testing::TiedSiblings& m) { return m->emb->weight; });
}

// inner.enc uses W and so does inner itself: with `inner_unit`, W moves from enc's unit to inner's
// (a unit and its parent); without, to the root (inner.mix a unit beside enc).
Scenario parent(bool inner_unit) {
  return tied_scenario<fsdp::testing::TiedParent>(
      inner_unit ? "a unit and its parent unit: the weight moves to the parent" : "a unit inside a plain module: the weight moves to the root",
      [] { return fsdp::testing::TiedParent(kIn, kHidden); },
      [inner_unit](fsdp::testing::TiedParent& m, const FullyShardOptions& o) {
        std::vector<FSDPModule> units;
        units.push_back(fsdp::fully_shard(m->inner->enc, o));
        torch::nn::Module& second = inner_unit ? static_cast<torch::nn::Module&>(*m->inner.ptr())
                                              : static_cast<torch::nn::Module&>(*m->inner->mix.ptr());
        units.push_back(fsdp::fully_shard(second, o));
        units.push_back(fsdp::fully_shard(m, o));
        return std::make_pair(units, inner_unit ? size_t{1} : size_t{2});
      },
      [](fsdp::testing::TiedParent& m) { return m->inner->enc->weight; });
}

// Four modules share emb.weight; `all_units`: each is a unit, else only emb and head are.
Scenario three_way(bool all_units) {
  return tied_scenario<fsdp::testing::TiedThreeWay>(
      all_units ? "four units share one weight" : "emb and head units and two users in the root",
      [] { return fsdp::testing::TiedThreeWay(kIn, kHidden); },
      [all_units](fsdp::testing::TiedThreeWay& m, const FullyShardOptions& o) {
        std::vector<FSDPModule> units;
        units.push_back(fsdp::fully_shard(m->emb, o));
        if (all_units) {
          units.push_back(fsdp::fully_shard(m->dec, o));
          units.push_back(fsdp::fully_shard(m->enc2, o));
        }
        units.push_back(fsdp::fully_shard(m->head, o));
        units.push_back(fsdp::fully_shard(m, o));
        return std::make_pair(units, units.size() - 1);
      },
      [](fsdp::testing::TiedThreeWay& m) { return m->emb->weight; });
}

// pair.a and pair.b share a weight, both units, inside the unit `pair`: the weight moves to pair.
// `tie_outside`: the root uses it too, so it moves again, from pair to the root.
Scenario nested(bool tie_outside) {
  return tied_scenario<fsdp::testing::TiedNested>(
      tie_outside ? "used inside and outside a unit: the weight moves twice" : "two units inside a third share a weight",
      [tie_outside] { return fsdp::testing::TiedNested(kIn, kHidden, tie_outside); },
      [tie_outside](fsdp::testing::TiedNested& m, const FullyShardOptions& o) {
        std::vector<FSDPModule> units;
        units.push_back(fsdp::fully_shard(m->pair->a, o));
        units.push_back(fsdp::fully_shard(m->pair->b, o));
        units.push_back(fsdp::fully_shard(m->pair, o));
        units.push_back(fsdp::fully_shard(m, o));
        return std::make_pair(units, tie_outside ? size_t{3} : size_t{2});
      },
      [](fsdp::testing::TiedNested& m) { return m->pair->a->weight; });
}

ParityOptions with(ShardingStrategy strategy, Optim optim = Optim::kAdam) {
  ParityOptions o;
  o.optim = optim;
  o.shard_options.strategy(strategy);
  return o;
}

// --- A parity loop of its own: mixed-precision reference, language models, optimizer state ----

struct Trainee {
  std::shared_ptr<torch::nn::Module> module;
  // The loss of rank q's batch of iteration `it`, fp32; inputs cast to `cast` when given (the
  // reference under mixed precision computes on low-precision copies of its parameters).
  std::function<at::Tensor(int64_t it, int q, std::optional<at::ScalarType> cast)> loss;
  // fully_shard bottom-up; the units, the root last.
  std::function<std::vector<FSDPModule>(const FullyShardOptions&)> shard;
  at::Tensor tied;
  size_t tied_owner = 0;
};

struct TrainOptions {
  FullyShardOptions shard;
  int iterations = 4;
  double rtol = 1e-5;
  double atol = 1e-6;
  // Runs on both fresh models before fully_shard (e.g. a backward: gradients held before sharding).
  std::function<void(Trainee&)> before_shard;
  // An optimizer step right after fully_shard, before the first forward (the optimizer's state is
  // created then, on gradients held from before fully_shard).
  bool step_before_forward = false;
};

at::Tensor batch(int64_t it, int q, int64_t cols, int salt) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(7000 * salt + 40 * it + q));
  return at::randn({5, cols}, gen);
}

// fp32 everywhere the optimizer looks: parameters, gradients, Adam's state (of the parameters'
// current, sharded shapes).
void check_full_precision(const std::vector<at::Tensor>& params, torch::optim::Adam& opt) {
  for (const auto& p : params) {
    CHECK(p.scalar_type() == at::kFloat);
    if (p.grad().defined()) {
      CHECK(p.grad().scalar_type() == at::kFloat);
      CHECK(p.grad().sizes() == p.sizes());
    }
    const auto it = opt.state().find(p.unsafeGetTensorImpl());
    if (it == opt.state().end()) continue;
    const auto& s = static_cast<const torch::optim::AdamParamState&>(*it->second);
    CHECK(s.exp_avg().scalar_type() == at::kFloat);
    CHECK(s.exp_avg_sq().scalar_type() == at::kFloat);
    CHECK(s.exp_avg().sizes() == p.sizes());
  }
}

// The sum over ranks of every (sharded) gradient's squared norm: the full gradients' on FULL_SHARD
// (each element on one rank), as the unsharded model's.
double sharded_grad_square_sum(const std::vector<at::Tensor>& params) {
  at::Tensor total = at::zeros({1}, at::kDouble);
  for (const auto& p : params) {
    if (p.grad().defined()) total += p.grad().to(at::kDouble).pow(2).sum();
  }
  world().all_reduce(total).wait();
  return total.item<double>();
}

double grad_square_sum(const std::vector<at::Tensor>& params) {
  double total = 0;
  for (const auto& p : params) {
    if (p.grad().defined()) total += p.grad().to(at::kDouble).pow(2).sum().item<double>();
  }
  return total;
}

// Compares parameter `key` of the trained models. The key part of MultiheadAttention's in-projection
// bias has an exactly-zero gradient (softmax ignores a constant added to a row of scores), so it
// only moves by rounding noise that Adam scales up to lr-sized steps: compared on query and value.
bool params_close(const std::string& key, at::Tensor mine, at::Tensor theirs, bool exact, double rtol, double atol) {
  if (!exact && key.find("in_proj_bias") != std::string::npos) {
    const int64_t d = mine.numel() / 3;
    mine = at::cat({mine.narrow(0, 0, d), mine.narrow(0, 2 * d, d)});
    theirs = at::cat({theirs.narrow(0, 0, d), theirs.narrow(0, 2 * d, d)});
  }
  return exact ? mine.equal(theirs) : at::allclose(mine, theirs, rtol, atol);
}

void train_parity(const std::string& name, const std::function<Trainee()>& make, const TrainOptions& options) {
  const int W = world_size();
  const auto& mp = options.shard.mixed_precision();
  const std::optional<at::ScalarType> param_dtype = mp.param_dtype();
  const at::ScalarType reduce_dtype = mp.reduce_dtype().value_or(param_dtype.value_or(at::kFloat));
  const bool exact = W == 1 && c10::elementSize(reduce_dtype) == 4;
  INFO(name << ", " << W << " ranks, param_dtype " << (param_dtype ? c10::toString(*param_dtype) : "fp32")
            << ", reduce_dtype " << reduce_dtype << ", offload " << options.shard.offload_to_cpu());
  torch::manual_seed(77);
  Trainee sharded = make();
  torch::manual_seed(77);
  Trainee reference = make();
  if (options.before_shard) {
    options.before_shard(sharded);
    options.before_shard(reference);
  }
  const auto keys_before = sharded.module->named_parameters().keys();
  std::vector<const void*> impls_before;  // the parameter objects, tied ones once per name
  for (const auto& p : sharded.module->parameters()) impls_before.push_back(p.unsafeGetTensorImpl());
  auto units = sharded.shard(FullyShardOptions(options.shard).communicator(fresh_comm()));
  check_placement(*sharded.module, units, sharded.tied, sharded.tied_owner);
  CHECK(sharded.module->named_parameters().keys() == keys_before);
  for (const auto& u : units) {
    for (const auto& h : fsdp::detail::handles_of(u)) {
      CHECK(h->local_shard().scalar_type() == at::kFloat);
      if (param_dtype) CHECK(h->compute_dtype() == *param_dtype);
    }
  }
  const auto params = unique_parameters(*sharded.module);
  const auto ref_params = unique_parameters(*reference.module);
  torch::optim::Adam opt(params, torch::optim::AdamOptions(1e-2));
  torch::optim::Adam ref_opt(ref_params, torch::optim::AdamOptions(1e-2));
  if (options.step_before_forward) {
    // Gradients held before fully_shard moved with the tied parameter (sharded, not lost).
    const double expected = grad_square_sum(ref_params);
    CHECK(expected > 0);
    CHECK(sharded_grad_square_sum(params) == Approx(expected).epsilon(1e-6));
    opt.step();
    opt.zero_grad();
    ref_opt.step();
    ref_opt.zero_grad();
    check_full_precision(params, opt);
  }

  for (int64_t it = 0; it < options.iterations; ++it) {
    at::Tensor loss = sharded.loss(it, rank(), std::nullopt);
    loss.backward();
    check_full_precision(params, opt);
    opt.step();
    opt.zero_grad();
    check_full_precision(params, opt);
    for (const auto& u : units) {
      for (const auto& h : fsdp::detail::handles_of(u)) CHECK(h->unsharded_bytes() == 0);
    }

    // The reference: every rank's batch, gradients averaged (in the reduce dtype, from
    // low-precision copies of the fp32 parameters under mixed precision), stepped in fp32.
    at::Tensor ref_loss;
    std::vector<at::Tensor> masters, sums;
    for (const auto& p : ref_params) {
      masters.push_back(p.detach().clone());
      sums.push_back(at::zeros(p.sizes(), p.options().dtype(reduce_dtype)));
    }
    for (int q = 0; q < W; ++q) {
      if (param_dtype) {
        for (size_t i = 0; i < ref_params.size(); ++i) ref_params[i].set_data(masters[i].to(*param_dtype));
      }
      at::Tensor lq = reference.loss(it, q, param_dtype);
      lq.backward();
      for (size_t i = 0; i < ref_params.size(); ++i) {
        if (ref_params[i].grad().defined()) sums[i].add_(ref_params[i].grad().to(reduce_dtype));
        ref_params[i].mutable_grad() = at::Tensor();
      }
      if (q == rank()) ref_loss = lq.detach();
    }
    for (size_t i = 0; i < ref_params.size(); ++i) {
      ref_params[i].set_data(masters[i]);
      ref_params[i].mutable_grad() = sums[i].to(at::kFloat) / W;
    }
    ref_opt.step();
    ref_opt.zero_grad();

    INFO("iteration " << it << ": loss " << loss.item<double>() << ", reference " << ref_loss.item<double>());
    CHECK((exact ? loss.equal(ref_loss) : at::allclose(loss, ref_loss, options.rtol, options.atol)));
  }

  check_placement(*sharded.module, units, sharded.tied, sharded.tied_owner);
  std::vector<const void*> impls_after;
  for (const auto& p : sharded.module->parameters()) impls_after.push_back(p.unsafeGetTensorImpl());
  CHECK(impls_after == impls_before);
  const auto full = fsdp::full_state_dict(units.back(), fsdp::FullStateDictOptions().rank0_only(false));
  for (const auto& item : reference.module->named_parameters()) {
    INFO("parameter " << item.key());
    REQUIRE(full.contains(item.key()));
    CHECK(full[item.key()].scalar_type() == at::kFloat);
    CHECK(params_close(item.key(), full[item.key()], item.value().detach(), exact, options.rtol, options.atol));
  }
}

// TiedSiblings with units on emb, body and head, then the root (the weight moves to the root);
// `siblings_unit`: one unit of emb and head instead, which keeps it.
Trainee tied_siblings(bool siblings_unit) {
  auto model = fsdp::testing::TiedSiblings(kIn, kHidden);
  Trainee t;
  t.module = model.ptr();
  t.loss = [model](int64_t it, int q, std::optional<at::ScalarType> cast) mutable {
    at::Tensor x = batch(it, q, kIn, 1);
    if (cast) x = x.to(*cast);
    return torch::nn::functional::mse_loss(model(x).to(at::kFloat), batch(it, q, kIn, 2));
  };
  t.shard = [model, siblings_unit](const FullyShardOptions& o) {
    std::vector<FSDPModule> units;
    if (siblings_unit) {
      units.push_back(fsdp::fully_shard({model->emb.ptr().get(), model->head.ptr().get()}, o));
      units.push_back(fsdp::fully_shard(model->body, o));
    } else {
      units.push_back(fsdp::fully_shard(model->emb, o));
      units.push_back(fsdp::fully_shard(model->body, o));
      units.push_back(fsdp::fully_shard(model->head, o));
    }
    units.push_back(fsdp::fully_shard(model, o));
    return units;
  };
  t.tied = model->emb->weight;
  t.tied_owner = siblings_unit ? 0 : 3;
  return t;
}

Trainee tied_siblings_trainee() { return tied_siblings(false); }

constexpr int64_t kVocab = 23;
constexpr int64_t kContext = 12;

// The GPT of the issue: the token embedding and the head (which ties its weight) are units of
// their own, beside one unit per block, then the root.
Trainee tied_gpt_trainee() {
  auto model = fsdp::testing::TinyGpt(kVocab, kContext, 16, 4, 2);
  Trainee t;
  t.module = model.ptr();
  t.loss = [model](int64_t it, int q, std::optional<at::ScalarType>) mutable {
    auto tokens = [&](int salt) {
      auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(3000 * salt + 30 * it + q));
      return at::randint(kVocab, {3, kContext}, gen);
    };
    at::Tensor logits = model(tokens(1)).to(at::kFloat);
    return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), tokens(2).reshape({-1}));
  };
  t.shard = [model](const FullyShardOptions& o) {
    std::vector<FSDPModule> units;
    units.push_back(fsdp::fully_shard(model->tok, o));
    for (size_t i = 0; i < model->blocks->size(); ++i) units.push_back(fsdp::fully_shard(model->block(i), o));
    units.push_back(fsdp::fully_shard(model->head, o));
    units.push_back(fsdp::fully_shard(model, o));
    return units;
  };
  t.tied = model->tok->weight;
  t.tied_owner = 4;
  return t;
}

}  // namespace

// --- Parity for every arrangement -----------------------------------------------------------

FSDP_RANKS_TEST_CASE("tied weight between sibling units (embedding and head): parity, every strategy", "[tied][siblings]") {
  fsdp::testing::run_parity(siblings(), with(ShardingStrategy::kFullShard));
  fsdp::testing::run_parity(siblings(), with(ShardingStrategy::kShardGradOp, Optim::kAdamW));
  fsdp::testing::run_parity(siblings(), with(ShardingStrategy::kNoShard, Optim::kSgdMomentum));
  auto before = with(ShardingStrategy::kFullShard);
  before.optimizer_before_shard = true;
  fsdp::testing::run_parity(siblings(), before);
  fsdp::testing::run_parity(siblings(/*frozen=*/true), with(ShardingStrategy::kFullShard));
  // One unit of emb and head contains both users and keeps the weight. Its two modules run apart
  // (body between them), so backward all-gathers it once per module: parity without collective
  // counts.
  train_parity("unit of siblings {emb, head} keeps the tied weight", [] { return tied_siblings(true); }, {});
}

FSDP_RANKS_TEST_CASE("tied weight between sibling units under hybrid sharding", "[tied][siblings][hybrid]") {
  const int W = world_size();
  for (int shard_size = 1; shard_size <= W; ++shard_size) {
    if (W % shard_size != 0) continue;
    INFO("shard groups of " << shard_size);
    auto o = with(ShardingStrategy::kFullShard, Optim::kAdamW);
    o.shard_options.mesh(fsdp::comm::DeviceMesh::hybrid(world(), shard_size));
    fsdp::testing::run_parity(siblings(), o);
  }
}

FSDP_RANKS_TEST_CASE("tied weight between a unit and its parent: parity", "[tied][parent]") {
  fsdp::testing::run_parity(parent(true), with(ShardingStrategy::kFullShard));
  fsdp::testing::run_parity(parent(true), with(ShardingStrategy::kShardGradOp, Optim::kSgdMomentum));
  fsdp::testing::run_parity(parent(false), with(ShardingStrategy::kFullShard));
}

FSDP_RANKS_TEST_CASE("one weight shared by three and four modules: parity", "[tied][three]") {
  fsdp::testing::run_parity(three_way(true), with(ShardingStrategy::kFullShard));
  fsdp::testing::run_parity(three_way(true), with(ShardingStrategy::kNoShard, Optim::kAdamW));
  fsdp::testing::run_parity(three_way(false), with(ShardingStrategy::kFullShard, Optim::kSgdMomentum));
}

FSDP_RANKS_TEST_CASE("a weight shared inside a unit stays there; used outside too, it moves twice: parity", "[tied][nested]") {
  fsdp::testing::run_parity(nested(false), with(ShardingStrategy::kFullShard));
  fsdp::testing::run_parity(nested(true), with(ShardingStrategy::kFullShard));
  fsdp::testing::run_parity(nested(true), with(ShardingStrategy::kShardGradOp, Optim::kAdamW));
}

FSDP_RANKS_TEST_CASE("GPT with the embedding and the tied head as units of their own: parity", "[tied][gpt]") {
  TrainOptions o;
  o.rtol = 1e-4;
  train_parity("GPT, tok and head units", tied_gpt_trainee, o);
  o.shard.strategy(ShardingStrategy::kShardGradOp);
  train_parity("GPT, tok and head units, SHARD_GRAD_OP", tied_gpt_trainee, o);
}

FSDP_RANKS_TEST_CASE("the tied weight moves at the root's fully_shard, before any forward", "[tied][siblings]") {
  torch::manual_seed(5);
  auto model = fsdp::testing::TiedSiblings(kIn, kHidden);
  torch::manual_seed(5);
  auto reference = fsdp::testing::TiedSiblings(kIn, kHidden);
  const auto o = FullyShardOptions().communicator(fresh_comm());
  auto emb = fsdp::fully_shard(model->emb, o);
  auto head = fsdp::fully_shard(model->head, o);
  // head uses emb's weight: it stays with emb until a unit contains both.
  CHECK(emb.manages(model->emb->weight));
  CHECK(fsdp::detail::handles_of(head).empty());
  auto root = fsdp::fully_shard(model, o);
  CHECK(root.manages(model->emb->weight));
  CHECK_FALSE(emb.manages(model->emb->weight));
  CHECK(emb.manages(model->emb->bias));
  CHECK(model->head->weight.is_same(model->emb->weight));
  // Values unchanged by the move: the full parameters equal the reference's.
  for (auto* u : {&emb, &root}) u->unshard();
  CHECK(model->emb->weight.equal(reference->emb->weight));
  CHECK(model->emb->bias.equal(reference->emb->bias));
  for (auto* u : {&emb, &root}) u->reshard();
  const at::Tensor x = at::randn({3, kIn});
  at::Tensor out = model(x);
  CHECK(at::allclose(out, reference(x), 1e-6, 1e-6));
  out.sum().backward();
  CHECK(model->emb->weight.grad().defined());
}

FSDP_RANKS_TEST_CASE("sync_module_states: the moved tied weight is rank 0's everywhere", "[tied][sync]") {
  torch::manual_seed(300 + rank());  // every rank initialises differently
  auto model = fsdp::testing::TiedSiblings(kIn, kHidden);
  torch::manual_seed(300);  // rank 0's initialisation
  auto rank0 = fsdp::testing::TiedSiblings(kIn, kHidden);
  const auto o = FullyShardOptions().communicator(fresh_comm()).sync_module_states(true);
  std::vector<FSDPModule> units{fsdp::fully_shard(model->emb, o), fsdp::fully_shard(model->head, o),
                                fsdp::fully_shard(model, o)};
  CHECK(units.back().manages(model->emb->weight));
  for (auto& u : units) u.unshard();
  const auto expected = rank0->named_parameters();
  for (const auto& item : model->named_parameters()) {
    INFO("parameter " << item.key());
    CHECK(item.value().equal(expected[item.key()]));
  }
  for (auto& u : units) u.reshard();
  const at::Tensor x = at::randn({2, kIn});
  CHECK(at::allclose(model(x), rank0(x), 1e-6, 1e-6));
}

// --- Mixed precision -------------------------------------------------------------------------

FSDP_RANKS_TEST_CASE("mixed precision: a moved tied weight keeps fp32 shards, gradients and optimizer state", "[tied][mixed_precision]") {
  for (bool offload : {false, true}) {
    TrainOptions bf16;
    bf16.shard.mixed_precision(fsdp::MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat))
        .offload_to_cpu(offload);
    bf16.rtol = 1e-5;
    bf16.atol = 1e-6;
    train_parity("TiedSiblings, bf16 compute", tied_siblings_trainee, bf16);
    TrainOptions fp16;
    fp16.shard.mixed_precision(fsdp::MixedPrecision().param_dtype(at::kHalf).reduce_dtype(at::kHalf))
        .offload_to_cpu(offload);
    // The reduction itself rounds to fp16 in an order the reference cannot reproduce.
    fp16.rtol = 5e-3;
    fp16.atol = 5e-3;
    train_parity("TiedSiblings, fp16 compute and reduction", tied_siblings_trainee, fp16);
  }
}

// --- Optimizer state -------------------------------------------------------------------------

FSDP_RANKS_TEST_CASE("optimizer state created before the first forward matches the moved parameters", "[tied][optim]") {
  // Gradients computed before fully_shard (the same batch on every rank) move with the tied
  // weight; Adam steps on them right after fully_shard, creating its state before any forward.
  TrainOptions o;
  o.before_shard = [](Trainee& t) { t.loss(99, 0, std::nullopt).backward(); };
  o.step_before_forward = true;
  train_parity("TiedSiblings, Adam step before the first forward", tied_siblings_trainee, o);
  o.shard.mixed_precision(fsdp::MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat));
  train_parity("TiedSiblings, Adam step before the first forward, bf16", tied_siblings_trainee, o);
}

FSDP_RANKS_TEST_CASE("optimizer state loaded before the first forward continues training exactly", "[tied][optim]") {
  const auto o = FullyShardOptions().communicator(fresh_comm());
  const std::string path = fsdp::testing::shared_tmpdir() + "/tied_adam_rank" + std::to_string(rank()) + ".pt";
  torch::manual_seed(21);
  Trainee a = tied_siblings_trainee();
  auto units_a = a.shard(o);
  const auto params_a = unique_parameters(*a.module);
  torch::optim::Adam opt_a(params_a, torch::optim::AdamOptions(1e-2));
  auto step = [](Trainee& t, torch::optim::Adam& opt, int64_t it) {
    at::Tensor loss = t.loss(it, rank(), std::nullopt);
    loss.backward();
    opt.step();
    opt.zero_grad();
    return loss.detach();
  };
  for (int64_t it = 0; it < 2; ++it) step(a, opt_a, it);
  const auto checkpoint = fsdp::full_state_dict(units_a.back(), fsdp::FullStateDictOptions().rank0_only(false));
  torch::save(opt_a, path);

  // A fresh model (other initial values), sharded alike; parameters and optimizer state loaded
  // before its first forward.
  torch::manual_seed(22);
  Trainee b = tied_siblings_trainee();
  auto units_b = b.shard(o);
  const auto params_b = unique_parameters(*b.module);
  torch::optim::Adam opt_b(params_b, torch::optim::AdamOptions(1e-2));
  fsdp::load_full_state_dict(units_b.back(), checkpoint);
  torch::load(opt_b, path);
  for (const auto& p : params_b) {
    const auto it = opt_b.state().find(p.unsafeGetTensorImpl());
    REQUIRE(it != opt_b.state().end());
    CHECK(static_cast<const torch::optim::AdamParamState&>(*it->second).exp_avg().sizes() == p.sizes());
  }
  for (int64_t it = 2; it < 5; ++it) {
    INFO("iteration " << it);
    const at::Tensor la = step(a, opt_a, it);
    const at::Tensor lb = step(b, opt_b, it);
    CHECK(la.equal(lb));
  }
  const auto final_a = fsdp::full_state_dict(units_a.back(), fsdp::FullStateDictOptions().rank0_only(false));
  const auto final_b = fsdp::full_state_dict(units_b.back(), fsdp::FullStateDictOptions().rank0_only(false));
  for (const auto& item : final_a) {
    INFO("parameter " << item.key());
    CHECK(item.value().equal(final_b[item.key()]));
  }
}

// --- Refused arrangements --------------------------------------------------------------------

FSDP_RANKS_TEST_CASE("no unit contains both users of a tied weight: a clear error at the first forward, model unchanged", "[tied][errors]") {
  torch::manual_seed(9);
  auto model = fsdp::testing::TiedSiblings(kIn, kHidden);
  torch::manual_seed(9);
  auto reference = fsdp::testing::TiedSiblings(kIn, kHidden);
  const auto o = FullyShardOptions().communicator(fresh_comm());
  auto emb = fsdp::fully_shard(model->emb, o);
  auto head = fsdp::fully_shard(model->head, o);  // no fully_shard(model)
  const auto keys_before = model->named_parameters().keys();
  std::vector<at::Tensor> shards_before;
  for (const auto& h : fsdp::detail::handles_of(emb)) shards_before.push_back(h->local_shard().clone());
  const at::Tensor x = at::randn({3, kIn});
  for (int attempt = 0; attempt < 2; ++attempt) {  // refused every time, not only the first
    INFO("attempt " << attempt);
    CHECK_THROWS_WITH(model(x), Contains("fully_shard: parameter 'weight'") && Contains("LinearImpl)") &&
                                    Contains("ProjectionImpl)") && Contains("outside that tree") &&
                                    Contains("Apply fully_shard to a module that contains both"));
  }
  // The head first: its parameter belongs to a unit outside its tree.
  CHECK_THROWS_WITH(model->head(at::randn({2, kHidden})),
                    Contains("fully_shard: parameter 'weight' of unit '<root>' (") && Contains("ProjectionImpl)") &&
                        Contains("LinearImpl)") && Contains("outside that tree") &&
                        Contains("Apply fully_shard to a module that contains both"));
  // Nothing moved or changed.
  CHECK(model->named_parameters().keys() == keys_before);
  CHECK(model->head->weight.is_same(model->emb->weight));
  CHECK(emb.manages(model->emb->weight));
  CHECK(fsdp::detail::handles_of(head).empty());
  REQUIRE(fsdp::detail::handles_of(emb).size() == shards_before.size());
  for (size_t i = 0; i < shards_before.size(); ++i) CHECK(fsdp::detail::handles_of(emb)[i]->local_shard().equal(shards_before[i]));
  CHECK(fsdp::detail::handles_of(emb)[0]->unsharded_bytes() == 0);
  // Doing what the error says makes it work.
  auto root = fsdp::fully_shard(model, o);
  CHECK(root.manages(model->emb->weight));
  at::Tensor out = model(x);
  CHECK(at::allclose(out, reference(x), 1e-6, 1e-6));
  out.sum().backward();
}

FSDP_RANKS_TEST_CASE("a unit that ran forward or is unsharded cannot give a tied weight up: clear errors, model unchanged", "[tied][errors]") {
  const auto o = FullyShardOptions().communicator(fresh_comm());
  {
    // Unsharded on demand (on one rank there is nothing to unshard): reshard() first.
    torch::manual_seed(10);
    auto model = fsdp::testing::TiedParent(kIn, kHidden);
    auto enc = fsdp::fully_shard(model->inner->enc, o);
    enc.unshard();
    if (fsdp::detail::handles_of(enc)[0]->is_unsharded()) {
      CHECK_THROWS_WITH(fsdp::fully_shard(model->inner, o),
                        Contains("fully_shard: ") && Contains("module '<root>' (") && Contains("TiedInnerImpl)") &&
                            Contains("parameter 'w'") && Contains("('<root>', 'enc')") &&
                            Contains("from unit 'enc'") && Contains("Call reshard() on that unit"));
      CHECK_FALSE(fsdp::fsdp_module_of(*model->inner).has_value());
      CHECK(enc.manages(model->inner->w));
      CHECK(fsdp::detail::handles_of(enc)[0]->is_unsharded());
    }
    enc.reshard();
    auto inner = fsdp::fully_shard(model->inner, o);
    CHECK(inner.manages(model->inner->w));
  }
  {
    // enc ran as a root of its own before its parent was sharded: the weight cannot move any more.
    torch::manual_seed(11);
    auto model = fsdp::testing::TiedParent(kIn, kHidden);
    auto enc = fsdp::fully_shard(model->inner->enc, o);
    const auto keys_before = model->named_parameters().keys();
    {
      c10::NoGradGuard no_grad;
      model->inner->enc(at::randn({2, kHidden}));
    }
    const at::Tensor shard_before = fsdp::detail::handles_of(enc)[0]->local_shard().clone();
    CHECK_THROWS_WITH(fsdp::fully_shard(model->inner, o),
                      Contains("fully_shard: ") && Contains("module '<root>' (") && Contains("TiedInnerImpl)") &&
                          Contains("parameter 'w'") && Contains("from unit 'enc'") &&
                          Contains("already ran forward") && Contains("before the first forward"));
    CHECK_FALSE(fsdp::fsdp_module_of(*model->inner).has_value());
    CHECK(enc.manages(model->inner->w));
    CHECK(fsdp::detail::handles_of(enc)[0]->local_shard().equal(shard_before));
    CHECK(model->named_parameters().keys() == keys_before);
  }
}

FSDP_RANKS_TEST_CASE("a unit managing a tied weight must contain its users inside its root's tree: clear error, model unchanged", "[tied][errors]") {
  // {pair.a, y.proj} is one unit spanning two subtrees; pair.b, inside the root unit `pair`, uses
  // the weight too, but that unit does not contain pair.b.
  torch::manual_seed(12);
  auto model = fsdp::testing::TiedAcross(kIn, kHidden);
  torch::manual_seed(12);
  auto reference = fsdp::testing::TiedAcross(kIn, kHidden);
  const auto o = FullyShardOptions().communicator(fresh_comm());
  auto across = fsdp::fully_shard({model->pair->a.ptr().get(), model->y->proj.ptr().get()}, o);
  auto pair = fsdp::fully_shard(model->pair, o);
  CHECK(across.manages(model->pair->a->weight));  // the pair unit does not contain y.proj
  const auto keys_before = model->named_parameters().keys();
  const at::Tensor shard_before = fsdp::detail::handles_of(across)[0]->local_shard().clone();
  const at::Tensor x = at::randn({3, kIn});
  CHECK_THROWS_WITH(model(x), Contains("fully_shard: parameter 'a.weight' is used by modules 'a', 'b'") &&
                                  Contains("TiedPairImpl)") && Contains("managed by unit 'a'") &&
                                  Contains("which does not contain 'b'") &&
                                  Contains("Apply fully_shard to a module that contains all of them"));
  CHECK(model->named_parameters().keys() == keys_before);
  CHECK(across.manages(model->pair->a->weight));
  CHECK(fsdp::detail::handles_of(across)[0]->local_shard().equal(shard_before));
  // fully_shard on the model, which contains every user, takes the weight over.
  auto root = fsdp::fully_shard(model, o);
  CHECK(root.manages(model->pair->a->weight));
  CHECK_FALSE(across.manages(model->pair->a->weight));
  at::Tensor out = model(x);
  CHECK(at::allclose(out, reference(x), 1e-6, 1e-6));
  out.sum().backward();
}
