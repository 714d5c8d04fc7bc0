#pragma once
// Checkpoints of a composed job, loadable at any layout: the model and optimizer state of every
// stage chunk this rank holds, merged into one distributed checkpoint (checkpoint/
// distributed_checkpoint.h: global FQNs and shapes, whatever the tensor-parallel, fully_shard,
// HSDP or pipeline layout), and the job's step count (so a resumed job's forwards are seeded as
// the uninterrupted job's would have been, [Note: tensor-parallel RNG]).
//
//   fsdp::parallel::save_checkpoint(dir, model, optim);     // at (dp_shard=2, tp=2)
//   ...                                                      // a new job, any layout:
//   auto model = fsdp::parallel::parallelize(pg.comm, spec, options_pp2_dp2);
//   torch::optim::AdamW optim(model.parameters(), adamw);
//   fsdp::parallel::load_checkpoint(dir, model, optim);     // model, optimizer, step count
//
// The optimizer holds exactly this rank's parameters (model.parameters()); its state is saved
// per stage chunk under the parameters' FQNs, as fsdp::sharded_optimizer_state_dict keys it. A
// checkpoint of a composed job also loads into a plain fully_shard model with dcp::load (the same
// keys), and the other way round.

#include <string>

#include <torch/optim/optimizer.h>

#include "fsdp_cpp/parallel/parallel_model.h"

namespace fsdp::parallel {

/// Collective over the job: writes `dir` (an atomic folder: complete or absent).
void save_checkpoint(const std::string& dir, const ParallelModel& model, torch::optim::Optimizer& optimizer);

/// Collective over the job: fills the model's parameters, the optimizer's state and the step count
/// from `dir`, saved at any layout. Errors of the state (a missing key, a shape that differs) name
/// the key and leave the model as it was (dcp::load_state validates before it writes); a folder
/// without the step count (not written by save_checkpoint) is refused after its state loaded.
void load_checkpoint(const std::string& dir, ParallelModel& model, torch::optim::Optimizer& optimizer);

}  // namespace fsdp::parallel
