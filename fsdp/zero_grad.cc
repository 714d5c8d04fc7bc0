#include "fsdp_cpp/fsdp/zero_grad.h"

#include <algorithm>
#include <memory>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/nn/module.h>

#include "fsdp_cpp/contract/forward_hooks.h"
#include "fsdp_cpp/fsdp/backward.h"
#include "fsdp_cpp/fsdp/fsdp_state.h"
#include "fsdp_cpp/fsdp/root_context.h"
#include "fsdp_cpp/fsdp/unit_tree.h"

namespace fsdp::runtime {
namespace {

std::string name_of(const FSDPState& unit) { return unit.fqn().empty() ? "<root>" : unit.fqn(); }

// `unit` and the distinct units inside its modules, `unit` first.
std::vector<FSDPState*> units_of(FSDPState& unit) {
  std::vector<FSDPState*> units{&unit};
  for (torch::nn::Module* module : unit.modules()) {
    for (const auto& inner : distinct_units_in_tree(*module, /*include_root=*/false)) {
      if (std::find(units.begin(), units.end(), inner.get()) == units.end()) units.push_back(inner.get());
    }
  }
  return units;
}

// Refusals, before anything changes: a forward or backward of the tree running now, a
// SummonFullParams scope holding a unit's full parameters (and gradients).
void check_can_discard(const FSDPState& unit, const std::vector<FSDPState*>& units,
                       const std::vector<RootContext*>& contexts, const std::string& api) {
  for (const RootContext* context : contexts) {
    const IterationState& iteration = context->iteration_state();
    // A backward pass that threw leaves the phase at kBackward; one that runs is this thread's
    // current graph task (the hooks run inside it).
    TORCH_CHECK(iteration.phase() != IterationPhase::kBackward || torch::autograd::get_current_graph_task_id() == -1,
                api, ": unit '", name_of(unit), "' was asked to discard its gradients in the middle of a backward pass "
                "of root '", name_of(*context->root()), "' (from a hook or an autograd function); the pass is "
                "accumulating and reducing them. Expected a call between steps, after backward returned (or threw)");
    TORCH_CHECK(!iteration.in_root_forward() || contract::hooked_forward_depth() == 0, api, ": unit '",
                name_of(unit), "' was asked to discard its gradients in the middle of a forward of root '",
                name_of(*context->root()), "'. Expected a call between steps, outside the model's forward");
  }
  for (const FSDPState* u : units) {
    TORCH_CHECK(!u->full_params_summoned(), api, ": unit '", name_of(*u), "' has its full parameters (and "
                "gradients) held by a SummonFullParams scope; expected no scope open on the units of '",
                name_of(unit), "': leave the scope first");
  }
}

// A forward or backward that threw, or an iteration left open ([Note: open iterations]): abandoned
// as the next root forward abandons a throw, and its graphs made an earlier iteration's.
void abandon_interrupted_iteration(RootContext& context) {
  IterationState& iteration = context.iteration_state();
  if (context.passthrough()) {
    if (iteration.phase() == IterationPhase::kBackward) discard_passthrough_backward(context);
    return;
  }
  const bool threw = iteration.in_root_forward() || iteration.phase() == IterationPhase::kBackward;
  if (!threw && !context.iteration_left_open()) return;
  discard_iteration(context);
  iteration.begin_iteration();  // a new generation: hooks of the abandoned graphs are refused
}

}  // namespace

void zero_grad(FSDPState& unit, bool set_to_none, const std::string& api) {
  const std::vector<FSDPState*> units = units_of(unit);
  std::vector<RootContext*> contexts;
  for (FSDPState* u : units) {
    RootContext* context = u->root_context();
    if (context && std::find(contexts.begin(), contexts.end(), context) == contexts.end()) contexts.push_back(context);
  }
  check_can_discard(unit, units, contexts, api);
  for (RootContext* context : contexts) abandon_interrupted_iteration(*context);
  for (FSDPState* u : units) {
    bool dropped = false;
    for (const auto& handle : u->handles()) dropped |= handle->discard_accumulated_gradients();
    if (dropped) u->count_gradient_discard();
  }
  for (torch::nn::Module* module : unit.modules()) module->zero_grad(set_to_none);
}

}  // namespace fsdp::runtime
