#pragma once

// The FQN half of the composable contract: an API may not add, remove, rename or reorder a
// module's parameters, buffers or submodules ("cannot modify FQNs").

#include <string>
#include <string_view>
#include <vector>

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace fsdp::contract {

/// The FQNs of a module's parameters, buffers and submodules, relative to the module, in
/// `named_parameters()` / `named_buffers()` / `named_modules()` order (the module itself is not a
/// submodule of itself).
///
///   ModuleFqns fqns = snapshot_fqns(*model);
///   fqns.parameters;   // {"embed.weight", "blocks.0.fc.weight", "blocks.0.fc.bias", ...}
struct ModuleFqns {
  std::vector<std::string> parameters;
  std::vector<std::string> buffers;
  std::vector<std::string> submodules;

  bool operator==(const ModuleFqns&) const = default;
};

/// Takes the FQN snapshot of `module`.
ModuleFqns snapshot_fqns(const torch::nn::Module& module);

/// Throws c10::Error if `after` differs from `before` in any FQN or in their order. The message
/// names `api`, the module (`module_description`, e.g. from describe_module()), and for each
/// kind the FQNs added and removed, or the first position where the order changed:
///
///   fully_shard: cannot modify FQNs of module '<root>' (ModelImpl): expected the same
///   parameter, buffer and submodule FQNs in the same order before and after fully_shard, got:
///   parameters added [fc.extra]; ...
///
///   check_fqns_unchanged("fully_shard", describe_module("", *model), before, snapshot_fqns(*model));
void check_fqns_unchanged(std::string_view api, std::string_view module_description,
                          const ModuleFqns& before, const ModuleFqns& after);

}  // namespace fsdp::contract
