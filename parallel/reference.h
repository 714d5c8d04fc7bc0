#pragma once
// The unsharded reference of a composed job: the same ModelSpec built whole on one process (every
// pipeline stage, run one after the other), trained on every data rank's batch with the seeds the
// composition root uses ([Note: tensor-parallel RNG]), so every dropout mask is the same. What a
// ParallelModel must reproduce, step for step; the composition tests and the examples compare
// against it.
//
//   fsdp::parallel::UnshardedReference reference(spec, options);
//   torch::optim::AdamW optim(reference.parameters(), 1e-3);
//   for (int64_t step = 1; step <= steps; ++step) {
//     std::vector<fsdp::parallel::Batch> global;          // data rank q's batch at [q]
//     for (int q = 0; q < dims.dp(); ++q) global.push_back(loader.batch(step, q));
//     reference.forward_backward(step, global);          // step numbers as the job's (from 1)
//     reference.clip_grad_norm_(1.0);
//     optim.step();
//     reference.zero_grad();
//   }

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "fsdp_cpp/parallel/parallel_model.h"

namespace fsdp::parallel {

struct Batch {
  at::Tensor inputs;
  at::Tensor targets;
};

class UnshardedReference {
 public:
  /// Builds every stage of the layout's pipeline (pp x stages_per_rank of them; the whole model
  /// without pipeline) through spec.build, with no parallelism applied.
  UnshardedReference(const ModelSpec& spec, const ParallelOptions& options);

  /// Stage s's part.
  const std::vector<ModelPart>& parts() const { return parts_; }
  std::vector<at::Tensor> parameters() const;
  /// The gradients of the mean loss over data ranks and microbatches of step `step` (numbered as
  /// ParallelModel::steps() counts, from 1): `global[q]` is data rank q's batch. Returns that mean.
  /// With ModelSpec::ignore_index, the mean over the step's counted targets instead ([Note:
  /// token-weighted loss] in parallel/parallel_model.cc), as the job computes it.
  at::Tensor forward_backward(int64_t step, const std::vector<Batch>& global);
  /// torch::nn::utils::clip_grad_norm_ over every parameter.
  double clip_grad_norm_(double max_norm, double norm_type = 2.0);
  void zero_grad();

 private:
  ModelSpec spec_;
  ParallelOptions options_;
  std::vector<ModelPart> parts_;
};

}  // namespace fsdp::parallel
