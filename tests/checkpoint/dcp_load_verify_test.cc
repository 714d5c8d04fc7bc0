// fsdp::dcp::load's checksum pass ([Note: verify, agree, then copy] in checkpoint/dcp_load.cc) on
// every world size: a corrupted byte in the LAST block one rank needs (after every other block it
// reads verified, so the rank has checked the first half of what it needs and more) fails every
// rank with the same error naming the rank, the file and the key, and leaves every local shard of
// the model and of the optimizer bit for bit unchanged on every rank; so does a corruption on every
// rank at once. Staging buffers smaller than one checksum block and than one element (dtype
// conversion, the path that stages) load the saved values, and refuse the same corruption the same
// way. References: the source's values exported before saving, and clones of the destination's
// local shards taken before the load.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include "fsdp_cpp/checkpoint/distributed_checkpoint.h"
#include "fsdp_cpp/checkpoint/optimizer_state_dict.h"
#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/storage/atomic_directory.h"
#include "fsdp_cpp/storage/safetensors.h"
#include "fsdp_cpp/tests/composable/parity.h"
#include "fsdp_cpp/tests/composable/test_models.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::testing::MlpStack;
using fsdp::testing::rank;
using fsdp::testing::world;
using fsdp::testing::world_size;
using StateDict = torch::OrderedDict<std::string, at::Tensor>;
using Comm = std::shared_ptr<fsdp::comm::Communicator>;

Comm fresh_comm() { return std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU); }

std::string test_dir(const std::string& name) { return fsdp::testing::shared_tmpdir() + "/dcp_verify_" + name; }

MlpStack make_model(uint64_t seed) {
  torch::manual_seed(seed);
  return MlpStack(6, 8, 32, 3, 3);
}

// A sharded model (FULL_SHARD over the world) and an AdamW that has stepped once, so that both the
// parameters and the optimizer state have values a load would overwrite.
struct Setup {
  MlpStack model;
  std::vector<fsdp::FSDPModule> units;
  std::unique_ptr<torch::optim::AdamW> optim;

  explicit Setup(uint64_t seed, at::ScalarType dtype = at::kFloat) : model(make_model(seed)) {
    model->to(dtype);
    units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
    optim = std::make_unique<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-2));
    auto gen = at::detail::createCPUGenerator(seed * 100 + static_cast<uint64_t>(rank()));
    const at::Tensor x = at::randn({4, 6}, gen).to(dtype);
    torch::nn::functional::mse_loss(model(x), at::zeros({4, 3}, x.options())).backward();
    optim->step();
    optim->zero_grad();
  }
  const fsdp::FSDPModule& root() const { return units.back(); }
};

// Clones of this rank's local shards of the model and the optimizer state, by key.
StateDict local_values(const Setup& s) {
  StateDict out;
  for (const auto& [key, shard] : fsdp::sharded_state_dict(s.root())) out.insert(key, shard.local.clone());
  for (const auto& [key, shard] : fsdp::sharded_optimizer_state_dict(s.root(), *s.optim)) {
    out.insert(key, shard.local.clone());
  }
  return out;
}

void check_equal(const StateDict& got, const StateDict& want) {
  REQUIRE(got.keys() == want.keys());
  for (const auto& item : want) {
    INFO(item.key());
    CHECK(got[item.key()].scalar_type() == item.value().scalar_type());
    CHECK(got[item.key()].equal(item.value()));
  }
}

// The file of rank `r` that a load verifies last on that rank, and its entry with the highest data
// offset (the last bytes rank r reads when it loads its own shards at the same world size).
struct Victim {
  std::string file;
  std::string path;
  std::string key;
  int64_t byte = 0;  // file offset of the entry's last byte
};

Victim last_needed_byte(const std::string& dir, int r) {
  char prefix[32];
  std::snprintf(prefix, sizeof(prefix), "shard-%05d-model-", r + 1);  // [Note: checkpoint layout]
  std::vector<std::string> files;
  for (const auto& name : fsdp::storage::list_files(dir)) {
    if (name.starts_with(prefix)) files.push_back(name);
  }
  REQUIRE_FALSE(files.empty());
  std::sort(files.begin(), files.end());
  Victim v;
  v.file = files.back();
  v.path = dir + "/" + v.file;
  fsdp::storage::SafetensorsFile file(v.path);
  const fsdp::storage::SafetensorsEntry* last = nullptr;
  for (const auto& e : file.header().entries) {
    if (e.nbytes() > 0 && (last == nullptr || e.data_begin > last->data_begin)) last = &e;
  }
  REQUIRE(last != nullptr);
  v.key = last->key;
  v.byte = file.header().data_start + last->data_end - 1;
  return v;
}

void flip(const Victim& v) {
  std::string bytes = fsdp::storage::read_file(v.path);
  bytes[static_cast<size_t>(v.byte)] ^= 0x5a;
  fsdp::storage::write_file(v.path, bytes);
}

// Loads `dir` into `s` expecting the corruption of `v` on rank `victim` to fail every rank with the
// same message, and checks every local shard on this rank is unchanged.
void expect_refused(const std::string& dir, Setup& s, const fsdp::dcp::LoadOptions& options, int victim,
                    const Victim& v) {
  const StateDict before = local_values(s);
  std::string message;
  try {
    fsdp::dcp::load(dir, s.root(), s.optim.get(), nullptr, options);
  } catch (const c10::Error& e) {
    message = e.what_without_backtrace();
  }
  INFO(message);
  CHECK_THAT(message, Contains("failed on rank " + std::to_string(victim) + " of " + std::to_string(world_size())) &&
                          Contains(v.file) && Contains("'" + v.key + "'") && Contains("checksum mismatch") &&
                          Contains("nothing was loaded"));
  // The same message on every rank.
  const auto all = fresh_comm()->all_gather_bytes({message.begin(), message.end()}, "messages");
  for (const auto& m : all) CHECK(std::string(m.begin(), m.end()) == message);
  check_equal(local_values(s), before);
}

}  // namespace

FSDP_RANKS_TEST_CASE("a corruption in the last block one rank needs changes nothing on any rank", "[dcp][verify]") {
  const std::string dir = test_dir("last_block");
  Setup source(7);
  fsdp::dcp::save(dir, source.root(), source.optim.get(), {},
                  fsdp::dcp::SaveOptions().communicator(fresh_comm()).crc_block_bytes(64));
  const StateDict saved = local_values(source);
  const auto options = fsdp::dcp::LoadOptions().communicator(fresh_comm());

  for (int victim = 0; victim < world_size(); ++victim) {
    DYNAMIC_SECTION("corrupted on rank " << victim) {
      Setup dest(77);
      const Victim v = last_needed_byte(dir, victim);
      world().barrier();
      if (rank() == victim) flip(v);
      world().barrier();
      expect_refused(dir, dest, options, victim, v);
      world().barrier();
      if (rank() == victim) flip(v);  // restored
      world().barrier();
      fsdp::dcp::load(dir, dest.root(), dest.optim.get(), nullptr, options);
      check_equal(local_values(dest), saved);
    }
  }
  SECTION("corrupted on every rank: the lowest rank's error") {
    Setup dest(78);
    std::vector<Victim> victims;
    for (int r = 0; r < world_size(); ++r) victims.push_back(last_needed_byte(dir, r));
    world().barrier();
    flip(victims[static_cast<size_t>(rank())]);
    world().barrier();
    expect_refused(dir, dest, options, 0, victims[0]);
    world().barrier();
    flip(victims[static_cast<size_t>(rank())]);
    world().barrier();
  }
}

FSDP_RANKS_TEST_CASE("staging smaller than one checksum block, and than one element", "[dcp][verify]") {
  const std::string dir = test_dir("small_staging");
  Setup source(9);
  fsdp::dcp::save(dir, source.root(), source.optim.get(), {},
                  fsdp::dcp::SaveOptions().communicator(fresh_comm()).crc_block_bytes(64));
  // The saved float32 values, converted to float64 (the destination's dtype).
  StateDict saved;
  for (const auto& item : local_values(source)) {
    saved.insert(item.key(), item.value().is_floating_point() ? item.value().to(at::kDouble) : item.value());
  }
  const auto options = fsdp::dcp::LoadOptions().communicator(fresh_comm()).convert_dtype(true);
  // 12 bytes: 3 floats per staged copy, under the 64-byte checksum block; 1 byte: under one element
  // (a staged copy is at least one element).
  for (const int64_t staging : {int64_t{12}, int64_t{1}}) {
    DYNAMIC_SECTION("max_staging_bytes " << staging) {
      Setup dest(99, at::kDouble);
      const auto small = fsdp::dcp::LoadOptions(options).max_staging_bytes(staging);
      const int victim = world_size() - 1;
      const Victim v = last_needed_byte(dir, victim);
      world().barrier();
      if (rank() == victim) flip(v);
      world().barrier();
      expect_refused(dir, dest, small, victim, v);
      world().barrier();
      if (rank() == victim) flip(v);
      world().barrier();
      fsdp::dcp::load(dir, dest.root(), dest.optim.get(), nullptr, small);
      StateDict got = local_values(dest);
      REQUIRE(got.keys() == saved.keys());
      for (const auto& item : saved) {
        INFO(item.key());
        CHECK(got[item.key()].equal(item.value().to(got[item.key()].scalar_type())));
      }
    }
  }
}

// Values of a few MiB, read through the files' mappings ([Note: verify, agree, then copy]): every
// rank reads every rank's file (the whole value), each piece of at least 1 MiB (the streaming copy)
// into a destination 4 bytes off 16-byte alignment, one key converted to float64 through a small
// staging buffer; checksum blocks of 64 KiB, so a rank verifies dozens of blocks of every file
// before the corrupted one. A byte flipped in the last block of the last file (verified last by
// every rank, after every other block it needs is mapped and checked) fails every rank and leaves
// every destination unchanged; restored, the same load reads the saved values.
FSDP_RANKS_TEST_CASE("large values through the mapping; a corruption verified last changes nothing", "[dcp][verify]") {
  const int W = world_size();
  const std::string dir = test_dir("mapped");
  const int64_t n = (int64_t{1} << 20) * W + 13;  // floats: at least 1 MiB per rank's piece
  const auto value = [&](int k) { return at::arange(n, at::kFloat).mul_(0.25).add_(k); };
  const int64_t begin = n * rank() / W;
  const int64_t end = n * (rank() + 1) / W;
  fsdp::ShardedStateDict saved;
  for (int k = 0; k < 2; ++k) {
    saved.emplace_back("v" + std::to_string(k),
                       fsdp::LocalShard{value(k).slice(0, begin, end).clone(), {n}, begin, true});
  }
  fsdp::dcp::save_state(dir, saved, {}, fsdp::dcp::SaveOptions().communicator(fresh_comm()).crc_block_bytes(64 << 10));
  // Destinations: v0 float32 at an address 4 bytes past an allocation's start, v1 float64.
  const at::Tensor v0_storage = at::full({n + 1}, -1.0f);
  fsdp::ShardedStateDict wanted;
  wanted.emplace_back("v0", fsdp::LocalShard{v0_storage.narrow(0, 1, n), {n}, 0, false});
  wanted.emplace_back("v1", fsdp::LocalShard{at::full({n}, -1.0, at::kDouble), {n}, 0, false});
  const auto options =
      fsdp::dcp::LoadOptions().communicator(fresh_comm()).convert_dtype(true).max_staging_bytes(100000);

  const Victim v = last_needed_byte(dir, W - 1);
  world().barrier();
  if (rank() == W - 1) flip(v);
  world().barrier();
  std::string message;
  try {
    fsdp::dcp::load_state(dir, wanted, nullptr, options);
  } catch (const c10::Error& e) {
    message = e.what_without_backtrace();
  }
  INFO(message);
  CHECK_THAT(message, Contains("failed on rank 0 of " + std::to_string(W)) && Contains(v.file) &&
                          Contains("'" + v.key + "'") && Contains("checksum mismatch") &&
                          Contains("nothing was loaded"));
  CHECK(v0_storage.eq(-1.0f).all().item<bool>());
  CHECK(wanted[1].second.local.eq(-1.0).all().item<bool>());
  world().barrier();
  if (rank() == W - 1) flip(v);  // restored
  world().barrier();
  CHECK(fsdp::dcp::load_state(dir, wanted, nullptr, options) == 2);
  CHECK(v0_storage[0].item<float>() == -1.0f);  // the element before the destination
  CHECK(wanted[0].second.local.equal(value(0)));
  CHECK(wanted[1].second.local.equal(value(1).to(at::kDouble)));
}

// The load's threads ([Note: load threads] in checkpoint/dcp_load.cc), forced through
// FSDP_DCP_LOAD_THREADS: 1 (the caller alone), 2, 3 and 8 threads load the same values (every rank
// reads every rank's file: values of a few MiB in 64 KiB checksum blocks and 4 MiB copy windows,
// one key converted through a small staging buffer on the caller's thread). With two corrupted
// blocks in the last file, block 3 of v0 and the last byte of the file, every thread count reports
// block 3 (the first corruption in file order, where one thread stops) and changes nothing.
FSDP_RANKS_TEST_CASE("any number of load threads: the same values, the first corruption in file order",
                     "[dcp][verify][threads]") {
  const int W = world_size();
  const std::string dir = test_dir("threads");
  const int64_t n = (int64_t{3} << 20) * W + 29;  // floats: 12 MiB per rank's piece, 3 copy windows
  const auto value = [&](int k) { return at::arange(n, at::kFloat).mul_(0.5).sub_(k); };
  const int64_t begin = n * rank() / W;
  const int64_t end = n * (rank() + 1) / W;
  fsdp::ShardedStateDict saved;
  for (int k = 0; k < 2; ++k) {
    saved.emplace_back("v" + std::to_string(k),
                       fsdp::LocalShard{value(k).slice(0, begin, end).clone(), {n}, begin, true});
  }
  fsdp::dcp::save_state(dir, saved, {}, fsdp::dcp::SaveOptions().communicator(fresh_comm()).crc_block_bytes(64 << 10));
  const auto options =
      fsdp::dcp::LoadOptions().communicator(fresh_comm()).convert_dtype(true).max_staging_bytes(1 << 16);
  // Block 3 of v0 in the last rank's file, and that file's last byte.
  const Victim last = last_needed_byte(dir, W - 1);
  Victim early = last;
  {
    fsdp::storage::SafetensorsFile file(last.path);
    for (const auto& e : file.header().entries) {
      if (e.key == "v0") early.byte = file.header().data_start + e.data_begin + 3 * (64 << 10) + 5;
    }
    early.key = "v0";
  }
  REQUIRE(early.byte < last.byte);
  for (const char* threads : {"1", "2", "3", "8"}) {
    DYNAMIC_SECTION(threads << " threads") {
      REQUIRE(::setenv("FSDP_DCP_LOAD_THREADS", threads, 1) == 0);
      fsdp::ShardedStateDict wanted;
      wanted.emplace_back("v0", fsdp::LocalShard{at::full({n}, -1.0f), {n}, 0, false});
      wanted.emplace_back("v1", fsdp::LocalShard{at::full({n}, -1.0, at::kDouble), {n}, 0, false});
      world().barrier();
      if (rank() == W - 1) {
        flip(early);
        flip(last);
      }
      world().barrier();
      std::string message;
      try {
        fsdp::dcp::load_state(dir, wanted, nullptr, options);
      } catch (const c10::Error& e) {
        message = e.what_without_backtrace();
      }
      INFO(message);
      CHECK_THAT(message, Contains("failed on rank 0 of " + std::to_string(W)) && Contains(last.file) &&
                              Contains("checksum mismatch in entry 'v0' block 3 ") && Contains("nothing was loaded"));
      CHECK(wanted[0].second.local.eq(-1.0f).all().item<bool>());
      CHECK(wanted[1].second.local.eq(-1.0).all().item<bool>());
      world().barrier();
      if (rank() == W - 1) {
        flip(early);  // restored
        flip(last);
      }
      world().barrier();
      CHECK(fsdp::dcp::load_state(dir, wanted, nullptr, options) == 2);
      CHECK(wanted[0].second.local.equal(value(0)));
      CHECK(wanted[1].second.local.equal(value(1).to(at::kDouble)));
      REQUIRE(::unsetenv("FSDP_DCP_LOAD_THREADS") == 0);
    }
  }
}
