#include "fsdp_cpp/contract/fqn_snapshot.h"

#include <algorithm>
#include <sstream>
#include <unordered_set>

#include <c10/util/Exception.h>
#include <torch/nn/module.h>

namespace fsdp::contract {
namespace {

constexpr size_t kMaxListedFqns = 8;  // longer lists are cut with "... and N more"

std::string format_fqns(const std::vector<std::string>& fqns) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < fqns.size() && i < kMaxListedFqns; ++i) {
    out << (i == 0 ? "" : ", ") << fqns[i];
  }
  if (fqns.size() > kMaxListedFqns) {
    out << ", ... and " << fqns.size() - kMaxListedFqns << " more";
  }
  out << "]";
  return out.str();
}

std::vector<std::string> missing_from(const std::vector<std::string>& fqns,
                                      const std::vector<std::string>& other) {
  const std::unordered_set<std::string> present(other.begin(), other.end());
  std::vector<std::string> missing;
  for (const auto& fqn : fqns) {
    if (present.count(fqn) == 0) {
      missing.push_back(fqn);
    }
  }
  return missing;
}

// Describes how one kind of FQN changed ("" when it did not).
std::string describe_change(std::string_view kind, const std::vector<std::string>& before,
                            const std::vector<std::string>& after) {
  if (before == after) {
    return "";
  }
  const std::vector<std::string> added = missing_from(after, before);
  const std::vector<std::string> removed = missing_from(before, after);
  std::ostringstream out;
  if (!added.empty() || !removed.empty()) {
    out << kind;
    if (!added.empty()) {
      out << " added " << format_fqns(added);
    }
    if (!removed.empty()) {
      out << (added.empty() ? "" : ",") << " removed " << format_fqns(removed);
    }
    return out.str();
  }
  // Same names, other order (or the same name listed another number of times).
  const auto [old_it, new_it] = std::mismatch(before.begin(), before.end(), after.begin(), after.end());
  const size_t position = static_cast<size_t>(old_it - before.begin());
  out << kind << " reordered: at position " << position << " expected '"
      << (old_it == before.end() ? "<end>" : *old_it) << "', got '"
      << (new_it == after.end() ? "<end>" : *new_it) << "' (before " << format_fqns(before)
      << ", after " << format_fqns(after) << ")";
  return out.str();
}

}  // namespace

ModuleFqns snapshot_fqns(const torch::nn::Module& module) {
  ModuleFqns fqns;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    fqns.parameters.push_back(item.key());
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    fqns.buffers.push_back(item.key());
  }
  for (const auto& item : module.named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    fqns.submodules.push_back(item.key());
  }
  return fqns;
}

void check_fqns_unchanged(std::string_view api, std::string_view module_description,
                          const ModuleFqns& before, const ModuleFqns& after) {
  if (before == after) {
    return;
  }
  std::string changes;
  for (const std::string& change :
       {describe_change("parameters", before.parameters, after.parameters),
        describe_change("buffers", before.buffers, after.buffers),
        describe_change("submodules", before.submodules, after.submodules)}) {
    if (!change.empty()) {
      changes += (changes.empty() ? "" : "; ") + change;
    }
  }
  TORCH_CHECK(false, api, ": cannot modify FQNs of module ", module_description,
              ": expected the same parameter, buffer and submodule FQNs in the same order before "
              "and after ", api, ", got: ", changes,
              ". Hint: a composable API must keep the module tree and its names; replace "
              "parameter storage with set_data() instead of registering new parameters or "
              "modules");
}

}  // namespace fsdp::contract
