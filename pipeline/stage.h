#pragma once
// A pipeline stage: one part of a model (its forward), its place in the pipeline, and the group
// of ranks the pipeline runs over. A schedule (pipeline/schedule.h) runs the stages a rank holds.
//
//   auto pp = mesh->group("pp");                      // the pipeline dimension of the mesh
//   // this rank's part of the model, e.g. examples' GPT pruned with keep_stage(...)
//   fsdp::pipeline::PipelineStage stage(
//       [&](const at::Tensor& x) { return part(x); }, /*stage_index=*/pp->rank(),
//       /*num_stages=*/pp->size(), pp);
//   stage.set_fsdp_units({fsdp::fully_shard(part, opts)});   // optional: fully_shard inside
//
// Stage s lives on rank s % group->size() of the group ([Note: schedule orders]), so a rank may
// hold several stages ("chunks") for interleaved schedules; every rank of the group holds the
// same number. The stage's input is the previous stage's output (the first stage's: the step's
// microbatch), its output goes to the next stage (the last stage's: to the loss function). The
// shapes and dtypes of what goes between stages are agreed at the first step (and again whenever
// the step's input shape changes), not declared.

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/composable/fully_shard.h"

namespace fsdp::pipeline {

class PipelineStage {
 public:
  using Forward = std::function<at::Tensor(const at::Tensor&)>;

  /// `forward`: the stage's part of the model (called once per microbatch, with gradients on).
  /// `group`: the pipeline group; stage `stage_index` of `num_stages` must live on this rank
  /// (stage_index % group->size() == group->rank()). c10::Errors name the stage and the values.
  PipelineStage(Forward forward, int stage_index, int num_stages, std::shared_ptr<comm::Communicator> group);

  /// fully_shard units of this stage (typically the stage's root; their inner units follow, as
  /// set_requires_gradient_sync(recurse=true) does): the schedule decides before each backward
  /// whether it reduces gradients (ScheduleOptions::reduce_every_microbatch).
  PipelineStage& set_fsdp_units(std::vector<FSDPModule> units);
  const std::vector<FSDPModule>& fsdp_units() const { return fsdp_units_; }

  int stage_index() const { return stage_index_; }
  int num_stages() const { return num_stages_; }
  bool is_first() const { return stage_index_ == 0; }
  bool is_last() const { return stage_index_ == num_stages_ - 1; }
  /// The rank of the group that holds stage `stage`.
  int rank_of(int stage) const { return stage % group_->size(); }
  const std::shared_ptr<comm::Communicator>& group() const { return group_; }
  /// "stage 2 of 4 (pipeline rank 0)", for errors.
  std::string name() const;

  at::Tensor run_forward(const at::Tensor& input) const { return forward_(input); }

 private:
  Forward forward_;
  int stage_index_;
  int num_stages_;
  std::shared_ptr<comm::Communicator> group_;
  std::vector<FSDPModule> fsdp_units_;
};

}  // namespace fsdp::pipeline
