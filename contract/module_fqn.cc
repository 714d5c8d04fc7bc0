#include "fsdp_cpp/contract/module_fqn.h"

#include <torch/nn/module.h>

namespace fsdp::contract {

std::optional<std::string> find_module_fqn(const torch::nn::Module& root,
                                           const torch::nn::Module& target) {
  if (&root == &target) {
    return std::string();
  }
  // include_self=false: named_modules() would otherwise need `root` to be owned by a shared_ptr.
  for (const auto& item : root.named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    if (item.value().get() == &target) {
      return item.key();
    }
  }
  return std::nullopt;
}

std::string display_fqn(std::string_view fqn) {
  return fqn.empty() ? std::string(kRootFqn) : std::string(fqn);
}

std::string join_fqn(std::string_view prefix, std::string_view name) {
  if (prefix.empty()) return std::string(name);
  if (name.empty()) return std::string(prefix);
  return std::string(prefix) + "." + std::string(name);
}

std::string describe_module(std::string_view fqn, const torch::nn::Module& module) {
  return "'" + display_fqn(fqn) + "' (" + module.name() + ")";
}

}  // namespace fsdp::contract
