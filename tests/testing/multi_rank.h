#pragma once
// Multi-rank tests over real processes (MPI): the same Catch2 test body runs on every rank of an
// `mpirun -np N` launch, and ranks agree on each test case's outcome.
//
//   FSDP_RANKS_TEST_CASE("allreduce sums", "[comm]") {
//     auto& world = fsdp::testing::world();
//     at::Tensor t = at::ones({4});
//     world.all_reduce(t).wait();
//     CHECK(t.equal(at::full({4}, world.size())));
//   }
//
// After the body, every rank learns which ranks failed; a rank that passed while another failed
// fails too, naming the failing ranks, so every rank reports and exits. If a rank fails while the
// others are blocked in a collective inside the body, the collective timeout (FSDP_TEST_TIMEOUT_S,
// default 120 s) aborts the job with a report naming that collective: no rank hangs.
//
// Build with fsdp_mpi_test (tests/testing/testing.bzl), which launches the binary on 1, 2, 3 and 4
// ranks.

#include <memory>
#include <string>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/tests/testing/errors.h"  // error_of, for test bodies

// Last: LibTorch's c10/util/Logging.h defines its own CHECK, and the last definition wins.
#include <catch2/catch.hpp>

namespace fsdp::testing {

/// The communicator over every rank of this launch (the MPI backend) for test bodies.
comm::Communicator& world();
/// A new communicator over world()'s backend, with counters of its own: a test's collectives are
/// counted apart from the harness's and from other tests'.
std::shared_ptr<comm::Communicator> fresh_comm();
int rank();
int world_size();

/// A folder shared by all ranks of this launch, removed after it (FSDP_TEST_TMPDIR).
std::string shared_tmpdir();

/// Whether every rank of the launch passed the same string (collective).
bool same_on_every_rank(const std::string& s);

/// Runs `body`, then exchanges pass/fail across ranks (see above).
void run_on_all_ranks(void (*body)());

}  // namespace fsdp::testing

#define FSDP_TESTING_CONCAT_(a, b) a##b
#define FSDP_TESTING_CONCAT(a, b) FSDP_TESTING_CONCAT_(a, b)

#define FSDP_RANKS_TEST_CASE(NAME, TAGS)                                      \
  static void FSDP_TESTING_CONCAT(fsdp_ranks_body_, __LINE__)();              \
  TEST_CASE(NAME, TAGS) {                                                     \
    ::fsdp::testing::run_on_all_ranks(&FSDP_TESTING_CONCAT(fsdp_ranks_body_, __LINE__)); \
  }                                                                           \
  static void FSDP_TESTING_CONCAT(fsdp_ranks_body_, __LINE__)()
