#pragma once
// Tied parameters: one tensor registered by several modules (an embedding tied to the output
// projection, a weight shared by several layers).
//
// [Note: tied parameters] A tied parameter belongs to the innermost unit whose module trees contain
// every module that registers it: any other unit would compute on it while the unit owning it has
// resharded it. That unit is only known once fully_shard reaches a module containing all of them,
// so placement follows fully_shard, bottom-up:
//   - fully_shard(M) takes a parameter no unit manages yet (as every parameter);
//   - a parameter another unit U manages stays in U when U contains every module of M's trees
//     that registers it, or when U has registrants outside M's trees (only a later unit around
//     both can own it: `fully_shard(head)` leaves an embedding's weight with the embedding's unit);
//   - otherwise M contains every registrant known so far (U's and its own) and no unit inside M
//     does: M takes the parameter over from U. Both FlatParameters are rebuilt from the
//     full-precision values (all-gathered: collective, every rank calls fully_shard alike); values
//     and gradients move with the parameter, shards and gradients keep the parameters' dtype
//     whatever the mixed precision.
// Guarantee: once fully_shard has been applied to the outermost unit (the root), no parameter
// changes unit, shape or dtype again, so an optimizer built, stepped or loaded after the root's
// fully_shard (before or after the first forward) matches the parameters for good. Optimizer state
// created between the first and the last fully_shard call is not remapped.
// At the root's first forward, lazy initialisation checks the result: a parameter shared with a
// unit outside the root's tree (no unit contains every module using it, e.g. fully_shard on the
// embedding and on the head but not on the model) is an error naming both modules and asking for
// fully_shard on a module containing both.

#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <ATen/core/Tensor.h>

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace fsdp {

class FSDPState;
class RootContext;

/// What fully_shard does with the parameters of a new unit's module trees that other units
/// already manage (decided before anything changes).
struct TiedParameterPlan {
  /// Parameters (TensorImpl*) the new unit must not take: they stay with the unit managing them.
  std::unordered_set<const void*> stay;
  /// Parameters the new unit takes over, with the unit they leave, in named_parameters order.
  struct Move {
    const void* param;
    std::shared_ptr<FSDPState> from;
  };
  std::vector<Move> moves;
};

/// Decides, for the new unit over `modules` (named `unit_fqn` in errors), which managed parameters
/// stay where they are and which move into it ([Note: tied parameters]). Changes nothing and
/// communicates nothing; throws (naming the modules and what to change) when a unit that must
/// give a parameter up cannot: it is unsharded, or in the middle of an iteration.
TiedParameterPlan plan_tied_parameters(const std::vector<torch::nn::Module*>& modules,
                                       const std::string& unit_fqn);

/// Carries out the moves of `plan`: every parameter moving gets its full-precision value (and its
/// full gradient, if it has one) back, ready for the new unit's FlatParameters; the units it
/// leaves are rebuilt over their other parameters. Collective (all-gathers of the units it
/// leaves); no-op without moves.
void take_tied_parameters(const TiedParameterPlan& plan);

/// The module FQNs (relative to the root) that make up each unit of the root's tree.
using UnitModuleFqns = std::unordered_map<FSDPState*, std::vector<std::string>>;

/// Lazy initialisation's check of [Note: tied parameters]: every parameter registered in the
/// root's tree is managed by a unit of that tree containing every module that registers it, and no
/// parameter of the tree is registered by a module of another unit's tree outside it. On failure
/// the units' root context is reset (the next forward checks again) and the error names the
/// parameter, the modules and the fully_shard call to add. Changes no parameter; no collective.
void place_tied_parameters(RootContext& context, const UnitModuleFqns& unit_fqns);

/// One module registering a parameter: the module's FQN and the parameter's, relative to a root.
struct ParameterUse {
  std::string module_fqn;
  std::string param_fqn;
};

/// A parameter of a root's tree with every module registering it (several: a tied parameter).
struct RegisteredParameter {
  at::Tensor param;
  std::vector<ParameterUse> uses;  // named_modules order; uses.front() names the parameter
};

/// Every parameter registered in `root`'s tree (the root included), once per tensor, in
/// named_modules order. Pure: reads the tree only.
std::vector<RegisteredParameter> registered_parameters(torch::nn::Module& root);

/// [Note: tied parameters]: the unit managing a parameter must contain every module using it. The
/// first of `uses` whose module is in none of `unit_module_fqns` (FQNs relative to the same root,
/// "" for the root), or null when the unit contains them all. Pure.
const ParameterUse* use_outside_unit(const std::vector<ParameterUse>& uses,
                                     const std::vector<std::string>& unit_module_fqns);

}  // namespace fsdp
