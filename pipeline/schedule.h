#pragma once
// Pipeline schedules: one training step over microbatches through the stages every rank of the
// pipeline group holds (GPipe, 1F1B, interleaved 1F1B; the orders: pipeline/schedule_order.h).
//
//   fsdp::pipeline::PipelineSchedule schedule(
//       {&stage}, [](const at::Tensor& logits, const at::Tensor& y) { return loss(logits, y); },
//       fsdp::pipeline::ScheduleOptions().kind(fsdp::pipeline::ScheduleKind::k1F1B).n_microbatches(4));
//   std::vector<at::Tensor> losses;
//   schedule.step(tokens, targets, &losses);   // tokens: the first stage's rank; targets: the last's
//   optimizer.step();                          // each rank steps its stages' parameters
//   optimizer.zero_grad();
//
// step() splits the batch into n_microbatches equal microbatches along dimension 0, runs each
// rank's order, sends activations forward and their gradients backward point-to-point, and on
// the last stage applies the loss function to each microbatch's output. Backward runs on
// loss / n_microbatches (scale_grads, the default), so the gradients after a step are those of
// the mean loss over the whole batch, as one large batch gives: gradients accumulate across
// microbatches. `losses` gets the unscaled loss of each microbatch (the last stage's rank; empty
// elsewhere).
//
// [Note: pipeline step agreement] Each step starts with one all-gather over the pipeline group
// of what each rank knows: the schedule's options and its stage layout (kind, number of
// microbatches, scale_grads, reduce_every_microbatch, number of stages and stages per rank), the
// input's shape and dtype (the first stage's rank) and whether targets were given (the last
// stage's). Each rank then names what it finds wrong: its own arguments (a batch the microbatches
// do not divide, missing inputs or targets), a layout that differs from pipeline rank 0's (or, at
// the first step with given fully_shard units, from its data-parallel group's rank 0: one more
// all-gather of the layout over each of those groups), inputs and targets whose batch sizes differ. Those errors go through the error agreement
// (comm/agreement.h) over the pipeline group and then over every data-parallel group the stages'
// fully_shard units communicate over (PipelineStage::set_fsdp_units: each unit's shard group and
// HSDP replicate group), so that a bad batch on one data-parallel replica is refused by every rank
// of the job, with the same error (that of the lowest world rank), before anything communicates
// further; no rank is left in a data-parallel collective, and the next step runs normally on every
// rank. Every rank then also knows the step's input shape: when it differs from the last agreed
// one, each stage boundary sends the activation's shape and dtype ahead of the first microbatch's
// activation, and the receivers allocate from that. Between such steps a stage whose output's
// shape differs from the agreed one fails naming the stage and both shapes (its peers end with the
// communicator's timeout report naming the transfer).
//
// Transfers between two stages on one rank (interleaved schedules on one rank) pass the tensor
// without communicating. Sends never block the sender; the step waits for them before returning.
// A stage that throws ends the step on its rank with its error; the other ranks end within the
// collective timeout with a report naming the transfer they waited for. The schedule is then
// unusable (transfers may be in flight).

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include "fsdp_cpp/pipeline/schedule_order.h"
#include "fsdp_cpp/pipeline/stage.h"

namespace fsdp::pipeline {

struct ScheduleOptions {
  TORCH_ARG(ScheduleKind, kind) = ScheduleKind::k1F1B;
  /// Microbatches per step; each is batch / n_microbatches rows of the step's input.
  TORCH_ARG(int, n_microbatches) = 1;
  /// Backward on loss / n_microbatches (the gradients of the whole batch's mean loss).
  TORCH_ARG(bool, scale_grads) = true;
  /// With fully_shard units on the stages (PipelineStage::set_fsdp_units): false (the default)
  /// reduce-scatters each stage's gradients once per step, in its last microbatch's backward
  /// (the units accumulate unsharded gradients until then: more memory, fewer collectives);
  /// true reduces in every microbatch's backward (sharded gradients only: m times the
  /// reduce-scatters).
  TORCH_ARG(bool, reduce_every_microbatch) = false;
};

/// Counters of the last step on this rank.
struct StepStats {
  int64_t forwards = 0;
  int64_t backwards = 0;
  int64_t sends = 0, send_bytes = 0;       // point-to-point, activations and gradients
  int64_t recvs = 0, recv_bytes = 0;
  int64_t local_transfers = 0;             // between two stages of this rank
  int64_t peak_live_microbatches = 0;      // most microbatches whose activations a stage held at once
  double compute_seconds = 0.0;            // forwards and backwards (wall time inside them)
  double wait_seconds = 0.0;               // blocked on receives
  double step_seconds = 0.0;
};

class PipelineSchedule {
 public:
  using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;

  /// `stages`: the stages this rank holds (any order; all of one pipeline group, the same number
  /// on every rank; refused otherwise before anything communicates: c10::Errors name the stages).
  /// `loss_fn`: on the last stage, (microbatch output, microbatch targets) -> scalar loss.
  PipelineSchedule(std::vector<PipelineStage*> stages, LossFn loss_fn, ScheduleOptions options);

  /// One step (collective over the pipeline group): `inputs` on the rank of the first stage
  /// (ignored elsewhere), `targets` on the rank of the last (ignored elsewhere). Returns the last
  /// stage's outputs of every microbatch concatenated along dimension 0, detached (undefined on
  /// other ranks). See the top of this file.
  at::Tensor step(const at::Tensor& inputs = {}, const at::Tensor& targets = {},
                  std::vector<at::Tensor>* losses = nullptr);

  const ScheduleOptions& options() const { return options_; }
  const StepStats& last_step_stats() const { return stats_; }
  /// This rank's order (pipeline/schedule_order.h).
  const std::vector<Action>& order() const { return order_; }

 private:
  std::vector<int64_t> agree_step(const at::Tensor& inputs, const at::Tensor& targets);
  // "1f1b, 4 microbatches, scale_grads true, reduce_every_microbatch false, 2 stages, 1 per
  // pipeline rank": what every rank of the pipeline group must agree on.
  std::string describe_layout() const;
  // The pipeline group, then each stage unit's shard group and HSDP replicate group (each once).
  std::vector<std::shared_ptr<comm::Communicator>> agreement_groups() const;

  std::vector<PipelineStage*> stages_;  // indexed by chunk: stages_[c] is stage c * p + rank
  LossFn loss_fn_;
  ScheduleOptions options_;
  std::shared_ptr<comm::Communicator> group_;
  int n_stages_ = 0;
  std::vector<Action> order_;
  // This rank's program at a step that agrees shapes [0] and at any other step [1] ([Note: rank
  // programs] in schedule_order.h).
  std::vector<ProgramStep> programs_[2];
  // The agreement groups whose data-parallel peers were found to run the same layout.
  std::vector<std::shared_ptr<comm::Communicator>> layout_agreed_groups_;
  std::vector<int64_t> agreed_input_shape_;  // the input shape the boundary shapes were agreed for
  std::vector<std::optional<std::vector<int64_t>>> boundary_shapes_;  // per stage boundary b (stage b -> b+1)
  std::vector<int> boundary_dtypes_;
  StepStats stats_;
};

}  // namespace fsdp::pipeline
