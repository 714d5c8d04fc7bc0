#include "fsdp_cpp/fsdp/backward_reach.h"

#include <cstdint>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/fsdp/fsdp_state.h"
#include "fsdp_cpp/fsdp/root_context.h"

namespace fsdp::runtime {
namespace {

// FNV-1a over the units' positions in the tree, in forward order; 62 bits, so that its negation
// stays representable in the MAX all-reduce.
int64_t order_hash(const std::vector<int64_t>& positions) {
  uint64_t h = 1469598103934665603ULL;
  for (int64_t p : positions) {
    h ^= static_cast<uint64_t>(p + 1);
    h *= 1099511628211ULL;
  }
  return static_cast<int64_t>(h >> 2);
}

std::string name_of(const FSDPState& unit) { return unit.fqn().empty() ? "<root>" : unit.fqn(); }

std::string unit_list(const std::vector<FSDPState*>& units) {
  std::string s;
  for (const FSDPState* u : units) s += (s.empty() ? "'" : ", '") + name_of(*u) + "'";
  return s.empty() ? "none" : s;
}

}  // namespace

bool runs_in_current_pass(const RootContext& context, torch::autograd::Node* node) {
  if (torch::autograd::get_current_graph_task_id() != context.reductions().graph_task()) return true;
  const auto* nodes = torch::autograd::get_current_graph_task_nodes_in_graph();
  if (nodes == nullptr) return true;
  if (nodes->count(node) == 0) return false;
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  if (exec_info == nullptr || exec_info->empty()) return true;
  const auto it = exec_info->find(node);
  return it != exec_info->end() && it->second.should_execute();
}

void agree_backward_reach(RootContext& context) {
  const std::vector<FSDPState*>& units = context.states();
  const std::vector<FSDPState*>& order = context.iteration_state().forward_order();
  const size_t n = units.size();
  std::unordered_map<const FSDPState*, int64_t> position;
  for (size_t i = 0; i < n; ++i) position[units[i]] = static_cast<int64_t>(i);

  // [reached here (n), -reached here (n), order hash, -order hash, controls hash (n), -controls
  // hash (n)], reduced with MAX: the first half says whether any rank reaches each unit, the
  // second whether every rank does; a hash and its negation agree only where every rank has the
  // same value.
  at::Tensor fields = at::empty({static_cast<int64_t>(4 * n + 2)}, at::kLong);
  int64_t* f = fields.data_ptr<int64_t>();
  for (size_t i = 0; i < n; ++i) {
    const UnitIteration& it = units[i]->iteration();
    const int64_t here = it.may_get_gradients() && it.reached_in_pass([&](torch::autograd::Node* node) { return runs_in_current_pass(context, node); }) ? 1 : 0;
    f[i] = here;
    f[n + i] = -here;
    // Kept by the unit's setters (FSDPState::controls_hash): no line formatted per unit per pass.
    const int64_t controls = units[i]->controls_hash();
    f[2 * n + 2 + i] = controls;
    f[3 * n + 2 + i] = -controls;
  }
  std::vector<int64_t> ran;
  ran.reserve(order.size());
  for (const FSDPState* u : order) ran.push_back(position.at(u));
  const int64_t hash = order_hash(ran);
  f[2 * n] = hash;
  f[2 * n + 1] = -hash;

  const auto& comm = context.comm();
  const auto& replicate = context.root()->config().replicate;
  for (comm::Communicator* group : {comm.get(), replicate.get()}) {
    if (group == nullptr || group->size() == 1) continue;
    at::Tensor on_device = fields.to(group->device());  // tiny; read on the host right away
    group->all_reduce(on_device, c10d::ReduceOp::MAX, "backward reach").wait();
    fields.copy_(on_device);
  }
  TORCH_CHECK(f[2 * n] == -f[2 * n + 1], "fully_shard: the ranks ran different units in the forward of "
              "iteration ", context.iteration_state().iterations(), " (this rank ran ", order.size(), " of the ",
              n, " units of root '", context.root()->fqn(), "', in this order: ", unit_list(order),
              "). Every rank must run the same units in the same order: a unit called on some ranks "
              "only, e.g. an expert that got no tokens or a tower whose input is absent on some ranks, "
              "must still be called on every rank (with an empty batch). Rerun with FSDP_DEBUG=1 to "
              "have the ranks compare every step.");
  for (size_t i = 0; i < n; ++i) {
    if (f[2 * n + 2 + i] == -f[3 * n + 2 + i]) continue;
    // Every rank saw the same reduced fields, so every rank is here, at the same unit: one more
    // exchange (per group) gives every rank each rank's settings for the message.
    const std::string mine = units[i]->controls_string();
    std::ostringstream message;
    message << "fully_shard: the ranks set different controls on unit '" << name_of(*units[i]) << "' for the backward "
            << "pass of iteration " << context.iteration_state().iterations() << "; nothing was reduced. They decide "
            << "which collectives the unit issues, so every rank must set them alike "
            << "(FSDPModule::set_requires_gradient_sync, set_gradient_divide_factor, set_requires_all_reduce, "
            << "set_unshard_in_backward, set_reshard_after_backward, and FullyShardOptions' all_gather_codec and "
            << "reduce_codec), and every rank must discard the unit's accumulated gradients alike "
            << "(FSDPModule::zero_grad dropped gradients of passes not yet reduced on some ranks only: call it on "
            << "every rank, [Note: discarding accumulated gradients] in fsdp/zero_grad.h):";
    for (comm::Communicator* group : {comm.get(), replicate.get()}) {
      if (group == nullptr || group->size() == 1) continue;
      const auto all = group->all_gather_bytes(std::vector<uint8_t>(mine.begin(), mine.end()), "backward reach controls");
      const char* label = group == comm.get() ? "rank " : "replica ";
      for (size_t r = 0; r < all.size(); ++r) {
        message << "\n  " << label << r << ": " << std::string(all[r].begin(), all[r].end());
      }
    }
    TORCH_CHECK(false, message.str());
  }
  for (size_t i = 0; i < n; ++i) {
    const bool any = f[i] > 0;
    const bool every = -f[n + i] > 0;
    units[i]->iteration().set_pass_reach(every ? PassReach::kEveryRank
                                               : any ? PassReach::kSomeRanks : PassReach::kNowhere);
  }
}

}  // namespace fsdp::runtime
