#pragma once
// The units (fully_shard states) of a module tree: the one walk that lazy initialisation, state
// dicts, gradient clipping and the FSDPModule setters share.

#include <memory>
#include <string>
#include <vector>

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace fsdp {

class FSDPState;

struct UnitInTree {
  std::string fqn;  // of the module, relative to the walk's root ("" for the root itself)
  torch::nn::Module* module = nullptr;
  std::shared_ptr<FSDPState> state;
};

/// Every module of `root`'s tree that fully_shard made (part of) a unit, in named_modules order
/// (pre-order); `root` itself only with `include_root`. A unit of several sibling modules appears
/// once per module.
std::vector<UnitInTree> units_in_tree(torch::nn::Module& root, bool include_root = true);

/// The distinct units of `root`'s tree (a unit of siblings once), in the order of their first
/// module.
std::vector<std::shared_ptr<FSDPState>> distinct_units_in_tree(torch::nn::Module& root,
                                                               bool include_root = true);

/// A unit whose module contains one of `unit`'s modules (so `unit` is not a root), or null when
/// `unit` is a root. After the root's first forward (lazy initialisation) from the root context;
/// before it, from the units registered so far (fully_shard is applied bottom-up, so a unit above
/// exists once its fully_shard ran).
const FSDPState* enclosing_unit(const FSDPState& unit);

}  // namespace fsdp
