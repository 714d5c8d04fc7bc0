// main() of every multi-rank test binary: initialises MPI, gives rank 0 the requested reporter
// (JUnit into FSDP_TEST_JUNIT when the launcher sets it) and the other ranks a silent one, and
// prints every failed assertion of every rank to stderr, prefixed with its rank.
#define CATCH_CONFIG_RUNNER
#include "fsdp_cpp/tests/testing/multi_rank.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <vector>

#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>

#include "fsdp_cpp/comm/mpi_backend.h"
#include "fsdp_cpp/comm/mpi_runtime.h"
#include "fsdp_cpp/tests/testing/failure_report.h"

namespace fsdp::testing {
namespace {

std::atomic<bool> g_failed_here{false};
comm::Communicator* g_world = nullptr;
comm::Communicator* g_results = nullptr;  // a separate group: never collides with test traffic

std::chrono::milliseconds test_timeout() {
  if (const char* env = std::getenv("FSDP_TEST_TIMEOUT_S")) {
    return std::chrono::milliseconds(static_cast<int64_t>(std::atof(env) * 1000));
  }
  return std::chrono::seconds(120);
}

// Records failures of this rank and echoes them with the rank, so a failure on rank 3 is visible
// even though only rank 0 writes the report.
class RankFailureListener : public Catch::TestEventListenerBase {
 public:
  using TestEventListenerBase::TestEventListenerBase;

  bool assertionEnded(const Catch::AssertionStats& stats) override {
    const auto& result = stats.assertionResult;
    if (!result.isOk()) {
      g_failed_here = true;
      std::ostringstream text;
      text << "[rank " << rank() << " of " << world_size() << "] FAILED in '" << current_case_
           << "'" << describe_failed_assertion(stats);
      std::fprintf(stderr, "%s\n", text.str().c_str());
      std::fflush(stderr);
    }
    return true;
  }

  void testCaseStarting(const Catch::TestCaseInfo& info) override {
    current_case_ = info.name;
    TestEventListenerBase::testCaseStarting(info);
  }

 private:
  std::string current_case_;
};

}  // namespace

comm::Communicator& world() { return *g_world; }
std::shared_ptr<comm::Communicator> fresh_comm() {
  return std::make_shared<comm::Communicator>(g_world->backend(), at::kCPU);
}
int rank() { return g_world->rank(); }
int world_size() { return g_world->size(); }

std::string shared_tmpdir() {
  const char* dir = std::getenv("FSDP_TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

bool same_on_every_rank(const std::string& s) {
  const auto all = world().all_gather_bytes(std::vector<uint8_t>(s.begin(), s.end()));
  for (const auto& bytes : all) {
    if (std::string(bytes.begin(), bytes.end()) != s) return false;
  }
  return true;
}

void run_on_all_ranks(void (*body)()) {
  g_failed_here = false;
  std::exception_ptr error;
  try {
    body();
  } catch (...) {
    error = std::current_exception();
  }
  const bool failed_here = g_failed_here || error != nullptr;
  at::Tensor mine = at::tensor({failed_here ? 1 : 0}, at::kInt);
  at::Tensor all = at::empty({g_results->size()}, at::kInt);
  g_results->all_gather_into_tensor(all, mine).wait();
  std::vector<int> failed_ranks;
  for (int r = 0; r < g_results->size(); ++r) {
    if (all[r].item<int>() != 0) failed_ranks.push_back(r);
  }
  if (!failed_here && !failed_ranks.empty()) {
    std::ostringstream text;
    text << "this test case failed on rank(s)";
    for (int r : failed_ranks) text << " " << r;
    text << " of " << g_results->size() << " (see their output)";
    FAIL_CHECK(text.str());
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace fsdp::testing

using RankFailureListener = fsdp::testing::RankFailureListener;
CATCH_REGISTER_LISTENER(RankFailureListener)

int main(int argc, char** argv) {
  using fsdp::comm::MpiBackend;
  MpiBackend::Options options;
  options.timeout = fsdp::testing::test_timeout();
  options.name = "test world";
  auto world = std::make_unique<fsdp::comm::Communicator>(MpiBackend::create_world(options), at::kCPU);
  options.name = "test results";
  auto results = std::make_unique<fsdp::comm::Communicator>(MpiBackend::create_world(options), at::kCPU);
  fsdp::testing::g_world = world.get();
  fsdp::testing::g_results = results.get();

  Catch::Session session;
  const int rc = session.applyCommandLine(argc, argv);
  if (rc != 0) return rc;
  auto& config = session.configData();
  if (world->rank() == 0) {
    if (const char* junit = std::getenv("FSDP_TEST_JUNIT")) {
      config.reporterName = "junit";
      config.outputFilename = junit;
    }
  } else {
    config.reporterName = "console";
    config.outputFilename = "/dev/null";
  }
  const int failures = session.run();
  // Every rank leaves together: no rank finalises MPI while another still sends.
  world->barrier();
  results.reset();
  world.reset();
  return failures == 0 ? 0 : 1;
}
