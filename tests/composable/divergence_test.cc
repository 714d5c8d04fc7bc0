// Divergence detection ([Note: divergence check] in fsdp/divergence.h): ranks that run different
// units, shapes, numbers of passes or gradient-sync settings fail with the same error on every
// rank, naming the ranks and what each was about to do, instead of an MPI truncation error or a
// hang. Each case runs on 1-4 ranks (on one rank nothing can differ: training just works).

#include <cstdlib>
#include <string>

#include <torch/nn/module.h>
#include <torch/utils.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/fsdp/divergence.h"
#include "fsdp_cpp/tests/composable/parity.h"
#include "fsdp_cpp/tests/composable/test_models.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

using Catch::Matchers::Contains;
using fsdp::testing::fresh_comm;
using fsdp::testing::error_of;
using fsdp::testing::rank;
using fsdp::testing::same_on_every_rank;
using fsdp::testing::world;
using fsdp::testing::world_size;

namespace {

fsdp::FullyShardOptions options(std::shared_ptr<fsdp::comm::Communicator> comm = fresh_comm()) {
  return fsdp::FullyShardOptions().communicator(std::move(comm));
}

// Sets FSDP_DEBUG=1 for a scope.
struct DebugScope {
  DebugScope() { setenv("FSDP_DEBUG", "1", 1); }
  ~DebugScope() { unsetenv("FSDP_DEBUG"); }
};

// y = x @ w: a unit whose one parameter can have the same size but another shape on one rank.
struct MatImpl : torch::nn::Module {
  MatImpl(int64_t rows, int64_t cols) { w = register_parameter("w", torch::randn({rows, cols})); }
  torch::Tensor forward(torch::Tensor x) { return x.matmul(w); }
  torch::Tensor w;
};
FSDP_HOOKABLE_MODULE(Mat);

// The root's own parameters (out) agree on every rank; only m's shape differs.
struct MatNetImpl : torch::nn::Module {
  MatNetImpl(int64_t rows, int64_t cols) {
    m = register_module("m", Mat(rows, cols));
    out = register_module("out", fsdp::contract::Linear(1, 2));
  }
  torch::Tensor forward(torch::Tensor x) { return out(m(x).sum(-1, true)); }
  Mat m{nullptr};
  fsdp::contract::Linear out{nullptr};
};
FSDP_HOOKABLE_MODULE(MatNet);

// a -> b, or only a (a rank that runs fewer units).
struct MaybeSkipImpl : torch::nn::Module {
  explicit MaybeSkipImpl(int64_t dim) {
    a = register_module("a", fsdp::contract::Linear(dim, dim));
    b = register_module("b", fsdp::contract::Linear(dim, dim));
  }
  torch::Tensor forward(torch::Tensor x, bool skip_b) { return skip_b ? a(x) : b(a(x)); }
  fsdp::contract::Linear a{nullptr}, b{nullptr};
};
FSDP_HOOKABLE_MODULE(MaybeSkip);

fsdp::testing::MlpStack sharded_stack(int64_t hidden, const fsdp::FullyShardOptions& o) {
  auto model = fsdp::testing::MlpStack(4, 8, hidden, 3, 2);
  fsdp::testing::shard_stack(model, o);
  return model;
}

// The message is the same on every rank (it is built from the same exchanged fingerprints).
void check_same_everywhere(const std::string& message) { CHECK(same_on_every_rank(message)); }

}  // namespace

TEST_CASE("describe_divergence groups ranks and shows only the fields that differ", "[divergence]") {
  auto fp = [](const std::string& event, const std::string& gather) {
    fsdp::Fingerprint f(event);
    f.add("all-gather", gather).add("iteration", "3");
    return f;
  };
  const auto same = fp("ran 'blocks.1'", "8 elements of Float per rank");
  CHECK(fsdp::describe_divergence({same, same, same}).empty());
  const std::string message = fsdp::describe_divergence(
      {same, fp("ran 'blocks.1'", "16 elements of Float per rank"), same});
  CHECK_THAT(message, Contains("fully_shard: ranks diverged before a collective in iteration 3: "
                               "ranks 0,2 have {ran 'blocks.1'; all-gather: 8 elements of Float per rank}; "
                               "rank 1 has {ran 'blocks.1'; all-gather: 16 elements of Float per rank}"));
  CHECK_THAT(message, !Contains("iteration: 3"));  // equal fields are not repeated
  CHECK_THAT(message, Contains("parameters differ across ranks"));
  const auto round_trip = fsdp::Fingerprint::deserialize(same.serialize());
  CHECK(round_trip == same);
}

FSDP_RANKS_TEST_CASE("ranks running units in a different order are named", "[divergence]") {
  torch::manual_seed(1);
  auto model = fsdp::testing::Order(4);
  const auto o = options();
  fsdp::fully_shard(model->a, o);
  fsdp::fully_shard(model->b, o);
  fsdp::fully_shard(model, o);
  const bool swap = rank() % 2 == 1;
  const std::string message = error_of([&] { model(at::randn({2, 4}), swap).sum().backward(); });
  if (world_size() == 1) {
    CHECK(message == "(no error)");
    return;
  }
  check_same_everywhere(message);
  const std::string odd = world_size() == 2 ? "rank 1 has {ran 'b'" : world_size() == 3 ? "rank 1 has {ran 'b'"
                                                                                         : "ranks 1,3 have {ran 'b'";
  const std::string even = world_size() == 2 ? "rank 0 has {ran 'a'" : "ranks 0,2 have {ran 'a'";
  CHECK_THAT(message, Contains("fully_shard: the forward order differs across ranks in iteration 0: " + even));
  CHECK_THAT(message, Contains(odd));
  CHECK_THAT(message, Contains("rank 0: ran 'a'") && Contains("rank 1: ran 'b'"));
}

FSDP_RANKS_TEST_CASE("a unit whose parameters have other sizes on one rank is named before its all-gather",
                     "[divergence]") {
  torch::manual_seed(2);
  const int64_t hidden = rank() == world_size() - 1 && world_size() > 1 ? 32 : 16;
  auto model = sharded_stack(hidden, options());
  const std::string message = error_of([&] { model(at::randn({2, 4})).sum().backward(); });
  if (world_size() == 1) {
    CHECK(message == "(no error)");
    return;
  }
  check_same_everywhere(message);
  // fc1 [hidden, 8] + bias [hidden] + fc2 [8, hidden] + bias [8], padded to the world size.
  const auto per_rank = [](int64_t h) {
    const int64_t w = world_size();
    int64_t n = h * 8;
    n += h;
    n += 8 * h;
    n += 8;
    return ((n + w - 1) / w * w) / w;
  };
  const std::string last = std::to_string(world_size() - 1);
  CHECK_THAT(message, Contains("fully_shard: ranks diverged before a collective in iteration 0"));
  CHECK_THAT(message, Contains("{ran 'blocks.0'; all-gather: " + std::to_string(per_rank(16)) +
                               " elements of Float per rank; parameters: fc1.weight [16, 8]"));
  CHECK_THAT(message, Contains("rank " + last + " has {ran 'blocks.0'; all-gather: " +
                               std::to_string(per_rank(32)) + " elements of Float per rank; parameters: "
                               "fc1.weight [32, 8]"));
  CHECK_THAT(message, Contains("parameters differ across ranks"));
}

FSDP_RANKS_TEST_CASE("same all-gather size but another parameter shape on one rank is named",
                     "[divergence]") {
  // w [4, 6] on most ranks, [6, 4] on rank 1: the all-gathers would pair up and train on wrongly
  // shaped values; the check names the shapes.
  torch::manual_seed(3);
  const bool other = rank() == 1;
  auto model = other ? MatNet(6, 4) : MatNet(4, 6);
  const auto o = options();
  fsdp::fully_shard(model->m, o);
  fsdp::fully_shard(model, o);
  const std::string message = error_of([&] { model(at::randn({3, other ? 6 : 4})).sum().backward(); });
  if (world_size() == 1) {
    CHECK(message == "(no error)");
    return;
  }
  check_same_everywhere(message);
  CHECK_THAT(message, Contains("ran 'm'; parameters: w [4, 6] (Float)}") &&
                          Contains("rank 1 has {ran 'm'; parameters: w [6, 4] (Float)}"));
  CHECK_THAT(message, !Contains("all-gather:"));  // the sizes agree
}

FSDP_RANKS_TEST_CASE("a rank that runs fewer units is named", "[divergence]") {
  torch::manual_seed(4);
  auto model = MaybeSkip(4);
  const auto o = options();
  fsdp::fully_shard(model->a, o);
  fsdp::fully_shard(model->b, o);
  fsdp::fully_shard(model, o);
  const bool skip = rank() == world_size() - 1 && world_size() > 1;
  const std::string message = error_of([&] { model(at::randn({2, 4}), skip).sum().backward(); });
  if (world_size() == 1) {
    CHECK(message == "(no error)");
    return;
  }
  check_same_everywhere(message);
  const std::string last = std::to_string(world_size() - 1);
  CHECK_THAT(message, Contains("fully_shard: the forward order differs across ranks in iteration 0"));
  CHECK_THAT(message, Contains("rank 0: ran 'b'") && Contains("rank " + last + ": finished its forward"));
}

FSDP_RANKS_TEST_CASE("gradient sync off on one rank is named before the reduce-scatter", "[divergence]") {
  torch::manual_seed(5);
  auto model = fsdp::testing::MlpStack(4, 8, 16, 3, 2);
  auto units = fsdp::testing::shard_stack(model, options());
  const bool off = rank() == 0 && world_size() > 1;
  if (off) units.back().set_requires_gradient_sync(false);
  at::Tensor loss = model(at::randn({2, 4})).sum();  // forward agrees
  const std::string message = error_of([&] { loss.backward(); });
  if (world_size() == 1) {
    CHECK(message == "(no error)");
    return;
  }
  check_same_everywhere(message);
  // Refused when the backward pass begins ([Note: backward reach]), at the first unit whose
  // controls differ (the units in tree order: the root), before any gradient moves.
  CHECK_THAT(message, Contains("fully_shard: the ranks set different controls on unit '<root>' for the backward "
                               "pass of iteration 0; nothing was reduced"));
  CHECK_THAT(message, Contains("rank 0: requires_gradient_sync false,"));
  CHECK_THAT(message, Contains("rank 1: requires_gradient_sync true,"));
}

FSDP_RANKS_TEST_CASE("a rank that runs an extra forward before backward is named", "[divergence]") {
  torch::manual_seed(6);
  auto model = sharded_stack(16, options());
  const bool extra = rank() == world_size() - 1 && world_size() > 1;
  const std::string message = error_of([&] {
    at::Tensor loss = model(at::randn({2, 4})).sum();
    if (extra) loss = loss + model(at::randn({2, 4})).sum();
    loss.backward();
  });
  if (world_size() == 1) {
    CHECK(message == "(no error)");
    return;
  }
  check_same_everywhere(message);
  const std::string last = std::to_string(world_size() - 1);
  CHECK_THAT(message, Contains("fully_shard: ranks diverged before a collective in iteration 0"));
  CHECK_THAT(message, Contains("rank 0: began a backward pass") && Contains("rank " + last + ": ran '<root>'"));
  CHECK_THAT(message, Contains("rank " + last + " has {ran '<root>'; forward call: 1"));
  CHECK_THAT(message, Contains("a rank that skips a backward, runs an extra forward"));
}

FSDP_RANKS_TEST_CASE("FSDP_DEBUG=1: a rank that skips a backward in a later iteration is named",
                     "[divergence][debug]") {
  torch::manual_seed(7);
  DebugScope debug;
  auto model = sharded_stack(16, options());
  const bool skipper = rank() == world_size() - 1 && world_size() > 1;
  std::string message = "(no error)";
  for (int step = 0; step < 4 && message == "(no error)"; ++step) {
    message = error_of([&] {
      at::Tensor loss = model(at::randn({2, 4})).sum();
      if (step == 2 && skipper) return;  // e.g. a non-finite loss skipped on this rank only
      loss.backward();
    });
  }
  if (world_size() == 1) {
    CHECK(message == "(no error)");
    return;
  }
  check_same_everywhere(message);
  const std::string last = std::to_string(world_size() - 1);
  CHECK_THAT(message, Contains("fully_shard: ranks diverged before a collective in iteration 2"));
  CHECK_THAT(message, Contains("rank 0: began a backward pass") && Contains("rank " + last + ": ran '<root>'"));
}

FSDP_RANKS_TEST_CASE("without FSDP_DEBUG only the first iteration is checked; with it every one",
                     "[divergence][debug]") {
  torch::manual_seed(8);
  auto comm = fresh_comm();
  auto model = sharded_stack(16, options(comm));
  const auto checks_in_one_iteration = [&] {
    const int64_t before = comm->stats(fsdp::comm::CollectiveKind::kAllGatherBytes).calls;
    model(at::randn({2, 4})).sum().backward();
    return comm->stats(fsdp::comm::CollectiveKind::kAllGatherBytes).calls - before;
  };
  // 4 units (3 blocks, the root): one check before each unit's forward and one before its
  // reduction, one at the end of the root's forward, one when the backward pass begins, and one
  // before each backward all-gather (the 3 blocks': the root stays unsharded). The first
  // iteration also holds other one-time exchanges (lazy initialisation's), so it has at least as
  // many.
  const int64_t expected = world_size() == 1 ? 0 : 4 * 2 + 2 + 3;
  CHECK(checks_in_one_iteration() >= expected);
  CHECK(checks_in_one_iteration() == 0);
  DebugScope debug;
  CHECK(checks_in_one_iteration() == expected);
  CHECK(checks_in_one_iteration() == expected);
}

FSDP_RANKS_TEST_CASE("FSDP_DEBUG=1 training matches the unsharded reference", "[divergence][debug]") {
  DebugScope debug;
  fsdp::testing::ParityOptions o;
  o.iterations = 3;
  o.micro_batches = 2;  // gradient accumulation: sync off, then on, checked every iteration
  fsdp::testing::run_parity(fsdp::testing::mlp_stack_scenario("mlp stack, FSDP_DEBUG=1"), o);
}
