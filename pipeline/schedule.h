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
//
// [Note: pipeline step failures] A stage that throws (its forward, its backward, the loss function
// on the last stage), or a transfer that fails, ends the step on every rank of the pipeline group
// with the same c10::Error, within moments rather than the collective timeout:
//   "fsdp::pipeline::PipelineSchedule::step: rank W: stage S of N (pipeline rank R) failed in the
//    forward of microbatch M: <the stage's message>. Every rank of the pipeline group ends this
//    step with this error: ..."
// (W the failing rank's world rank; with several failing ranks, the lowest one's error, naming the
// others: comm/agreement.h). How, on a backend with failure messages (MPI;
// comm/point_to_point_failure.h): the rank's program ([Note: rank programs]) says exactly which
// transfers it still owes each peer in this step and which receives it still expects. The failing
// rank sends, in place of every transfer it still owes (shapes, activations, gradients), a failure
// carrying its error; it posts every receive it still expects as a discarding receive (whatever
// comes is dropped), and waits until all of them, its posted receives and its earlier sends
// completed. A peer whose receive gets a failure does the same with that error, so the failure
// travels along the pipeline in both directions, and every transfer of the step is matched on
// both sides: nothing stays in flight, and the next step runs normally (it agrees the stage
// boundaries' shapes again). Then, on every step, failed or not, one all-gather over the pipeline
// group (comm::agree_on_error) agrees on the error, so a rank whose failing action owed no
// transfer (e.g. the first stage's last backward) is heard too. The stages' fully_shard units
// (PipelineStage::set_fsdp_units) then discard the step's gradients and open iteration
// (FSDPModule::zero_grad, gradient sync and is_last_backward set back to true), so the next step
// equals a run without the failed one; gradients of parameters outside units, accumulated by the
// microbatches that ran, are the caller's to zero. Cost on success: that one all-gather per step.
//
// Limits: (1) Data-parallel replicas whose stages communicate over the data-parallel group
// (fully_shard units with dp > 1): when every replica fails alike (the same stage and microbatch:
// a loss that is NaN on every replica, a bad shape), every rank of the job throws that error (the
// replicas' pipelines stop at the same program step, so their data-parallel collectives stay
// matched). When only one replica fails, its pipeline ranks throw the error at once, but the
// ranks of the other replicas wait in their next data-parallel collective with the failed
// replica's ranks, which never issue it: they end with the collective timeout's report naming
// that collective, and the watchdog aborts the job (a failed replica that catches the error and
// communicates over the data-parallel group again instead gets the MPI backend's mismatch error
// in that collective, as its peers do: [Note: MPI size check]). Telling them would need the
// data-parallel collectives themselves to carry a failure (a failed rank joining its peers'
// pending collective as a failure, which the size check could carry), not done. Replicas without
// data-parallel communication inside the step are separate pipelines: the other replicas finish
// their step normally and learn nothing (agree over the dp group before the optimizer step).
// (2) A backend without failure messages (NCCL: no envelope to mark a message as a failure, see
// comm/point_to_point_failure.h for what it would need): the step ends on the failing rank with its
// error; the other ranks end within the collective timeout with a report naming the transfer they
// waited for, and the schedule is unusable. (3) A rank that dies (killed) is not a failure: its
// peers end with the collective timeout.

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
  /// Whether the last stage keeps every microbatch's output until the step returns them (true,
  /// the default). false: each microbatch's output is released after its backward (with 1F1B
  /// the last stage then holds one microbatch's output at a time instead of all of them), and
  /// step() returns an undefined tensor on every rank; the losses are returned as before.
  /// StepStats::peak_output_bytes and output_bytes_kept measure it. Need not agree across ranks.
  TORCH_ARG(bool, keep_outputs) = true;
};

/// Counters of the last step on this rank.
struct StepStats {
  int64_t forwards = 0;
  int64_t backwards = 0;
  int64_t sends = 0, send_bytes = 0;       // point-to-point, activations and gradients
  int64_t recvs = 0, recv_bytes = 0;
  int64_t local_transfers = 0;             // between two stages of this rank
  int64_t peak_live_microbatches = 0;      // most microbatches whose activations a stage held at once
  // The last stage's outputs: the most bytes of them the schedule referenced at once (outputs
  // awaiting their backward, plus the kept ones), and the bytes returned by step() (0 with
  // keep_outputs(false), and on ranks without the last stage).
  int64_t peak_output_bytes = 0;
  int64_t output_bytes_kept = 0;
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
  /// other ranks, and on every rank with keep_outputs(false)). A stage that throws fails the step
  /// on every rank of the pipeline group with the same error ([Note: pipeline step failures]).
  /// See the top of this file.
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
