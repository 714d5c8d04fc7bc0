#pragma once
// Packs: small parameters of one param group, wherever they live, stepped as one tensor.
//
// [Note: flat packs] Stepping a run in place ([Note: flat runs]) costs about ten tensor ops
// whatever its size, so a model of many small FlatParameters (TinyNet's units hold 72
// parameters each) would still pay ten ops per unit. On the CPU, the parameters of small runs
// (at most kPackMaxNumel elements) and small parameters that are in no run (the gradients
// that autograd writes on one rank are separate tensors: [Note: passthrough backward] in
// fsdp/backward.cc) are instead packed: per dtype, one tensor holding each member's values back
// to back (no padding) and one holding its gradient, copied in with memcpy; the pack is stepped
// with the same ops as a run and the parameters' values copied back (their version counters
// bumped). The optimizer state of a pack is flat like a run's ([Note: flat state]): one buffer
// per state name in the pack's layout, the members' state tensors views of it, reused while
// the pack keeps its members. Copying costs three passes over the small parameters (gather
// parameters and gradients, scatter parameters), a few nanoseconds per element, against
// microseconds per op saved; parameters of larger runs are stepped in place and larger
// parameters in no run per parameter, so large models pay no copies.

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "fsdp_cpp/optim/flat_runs.h"
#include "fsdp_cpp/optim/flat_step_stats.h"

namespace fsdp::optim {

/// The runs of `params` (find_runs), with the small CPU ones (at most `pack_max_numel` elements;
/// also parameters stepped alone) moved into packs, one per dtype, after the others. A pack's
/// `param` and `grad` are gathered copies, written back by finish_flat_step.
std::vector<ParamRun> plan_runs(const std::vector<at::Tensor>& params, int64_t pack_max_numel,
                                int64_t max_gap_bytes = kMaxRunGapBytes);

/// After a flat run (flat() true) was stepped: copies a pack's parameter values back into its
/// members, bumps every member's version counter (as torch::optim's in-place updates do: the
/// run's tensors have counters of their own; fully_shard reads the parameters', see
/// FlatParamStorage::shard_version) and counts the run in `stats`.
void finish_flat_step(const ParamRun& run, const std::vector<at::Tensor>& params, FlatStepStats& stats);

}  // namespace fsdp::optim
