// Model state dicts over MPI on every world size.
// Full: saving a trained sharded model gives the unsharded reference's parameters and buffers under
// the same keys (rank 0 only by default); loading a full state dict into a freshly initialised
// sharded model (any strategy) makes it compute exactly what the source computes, from every
// rank's dict or from rank 0's alone; bad dicts (missing or extra keys, shapes, dtypes, a
// rank-0-only dict read on every rank, different dicts on different ranks, one bad rank) are the
// same clear error on every rank and leave every rank's model unchanged.
// Sharded: each rank's views, reassembled across the world from global_shape / flat_offset /
// write, give every element of the full state dict exactly once (hybrid sharding and tied
// parameters too), and writing into the views loads.
#include <filesystem>

#include <ATen/ATen.h>
#include <torch/serialize.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/comm/device_mesh.h"
#include "fsdp_cpp/composable/fully_shard_internal.h"
#include "fsdp_cpp/tests/composable/parity.h"
#include "fsdp_cpp/tests/composable/test_models.h"
#include "fsdp_cpp/tests/composable/tied_models.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::testing::rank;
using fsdp::testing::error_of;
using fsdp::testing::same_on_every_rank;
using fsdp::testing::world;
using fsdp::testing::world_size;
using Dict = torch::OrderedDict<std::string, at::Tensor>;

std::shared_ptr<fsdp::comm::Communicator> fresh_comm() {
  return std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
}

Dict unsharded_state(torch::nn::Module& m) {
  Dict state;
  for (const auto& item : m.named_parameters()) state.insert(item.key(), item.value().detach().clone());
  for (const auto& item : m.named_buffers()) state.insert(item.key(), item.value().detach().clone());
  return state;
}

Dict everywhere(const fsdp::FSDPModule& root) {
  return fsdp::full_state_dict(root, fsdp::FullStateDictOptions().rank0_only(false));
}

bool dicts_equal(const Dict& a, const Dict& b) {
  if (a.keys() != b.keys()) return false;
  for (const auto& item : a) {
    if (!item.value().equal(b[item.key()])) return false;
  }
  return true;
}

// An MlpStack with a buffer, the same on every rank for one seed.
fsdp::testing::MlpStack make_stack(uint64_t seed) {
  torch::manual_seed(seed);
  auto model = fsdp::testing::MlpStack(6, 8, 16, 2, 3);
  model->register_buffer("running", at::randn({5}));
  return model;
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
    for (const auto& h : fsdp::detail::handles_of(u)) CHECK(h->unsharded_bytes() == 0);
  }
  CHECK(everywhere(units.back()).size() == unsharded_state(*reference).size());
}

FSDP_RANKS_TEST_CASE("load_full_state_dict makes a fresh sharded model compute like the source", "[state_dict]") {
  auto source = make_stack(42);
  const auto state = unsharded_state(*source);
  const int W = world_size();
  for (bool from_rank0 : {false, true}) {
    for (int setup = 0; setup < 4; ++setup) {
      INFO("setup " << setup << " (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, hybrid), broadcast_from_rank0 " << from_rank0);
      if (setup == 3 && W != 2 && W != 4) continue;
      const auto strategy = setup == 1 ? fsdp::ShardingStrategy::kShardGradOp
                            : setup == 2 ? fsdp::ShardingStrategy::kNoShard
                                         : fsdp::ShardingStrategy::kFullShard;
      auto options = setup == 3 ? fsdp::FullyShardOptions().mesh(fsdp::comm::DeviceMesh::hybrid(world(), W / 2))
                                : fsdp::FullyShardOptions().communicator(fresh_comm()).strategy(strategy);
      auto model = make_stack(1000 + rank());  // a different initialisation on every rank
      auto units = fsdp::testing::shard_stack(model, options);
      // From rank 0, the other ranks' dicts are not read: give them wrong ones.
      const Dict input = !from_rank0 || rank() == 0 ? state : unsharded_state(*make_stack(7));
      fsdp::load_full_state_dict(units.back(), input, fsdp::LoadFullStateDictOptions().broadcast_from_rank0(from_rank0));
      const at::Tensor x = at::randn({5, 6});
      CHECK(at::allclose(model(x), source(x), 1e-6, 1e-6));
      CHECK(dicts_equal(everywhere(units.back()), state));
    }
  }
}

FSDP_RANKS_TEST_CASE("broadcast_from_rank0 needs no dict on the other ranks", "[state_dict]") {
  auto source = make_stack(45);
  auto model = make_stack(46 + rank());
  auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
  // full_state_dict's default: the tensors on rank 0 only.
  auto saver = make_stack(45);
  auto saver_units = fsdp::testing::shard_stack(saver, fsdp::FullyShardOptions().communicator(fresh_comm()));
  const Dict saved = fsdp::full_state_dict(saver_units.back());
  CHECK(saved.is_empty() == (rank() != 0));
  fsdp::load_full_state_dict(units.back(), saved, fsdp::LoadFullStateDictOptions().broadcast_from_rank0(true));
  CHECK(dicts_equal(everywhere(units.back()), unsharded_state(*source)));
  // Hybrid sharding: only world rank 0 gets (and gives) the tensors.
  const int W = world_size();
  if (W == 2 || W == 4) {
    auto mesh = fsdp::comm::DeviceMesh::hybrid(world(), W / 2);
    auto hybrid = make_stack(47 + rank());
    auto hybrid_units = fsdp::testing::shard_stack(hybrid, fsdp::FullyShardOptions().mesh(mesh));
    const Dict from_hybrid = fsdp::full_state_dict(hybrid_units.back());
    CHECK(from_hybrid.is_empty() == (rank() != 0));
    fsdp::load_full_state_dict(hybrid_units.back(), saved, fsdp::LoadFullStateDictOptions().broadcast_from_rank0(true));
    CHECK(dicts_equal(everywhere(hybrid_units.back()), unsharded_state(*source)));
  }
}

FSDP_RANKS_TEST_CASE("a rank-0-only dict loaded on every rank is the same error everywhere and loads nothing", "[state_dict]") {
  const int W = world_size();
  auto source = make_stack(47);
  auto model = make_stack(48);
  auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
  const Dict before = everywhere(units.back());
  const Dict input = rank() == 0 ? unsharded_state(*source) : Dict();
  if (W == 1) {
    fsdp::load_full_state_dict(units.back(), input);
    CHECK(dicts_equal(everywhere(units.back()), unsharded_state(*source)));
    return;
  }
  const std::string error = error_of([&] { fsdp::load_full_state_dict(units.back(), input); });
  INFO(error);
  CHECK(same_on_every_rank(error));
  CHECK_THAT(error, Contains("fsdp::load_full_state_dict: the state dict of rank 1 is not loadable"));
  CHECK_THAT(error, Contains("missing " + std::to_string(before.size()) + " keys"));
  for (const auto& item : before) CHECK_THAT(error, Contains("'" + item.key() + "'"));
  CHECK_THAT(error, Contains("broadcast_from_rank0(true)"));
  CHECK_THAT(error, Contains("Nothing was loaded on any rank"));
  CHECK(dicts_equal(everywhere(units.back()), before));
}

FSDP_RANKS_TEST_CASE("bad keys, shapes and dtypes are named, on every rank, and change nothing", "[state_dict]") {
  auto model = make_stack(43);
  auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
  const Dict before = everywhere(units.back());
  auto load = [&](const Dict& d, fsdp::LoadFullStateDictOptions o = {}) {
    return error_of([&] { fsdp::load_full_state_dict(units.back(), d, o); });
  };

  auto bad = before;
  bad.erase("head.bias");
  bad.erase("running");
  bad.insert("unknown.weight", at::zeros({1}));
  bad.insert("blocks.0.extra", at::zeros({2}));
  bad["blocks.0.fc1.weight"] = at::zeros({3, 3});
  std::string error = load(bad);
  INFO(error);
  CHECK(same_on_every_rank(error));
  CHECK_THAT(error, Contains("missing 2 keys 'head.bias', 'running'"));
  CHECK_THAT(error, Contains("unexpected 2 keys 'unknown.weight', 'blocks.0.extra'"));
  CHECK_THAT(error, Contains("'blocks.0.fc1.weight' has shape [3, 3] in the state dict but [16, 8] in the model"));

  // A float64 or int64 value is refused (naming the key and both dtypes) unless converting.
  auto doubles = before;
  doubles["in.weight"] = before["in.weight"].to(at::kDouble) * 3;
  doubles["running"] = at::arange(5, at::kLong);
  error = load(doubles);
  CHECK(same_on_every_rank(error));
  CHECK_THAT(error, Contains("'in.weight' has dtype Double in the state dict but Float in the model"));
  CHECK_THAT(error, Contains("'running' has dtype Long in the state dict but Float in the model"));
  CHECK_THAT(error, Contains("convert_dtype(true)"));
  CHECK(dicts_equal(everywhere(units.back()), before));

  fsdp::load_full_state_dict(units.back(), doubles, fsdp::LoadFullStateDictOptions().convert_dtype(true));
  const Dict after = everywhere(units.back());
  CHECK(after["in.weight"].scalar_type() == at::kFloat);
  CHECK(after["in.weight"].equal((before["in.weight"].to(at::kDouble) * 3).to(at::kFloat)));
  CHECK(after["running"].equal(at::arange(5, at::kFloat)));
  CHECK(after["head.weight"].equal(before["head.weight"]));
}

FSDP_RANKS_TEST_CASE("one rank's bad dict fails every rank, naming that rank", "[state_dict]") {
  const int W = world_size();
  auto model = make_stack(49);
  auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
  const Dict before = everywhere(units.back());
  auto input = unsharded_state(*make_stack(50));
  if (rank() == W - 1) input["blocks.1.fc2.bias"] = at::zeros({9});
  const std::string error = error_of([&] { fsdp::load_full_state_dict(units.back(), input); });
  INFO(error);
  CHECK(same_on_every_rank(error));
  CHECK_THAT(error, Contains("the state dict of rank " + std::to_string(W - 1) + " is not loadable: "
                             "'blocks.1.fc2.bias' has shape [9]"));
  CHECK(dicts_equal(everywhere(units.back()), before));
}

FSDP_RANKS_TEST_CASE("different dicts on different ranks are refused, naming the first differing key", "[state_dict]") {
  const int W = world_size();
  auto model = make_stack(51);
  auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
  const Dict before = everywhere(units.back());
  const auto source = unsharded_state(*make_stack(52));
  auto input = unsharded_state(*make_stack(52));
  // One element of two values differs on the last rank (its sum unchanged: swapped elements).
  if (rank() == W - 1 && W > 1) {
    for (const std::string key : {"blocks.0.fc2.weight", "head.bias"}) {
      at::Tensor v = input[key].view({-1});
      const at::Tensor first = v[0].clone();
      v[0] = v[1];
      v[1] = first;
    }
  }
  if (W == 1) {
    fsdp::load_full_state_dict(units.back(), input);
    CHECK(dicts_equal(everywhere(units.back()), source));
    return;
  }
  const std::string error = error_of([&] { fsdp::load_full_state_dict(units.back(), input); });
  INFO(error);
  CHECK(same_on_every_rank(error));
  CHECK_THAT(error, Contains("the ranks passed different values for 'blocks.0.fc2.weight'"));
  CHECK(dicts_equal(everywhere(units.back()), before));
  // Not checked when asked not to: each rank loads its slices of its own dict.
  fsdp::load_full_state_dict(units.back(), input, fsdp::LoadFullStateDictOptions().check_ranks_agree(false));
  CHECK(everywhere(units.back())["in.weight"].equal(source["in.weight"]));
}

FSDP_RANKS_TEST_CASE("full_state_dict holds full-precision values under mixed precision", "[state_dict]") {
  torch::manual_seed(44);
  auto model = fsdp::testing::MlpStack(6, 8, 16, 2, 3);
  torch::manual_seed(44);
  auto reference = fsdp::testing::MlpStack(6, 8, 16, 2, 3);
  auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(fresh_comm()).mixed_precision(
                                                     fsdp::MixedPrecision().param_dtype(at::kBFloat16)));
  const auto state = everywhere(units.back());
  for (const auto& item : reference->named_parameters()) {
    INFO(item.key());
    CHECK(state[item.key()].scalar_type() == at::kFloat);
    CHECK(state[item.key()].equal(item.value()));
  }
}

namespace {

// Reassembles a sharded state dict across the world: every written element added into a zero
// tensor of the global shape, and a count of the writes per element.
void check_sharded_against_full(const fsdp::ShardedStateDict& sharded, const Dict& full) {
  std::vector<std::string> keys;
  for (const auto& [key, shard] : sharded) keys.push_back(key);
  REQUIRE(keys == full.keys());
  for (const auto& [key, shard] : sharded) {
    INFO(key);
    const at::Tensor& expected = full[key];
    CHECK(shard.global_shape == expected.sizes().vec());
    CHECK(shard.global_numel() == expected.numel());
    CHECK(shard.local.dim() == 1);
    CHECK(shard.flat_offset >= 0);
    CHECK(shard.flat_offset + shard.local.numel() <= shard.global_numel());
    at::Tensor values = at::zeros({shard.global_numel()}, at::kDouble);
    at::Tensor counts = at::zeros({shard.global_numel()}, at::kInt);
    if (shard.write) {
      values.narrow(0, shard.flat_offset, shard.local.numel()).copy_(shard.local);
      counts.narrow(0, shard.flat_offset, shard.local.numel()).fill_(1);
    }
    world().all_reduce(values).wait();
    world().all_reduce(counts).wait();
    CHECK(counts.eq(1).all().item<bool>());
    CHECK(values.to(at::kFloat).view(expected.sizes()).equal(expected));
    // Every rank's view holds the full value's elements at its offset, written or not.
    CHECK(shard.local.equal(expected.reshape({-1}).narrow(0, shard.flat_offset, shard.local.numel())));
  }
}

// Loads `values` (full, by key) by writing into the views, as a checkpoint reader does.
void write_into(const fsdp::ShardedStateDict& sharded, const Dict& values) {
  at::NoGradGuard no_grad;
  for (const auto& [key, shard] : sharded) {
    shard.local.copy_(values[key].reshape({-1}).narrow(0, shard.flat_offset, shard.local.numel()));
  }
}

}  // namespace

FSDP_RANKS_TEST_CASE("sharded_state_dict views reassemble into the full state dict, each element written once", "[state_dict][sharded]") {
  const int W = world_size();
  struct Setup {
    std::string name;
    fsdp::FullyShardOptions options;
  };
  std::vector<Setup> setups{{"full shard", fsdp::FullyShardOptions().communicator(fresh_comm())},
                            {"no shard", fsdp::FullyShardOptions().communicator(fresh_comm()).strategy(
                                             fsdp::ShardingStrategy::kNoShard)}};
  if (W == 4 || W == 2) {
    setups.push_back({"hybrid, shard size 2 or 1", fsdp::FullyShardOptions().mesh(fsdp::comm::DeviceMesh::hybrid(world(), W / 2))});
  }
  for (const auto& setup : setups) {
    INFO(setup.name);
    auto model = make_stack(53);
    auto units = fsdp::testing::shard_stack(model, setup.options);
    // Train a little so that every value differs from its initialisation.
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
    torch::nn::functional::mse_loss(model(at::randn({4, 6})), at::randn({4, 3})).backward();
    opt.step();
    const Dict full = everywhere(units.back());
    const auto sharded = fsdp::sharded_state_dict(units.back());
    check_sharded_against_full(sharded, full);

    // Writing into the views loads: the model then holds another model's values.
    const Dict other = unsharded_state(*make_stack(54));
    write_into(sharded, other);
    CHECK(dicts_equal(everywhere(units.back()), other));
    const at::Tensor x = at::randn({3, 6});
    CHECK(at::allclose(model(x), make_stack(54)(x), 1e-6, 1e-6));
  }
}

FSDP_RANKS_TEST_CASE("a tied parameter is in the sharded state dict under each FQN, loadable untied", "[state_dict][sharded][tied]") {
  auto make = [](uint64_t seed) {
    torch::manual_seed(seed);
    return fsdp::testing::TiedSiblings(4, 6);
  };
  auto model = make(55);
  const auto options = fsdp::FullyShardOptions().communicator(fresh_comm());
  fsdp::fully_shard(model->body, options);
  auto root = fsdp::fully_shard(model, options);
  const auto sharded = fsdp::sharded_state_dict(root);
  const Dict full = everywhere(root);
  check_sharded_against_full(sharded, full);
  const fsdp::LocalShard* emb = nullptr;
  const fsdp::LocalShard* head = nullptr;
  for (const auto& [key, shard] : sharded) {
    if (key == "emb.weight") emb = &shard;
    if (key == "head.weight") head = &shard;
  }
  REQUIRE(emb != nullptr);
  REQUIRE(head != nullptr);
  CHECK(head->local.data_ptr() == emb->local.data_ptr());
  CHECK(head->flat_offset == emb->flat_offset);
  CHECK(head->write == emb->write);

  // Every FQN of the unsharded model has its value: an untied model takes the tied weight under
  // both names.
  const auto reference = make(55);
  for (const auto& item : reference->named_parameters()) {
    INFO(item.key());
    REQUIRE(full.contains(item.key()));
    CHECK(full[item.key()].equal(item.value()));
  }
}

// torch::save / torch::load of a sharded model's holder (or of a holder inside it) would write
// each rank's 1-D shards as if they were the parameters, or replace the tensors fully_shard
// manages: refused on every rank before anything is written or read, the model unchanged. The
// same calls on an unsharded model still work.
FSDP_RANKS_TEST_CASE("torch::save and torch::load of a sharded model are refused, naming the unit", "[state_dict]") {
  const std::string dir = fsdp::testing::shared_tmpdir() + "/torch_save_" + std::to_string(rank());
  std::filesystem::create_directories(dir);
  // A block's archive (the stack's own would not load back in LibTorch: its child is named `in`,
  // a keyword of TorchScript's archive format).
  const std::string unsharded_path = dir + "/unsharded_block.pt";
  auto plain = make_stack(71);
  torch::save(plain->block(0), unsharded_path);  // no unit: allowed
  auto model = make_stack(72);
  auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
  const Dict before = everywhere(units.back());
  const std::string sharded_path = dir + "/sharded.pt";
  CHECK_THROWS_WITH(torch::save(model, sharded_path),
                    Contains("torch::save") && Contains("managed by fully_shard") && Contains("fsdp::dcp::save"));
  CHECK_FALSE(std::filesystem::exists(sharded_path));
  CHECK_THROWS_WITH(torch::save(model->block(0), sharded_path), Contains("torch::save") && Contains("'blocks.0'"));
  CHECK_THROWS_WITH(torch::save(model->block(0)->fc1, sharded_path), Contains("'blocks.0.fc1'"));
  CHECK_FALSE(std::filesystem::exists(sharded_path));
  auto block = model->block(0);
  CHECK_THROWS_WITH(torch::load(block, unsharded_path), Contains("torch::load") && Contains("managed by fully_shard"));
  CHECK_THROWS_WITH(torch::load(model, unsharded_path), Contains("torch::load") && Contains("'<root>'"));
  CHECK(dicts_equal(everywhere(units.back()), before));
  // The model still trains after the refusals.
  torch::nn::functional::mse_loss(model(at::ones({2, 6})), at::zeros({2, 3})).backward();
  // An unsharded model loads what was saved.
  auto other = make_stack(73);
  auto other_block = other->block(0);
  torch::load(other_block, unsharded_path);
  CHECK(other->block(0)->fc1->weight.equal(plain->block(0)->fc1->weight));
  std::filesystem::remove_all(dir);
}

// load_full_state_dict between a forward and its backward: units unsharded then (the root) would
// keep computing with the values they gathered. Refused on every rank, the model unchanged, and
// the backward still runs; also while a unit is unsharded by unshard().
FSDP_RANKS_TEST_CASE("load_full_state_dict is refused between forward and backward and while unsharded",
                     "[state_dict]") {
  auto model = make_stack(74);
  auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
  const Dict before = everywhere(units.back());
  const Dict other = everywhere(units.back());
  for (auto& item : other) item.value().add_(1.0);
  auto loss = torch::nn::functional::mse_loss(model(at::ones({2, 6})), at::zeros({2, 3}));
  // On every world size (one rank's passthrough units track the phase too).
  CHECK_THROWS_WITH(fsdp::load_full_state_dict(units.back(), other),
                    Contains("fsdp::load_full_state_dict") && Contains("backward has not") &&
                        Contains("Nothing was loaded"));
  CHECK_NOTHROW(loss.backward());
  CHECK(dicts_equal(everywhere(units.back()), before));
  units.front().unshard();
  if (world_size() > 1) {  // one rank holds nothing sharded: unshard() gathers nothing
    CHECK_THROWS_WITH(fsdp::load_full_state_dict(units.back(), other),
                      Contains("is unsharded") && Contains("reshard()"));
  }
  units.front().reshard();
  fsdp::load_full_state_dict(units.back(), other);
  CHECK(dicts_equal(everywhere(units.back()), other));
}
