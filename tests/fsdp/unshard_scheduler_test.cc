// UnshardScheduler on 2 ranks as threads: the in-flight limit (issuing one more waits for the
// oldest), which units are counted against the limit and the peak, and implicit prefetches skipped
// at the limit while explicit ones are not.
#include <ATen/ATen.h>

#include "fsdp_cpp/fsdp/fsdp_state.h"
#include "fsdp_cpp/fsdp/unshard_scheduler.h"
#include "fsdp_cpp/tests/fsdp/engine_units.h"
#include "fsdp_cpp/tests/testing/thread_backend.h"

// Last: LibTorch's c10/util/Logging.h defines its own CHECK, and the last definition wins.
#include <catch2/catch.hpp>

namespace {

using fsdp::FSDPState;
using fsdp::UnshardScheduler;
using fsdp::testing::Failures;
using fsdp::testing::Leaf;
using fsdp::testing::make_unit;
using fsdp::testing::UnitOptions;

constexpr int kWorld = 2;

// A root (no parameters) and `n` units of 8 elements each, the same on every rank.
struct Tree {
  std::shared_ptr<torch::nn::Module> root_module = std::make_shared<torch::nn::Module>();
  std::vector<std::shared_ptr<Leaf>> modules;
  std::vector<std::shared_ptr<FSDPState>> units;  // [0]: the root
  FSDPState& root() { return *units[0]; }
  FSDPState& unit(size_t i) { return *units[i]; }

  Tree(fsdp::comm::Communicator& comm, int n, std::vector<UnitOptions> options = {}) {
    units.push_back(make_unit(*root_module, "<root>", fsdp::testing::borrow(comm)));
    for (int i = 1; i <= n; ++i) {
      modules.push_back(std::make_shared<Leaf>(8));
      const UnitOptions o = static_cast<size_t>(i - 1) < options.size() ? options[i - 1] : UnitOptions{};
      units.push_back(make_unit(*modules.back(), "u" + std::to_string(i), fsdp::testing::borrow(comm), o));
    }
  }
};

void require_none(Failures& f) {
  for (const auto& s : f.list) FAIL_CHECK(s);
  CHECK(f.list.empty());
}

}  // namespace

TEST_CASE("start_unshard keeps at most max_unsharded all-gathers in flight, waiting for the oldest",
          "[fsdp][scheduler]") {
  Failures f;
  fsdp::testing::run_ranks_as_threads(kWorld, [&](fsdp::comm::Communicator& comm) {
    const int r = comm.rank();
    Tree t(comm, 3);
    FSDPState &a = t.unit(1), &b = t.unit(2), &c = t.unit(3);
    UnshardScheduler s(&t.root(), {}, /*max_unsharded=*/2);
    s.start_unshard(a);
    s.start_unshard(b);
    f.check(s.in_flight() == std::vector<FSDPState*>{&a, &b}, "a, b in flight", r);
    f.check(!a.is_unsharded() && a.unshard_in_flight(), "a not waited for yet", r);
    s.start_unshard(c);  // the limit: waits for a first
    f.check(s.in_flight() == std::vector<FSDPState*>{&b, &c}, "b, c in flight", r);
    f.check(a.is_unsharded() && !a.unshard_in_flight(), "a waited for", r);
    f.check(s.unsharded_units() == std::vector<FSDPState*>{&a, &b, &c}, "a, b, c unsharded", r);
    // Counted: every unit but the root and the running one.
    f.check(s.unsharded_count(t.root()) == 3, "3 counted while the root runs", r);
    f.check(s.unsharded_count(a) == 2, "2 counted while a runs", r);
    s.start_unshard(a);  // unsharded already: nothing issued
    f.check(s.in_flight().size() == 2, "no all-gather for an unsharded unit", r);
    s.reshard(b);  // waits for its all-gather, then frees it
    f.check(s.in_flight() == std::vector<FSDPState*>{&c}, "b no longer in flight", r);
    f.check(s.unsharded_units() == std::vector<FSDPState*>{&a, &c}, "b resharded", r);
    f.check(!b.is_unsharded() && !b.unshard_in_flight(), "b sharded", r);
    s.unshard(c);
    f.check(s.in_flight().empty() && c.is_unsharded(), "unshard waits for c", r);
    s.reshard(a);
    s.reshard(c);
    f.check(s.unsharded_units().empty() && s.unsharded_count(t.root()) == 0, "every unit resharded", r);

    // A limit of 1 (and anything below counts as 1): the second start waits for the first.
    UnshardScheduler one(&t.root(), {}, /*max_unsharded=*/0);
    f.check(one.max_unsharded() == 1, "limit at least 1", r);
    one.start_unshard(a);
    one.start_unshard(b);
    f.check(one.in_flight() == std::vector<FSDPState*>{&b} && a.is_unsharded(), "one in flight", r);
    one.reshard(a);
    one.reshard(b);
  });
  require_none(f);
}

TEST_CASE("the peak counts the running unit and the unsharded units its ancestors and strategy do not exempt",
          "[fsdp][scheduler]") {
  Failures f;
  fsdp::testing::run_ranks_as_threads(kWorld, [&](fsdp::comm::Communicator& comm) {
    const int r = comm.rank();
    UnitOptions shard_grad_op;
    shard_grad_op.reshard_after_forward = false;
    UnitOptions no_shard;
    no_shard.shard = false;
    Tree t(comm, 4, {{}, {}, shard_grad_op, no_shard});
    FSDPState &a = t.unit(1), &b = t.unit(2), &kept = t.unit(3), &replicated = t.unit(4);
    {
      UnshardScheduler s(&t.root(), {}, 2);
      f.check(s.peak_unsharded() == 0, "no peak yet", r);
      s.unshard(a);  // a itself
      f.check(s.peak_unsharded() == 1, "peak 1 after a", r);
      s.unshard(b);  // b and a
      f.check(s.peak_unsharded() == 2, "peak 2 after b", r);
      s.reshard(a);
      s.reshard(b);
      f.check(s.peak_unsharded() == 2, "the peak stays after resharding", r);
      s.reset_peak_unsharded();
      f.check(s.peak_unsharded() == 0, "reset", r);
      s.unshard(t.root());  // the root is never counted
      f.check(s.peak_unsharded() == 0, "root not counted", r);
      // SHARD_GRAD_OP keeps its unit unsharded by strategy; NO_SHARD has nothing to gather.
      s.unshard(kept);
      s.unshard(replicated);
      f.check(s.peak_unsharded() == 0, "strategy-kept and replicated units not counted", r);
      s.unshard(a);
      f.check(s.peak_unsharded() == 1 && s.unsharded_count(b) == 1, "only a counted", r);
      for (auto& u : t.units) s.reshard(*u);
    }
    {
      // b runs inside a (a is its ancestor): a is not counted while b runs.
      fsdp::UnitAncestors ancestors{{&b, {&a}}};
      UnshardScheduler s(&t.root(), ancestors, 2);
      s.unshard(a);
      s.unshard(b);
      f.check(s.peak_unsharded() == 1, "ancestor exempt", r);
      f.check(s.unsharded_count(b) == 0 && s.unsharded_count(a) == 1, "counts per running unit", r);
      s.reshard(a);
      s.reshard(b);
    }
  });
  require_none(f);
}

TEST_CASE("an implicit prefetch is skipped at the limit; an explicit one, or one of a unit kept unsharded, is not",
          "[fsdp][scheduler]") {
  Failures f;
  fsdp::testing::run_ranks_as_threads(kWorld, [&](fsdp::comm::Communicator& comm) {
    const int r = comm.rank();
    UnitOptions shard_grad_op;
    shard_grad_op.reshard_after_forward = false;
    Tree t(comm, 4, {{}, {}, {}, shard_grad_op});
    FSDPState &a = t.unit(1), &b = t.unit(2), &c = t.unit(3), &kept = t.unit(4);
    UnshardScheduler s(&t.root(), {}, /*max_unsharded=*/2);
    s.unshard(a);
    s.prefetch(b, /*running=*/a, /*bounded=*/true);  // a + b = 2: within the limit
    f.check(b.unshard_in_flight(), "b prefetched", r);
    f.check(s.peak_unsharded() == 2, "peak 2 with a running and b in flight", r);
    s.prefetch(c, a, /*bounded=*/true);  // a + b + c would be 3
    f.check(!c.unshard_in_flight() && !c.is_unsharded(), "implicit prefetch of c skipped", r);
    f.check(s.peak_unsharded() == 2, "peak unchanged by the skipped prefetch", r);
    s.prefetch(kept, a, /*bounded=*/true);  // unsharded by its strategy anyway: not bounded
    f.check(kept.unshard_in_flight(), "SHARD_GRAD_OP unit prefetched at the limit", r);
    s.unshard(kept);
    s.prefetch(c, a, /*bounded=*/false);  // explicit targets: issued past the limit
    f.check(c.unshard_in_flight(), "explicit prefetch of c issued", r);
    f.check(s.peak_unsharded() == 3, "peak 3: a, b, c", r);
    s.prefetch(b, a, /*bounded=*/false);  // in flight already: nothing issued
    f.check(s.in_flight() == std::vector<FSDPState*>{&b, &c}, "b, c in flight", r);
    for (auto& u : t.units) s.reshard(*u);
    f.check(s.in_flight().empty() && s.unsharded_units().empty(), "all resharded", r);
  });
  require_none(f);
}
