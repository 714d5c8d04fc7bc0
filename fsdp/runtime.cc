#include "fsdp_cpp/fsdp/runtime.h"
#include "fsdp_cpp/comm/issuing_api.h"

#include <ATen/record_function.h>
#include <sstream>

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "fsdp_cpp/contract/forward_hooks.h"
#include "fsdp_cpp/contract/module_state.h"
#include "fsdp_cpp/contract/recompute_region.h"
#include "fsdp_cpp/fsdp/backward.h"
#include "fsdp_cpp/fsdp/divergence.h"
#include "fsdp_cpp/fsdp/fsdp_state.h"
#include "fsdp_cpp/fsdp/lazy_init.h"
#include "fsdp_cpp/fsdp/open_iteration.h"
#include "fsdp_cpp/fsdp/root_context.h"
#include "fsdp_cpp/fsdp/sharded_use_guard.h"

namespace fsdp::runtime {
namespace {

// Ends an iteration in which no backward can run: every unit resharded and idle.
void end_iteration_without_backward(RootContext& context) {
  for (FSDPState* unit : context.states()) {
    context.scheduler().reshard(*unit);
    unit->set_training_state(TrainingState::kIdle);
    for (const auto& handle : unit->handles()) handle->end_iteration();  // [Note: streams]
  }
  context.iteration_state().end_iteration();
}

// [Note: unshard in backward] A unit whose forward saved views of its unsharded parameters for
// backward (a Linear saves weight.t()) needs their values in backward: with
// set_unshard_in_backward(false) it would read freed memory. Once its parameters are sharded
// again, only such views still hold the unsharded buffer's storage. Refused here, in forward, on
// every rank alike (the same program saves the same tensors). Parameters saved whole (not views)
// are not seen here: their backward fails with LibTorch's "data is not allocated yet".
void check_backward_needs_no_values(const FSDPState& state) {
  for (const auto& handle : state.handles()) {
    const long held = handle->unsharded_buffer_references();
    TORCH_CHECK(held == 0, "fully_shard: unit '", state.fqn().empty() ? "<root>" : state.fqn(),
                "' was set to skip its backward all-gather (FSDPModule::set_unshard_in_backward(false)), but its "
                "forward saved views of its parameters for backward (", held, held == 1 ? " tensor holds" : " tensors hold",
                " its unsharded parameters after resharding), so its backward needs their values. Expected a unit "
                "whose backward reads no parameter values (an embedding whose input needs no gradient); call "
                "set_unshard_in_backward(true) on it");
  }
}

void root_pre_forward(RootContext& context) {
  RECORD_USER_SCOPE("FSDP::root_pre_forward");
  comm::IssuingApi issuing_api("fully_shard root pre-forward");
  // The previous forward or backward threw: start clean (every rank threw at the same point).
  IterationState& iteration = context.iteration_state();
  if (iteration.in_root_forward() || iteration.phase() == IterationPhase::kBackward) discard_iteration(context);
  // Several forwards before one backward continue the iteration while an earlier forward's graph
  // can still be backpropagated through; otherwise a new iteration starts.
  if (iteration.phase() != IterationPhase::kForward || !context.any_unit_may_get_gradients()) {
    context.begin_iteration();
    // [Note: post-forward group] Slices kept by an earlier iteration may be stale (an optimizer step).
    for (FSDPState* unit : context.states()) {
      for (const auto& handle : unit->handles()) handle->drop_post_forward_shard();
    }
  } else {
    // [Note: open iterations] in fsdp/open_iteration.h: no optimizer step inside one.
    check_no_step_in_open_iteration(context, "this forward");
  }
  iteration.enter_root_forward(/*nested=*/contract::hooked_forward_depth() > 1);  // this call counts one
  // [Note: streams] The optimizer step (or a state-dict load) wrote the shards on the compute
  // stream: the first all-gather waits for it, the later ones in this iteration need not.
  for (FSDPState* unit : context.states()) {
    for (const auto& handle : unit->handles()) handle->begin_iteration();
  }
}

// Checked iterations ([Note: divergence check]): before each forward call of a unit, every rank
// must be running the same unit, call and parameters (their collectives pair up by order), so a
// divergence is named before the all-gather, not a truncation error or a hang.
void check_before_forward(RootContext& context, const FSDPState& state, size_t call) {
  Fingerprint f("ran '" + state.fqn() + "'");
  f.add("forward call", std::to_string(call));
  add_all_gather_fields(f, state.handles(), !state.is_unsharded() && !state.unshard_in_flight());
  context.check_ranks_agree(state, std::move(f));
}

// A root forward while a SummonFullParams scope holds some unit's full parameters would reshard
// them under the scope (and its writeback would then copy stale values): refused before anything
// runs, naming the unit.
void check_no_summoned_unit(const RootContext& context) {
  for (const FSDPState* unit : context.states()) {
    TORCH_CHECK(!unit->full_params_summoned(), "fully_shard: forward of the root ran while a "
                "SummonFullParams scope holds the full parameters of unit ",
                contract::ModuleStateRegistry::global().describe(unit->module()),
                "; leave the scope (or call its exit()) before running the model");
  }
}

// A unit inside a module whose forward is recomputed in backward (activation checkpointing around
// the unit) would be all-gathered, reduced and hooked again from inside backward: refused at its
// first forward, before anything runs. Checkpointing the unit's own module, or modules inside a
// unit, is what composes (the recomputation then finds the unit unsharded by its pre-backward).
void check_not_inside_recompute_region(const FSDPState& state) {
  const contract::RecomputeRegion region = contract::current_recompute_region();
  if (region.phase == contract::RecomputePhase::kNone) return;
  auto& registry = contract::ModuleStateRegistry::global();
  TORCH_CHECK(false, "fully_shard: unit ", registry.describe(state.module()),
              " runs inside the forward of ", registry.describe(*region.module),
              ", which has activation checkpointing (its forward runs again in backward); a unit "
              "inside it would be all-gathered and reduced again from inside backward. Apply "
              "checkpointing to the unit's own module or to modules inside units, not to a module "
              "that contains units.");
}

// One rank: the root's call ends; the phase stays kForward while a backward can run through it
// (hook_outputs_for_backward does the same for every unit on several ranks).
void end_passthrough_root_call(FSDPState& root, const c10::IValue& output) {
  std::vector<c10::intrusive_ptr<torch::autograd::Node>> nodes;
  bool need_grad = false;
  if (c10::GradMode::is_enabled()) {
    contract::for_each_tensor(output, [&](const at::Tensor& t) {
      if (!t.requires_grad()) return;
      need_grad = true;
      if (t.grad_fn()) nodes.push_back(t.grad_fn());
      // A view's in-place edit replaces its node; its base's stays in the graph.
      if (t.is_view() && t._base().grad_fn()) nodes.push_back(t._base().grad_fn());
    });
  }
  root.iteration().end_call(need_grad, nodes);
  RootContext& context = *root.root_context();
  if (!context.any_unit_may_get_gradients()) context.iteration_state().return_to_idle();
}

// [Note: hidden parameters] in fsdp/sharded_use_guard.h: in the root's pre-forward, after the
// root itself is unsharded.
void hide_other_units(RootContext& context) {
  for (FSDPState* unit : context.states()) {
    if (unit != context.root()) hide_params(*unit);
  }
}

}  // namespace

void pre_forward(FSDPState& state, contract::ForwardArgs& args) {
  RECORD_USER_SCOPE("FSDP::pre_forward");
  comm::IssuingApi issuing_api("fully_shard pre-forward of unit '" + (state.fqn().empty() ? "<root>" : state.fqn()) + "'");
  check_not_inside_recompute_region(state);
  if (state.root_context() == nullptr) lazy_init(state);
  RootContext& context = *state.root_context();
  if (state.is_root()) check_no_summoned_unit(context);
  // [Note: hidden parameters] in fsdp/sharded_use_guard.h. The root shows what a forward that
  // threw left hidden, then hides every other unit; a unit shows its own before it is gathered.
  const bool hide = hides_params_outside_forward(context);
  if (state.is_root()) {
    show_all_params(context);
  } else if (!state.hidden_params().empty()) {
    show_params(state);
  }
  IterationState& iteration = context.iteration_state();
  if (context.passthrough()) {  // one rank: nothing to gather, route or hook
    if (state.is_root()) {
      discard_passthrough_backward(context);  // the last backward threw
      // [Note: iteration phases] on one rank too, so that what may run between a forward and its
      // backward (SummonFullParams, state-dict loads) is decided as on several ranks: the root's
      // calls say whether a backward can still run.
      if (iteration.phase() != IterationPhase::kForward || !state.iteration().may_get_gradients()) {
        state.iteration().reset();
      }
      bool first = false;
      state.iteration().begin_call(c10::GradMode::is_enabled(), &first);
      iteration.enter_root_forward(iteration.root_nested());  // read only where units reshard
    }
    TORCH_CHECK(iteration.in_root_forward(), "fully_shard: module ",
                contract::ModuleStateRegistry::global().describe(state.module()),
                " ran its forward outside a forward of its root; call the root module");
    state.unshard();  // checks that parameters were not replaced (dtype, device, shape)
    if (hide) {
      // The guards' errors say whether a unit ran (forward_order; nothing else needs it here).
      iteration.record_passthrough_call(state, /*restart=*/state.is_root());
      if (state.is_root()) hide_other_units(context);
    }
    return;
  }
  if (state.is_root()) root_pre_forward(context);
  TORCH_CHECK(iteration.in_root_forward(), "fully_shard: module ",
              contract::ModuleStateRegistry::global().describe(state.module()),
              " ran its forward outside a forward of its root; call the root module");
  bool first = false;
  const size_t call = state.iteration().begin_call(c10::GradMode::is_enabled(), &first);
  if (context.divergence().enabled()) check_before_forward(context, state, call);
  if (first) iteration.record_first_call(state);
  UnshardScheduler& scheduler = context.scheduler();
  scheduler.start_unshard(state);
  // Forward prefetch: the unit that ran after this one in the previous iteration.
  const auto* explicit_targets = state.forward_prefetch_targets();
  if (state.config().options.forward_prefetch() || explicit_targets) {
    for (FSDPState* next : prefetch_targets(state, explicit_targets, iteration.previous_forward_order(), +1)) {
      if (next->iteration().ran_forward()) continue;
      if (!next->hidden_params().empty()) show_params(*next);  // its all-gather reads the shards
      scheduler.prefetch(*next, state, explicit_targets == nullptr);
    }
  }
  scheduler.unshard(state);
  if (hide && state.is_root()) hide_other_units(context);
  state.set_training_state(TrainingState::kForward);
  if (const auto dtype = state.config().cast_forward_inputs_to()) {
    for (auto& arg : args) {
      arg = contract::map_tensors(arg, [&](const at::Tensor& t) {
        return at::isFloatingType(t.scalar_type()) && t.scalar_type() != *dtype ? t.to(*dtype) : t;
      });
    }
  }
  if (c10::GradMode::is_enabled()) route_inputs_for_post_backward(state, call, args);
}

void post_forward(FSDPState& state, c10::IValue& output) {
  RECORD_USER_SCOPE("FSDP::post_forward");
  comm::IssuingApi issuing_api("fully_shard post-forward of unit '" + (state.fqn().empty() ? "<root>" : state.fqn()) + "'");
  RootContext& context = *state.root_context();
  const bool hide = hides_params_outside_forward(context);
  IterationState& iteration = context.iteration_state();
  if (context.passthrough()) {
    if (!state.is_root()) {
      // Hidden where several ranks would reshard it ([Note: hidden parameters]).
      if (hide && (state.config().reshard_after_forward() || !state.config().shard())) hide_params(state);
      return;
    }
    if (hide) show_all_params(context);
    iteration.exit_root_forward();
    hook_root_outputs_passthrough(context, output);
    end_passthrough_root_call(state, output);
    if (hide) {
      std::vector<at::Tensor> outputs;
      contract::for_each_tensor(output, [&](const at::Tensor& t) {
        if (t.requires_grad()) outputs.push_back(t);
      });
      if (!outputs.empty()) {
        iteration.mark_sharded_use_checked();
        check_no_sharded_use(outputs, context);
      }
    }
    return;
  }
  // Siblings: reshard after the last of the unit's modules ran.
  const bool last_module = state.iteration().last_module_ran(state.modules().size());
  const bool kept_after_forward = state.is_root() && !iteration.root_nested();
  if (!kept_after_forward && state.config().reshard_after_forward() && last_module) {
    context.scheduler().reshard(state, /*after_forward=*/state.unshard_in_backward());
    if (!state.unshard_in_backward() && c10::GradMode::is_enabled()) check_backward_needs_no_values(state);
  }
  if (hide && !state.is_root()) hide_params(state);
  const std::vector<at::Tensor> hooked = hook_outputs_for_backward(state, output);
  if (!state.is_root()) return;
  if (hide) show_all_params(context);
  // Before leaving the root's forward: if the ranks differ, the next root pre-forward finds the
  // iteration still in it and discards it (reshards the root on every rank).
  if (context.divergence().enabled()) context.check_ranks_agree(Fingerprint("finished its forward"));
  iteration.exit_root_forward();
  if (!context.any_unit_may_get_gradients()) {
    end_iteration_without_backward(context);
    return;
  }
  if (!iteration.checked_sharded_use() && !hooked.empty()) {
    iteration.mark_sharded_use_checked();
    check_no_sharded_use(hooked, context);
  }
}

bool settle_forward_phase(RootContext& context) {
  const IterationState& iteration = context.iteration_state();
  if (iteration.phase() != IterationPhase::kForward || iteration.in_root_forward()) return false;
  if (context.any_unit_may_get_gradients()) return true;
  end_iteration_without_backward(context);
  return false;
}

void forward_failed(FSDPState& state) {
  RootContext* context = state.root_context();
  if (context != nullptr && state.is_root()) show_all_params(*context);
}

}  // namespace fsdp::runtime
