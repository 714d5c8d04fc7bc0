// DivergenceCheck on 1-3 ranks as threads: ranks that agree pass, ranks that differ all throw the
// same error naming each side, and unchecked iterations exchange nothing.
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

#include "fsdp_cpp/fsdp/divergence_check.h"
#include "fsdp_cpp/tests/fsdp/engine_units.h"
#include "fsdp_cpp/tests/testing/thread_backend.h"

// Last: LibTorch's c10/util/Logging.h defines its own CHECK, and the last definition wins.
#include <catch2/catch.hpp>

namespace {

using Catch::Matchers::Contains;

// Runs `fingerprint_of(rank)` through a checked DivergenceCheck on `world` rank threads; returns
// each rank's error message ("" where it passed).
std::vector<std::string> check_on_ranks(int world, const std::function<fsdp::Fingerprint(int)>& fingerprint_of,
                                        int64_t completed_iterations = 0) {
  std::vector<std::string> errors(static_cast<size_t>(world));
  fsdp::testing::run_ranks_as_threads(world, [&](fsdp::comm::Communicator& comm) {
    fsdp::DivergenceCheck check(fsdp::testing::borrow(comm));
    check.begin_iteration(completed_iterations);
    try {
      check.check(fingerprint_of(comm.rank()), /*iteration=*/completed_iterations);
    } catch (const c10::Error& e) {
      errors[static_cast<size_t>(comm.rank())] = e.msg();
    }
  });
  return errors;
}

fsdp::Fingerprint forward_of(const std::string& unit, const std::string& gather) {
  fsdp::Fingerprint f("ran '" + unit + "'");
  f.add("all-gather", gather);
  return f;
}

}  // namespace

TEST_CASE("ranks that agree pass the divergence check", "[fsdp][divergence]") {
  unsetenv("FSDP_DEBUG");
  for (int world = 1; world <= 3; ++world) {
    INFO("world " << world);
    const auto errors = check_on_ranks(world, [](int) { return forward_of("blocks.0", "8 x float"); });
    for (const auto& e : errors) CHECK(e.empty());
  }
}

TEST_CASE("ranks running different units all get the same error naming both", "[fsdp][divergence]") {
  unsetenv("FSDP_DEBUG");
  const auto errors = check_on_ranks(3, [](int rank) {
    return forward_of(rank == 1 ? "blocks.1" : "blocks.0", "8 x float");
  });
  REQUIRE_FALSE(errors[0].empty());
  CHECK(errors[1] == errors[0]);
  CHECK(errors[2] == errors[0]);
  CHECK_THAT(errors[0], Contains("fully_shard: the forward order differs across ranks in iteration 0: "
                                 "ranks 0,2 have {ran 'blocks.0'}; rank 1 has {ran 'blocks.1'}"));
  CHECK_THAT(errors[0], Contains("\n  rank 0: ran 'blocks.0'\n  rank 1: ran 'blocks.1'\n  rank 2: ran 'blocks.0'"));
}

TEST_CASE("ranks with different parameters are named with the differing field", "[fsdp][divergence]") {
  unsetenv("FSDP_DEBUG");
  const auto errors = check_on_ranks(2, [](int rank) {
    return forward_of("blocks.0", rank == 0 ? "8 x float" : "6 x float");
  });
  REQUIRE_FALSE(errors[0].empty());
  CHECK(errors[1] == errors[0]);
  CHECK_THAT(errors[0], Contains("fully_shard: ranks diverged before a collective in iteration 0: "
                                 "rank 0 has {ran 'blocks.0'; all-gather: 8 x float}; "
                                 "rank 1 has {ran 'blocks.0'; all-gather: 6 x float}"));
  CHECK_THAT(errors[0], Contains("The unit's parameters differ across ranks"));
}

TEST_CASE("only the first iteration is checked unless FSDP_DEBUG=1", "[fsdp][divergence]") {
  unsetenv("FSDP_DEBUG");
  const auto differ = [](int rank) { return forward_of("blocks." + std::to_string(rank), "8 x float"); };
  // Not checked: nothing exchanged, nothing thrown, although the ranks differ.
  for (const auto& e : check_on_ranks(2, differ, /*completed_iterations=*/1)) CHECK(e.empty());
  setenv("FSDP_DEBUG", "1", 1);
  const auto errors = check_on_ranks(2, differ, /*completed_iterations=*/4);
  unsetenv("FSDP_DEBUG");
  REQUIRE_FALSE(errors[0].empty());
  CHECK(errors[1] == errors[0]);
  CHECK_THAT(errors[0], Contains("in iteration 4: rank 0 has {ran 'blocks.0'}; rank 1 has {ran 'blocks.1'}"));
}

TEST_CASE("a DivergenceCheck is off until an iteration begins, and off without a communicator", "[fsdp][divergence]") {
  fsdp::DivergenceCheck check(nullptr);
  CHECK_FALSE(check.enabled());
  check.begin_iteration(0);
  CHECK(check.enabled());
  check.check(fsdp::Fingerprint("ran 'a'"), 0);  // nothing to exchange with
  check.begin_iteration(1);
  CHECK_FALSE(check.enabled());
}
