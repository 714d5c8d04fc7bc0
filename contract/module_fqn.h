#pragma once

// Fully qualified names (FQNs) of modules inside a module tree, for lookups and error messages.

#include <optional>
#include <string>
#include <string_view>

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace fsdp::contract {

/// How error messages show the FQN of a module relative to itself (its FQN is the empty string).
inline constexpr std::string_view kRootFqn = "<root>";

/// Returns the fully qualified name of `target` inside the tree of `root`: "" when `target` is
/// `root` itself, "blocks.0.attn" for a nested submodule, std::nullopt when `target` is not in
/// `root`'s tree. Modules are compared by identity. A module registered under two names reports the
/// first one in `root.named_modules()` order.
///
///   auto fqn = fsdp::contract::find_module_fqn(*model, *model->blocks[0]);  // "blocks.0"
std::optional<std::string> find_module_fqn(const torch::nn::Module& root,
                                           const torch::nn::Module& target);

/// Renders an FQN for an error message: "<root>" for the empty FQN, else the FQN itself.
///
///   display_fqn("");            // "<root>"
///   display_fqn("blocks.0");    // "blocks.0"
std::string display_fqn(std::string_view fqn);

/// The FQN of `name` inside the module at `prefix` (either may be empty: the root, or the module
/// itself).
///
///   join_fqn("blocks.0", "attn");   // "blocks.0.attn"
///   join_fqn("", "head.weight");    // "head.weight"
std::string join_fqn(std::string_view prefix, std::string_view name);

/// Describes a module for an error message: its FQN in quotes and its class, as in
/// "'blocks.0' (BlockImpl)" or "'<root>' (ModelImpl)".
///
///   TORCH_CHECK(ok, "fully_shard: module ", describe_module("blocks.0", *block), " ...");
std::string describe_module(std::string_view fqn, const torch::nn::Module& module);

}  // namespace fsdp::contract
