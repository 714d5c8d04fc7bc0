#include "fsdp_cpp/pipeline/schedule_order.h"

#include <algorithm>
#include <map>
#include <set>
#include <sstream>
#include <tuple>
#include <utility>

#include <c10/util/Exception.h>

namespace fsdp::pipeline {

std::string schedule_name(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kGPipe: return "gpipe";
    case ScheduleKind::k1F1B: return "1f1b";
    case ScheduleKind::kInterleaved1F1B: return "interleaved_1f1b";
  }
  return "?";
}

ScheduleKind parse_schedule(const std::string& name) {
  for (ScheduleKind kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved1F1B}) {
    if (schedule_name(kind) == name) return kind;
  }
  TORCH_CHECK(false, "fsdp::pipeline::parse_schedule: expected one of gpipe, 1f1b, interleaved_1f1b, got '",
              name, "'");
}

std::string to_string(const Action& action) {
  std::ostringstream out;
  out << (action.type == Action::Type::kForward ? "F(" : "B(") << action.stage << "," << action.microbatch << ")";
  return out.str();
}

void check_schedule(ScheduleKind kind, int pp_size, int n_stages, int n_microbatches) {
  const std::string name = schedule_name(kind);
  TORCH_CHECK(pp_size >= 1, "fsdp::pipeline: schedule ", name, " expected a pipeline group of at least 1 rank, got ",
              pp_size);
  TORCH_CHECK(n_microbatches >= 1, "fsdp::pipeline: schedule ", name, " expected at least 1 microbatch, got ",
              n_microbatches);
  if (kind == ScheduleKind::kInterleaved1F1B) {
    TORCH_CHECK(n_stages >= pp_size && n_stages % pp_size == 0, "fsdp::pipeline: schedule ", name,
                " expected a number of stages that is a multiple of the pipeline group's ", pp_size,
                " ranks (each rank holds the same number of stage chunks), got ", n_stages, " stages");
    TORCH_CHECK(n_microbatches % pp_size == 0, "fsdp::pipeline: schedule ", name,
                " expected a number of microbatches that is a multiple of the pipeline group's ", pp_size,
                " ranks, got ", n_microbatches, " microbatches");
  } else {
    TORCH_CHECK(n_stages == pp_size, "fsdp::pipeline: schedule ", name, " runs one stage per rank: expected ",
                pp_size, " stages for a pipeline group of ", pp_size, " ranks, got ", n_stages,
                n_stages > pp_size ? " (several stages per rank need interleaved_1f1b)" : "");
  }
}

namespace {

Action forward(int stage, int mb) { return {Action::Type::kForward, stage, mb}; }
Action backward(int stage, int mb) { return {Action::Type::kBackward, stage, mb}; }

std::vector<Action> gpipe(int stage, int m) {
  std::vector<Action> out;
  for (int i = 0; i < m; ++i) out.push_back(forward(stage, i));
  for (int i = 0; i < m; ++i) out.push_back(backward(stage, i));
  return out;
}

std::vector<Action> one_f_one_b(int stage, int p, int m) {
  const int warmup = std::min(p - 1 - stage, m);
  std::vector<Action> out;
  for (int i = 0; i < warmup; ++i) out.push_back(forward(stage, i));
  for (int i = 0; i < m - warmup; ++i) {
    out.push_back(forward(stage, warmup + i));
    out.push_back(backward(stage, i));
  }
  for (int i = m - warmup; i < m; ++i) out.push_back(backward(stage, i));
  return out;
}

// Megatron-LM's interleaved order: the k-th forward (backward) of rank r runs chunk
// (k mod (p v)) / p (reversed for backwards) on microbatch (k / (p v)) p + k mod p.
std::vector<Action> interleaved(int rank, int p, int v, int m) {
  const int total = m * v;
  int warmup = (m == p) ? total : std::min((p - rank - 1) * 2 + (v - 1) * p, total);
  auto action = [&](int k, bool fwd) {
    const int chunk = (k % (p * v)) / p;
    const int mb = (k / (p * v)) * p + k % p;
    const int c = fwd ? chunk : v - 1 - chunk;
    return fwd ? forward(c * p + rank, mb) : backward(c * p + rank, mb);
  };
  std::vector<Action> out;
  for (int k = 0; k < warmup; ++k) out.push_back(action(k, true));
  for (int k = 0; k < total - warmup; ++k) {
    out.push_back(action(warmup + k, true));
    out.push_back(action(k, false));
  }
  for (int k = total - warmup; k < total; ++k) out.push_back(action(k, false));
  return out;
}

}  // namespace

std::vector<Action> schedule_order(ScheduleKind kind, int pp_rank, int pp_size, int n_stages,
                                   int n_microbatches) {
  check_schedule(kind, pp_size, n_stages, n_microbatches);
  TORCH_CHECK(pp_rank >= 0 && pp_rank < pp_size, "fsdp::pipeline::schedule_order: expected a rank in [0, ",
              pp_size, "), got ", pp_rank);
  switch (kind) {
    case ScheduleKind::kGPipe: return gpipe(pp_rank, n_microbatches);
    case ScheduleKind::k1F1B: return one_f_one_b(pp_rank, pp_size, n_microbatches);
    case ScheduleKind::kInterleaved1F1B:
      return interleaved(pp_rank, pp_size, n_stages / pp_size, n_microbatches);
  }
  return {};
}

SimulatedStep simulate_schedule(ScheduleKind kind, int pp_size, int n_stages, int n_microbatches,
                                int backward_cost) {
  std::vector<std::vector<Action>> orders;
  for (int r = 0; r < pp_size; ++r) orders.push_back(schedule_order(kind, r, pp_size, n_stages, n_microbatches));
  // Finish time of each action, keyed by (type, stage, microbatch).
  std::map<std::tuple<int, int, int>, int> done;
  auto key = [](Action::Type t, int s, int mb) { return std::make_tuple(static_cast<int>(t), s, mb); };
  std::vector<size_t> next(pp_size, 0);
  std::vector<int> free_at(pp_size, 0);
  int busy = 0;
  size_t remaining = 0;
  for (const auto& order : orders) remaining += order.size();
  while (remaining > 0) {
    bool progressed = false;
    for (int r = 0; r < pp_size; ++r) {
      while (next[r] < orders[r].size()) {
        const Action& a = orders[r][next[r]];
        std::vector<std::tuple<int, int, int>> deps;
        if (a.type == Action::Type::kForward) {
          if (a.stage > 0) deps.push_back(key(Action::Type::kForward, a.stage - 1, a.microbatch));
        } else {
          deps.push_back(key(Action::Type::kForward, a.stage, a.microbatch));
          if (a.stage < n_stages - 1) deps.push_back(key(Action::Type::kBackward, a.stage + 1, a.microbatch));
        }
        int start = free_at[r];
        bool ready = true;
        for (const auto& d : deps) {
          auto it = done.find(d);
          if (it == done.end()) { ready = false; break; }
          start = std::max(start, it->second);
        }
        if (!ready) break;
        const int cost = a.type == Action::Type::kForward ? 1 : backward_cost;
        free_at[r] = start + cost;
        busy += cost;
        done[key(a.type, a.stage, a.microbatch)] = free_at[r];
        ++next[r];
        --remaining;
        progressed = true;
      }
    }
    if (!progressed) {
      std::ostringstream stuck;
      for (int r = 0; r < pp_size; ++r) {
        if (next[r] < orders[r].size()) stuck << " rank " << r << " at " << to_string(orders[r][next[r]]) << ";";
      }
      TORCH_CHECK(false, "fsdp::pipeline: schedule ", schedule_name(kind), " deadlocks with ", pp_size,
                  " ranks, ", n_stages, " stages and ", n_microbatches, " microbatches:", stuck.str());
    }
  }
  SimulatedStep step;
  step.slots = *std::max_element(free_at.begin(), free_at.end());
  step.bubble_fraction = 1.0 - static_cast<double>(busy) / (static_cast<double>(pp_size) * step.slots);
  return step;
}

std::string to_string(const ProgramStep& step) {
  std::ostringstream out;
  switch (step.kind) {
    case ProgramStep::Kind::kRecvShape: out << "recv shape for "; break;
    case ProgramStep::Kind::kPostRecv: out << "post recv "; break;
    case ProgramStep::Kind::kRun: out << "run "; break;
    case ProgramStep::Kind::kSendShape: out << "send shape of "; break;
    case ProgramStep::Kind::kSend: out << "send "; break;
  }
  out << to_string(step.action);
  if (step.kind == ProgramStep::Kind::kRecvShape || step.kind == ProgramStep::Kind::kPostRecv) {
    out << " from " << step.peer << " [boundary " << step.boundary << "]";
  } else if (step.kind != ProgramStep::Kind::kRun) {
    out << " to " << step.peer << " [boundary " << step.boundary << "]";
  }
  return out.str();
}

std::vector<ProgramStep> rank_program(ScheduleKind kind, int pp_rank, int pp_size, int n_stages, int n_microbatches,
                                      bool shapes_known) {
  const std::vector<Action> order = schedule_order(kind, pp_rank, pp_size, n_stages, n_microbatches);
  auto rank_of = [&](int stage) { return stage % pp_size; };
  // Boundaries whose activation shape this rank knows (sends and receives alike: a rank holds
  // either side of a boundary to another rank, never both).
  std::vector<bool> known(static_cast<size_t>(std::max(n_stages - 1, 0)), shapes_known);
  std::set<std::tuple<int, int, int>> posted;  // (0 forward / 1 backward, stage, microbatch)
  std::set<std::pair<int, int>> forwarded;     // (stage, microbatch) whose forward ran
  std::vector<ProgramStep> program;
  auto post = [&](const Action& a, bool may_wait_for_shape) {
    const bool fwd = a.type == Action::Type::kForward;
    const int peer_stage = fwd ? a.stage - 1 : a.stage + 1;
    if (peer_stage < 0 || peer_stage >= n_stages || rank_of(peer_stage) == pp_rank) return;
    const auto key = std::make_tuple(fwd ? 0 : 1, a.stage, a.microbatch);
    if (posted.count(key)) return;
    const int src = rank_of(peer_stage);
    const int b = fwd ? a.stage - 1 : a.stage;
    if (fwd && !known[b]) {
      if (!may_wait_for_shape) return;
      program.push_back({ProgramStep::Kind::kRecvShape, a, src, b});
      known[b] = true;
    }
    if (!fwd && !forwarded.count({a.stage, a.microbatch})) return;  // its output's shape is not known yet
    program.push_back({ProgramStep::Kind::kPostRecv, a, src, b});
    posted.insert(key);
  };
  for (size_t i = 0; i < order.size(); ++i) {
    const Action& a = order[i];
    post(a, /*may_wait_for_shape=*/true);
    if (i + 1 < order.size()) post(order[i + 1], /*may_wait_for_shape=*/false);
    program.push_back({ProgramStep::Kind::kRun, a, -1, -1});
    if (a.type == Action::Type::kForward) {
      forwarded.insert({a.stage, a.microbatch});
      const int next = a.stage + 1;
      if (next < n_stages && rank_of(next) != pp_rank) {
        if (!known[a.stage]) {
          program.push_back({ProgramStep::Kind::kSendShape, a, rank_of(next), a.stage});
          known[a.stage] = true;
        }
        program.push_back({ProgramStep::Kind::kSend, a, rank_of(next), a.stage});
      }
    } else {
      const int prev = a.stage - 1;
      if (prev >= 0 && rank_of(prev) != pp_rank) {
        program.push_back({ProgramStep::Kind::kSend, a, rank_of(prev), prev});
      }
    }
  }
  return program;
}

}  // namespace fsdp::pipeline
