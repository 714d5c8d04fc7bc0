#include "fsdp_cpp/fsdp/backward.h"
#include "fsdp_cpp/comm/issuing_api.h"

#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>

#include "fsdp_cpp/fsdp/backward_reach.h"
#include "fsdp_cpp/fsdp/divergence.h"
#include "fsdp_cpp/fsdp/fsdp_state.h"
#include "fsdp_cpp/fsdp/open_iteration.h"
#include "fsdp_cpp/fsdp/post_backward_function.h"
#include "fsdp_cpp/fsdp/root_context.h"

namespace fsdp::runtime {
namespace {

// Hooks carry the iteration's generation and the call's index in one integer.
constexpr int kCallBits = 24;
int64_t make_tag(int64_t generation, size_t call) {
  return (generation << kCallBits) | static_cast<int64_t>(call);
}
int64_t tag_generation(int64_t tag) { return tag >> kCallBits; }
size_t tag_call(int64_t tag) { return static_cast<size_t>(tag & ((int64_t{1} << kCallBits) - 1)); }

bool has_trainable_handle(const FSDPState& unit) {
  for (const auto& h : unit.handles()) {
    if (h->requires_grad()) return true;
  }
  return false;
}

// `finish` false: HSDP's replicate all-reduces are issued, not waited for ([Note: asynchronous
// replicate all-reduce] in fsdp/flat_param_grad.h); the end of backward finishes them.
void finalize(FSDPState& unit, bool finish = true) {
  for (const auto& handle : unit.handles()) handle->finalize_gradients(finish);
}

void reduce_unit(RootContext& context, FSDPState& unit) {
  // Checked iterations ([Note: divergence check]): a rank with gradient sync off, other sizes, or
  // in another unit's reduction is named before the reduce-scatter.
  if (context.divergence().enabled()) {
    Fingerprint f("reduces the gradients of '" + unit.fqn() + "'");
    add_reduction_fields(f, unit.handles(), unit.requires_gradient_sync());
    context.check_ranks_agree(unit, std::move(f));
  }
  for (const auto& handle : unit.handles()) handle->reduce_gradients(unit.requires_gradient_sync());
  // The previous unit's reduction has had this unit's reduction to overlap with: finish it and
  // free its buffers.
  BackwardReductionQueue& reductions = context.reductions();
  if (reductions.awaiting_finalize() != nullptr) finalize(*reductions.awaiting_finalize(), /*finish=*/false);
  reductions.set_awaiting_finalize(unit.requires_gradient_sync() ? &unit : nullptr);
  unit.iteration().set_reduced();
}

// Whether `unit`'s turn in the reduction order has come: its backward is complete, or this pass
// will not reach it at all (a unit whose output the caller holds but the loss does not use; it
// reduces zeros, as at the end of the pass). Only the timing of a reduction depends on it, never
// the order or whether the reduction is issued, so ranks where the unit is reached and ranks where
// it is not still issue the same collectives in the same order.
bool ready_for_reduction(const RootContext& context, const FSDPState& unit) {
  if (unit.iteration().backward_complete()) return true;
  return unit.iteration().backward_complete(
      [&](torch::autograd::Node* node) { return runs_in_current_pass(context, node); });
}

// What a unit's turn in the reduction order does (BackwardReductionQueue::advance's steps).
struct ReductionSteps {
  RootContext& context;

  // From what every rank agreed ([Note: backward reach]) and what is the same on every rank that
  // reaches the unit, so that every rank gives the unit the same turn.
  BackwardReductionQueue::Turn turn(FSDPState& unit) const {
    using Turn = BackwardReductionQueue::Turn;
    if (!has_trainable_handle(unit)) return Turn::kSkip;
    switch (unit.iteration().pass_reach()) {
      case PassReach::kNowhere: return Turn::kSkip;
      case PassReach::kSomeRanks: return Turn::kDefer;  // its backward ends on some ranks only
      case PassReach::kEveryRank: break;
    }
    // Its backward end cannot be seen (a call's inputs needed no gradient).
    return unit.iteration().completes_at_end_of_backward() ? Turn::kDefer : Turn::kReduce;
  }
  bool ready(FSDPState& unit) const { return ready_for_reduction(context, unit); }
  void reduce(FSDPState& unit) const { reduce_unit(context, unit); }
  void skip(FSDPState& unit) const { unit.iteration().set_reduced(); }
};

// Reduces, in reverse forward order, every unit whose turn has come: with `final`, all of them;
// else only while the next one is ready (its backward finished, or this pass does not reach it).
void reduce_in_order(RootContext& context, bool final) {
  ReductionSteps steps{context};
  context.reductions().advance(context.iteration_state().forward_order(), final, steps);
}

void end_of_backward(RootContext& context) {
  RECORD_USER_SCOPE("FSDP::post_backward_final_callback");
  comm::IssuingApi issuing_api("fully_shard end of backward");
  reduce_in_order(context, /*final=*/true);
  context.reductions().set_awaiting_finalize(nullptr);  // finalized below, with every unit
  for (FSDPState* unit : context.iteration_state().forward_order()) {
    finalize(*unit);
    for (const auto& handle : unit->handles()) handle->commit_gradients();
  }
  for (FSDPState* unit : context.states()) {
    if (!unit->keeps_unsharded_after_backward()) context.scheduler().reshard(*unit);
    unit->set_training_state(TrainingState::kIdle);
  }
  // [Note: backward passes within an iteration] An iteration is the forwards since the last one
  // ended and the backward passes through their graphs; by default the first backward pass ends
  // it, and a graph of its forwards backpropagated after the next root forward is refused (its
  // parameters may have been stepped since: check_current_iteration). Pipeline schedules
  // interleave microbatches: 1F1B runs forward 2 after backward 0 and before backward 1, all
  // within one optimizer step. With the root's is_last_backward false (FSDP2's
  // set_is_last_backward), a backward pass ends without ending the iteration while some
  // forward's graph is still live: the phase returns to kForward, the next root forward
  // continues the iteration (same generation, units keep their calls), and each later backward
  // pass reduces, finalizes and reshards as this one did. The backward with is_last_backward
  // true ends the iteration. Every rank must set it alike (it is in the controls the ranks
  // compare at each pass, [Note: backward reach]).
  context.end_backward_pass(context.root()->is_last_backward() || !context.any_unit_may_get_gradients());
}

void begin_backward_pass(RootContext& context) {
  context.begin_backward_pass(torch::autograd::get_current_graph_task_id());
  torch::autograd::Engine::get_default_engine().queue_callback([c = &context] { end_of_backward(*c); });
  for (FSDPState* unit : context.iteration_state().forward_order()) unit->iteration().begin_backward_pass();
  // Checked iterations ([Note: divergence check]): a rank that skipped this backward, or runs
  // another forward instead, is named before any collective of the pass. Not which unit's
  // pre-backward began it: that may differ across ranks (a unit's output returned as the root's
  // output on some ranks only).
  if (context.divergence().enabled()) context.check_ranks_agree(Fingerprint("began a backward pass"));
  agree_backward_reach(context);  // collective: every rank is at its first pre-backward of the pass
  for (FSDPState* unit : context.iteration_state().forward_order()) {
    const PassReach reach = unit->iteration().pass_reach();
    if (reach == PassReach::kNowhere) continue;
    for (const auto& handle : unit->handles()) handle->prepare_gradients_for_backward();
    // Reached on some ranks only: all-gathered now, in forward order, by every rank (those the pass
    // does not reach issue no pre-backward), and kept unsharded until the end of the pass.
    if (reach == PassReach::kSomeRanks && unit->unshard_in_backward()) context.scheduler().start_unshard(*unit);
  }
}

// Checked iterations ([Note: divergence check]): before each backward all-gather, whether a
// pre-backward or a prefetch issues it (the two may differ across ranks when the pass reaches
// units in a different order), every rank must be gathering the same unit with the same sizes.
void check_before_backward_all_gather(RootContext& context, const FSDPState& unit) {
  if (!context.divergence().enabled()) return;
  if (!unit.unshard_in_backward()) {
    context.check_ranks_agree(unit, Fingerprint("uses '" + unit.fqn() + "' in backward without all-gathering it"));
    return;
  }
  Fingerprint f("all-gathers '" + unit.fqn() + "' for backward");
  add_all_gather_fields(f, unit.handles(), /*needs_all_gather=*/true);
  context.check_ranks_agree(unit, std::move(f));
}

// Backward prefetch: the unit that ran before this one in forward runs its backward next.
void prefetch_for_backward(RootContext& context, const FSDPState& unit) {
  const auto* explicit_targets = unit.backward_prefetch_targets();
  for (FSDPState* next : prefetch_targets(unit, explicit_targets, context.iteration_state().forward_order(), -1)) {
    // Units reached on some ranks only were all-gathered when the pass began.
    if (next->iteration().reduced() || next->iteration().pass_reach() != PassReach::kEveryRank) continue;
    if (!next->unshard_in_backward()) continue;  // [Note: unshard in backward]: nothing to gather
    const bool bounded = explicit_targets == nullptr;
    if (!context.scheduler().would_prefetch(*next, unit, bounded)) continue;
    check_before_backward_all_gather(context, *next);
    context.scheduler().prefetch(*next, unit, bounded);
  }
}

// A hook from the graph of an earlier iteration: backward runs through a graph whose unsharded
// parameters were freed and whose gradients would land in another iteration's buffers. Refused at
// whichever of the unit's hooks the stale graph reaches first: its outputs' pre-backward, or its
// inputs' post-backward (a tensor the unit computed from its input and kept, backpropagated
// without passing the unit's outputs). Before anything changes.
void check_current_iteration(const FSDPState& unit, const RootContext& context, int64_t tag) {
  TORCH_CHECK(tag_generation(tag) == context.iteration_state().generation(), "fully_shard: unit '", unit.fqn(),
              "' is in a backward through the graph of an earlier iteration (the root ran a new "
              "forward since); run every backward through a graph before the root's next forward, or, "
              "to interleave microbatches' forwards and backwards within one step (pipeline "
              "schedules), call set_is_last_backward(false) on the root before each backward but "
              "the step's last");
}

void pre_backward(FSDPState& unit, int64_t tag) {
  RECORD_USER_SCOPE("FSDP::pre_backward");
  comm::IssuingApi issuing_api("fully_shard pre-backward of unit '" + (unit.fqn().empty() ? "<root>" : unit.fqn()) + "'");
  RootContext& context = *unit.root_context();
  TORCH_CHECK(!c10::GradMode::is_enabled(), "fully_shard: unit '", unit.fqn(),
              "' is in a backward with create_graph=true (a double backward, e.g. a gradient "
              "penalty through torch::autograd::grad); fully_shard does not support "
              "differentiating through gradients, because each unit's unsharded parameters are "
              "freed after its backward. Compute the gradients without create_graph.");
  check_current_iteration(unit, context, tag);
  if (context.iteration_state().phase() != IterationPhase::kBackward) {
    // [Note: open iterations] in fsdp/open_iteration.h: no optimizer step inside one.
    check_no_step_in_open_iteration(context, "a backward pass");
    begin_backward_pass(context);
  }
  // Only where this pre-backward issues the all-gather: the order of pre-backwards that issue none
  // may differ across ranks (a unit's output returned as the root's output on some ranks only).
  if (!unit.is_unsharded() && !unit.unshard_in_flight()) check_before_backward_all_gather(context, unit);
  TORCH_CHECK(!unit.iteration().reduced() || !has_trainable_handle(unit), "fully_shard: unit '", unit.fqn(),
              "' is reached by backward after its gradients were reduced in this backward pass; "
              "the gradients it would get now would be lost. A unit's forward outputs must stay "
              "in the autograd graph its backward goes through.");
  // The previous unit's reduction, if it has completed, frees its buffers before this unit's
  // gradients and parameters are allocated (otherwise the next reduction's issue waits for it).
  // Not under hybrid sharding: finalizing all-reduces across the replicate group, and a collective
  // issued at a point that depends on timing (whether the reduction has completed) would pair up
  // differently across ranks with the shard group's collectives and deadlock.
  BackwardReductionQueue& reductions = context.reductions();
  FSDPState* awaiting = reductions.awaiting_finalize();
  const auto& replicate = awaiting ? awaiting->config().replicate : nullptr;
  if (FSDPState* previous = replicate && replicate->size() > 1 ? nullptr : awaiting) {
    bool completed = true;
    for (const auto& handle : previous->handles()) completed &= handle->reduction_completed();
    if (completed) {
      finalize(*previous);
      reductions.set_awaiting_finalize(nullptr);
    }
  }
  unit.iteration().call_pre_backward(tag_call(tag));
  if (unit.iteration().pass_reach() == PassReach::kNowhere) {
    // Its outputs' nodes looked freed (or outside the pass) when the pass began, yet backward
    // reached it: taken as reached on every rank, as the same program does the same on every rank
    // (checked iterations compare it).
    unit.iteration().set_pass_reach(PassReach::kEveryRank);
    for (const auto& handle : unit.handles()) handle->prepare_gradients_for_backward();
  }
  // [Note: unshard in backward] set_unshard_in_backward(false): the unit's backward needs no
  // parameter values (an embedding whose input needs no gradient: its weight's gradient is a
  // scatter of the output's). Nothing is all-gathered; the parameters become full-shape views of
  // the freed unsharded buffer, so autograd accumulates into the flat gradient buffer as usual,
  // and the gradient is reduced as usual. A backward that does read the values (a Linear's input
  // gradient) fails with LibTorch's "data is not allocated yet" on every rank alike, and the
  // next root forward discards the iteration. Ranks that disagree are refused at the pass begin
  // ([Note: backward reach]).
  if (unit.unshard_in_backward()) {
    context.scheduler().unshard(unit);
  } else {
    unit.use_unsharded_views_without_data();
  }
  for (const auto& handle : unit.handles()) handle->prepare_gradient_buffer();
  unit.set_training_state(TrainingState::kPreBackward);
  // Not from a unit the pass reaches on some ranks only: the others run no hook for it.
  const bool everywhere = unit.iteration().pass_reach() == PassReach::kEveryRank;
  if (everywhere && unit.config().options.backward_prefetch() == BackwardPrefetch::kBackwardPre) {
    prefetch_for_backward(context, unit);
  }
}

void post_backward(void* arg, int64_t tag) {
  RECORD_USER_SCOPE("FSDP::post_backward");
  FSDPState& unit = *static_cast<FSDPState*>(arg);
  comm::IssuingApi issuing_api("fully_shard post-backward of unit '" + (unit.fqn().empty() ? "<root>" : unit.fqn()) + "'");
  RootContext& context = *unit.root_context();
  check_current_iteration(unit, context, tag);
  // This iteration's graph reached through a tensor the unit kept from its input, with no
  // pre-backward of any unit before it: no pass has begun, nothing of the unit's to finish.
  if (context.iteration_state().phase() != IterationPhase::kBackward) return;
  unit.iteration().call_post_backward(tag_call(tag));
  if (unit.iteration().backward_running()) return;  // another call of the unit is mid-backward
  const bool complete = unit.iteration().backward_complete();
  // Resharded after each call (a later call's pre-backward unshards again), except when the unit
  // is meant to be unsharded once through backward (SHARD_GRAD_OP, the root, a unit of sibling
  // modules): then once complete.
  const bool keep_until_complete =
      !unit.config().reshard_after_forward() || (unit.is_root() && !context.iteration_state().root_nested()) ||
      unit.modules().size() > 1;
  // A unit the pass reaches on some ranks only stays unsharded until the end of the pass, as on the
  // ranks it does not reach, so that every rank's scheduler counts the same units when it decides
  // whether to prefetch.
  const bool everywhere = unit.iteration().pass_reach() == PassReach::kEveryRank;
  if (everywhere && !unit.keeps_unsharded_after_backward() && (complete || !keep_until_complete)) {
    context.scheduler().reshard(unit);
  }
  if (complete) {
    unit.set_training_state(TrainingState::kPostBackward);
    reduce_in_order(context, /*final=*/false);
  }
  // After this unit's gradient computation (and its reduction, once its turn came).
  if (everywhere && unit.config().options.backward_prefetch() == BackwardPrefetch::kBackwardPost) {
    prefetch_for_backward(context, unit);
  }
}

}  // namespace

void route_inputs_for_post_backward(FSDPState& unit, size_t call, contract::ForwardArgs& args) {
  std::vector<at::Tensor> needs_grad;
  for (const auto& arg : args) {
    contract::for_each_tensor(arg, [&](const at::Tensor& t) {
      if (t.requires_grad()) needs_grad.push_back(t);
    });
  }
  if (needs_grad.empty()) return;  // the end of this call's backward cannot be seen
  const int64_t tag = make_tag(unit.root_context()->iteration_state().generation(), call);
  std::vector<at::Tensor> routed = register_post_backward(needs_grad, &post_backward, &unit, tag);
  size_t next = 0;
  for (auto& arg : args) {
    arg = contract::map_tensors(arg, [&](const at::Tensor& t) {
      return t.requires_grad() ? routed[next++] : t;
    });
  }
  unit.iteration().set_post_backward_visible(call);
}

std::vector<at::Tensor> hook_outputs_for_backward(FSDPState& unit, c10::IValue& output) {
  std::vector<at::Tensor> hooked;
  std::vector<c10::intrusive_ptr<torch::autograd::Node>> nodes;
  if (c10::GradMode::is_enabled() && unit.iteration().ran_forward()) {
    const int64_t tag = make_tag(unit.root_context()->iteration_state().generation(), unit.iteration().latest_call());
    const uint64_t first_node = unit.iteration().latest_call_first_node();
    auto hook = [u = &unit, tag](const at::TensorBase&) { pre_backward(*u, tag); };
    auto hook_tensor = [&](const at::TensorBase& t) {
      t.register_hook(hook);
      if (t.grad_fn()) nodes.push_back(t.grad_fn());
    };
    contract::for_each_tensor(output, [&](const at::Tensor& t) {
      if (!t.requires_grad()) return;
      hook_tensor(t);
      hooked.push_back(t);
      // An output that is a view (`h.view(...)`, `transpose`) may be modified in place by the
      // caller, which rewrites its autograd history: the hook above would never fire, and its
      // node is freed. The hook on its base fires either way (the pre-backward runs once per
      // call whichever fires first), and the base's node stays in the graph. Only a base this
      // call computed: a view of a tensor from before the unit (its input) gets its gradient only
      // after the unit's backward.
      if (t.is_view()) {
        const at::TensorBase& base = t._base();
        if (base.requires_grad() && base.grad_fn() && base.grad_fn()->sequence_nr() >= first_node) {
          hook_tensor(base);
        }
      }
    });
  }
  unit.iteration().end_call(!hooked.empty(), nodes);
  return hooked;
}

namespace {

// [Note: passthrough backward] With nothing to gather or reduce (one rank), autograd writes the
// parameters' `.grad` as in local training. Only the root's outputs are hooked: the first
// pre-backward of a pass sets aside the gradients the parameters hold, the end-of-backward
// callback adds them back, and a pass that threw is undone by the next root forward (the
// parameters get back what they held before it).
void end_of_passthrough_backward(RootContext& context) {
  for (FSDPState* unit : context.states()) unit->divide_passthrough_gradients();  // a custom factor
  context.passthrough_saved_grads().add_back();
  context.iteration_state().end_passthrough_iteration();
}

void passthrough_pre_backward(RootContext& context) {
  if (context.iteration_state().phase() == IterationPhase::kBackward) return;
  context.iteration_state().begin_backward();
  torch::autograd::Engine::get_default_engine().queue_callback(
      [c = &context] { end_of_passthrough_backward(*c); });
  SetAsideGradients& saved = context.passthrough_saved_grads();
  saved.clear();
  for (FSDPState* unit : context.states()) {
    for (const auto& handle : unit->handles()) {
      if (!handle->requires_grad()) continue;
      for (const auto& p : handle->params()) saved.set_aside(p.param);
    }
  }
}

}  // namespace

void hook_root_outputs_passthrough(RootContext& context, const c10::IValue& output) {
  if (!c10::GradMode::is_enabled()) return;
  contract::for_each_tensor(output, [&](const at::Tensor& t) {
    if (t.requires_grad()) t.register_hook([c = &context](const at::TensorBase&) { passthrough_pre_backward(*c); });
  });
}

void discard_passthrough_backward(RootContext& context) {
  if (context.iteration_state().phase() != IterationPhase::kBackward) return;
  context.passthrough_saved_grads().restore();
  context.iteration_state().return_to_idle();
}

void discard_iteration(RootContext& context) {
  for (FSDPState* unit : context.states()) {
    for (const auto& handle : unit->handles()) handle->discard_gradients();
    context.scheduler().reshard(*unit);  // waits for an all-gather in flight first
    unit->set_training_state(TrainingState::kIdle);
    unit->iteration().reset();
  }
  context.discard();
}

}  // namespace fsdp::runtime
