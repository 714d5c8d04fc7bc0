#pragma once
// Error messages as values, for tests that check what an API says when it refuses: single-process
// tests use it directly, multi-rank tests through multi_rank.h.
//
//   CHECK_THAT(fsdp::testing::error_of([&] { registry.get(*model, ""); }), Contains("fully_shard"));

#include <functional>
#include <string>

#include <c10/util/Exception.h>

namespace fsdp::testing {

/// What error_of returns when `fn` throws nothing.
inline constexpr const char* kNoError = "(no error)";

/// The message (without backtrace) of the c10::Error `fn` throws, or kNoError if it returns.
/// Other exceptions propagate, so a test fails loudly on them.
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& error) {
    return error.what_without_backtrace();
  }
  return kNoError;
}

}  // namespace fsdp::testing
