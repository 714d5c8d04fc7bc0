#pragma once
// The text the test mains (catch_main.cc, mpi_test_main.cc) print to stderr for a failed
// assertion, so the test log says where and why without the JUnit report.

#include <sstream>
#include <string>

#include <catch2/catch.hpp>

namespace fsdp::testing {

/// " at FILE:LINE", then one indented line each for the expression, its expansion, the message
/// and every INFO message that is not the message.
inline std::string describe_failed_assertion(const Catch::AssertionStats& stats) {
  const auto& result = stats.assertionResult;
  std::ostringstream text;
  text << " at " << result.getSourceInfo().file << ":" << result.getSourceInfo().line;
  if (result.hasExpression()) text << "\n    " << result.getExpressionInMacro();
  if (result.hasExpandedExpression()) text << "\n    with expansion: " << result.getExpandedExpression();
  if (result.hasMessage()) text << "\n    " << result.getMessage();
  for (const auto& info : stats.infoMessages) {
    if (!result.hasMessage() || info.message != result.getMessage()) text << "\n    info: " << info.message;
  }
  return text.str();
}

}  // namespace fsdp::testing
