// main() of single-process Catch2 tests: the reporter Bazel asks for (JUnit into XML_OUTPUT_FILE,
// so test cases are counted), with every failed assertion also printed to stderr (the test log).
#define CATCH_CONFIG_RUNNER
#include <cstdio>
#include <cstdlib>
#include <string>

#include <catch2/catch.hpp>

#include "fsdp_cpp/tests/testing/failure_report.h"

namespace {

class FailurePrinter : public Catch::TestEventListenerBase {
 public:
  using TestEventListenerBase::TestEventListenerBase;

  void testCaseStarting(const Catch::TestCaseInfo& info) override {
    current_case_ = info.name;
    TestEventListenerBase::testCaseStarting(info);
  }

  bool assertionEnded(const Catch::AssertionStats& stats) override {
    const auto& result = stats.assertionResult;
    if (result.isOk()) return true;
    const std::string text =
        "FAILED in '" + current_case_ + "'" + fsdp::testing::describe_failed_assertion(stats);
    std::fprintf(stderr, "%s\n", text.c_str());
    return true;
  }

  void testCaseEnded(const Catch::TestCaseStats& stats) override {
    std::fprintf(stderr, "%s: %s\n", stats.totals.assertions.allOk() ? "passed" : "FAILED",
                 stats.testInfo.name.c_str());
    TestEventListenerBase::testCaseEnded(stats);
  }

 private:
  std::string current_case_;
};

}  // namespace

CATCH_REGISTER_LISTENER(FailurePrinter)

int main(int argc, char** argv) {
  Catch::Session session;
  const int rc = session.applyCommandLine(argc, argv);
  if (rc != 0) return rc;
  if (const char* xml = std::getenv("XML_OUTPUT_FILE")) {
    session.configData().reporterName = "junit";
    session.configData().outputFilename = xml;
  }
  return session.run() == 0 ? 0 : 1;
}
