// Optimizer state dicts over MPI on every world size, for AdamW and SGD with momentum.
// The reference: an unsharded copy of the model trained with gradients averaged over the ranks'
// batches, whose optimizer's state is read directly from LibTorch and written under the
// documented keys (reference_dict below).
// - full_optimizer_state_dict of the sharded model equals the reference's (every strategy, and
//   hybrid sharding where the world allows);
// - sharded_optimizer_state_dict's views, reassembled across the world, equal it too, every
//   element written by exactly one rank;
// - loading (full, from every rank or from rank 0; sharded, into a never-stepped optimizer) into
//   a fresh model and optimizer continues training exactly as the source does, and as the
//   reference does;
// - bad dicts are errors on every rank that change nothing.
#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "fsdp_cpp/checkpoint/optimizer_state_dict.h"
#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/comm/device_mesh.h"
#include "fsdp_cpp/tests/composable/parity.h"
#include "fsdp_cpp/tests/composable/test_models.h"
#include "fsdp_cpp/tests/composable/tied_models.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::testing::MlpStack;
using fsdp::testing::rank;
using fsdp::testing::error_of;
using fsdp::testing::same_on_every_rank;
using fsdp::testing::world;
using fsdp::testing::world_size;
using Dict = torch::OrderedDict<std::string, at::Tensor>;

enum class Opt { kAdamW, kSgd };

std::shared_ptr<fsdp::comm::Communicator> fresh_comm() {
  return std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
}

MlpStack make_stack(uint64_t seed) {
  torch::manual_seed(seed);
  return MlpStack(6, 8, 16, 2, 3);
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Opt kind, const std::vector<at::Tensor>& params) {
  if (kind == Opt::kAdamW) {
    return std::make_unique<torch::optim::AdamW>(
        params, torch::optim::AdamWOptions(1e-2).betas({0.8, 0.95}).eps(1e-7).weight_decay(0.05));
  }
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(0.01));
}

at::Tensor batch(int it, int q, int salt) {
  auto g = at::detail::createCPUGenerator(static_cast<uint64_t>(1000 * it + 10 * q + salt));
  return at::randn({4, salt == 1 ? 6 : 3}, g);
}

// One step of the sharded model on this rank's batch.
void sharded_step(MlpStack& model, torch::optim::Optimizer& opt, int it) {
  torch::nn::functional::mse_loss(model(batch(it, rank(), 1)), batch(it, rank(), 2)).backward();
  opt.step();
  opt.zero_grad();
}

// One step of the reference on every rank's batch, gradients averaged.
void reference_step(MlpStack& model, torch::optim::Optimizer& opt, int it) {
  const int W = world_size();
  for (int q = 0; q < W; ++q) (torch::nn::functional::mse_loss(model(batch(it, q, 1)), batch(it, q, 2)) / W).backward();
  opt.step();
  opt.zero_grad();
}

// The reference optimizer's state under the documented keys, read from LibTorch directly.
Dict reference_dict(MlpStack& model, torch::optim::Optimizer& opt, Opt kind) {
  Dict d;
  for (const auto& item : model->named_parameters()) {
    const auto& s = *opt.state().at(item.value().unsafeGetTensorImpl());
    if (kind == Opt::kAdamW) {
      const auto& a = static_cast<const torch::optim::AdamWParamState&>(s);
      d.insert("state." + item.key() + ".step", at::scalar_tensor(static_cast<double>(a.step()), at::kFloat));
      d.insert("state." + item.key() + ".exp_avg", a.exp_avg().clone());
      d.insert("state." + item.key() + ".exp_avg_sq", a.exp_avg_sq().clone());
    } else {
      d.insert("state." + item.key() + ".momentum_buffer",
               static_cast<const torch::optim::SGDParamState&>(s).momentum_buffer().clone());
    }
  }
  auto scalar = [](double v) { return at::scalar_tensor(v, at::kDouble); };
  for (const auto& item : model->named_parameters()) {
    const std::string p = "param_groups." + item.key() + ".";
    if (kind == Opt::kAdamW) {
      d.insert(p + "lr", scalar(1e-2));
      d.insert(p + "betas", at::tensor({0.8, 0.95}, at::kDouble));
      d.insert(p + "eps", scalar(1e-7));
      d.insert(p + "weight_decay", scalar(0.05));
      d.insert(p + "amsgrad", scalar(0));
    } else {
      d.insert(p + "lr", scalar(0.05));
      d.insert(p + "momentum", scalar(0.9));
      d.insert(p + "dampening", scalar(0));
      d.insert(p + "weight_decay", scalar(0.01));
      d.insert(p + "nesterov", scalar(0));
    }
  }
  return d;
}

void check_close(const Dict& actual, const Dict& expected, bool exact) {
  REQUIRE(actual.keys() == expected.keys());
  for (const auto& item : expected) {
    INFO(item.key() << ": " << actual[item.key()] << " vs " << item.value());
    CHECK(actual[item.key()].scalar_type() == item.value().scalar_type());
    CHECK(actual[item.key()].sizes() == item.value().sizes());
    CHECK((exact ? actual[item.key()].equal(item.value())
                 : at::allclose(actual[item.key()], item.value(), 1e-4, 1e-6)));
  }
}

Dict model_state(torch::nn::Module& m) {
  Dict state;
  for (const auto& item : m.named_parameters()) state.insert(item.key(), item.value().detach().clone());
  return state;
}

Dict everywhere(const fsdp::FSDPModule& root) {
  return fsdp::full_state_dict(root, fsdp::FullStateDictOptions().rank0_only(false));
}

// A sharded model with its optimizer, and the unsharded reference with its own.
struct Pair {
  MlpStack model{nullptr};
  std::vector<fsdp::FSDPModule> units;
  std::unique_ptr<torch::optim::Optimizer> opt;
  MlpStack reference{nullptr};
  std::unique_ptr<torch::optim::Optimizer> ref_opt;
};

Pair trained_pair(Opt kind, const fsdp::FullyShardOptions& options, int steps) {
  Pair p;
  p.model = make_stack(61);
  p.reference = make_stack(61);
  p.units = fsdp::testing::shard_stack(p.model, options);
  p.opt = make_optimizer(kind, p.model->parameters());
  p.ref_opt = make_optimizer(kind, p.reference->parameters());
  for (int it = 0; it < steps; ++it) {
    sharded_step(p.model, *p.opt, it);
    reference_step(p.reference, *p.ref_opt, it);
  }
  return p;
}

struct Setup {
  std::string name;
  std::function<fsdp::FullyShardOptions()> options;
};

std::vector<Setup> setups() {
  std::vector<Setup> s{
      {"full shard", [] { return fsdp::FullyShardOptions().communicator(fresh_comm()); }},
      {"no shard", [] { return fsdp::FullyShardOptions().communicator(fresh_comm()).strategy(fsdp::ShardingStrategy::kNoShard); }}};
  const int W = world_size();
  if (W == 2 || W == 4) {
    s.push_back({"hybrid", [W] { return fsdp::FullyShardOptions().mesh(fsdp::comm::DeviceMesh::hybrid(world(), W / 2)); }});
  }
  return s;
}

const char* name_of(Opt kind) { return kind == Opt::kAdamW ? "AdamW" : "SGD"; }

}  // namespace

FSDP_RANKS_TEST_CASE("full_optimizer_state_dict equals the reference optimizer's state by FQN", "[optimizer_state_dict]") {
  for (Opt kind : {Opt::kAdamW, Opt::kSgd}) {
    for (const auto& setup : setups()) {
      INFO(name_of(kind) << ", " << setup.name);
      auto p = trained_pair(kind, setup.options(), 3);
      const Dict expected = reference_dict(p.reference, *p.ref_opt, kind);
      const Dict full = fsdp::full_optimizer_state_dict(p.units.back(), *p.opt);
      CHECK(full.is_empty() == (rank() != 0));
      if (rank() == 0) check_close(full, expected, world_size() == 1);
      check_close(fsdp::full_optimizer_state_dict(p.units.back(), *p.opt, fsdp::FullStateDictOptions().rank0_only(false)),
                  expected, world_size() == 1);
    }
  }
}

FSDP_RANKS_TEST_CASE("sharded_optimizer_state_dict views reassemble into the reference's state, written once", "[optimizer_state_dict][sharded]") {
  for (Opt kind : {Opt::kAdamW, Opt::kSgd}) {
    for (const auto& setup : setups()) {
      INFO(name_of(kind) << ", " << setup.name);
      auto p = trained_pair(kind, setup.options(), 2);
      const Dict expected = reference_dict(p.reference, *p.ref_opt, kind);
      const auto sharded = fsdp::sharded_optimizer_state_dict(p.units.back(), *p.opt);
      std::vector<std::string> keys;
      for (const auto& [key, shard] : sharded) keys.push_back(key);
      REQUIRE(keys == expected.keys());
      for (const auto& [key, shard] : sharded) {
        INFO(key);
        const at::Tensor& value = expected[key];
        CHECK(shard.global_shape == value.sizes().vec());
        REQUIRE(shard.local.dim() == 1);
        at::Tensor values = at::zeros({shard.global_numel()}, at::kDouble);
        at::Tensor counts = at::zeros({shard.global_numel()}, at::kInt);
        if (shard.write) {
          values.narrow(0, shard.flat_offset, shard.local.numel()).copy_(shard.local);
          counts.narrow(0, shard.flat_offset, shard.local.numel()).fill_(1);
        }
        world().all_reduce(values).wait();
        world().all_reduce(counts).wait();
        CHECK(counts.eq(1).all().item<bool>());
        CHECK(at::allclose(values.view(value.sizes()), value.to(at::kDouble), 1e-4, 1e-6));
      }
      // The state tensors' entries are views of the live state: the next step moves them.
      std::vector<at::Tensor> before;
      for (const auto& [key, shard] : sharded) before.push_back(shard.local.clone());
      sharded_step(p.model, *p.opt, 7);
      size_t moved = 0;
      for (size_t i = 0; i < sharded.size(); ++i) {
        if (sharded[i].first.rfind("state.", 0) == 0 && sharded[i].first.find(".step") == std::string::npos &&
            sharded[i].second.local.numel() > 0) {
          moved += !sharded[i].second.local.equal(before[i]);
        }
      }
      CHECK(moved > 0);
    }
  }
}

FSDP_RANKS_TEST_CASE("a full round trip into a fresh model and optimizer continues training identically", "[optimizer_state_dict]") {
  for (Opt kind : {Opt::kAdamW, Opt::kSgd}) {
    for (const auto& setup : setups()) {
    for (bool from_rank0 : {false, true}) {
      INFO(name_of(kind) << ", " << setup.name << ", broadcast_from_rank0 " << from_rank0);
      auto p = trained_pair(kind, setup.options(), 3);
      const auto save = fsdp::FullStateDictOptions().rank0_only(from_rank0);
      const Dict model_sd = fsdp::full_state_dict(p.units.back(), save);
      const Dict optim_sd = fsdp::full_optimizer_state_dict(p.units.back(), *p.opt, save);

      auto fresh = make_stack(70 + rank());
      auto units = fsdp::testing::shard_stack(fresh, setup.options());
      auto opt = make_optimizer(kind, fresh->parameters());
      const auto load = fsdp::LoadFullStateDictOptions().broadcast_from_rank0(from_rank0);
      fsdp::load_full_state_dict(units.back(), model_sd, load);
      fsdp::load_full_optimizer_state_dict(units.back(), *opt, optim_sd, load);

      for (int it = 3; it < 6; ++it) {
        sharded_step(p.model, *p.opt, it);
        sharded_step(fresh, *opt, it);
        reference_step(p.reference, *p.ref_opt, it);
      }
      const Dict source = everywhere(p.units.back());
      const Dict loaded = everywhere(units.back());
      for (const auto& item : model_state(*p.reference)) {
        INFO(item.key());
        CHECK(loaded[item.key()].equal(source[item.key()]));
        CHECK(at::allclose(loaded[item.key()], item.value(), 1e-4, 1e-6));
      }
    }
    }
  }
}

FSDP_RANKS_TEST_CASE("the reference's full optimizer state loads into a sharded model that then trains like it", "[optimizer_state_dict]") {
  for (Opt kind : {Opt::kAdamW, Opt::kSgd}) {
    INFO(name_of(kind));
    auto p = trained_pair(kind, fsdp::FullyShardOptions().communicator(fresh_comm()), 2);
    auto fresh = make_stack(80 + rank());
    auto units = fsdp::testing::shard_stack(fresh, fsdp::FullyShardOptions().communicator(fresh_comm()).strategy(
                                                       fsdp::ShardingStrategy::kShardGradOp));
    auto opt = make_optimizer(kind, fresh->parameters());
    fsdp::load_full_state_dict(units.back(), model_state(*p.reference));
    fsdp::load_full_optimizer_state_dict(units.back(), *opt, reference_dict(p.reference, *p.ref_opt, kind));
    for (int it = 2; it < 5; ++it) {
      sharded_step(fresh, *opt, it);
      reference_step(p.reference, *p.ref_opt, it);
    }
    const Dict loaded = everywhere(units.back());
    for (const auto& item : model_state(*p.reference)) {
      INFO(item.key());
      CHECK(at::allclose(loaded[item.key()], item.value(), 1e-4, 1e-6));
    }
  }
}

FSDP_RANKS_TEST_CASE("a never-stepped optimizer loaded from a sharded dict steps like the reference", "[optimizer_state_dict][sharded]") {
  for (Opt kind : {Opt::kAdamW, Opt::kSgd}) {
    for (const auto& setup : setups()) {
      INFO(name_of(kind) << ", " << setup.name);
      auto p = trained_pair(kind, setup.options(), 2);
      const Dict expected = reference_dict(p.reference, *p.ref_opt, kind);
      const Dict params = model_state(*p.reference);

      auto fresh = make_stack(90 + rank());
      auto units = fsdp::testing::shard_stack(fresh, setup.options());
      auto opt = make_optimizer(kind, fresh->parameters());
      // Lower the learning rate: the checkpoint's hyperparameters must replace it.
      for (auto& group : opt->param_groups()) group.options().set_lr(1e-5);
      CHECK(opt->state().empty());
      // A checkpoint reader: fill every view from the full values at its offset.
      const auto model_sd = fsdp::sharded_state_dict(units.back());
      const auto optim_sd = fsdp::sharded_optimizer_state_dict(units.back(), *opt);
      CHECK(opt->state().empty());  // the fresh zero tensors are not installed yet
      {
        at::NoGradGuard no_grad;
        for (const auto& [key, shard] : model_sd) {
          shard.local.copy_(params[key].reshape({-1}).narrow(0, shard.flat_offset, shard.local.numel()));
        }
        for (const auto& [key, shard] : optim_sd) {
          if (key.rfind("state.", 0) == 0) CHECK(shard.local.count_nonzero().item<int64_t>() == 0);
          shard.local.copy_(expected[key].reshape({-1}).narrow(0, shard.flat_offset, shard.local.numel()));
        }
      }
      fsdp::load_sharded_optimizer_state_dict(units.back(), *opt, optim_sd);
      CHECK(opt->state().size() == fresh->parameters().size());
      check_close(fsdp::full_optimizer_state_dict(units.back(), *opt, fsdp::FullStateDictOptions().rank0_only(false)),
                  expected, true);

      for (int it = 2; it < 5; ++it) {
        sharded_step(fresh, *opt, it);
        sharded_step(p.model, *p.opt, it);
        reference_step(p.reference, *p.ref_opt, it);
      }
      const Dict loaded = everywhere(units.back());
      const Dict source = everywhere(p.units.back());
      for (const auto& item : model_state(*p.reference)) {
        INFO(item.key());
        CHECK(at::allclose(loaded[item.key()], item.value(), 1e-4, 1e-6));
        CHECK(at::allclose(loaded[item.key()], source[item.key()], 1e-5, 1e-7));
      }
    }
  }
}

FSDP_RANKS_TEST_CASE("a sharded round trip into a stepped optimizer copies into its live state", "[optimizer_state_dict][sharded]") {
  auto p = trained_pair(Opt::kAdamW, fsdp::FullyShardOptions().communicator(fresh_comm()), 2);
  auto other = trained_pair(Opt::kAdamW, fsdp::FullyShardOptions().communicator(fresh_comm()), 4);
  const auto source = fsdp::sharded_optimizer_state_dict(p.units.back(), *p.opt);
  auto target = fsdp::sharded_optimizer_state_dict(other.units.back(), *other.opt);
  // Loading the source's views into the other optimizer: values copied, not aliased.
  fsdp::load_sharded_optimizer_state_dict(other.units.back(), *other.opt, source);
  const auto expected = reference_dict(p.reference, *p.ref_opt, Opt::kAdamW);
  check_close(fsdp::full_optimizer_state_dict(other.units.back(), *other.opt, fsdp::FullStateDictOptions().rank0_only(false)),
              expected, world_size() == 1);
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i].second.local.numel() > 0 && source[i].first.find(".exp_avg") != std::string::npos) {
      CHECK(source[i].second.local.data_ptr() != target[i].second.local.data_ptr());
      CHECK(target[i].second.local.equal(source[i].second.local));  // the other optimizer's live state
    }
  }
}

FSDP_RANKS_TEST_CASE("bad optimizer state dicts are errors on every rank that change nothing", "[optimizer_state_dict]") {
  const int W = world_size();
  auto p = trained_pair(Opt::kAdamW, fsdp::FullyShardOptions().communicator(fresh_comm()), 2);
  const auto all = fsdp::FullStateDictOptions().rank0_only(false);
  const Dict before = fsdp::full_optimizer_state_dict(p.units.back(), *p.opt, all);
  auto unchanged = [&] {
    const Dict now = fsdp::full_optimizer_state_dict(p.units.back(), *p.opt, all);
    for (const auto& item : before) {
      if (!now[item.key()].equal(item.value())) return false;
    }
    return true;
  };
  // Another optimizer's values, to load.
  auto q = trained_pair(Opt::kAdamW, fsdp::FullyShardOptions().communicator(fresh_comm()), 1);
  const Dict good = fsdp::full_optimizer_state_dict(q.units.back(), *q.opt, all);

  // A rank-0-only dict read on every rank.
  const Dict rank0_only = fsdp::full_optimizer_state_dict(q.units.back(), *q.opt);
  if (W > 1) {
    const std::string error = error_of([&] { fsdp::load_full_optimizer_state_dict(p.units.back(), *p.opt, rank0_only); });
    INFO(error);
    CHECK(same_on_every_rank(error));
    CHECK_THAT(error, Contains("fsdp::load_full_optimizer_state_dict: the state dict of rank 1 is not loadable: missing"));
    CHECK_THAT(error, Contains("'state.blocks.1.fc2.weight.exp_avg_sq'"));
    CHECK_THAT(error, Contains("'param_groups.head.bias.lr'"));
    CHECK(unchanged());
  }

  // Hyperparameters that differ within a group, and an extra key.
  auto mixed = good;
  mixed["param_groups.blocks.0.fc1.bias.lr"] = at::scalar_tensor(0.5, at::kDouble);
  std::string error = error_of([&] { fsdp::load_full_optimizer_state_dict(p.units.back(), *p.opt, mixed); });
  CHECK(same_on_every_rank(error));
  CHECK_THAT(error, Contains("'param_groups.blocks.0.fc1.bias.lr' is 0.5 but 'param_groups.in.weight.lr' is 0.01, and both "
                                 "parameters are in optimizer parameter group 0"));
  auto extra = good;
  extra.insert("state.nothing.exp_avg", at::zeros({1}));
  error = error_of([&] { fsdp::load_full_optimizer_state_dict(p.units.back(), *p.opt, extra); });
  CHECK(same_on_every_rank(error));
  CHECK_THAT(error, Contains("unexpected 1 key 'state.nothing.exp_avg'"));
  CHECK(unchanged());

  // Sharded: a missing key and a wrong size, named; nothing changes.
  auto sharded = fsdp::sharded_optimizer_state_dict(q.units.back(), *q.opt);
  fsdp::ShardedStateDict broken;
  for (auto [key, shard] : sharded) {
    if (key == "state.head.weight.exp_avg") continue;
    if (key == "state.in.weight.exp_avg_sq") shard.local = at::zeros({shard.local.numel() + 1});
    broken.emplace_back(key, shard);
  }
  error = error_of([&] { fsdp::load_sharded_optimizer_state_dict(p.units.back(), *p.opt, broken); });
  CHECK_THAT(error, Contains("fsdp::load_sharded_optimizer_state_dict: missing 1 key 'state.head.weight.exp_avg'"));
  CHECK_THAT(error, Contains("'state.in.weight.exp_avg_sq' has global shape [8, 6]"));
  CHECK(unchanged());

  // A good dict loads.
  fsdp::load_full_optimizer_state_dict(p.units.back(), *p.opt, good);
  check_close(fsdp::full_optimizer_state_dict(p.units.back(), *p.opt, all), good, true);
}

FSDP_RANKS_TEST_CASE("a tied parameter's optimizer state is under each of its FQNs and loads back", "[optimizer_state_dict][tied]") {
  auto make = [](uint64_t seed) {
    torch::manual_seed(seed);
    auto model = fsdp::testing::TiedSiblings(4, 6);
    const auto options = fsdp::FullyShardOptions().communicator(fresh_comm());
    fsdp::fully_shard(model->body, options);
    auto root = fsdp::fully_shard(model, options);
    return std::make_pair(model, root);
  };
  auto distinct = [](torch::nn::Module& m) {  // the optimizer holds a tied tensor once
    std::vector<at::Tensor> params;
    for (const auto& p : m.parameters()) {
      bool seen = false;
      for (const auto& q : params) seen = seen || q.is_same(p);
      if (!seen) params.push_back(p);
    }
    return params;
  };
  auto [model, root] = make(95);
  torch::optim::AdamW opt(distinct(*model), torch::optim::AdamWOptions(1e-2));
  for (int it = 0; it < 2; ++it) {
    model(at::randn({3, 4})).pow(2).mean().backward();
    opt.step();
    opt.zero_grad();
  }
  const auto all = fsdp::FullStateDictOptions().rank0_only(false);
  const Dict full = fsdp::full_optimizer_state_dict(root, opt, all);
  for (const std::string name : {"step", "exp_avg", "exp_avg_sq"}) {
    INFO(name);
    REQUIRE(full.contains("state.emb.weight." + name));
    REQUIRE(full.contains("state.head.weight." + name));
    CHECK(full["state.head.weight." + name].equal(full["state.emb.weight." + name]));
  }
  CHECK(full["state.emb.weight.exp_avg"].sizes() == at::IntArrayRef({6, 4}));
  CHECK(full["state.emb.weight.step"].item<float>() == 2);
  const auto sharded = fsdp::sharded_optimizer_state_dict(root, opt);
  const fsdp::LocalShard* emb = nullptr;
  const fsdp::LocalShard* head = nullptr;
  for (const auto& [key, shard] : sharded) {
    if (key == "state.emb.weight.exp_avg") emb = &shard;
    if (key == "state.head.weight.exp_avg") head = &shard;
  }
  REQUIRE(emb != nullptr);
  REQUIRE(head != nullptr);
  CHECK(emb->local.data_ptr() == head->local.data_ptr());
  CHECK(emb->write == head->write);

  // Into a fresh tied model and optimizer.
  auto [fresh, fresh_root] = make(96);
  torch::optim::AdamW fresh_opt(distinct(*fresh), torch::optim::AdamWOptions(1e-3));
  fsdp::load_full_state_dict(fresh_root, everywhere(root));
  fsdp::load_full_optimizer_state_dict(fresh_root, fresh_opt, full);
  check_close(fsdp::full_optimizer_state_dict(fresh_root, fresh_opt, all), full, true);
}
