// Prefetch and overlap over MPI on every world size, checked through the communicator's trace of
// issue/complete order: the implicit and explicit prefetch orders, backward prefetch before or
// after the current unit's gradient computation, and never more all-gathers in flight than the
// limit; training parity holds with every prefetch mode.
#include <algorithm>
#include <stdexcept>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/tests/composable/parity.h"
#include "fsdp_cpp/tests/composable/test_models.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using fsdp::BackwardPrefetch;
using fsdp::comm::CollectiveKind;
using fsdp::comm::TraceEvent;
using fsdp::testing::world;

struct Traced {
  fsdp::testing::MlpStack model{nullptr};
  std::vector<fsdp::FSDPModule> units;  // blocks.0, blocks.1, blocks.2, root
  std::shared_ptr<fsdp::comm::Communicator> comm;
};

Traced build(const fsdp::FullyShardOptions& base) {
  Traced t;
  torch::manual_seed(21);
  t.model = fsdp::testing::MlpStack(4, 8, 8, 3, 2);
  t.comm = std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
  auto o = base;
  o.communicator(t.comm);
  for (size_t i = 0; i < 3; ++i) t.units.push_back(fsdp::fully_shard(t.model->block(i), o));
  t.units.push_back(fsdp::fully_shard(t.model, o));
  return t;
}

// Runs an iteration untraced (the first: lazy initialisation, recorded order), then a traced one.
std::vector<TraceEvent> traced_iteration(Traced& t) {
  t.model(at::randn({2, 4})).pow(2).sum().backward();
  t.comm->set_trace_enabled(true);
  t.model(at::randn({2, 4})).pow(2).sum().backward();
  t.comm->set_trace_enabled(false);
  return t.comm->trace();
}

// One rank has nothing to communicate: its trace must be empty, and there is no order to check.
bool single_rank_trace_is_empty(const std::vector<TraceEvent>& trace) {
  if (world().size() > 1) return false;
  CHECK(trace.empty());
  return true;
}

std::string name(const TraceEvent& e) {
  const char* phase = e.phase == TraceEvent::Phase::kIssued ? "issue " : "done ";
  const char* kind = e.kind == CollectiveKind::kAllGather ? "AG " : e.kind == CollectiveKind::kReduceScatter ? "RS " : "? ";
  return std::string(phase) + kind + e.tag;
}

std::vector<std::string> names(const std::vector<TraceEvent>& trace) {
  std::vector<std::string> out;
  for (const auto& e : trace) out.push_back(name(e));
  return out;
}

int64_t position(const std::vector<std::string>& events, const std::string& event, int occurrence = 1) {
  int seen = 0;
  for (size_t i = 0; i < events.size(); ++i) {
    if (events[i] == event && ++seen == occurrence) return static_cast<int64_t>(i);
  }
  throw std::runtime_error("event '" + event + "' #" + std::to_string(occurrence) + " is not in the trace");
}

int max_all_gathers_in_flight(const std::vector<TraceEvent>& trace) {
  int in_flight = 0, most = 0;
  for (const auto& e : trace) {
    if (e.kind != CollectiveKind::kAllGather) continue;
    in_flight += e.phase == TraceEvent::Phase::kIssued ? 1 : -1;
    most = std::max(most, in_flight);
  }
  return most;
}

std::string dump(const std::vector<std::string>& events) {
  std::string s;
  for (const auto& e : events) s += "\n  " + e;
  return s;
}

}  // namespace

FSDP_RANKS_TEST_CASE("default: backward prefetch before the current unit's gradients, two in flight at most", "[prefetch]") {
  auto t = build(fsdp::FullyShardOptions());
  const auto trace = traced_iteration(t);
  if (single_rank_trace_is_empty(trace)) return;
  const auto ev = names(trace);
  INFO("trace:" << dump(ev));
  // Forward without prefetch: each all-gather completes before the next is issued.
  CHECK(position(ev, "done AG <root>") < position(ev, "issue AG blocks.0"));
  CHECK(position(ev, "done AG blocks.0") < position(ev, "issue AG blocks.1"));
  // Backward: blocks.1 is all-gathered while blocks.2 computes, before blocks.2's reduce-scatter.
  CHECK(position(ev, "issue AG blocks.1", 2) < position(ev, "issue RS blocks.2"));
  CHECK(position(ev, "issue AG blocks.0", 2) < position(ev, "issue RS blocks.1"));
  CHECK(position(ev, "issue AG blocks.1", 2) < position(ev, "done AG blocks.2", 2) + 2);
  CHECK(max_all_gathers_in_flight(trace) <= 2);
}

FSDP_RANKS_TEST_CASE("backward prefetch after the current unit's gradients", "[prefetch]") {
  auto t = build(fsdp::FullyShardOptions().backward_prefetch(BackwardPrefetch::kBackwardPost));
  const auto trace = traced_iteration(t);
  if (single_rank_trace_is_empty(trace)) return;
  const auto ev = names(trace);
  INFO("trace:" << dump(ev));
  CHECK(position(ev, "issue RS blocks.2") < position(ev, "issue AG blocks.1", 2));
  CHECK(position(ev, "issue RS blocks.1") < position(ev, "issue AG blocks.0", 2));
}

FSDP_RANKS_TEST_CASE("no backward prefetch", "[prefetch]") {
  auto t = build(fsdp::FullyShardOptions().backward_prefetch(BackwardPrefetch::kNone));
  const auto trace = traced_iteration(t);
  if (single_rank_trace_is_empty(trace)) return;
  const auto ev = names(trace);
  INFO("trace:" << dump(ev));
  CHECK(position(ev, "issue RS blocks.2") < position(ev, "issue AG blocks.1", 2));
  CHECK(max_all_gathers_in_flight(trace) == 1);
}

FSDP_RANKS_TEST_CASE("forward prefetch follows the previous iteration's order", "[prefetch]") {
  auto t = build(fsdp::FullyShardOptions().forward_prefetch(true));
  const auto trace = traced_iteration(t);
  if (single_rank_trace_is_empty(trace)) return;
  const auto ev = names(trace);
  INFO("trace:" << dump(ev));
  // blocks.0 is in flight while the root's forward starts; blocks.1 while blocks.0 computes.
  CHECK(position(ev, "issue AG blocks.0") < position(ev, "done AG <root>"));
  CHECK(position(ev, "issue AG blocks.1") < position(ev, "done AG blocks.0"));
  CHECK(position(ev, "issue AG blocks.2") < position(ev, "done AG blocks.1"));
  CHECK(max_all_gathers_in_flight(trace) <= 2);
}

FSDP_RANKS_TEST_CASE("explicit prefetch lists and the in-flight limit", "[prefetch]") {
  auto t = build(fsdp::FullyShardOptions().max_unshards_in_flight(2));
  // The root prefetches blocks.1 and blocks.2 in its pre-forward: with the limit of 2 the root's
  // own all-gather must complete before blocks.2's is issued.
  t.units[3].set_modules_to_forward_prefetch({t.units[1], t.units[2]});
  // blocks.2 prefetches blocks.0 (not blocks.1) in backward.
  t.units[2].set_modules_to_backward_prefetch({t.units[0]});
  const auto trace = traced_iteration(t);
  if (single_rank_trace_is_empty(trace)) return;
  const auto ev = names(trace);
  INFO("trace:" << dump(ev));
  CHECK(position(ev, "issue AG blocks.1") < position(ev, "done AG <root>"));
  CHECK(position(ev, "done AG <root>") < position(ev, "issue AG blocks.2"));
  CHECK(position(ev, "issue AG blocks.2") < position(ev, "issue AG blocks.0"));
  CHECK(position(ev, "issue AG blocks.0", 2) < position(ev, "issue AG blocks.1", 2));
  CHECK(max_all_gathers_in_flight(trace) <= 2);

  auto one = build(fsdp::FullyShardOptions().max_unshards_in_flight(1).forward_prefetch(true));
  CHECK(max_all_gathers_in_flight(traced_iteration(one)) <= 1);
}

FSDP_RANKS_TEST_CASE("parity with forward prefetch and backward prefetch after gradients", "[prefetch][parity]") {
  fsdp::testing::ParityOptions o;
  o.optim = fsdp::testing::Optim::kAdamW;
  o.shard_options.forward_prefetch(true).backward_prefetch(BackwardPrefetch::kBackwardPost);
  const auto s = fsdp::testing::mlp_stack_scenario("MLP stack, forward prefetch, backward post");
  fsdp::testing::run_parity(s, o);
}
