#pragma once
// Command-line values of the example programs: an integer or a number with a lower bound, or
// std::invalid_argument naming the flag, the bound and what was given.
//
//   f.steps = fsdp::examples::parse_int_flag("--steps", argv[++i], 1);

#include <cstdint>
#include <stdexcept>
#include <string>

namespace fsdp::examples {

inline int64_t parse_int_flag(const std::string& name, const std::string& value, int64_t min) {
  size_t used = 0;
  int64_t v = 0;
  try {
    v = std::stoll(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != value.size() || value.empty() || v < min) {
    throw std::invalid_argument(name + " expects an integer >= " + std::to_string(min) + " (got '" + value + "')");
  }
  return v;
}

inline double parse_double_flag(const std::string& name, const std::string& value, double min) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != value.size() || value.empty() || !(v >= min)) {
    throw std::invalid_argument(name + " expects a number >= " + std::to_string(min) + " (got '" + value + "')");
  }
  return v;
}

}  // namespace fsdp::examples
