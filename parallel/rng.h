#pragma once
// The seed of each forward of a training job ([Note: tensor-parallel RNG] in
// composable/tp_random.h): a pure function of the job's seed, the step, the data rank (never the
// world rank), the microbatch and the pipeline stage. The ranks of a tensor-parallel group compute
// the same seed, so their dropout masks agree; data-parallel replicas, microbatches and stages get
// distinct streams; an unsharded reference reproduces every mask by seeding its forward of the same
// (step, data rank, microbatch, stage) alike, whatever the schedule's order.
//
//   torch::manual_seed(fsdp::parallel::forward_seed(seed, step, mesh.data_rank(), microbatch, stage));
//   at::Tensor out = stage_module(x);

#include <cstdint>

namespace fsdp::parallel {

/// A 64-bit seed mixed from the arguments (splitmix64 over each in turn): equal arguments give
/// equal seeds on every machine.
uint64_t forward_seed(uint64_t seed, int64_t step, int64_t data_rank, int64_t microbatch, int64_t stage);

/// Seeds the default generators (CPU and, where present, CUDA) with forward_seed(...).
void seed_forward(uint64_t seed, int64_t step, int64_t data_rank, int64_t microbatch, int64_t stage);

}  // namespace fsdp::parallel
