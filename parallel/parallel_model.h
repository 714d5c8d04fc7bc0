#pragma once
// parallelize: the composition root of a training job (torchtitan's parallelize_llama +
// pipeline_llama, for any model that supplies its plan). From a ParallelDims layout it builds the
// mesh, this rank's pipeline stage chunks, and applies to each, in torchtitan's order: tensor
// parallel (over "tp") -> context parallel (over "cp") -> expert parallel (over "ep") ->
// activation checkpointing -> fully_shard (over "dp_shard" x "cp", HSDP over (dp_replicate,
// dp_shard x cp) when dp_replicate > 1; experts over "efsdp") -> pipeline stages and schedule
// (over "pp").
// The result trains with the job-wide invariants held by construction:
//   - every data-parallel group is the right one (fully_shard never sees a tp peer);
//   - gradient clipping over every stage chunk, tp and dp rank of the job (clip_grad_norm_);
//   - each forward seeded by (seed, step, data rank, microbatch, stage) alike on the ranks of a
//     tp group ([Note: tensor-parallel RNG]), so dropout trains the unsharded model's masks;
//   - every step first compares, over the whole job, the batch shapes (equal on every replica), the
//     inputs of the ranks of each tp group (the same data; in the first step, every step with
//     FSDP_DEBUG=1) and each rank's own errors: a bad step is refused on every rank with the same
//     error before anything communicates;
//   - zero_grad() discards whatever an abandoned step accumulated.
//
//   auto pg = fsdp::comm::init_process_group();
//   fsdp::parallel::ModelSpec spec;
//   spec.build = [&](int stage, int n_stages) { ... return fsdp::parallel::ModelPart{...}; };
//   spec.loss = next_token_loss;
//   spec.units = fsdp::WrapPolicy::module_types<BlockImpl>();
//   spec.tensor_parallel = [](fsdp::parallel::ModelPart& part, const auto& tp) { ...; return LossFn{}; };
//   auto model = fsdp::parallel::parallelize(pg.comm, spec,
//       fsdp::parallel::ParallelOptions().dims({.dp_shard = -1, .tp = 2}).seed(0));
//   torch::optim::AdamW optim(model.parameters(), 1e-3);
//   for (int64_t step = 0; step < steps; ++step) {
//     auto batch = loader.next(model.mesh().data_rank());   // by data rank, never world rank
//     model.forward_backward(batch.inputs, batch.targets);
//     model.clip_grad_norm_(1.0);
//     optim.step();
//     model.zero_grad();
//   }
//
// The building blocks (parallelize_module, fully_shard, checkpoint_activations, PipelineStage,
// PipelineSchedule) stay public for programs that compose by hand; those get the same invariants
// from fsdp::clip_grad_norm_ over their roots and pipeline group, fsdp::tp::dropout with
// forward_seed, FSDPModule::zero_grad, and fully_shard's refusal of a communicator holding tp peers.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/wrap_policy.h"
#include "fsdp_cpp/parallel/parallel_dims.h"
#include "fsdp_cpp/pipeline/schedule_order.h"

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace fsdp::parallel {

/// One pipeline stage's part of the model (the whole model without pipeline parallelism).
struct ModelPart {
  /// The part's root module (hook-able: it becomes the part's fully_shard root unit).
  std::shared_ptr<torch::nn::Module> module;
  /// Its forward, called through the module's hook-able holder: stage input -> stage output.
  std::function<at::Tensor(const at::Tensor&)> forward;
};

using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& targets)>;

/// What a model supplies to the composition root.
struct ModelSpec {
  /// The part that pipeline stage `stage` of `n_stages` holds (the whole model when n_stages is
  /// 1), keeping the whole model's FQNs, with the same values on every rank (initialised from a
  /// fixed seed). Called once per stage chunk this rank holds. May throw (e.g. fewer layers than
  /// stages): the error reaches every rank.
  std::function<ModelPart(int stage, int n_stages)> build;
  /// The loss of the last stage's output against the targets: a mean over the microbatch.
  LossFn loss;
  /// Tensor parallelism on a part over the tp group (parallelize_module with the model's plan).
  /// Returns the loss to use instead of `loss` when the layout changes it (loss parallel), or an
  /// empty function. Needed when tp > 1.
  std::function<LossFn(ModelPart& part, const std::shared_ptr<comm::Communicator>& tp)> tensor_parallel;
  /// The modules of each part that become fully_shard units; the part's root always is one.
  std::optional<WrapPolicy> units;
  /// The modules activation-checkpointed with ParallelOptions::checkpoint_activations (default:
  /// `units`).
  std::optional<WrapPolicy> checkpoint;
  /// Set when `loss` is a mean over the targets that are not this id (label padding, e.g. -100):
  /// each step then counts the targets that do count over the whole job (in the exchange that
  /// starts it) and weights every microbatch's loss by its count, so that the gradients are those
  /// of the mean over the global batch's counted tokens whatever their split over data ranks and
  /// microbatches (torchtitan's global valid tokens). [Note: token-weighted loss].
  std::optional<int64_t> ignore_index;
  /// Context parallelism (cp > 1): makes a part's attention attend over the sequence split across
  /// the cp group (fsdp::cp::ring_attention, its rotary positions global: composable/
  /// context_parallel.h). The composition root splits inputs and targets along dimension 1
  /// (time) in the load-balanced head-tail layout before the first stage and the loss, so a part
  /// sees this rank's chunk. Needed when cp > 1; may throw (e.g. a model it cannot split).
  std::function<void(ModelPart& part, const std::shared_ptr<comm::Communicator>& cp)> context_parallel;
  /// Expert parallelism (ep > 1): keeps the part's experts of this ep rank (num_experts / ep of
  /// them, the others removed) and routes tokens to the ranks holding theirs through all-to-alls
  /// (composable/expert_parallel.h). Needed when ep > 1, with `experts`.
  std::function<void(ModelPart& part, const std::shared_ptr<comm::Communicator>& ep)> expert_parallel;
  /// The modules that are experts: with ep > 1 each becomes a fully_shard unit over the ranks
  /// holding the same experts (ParallelMesh::efsdp_group), with the job's data-parallel degree
  /// as gradient divide factor ([Note: expert parallel mesh] in parallel/parallel_dims.h); the
  /// other units are `units` without them.
  std::optional<WrapPolicy> experts;
};

struct ParallelOptions {
  TORCH_ARG(ParallelDims, dims) = {};
  /// Pipeline schedule (pp > 1) and stage chunks per pipeline rank (> 1 needs interleaved_1f1b).
  TORCH_ARG(pipeline::ScheduleKind, schedule) = pipeline::ScheduleKind::k1F1B;
  TORCH_ARG(int, stages_per_rank) = 1;
  /// Microbatches per step: the pipeline's, or gradient accumulation without pipeline (the
  /// gradients are those of the whole batch's mean loss either way).
  TORCH_ARG(int, n_microbatches) = 1;
  TORCH_ARG(bool, checkpoint_activations) = false;
  /// fully_shard's options for every unit (its communicator and mesh are the composition root's).
  TORCH_ARG(FullyShardOptions, fully_shard) = {};
  /// The job's seed ([Note: tensor-parallel RNG]).
  TORCH_ARG(uint64_t, seed) = 0;
};

class ParallelModel {
 public:
  const ParallelMesh& mesh() const;
  /// This rank's stage chunks, in stage order, and each one's stage index.
  const std::vector<ModelPart>& parts() const;
  const std::vector<int>& stages() const;
  int n_stages() const;
  /// Each part's root unit.
  const std::vector<FSDPModule>& roots() const;
  /// The parameters of this rank's parts (what its optimizer steps).
  std::vector<at::Tensor> parameters() const;
  /// The loss in use (the spec's, or the one tensor parallelism returned).
  const LossFn& loss() const;

  /// One step's forwards and backwards on this rank's slice of the global batch: `inputs` on the
  /// ranks holding the first stage, `targets` on those holding the last (both everywhere without
  /// pipeline). Returns the mean loss over the microbatches on the ranks holding the last stage
  /// (undefined elsewhere). Collective over the job; see the top of this file for what it checks
  /// first. With ModelSpec::ignore_index the value returned is this data rank's share, weighted
  /// so that global_loss() is the mean over the global batch's counted tokens ([Note:
  /// token-weighted loss]); a step in which no target counts has no gradient and loss 0.
  at::Tensor forward_backward(const at::Tensor& inputs, const at::Tensor& targets);
  /// clip_grad_norm_ over every part, tp, dp and pipeline rank of the job: the whole model's norm.
  double clip_grad_norm_(double max_norm, double norm_type = 2.0);
  /// Drops every gradient of this rank's parts: `.grad`, accumulations without sync and HSDP's
  /// replicate partials (an abandoned step leaves nothing behind).
  void zero_grad();
  /// The steps begun (forward_backward calls, abandoned ones included: their seeds are used up).
  int64_t steps() const;
  /// Continues the step count from `steps` (a job resumed from a checkpoint: its next forward is
  /// seeded as step steps + 1 would have been). parallel/checkpoint.h restores it.
  void set_steps(int64_t steps);
  /// The communicator over the whole job.
  const std::shared_ptr<comm::Communicator>& world() const;
  /// The mean over data ranks of a loss returned by forward_backward, on every rank (a collective
  /// over the job on a communicator of its own, so training's counters are untouched).
  double global_loss(const at::Tensor& loss) const;
  /// The layout in a few lines (for logs).
  std::string describe() const;

  struct Impl;

 private:
  friend ParallelModel parallelize(const std::shared_ptr<comm::Communicator>&, const ModelSpec&,
                                   const ParallelOptions&);
  explicit ParallelModel(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  // forward_backward after its checks, on this rank's (context-parallel) chunk of the batch.
  at::Tensor run_step(const at::Tensor& inputs, const at::Tensor& targets);
  std::shared_ptr<Impl> impl_;
};

/// The composition root (see the top of this file). Collective over `world`; every rank passes the
/// same spec and options. Refused on every rank with the same error, before the model is sharded:
/// dims that do not fit the world size, a schedule its sizes cannot run (fewer stages than pipeline
/// ranks, microbatches fewer than pipeline ranks for 1F1B, ...), a spec without build or loss (or
/// without tensor_parallel at tp > 1), a build that throws on any rank.
ParallelModel parallelize(const std::shared_ptr<comm::Communicator>& world, const ModelSpec& spec,
                          const ParallelOptions& options);

}  // namespace fsdp::parallel
