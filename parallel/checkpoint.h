#pragma once
// Checkpoints of a composed job, loadable at any layout: the model and optimizer state of every
// stage chunk this rank holds, merged into one distributed checkpoint (checkpoint/
// distributed_checkpoint.h: global FQNs and shapes, whatever the tensor-parallel, fully_shard,
// HSDP or pipeline layout), the job's step count (so a resumed job's forwards are seeded as
// the uninterrupted job's would have been, [Note: tensor-parallel RNG]) and, if given, small named
// values of the caller's (CheckpointValues: the data loader's position, ...).
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
//
// The data loader's position goes with it as a named value, so that a resumed job reads the
// batches the uninterrupted job would have read (data/token_dataset.h, [Note: dataset state]: the
// state is the same on every rank and holds no rank, so it resumes at any layout too):
//
//   fsdp::parallel::save_checkpoint(dir, model, optim, {{"data", dataset.state().to_string()}});
//   ...
//   fsdp::parallel::CheckpointValues values;
//   fsdp::parallel::load_checkpoint(dir, model, optim, &values);
//   dataset.load_state(values.at("data"));

#include <map>
#include <string>

#include <torch/optim/optimizer.h>

#include "fsdp_cpp/parallel/parallel_model.h"

namespace fsdp::parallel {

/// Small named values saved with a checkpoint: name -> value, both free-form strings (names not
/// empty). Global to the job: every rank passes the same values, and they are stored once (in the
/// checkpoint's manifest, dcp::Extra::values, under "fsdp.parallel.value.<name>"), so a
/// checkpoint's values load at any layout. Meant for a few bytes to kilobytes (a data loader's
/// position, a run id), not for tensors.
using CheckpointValues = std::map<std::string, std::string>;

/// Collective over the job: writes `dir` (an atomic folder: complete or absent) with the model,
/// the optimizer, the step count and `values`. The ranks' values are compared first (one
/// all-gather of their bytes over the job): values that differ between ranks, or an empty name,
/// are refused on every rank with the same error, naming the first name that differs and the two
/// ranks' values, before anything is written.
void save_checkpoint(const std::string& dir, const ParallelModel& model, torch::optim::Optimizer& optimizer,
                     const CheckpointValues& values = {});

/// Collective over the job: fills the model's parameters, the optimizer's state and the step count
/// from `dir`, saved at any layout, and, if `values` is given, replaces its contents by the values
/// saved with it (empty when none were). Errors of the state (a missing key, a shape that differs)
/// name the key and leave the model as it was (dcp::load_state validates before it writes); a
/// folder without the step count (not written by save_checkpoint) is refused after its state
/// loaded.
void load_checkpoint(const std::string& dir, ParallelModel& model, torch::optim::Optimizer& optimizer,
                     CheckpointValues* values = nullptr);

}  // namespace fsdp::parallel
