#pragma once
// plan: the sharding plan of a model, printed before training. What every unit holds per rank, the
// memory each rank will need, and the bytes it will communicate per step, computed from the
// FlatParameter layouts fully_shard made (pure arithmetic: no collective, no allocation of model
// size, nothing changed), so it can be printed right after the root's fully_shard, before the
// first forward.
//
//   for (auto& block : model->block_list()) fsdp::fully_shard(block, opts);
//   auto root = fsdp::fully_shard(model, opts);
//   const fsdp::ShardingPlan plan =
//       fsdp::plan(root, fsdp::PlanOptions().optimizer(fsdp::PlanOptimizer::kAdamW));
//   if (rank == 0) std::cout << plan;
//   plan.memory.sharded_state_bytes();      // this rank's shards + gradients + optimizer state
//   plan.communication.all_gather.bytes;    // per step, as comm::Communicator counts it
//
// [Note: what the plan predicts] Every figure is for one rank (`ShardingPlan::rank`, the rank
// that computed it; `max_over_ranks` for the largest), in bytes as LibTorch allocates them:
//  - sharded state (persistent from the first optimizer step on): the local shards of every
//    handle (padded: shard_numel elements in the parameters' dtype); the sharded gradients of the
//    trainable handles (the same size; on one rank without mixed precision or offload, autograd's
//    own per-parameter gradients, without the alignment padding); the optimizer state, one tensor
//    per state variable and parameter of the parameter's (sharded) shape, so it counts the
//    elements this rank really holds, not the padding; the low-precision copies of the shards
//    (mixed precision, or CPU offload of a unit computing on an accelerator).
//  - unsharded parameters, the peak: the root's unsharded buffers (held from its forward to the
//    end of backward), those of the units kept unsharded from forward to backward (SHARD_GRAD_OP,
//    and NO_SHARD ones that keep a low-precision copy), and the largest `max_unshards_in_flight`
//    of the units resharded after forward (the prefetch limit; more when such units are nested,
//    since a unit's ancestors do not count against the limit). An upper bound, reached when the
//    largest units are the ones prefetched together. Explicit prefetch lists
//    (set_modules_to_forward_prefetch / _backward_prefetch) are not bounded by the limit and not
//    modelled.
//  - unsharded gradients, a bound: the root's flat gradient (alive through the whole backward,
//    its reduction comes last) and two other units' (the one computing and the one whose
//    reduction is in flight), each with its reduction output and, when gradients are reduced in
//    another dtype than they are computed in, autograd's gradients in the compute dtype.
//  - communication per training step (one forward and one backward with gradient sync), as
//    comm::Communicator counts it (an all-gather's output, a reduce-scatter's input, an
//    all-reduce's tensor; summed over the shard and the replicate communicators with HSDP): every
//    sharded unit is all-gathered in forward, and again in backward unless it is the root or kept
//    unsharded (SHARD_GRAD_OP); every trainable sharded handle is reduce-scattered; NO_SHARD
//    handles are all-reduced; with HSDP the sharded gradient is then all-reduced across replicas
//    (in the parameters' dtype). Frozen handles get no reduction. Each backward pass begins with
//    one all-reduce of 2 int64 per unit (and 2 more) over the shard group, and one over the
//    replicate group with HSDP ([Note: backward reach] in fsdp/backward_reach.h). A unit with an
//    all_gather_codec carries W x encoded_bytes(shard_numel) per all-gather over its shard group
//    (the post-forward group's all-gathers are not encoded); one with a reduce_codec reduces each
//    trainable sharded handle with an all-to-all of W x encoded_reduce_bytes() (encoded with the
//    FlatParameter's row layout) instead of the reduce-scatter ([Note: communication codecs] in
//    fsdp/comm_codec.h). On one rank
//    nothing is communicated. Assumes each unit runs once per forward and is reached by backward; the first
//    iteration's small order checks (all_gather_bytes) are not counted.

#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>
#include <torch/arg.h>

#include "fsdp_cpp/composable/fully_shard.h"

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace fsdp {

/// The optimizer whose state the plan predicts (LibTorch's torch::optim classes).
enum class PlanOptimizer {
  /// No optimizer state.
  kNone,
  /// torch::optim::SGD without momentum: no state.
  kSGD,
  /// torch::optim::SGD with momentum: a momentum buffer per element.
  kSGDMomentum,
  /// torch::optim::Adam: exp_avg and exp_avg_sq per element (max_exp_avg_sq too with amsgrad),
  /// and a step counter per parameter (an int64_t in the parameter's state, not tensor memory).
  kAdam,
  /// torch::optim::AdamW: the same state as Adam.
  kAdamW,
};

/// The optimizer's name as the plan prints it: to_string(PlanOptimizer::kAdamW) is "AdamW".
const char* to_string(PlanOptimizer optimizer);

/// Options of plan(), in the LibTorch style:
///
///   fsdp::plan(root, fsdp::PlanOptions().optimizer(fsdp::PlanOptimizer::kAdam).amsgrad(true));
struct PlanOptions {
  /// The optimizer whose state to predict.
  TORCH_ARG(PlanOptimizer, optimizer) = PlanOptimizer::kNone;
  /// Adam/AdamW with amsgrad: one more state tensor (max_exp_avg_sq) per parameter.
  TORCH_ARG(bool, amsgrad) = false;
  /// Print each handle's original parameters (FQN and shape) under it.
  TORCH_ARG(bool, list_parameters) = false;
};

/// How a unit keeps its parameters, as planned (FSDP1's names).
enum class PlannedStrategy {
  kFullShard,
  kShardGradOp,
  kNoShard,
  /// HSDP: FULL_SHARD inside the shard group, gradients all-reduced across replicas.
  kHybridShard,
  /// HSDP with SHARD_GRAD_OP inside the shard group (PyTorch's _HYBRID_SHARD_ZERO2).
  kHybridShardZero2,
};

/// FSDP's name of the strategy: to_string(PlannedStrategy::kShardGradOp) is "SHARD_GRAD_OP".
const char* to_string(PlannedStrategy strategy);

/// One FlatParameter (FlatParamHandle) of a unit.
struct HandlePlan {
  c10::ScalarType dtype = c10::ScalarType::Float;          // the shards' (the parameters')
  c10::ScalarType compute_dtype = c10::ScalarType::Float;  // all-gathered and computed in
  c10::ScalarType reduce_dtype = c10::ScalarType::Float;   // gradients reduced in
  bool trainable = true;
  /// Sharded across more than one rank (false: NO_SHARD, or one rank).
  bool sharded = true;
  /// Keeps a padded unsharded buffer (sharded, or a low-precision / device copy without sharding).
  bool unsharded_buffer = true;
  /// Keeps a copy of the shard in the compute dtype / on the compute device.
  bool compute_copy = false;
  bool offload_to_cpu = false;
  int64_t num_params = 0;
  /// The original parameters' elements, without padding.
  int64_t numel = 0;
  /// The FlatParameter: aligned (each parameter on 16 bytes), then padded to a multiple of the
  /// ranks it is sharded over; shard_numel = padded_numel / ranks.
  int64_t aligned_numel = 0;
  int64_t padded_numel = 0;
  int64_t shard_numel = 0;
  /// Elements of original parameters in this rank's shard (the rest is padding), and the most
  /// any rank holds.
  int64_t rank_numel = 0;
  int64_t max_rank_numel = 0;
  /// Quantized communication ([Note: communication codecs] in fsdp/comm_codec.h), when the handle
  /// is sharded and its unit has the codec: the bytes of this rank's encoded shard
  /// (encoded_bytes(shard_numel)) for the all-gather, and per destination for the gradient
  /// all-to-all; 0 otherwise.
  int64_t encoded_gather_bytes = 0;
  int64_t encoded_reduce_bytes = 0;
  /// The original parameters, "fqn [shape]", relative to the unit's module.
  std::vector<std::string> params;

  int64_t shard_bytes() const { return shard_numel * static_cast<int64_t>(c10::elementSize(dtype)); }
  /// The padded unsharded buffer (0 when the handle keeps none).
  int64_t unsharded_bytes() const {
    return unsharded_buffer ? padded_numel * static_cast<int64_t>(c10::elementSize(compute_dtype)) : 0;
  }
};

/// One unit (one fully_shard call).
struct UnitPlan {
  /// The FQNs of its modules relative to the root ("" for the root), several for a unit of
  /// siblings, and the modules' class.
  std::vector<std::string> module_fqns;
  std::string module_class;
  /// Units whose modules contain one of this unit's modules (0 for the root).
  int depth = 0;
  bool is_root = false;
  PlannedStrategy strategy = PlannedStrategy::kFullShard;
  /// Resharded after forward and all-gathered again in backward (FULL_SHARD, not the root).
  bool reshards_after_forward = true;
  /// reshard_after_forward(int) below the shard group's size: the post-forward group's size
  /// (the backward all-gather runs inside it); 0 otherwise.
  int post_forward_group_size = 0;
  /// The ranks it shards over, and the replicas its gradients are all-reduced across (HSDP).
  int shard_group_size = 1;
  int replicate_group_size = 1;
  std::optional<c10::ScalarType> param_dtype;
  std::optional<c10::ScalarType> reduce_dtype;
  bool offload_to_cpu = false;
  /// The codecs' names (CommCodec::name()), empty when none.
  std::string all_gather_codec;
  std::string reduce_codec;
  std::vector<HandlePlan> handles;

  /// The unit's name as lazy initialisation gives it ("<root>", "blocks.0", "a+b").
  std::string name() const;
  /// Bytes of the unit's padded unsharded buffers while unsharded (0: nothing is gathered).
  int64_t unsharded_bytes() const;
  /// Bytes of the unit's local shards on one rank.
  int64_t shard_bytes() const;
};

/// A parameter registered by several modules, and the unit that manages it.
struct TiedParameterPlacement {
  std::vector<std::string> fqns;  // every FQN it is registered under, relative to the root
  std::string unit;               // UnitPlan::name() of the unit managing it
  /// Empty when every module using it is inside that unit; else why lazy initialisation will
  /// refuse the model.
  std::string problem;
};

/// Per-rank memory, in bytes (see [Note: what the plan predicts]).
struct MemoryEstimate {
  int64_t sharded_params = 0;
  int64_t sharded_grads = 0;
  int64_t optimizer_state = 0;
  int64_t low_precision_shards = 0;
  /// Of the above, what lives in host memory because of CPU offload.
  int64_t offloaded = 0;
  int64_t sharded_state_bytes() const {
    return sharded_params + sharded_grads + optimizer_state + low_precision_shards;
  }
};

struct UnshardedPeak {
  int64_t root = 0;         // the root's unsharded buffers
  int64_t kept = 0;         // units kept unsharded from forward to backward
  int64_t in_flight = 0;    // the largest units resharded after forward, unsharded at once
  int units_in_flight = 0;  // how many units in_flight counts
  /// reshard_after_forward(int): every such unit's post-forward slice (padded bytes / group
  /// size), all held at the end of forward.
  int64_t post_forward = 0;
  int64_t total() const { return root + kept + in_flight + post_forward; }
};

struct CollectivePlan {
  int64_t calls = 0;
  int64_t bytes = 0;
};

/// Per rank and training step (see [Note: what the plan predicts]).
struct CommunicationPlan {
  CollectivePlan all_gather;      // comm::CollectiveKind::kAllGather
  CollectivePlan reduce_scatter;  // comm::CollectiveKind::kReduceScatter
  CollectivePlan all_reduce;      // comm::CollectiveKind::kAllReduce
  CollectivePlan all_to_all;      // comm::CollectiveKind::kAllToAll: gradients reduced through a codec
  /// reshard_after_forward(int): the backward all-gathers inside the post-forward groups (counted
  /// by those groups' communicators, not in all_gather).
  CollectivePlan post_forward_all_gather;
};

/// What plan() returns; print it with operator<<.
struct ShardingPlan {
  PlanOptions options;
  int rank = 0;
  int world_size = 1;
  /// The root's max_unshards_in_flight (the prefetch limit of the tree).
  int max_unshards_in_flight = 2;
  /// Every unit of the root's tree, in module order (pre-order: a unit before those inside it).
  std::vector<UnitPlan> units;
  std::vector<TiedParameterPlacement> tied_parameters;
  /// Parameters of the tree no unit manages (ignored, or registered after fully_shard): their FQNs.
  /// Not counted in any figure.
  std::vector<std::string> unmanaged_parameters;
  MemoryEstimate memory;          // this rank
  MemoryEstimate max_over_ranks;  // each figure's maximum over the ranks
  UnshardedPeak unsharded_params;
  /// Bound on the unsharded gradient buffers alive at once in backward.
  int64_t unsharded_grads_bound = 0;
  CommunicationPlan communication;
  /// Tensor parallelism (parallelize_module before fully_shard): the parameters it placed. Every
  /// figure above counts this rank's pieces; the tensor-parallel collectives move activations, whose
  /// size depends on the batch, and are not predicted.
  struct TensorParallel {
    int size = 1;                 // the tp group's size (1: no tensor parallelism)
    std::string mesh_dim;         // its mesh dimension's name
    int64_t sharded_params = 0;   // split over the tp group
    int64_t whole_params = 0;     // whole on every rank of the group (row-parallel biases, ...)
    int64_t local_numel = 0;      // elements of the split ones on this rank
    int64_t global_numel = 0;     // and their global elements
  } tensor_parallel;
};

/// The sharding plan of the tree of `root`, the unit fully_shard made of the outermost module (see
/// the top of this file). Works before the first forward (it reads the units' layouts, nothing
/// lazily initialised) and at any time after; communicates nothing. Fails, naming the module, when
/// `root` is inside another unit.
///
///   auto root = fsdp::fully_shard(model, opts);
///   std::cout << fsdp::plan(root, fsdp::PlanOptions().optimizer(fsdp::PlanOptimizer::kAdamW));
ShardingPlan plan(const FSDPModule& root, const PlanOptions& options = {});

/// The same for the root module (fully_shard must have been applied to it).
///
///   std::cout << fsdp::plan(*model);
ShardingPlan plan(torch::nn::Module& root, const PlanOptions& options = {});

/// Prints the plan: the unit tree with each handle's layout, the memory per rank and the bytes
/// communicated per step.
std::ostream& operator<<(std::ostream& out, const ShardingPlan& plan);

}  // namespace fsdp
