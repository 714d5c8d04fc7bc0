#include "fsdp/sharded_use_guard.h"

#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <torch/nn/module.h>

#include "fsdp/fsdp_state.h"
#include "fsdp/root_context.h"

namespace fsdp {
namespace {

struct ManagedParam {
  std::string fqn;  // relative to the root
  std::vector<int64_t> shape;
};

}  // namespace

std::vector<std::string> find_params_used_while_sharded(const std::vector<at::Tensor>& outputs,
                                                        const RootContext& context) {
  std::unordered_map<const void*, std::vector<int64_t>> shapes;  // managed parameter -> full shape
  for (const FSDPState* state : context.states) {
    for (const auto& handle : state->handles()) {
      for (size_t i = 0; i < handle->params().size(); ++i) {
        shapes[handle->params()[i].param.unsafeGetTensorImpl()] = handle->layout().entries[i].shape;
      }
    }
  }
  std::unordered_map<const void*, ManagedParam> params;
  for (const auto& item : context.root->module().named_parameters()) {
    const void* impl = item.value().unsafeGetTensorImpl();
    const auto it = shapes.find(impl);
    if (it != shapes.end()) params.emplace(impl, ManagedParam{item.key(), it->second});
  }
  std::vector<std::string> found;
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
      const auto it = params.find(acc->variable.unsafeGetTensorImpl());
      if (it != params.end()) {
        const auto used_shape = acc->input_metadata(0).shape_as_dim_vector();
        bool same = used_shape.size() == it->second.shape.size();
        for (size_t d = 0; same && d < used_shape.size(); ++d) {
          same = used_shape[d].maybe_as_int() == std::optional<int64_t>(it->second.shape[d]);
        }
        if (!same) found.push_back(it->second.fqn);
      }
      continue;
    }
    for (const auto& edge : node->next_edges()) {
      if (edge.function) stack.push_back(edge.function.get());
    }
  }
  return found;
}

void check_no_sharded_use(const std::vector<at::Tensor>& outputs, const RootContext& context) {
  const auto found = find_params_used_while_sharded(outputs, context);
  std::string mine;
  for (const auto& fqn : found) mine += fqn + "\n";
  const auto all = context.comm->all_gather_bytes(std::vector<uint8_t>(mine.begin(), mine.end()),
                                                  "sharded use check");
  std::ostringstream message;
  bool any = false;
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty()) continue;
    any = true;
    std::string names(all[r].begin(), all[r].end());
    for (char& c : names) c = c == '\n' ? ' ' : c;
    message << "\n  rank " << r << ": " << names;
  }
  TORCH_CHECK(!any,
              "fully_shard: parameters were used in the forward while sharded (their module's "
              "forward hooks did not run, so they were 1-D shards, and results would be silently "
              "wrong):", message.str(),
              "\nCall managed modules through their hook-able holder (`module(x)`, not "
              "`module->forward(x)`), use fsdp::contract::Sequential instead of "
              "torch::nn::Sequential, and do not read a child unit's parameters from its parent "
              "(make the parent one unit with the child).");
}

}  // namespace fsdp
