// The schedules' orders (pipeline/schedule_order.h): every stage runs each microbatch's forward
// and backward once, in microbatch order, on the rank that holds it; no order waits in a cycle;
// the simulated bubble of GPipe and 1F1B is the closed form (p - 1) / (m + p - 1), interleaved
// 1F1B's is smaller; 1F1B holds at most p - s microbatches on stage s, GPipe m; bad layouts are
// refused naming the schedule and the values.
#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <c10/util/Exception.h>

#include "fsdp_cpp/pipeline/schedule_order.h"

#include <catch2/catch.hpp>

using fsdp::pipeline::Action;
using fsdp::pipeline::ScheduleKind;

namespace {

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

// Checks every rank's order; returns the most microbatches stage s holds at once.
std::map<int, int> check_orders(ScheduleKind kind, int p, int n_stages, int m) {
  std::map<int, int> peak;
  std::set<std::tuple<int, int, int>> seen;
  for (int r = 0; r < p; ++r) {
    const auto order = fsdp::pipeline::schedule_order(kind, r, p, n_stages, m);
    CHECK(order.size() == static_cast<size_t>(2 * m * (n_stages / p)));
    std::map<int, int> next_f, next_b, live;
    for (const Action& a : order) {
      CHECK(a.stage % p == r);
      const bool fwd = a.type == Action::Type::kForward;
      CHECK(seen.insert({fwd ? 0 : 1, a.stage, a.microbatch}).second);
      int& next = fwd ? next_f[a.stage] : next_b[a.stage];
      CHECK(a.microbatch == next);  // microbatch order per stage and direction
      ++next;
      if (!fwd) CHECK(next_f[a.stage] > a.microbatch);  // its own forward ran before
      live[a.stage] += fwd ? 1 : -1;
      peak[a.stage] = std::max(peak[a.stage], live[a.stage]);
    }
  }
  CHECK(seen.size() == static_cast<size_t>(2 * m * n_stages));
  return peak;
}

}  // namespace

TEST_CASE("GPipe and 1F1B orders: each microbatch once per stage, no cycle, the closed-form bubble", "[pipeline]") {
  for (ScheduleKind kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B}) {
    for (int p : {1, 2, 3, 4, 8}) {
      for (int m : {1, 2, 3, 4, 8, 16}) {
        CAPTURE(fsdp::pipeline::schedule_name(kind), p, m);
        const auto peak = check_orders(kind, p, p, m);
        for (int s = 0; s < p; ++s) {
          CHECK(peak.at(s) == (kind == ScheduleKind::kGPipe ? m : std::min(p - s, m)));
        }
        const auto sim = fsdp::pipeline::simulate_schedule(kind, p, p, m);
        CHECK(sim.slots == 2 * (m + p - 1));
        CHECK(sim.bubble_fraction == Approx(static_cast<double>(p - 1) / (m + p - 1)).margin(1e-12));
      }
    }
  }
}

TEST_CASE("1F1B order of the middle stage of 4", "[pipeline]") {
  const auto order = fsdp::pipeline::schedule_order(ScheduleKind::k1F1B, 1, 4, 4, 6);
  std::string s;
  for (const Action& a : order) s += fsdp::pipeline::to_string(a) + " ";
  CHECK(s == "F(1,0) F(1,1) F(1,2) B(1,0) F(1,3) B(1,1) F(1,4) B(1,2) F(1,5) B(1,3) B(1,4) B(1,5) ");
}

TEST_CASE("interleaved 1F1B: every chunk once per microbatch, no cycle, less bubble than 1F1B", "[pipeline]") {
  for (int p : {1, 2, 3, 4}) {
    for (int v : {1, 2, 3}) {
      for (int k : {1, 2, 3}) {
        const int m = k * p;
        CAPTURE(p, v, m);
        check_orders(ScheduleKind::kInterleaved1F1B, p, p * v, m);
        const auto sim = fsdp::pipeline::simulate_schedule(ScheduleKind::kInterleaved1F1B, p, p * v, m);
        // Chunks are 1/v of a stage: in units of a whole stage's forward the step is slots / v.
        const double one_f_one_b = static_cast<double>(p - 1) / (m + p - 1);
        if (v > 1 && p > 1) {
          CHECK(sim.bubble_fraction < one_f_one_b);
        } else {
          CHECK(sim.bubble_fraction <= one_f_one_b + 1e-12);
        }
      }
    }
  }
  // Megatron's closed form for the interleaved schedule: bubble time (p - 1) / v per microbatch
  // time, i.e. a fraction (p - 1) / (v m + p - 1) when forward and backward cost the same.
  const auto sim = fsdp::pipeline::simulate_schedule(ScheduleKind::kInterleaved1F1B, 4, 8, 8);
  CHECK(sim.bubble_fraction == Approx(3.0 / (2 * 8 + 3)).margin(1e-12));
}

TEST_CASE("schedules refuse layouts they cannot run, naming the schedule and the values", "[pipeline]") {
  using fsdp::pipeline::check_schedule;
  auto e = error_of([] { check_schedule(ScheduleKind::k1F1B, 2, 4, 4); });
  CHECK_THAT(e, Catch::Contains("1f1b") && Catch::Contains("2 stages") && Catch::Contains("got 4") &&
                    Catch::Contains("interleaved_1f1b"));
  e = error_of([] { check_schedule(ScheduleKind::kInterleaved1F1B, 2, 4, 3); });
  CHECK_THAT(e, Catch::Contains("multiple of the pipeline group's 2 ranks") && Catch::Contains("got 3 microbatches"));
  e = error_of([] { check_schedule(ScheduleKind::kInterleaved1F1B, 4, 6, 4); });
  CHECK_THAT(e, Catch::Contains("got 6 stages"));
  e = error_of([] { check_schedule(ScheduleKind::kGPipe, 2, 2, 0); });
  CHECK_THAT(e, Catch::Contains("at least 1 microbatch") && Catch::Contains("got 0"));
  e = error_of([] { fsdp::pipeline::parse_schedule("zb"); });
  CHECK_THAT(e, Catch::Contains("gpipe, 1f1b, interleaved_1f1b") && Catch::Contains("'zb'"));
  CHECK(fsdp::pipeline::parse_schedule("interleaved_1f1b") == ScheduleKind::kInterleaved1F1B);
}
