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

namespace {

using fsdp::pipeline::ProgramStep;

// What a transfer carries: ('S' shape | 'A' activation | 'G' gradient, stage boundary, microbatch).
using Label = std::tuple<char, int, int>;

Label label_of(const ProgramStep& ps) {
  const bool fwd = ps.action.type == Action::Type::kForward;
  const bool shape = ps.kind == ProgramStep::Kind::kRecvShape || ps.kind == ProgramStep::Kind::kSendShape;
  return {shape ? 'S' : (fwd ? 'A' : 'G'), ps.boundary, ps.action.microbatch};
}

std::string describe(const Label& l) {
  return std::string(1, std::get<0>(l)) + "(b" + std::to_string(std::get<1>(l)) + ",mb" + std::to_string(std::get<2>(l)) + ")";
}

// Replays every rank's program ([Note: rank programs]) of one layout; returns what is wrong (empty
// when nothing): per ordered rank pair, the receives posted must be the sends issued, in the same
// order (c10d's NCCL backend ignores tags); each action runs once, in schedule_order's order, after
// the receive it needs was posted; and executed with blocking receives (a shape receive, and an
// action whose input comes from another rank, wait for the matching send; sends never block) the
// programs finish.
std::string replay(ScheduleKind kind, int p, int n_stages, int m, bool shapes_known) {
  std::vector<std::vector<ProgramStep>> programs;
  for (int r = 0; r < p; ++r) programs.push_back(fsdp::pipeline::rank_program(kind, r, p, n_stages, m, shapes_known));
  std::map<std::pair<int, int>, std::vector<Label>> sends, recvs;  // (src, dst)
  // For each rank's blocking steps: which pair and which position in that pair's order they wait for.
  std::vector<std::vector<std::pair<std::pair<int, int>, size_t>>> waits(p);
  for (int r = 0; r < p; ++r) {
    std::vector<Action> runs;
    std::set<std::tuple<int, int, int>> posted;
    std::map<std::tuple<int, int, int>, std::pair<std::pair<int, int>, size_t>> recv_of;
    waits[r].assign(programs[r].size(), {{-1, -1}, 0});
    for (size_t i = 0; i < programs[r].size(); ++i) {
      const ProgramStep& ps = programs[r][i];
      const bool fwd = ps.action.type == Action::Type::kForward;
      const auto key = std::make_tuple(fwd ? 0 : 1, ps.action.stage, ps.action.microbatch);
      switch (ps.kind) {
        case ProgramStep::Kind::kSend:
        case ProgramStep::Kind::kSendShape:
          if (ps.peer == r) return "rank " + std::to_string(r) + " sends to itself: " + fsdp::pipeline::to_string(ps);
          sends[{r, ps.peer}].push_back(label_of(ps));
          break;
        case ProgramStep::Kind::kRecvShape:
        case ProgramStep::Kind::kPostRecv: {
          if (ps.peer == r) return "rank " + std::to_string(r) + " receives from itself: " + fsdp::pipeline::to_string(ps);
          auto& list = recvs[{ps.peer, r}];
          list.push_back(label_of(ps));
          if (ps.kind == ProgramStep::Kind::kRecvShape) {
            waits[r][i] = {{ps.peer, r}, list.size()};
          } else {
            if (!posted.insert(key).second) return "rank " + std::to_string(r) + " posts twice: " + fsdp::pipeline::to_string(ps);
            recv_of[key] = {{ps.peer, r}, list.size()};
          }
          break;
        }
        case ProgramStep::Kind::kRun: {
          runs.push_back(ps.action);
          const int peer_stage = fwd ? ps.action.stage - 1 : ps.action.stage + 1;
          const bool remote = peer_stage >= 0 && peer_stage < n_stages && peer_stage % p != r;
          if (remote) {
            auto it = recv_of.find(key);
            if (it == recv_of.end()) {
              return "rank " + std::to_string(r) + " runs " + fsdp::pipeline::to_string(ps.action) +
                     " before posting its receive";
            }
            waits[r][i] = it->second;
          }
          break;
        }
      }
    }
    if (runs != fsdp::pipeline::schedule_order(kind, r, p, n_stages, m)) {
      return "rank " + std::to_string(r) + " runs its actions in another order than schedule_order";
    }
  }
  for (const auto& [pair, sent] : sends) {
    const auto& received = recvs[pair];
    if (sent != received) {
      size_t k = 0;
      while (k < sent.size() && k < received.size() && sent[k] == received[k]) ++k;
      return "rank " + std::to_string(pair.first) + " -> rank " + std::to_string(pair.second) + ": transfer " +
             std::to_string(k) + " is sent as " + (k < sent.size() ? describe(sent[k]) : "nothing") +
             " but received as " + (k < received.size() ? describe(received[k]) : "nothing");
    }
  }
  for (const auto& [pair, received] : recvs) {
    if (!received.empty() && sends[pair].empty()) {
      return "rank " + std::to_string(pair.second) + " receives from rank " + std::to_string(pair.first) + " which sends nothing";
    }
  }
  // Execution: a blocking step waits until its pair's sender issued that many sends.
  std::vector<size_t> pc(p, 0);
  std::map<std::pair<int, int>, size_t> issued;
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < p; ++r) {
      while (pc[r] < programs[r].size()) {
        const auto& [pair, needed] = waits[r][pc[r]];
        if (pair.first >= 0 && issued[pair] < needed) break;
        const ProgramStep& ps = programs[r][pc[r]];
        if (ps.kind == ProgramStep::Kind::kSend || ps.kind == ProgramStep::Kind::kSendShape) ++issued[{r, ps.peer}];
        ++pc[r];
        progress = true;
      }
    }
  }
  for (int r = 0; r < p; ++r) {
    if (pc[r] < programs[r].size()) {
      return "the programs wait in a cycle: rank " + std::to_string(r) + " is stuck at " +
             fsdp::pipeline::to_string(programs[r][pc[r]]);
    }
  }
  return "";
}

}  // namespace

TEST_CASE("rank programs: every pair's receive order equals the peer's send order, p <= 8, v <= 4, m <= 16", "[pipeline][programs]") {
  int layouts = 0;
  std::vector<std::string> failures;
  for (ScheduleKind kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved1F1B}) {
    for (int p = 1; p <= 8; ++p) {
      for (int v = 1; v <= (kind == ScheduleKind::kInterleaved1F1B ? 4 : 1); ++v) {
        for (int m = 1; m <= 16; ++m) {
          if (kind == ScheduleKind::kInterleaved1F1B && m % p != 0) continue;
          for (bool shapes_known : {false, true}) {
            ++layouts;
            const std::string wrong = replay(kind, p, p * v, m, shapes_known);
            if (!wrong.empty()) {
              failures.push_back(fsdp::pipeline::schedule_name(kind) + " p=" + std::to_string(p) + " v=" +
                                 std::to_string(v) + " m=" + std::to_string(m) +
                                 (shapes_known ? "" : " (shapes agreed)") + ": " + wrong);
            }
          }
        }
      }
    }
  }
  INFO(layouts << " layouts; first failures:\n"
               << (failures.size() > 0 ? failures[0] : "") << "\n" << (failures.size() > 1 ? failures[1] : ""));
  CHECK(layouts == 2 * (2 * 8 * 16 + 4 * (16 + 8 + 5 + 4 + 3 + 2 + 2 + 2)));
  CHECK(failures.empty());
}

// The programs of a 2-rank 1F1B step with 2 microbatches that agrees shapes: the receiver waits
// for the shape, then posts each activation's receive one action ahead.
TEST_CASE("rank programs: a 2-rank 1F1B step, shapes first", "[pipeline][programs]") {
  std::vector<std::string> rank0, rank1;
  for (const auto& ps : fsdp::pipeline::rank_program(ScheduleKind::k1F1B, 0, 2, 2, 2, false)) rank0.push_back(fsdp::pipeline::to_string(ps));
  for (const auto& ps : fsdp::pipeline::rank_program(ScheduleKind::k1F1B, 1, 2, 2, 2, false)) rank1.push_back(fsdp::pipeline::to_string(ps));
  CHECK(rank0 == std::vector<std::string>{
                     "run F(0,0)", "send shape of F(0,0) to 1 [boundary 0]", "send F(0,0) to 1 [boundary 0]",
                     "post recv B(0,0) from 1 [boundary 0]", "run F(0,1)", "send F(0,1) to 1 [boundary 0]",
                     "post recv B(0,1) from 1 [boundary 0]", "run B(0,0)", "run B(0,1)"});
  CHECK(rank1 == std::vector<std::string>{
                     "recv shape for F(1,0) from 0 [boundary 0]", "post recv F(1,0) from 0 [boundary 0]",
                     "run F(1,0)", "post recv F(1,1) from 0 [boundary 0]", "run B(1,0)",
                     "send B(1,0) to 0 [boundary 0]", "run F(1,1)", "run B(1,1)", "send B(1,1) to 0 [boundary 0]"});
}
