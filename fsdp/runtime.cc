#include "fsdp/runtime.h"

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
  for (const auto& item : state.module().named_modules("", /*include_self=*/true)) {
    auto unit = registry.get_as<FSDPState>(*item.value(), kFullyShardApi);
    if (!unit) continue;
    TORCH_CHECK(unit->config().comm == context->comm, "fully_shard: unit ",
                registry.describe(*item.value()),
                " uses another communicator than its root; every unit of one model must use the "
                "same one");
    unit->set_root_context(context);
    unit->set_fqn(item.key().empty() ? std::string("<root>") : item.key());
    context->states.push_back(unit.get());
  }
}

// Ends an iteration in which no backward ran (or will run): every unit resharded and idle.
void end_iteration_without_backward(RootContext& context) {
  for (FSDPState* unit : context.states) {
    unit->reshard();
    unit->set_training_state(TrainingState::kIdle);
  }
  context.iteration_active = false;
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
    unit->pre_backward_done = false;
    unit->reduced = false;
    unit->ran_forward = false;
  }
}

// Reduce-scatters, in reverse forward order, every unit whose turn has come: with `final`, all of
// them; else only while the next one has finished its backward.
void reduce_in_order(RootContext& context, bool final) {
  const size_t n = context.forward_order.size();
  while (context.reduced_from_back < n) {
    FSDPState* unit = context.forward_order[n - 1 - context.reduced_from_back];
    if (!final && unit->training_state() != TrainingState::kPostBackward) break;
    for (const auto& handle : unit->handles()) handle->reduce_gradients();
    unit->reduced = true;
    ++context.reduced_from_back;
  }
}

void end_of_backward(RootContext& context) {
  reduce_in_order(context, /*final=*/true);
  for (FSDPState* unit : context.forward_order) {
    for (const auto& handle : unit->handles()) handle->finalize_gradients();
  }
  for (FSDPState* unit : context.states) {
    unit->reshard();
    unit->set_training_state(TrainingState::kIdle);
  }
  context.iteration_active = false;
  ++context.iterations;
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
  unit.unshard();
  unit.set_training_state(TrainingState::kPreBackward);
  // Backward prefetch: the unit that ran before this one in forward runs its backward next.
  const int index = context.forward_index(&unit);
  if (index > 0) {
    FSDPState* next = context.forward_order[index - 1];
    if (!next->reduced && next->training_state() != TrainingState::kPostBackward) next->start_unshard();
  }
}

void post_backward(void* arg) {
  FSDPState& unit = *static_cast<FSDPState*>(arg);
  if (--unit.pending_post_backward > 0) return;  // another forward call's backward is to come
  if (unit.training_state() == TrainingState::kPostBackward) return;
  unit.set_training_state(TrainingState::kPostBackward);
  unit.reshard();
  reduce_in_order(*unit.root_context(), /*final=*/false);
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
    state.ran_forward = true;
    context.forward_order.push_back(&state);
  }
  state.unshard();
  state.set_training_state(TrainingState::kForward);

  if (!c10::GradMode::is_enabled()) return;
  std::vector<at::Tensor> needs_grad;
  for (const auto& arg : args) {
    contract::for_each_tensor(arg, [&](const at::Tensor& t) {
      if (t.requires_grad()) needs_grad.push_back(t);
    });
  }
  if (needs_grad.empty()) return;
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
  if (!state.is_root() && state.config().reshard_after_forward) state.reshard();
  std::vector<at::Tensor> hooked;
  if (c10::GradMode::is_enabled()) {
    contract::for_each_tensor(output, [&](const at::Tensor& t) {
      if (!t.requires_grad()) return;
      t.register_hook([unit = &state](const at::TensorBase&) { pre_backward(*unit); });
      hooked.push_back(t);
    });
  }
  if (!state.is_root()) return;
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
