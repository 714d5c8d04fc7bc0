// Distributed checkpoints (fsdp::dcp) over MPI on every world size. References are independent of
// the library: an unsharded copy of the model built from the same seed, values written by hand, or
// the source's state exported before saving. Covered: round trip into a differently initialised
// model; resharding (saved by the first s ranks, loaded on t ranks for every s, t, with FULL_SHARD,
// SHARD_GRAD_OP, NO_SHARD, mixed precision and hybrid sharding); optimizer round trip; refusals
// (corrupted byte, truncated file, missing file, broken header, missing key, shape and dtype
// mismatch, optimizer state absent) on every rank with the model unchanged; option values (checksum
// blocks, staging sizes, LoadOptions::staging_bytes); replacing a checkpoint; save_async; Extra;
// foreign checkpoints without a manifest.
#include <cstdio>
#include <filesystem>
#include <map>
#include <set>

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <nlohmann/json.hpp>
#include <torch/optim/adamw.h>

#include "fsdp_cpp/checkpoint/distributed_checkpoint.h"
#include "fsdp_cpp/checkpoint/full_state_dict_files.h"
#include "fsdp_cpp/checkpoint/optimizer_state_dict.h"
#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/comm/device_mesh.h"
#include "fsdp_cpp/comm/mpi_backend.h"
#include "fsdp_cpp/contract/hookable_module_holder.h"
#include "fsdp_cpp/contract/hookable_modules.h"
#include "fsdp_cpp/storage/atomic_directory.h"
#include "fsdp_cpp/storage/safetensors.h"
#include "fsdp_cpp/tests/composable/parity.h"
#include "fsdp_cpp/tests/composable/test_models.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

namespace fs = std::filesystem;
using Catch::Matchers::Contains;
using fsdp::testing::MlpStack;
using fsdp::testing::rank;
using fsdp::testing::world;
using fsdp::testing::world_size;
using StateDict = torch::OrderedDict<std::string, at::Tensor>;
using Comm = std::shared_ptr<fsdp::comm::Communicator>;

Comm fresh_comm() { return std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU); }

// Collective over the world: a communicator over ranks [0, s) (on those ranks; the others get the
// group of the remaining ranks, unused).
Comm first_ranks(int s) {
  auto* mpi = dynamic_cast<fsdp::comm::MpiBackend*>(world().backend().get());
  REQUIRE(mpi != nullptr);
  fsdp::comm::MpiBackend::Options options;
  options.timeout = mpi->timeout();
  options.name = "first " + std::to_string(s) + " ranks";
  return std::make_shared<fsdp::comm::Communicator>(mpi->split(rank() < s ? 0 : 1, rank(), options), at::kCPU);
}

std::string test_dir(const std::string& name) { return fsdp::testing::shared_tmpdir() + "/dcp_" + name; }

// MlpStack with two buffers (a float matrix on the root, a 0-d int64 in the head).
MlpStack make_model(uint64_t seed, int64_t hidden = 16, int64_t depth = 2) {
  torch::manual_seed(seed);
  auto model = MlpStack(6, 8, hidden, depth, 3);
  model->register_buffer("running", at::randn({3, 2}));
  model->head->register_buffer("count", at::full({}, static_cast<int64_t>(seed), at::kLong));
  return model;
}

// The unsharded model's parameters then buffers: the reference of every comparison.
StateDict reference_state(uint64_t seed, int64_t hidden = 16, int64_t depth = 2) {
  auto model = make_model(seed, hidden, depth);
  StateDict state;
  for (const auto& item : model->named_parameters()) state.insert(item.key(), item.value().detach().clone());
  for (const auto& item : model->named_buffers()) state.insert(item.key(), item.value().detach().clone());
  return state;
}

StateDict full(const fsdp::FSDPModule& root) {
  return fsdp::full_state_dict(root, fsdp::FullStateDictOptions().rank0_only(false));
}

void check_same(const StateDict& got, const StateDict& want) {
  REQUIRE(got.keys() == want.keys());
  for (const auto& item : want) {
    INFO(item.key());
    CHECK(got[item.key()].scalar_type() == item.value().scalar_type());
    CHECK(got[item.key()].equal(item.value()));
  }
}

struct Sharding {
  std::string name;
  fsdp::ShardingStrategy strategy = fsdp::ShardingStrategy::kFullShard;
  bool bf16 = false;
  int hsdp_shard_size = 0;  // > 0: hybrid sharding over the whole world
};

std::vector<Sharding> shardings() {
  std::vector<Sharding> all{{"FULL_SHARD"},
                            {"SHARD_GRAD_OP", fsdp::ShardingStrategy::kShardGradOp},
                            {"NO_SHARD", fsdp::ShardingStrategy::kNoShard},
                            {"FULL_SHARD + bf16", fsdp::ShardingStrategy::kFullShard, true}};
  if (world_size() % 2 == 0) all.push_back({"HSDP", fsdp::ShardingStrategy::kFullShard, false, world_size() / 2});
  return all;
}

fsdp::FullyShardOptions options_for(const Sharding& s, const Comm& comm) {
  auto options = fsdp::FullyShardOptions().strategy(s.strategy);
  if (s.hsdp_shard_size > 0) {
    options.mesh(fsdp::comm::DeviceMesh::hybrid(world(), s.hsdp_shard_size));
  } else {
    options.communicator(comm);
  }
  if (s.bf16) options.mixed_precision(fsdp::MixedPrecision().param_dtype(at::kBFloat16));
  return options;
}

void train(MlpStack& model, torch::optim::Optimizer& optim, int steps, int salt) {
  for (int it = 0; it < steps; ++it) {
    auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(1000 * salt + 10 * it + rank()));
    const at::Tensor x = at::randn({4, 6}, gen);
    const at::Tensor y = at::randn({4, 3}, gen);
    torch::nn::functional::mse_loss(model(x), y).backward();
    optim.step();
    optim.zero_grad();
  }
}

}  // namespace

FSDP_RANKS_TEST_CASE("a saved model loads into a differently initialised one", "[dcp]") {
  const std::string dir = test_dir("round_trip");
  auto model = make_model(1);
  auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
  fsdp::dcp::save(dir, units.back(), nullptr, {}, fsdp::dcp::SaveOptions().communicator(fresh_comm()));

  // The layout: a manifest and every writing rank's files, named as PyTorch's Hugging Face storage
  // names them, each with its DCP_SHARDING_INFO; together they store every element once.
  const auto files = fsdp::storage::list_files(dir);
  CHECK(std::count(files.begin(), files.end(), std::string(fsdp::dcp::kManifestName)) == 1);
  CHECK_FALSE(fs::exists(fsdp::storage::temporary_sibling(dir)));
  std::map<std::string, int64_t> stored;
  std::set<int> writers;
  for (const auto& name : files) {
    if (name == fsdp::dcp::kManifestName) continue;
    INFO(name);
    int r = 0, j = 0, n = 0;
    REQUIRE(std::sscanf(name.c_str(), "shard-%5d-model-%5d-of-%5d.safetensors", &r, &j, &n) == 3);
    CHECK((1 <= r && r <= world_size() && 1 <= j && j <= n));
    writers.insert(r);
    fsdp::storage::SafetensorsFile file(dir + "/" + name);
    CHECK(file.header().metadata.at("format") == "pt");
    const auto info = nlohmann::json::parse(file.header().metadata.at("DCP_SHARDING_INFO"));
    for (const auto& entry : file.header().entries) {
      CHECK(info.at(entry.key).at("saved_offsets").size() == entry.shape.size());
      stored[entry.key] += entry.numel();
    }
  }
  CHECK(writers.count(1) == 1);
  for (const auto& item : reference_state(1)) {
    INFO(item.key());
    CHECK(stored[item.key()] == item.value().numel());
  }

  torch::manual_seed(500 + rank());  // a different initialisation on every rank
  auto fresh = make_model(100 + rank());
  auto fresh_units = fsdp::testing::shard_stack(fresh, fsdp::FullyShardOptions().communicator(fresh_comm()));
  const auto before = full(fresh_units.back());
  CHECK_FALSE(before["in.weight"].equal(reference_state(1)["in.weight"]));
  fsdp::dcp::load(dir, fresh_units.back(), nullptr, nullptr, fsdp::dcp::LoadOptions().communicator(fresh_comm()));
  check_same(full(fresh_units.back()), reference_state(1));
  auto reference = make_model(1);
  const at::Tensor x = at::randn({5, 6});
  CHECK(at::allclose(fresh(x), reference(x), 1e-6, 1e-6));
}

FSDP_RANKS_TEST_CASE("resharding: saved by s ranks, loaded on t ranks with every strategy", "[dcp]") {
  const int W = world_size();
  const auto expected = reference_state(2);
  for (int s = 1; s <= W; ++s) {
    INFO("saved on " << s << " rank(s)");
    const std::string dir = test_dir("reshard_" + std::to_string(s));
    auto saver = first_ranks(s);
    if (rank() < s) {
      auto model = make_model(2);
      auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(saver));
      fsdp::dcp::save(dir, units.back(), nullptr, {}, fsdp::dcp::SaveOptions().communicator(saver));
    }
    world().barrier();
    // Every strategy on the whole world.
    for (const auto& sharding : shardings()) {
      INFO("loaded on " << W << " rank(s) with " << sharding.name);
      auto model = make_model(300 + rank());
      auto units = fsdp::testing::shard_stack(model, options_for(sharding, fresh_comm()));
      fsdp::dcp::load(dir, units.back(), nullptr, nullptr, fsdp::dcp::LoadOptions().communicator(fresh_comm()));
      check_same(full(units.back()), expected);
    }
    // Every other world size (the first t ranks), strategies in turn.
    for (int t = 1; t < W; ++t) {
      auto loader = first_ranks(t);
      if (rank() < t) {
        const Sharding sharding = shardings()[(s + t) % 4];
        INFO("loaded on " << t << " rank(s) with " << sharding.name);
        auto model = make_model(400 + rank());
        auto units = fsdp::testing::shard_stack(model, options_for(sharding, loader));
        fsdp::dcp::load(dir, units.back(), nullptr, nullptr, fsdp::dcp::LoadOptions().communicator(loader));
        check_same(full(units.back()), expected);
      }
      world().barrier();
    }
  }
}

FSDP_RANKS_TEST_CASE("hybrid sharding saves and reloads", "[dcp]") {
  const int W = world_size();
  // Two shard groups where the world size is even, else shard groups of one rank (W replicas):
  // only the first shard group writes.
  const int shard_size = W % 2 == 0 ? W / 2 : 1;
  const std::string dir = test_dir("hsdp");
  auto model = make_model(3);
  auto units = fsdp::testing::shard_stack(
      model, fsdp::FullyShardOptions().mesh(fsdp::comm::DeviceMesh::hybrid(world(), shard_size)));
  fsdp::dcp::save(dir, units.back(), nullptr, {}, fsdp::dcp::SaveOptions().communicator(fresh_comm()));
  // Loaded on one rank without sharding: every element was written once.
  auto one = first_ranks(1);
  if (rank() == 0) {
    auto fresh = make_model(33);
    auto fresh_units = fsdp::testing::shard_stack(fresh, fsdp::FullyShardOptions().communicator(one));
    fsdp::dcp::load(dir, fresh_units.back(), nullptr, nullptr, fsdp::dcp::LoadOptions().communicator(one));
    check_same(full(fresh_units.back()), reference_state(3));
  }
  world().barrier();
}

FSDP_RANKS_TEST_CASE("the optimizer state round-trips, also across world sizes", "[dcp]") {
  const int W = world_size();
  const std::string dir = test_dir("optim");
  auto model = make_model(4);
  auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
  torch::optim::AdamW optim(model->parameters(), torch::optim::AdamWOptions(1e-2));
  train(model, optim, 3, 1);
  const auto model_before = full(units.back());
  const auto optim_before =
      fsdp::full_optimizer_state_dict(units.back(), optim, fsdp::FullStateDictOptions().rank0_only(false));
  REQUIRE(optim_before.size() > 0);
  fsdp::dcp::save(dir, units.back(), &optim, {}, fsdp::dcp::SaveOptions().communicator(fresh_comm()));

  auto fresh = make_model(44);
  auto fresh_units = fsdp::testing::shard_stack(fresh, fsdp::FullyShardOptions().communicator(fresh_comm()));
  torch::optim::AdamW fresh_optim(fresh->parameters(), torch::optim::AdamWOptions(1e-3));  // no state yet
  fsdp::dcp::load(dir, fresh_units.back(), &fresh_optim, nullptr, fsdp::dcp::LoadOptions().communicator(fresh_comm()));
  check_same(full(fresh_units.back()), model_before);
  check_same(fsdp::full_optimizer_state_dict(fresh_units.back(), fresh_optim,
                                             fsdp::FullStateDictOptions().rank0_only(false)),
             optim_before);
  // Training continues identically.
  train(model, optim, 2, 2);
  train(fresh, fresh_optim, 2, 2);
  check_same(full(fresh_units.back()), full(units.back()));

  // Saved by the first max(1, W - 1) ranks (and exported by hand there), loaded on all W.
  const int s = std::max(1, W - 1);
  const std::string resharded = test_dir("optim_reshard");
  const std::string exported = test_dir("optim_reshard_reference.pt");
  auto saver = first_ranks(s);
  if (rank() < s) {
    auto source = make_model(5);
    auto source_units = fsdp::testing::shard_stack(source, fsdp::FullyShardOptions().communicator(saver));
    torch::optim::AdamW source_optim(source->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    train(source, source_optim, 2, 3);
    auto sd = fsdp::full_optimizer_state_dict(source_units.back(), source_optim);
    if (rank() == 0) fsdp::save_pt(exported, sd);
    fsdp::dcp::save(resharded, source_units.back(), &source_optim, {}, fsdp::dcp::SaveOptions().communicator(saver));
  }
  world().barrier();
  auto target = make_model(55);
  auto target_units = fsdp::testing::shard_stack(target, fsdp::FullyShardOptions().communicator(fresh_comm()));
  torch::optim::AdamW target_optim(target->parameters(), torch::optim::AdamWOptions(1e-3));
  fsdp::dcp::load(resharded, target_units.back(), &target_optim, nullptr,
                  fsdp::dcp::LoadOptions().communicator(fresh_comm()));
  check_same(fsdp::full_optimizer_state_dict(target_units.back(), target_optim,
                                             fsdp::FullStateDictOptions().rank0_only(false)),
             fsdp::load_pt(exported));
  CHECK(static_cast<const torch::optim::AdamWOptions&>(target_optim.param_groups()[0].options()).weight_decay() == 0.1);
}

FSDP_RANKS_TEST_CASE("an optimizer without state in the checkpoint is refused, or left as it is", "[dcp]") {
  const std::string dir = test_dir("no_optim");
  auto model = make_model(6);
  auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
  fsdp::dcp::save(dir, units.back(), nullptr, {}, fsdp::dcp::SaveOptions().communicator(fresh_comm()));
  auto fresh = make_model(66);
  auto fresh_units = fsdp::testing::shard_stack(fresh, fsdp::FullyShardOptions().communicator(fresh_comm()));
  torch::optim::AdamW optim(fresh->parameters(), torch::optim::AdamWOptions(1e-2));
  const auto before = full(fresh_units.back());
  CHECK_THROWS_WITH(fsdp::dcp::load(dir, fresh_units.back(), &optim, nullptr,
                                    fsdp::dcp::LoadOptions().communicator(fresh_comm())),
                    Contains("holds no optimizer state") && Contains(dir));
  check_same(full(fresh_units.back()), before);
  fsdp::dcp::load(dir, fresh_units.back(), &optim, nullptr,
                  fsdp::dcp::LoadOptions().communicator(fresh_comm()).strict(false));
  check_same(full(fresh_units.back()), reference_state(6));
  CHECK(optim.state().empty());
}

FSDP_RANKS_TEST_CASE("damaged checkpoints and other models are refused on every rank, changing nothing", "[dcp]") {
  const std::string dir = test_dir("damaged");
  auto source = make_model(7);
  auto source_units = fsdp::testing::shard_stack(source, fsdp::FullyShardOptions().communicator(fresh_comm()));
  fsdp::dcp::save(dir, source_units.back(), nullptr, {},
                  fsdp::dcp::SaveOptions().communicator(fresh_comm()).crc_block_bytes(64));
  auto model = make_model(77);
  auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
  const auto before = full(units.back());
  const auto load = [&](const fsdp::dcp::LoadOptions& options) {
    fsdp::dcp::load(dir, units.back(), nullptr, nullptr, options);
  };
  const auto options = fsdp::dcp::LoadOptions().communicator(fresh_comm());
  std::vector<std::string> shard_files;
  for (const auto& name : fsdp::storage::list_files(dir)) {
    if (name != fsdp::dcp::kManifestName) shard_files.push_back(name);
  }
  REQUIRE_FALSE(shard_files.empty());
  const std::string first = shard_files.front();  // rank 0's first file
  const std::string first_path = dir + "/" + first;

  // A flipped byte in rank 0's first file: the checksum names the file and the key.
  std::string key;
  {
    fsdp::storage::SafetensorsFile file(first_path);
    const auto& entry = file.header().entries.at(0);
    key = entry.key;
    world().barrier();
    if (rank() == 0) {
      std::string bytes = fsdp::storage::read_file(first_path);
      bytes[file.header().data_start + entry.data_begin] ^= 0x5a;
      fsdp::storage::write_file(first_path, bytes);
    }
    world().barrier();
  }
  INFO("corrupted key " << key);
  CHECK_THROWS_WITH(load(options), Contains(first) && Contains(key) && Contains("nothing was loaded"));
  check_same(full(units.back()), before);
  CHECK_NOTHROW(load(fsdp::dcp::LoadOptions(options).verify_checksums(false)));  // loads the damaged value
  fsdp::load_full_state_dict(units.back(), before);
  world().barrier();
  const std::string intact = [&] {
    std::string bytes = fsdp::storage::read_file(first_path);
    fsdp::storage::SafetensorsFile file(first_path);
    bytes[file.header().data_start + file.header().entries.at(0).data_begin] ^= 0x5a;
    return bytes;
  }();
  world().barrier();
  if (rank() == 0) fsdp::storage::write_file(first_path, intact);
  world().barrier();

  // A truncated file, a missing file, a broken header.
  const std::string last = shard_files.back();
  const std::string last_path = dir + "/" + last;
  const std::string last_bytes = fsdp::storage::read_file(last_path);
  world().barrier();
  if (rank() == 0) fs::resize_file(last_path, last_bytes.size() - 10);
  world().barrier();
  CHECK_THROWS_WITH(load(options), Contains(last) && Contains("truncated"));
  world().barrier();
  if (rank() == 0) fs::remove(last_path);
  world().barrier();
  CHECK_THROWS_WITH(load(options), Contains(last) && Contains("missing"));
  world().barrier();
  if (rank() == 0) {
    std::string broken = last_bytes;
    for (int i = 0; i < 8; ++i) broken[i] = static_cast<char>(0xff);
    fsdp::storage::write_file(last_path, broken);
  }
  world().barrier();
  CHECK_THROWS_WITH(load(options), Contains(last));
  world().barrier();
  if (rank() == 0) fsdp::storage::write_file(last_path, last_bytes);
  world().barrier();
  check_same(full(units.back()), before);

  // Another model: a key the checkpoint lacks, a shape that differs, a dtype that differs.
  {
    auto deeper = make_model(78, 16, 3);
    auto deeper_units = fsdp::testing::shard_stack(deeper, fsdp::FullyShardOptions().communicator(fresh_comm()));
    const auto deeper_before = full(deeper_units.back());
    // Every missing key is named, in one message.
    CHECK_THROWS_WITH(fsdp::dcp::load(dir, deeper_units.back(), nullptr, nullptr, options),
                      Contains("4 keys are not in the checkpoint") && Contains("'blocks.2.fc1.weight'") &&
                          Contains("'blocks.2.fc1.bias'") && Contains("'blocks.2.fc2.weight'") &&
                          Contains("'blocks.2.fc2.bias'"));
    check_same(full(deeper_units.back()), deeper_before);
    // Not strict: the keys present load, the others keep their values.
    fsdp::dcp::load(dir, deeper_units.back(), nullptr, nullptr, fsdp::dcp::LoadOptions(options).strict(false));
    const auto partial = full(deeper_units.back());
    const auto saved = reference_state(7);
    for (const auto& item : partial) {
      INFO(item.key());
      CHECK(item.value().equal(saved.contains(item.key()) ? saved[item.key()] : deeper_before[item.key()]));
    }
  }
  {
    auto wider = make_model(79, 12);
    auto wider_units = fsdp::testing::shard_stack(wider, fsdp::FullyShardOptions().communicator(fresh_comm()));
    const auto wider_before = full(wider_units.back());
    CHECK_THROWS_WITH(fsdp::dcp::load(dir, wider_units.back(), nullptr, nullptr, options),
                      Contains("'blocks.0.fc1.weight' has shape [16, 8]") && Contains("[12, 8] here"));
    check_same(full(wider_units.back()), wider_before);
  }
  {
    auto wide = make_model(80);
    wide->to(at::kDouble);
    auto wide_units = fsdp::testing::shard_stack(wide, fsdp::FullyShardOptions().communicator(fresh_comm()));
    const auto wide_before = full(wide_units.back());
    CHECK_THROWS_WITH(fsdp::dcp::load(dir, wide_units.back(), nullptr, nullptr, options),
                      Contains("stored as F32") && Contains("convert_dtype"));
    check_same(full(wide_units.back()), wide_before);
    // Converted through a staging buffer of 3 floats: many reads per run.
    fsdp::dcp::load(dir, wide_units.back(), nullptr, nullptr,
                    fsdp::dcp::LoadOptions(options).convert_dtype(true).max_staging_bytes(12));
    StateDict expected;
    for (const auto& item : reference_state(7)) {
      expected.insert(item.key(), item.value().to(wide_before[item.key()].scalar_type()));  // Module::to: all
    }
    check_same(full(wide_units.back()), expected);
  }
  // The intact checkpoint still loads.
  load(options);
  check_same(full(units.back()), reference_state(7));
}

FSDP_RANKS_TEST_CASE("checksum block sizes and staging sizes: 0, negative, and the old name", "[dcp][options]") {
  const std::string dir = test_dir("options");
  auto model = make_model(12);
  auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
  // A negative checksum block size is refused on every rank before anything is written.
  CHECK_THROWS_WITH(fsdp::dcp::save(dir, units.back(), nullptr, {},
                                    fsdp::dcp::SaveOptions().communicator(fresh_comm()).crc_block_bytes(-1)),
                    Contains("SaveOptions::crc_block_bytes must not be negative"));
  CHECK_FALSE(fs::exists(dir));
  CHECK_FALSE(fs::exists(fsdp::storage::temporary_sibling(dir)));
  world().barrier();  // every rank looked before the next save creates them
  // 0 writes files without checksums, which load (nothing to verify).
  fsdp::dcp::save(dir, units.back(), nullptr, {},
                  fsdp::dcp::SaveOptions().communicator(fresh_comm()).crc_block_bytes(0));
  for (const auto& name : fsdp::storage::list_files(dir)) {
    if (name == fsdp::dcp::kManifestName) continue;
    CHECK(fsdp::storage::SafetensorsFile(dir + "/" + name).header().crc_block_bytes == 0);
  }
  const auto options = fsdp::dcp::LoadOptions().communicator(fresh_comm());
  // staging_bytes, the old name of max_staging_bytes, reaches the load: 0 is refused by the new name.
  auto wide = make_model(120);
  wide->to(at::kDouble);
  auto wide_units = fsdp::testing::shard_stack(wide, fsdp::FullyShardOptions().communicator(fresh_comm()));
  const auto before = full(wide_units.back());
  CHECK_THROWS_WITH(fsdp::dcp::load(dir, wide_units.back(), nullptr, nullptr,
                                    fsdp::dcp::LoadOptions(options).convert_dtype(true).staging_bytes(0)),
                    Contains("LoadOptions::max_staging_bytes must be positive, got 0"));
  check_same(full(wide_units.back()), before);
  // Converted through a staging buffer of 3 floats set by the old name.
  fsdp::dcp::load(dir, wide_units.back(), nullptr, nullptr,
                  fsdp::dcp::LoadOptions(options).convert_dtype(true).staging_bytes(12));
  StateDict expected;
  for (const auto& item : reference_state(12)) {
    expected.insert(item.key(), item.value().to(before[item.key()].scalar_type()));
  }
  check_same(full(wide_units.back()), expected);
}

FSDP_RANKS_TEST_CASE("saving over a checkpoint replaces it whole", "[dcp]") {
  const std::string dir = test_dir("replace");
  {
    auto model = make_model(8);
    auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
    fsdp::dcp::save(dir, units.back(), nullptr, {}, fsdp::dcp::SaveOptions().communicator(fresh_comm()));
  }
  auto one = first_ranks(1);
  if (rank() == 0) {
    auto model = make_model(9);
    auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(one));
    fsdp::dcp::save(dir + "/", units.back(), nullptr, {}, fsdp::dcp::SaveOptions().communicator(one));  // same folder
  }
  world().barrier();
  // Only the second save's files remain: rank 0 of a one-rank save writes whole tensors in one file.
  const auto files = fsdp::storage::list_files(dir);
  CHECK(files == std::vector<std::string>{std::string(fsdp::dcp::kManifestName),
                                          "shard-00001-model-00001-of-00001.safetensors"});
  CHECK_FALSE(fs::exists(fsdp::storage::temporary_sibling(dir)));
  auto model = make_model(88);
  auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
  fsdp::dcp::load(dir, units.back(), nullptr, nullptr, fsdp::dcp::LoadOptions().communicator(fresh_comm()));
  check_same(full(units.back()), reference_state(9));
}

FSDP_RANKS_TEST_CASE("save_async writes the state at the call while training goes on", "[dcp]") {
  const std::string dir = test_dir("async");
  auto model = make_model(10);
  auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
  torch::optim::AdamW optim(model->parameters(), torch::optim::AdamWOptions(1e-2));
  train(model, optim, 2, 4);
  const auto model_at_call = full(units.back());
  const auto optim_at_call =
      fsdp::full_optimizer_state_dict(units.back(), optim, fsdp::FullStateDictOptions().rank0_only(false));
  const auto save_options = fsdp::dcp::SaveOptions().communicator(fresh_comm());
  auto pending = fsdp::dcp::save_async(dir, units.back(), &optim, {}, save_options);
  train(model, optim, 2, 5);  // modifies the parameters and the optimizer state in place
  const auto model_later = full(units.back());
  CHECK_FALSE(model_later["in.weight"].equal(model_at_call["in.weight"]));
  CHECK_FALSE(fs::exists(dir + "/" + fsdp::dcp::kManifestName));  // not committed before wait()
  pending.wait();
  CHECK(pending.waited());
  CHECK(pending.files_written());

  auto fresh = make_model(111);
  auto fresh_units = fsdp::testing::shard_stack(fresh, fsdp::FullyShardOptions().communicator(fresh_comm()));
  torch::optim::AdamW fresh_optim(fresh->parameters(), torch::optim::AdamWOptions(1e-2));
  fsdp::dcp::load(dir, fresh_units.back(), &fresh_optim, nullptr, fsdp::dcp::LoadOptions().communicator(fresh_comm()));
  check_same(full(fresh_units.back()), model_at_call);
  check_same(fsdp::full_optimizer_state_dict(fresh_units.back(), fresh_optim,
                                             fsdp::FullStateDictOptions().rank0_only(false)),
             optim_at_call);

  // The next save waits for a pending one; a save whose handle is dropped is discarded.
  const std::string second = test_dir("async_second");
  const std::string dropped = test_dir("async_dropped");
  auto first_pending = fsdp::dcp::save_async(second, units.back(), nullptr, {}, save_options);
  fsdp::dcp::save(dir, units.back(), nullptr, {}, save_options);
  CHECK(first_pending.waited());
  CHECK(fs::exists(second + "/" + fsdp::dcp::kManifestName));
  { auto discarded = fsdp::dcp::save_async(dropped, units.back(), nullptr, {}, save_options); }
  world().barrier();
  CHECK_FALSE(fs::exists(dropped));
  fsdp::dcp::load(second, fresh_units.back(), nullptr, nullptr, fsdp::dcp::LoadOptions().communicator(fresh_comm()));
  check_same(full(fresh_units.back()), model_later);
}

FSDP_RANKS_TEST_CASE("Extra values and tensors round-trip; colliding keys are refused", "[dcp]") {
  const std::string dir = test_dir("extra");
  auto model = make_model(12);
  auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
  fsdp::dcp::Extra extra;
  extra.values["step"] = "12";
  extra.values["loader"] = "epoch=1;position=345";
  auto gen = at::detail::createCPUGenerator(12);  // the same on every rank
  extra.tensors.insert("rng", at::randint(0, 256, {64}, gen, at::TensorOptions().dtype(at::kByte)));
  extra.tensors.insert("position", at::full({}, int64_t{345}, at::kLong));
  extra.tensors.insert("matrix", at::randn({5, 3}, gen).t());  // not contiguous
  fsdp::dcp::save(dir, units.back(), nullptr, extra, fsdp::dcp::SaveOptions().communicator(fresh_comm()));

  fsdp::dcp::Extra back;
  back.values["stale"] = "x";
  fsdp::dcp::load(dir, units.back(), nullptr, &back, fsdp::dcp::LoadOptions().communicator(fresh_comm()));
  CHECK(back.values == extra.values);
  REQUIRE(back.tensors.keys() == std::vector<std::string>{"matrix", "position", "rng"});
  for (const auto& item : extra.tensors) {
    INFO(item.key());
    CHECK(back.tensors[item.key()].scalar_type() == item.value().scalar_type());
    CHECK(back.tensors[item.key()].equal(item.value()));
  }
  // save_state: a key of the state that an extra tensor's key repeats.
  fsdp::ShardedStateDict state = fsdp::sharded_state_dict(units.back());
  state.emplace_back("extra.rng", fsdp::LocalShard{at::zeros({64}, at::kByte), {64}, 0, rank() == 0});
  CHECK_THROWS_WITH(fsdp::dcp::save_state(test_dir("extra_collision"), state, extra,
                                          fsdp::dcp::SaveOptions().communicator(fresh_comm())),
                    Contains("'extra.rng' appears twice"));
  CHECK_FALSE(fs::exists(test_dir("extra_collision")));
}

FSDP_RANKS_TEST_CASE("save_state / load_state of a sharded state dict built by hand", "[dcp]") {
  const int W = world_size();
  const std::string dir = test_dir("by_hand");
  // A [5, 7] tensor whose elements are their flat indices, split over the ranks unevenly; a 0-d
  // value written by rank 0.
  const int64_t n = 35;
  const int64_t begin = n * rank() * rank() / (W * W);
  const int64_t next = n * (rank() + 1) * (rank() + 1) / (W * W);
  fsdp::ShardedStateDict state;
  state.emplace_back("grid", fsdp::LocalShard{at::arange(begin, next, at::kFloat), {5, 7}, begin, true});
  state.emplace_back("scalar", fsdp::LocalShard{at::full({1}, 2.5, at::kDouble), {}, 0, rank() == 0});
  fsdp::dcp::save_state(dir, state, {}, fsdp::dcp::SaveOptions().communicator(fresh_comm()));
  // Read back every element on every rank, as one range, and as two ranges.
  fsdp::ShardedStateDict whole;
  whole.emplace_back("grid", fsdp::LocalShard{at::zeros({35}), {5, 7}, 0, false});
  whole.emplace_back("scalar", fsdp::LocalShard{at::zeros({1}, at::kDouble), {}, 0, false});
  CHECK(fsdp::dcp::load_state(dir, whole, nullptr, fsdp::dcp::LoadOptions().communicator(fresh_comm())) == 2);
  CHECK(whole[0].second.local.equal(at::arange(35, at::kFloat)));
  CHECK(whole[1].second.local.item<double>() == 2.5);
  fsdp::ShardedStateDict part;
  part.emplace_back("grid", fsdp::LocalShard{at::zeros({13}, at::kFloat), {5, 7}, 9, false});
  fsdp::dcp::load_state(dir, part, nullptr, fsdp::dcp::LoadOptions().communicator(fresh_comm()));
  CHECK(part[0].second.local.equal(at::arange(9, 22, at::kFloat)));
  // Elements written twice (or never) are refused at save.
  fsdp::ShardedStateDict twice;
  twice.emplace_back("grid", fsdp::LocalShard{at::arange(35, at::kFloat), {5, 7}, 0, true});
  if (W > 1) {
    CHECK_THROWS_WITH(fsdp::dcp::save_state(test_dir("by_hand_twice"), twice, {},
                                            fsdp::dcp::SaveOptions().communicator(fresh_comm())),
                      Contains("'grid'") && Contains("exactly one rank"));
  }
}

FSDP_RANKS_TEST_CASE("foreign checkpoints without a manifest load", "[dcp]") {
  const std::string dir = test_dir("foreign");
  const auto expected = reference_state(13);
  // As PyTorch's DCP writes with HuggingFaceStorageWriter(save_distributed=True) from three ranks
  // holding Shard(0) pieces of uneven sizes: one file per writer, no checksums.
  if (rank() == 0) {
    fsdp::storage::create_directories(dir);
    std::vector<std::vector<fsdp::storage::SafetensorsItem>> items(3);
    std::vector<std::string> info(3);
    for (const auto& item : expected) {
      const at::Tensor& t = item.value();
      if (t.dim() == 0) {
        items[1].push_back({item.key(), t});
        info[1] += (info[1].empty() ? "" : ", ") + ("\"" + item.key() + "\": {\"saved_offsets\": []}");
        continue;
      }
      const int64_t rows = t.size(0);
      const int64_t a = (rows + 1) / 2;
      const int64_t b = a + (rows - a + 2) / 3;
      const int64_t cuts[4] = {0, a, b, rows};
      for (int w = 0; w < 3; ++w) {
        if (cuts[w + 1] == cuts[w]) continue;
        items[w].push_back({item.key(), t.narrow(0, cuts[w], cuts[w + 1] - cuts[w])});
        std::string offsets = "[" + std::to_string(cuts[w]);
        for (int64_t d = 1; d < t.dim(); ++d) offsets += ", 0";
        info[w] += (info[w].empty() ? "" : ", ") + ("\"" + item.key() + "\": {\"saved_offsets\": " + offsets + "]}");
      }
    }
    for (int w = 0; w < 3; ++w) {
      const std::string name = "shard-0000" + std::to_string(w + 1) + "-model-00001-of-00001.safetensors";
      fsdp::storage::write_safetensors(dir + "/" + name, items[w],
                                       {{"DCP_SHARDING_INFO", "{" + info[w] + "}"}, {"format", "pt"}}, 0);
    }
  }
  world().barrier();
  auto model = make_model(130);
  auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
  fsdp::dcp::load(dir, units.back(), nullptr, nullptr, fsdp::dcp::LoadOptions().communicator(fresh_comm()));
  check_same(full(units.back()), expected);

  // A Hugging Face model folder (whole tensors, no DCP_SHARDING_INFO), split over several files.
  const std::string hf = test_dir("foreign_hf");
  if (rank() == 0) fsdp::save_safetensors(hf, expected, fsdp::SaveSafetensorsOptions().max_file_bytes(600));
  world().barrier();
  auto other = make_model(131);
  auto other_units = fsdp::testing::shard_stack(
      other, fsdp::FullyShardOptions().communicator(fresh_comm()).strategy(fsdp::ShardingStrategy::kShardGradOp));
  fsdp::dcp::load(hf, other_units.back(), nullptr, nullptr, fsdp::dcp::LoadOptions().communicator(fresh_comm()));
  check_same(full(other_units.back()), expected);
}

FSDP_RANKS_TEST_CASE("a write error on one rank fails the save everywhere and keeps the previous checkpoint",
                     "[dcp]") {
  const int W = world_size();
  const int victim = W - 1;
  const std::string dir = test_dir("write_error");
  const auto save_options = fsdp::dcp::SaveOptions().communicator(fresh_comm());
  auto model = make_model(14);
  auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
  fsdp::dcp::save(dir, units.back(), nullptr, {}, save_options);
  auto other = make_model(15);
  auto other_units = fsdp::testing::shard_stack(other, fsdp::FullyShardOptions().communicator(fresh_comm()));
  if (rank() == victim) {
    fsdp::dcp::testing::set_file_written_hook(
        [](const std::string& path) { TORCH_CHECK(false, "no space left on the device while writing '", path, "'"); });
  }
  const std::string expected_file = "shard-0000" + std::to_string(victim + 1) + "-model-00001-of-";
  CHECK_THROWS_WITH(fsdp::dcp::save(dir, other_units.back(), nullptr, {}, save_options),
                    Contains("failed on rank " + std::to_string(victim)) && Contains("no space left") &&
                        Contains(expected_file));
  // The same in the background: wait() throws on every rank.
  auto pending = fsdp::dcp::save_async(dir, other_units.back(), nullptr, {}, save_options);
  CHECK_THROWS_WITH(pending.wait(), Contains("failed on rank " + std::to_string(victim)) && Contains(expected_file));
  CHECK_THROWS_WITH(pending.wait(), Contains("no space left"));  // waiting again rethrows
  fsdp::dcp::testing::set_file_written_hook(nullptr);
  fsdp::dcp::load(dir, other_units.back(), nullptr, nullptr, fsdp::dcp::LoadOptions().communicator(fresh_comm()));
  check_same(full(other_units.back()), reference_state(14));
}

// A folder saved by fsdp::dcp whose manifest was deleted would load the weights and silently drop
// the Extra values (they are in the manifest): refused on every rank, naming the folder and the
// manifest, the model unchanged. Folders of other writers (no manifest of ours, see "foreign
// checkpoints without a manifest load") still load.
FSDP_RANKS_TEST_CASE("a checkpoint of ours without its manifest is refused", "[dcp]") {
  const std::string dir = test_dir("no_manifest");
  auto model = make_model(16);
  auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
  fsdp::dcp::Extra extra;
  extra.values["step"] = "16";
  fsdp::dcp::save(dir, units.back(), nullptr, extra, fsdp::dcp::SaveOptions().communicator(fresh_comm()));
  world().barrier();
  if (rank() == 0) fs::remove(dir + "/" + fsdp::dcp::kManifestName);
  world().barrier();
  auto fresh = make_model(17);
  auto fresh_units = fsdp::testing::shard_stack(fresh, fsdp::FullyShardOptions().communicator(fresh_comm()));
  const auto before = full(fresh_units.back());
  fsdp::dcp::Extra back;
  CHECK_THROWS_WITH(fsdp::dcp::load(dir, fresh_units.back(), nullptr, &back,
                                    fsdp::dcp::LoadOptions().communicator(fresh_comm())),
                    Contains("has no manifest") && Contains(fsdp::dcp::kManifestName) && Contains(dir) &&
                        Contains("nothing was loaded"));
  check_same(full(fresh_units.back()), before);
  CHECK(back.values.empty());
}

// dcp::load between a forward and its backward (or while a unit is unsharded): the units unsharded
// then would keep computing with the values they gathered. Refused on every rank, the model
// unchanged, the backward still runs.
FSDP_RANKS_TEST_CASE("dcp::load is refused between forward and backward and while a unit is unsharded", "[dcp]") {
  const std::string dir = test_dir("mid_iteration");
  auto source = make_model(18);
  auto source_units = fsdp::testing::shard_stack(source, fsdp::FullyShardOptions().communicator(fresh_comm()));
  fsdp::dcp::save(dir, source_units.back(), nullptr, {}, fsdp::dcp::SaveOptions().communicator(fresh_comm()));
  auto model = make_model(19);
  auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
  const auto before = full(units.back());
  const auto options = fsdp::dcp::LoadOptions().communicator(fresh_comm());
  auto loss = torch::nn::functional::mse_loss(model(at::ones({2, 6})), at::zeros({2, 3}));
  // On every world size (one rank's passthrough units track the phase too).
  CHECK_THROWS_WITH(fsdp::dcp::load(dir, units.back(), nullptr, nullptr, options),
                    Contains("fsdp::dcp::load") && Contains("backward has not") && Contains("nothing was loaded"));
  CHECK_NOTHROW(loss.backward());
  check_same(full(units.back()), before);
  if (world_size() > 1) {  // on one rank nothing is sharded, and unshard() gathers nothing
    units.front().unshard();
    CHECK_THROWS_WITH(fsdp::dcp::load(dir, units.back(), nullptr, nullptr, options),
                      Contains("is unsharded") && Contains("reshard()"));
    units.front().reshard();
  }
  fsdp::dcp::load(dir, units.back(), nullptr, nullptr, options);
  check_same(full(units.back()), reference_state(18));
}

// The target of a save is checked before anything is written: a regular file, or a folder inside
// a regular file, is the same error on every rank, and no temporary folder is left. A save that
// fails after writing removes its temporary folder.
FSDP_RANKS_TEST_CASE("saving into a file is refused before writing; failed saves leave no .partial folder",
                     "[dcp]") {
  const std::string file = test_dir("target_file");
  world().barrier();
  if (rank() == 0) fsdp::storage::write_file(file, "not a folder");
  world().barrier();
  auto model = make_model(20);
  auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
  const auto save_options = fsdp::dcp::SaveOptions().communicator(fresh_comm());
  int64_t written = 0;
  fsdp::dcp::testing::set_file_written_hook([&](const std::string&) { ++written; });
  CHECK_THROWS_WITH(fsdp::dcp::save(file, units.back(), nullptr, {}, save_options),
                    Contains("'" + file + "': it exists and is not a folder") && Contains("prepare"));
  CHECK_THROWS_WITH(fsdp::dcp::save(file + "/step-1", units.back(), nullptr, {}, save_options),
                    Contains("'" + file + "' is not a folder"));
  CHECK(written == 0);
  fsdp::dcp::testing::set_file_written_hook(nullptr);
  CHECK(fsdp::storage::read_file(file) == "not a folder");
  CHECK_FALSE(fs::exists(fsdp::storage::temporary_sibling(file)));
  // A write error on the last rank, after the others wrote everything.
  const std::string dir = test_dir("partial_removed");
  if (rank() == world_size() - 1) {
    fsdp::dcp::testing::set_file_written_hook(
        [](const std::string& path) { TORCH_CHECK(false, "disk full while writing '", path, "'"); });
  }
  CHECK_THROWS_WITH(fsdp::dcp::save(dir, units.back(), nullptr, {}, save_options), Contains("disk full"));
  fsdp::dcp::testing::set_file_written_hook(nullptr);
  world().barrier();
  CHECK_FALSE(fs::exists(fsdp::storage::temporary_sibling(dir)));
  CHECK_FALSE(fs::exists(dir));
}

// With a manifest, a load opens only the files that hold what it reads (from many ranks, every
// rank opening every file would exceed the open-file limit): each rank wrote one key of its own
// into its own file, and each loading rank reads one key.
FSDP_RANKS_TEST_CASE("a load opens only the files holding the keys it reads", "[dcp]") {
  const int W = world_size();
  const std::string dir = test_dir("files_opened");
  fsdp::ShardedStateDict state;
  for (int r = 0; r < W; ++r) {
    const bool mine = r == rank();
    state.emplace_back("k" + std::to_string(r),
                       fsdp::LocalShard{at::full({mine ? 3 : 0}, static_cast<float>(r)), {3}, 0, mine});
  }
  fsdp::dcp::save_state(dir, state, {}, fsdp::dcp::SaveOptions().communicator(fresh_comm()));
  // Loaded on the first ranks only (fewer than saved when W > 1): rank r reads key k<r+1 (mod W).
  const int s = std::max(1, W - 1);
  auto comm = first_ranks(s);
  if (rank() < s) {
    const int key = (rank() + 1) % W;
    fsdp::ShardedStateDict wanted;
    wanted.emplace_back("k" + std::to_string(key), fsdp::LocalShard{at::zeros({3}), {3}, 0, false});
    const int64_t opened_before = fsdp::dcp::testing::checkpoint_files_opened();
    fsdp::dcp::load_state(dir, wanted, nullptr, fsdp::dcp::LoadOptions().communicator(comm));
    CHECK(fsdp::dcp::testing::checkpoint_files_opened() - opened_before == 1);
    CHECK(wanted[0].second.local.equal(at::full({3}, static_cast<float>(key))));
  }
  world().barrier();
}

namespace {
// A model with submodules named like the checkpoint's key prefixes: `state` (the optimizer's
// "state." keys) and `extra` (Extra tensors' "extra." keys).
struct PrefixNamesImpl : torch::nn::Module {
  PrefixNamesImpl() {
    state = register_module("state", fsdp::contract::Linear(4, 4));
    extra = register_module("extra", fsdp::contract::Linear(4, 2));
  }
  at::Tensor forward(at::Tensor x) { return extra(state(x)); }
  fsdp::contract::Linear state{nullptr}, extra{nullptr};
};
FSDP_HOOKABLE_MODULE(PrefixNames);
}  // namespace

// Strict loads: a zero-element key the checkpoint lacks is missing like any other. "Has optimizer
// state" and "is an Extra tensor" come from the keys themselves, not from their prefixes.
FSDP_RANKS_TEST_CASE("strict loads refuse missing zero-element keys; submodules named state or extra", "[dcp]") {
  const std::string dir = test_dir("prefix_names");
  {
    fsdp::ShardedStateDict saved;
    saved.emplace_back("a", fsdp::LocalShard{at::ones({2}), {2}, 0, rank() == 0});
    fsdp::dcp::save_state(dir, saved, {}, fsdp::dcp::SaveOptions().communicator(fresh_comm()));
    fsdp::ShardedStateDict wanted;
    wanted.emplace_back("a", fsdp::LocalShard{at::zeros({2}), {2}, 0, false});
    wanted.emplace_back("empty", fsdp::LocalShard{at::zeros({0}), {0, 3}, 0, false});
    CHECK_THROWS_WITH(fsdp::dcp::load_state(dir, wanted, nullptr, fsdp::dcp::LoadOptions().communicator(fresh_comm())),
                      Contains("1 key is not in the checkpoint") && Contains("'empty'"));
    CHECK(fsdp::dcp::load_state(dir, wanted, nullptr,
                                fsdp::dcp::LoadOptions().communicator(fresh_comm()).strict(false)) == 1);
  }
  torch::manual_seed(21);
  PrefixNames model;
  auto root = fsdp::fully_shard(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
  fsdp::dcp::Extra extra;
  extra.values["step"] = "21";
  fsdp::dcp::save(dir, root, nullptr, extra, fsdp::dcp::SaveOptions().communicator(fresh_comm()));
  torch::manual_seed(22);
  PrefixNames fresh;
  auto fresh_root = fsdp::fully_shard(fresh, fsdp::FullyShardOptions().communicator(fresh_comm()));
  torch::optim::AdamW optim(fresh->parameters(), torch::optim::AdamWOptions(1e-2));
  const auto before = full(fresh_root);
  CHECK_THROWS_WITH(fsdp::dcp::load(dir, fresh_root, &optim, nullptr,
                                    fsdp::dcp::LoadOptions().communicator(fresh_comm())),
                    Contains("holds no optimizer state"));
  check_same(full(fresh_root), before);
  fsdp::dcp::Extra back;
  fsdp::dcp::load(dir, fresh_root, nullptr, &back, fsdp::dcp::LoadOptions().communicator(fresh_comm()));
  check_same(full(fresh_root), full(root));
  CHECK(back.values == extra.values);
  CHECK(back.tensors.is_empty());  // the model's `extra.*` keys are not Extra tensors
}
