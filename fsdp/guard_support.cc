#include "fsdp_cpp/fsdp/guard_support.h"

#include <algorithm>
#include <sstream>
#include <unordered_set>

#include <torch/nn/module.h>

#include "fsdp_cpp/fsdp/fsdp_state.h"
#include "fsdp_cpp/fsdp/root_context.h"

namespace fsdp::guard {

std::string unit_name(const FSDPState& unit) { return "'" + unit.fqn() + "'"; }

std::unordered_map<const void*, ManagedParam> managed_params(const RootContext& context) {
  std::unordered_map<const void*, ManagedParam> params;
  for (const FSDPState* state : context.states()) {
    for (const auto& handle : state->handles()) {
      for (size_t i = 0; i < handle->params().size(); ++i) {
        const auto& p = handle->params()[i];
        params[p.param.unsafeGetTensorImpl()] =
            ManagedParam{state->is_root() ? p.fqn : state->fqn() + "." + p.fqn, 0, state,
                         handle->layout().entries[i].shape};
      }
    }
  }
  std::unordered_set<const void*> named;
  for (const auto& item : context.root()->module().named_parameters()) {
    const void* impl = item.value().unsafeGetTensorImpl();
    const auto it = params.find(impl);
    if (it != params.end() && named.insert(impl).second) {
      it->second.fqn = item.key();
      it->second.order = named.size() - 1;
    }
  }
  for (auto& [impl, info] : params) {
    if (!named.count(impl)) info.order = named.size();  // unnamed ones last
  }
  return params;
}

bool ran_forward(const RootContext& context, const FSDPState& unit) {
  return context.iteration_state().ran_forward(unit);
}

std::string exchange_findings(const RootContext& context, const std::vector<std::string>& mine,
                              const char* what) {
  std::string joined;
  for (size_t i = 0; i < mine.size() && i < kMaxListed; ++i) joined += (i == 0 ? "" : "; ") + mine[i];
  if (mine.size() > kMaxListed) joined += "; and " + std::to_string(mine.size() - kMaxListed) + " more";
  const auto all = context.comm()->all_gather_bytes(std::vector<uint8_t>(joined.begin(), joined.end()), what);
  std::ostringstream message;
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty()) continue;
    message << "\n  rank " << r << ": " << std::string(all[r].begin(), all[r].end());
  }
  return message.str();
}

}  // namespace fsdp::guard
