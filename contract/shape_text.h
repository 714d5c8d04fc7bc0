#pragma once

// How error messages and descriptions write a shape: "[2, 3, 4]" ("[]" for a scalar), the same
// text as streaming c10::IntArrayRef (`out << t.sizes()`). One function for every layer above.

#include <string>

#include <c10/util/ArrayRef.h>

namespace fsdp::contract {

/// The shape as "[a, b, c]".
///
///   shape_string(t.sizes());                      // "[16, 8]"
///   shape_string(std::vector<int64_t>{});         // "[]"
inline std::string shape_string(c10::IntArrayRef shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) text += ", ";
    text += std::to_string(shape[i]);
  }
  return text + "]";
}

}  // namespace fsdp::contract
