#include "comm/issuing_api.h"

#include <utility>

namespace fsdp::comm {
namespace {
thread_local IssuingApi* t_innermost = nullptr;
}  // namespace

IssuingApi::IssuingApi(std::string label) : label_(std::move(label)), outer_(t_innermost) {
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

}  // namespace fsdp::comm
