#include "fsdp_cpp/fsdp/sharded_use_guard.h"

#include <algorithm>
#include <memory>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include "fsdp_cpp/contract/forward_values.h"
#include "fsdp_cpp/contract/module_fqn.h"
#include "fsdp_cpp/contract/module_state.h"
#include "fsdp_cpp/contract/shape_text.h"
#include "fsdp_cpp/fsdp/fsdp_state.h"
#include "fsdp_cpp/fsdp/guard_support.h"
#include "fsdp_cpp/fsdp/root_context.h"

namespace fsdp {

using contract::shape_string;
using guard::exchange_findings;
using guard::managed_params;
using guard::ran_forward;
using guard::unit_name;

std::vector<std::string> find_params_used_while_sharded(const std::vector<at::Tensor>& outputs,
                                                        const RootContext& context) {
  const auto params = managed_params(context);
  std::vector<std::pair<size_t, std::string>> found;  // (parameter order, line)
  std::unordered_set<const void*> reported;
  std::unordered_set<const torch::autograd::Node*> visited;
  std::vector<torch::autograd::Node*> stack;
  for (const auto& out : outputs) {
    if (out.defined() && out.grad_fn()) stack.push_back(out.grad_fn().get());
  }
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (!visited.insert(node).second) continue;
    if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      const void* impl = acc->variable.unsafeGetTensorImpl();
      const auto it = params.find(impl);
      if (it != params.end()) {
        const auto used_shape = acc->input_metadata(0).shape_as_dim_vector();
        bool same = used_shape.size() == it->second.shape.size();
        for (size_t d = 0; same && d < used_shape.size(); ++d) {
          same = used_shape[d].maybe_as_int() == std::optional<int64_t>(it->second.shape[d]);
        }
        if (!same && reported.insert(impl).second) {
          const FSDPState& unit = *it->second.unit;
          std::ostringstream line;
          line << it->second.fqn << " (used with shape " << used_shape << ", expected "
               << shape_string(it->second.shape) << "; unit " << unit_name(unit)
               << (ran_forward(context, unit) ? ", read outside its forward"
                                              : ", whose pre-forward did not run")
               << ")";
          found.emplace_back(it->second.order, line.str());
        }
      }
      continue;
    }
    for (const auto& edge : node->next_edges()) {
      if (edge.function) stack.push_back(edge.function.get());
    }
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> lines;
  for (auto& [order, line] : found) lines.push_back(std::move(line));
  return lines;
}

void check_no_sharded_use(const std::vector<at::Tensor>& outputs, const RootContext& context) {
  const std::string found =
      exchange_findings(context, find_params_used_while_sharded(outputs, context), "sharded use check");
  TORCH_CHECK(found.empty(),
              "fully_shard: parameters were used in the forward while sharded (their unit's "
              "forward hooks did not run around the use, so they were 1-D views of this rank's "
              "shard, and results would be silently wrong):", found,
              "\nCall managed modules through their hook-able holder (`module(x)`, not "
              "`module->forward(x)`), use fsdp::contract::Sequential instead of "
              "torch::nn::Sequential, and do not read a child unit's parameters from its parent "
              "(make the parent one unit with the child).");
}

bool hides_params_outside_forward(const RootContext& context) { return !context.iteration_state().checked_sharded_use(); }

void hide_params(FSDPState& unit) {
  for (const auto& handle : unit.handles()) {
    if (handle->is_unsharded()) continue;  // full views: a use outside the forward is correct
    for (const auto& p : handle->params()) unit.hidden_params().hide(p.param);
  }
}

void show_params(FSDPState& unit) { unit.hidden_params().show_all(); }

void show_all_params(const RootContext& context) {
  for (FSDPState* unit : context.states()) {
    if (!unit->hidden_params().empty()) show_params(*unit);
  }
}

}  // namespace fsdp
