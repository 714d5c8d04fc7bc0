#include "fsdp_cpp/comm/issuing_api.h"

#include <utility>

namespace fsdp::comm {
namespace {
thread_local IssuingApi* t_innermost = nullptr;
}  // namespace

IssuingApi::IssuingApi(std::string label, std::string tag)
    : label_(std::move(label)), tag_(std::move(tag)), outer_(t_innermost) {
  t_innermost = this;
}

// Scopes are objects on the stack, so they end innermost first.
IssuingApi::~IssuingApi() { t_innermost = outer_; }

std::string IssuingApi::current() {
  std::string joined;
  for (const IssuingApi* scope = t_innermost; scope != nullptr; scope = scope->outer_) {
    if (scope->label_.empty()) continue;
    joined = joined.empty() ? scope->label_ : scope->label_ + " > " + joined;
  }
  return joined;
}

const std::string& IssuingApi::current_tag() {
  static const std::string kNone;
  for (const IssuingApi* scope = t_innermost; scope != nullptr; scope = scope->outer_) {
    if (!scope->tag_.empty()) return scope->tag_;
  }
  return kNone;
}

}  // namespace fsdp::comm
