#pragma once
// The order in which each pipeline rank runs its stages' forwards and backwards, per schedule.
// Pure functions of (schedule, rank, pipeline size, stages, microbatches): every rank computes
// every other rank's order too, so what a rank receives is what its peer sends, in the same order.
//
//   auto actions = fsdp::pipeline::schedule_order(fsdp::pipeline::ScheduleKind::k1F1B,
//                                                 /*pp_rank=*/1, /*pp_size=*/4, /*n_stages=*/4,
//                                                 /*n_microbatches=*/8);
//   // F(1,0) F(1,1) F(1,2) B(1,0) F(1,3) B(1,1) ... B(1,7)
//
// [Note: schedule orders] Stage s lives on pipeline rank s % pp_size (looped placement), so rank r
// holds stages r, r + pp_size, ... (its "chunks"; one chunk unless interleaved).
// - GPipe: every microbatch's forward, then every backward (a stage holds all m microbatches'
//   activations at its peak).
// - 1F1B: stage s runs min(p - 1 - s, m) warm-up forwards, then alternates one forward and one
//   backward, then the remaining backwards: at most p - s microbatches in flight on stage s.
// - Interleaved 1F1B (several chunks per rank, Megatron-LM's order): forwards go through the
//   chunks in groups of p microbatches (chunk 0 for microbatches 0..p-1, chunk 1 for the same,
//   ..., then chunk 0 for p..2p-1), backwards the same with the chunks reversed; rank r warms up
//   with (p - r - 1) * 2 + (v - 1) * p forwards (all of them when m == p), then alternates. The
//   number of microbatches must be a multiple of p.
// Each stage's forwards, and its backwards, run in microbatch order 0, 1, ..., m - 1 in every
// schedule: the point-to-point transfers between two stages match by order (one tag per
// direction and stage boundary).
// With sends that never block the sender (pipeline/schedule.cc waits for them at the end of the
// step), a rank blocks only on a receive whose send its peer issues earlier in its own order:
// these orders never wait in a cycle (checked over every rank's order by schedule_order_test).

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::pipeline {

enum class ScheduleKind { kGPipe, k1F1B, kInterleaved1F1B };

/// "gpipe", "1f1b", "interleaved_1f1b".
std::string schedule_name(ScheduleKind kind);
/// The inverse of schedule_name (c10::Error listing the names for anything else).
ScheduleKind parse_schedule(const std::string& name);

struct Action {
  enum class Type { kForward, kBackward };
  Type type = Type::kForward;
  int stage = 0;
  int microbatch = 0;
  bool operator==(const Action& other) const {
    return type == other.type && stage == other.stage && microbatch == other.microbatch;
  }
};

/// "F(stage,microbatch)" or "B(stage,microbatch)".
std::string to_string(const Action& action);

/// Checks a pipeline layout for `kind`: GPipe and 1F1B hold one stage per rank (n_stages ==
/// pp_size); interleaved 1F1B holds n_stages / pp_size chunks per rank (a whole multiple) and
/// needs n_microbatches to be a multiple of pp_size; n_microbatches >= 1 always. c10::Errors name
/// the schedule, what was expected and the values found.
void check_schedule(ScheduleKind kind, int pp_size, int n_stages, int n_microbatches);

/// Rank `pp_rank`'s actions for one step (check_schedule first).
std::vector<Action> schedule_order(ScheduleKind kind, int pp_rank, int pp_size, int n_stages,
                                   int n_microbatches);

/// [Note: rank programs] What one rank of a step does, in order: the action orders above plus
/// the point-to-point operations around them, as pipeline/schedule.cc issues them
/// (PipelineSchedule::step executes exactly this list, and schedule_order_test replays every
/// rank's list against its peers'). A receive an action needs from another rank is posted before
/// the action before it runs ([Note: posted receives] in schedule.cc): before running action i the
/// rank posts the receive of action i (if not posted yet), then prefetches the receive of action
/// i + 1 when it can already allocate it (an activation whose boundary shape is known, a gradient
/// whose stage output exists, i.e. whose forward ran). At a step that agrees shapes
/// (`shapes_known` false: the first step, or a new input shape), the first activation across each
/// stage boundary is preceded by its shape: the sender sends it before the activation, the
/// receiver receives it (blocking) just before posting the activation's receive. A forward sends
/// its output right after it ran, a backward its input's gradient; transfers between two stages of
/// one rank are not in the list. c10d's NCCL backend ignores tags, so the sends of rank A to rank
/// B and the receives B posts from A must come in the same order: schedule_order_test checks it for
/// every layout up to 8 ranks, 4 chunks and 16 microbatches.
struct ProgramStep {
  enum class Kind {
    kRecvShape,  // receive (blocking) the shape and dtype of the activation `boundary` carries
    kPostRecv,   // post the receive `action` needs (its activation or its output's gradient)
    kRun,        // run `action`
    kSendShape,  // send the shape and dtype of the activation `action` produced
    kSend,       // send what `action` produced (a forward's output, a backward's input gradient)
  };
  Kind kind = Kind::kRun;
  Action action;
  int peer = -1;      // the pipeline rank received from or sent to (-1 for kRun)
  int boundary = -1;  // the stage boundary b (stage b -> b + 1) the transfer crosses (-1 for kRun)
  bool operator==(const ProgramStep& other) const {
    return kind == other.kind && action == other.action && peer == other.peer && boundary == other.boundary;
  }
};

/// "post recv F(1,0) from 0 [boundary 0]", "run F(1,0)", "send B(1,0) to 0 [boundary 0]", ...
std::string to_string(const ProgramStep& step);

/// Rank `pp_rank`'s program for one step ([Note: rank programs]; check_schedule first).
std::vector<ProgramStep> rank_program(ScheduleKind kind, int pp_rank, int pp_size, int n_stages,
                                      int n_microbatches, bool shapes_known);

/// The step's length in time slots when each forward and each backward takes one slot and
/// transfers are free (every rank's order run as early as its dependencies allow), and the
/// resulting bubble fraction 1 - busy / (p * slots). GPipe and 1F1B: (p - 1) / (m + p - 1) when
/// a backward costs what a forward does.
struct SimulatedStep {
  int slots = 0;
  double bubble_fraction = 0.0;
};
/// Runs every rank's order against the dependencies (a forward needs the previous stage's forward
/// of its microbatch, a backward the next stage's backward and its own forward); `backward_cost`
/// slots per backward. c10::Error if the orders deadlock (naming the ranks' stuck actions).
SimulatedStep simulate_schedule(ScheduleKind kind, int pp_size, int n_stages, int n_microbatches,
                                int backward_cost = 1);

}  // namespace fsdp::pipeline
