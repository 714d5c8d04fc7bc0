// The engine's state machines without communication: IterationState's transitions, the backward
// reduction queue's order, RootContext's transitions across its parts, prefetch targets, and the
// undo records (set-aside gradients, hidden parameters).
#include <cstdlib>
#include <map>
#include <set>
#include <string>

#include <ATen/ATen.h>

#include "fsdp_cpp/fsdp/backward_reduction_queue.h"
#include "fsdp_cpp/fsdp/fsdp_state.h"
#include "fsdp_cpp/fsdp/hidden_params.h"
#include "fsdp_cpp/fsdp/iteration_state.h"
#include "fsdp_cpp/fsdp/root_context.h"
#include "fsdp_cpp/fsdp/set_aside_gradients.h"
#include "fsdp_cpp/tests/fsdp/engine_units.h"

// Last: LibTorch's c10/util/Logging.h defines its own CHECK, and the last definition wins.
#include <catch2/catch.hpp>

namespace {

using fsdp::BackwardReductionQueue;
using fsdp::FSDPState;
using fsdp::IterationPhase;
using fsdp::IterationState;
using Order = std::vector<FSDPState*>;

// Distinct unit addresses for the state machines that only store and compare them (never
// dereferenced).
struct FakeUnits {
  alignas(8) char storage[8][8] = {};
  FSDPState* operator[](size_t i) { return reinterpret_cast<FSDPState*>(storage[i]); }
};

// The reduction steps of a test: each unit's turn, which are ready, and what happened, in order.
struct RecordingSteps {
  std::map<FSDPState*, BackwardReductionQueue::Turn> turns;  // kReduce when absent
  std::set<FSDPState*> ready_units;
  std::map<FSDPState*, std::string> names;
  std::vector<std::string> log;
  int ready_asked = 0;

  BackwardReductionQueue::Turn turn(FSDPState& u) {
    const auto it = turns.find(&u);
    return it == turns.end() ? BackwardReductionQueue::Turn::kReduce : it->second;
  }
  bool ready(FSDPState& u) {
    ++ready_asked;
    return ready_units.count(&u) > 0;
  }
  void reduce(FSDPState& u) { log.push_back("reduce " + names.at(&u)); }
  void skip(FSDPState& u) { log.push_back("skip " + names.at(&u)); }
};

using Log = std::vector<std::string>;

}  // namespace

TEST_CASE("IterationState: forward order recorded per iteration, kept as previous when it ends",
          "[fsdp][iteration]") {
  FakeUnits u;
  IterationState s;
  CHECK(s.phase() == IterationPhase::kIdle);
  CHECK(s.generation() == 0);
  CHECK(s.iterations() == 0);
  CHECK_FALSE(s.in_root_forward());

  s.begin_iteration();
  s.enter_root_forward(/*nested=*/false);
  CHECK(s.phase() == IterationPhase::kForward);
  CHECK(s.in_root_forward());
  CHECK_FALSE(s.root_nested());
  s.record_first_call(*u[0]);
  s.record_first_call(*u[1]);
  s.record_first_call(*u[2]);
  s.exit_root_forward();
  CHECK_FALSE(s.in_root_forward());
  CHECK(s.phase() == IterationPhase::kForward);  // a backward may follow
  CHECK(s.forward_order() == Order{u[0], u[1], u[2]});
  CHECK(s.ran_forward(*u[1]));
  CHECK_FALSE(s.ran_forward(*u[3]));
  CHECK(s.previous_forward_order().empty());
  s.begin_backward();
  CHECK(s.phase() == IterationPhase::kBackward);
  s.end_iteration();
  CHECK(s.phase() == IterationPhase::kIdle);
  CHECK(s.iterations() == 1);
  CHECK(s.generation() == 1);
  CHECK(s.previous_forward_order() == Order{u[0], u[1], u[2]});
  // Kept until the next iteration begins: a second backward through a retained graph reads it.
  CHECK(s.forward_order() == Order{u[0], u[1], u[2]});

  // The next iteration runs the units in another order.
  s.begin_iteration();
  CHECK(s.generation() == 2);
  CHECK(s.forward_order().empty());
  s.enter_root_forward(/*nested=*/true);
  CHECK(s.root_nested());
  s.record_first_call(*u[2]);
  s.record_first_call(*u[0]);
  CHECK(s.previous_forward_order() == Order{u[0], u[1], u[2]});
  s.exit_root_forward();
  s.end_iteration();  // a forward after which no backward can run
  CHECK(s.iterations() == 2);
  CHECK(s.previous_forward_order() == Order{u[2], u[0]});
}

TEST_CASE("IterationState: a discarded iteration keeps the counters and the previous order",
          "[fsdp][iteration]") {
  FakeUnits u;
  IterationState s;
  s.begin_iteration();
  s.enter_root_forward(false);
  s.record_first_call(*u[0]);
  s.exit_root_forward();
  s.begin_backward();
  s.end_iteration();

  s.begin_iteration();
  s.enter_root_forward(false);
  s.record_first_call(*u[1]);  // the forward throws here
  s.discard();
  CHECK(s.phase() == IterationPhase::kIdle);
  CHECK_FALSE(s.in_root_forward());
  CHECK(s.forward_order().empty());
  CHECK(s.previous_forward_order() == Order{u[0]});
  CHECK(s.iterations() == 1);
  CHECK(s.generation() == 2);

  // One rank: the root restarts the order, each unit once.
  s.enter_root_forward(s.root_nested());
  s.record_passthrough_call(*u[0], /*restart=*/true);
  s.record_passthrough_call(*u[1], false);
  s.record_passthrough_call(*u[1], false);
  CHECK(s.forward_order() == Order{u[0], u[1]});
  s.record_passthrough_call(*u[0], /*restart=*/true);
  CHECK(s.forward_order() == Order{u[0]});
  s.exit_root_forward();
  s.return_to_idle();  // no backward can run through it
  CHECK(s.phase() == IterationPhase::kIdle);
  CHECK(s.iterations() == 1);
  s.begin_backward();
  s.end_passthrough_iteration();
  CHECK(s.phase() == IterationPhase::kIdle);
  CHECK(s.iterations() == 2);
  CHECK(s.previous_forward_order() == Order{u[0]});  // one rank keeps no order to prefetch by

  CHECK_FALSE(s.checked_sharded_use());
  s.mark_sharded_use_checked();
  CHECK(s.checked_sharded_use());
}

TEST_CASE("BackwardReductionQueue: reverse forward order, waiting for the next unit to be ready",
          "[fsdp][reduction]") {
  FakeUnits u;
  const Order order{u[0], u[1], u[2], u[3]};  // forward order a, b, c, d
  RecordingSteps steps;
  steps.names = {{u[0], "a"}, {u[1], "b"}, {u[2], "c"}, {u[3], "d"}};
  BackwardReductionQueue q;
  q.begin_pass(/*graph_task=*/5);
  CHECK(q.graph_task() == 5);

  steps.ready_units = {u[3], u[1]};  // b is ready before c: it still waits for c
  q.advance(order, /*final=*/false, steps);
  CHECK(steps.log == Log{"reduce d"});
  CHECK(q.reduced_from_back() == 1);
  steps.ready_units.insert(u[2]);
  q.advance(order, false, steps);
  CHECK(steps.log == Log{"reduce d", "reduce c", "reduce b"});
  CHECK(q.reduced_from_back() == 3);
  // The end of the pass reduces the rest whether ready or not, without asking.
  const int asked = steps.ready_asked;
  q.advance(order, /*final=*/true, steps);
  CHECK(steps.log == Log{"reduce d", "reduce c", "reduce b", "reduce a"});
  CHECK(steps.ready_asked == asked);
  CHECK(q.reduced_from_back() == 4);
  q.advance(order, true, steps);  // nothing left
  CHECK(steps.log.size() == 4);
  q.end_pass();
  CHECK(q.graph_task() == -1);
}

TEST_CASE("BackwardReductionQueue: deferred units reduced at the end in the order deferred; skipped units never",
          "[fsdp][reduction]") {
  using Turn = BackwardReductionQueue::Turn;
  FakeUnits u;
  const Order order{u[0], u[1], u[2], u[3], u[4]};  // a, b, c, d, e
  RecordingSteps steps;
  steps.names = {{u[0], "a"}, {u[1], "b"}, {u[2], "c"}, {u[3], "d"}, {u[4], "e"}};
  steps.turns = {{u[3], Turn::kDefer}, {u[2], Turn::kSkip}, {u[1], Turn::kDefer}};
  steps.ready_units = {u[4], u[0]};
  BackwardReductionQueue q;
  q.begin_pass(1);
  q.advance(order, false, steps);
  // A deferred or skipped unit does not hold up the ones before it.
  CHECK(steps.log == Log{"reduce e", "skip c", "reduce a"});
  CHECK(q.deferred() == Order{u[3], u[1]});
  CHECK(q.reduced_from_back() == 5);
  q.advance(order, true, steps);
  CHECK(steps.log == Log{"reduce e", "skip c", "reduce a", "reduce d", "reduce b"});
  CHECK(q.deferred().empty());

  // The unit awaiting finalization, and a new pass.
  q.set_awaiting_finalize(u[0]);
  CHECK(q.awaiting_finalize() == u[0]);
  q.begin_pass(2);
  CHECK(q.awaiting_finalize() == nullptr);
  CHECK(q.reduced_from_back() == 0);
  CHECK(q.graph_task() == 2);
  steps.log.clear();
  steps.ready_units.clear();
  q.advance(order, false, steps);  // e is not ready: nothing reduced
  CHECK(steps.log.empty());
  CHECK(q.reduced_from_back() == 0);
  q.discard();
  CHECK(q.graph_task() == -1);
  CHECK(q.reduced_from_back() == 0);
  CHECK(q.deferred().empty());
}

TEST_CASE("RootContext: iteration, backward pass and discard move every part together", "[fsdp][root_context]") {
  unsetenv("FSDP_DEBUG");
  auto root_module = std::make_shared<torch::nn::Module>();
  auto child_module = std::make_shared<torch::nn::Module>();
  // Units without parameters (nothing to communicate: no communicator needed).
  auto root = fsdp::testing::make_unit(*root_module, "<root>", nullptr);
  auto child = fsdp::testing::make_unit(*child_module, "child", nullptr);
  fsdp::RootContext context(*root, {root.get(), child.get()}, {{child.get(), {root.get()}}});
  CHECK(context.root() == root.get());
  CHECK(context.states() == Order{root.get(), child.get()});
  CHECK(context.passthrough());  // no handle gathers anything
  CHECK(context.scheduler().max_unsharded() == 2);
  CHECK_FALSE(context.divergence().enabled());

  bool first = false;
  child->iteration().begin_call(/*grad_enabled=*/true, &first);
  CHECK(first);
  context.begin_iteration();
  CHECK(context.iteration_state().generation() == 1);
  CHECK_FALSE(child->iteration().ran_forward());  // every unit's calls forgotten
  CHECK(context.divergence().enabled());          // the first iteration is checked
  context.iteration_state().enter_root_forward(false);
  context.iteration_state().record_first_call(*root);
  context.iteration_state().exit_root_forward();

  context.begin_backward_pass(/*graph_task=*/9);
  CHECK(context.iteration_state().phase() == IterationPhase::kBackward);
  CHECK(context.reductions().graph_task() == 9);
  context.reductions().set_awaiting_finalize(root.get());
  context.end_backward_pass();
  CHECK(context.iteration_state().phase() == IterationPhase::kIdle);
  CHECK(context.iteration_state().iterations() == 1);
  CHECK(context.reductions().graph_task() == -1);
  CHECK(context.reductions().awaiting_finalize() == nullptr);
  CHECK(context.iteration_state().previous_forward_order() == Order{root.get()});

  context.begin_iteration();
  CHECK_FALSE(context.divergence().enabled());  // later iterations are not (without FSDP_DEBUG=1)
  setenv("FSDP_DEBUG", "1", 1);
  context.begin_iteration();
  CHECK(context.divergence().enabled());
  unsetenv("FSDP_DEBUG");
  context.iteration_state().enter_root_forward(false);
  context.begin_backward_pass(3);
  context.discard();
  CHECK(context.iteration_state().phase() == IterationPhase::kIdle);
  CHECK_FALSE(context.iteration_state().in_root_forward());
  CHECK(context.reductions().graph_task() == -1);
  CHECK(context.iteration_state().iterations() == 1);
  CHECK(context.scheduler().in_flight().empty());
  context.check_ranks_agree(fsdp::Fingerprint("no communicator: nothing exchanged"));

  // The limit comes from the root (at least 1).
  fsdp::testing::UnitOptions o;
  o.max_unshards_in_flight = 5;
  auto root5 = fsdp::testing::make_unit(*root_module, "<root>", nullptr, o);
  fsdp::RootContext context5(*root5, {root5.get()}, {});
  CHECK(context5.scheduler().max_unsharded() == 5);
}

TEST_CASE("prefetch_targets: the next unit in the order, or the explicit targets", "[fsdp][prefetch]") {
  auto root_module = std::make_shared<torch::nn::Module>();
  auto a = fsdp::testing::make_unit(*root_module, "a", nullptr);
  auto b = fsdp::testing::make_unit(*root_module, "b", nullptr);
  auto c = fsdp::testing::make_unit(*root_module, "c", nullptr);
  const Order order{a.get(), b.get(), c.get()};
  CHECK(fsdp::prefetch_targets(*b, nullptr, order, +1) == Order{c.get()});
  CHECK(fsdp::prefetch_targets(*b, nullptr, order, -1) == Order{a.get()});
  CHECK(fsdp::prefetch_targets(*c, nullptr, order, +1).empty());
  CHECK(fsdp::prefetch_targets(*a, nullptr, order, -1).empty());
  CHECK(fsdp::prefetch_targets(*a, nullptr, Order{b.get()}, +1).empty());  // not in the order
  const Order explicit_targets{c.get(), a.get()};
  CHECK(fsdp::prefetch_targets(*b, &explicit_targets, order, +1) == explicit_targets);
}

TEST_CASE("SetAsideGradients: added back at the end of a pass, restored when it threw", "[fsdp][passthrough]") {
  at::Tensor p = at::zeros({2}).requires_grad_();
  at::Tensor q = at::zeros({2}).requires_grad_();
  at::Tensor w = at::zeros({2}).requires_grad_();
  p.mutable_grad() = at::tensor({1.0f, 2.0f});
  w.mutable_grad() = at::tensor({7.0f, 8.0f});
  fsdp::SetAsideGradients saved;
  saved.set_aside(p);
  saved.set_aside(q);
  saved.set_aside(w);
  CHECK_FALSE(saved.empty());
  CHECK_FALSE(p.grad().defined());
  CHECK_FALSE(w.grad().defined());
  // The pass computes gradients for p and q, none for w.
  p.mutable_grad() = at::tensor({10.0f, 20.0f});
  q.mutable_grad() = at::tensor({5.0f, 6.0f});
  saved.add_back();
  CHECK(saved.empty());
  CHECK(p.grad().equal(at::tensor({11.0f, 22.0f})));
  CHECK(q.grad().equal(at::tensor({5.0f, 6.0f})));
  CHECK(w.grad().equal(at::tensor({7.0f, 8.0f})));

  saved.set_aside(p);
  saved.set_aside(q);
  p.mutable_grad() = at::tensor({100.0f, 100.0f});  // the pass throws after this
  saved.restore();
  CHECK(p.grad().equal(at::tensor({11.0f, 22.0f})));
  CHECK(q.grad().equal(at::tensor({5.0f, 6.0f})));
}

TEST_CASE("HiddenParams: an empty placeholder while hidden, the data back when shown", "[fsdp][hidden]") {
  at::Tensor p = at::arange(6, at::kFloat).view({2, 3}).requires_grad_();
  at::Tensor q = at::arange(4, at::kDouble).requires_grad_();
  const void* identity = p.unsafeGetTensorImpl();
  fsdp::HiddenParams hidden;
  CHECK(hidden.empty());
  hidden.hide(p);
  hidden.hide(p);  // once
  hidden.hide(q);
  CHECK(hidden.size() == 2);
  CHECK(hidden.hides(p));
  CHECK((p.dim() == 1 && p.numel() == 0));
  CHECK(p.scalar_type() == at::kFloat);
  CHECK((q.dim() == 1 && q.numel() == 0));
  CHECK(q.scalar_type() == at::kDouble);
  q.set_data(at::ones({3}, at::kDouble));  // new data while hidden: kept
  hidden.show_all();
  CHECK(hidden.empty());
  CHECK_FALSE(hidden.hides(p));
  CHECK(p.unsafeGetTensorImpl() == identity);
  CHECK(p.equal(at::arange(6, at::kFloat).view({2, 3})));
  CHECK(q.equal(at::ones({3}, at::kDouble)));
}
