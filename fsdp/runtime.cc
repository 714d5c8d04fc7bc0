#include "fsdp/runtime.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <unordered_map>

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/nn/module.h>

#include "contract/module_fqn.h"
#include "contract/module_state.h"
#include "fsdp/fsdp_state.h"
#include "fsdp/post_backward_function.h"
#include "fsdp/root_context.h"
#include "fsdp/sharded_use_guard.h"

namespace fsdp::runtime {
namespace {

std::string join_fqn(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : name.empty() ? prefix : prefix + "." + name;
}

// Whether the module at `fqn` is `ancestor_fqn` or inside it.
bool within(const std::string& fqn, const std::string& ancestor_fqn) {
  if (ancestor_fqn.empty()) return true;
  return fqn == ancestor_fqn ||
         (fqn.size() > ancestor_fqn.size() && fqn.compare(0, ancestor_fqn.size(), ancestor_fqn) == 0 &&
          fqn[ancestor_fqn.size()] == '.');
}

// Unsharding through the root's context keeps at most `max_in_flight` all-gathers in flight:
// issuing one more first waits for the oldest.
void complete_unshard(RootContext& context, FSDPState* unit) {
  unit->unshard();
  auto& in_flight = context.unshards_in_flight;
  in_flight.erase(std::remove(in_flight.begin(), in_flight.end(), unit), in_flight.end());
}

void issue_unshard(RootContext& context, FSDPState* unit) {
  if (unit->is_unsharded() || unit->unshard_in_flight()) return;
  while (static_cast<int>(context.unshards_in_flight.size()) >= context.max_in_flight) {
    complete_unshard(context, context.unshards_in_flight.front());
  }
  unit->start_unshard();
  if (unit->unshard_in_flight()) context.unshards_in_flight.push_back(unit);
}

void reshard_unit(RootContext& context, FSDPState* unit) {
  unit->reshard();  // waits for an all-gather in flight first
  auto& in_flight = context.unshards_in_flight;
  in_flight.erase(std::remove(in_flight.begin(), in_flight.end(), unit), in_flight.end());
}

// The units `unit` prefetches: its explicit list if set, else the one next to it in `order`
// (+1: forward, the unit that ran after it; -1: backward, the one that ran before it).
std::vector<FSDPState*> prefetch_targets(const FSDPState& unit,
                                         const std::optional<std::vector<FSDPState*>>& explicit_targets,
                                         const std::vector<FSDPState*>& order, int direction) {
  if (explicit_targets) return *explicit_targets;
  const auto it = std::find(order.begin(), order.end(), &unit);
  if (it == order.end()) return {};
  const auto index = (it - order.begin()) + direction;
  if (index < 0 || index >= static_cast<std::ptrdiff_t>(order.size())) return {};
  return {order[static_cast<size_t>(index)]};
}

// [Note: tied parameters] A parameter registered by several modules (an embedding tied to the
// output projection) belongs to the innermost unit that contains every module registering it:
// otherwise one unit would compute on a parameter another unit has resharded. fully_shard gives
// it to the first unit applied (bottom-up, the innermost one containing one registrant); lazy
// initialisation moves it where it belongs, rebuilding both units' FlatParameters (every rank does
// the same, so the all-gathers this takes match).
void place_tied_parameters(RootContext& context,
                           const std::unordered_map<FSDPState*, std::vector<std::string>>& unit_fqns) {
  torch::nn::Module& root = context.root->module();
  std::unordered_map<const void*, std::vector<std::string>> registrants;  // module FQNs
  std::unordered_map<const void*, std::string> first_name;                // parameter FQN
  for (const auto& item : root.named_modules("", /*include_self=*/true)) {
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false)) {
      const void* impl = p.value().unsafeGetTensorImpl();
      registrants[impl].push_back(item.key());
      first_name.emplace(impl, join_fqn(item.key(), p.key()));
    }
  }
  // The innermost unit containing module `fqn`, and how deep its module is.
  auto containing_depth = [&](FSDPState* unit, const std::string& fqn) -> int {
    int best = -1;
    for (const auto& m : unit_fqns.at(unit)) {
      if (within(fqn, m)) best = std::max(best, static_cast<int>(m.size()) + (m.empty() ? 0 : 1));
    }
    return best;
  };
  std::map<FSDPState*, std::vector<const void*>> moves_out;
  std::map<FSDPState*, std::vector<const void*>> moves_in;
  for (FSDPState* owner : context.states) {
    for (const auto& p : owner->params()) {
      const void* impl = p.param.unsafeGetTensorImpl();
      const auto& modules = registrants[impl];
      if (modules.size() < 2) continue;
      FSDPState* target = nullptr;
      int target_depth = -1;
      for (FSDPState* unit : context.states) {
        int depth = INT32_MAX;
        for (const auto& m : modules) depth = std::min(depth, containing_depth(unit, m));
        if (depth > target_depth) {
          target_depth = depth;
          target = unit;
        }
      }
      TORCH_CHECK(target != nullptr && target_depth >= 0, "fully_shard: parameter '",
                  first_name[impl], "' is registered by '", modules.front(), "' and by '",
                  modules.back(), "', and no unit contains both: apply fully_shard to a module "
                  "that contains every module using the parameter");
      if (target != owner) {
        moves_out[owner].push_back(impl);
        moves_in[target].push_back(impl);
      }
    }
  }
  if (moves_out.empty()) return;
  // Full values for every affected unit, then rebuilt FlatParameters.
  std::vector<FSDPState*> affected;
  for (auto& [unit, _] : moves_out) affected.push_back(unit);
  for (auto& [unit, _] : moves_in) {
    if (!moves_out.count(unit)) affected.push_back(unit);
  }
  std::sort(affected.begin(), affected.end(), [&](FSDPState* a, FSDPState* b) {
    return std::find(context.states.begin(), context.states.end(), a) <
           std::find(context.states.begin(), context.states.end(), b);
  });
  std::unordered_map<const void*, FlatParamHandle::OrigParam> moved;
  std::map<FSDPState*, std::vector<FlatParamHandle::OrigParam>> kept;
  for (FSDPState* unit : affected) unit->unshard();
  for (FSDPState* unit : affected) {
    std::vector<FlatParamHandle::OrigParam> keep;
    for (auto& p : unit->params()) {
      const void* impl = p.param.unsafeGetTensorImpl();
      const auto& out = moves_out[unit];
      // Full values of their own, independent of the buffer about to be rebuilt.
      p.param.set_data(p.param.detach().clone());
      if (std::find(out.begin(), out.end(), impl) != out.end()) {
        moved.emplace(impl, p);
      } else {
        keep.push_back(p);
      }
    }
    kept[unit] = std::move(keep);
  }
  for (FSDPState* unit : affected) {
    auto params = std::move(kept[unit]);
    for (const void* impl : moves_in[unit]) {
      auto p = moved.at(impl);
      p.fqn = first_name[impl];  // relative to the unit's module below
      for (const auto& m : unit_fqns.at(unit)) {
        if (!m.empty() && within(p.fqn, m)) p.fqn = p.fqn.substr(m.size() + 1);
      }
      params.push_back(p);
    }
    unit->rebuild_handles(params);
  }
}

// Lazy initialisation in the root's first pre-forward: the root is the managed module with no
// managed ancestor; every managed module in its tree shares its context.
void lazy_init(FSDPState& state) {
  auto& registry = contract::ModuleStateRegistry::global();
  for (const auto& other : registry.modules_with(kFullyShardApi)) {
    if (other.get() == &state.module()) continue;
    if (contract::find_module_fqn(*other, state.module()).has_value()) {
      TORCH_CHECK(false, "fully_shard: module ", registry.describe(state.module()),
                  " ran its forward before its root ", registry.describe(*other),
                  " did: the root's first forward initialises every unit inside it. Call the "
                  "root module (the outermost one fully_shard was applied to) first.");
    }
  }
  auto context = std::make_shared<RootContext>();
  context->root = &state;
  context->comm = state.config().comm;
  context->max_in_flight = std::max(1, state.config().max_unshards_in_flight);
  std::unordered_map<FSDPState*, std::vector<std::string>> unit_fqns;
  for (const auto& item : state.module().named_modules("", /*include_self=*/true)) {
    auto unit = registry.get_as<FSDPState>(*item.value(), kFullyShardApi);
    if (!unit) continue;
    TORCH_CHECK(unit->config().comm == context->comm, "fully_shard: unit ",
                registry.describe(*item.value()),
                " uses another communicator than its root; every unit of one model must use the "
                "same one");
    auto& names = unit_fqns[unit.get()];
    if (names.empty()) context->states.push_back(unit.get());  // siblings: one unit, several modules
    names.push_back(item.key());
  }
  for (FSDPState* unit : context->states) {
    unit->set_root_context(context);
    std::string name;
    for (const auto& n : unit_fqns[unit]) name += (name.empty() ? "" : "+") + (n.empty() ? std::string("<root>") : n);
    unit->set_fqn(name);
  }
  place_tied_parameters(*context, unit_fqns);
}

// Ends an iteration in which no backward ran (or will run): every unit resharded and idle.
void end_iteration_without_backward(RootContext& context) {
  for (FSDPState* unit : context.states) {
    reshard_unit(context, unit);
    unit->set_training_state(TrainingState::kIdle);
  }
  context.previous_forward_order = context.forward_order;
  context.iteration_active = false;
  ++context.iterations;
}

void root_pre_forward(RootContext& context) {
  if (context.iteration_active) {
    // The previous forward's backward never came (e.g. evaluation with grad mode on).
    end_iteration_without_backward(context);
  }
  context.iteration_active = true;
  context.backward_started = false;
  context.forward_order.clear();
  context.reduced_from_back = 0;
  for (FSDPState* unit : context.states) {
    unit->pending_post_backward = 0;
    unit->forward_calls_without_post_backward = 0;
    unit->pre_backward_done = false;
    unit->reduced = false;
    unit->ran_forward = false;
    unit->post_forwards = 0;
  }
}

// First iteration: every rank must run the units in the same order (their collectives pair up by
// order). Exchanged before the unit's first all-gather, so a divergence is named, not a hang.
void check_forward_order(RootContext& context, const std::string& entry) {
  const auto all = context.comm->all_gather_bytes(std::vector<uint8_t>(entry.begin(), entry.end()),
                                                  "forward order check");
  bool same = true;
  for (const auto& e : all) same &= std::string(e.begin(), e.end()) == entry;
  if (same) return;
  std::ostringstream message;
  message << "fully_shard: the forward order differs across ranks in the first iteration (at unit #"
          << context.forward_order.size() << "):";
  for (size_t r = 0; r < all.size(); ++r) {
    const std::string e(all[r].begin(), all[r].end());
    message << "\n  rank " << r << ": "
            << (e.rfind("unit ", 0) == 0 ? "ran '" + e.substr(5) + "'" : "finished its forward");
  }
  message << "\nEvery rank must run the same units in the same order (their collectives pair up by "
             "order).";
  TORCH_CHECK(false, message.str());
}

// Reduce-scatters, in reverse forward order, every unit whose turn has come: with `final`, all of
// them; else only while the next one has finished its backward.
void reduce_in_order(RootContext& context, bool final) {
  const size_t n = context.forward_order.size();
  while (context.reduced_from_back < n) {
    FSDPState* unit = context.forward_order[n - 1 - context.reduced_from_back];
    if (!final && unit->training_state() != TrainingState::kPostBackward) break;
    for (const auto& handle : unit->handles()) handle->reduce_gradients(unit->requires_gradient_sync);
    unit->reduced = true;
    ++context.reduced_from_back;
  }
}

bool keeps_unsharded_after_backward(const FSDPState& unit) {
  return !unit.reshard_after_backward && !unit.requires_gradient_sync;
}

void end_of_backward(RootContext& context) {
  reduce_in_order(context, /*final=*/true);
  for (FSDPState* unit : context.forward_order) {
    for (const auto& handle : unit->handles()) handle->finalize_gradients();
  }
  for (FSDPState* unit : context.states) {
    if (!keeps_unsharded_after_backward(*unit)) reshard_unit(context, unit);
    unit->set_training_state(TrainingState::kIdle);
  }
  context.previous_forward_order = context.forward_order;
  context.iteration_active = false;
  ++context.iterations;
}

// Backward prefetch: the unit that ran before this one in forward runs its backward next.
void prefetch_for_backward(RootContext& context, const FSDPState& unit) {
  for (FSDPState* next : prefetch_targets(unit, unit.backward_prefetch_targets, context.forward_order, -1)) {
    if (!next->reduced && next->training_state() != TrainingState::kPostBackward) issue_unshard(context, next);
  }
}

void pre_backward(FSDPState& unit) {
  RootContext& context = *unit.root_context();
  if (!context.backward_started) {
    context.backward_started = true;
    torch::autograd::Engine::get_default_engine().queue_callback(
        [c = &context] { end_of_backward(*c); });
    for (FSDPState* ran : context.forward_order) {
      for (const auto& handle : ran->handles()) handle->prepare_gradients_for_backward();
    }
  }
  if (unit.pre_backward_done) return;
  unit.pre_backward_done = true;
  issue_unshard(context, &unit);
  complete_unshard(context, &unit);
  unit.set_training_state(TrainingState::kPreBackward);
  if (unit.config().backward_prefetch == BackwardPrefetch::kBackwardPre) prefetch_for_backward(context, unit);
}

void post_backward(void* arg) {
  FSDPState& unit = *static_cast<FSDPState*>(arg);
  // Another forward call's backward is to come, or one that cannot be seen ending.
  if (--unit.pending_post_backward > 0 || unit.forward_calls_without_post_backward > 0) return;
  if (unit.training_state() == TrainingState::kPostBackward) return;
  unit.set_training_state(TrainingState::kPostBackward);
  RootContext& context = *unit.root_context();
  if (!keeps_unsharded_after_backward(unit)) reshard_unit(context, &unit);
  reduce_in_order(context, /*final=*/false);
  // After this unit's gradient computation (and its reduce-scatter, once its turn came).
  if (unit.config().backward_prefetch == BackwardPrefetch::kBackwardPost) prefetch_for_backward(context, unit);
}

}  // namespace

void pre_forward(FSDPState& state, contract::ForwardArgs& args) {
  if (state.root_context() == nullptr) lazy_init(state);
  RootContext& context = *state.root_context();
  if (state.is_root()) root_pre_forward(context);
  TORCH_CHECK(context.iteration_active, "fully_shard: module ",
              contract::ModuleStateRegistry::global().describe(state.module()),
              " ran its forward outside a forward of its root; call the root module");
  if (!state.ran_forward) {
    if (context.iterations == 0) check_forward_order(context, "unit " + state.fqn());
    state.ran_forward = true;
    context.forward_order.push_back(&state);
  }
  issue_unshard(context, &state);
  // Forward prefetch: the unit that ran after this one in the previous iteration.
  if (state.config().forward_prefetch || state.forward_prefetch_targets) {
    for (FSDPState* next : prefetch_targets(state, state.forward_prefetch_targets,
                                            context.previous_forward_order, +1)) {
      if (!next->ran_forward) issue_unshard(context, next);
    }
  }
  complete_unshard(context, &state);
  state.set_training_state(TrainingState::kForward);
  if (const auto dtype = state.config().cast_forward_inputs_to) {
    for (auto& arg : args) {
      arg = contract::map_tensors(arg, [&](const at::Tensor& t) {
        return at::isFloatingType(t.scalar_type()) && t.scalar_type() != *dtype ? t.to(*dtype) : t;
      });
    }
  }

  if (!c10::GradMode::is_enabled()) return;
  std::vector<at::Tensor> needs_grad;
  for (const auto& arg : args) {
    contract::for_each_tensor(arg, [&](const at::Tensor& t) {
      if (t.requires_grad()) needs_grad.push_back(t);
    });
  }
  if (needs_grad.empty()) {
    ++state.forward_calls_without_post_backward;
    return;
  }
  std::vector<at::Tensor> routed = register_post_backward(needs_grad, &post_backward, &state);
  size_t next = 0;
  for (auto& arg : args) {
    arg = contract::map_tensors(arg, [&](const at::Tensor& t) {
      return t.requires_grad() ? routed[next++] : t;
    });
  }
  ++state.pending_post_backward;
}

void post_forward(FSDPState& state, c10::IValue& output) {
  RootContext& context = *state.root_context();
  // Siblings: reshard after the last of the unit's modules ran.
  const bool last_module = ++state.post_forwards % state.modules().size() == 0;
  if (!state.is_root() && state.config().reshard_after_forward && last_module) reshard_unit(context, &state);
  std::vector<at::Tensor> hooked;
  if (c10::GradMode::is_enabled()) {
    contract::for_each_tensor(output, [&](const at::Tensor& t) {
      if (!t.requires_grad()) return;
      t.register_hook([unit = &state](const at::TensorBase&) { pre_backward(*unit); });
      hooked.push_back(t);
    });
  }
  if (!state.is_root()) return;
  if (context.iterations == 0 && !context.checked_sharded_use) {
    check_forward_order(context, "end of forward");
  }
  if (hooked.empty()) {
    end_iteration_without_backward(context);
    return;
  }
  if (!context.checked_sharded_use) {
    context.checked_sharded_use = true;
    check_no_sharded_use(hooked, context);
  }
}

}  // namespace fsdp::runtime
