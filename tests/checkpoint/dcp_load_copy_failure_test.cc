// fsdp::dcp::load when a rank fails AFTER every rank verified the checkpoint and began to copy
// ([Note: a mapping that shrinks] and [Note: a load that fails while copying] in
// checkpoint/dcp_load.cc), on every world size. A test hook (dcp::testing::set_before_copy_hook)
// truncates a checkpoint file of one rank in the copy phase, after the verification, the agreement
// and the size check, while that rank reads the file through its mapping:
//   - every rank throws the same c10::Error, naming the API, the rank, the file, the key being
//     copied, the file's size when verified and now, and saying that the model holds a partial
//     load that must be reloaded; no SIGBUS ends the process and no rank hangs;
//   - every floating-point value the load writes is NaN on every rank (a forward gives a NaN
//     loss), the Extra passed is unchanged;
//   - restored, the file loads the saved values, and a training step from them equals the same
//     step of the model that was saved.
// Large values: a file truncated in the middle of a key (after several windows of it were copied),
// through the mapping into a destination of the file's dtype, through the staging buffer of a
// dtype conversion, and through pread (no checksums verified, so no mapping). A SIGBUS that is not
// a load's read (a fault on another mapping during a load) reaches the handler that was installed
// before the load, which is installed again after it.
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
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

std::string test_dir(const std::string& name) { return fsdp::testing::shared_tmpdir() + "/dcp_copy_failure_" + name; }

std::string file_name(const std::string& path) { return path.substr(path.find_last_of('/') + 1); }

// The prefix of rank r's checkpoint files ([Note: checkpoint layout]).
std::string own_prefix(int r) {
  char prefix[32];
  std::snprintf(prefix, sizeof(prefix), "shard-%05d-model-", r + 1);
  return prefix;
}

// Removes the copy hook when the test ends, passed or not.
struct HookGuard {
  explicit HookGuard(std::function<void(const std::string&, const std::string&)> hook) {
    fsdp::dcp::testing::set_before_copy_hook(std::move(hook));
  }
  ~HookGuard() { fsdp::dcp::testing::set_before_copy_hook({}); }
};

void truncate_to(const std::string& path, int64_t bytes) { REQUIRE(::truncate(path.c_str(), bytes) == 0); }

// `s` of rank `from` on every rank.
std::string from_rank(const std::string& s, int from) {
  const auto all = fresh_comm()->all_gather_bytes({s.begin(), s.end()}, "from_rank");
  return {all[static_cast<size_t>(from)].begin(), all[static_cast<size_t>(from)].end()};
}

// The error message of `load` (empty when it did not throw), checked to be the same on every rank.
std::string error_on_every_rank(const std::function<void()>& load) {
  std::string message;
  try {
    load();
  } catch (const c10::Error& e) {
    message = e.what_without_backtrace();
  }
  INFO(message);
  CHECK(fsdp::testing::same_on_every_rank(message));
  return message;
}

bool all_nan(const at::Tensor& t) { return t.numel() == 0 || t.isnan().all().item<bool>(); }

MlpStack make_model(uint64_t seed) {
  torch::manual_seed(seed);
  return MlpStack(6, 8, 32, 3, 3);
}

at::Tensor batch(uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed * 100 + static_cast<uint64_t>(rank()));
  return at::randn({4, 6}, gen);
}

// A sharded model (FULL_SHARD over the world) and an AdamW that has stepped once.
struct Setup {
  MlpStack model;
  std::vector<fsdp::FSDPModule> units;
  std::unique_ptr<torch::optim::AdamW> optim;

  explicit Setup(uint64_t seed) : model(make_model(seed)) {
    units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
    optim = std::make_unique<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-2));
    step(seed);
  }
  // One training step on this rank's batch of `seed`; returns the loss.
  at::Tensor step(uint64_t seed) {
    const at::Tensor x = batch(seed);
    at::Tensor loss = torch::nn::functional::mse_loss(model(x), at::zeros({4, 3}));
    loss.backward();
    optim->step();
    optim->zero_grad();
    return loss.detach();
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
    CHECK(got[item.key()].equal(item.value()));
  }
}

}  // namespace

FSDP_RANKS_TEST_CASE("a checkpoint file truncated while one rank copies it: the same error everywhere, then a good load",
                     "[dcp][copy_failure]") {
  const int W = world_size();
  const std::string dir = test_dir("model");
  Setup source(7);
  fsdp::dcp::Extra extra;
  extra.values["step"] = "1";
  fsdp::dcp::save(dir, source.root(), source.optim.get(), extra,
                  fsdp::dcp::SaveOptions().communicator(fresh_comm()).crc_block_bytes(64));
  const StateDict saved = local_values(source);
  const auto options = fsdp::dcp::LoadOptions().communicator(fresh_comm());

  for (int victim = 0; victim < W; ++victim) {
    DYNAMIC_SECTION("truncated on rank " << victim) {
      Setup dest(77);
      // On the victim, the third run it copies from a file of its own: truncate that file to
      // nothing (two runs of it are copied by then: a partial load), remembering its bytes.
      std::string hit_key;
      std::string hit_path;
      std::string original;
      int own_runs = 0;
      HookGuard hook([&](const std::string& key, const std::string& path) {
        if (rank() != victim || !file_name(path).starts_with(own_prefix(victim)) || ++own_runs != 3) return;
        hit_key = key;
        hit_path = path;
        original = fsdp::storage::read_file(path);
        truncate_to(path, 0);
      });
      fsdp::dcp::Extra restored;
      restored.values["kept"] = "yes";
      const std::string message = error_on_every_rank(
          [&] { fsdp::dcp::load(dir, dest.root(), dest.optim.get(), &restored, options); });
      INFO(message);
      REQUIRE(from_rank(hit_key, victim) != "");  // the victim's hook truncated a file
      const std::string key = from_rank(hit_key, victim);
      const std::string file = file_name(from_rank(hit_path, victim));
      const std::string bytes = from_rank(std::to_string(original.size()), victim);
      CHECK_THAT(message, Contains("fsdp::dcp::load: ") && Contains("rank " + std::to_string(victim) + ": ") &&
                              Contains("the checkpoint file '") && Contains(file + "' ended while key '" + key +
                                                                            "' was copied from it") &&
                              Contains("the file had " + bytes + " bytes when it was verified, but it has 0 now") &&
                              Contains("SIGBUS: truncated during the load") && Contains("partial load") &&
                              Contains("set to NaN on every rank") && Contains("load a checkpoint again"));
      // Every floating-point value the load writes is NaN on every rank; a forward gives NaN.
      for (const auto& item : local_values(dest)) {
        INFO(item.key());
        if (item.value().is_floating_point() && !item.key().starts_with("param_groups.") &&
            !item.key().ends_with(".step")) {
          CHECK(all_nan(item.value()));
        }
      }
      {
        c10::NoGradGuard no_grad;  // a forward without a backward
        const at::Tensor out = dest.model(batch(5));
        CHECK(out.isnan().all().item<bool>());
      }
      CHECK(restored.values == std::map<std::string, std::string>{{"kept", "yes"}});
      // Restored, the same checkpoint loads the saved values, and training goes on exactly as the
      // saved model's does.
      world().barrier();
      if (rank() == victim) fsdp::storage::write_file(hit_path, original);
      world().barrier();
      fsdp::dcp::load(dir, dest.root(), dest.optim.get(), &restored, options);
      check_equal(local_values(dest), saved);
      CHECK(restored.values == extra.values);
      const at::Tensor loss = dest.step(11);
      CHECK(std::isfinite(loss.item<float>()));
      CHECK(loss.equal(source.step(11)));
      check_equal(local_values(dest), local_values(source));
    }
  }
}

// The same truncation one step earlier, in the checksum pass (before the ranks agree): an error
// on every rank naming the file and the key, not a SIGBUS, and nothing loaded on any rank.
FSDP_RANKS_TEST_CASE("a checkpoint file truncated while one rank verifies it: nothing is loaded on any rank",
                     "[dcp][copy_failure]") {
  const int W = world_size();
  const std::string dir = test_dir("verify");
  Setup source(8);
  fsdp::dcp::save(dir, source.root(), source.optim.get(), {},
                  fsdp::dcp::SaveOptions().communicator(fresh_comm()).crc_block_bytes(64));
  const StateDict saved = local_values(source);
  const auto options = fsdp::dcp::LoadOptions().communicator(fresh_comm());
  const int victim = W - 1;
  Setup dest(88);
  const StateDict before = local_values(dest);
  std::string hit_key;
  std::string hit_path;
  std::string original;
  int own_spans = 0;
  struct VerifyHookGuard {
    explicit VerifyHookGuard(std::function<void(const std::string&, const std::string&)> hook) {
      fsdp::dcp::testing::set_before_verify_hook(std::move(hook));
    }
    ~VerifyHookGuard() { fsdp::dcp::testing::set_before_verify_hook({}); }
  };
  {
    VerifyHookGuard hook([&](const std::string& key, const std::string& path) {
      if (rank() != victim || !file_name(path).starts_with(own_prefix(victim)) || ++own_spans != 2) return;
      hit_key = key;
      hit_path = path;
      original = fsdp::storage::read_file(path);
      truncate_to(path, 0);
    });
    const std::string message =
        error_on_every_rank([&] { fsdp::dcp::load(dir, dest.root(), dest.optim.get(), nullptr, options); });
    INFO(message);
    const std::string key = from_rank(hit_key, victim);
    REQUIRE_FALSE(key.empty());
    const std::string file = file_name(from_rank(hit_path, victim));
    CHECK_THAT(message, Contains("fsdp::dcp::load failed on rank " + std::to_string(victim) + " of " +
                                 std::to_string(W) + " (validation; nothing was loaded)") &&
                            Contains("the checkpoint file '") && Contains(file + "' ended while block ") &&
                            Contains(" of entry '" + key + "'") &&
                            Contains("bytes when the load mapped it and has 0 now (truncated during the load)"));
    check_equal(local_values(dest), before);  // nothing loaded on any rank
  }
  world().barrier();
  if (rank() == victim) fsdp::storage::write_file(hit_path, original);
  world().barrier();
  fsdp::dcp::load(dir, dest.root(), dest.optim.get(), nullptr, options);
  check_equal(local_values(dest), saved);
}

// Each rank saves and loads its own range of two values of 3 Mi floats per rank (three windows of
// the mapped copy each), so a rank reads only its own file. The victim (the last rank) truncates
// its file in the middle of v1's bytes when it begins to copy v1: the first half of v1 is copied
// (windows before the end), then the read past the end fails.
FSDP_RANKS_TEST_CASE("large values: a file truncated in the middle of a key, through the mapping, staging and pread",
                     "[dcp][copy_failure]") {
  const int W = world_size();
  const int victim = W - 1;
  const std::string dir = test_dir("large");
  const int64_t per_rank = int64_t{3} << 20;
  const int64_t n = per_rank * W;
  const auto value = [&](int k) { return at::arange(n, at::kFloat).mul_(0.5).add_(k); };
  const int64_t begin = per_rank * rank();
  fsdp::ShardedStateDict saved;
  for (int k = 0; k < 2; ++k) {
    saved.emplace_back("v" + std::to_string(k),
                       fsdp::LocalShard{value(k).slice(0, begin, begin + per_rank).clone(), {n}, begin, true});
  }
  fsdp::dcp::save_state(dir, saved, {}, fsdp::dcp::SaveOptions().communicator(fresh_comm()).crc_block_bytes(64 << 10));

  struct Way {
    const char* name;
    at::ScalarType v1_dtype;
    bool verify;
    const char* says;  // what the message says of the read that failed
  };
  const Way ways[] = {
      {"mapped, into float32", at::kFloat, true, "SIGBUS: truncated during the load"},
      {"mapped, converted to float64 through staging", at::kDouble, true, "SIGBUS: truncated during the load"},
      {"pread (checksums not verified: no mapping)", at::kFloat, false, "unexpected end of"},
  };
  for (const Way& way : ways) {
    DYNAMIC_SECTION(way.name) {
      fsdp::ShardedStateDict wanted;
      wanted.emplace_back("v0", fsdp::LocalShard{at::full({per_rank}, -1.0f), {n}, begin, false});
      wanted.emplace_back("v1", fsdp::LocalShard{at::full({per_rank}, -1.0, way.v1_dtype), {n}, begin, false});
      const auto options = fsdp::dcp::LoadOptions()
                               .communicator(fresh_comm())
                               .convert_dtype(true)
                               .max_staging_bytes(1 << 20)
                               .verify_checksums(way.verify);
      std::string hit_path;
      std::string original;
      int64_t cut = 0;
      HookGuard hook([&](const std::string& key, const std::string& path) {
        if (rank() != victim || key != "v1" || !original.empty()) return;
        hit_path = path;
        original = fsdp::storage::read_file(path);
        const fsdp::storage::SafetensorsFile file(path);
        const auto& entry = file.header().at("v1");
        cut = file.header().data_start + entry.data_begin + entry.nbytes() / 2;
        truncate_to(path, cut);
      });
      const std::string message = error_on_every_rank([&] { fsdp::dcp::load_state(dir, wanted, nullptr, options); });
      INFO(message);
      const std::string file = file_name(from_rank(hit_path, victim));
      REQUIRE_FALSE(file.empty());
      CHECK_THAT(message, Contains("fsdp::dcp::load_state: ") && Contains("rank " + std::to_string(victim) + ": ") &&
                              Contains(file) && Contains("'v1'") && Contains(way.says) &&
                              Contains("the state dict's tensors hold a partial load") &&
                              Contains("load a checkpoint again"));
      if (way.verify) {
        CHECK_THAT(message, Contains("has " + from_rank(std::to_string(cut), victim) + " now"));
      }
      CHECK(all_nan(wanted[0].second.local));
      CHECK(all_nan(wanted[1].second.local));
      world().barrier();
      if (rank() == victim) fsdp::storage::write_file(hit_path, original);
      world().barrier();
      original = "done";  // the hook truncates once
      CHECK(fsdp::dcp::load_state(dir, wanted, nullptr, options) == 2);
      CHECK(wanted[0].second.local.equal(value(0).slice(0, begin, begin + per_rank)));
      CHECK(wanted[1].second.local.equal(value(1).slice(0, begin, begin + per_rank).to(way.v1_dtype)));
    }
  }
}

namespace {

// A handler of the test's own, installed before a load: it jumps back out of a fault it expects.
sigjmp_buf g_test_jump;
volatile sig_atomic_t g_test_expects_fault = 0;
volatile sig_atomic_t g_test_faults = 0;

void test_handler(int, siginfo_t*, void*) {
  if (g_test_expects_fault) {
    g_test_expects_fault = 0;
    g_test_faults = g_test_faults + 1;
    siglongjmp(g_test_jump, 1);
  }
  std::abort();
}

bool is_test_handler(const struct sigaction& action) {
  return (action.sa_flags & SA_SIGINFO) != 0 && action.sa_sigaction == test_handler;
}

}  // namespace

FSDP_RANKS_TEST_CASE("a SIGBUS that is not a load's read reaches the handler installed before the load",
                     "[dcp][copy_failure]") {
  const int W = world_size();
  const std::string dir = test_dir("chain");
  const int64_t begin = 1000 * rank();
  fsdp::ShardedStateDict saved;
  saved.emplace_back("v", fsdp::LocalShard{at::arange(1000, at::kFloat).add_(begin), {1000 * W}, begin, true});
  fsdp::dcp::save_state(dir, saved, {}, fsdp::dcp::SaveOptions().communicator(fresh_comm()).crc_block_bytes(256));

  struct sigaction mine {};
  mine.sa_sigaction = test_handler;
  mine.sa_flags = SA_SIGINFO;
  sigemptyset(&mine.sa_mask);
  struct sigaction before {};
  REQUIRE(::sigaction(SIGBUS, &mine, &before) == 0);

  // In the copy phase, a mapping of the test's own, whose file is then truncated, is read: the
  // load's handler is installed but the fault is not in a load's read, so it reaches test_handler.
  const std::string scratch = fsdp::testing::shared_tmpdir() + "/dcp_copy_failure_scratch_" + std::to_string(rank());
  fsdp::storage::write_file(scratch, std::string(8192, 'x'));
  bool load_handler_installed = false;
  int hook_calls = 0;
  HookGuard hook([&](const std::string&, const std::string&) {
    if (++hook_calls != 1) return;
    struct sigaction current {};
    ::sigaction(SIGBUS, nullptr, &current);
    load_handler_installed = !is_test_handler(current);
    const int fd = ::open(scratch.c_str(), O_RDONLY);
    REQUIRE(fd >= 0);
    void* p = ::mmap(nullptr, 8192, PROT_READ, MAP_SHARED, fd, 0);
    REQUIRE(p != MAP_FAILED);
    REQUIRE(::truncate(scratch.c_str(), 0) == 0);
    if (sigsetjmp(g_test_jump, 1) == 0) {
      g_test_expects_fault = 1;
      const volatile char c = static_cast<const volatile char*>(p)[4096];
      (void)c;
      g_test_expects_fault = 0;  // not reached: the page is past the end of the file
    }
    ::munmap(p, 8192);
    ::close(fd);
  });
  fsdp::ShardedStateDict wanted;
  wanted.emplace_back("v", fsdp::LocalShard{at::zeros({1000}), {1000 * W}, begin, false});
  CHECK(fsdp::dcp::load_state(dir, wanted, nullptr, fsdp::dcp::LoadOptions().communicator(fresh_comm())) == 1);
  CHECK(wanted[0].second.local.equal(saved[0].second.local));
  CHECK(hook_calls >= 1);
  CHECK(load_handler_installed);
  CHECK(g_test_faults == 1);
  struct sigaction after {};
  REQUIRE(::sigaction(SIGBUS, &before, &after) == 0);
  CHECK(is_test_handler(after));  // installed again when the load ended
}
