#pragma once
// fsdp::optim::Muon: torch.optim.Muon (torch 2.15, torch/optim/_muon.py) on fully_shard models.
//
// Muon steps 2-D matrices: momentum (buf = lerp(buf, grad, 1 - momentum)), the Nesterov update
// (lerp(grad, buf, momentum)) or the momentum itself, Newton-Schulz orthogonalization of that
// update in bfloat16 (ns_steps quintic iterations with ns_coefficients, after dividing by the
// Frobenius norm clamped at eps; a tall matrix is orthogonalized transposed), decoupled weight
// decay (param *= 1 - lr * weight_decay) and the update scaled by the adjusted learning rate
// (adjust_lr_fn: "original"/none sqrt(max(1, rows/cols)), "match_rms_adamw" 0.2 sqrt(max(rows,
// cols)), "spectral_unclamped" sqrt(rows/cols)). Everything but Newton-Schulz is elementwise and
// runs on each rank's shard; Newton-Schulz needs the whole matrix.
//
// [Note: Muon on flat shards] After fully_shard each rank holds a flat slice of every matrix
// (fsdp/flat_param_layout.h: a parameter's flattened elements [begin, end), maybe none, uneven
// at the end of a FlatParameter and next to padding). Each matrix has one OWNER rank, assigned
// once at construction by a greedy balance of the Newton-Schulz cost rows * cols * min(rows,
// cols): matrices in decreasing cost (ties: optimizer order) each go to the rank with the least
// cost so far (ties: the lowest rank). A step is
//   1. local: momentum and the update of this rank's slice of every matrix, cast to bfloat16
//      (Newton-Schulz's first op, so sending bfloat16 changes no value);
//   2. one all-gather of a byte per matrix and rank: which matrices have a gradient on this rank,
//      and whether this rank found an error (a gradient of the wrong size, a parameter left
//      unsharded; the messages then follow, comm/agreement.h), so every rank steps the same
//      matrices or every rank refuses with the same error;
//   3. one all-to-all (Communicator::all_to_all with splits): each rank sends its slice of every
//      matrix to the matrix's owner, which assembles the matrices it owns;
//   4. Newton-Schulz on the owned matrices only;
//   5. one all-to-all back: each owner sends every rank the slice of the result it holds;
//   6. local: weight decay and the update on this rank's slices.
// So a step issues three collectives whatever the number of matrices; their sizes (splits) are
// computed by every rank from the same metadata: at construction every rank's placement of every
// matrix (FQN, shape, dtype, flat offset and size of its slice, whether it writes it) is
// all-gathered once and checked (the same matrices in the same order on every rank, the writers'
// slices covering each matrix exactly once) before anything else is exchanged. Values held by
// several ranks (hybrid sharding's replicas, NO_SHARD, a model without fully_shard) are sent by
// the one rank whose `write` flag is set (checkpoint/local_shard.h) and received by every holder.
// The result equals torch.optim.Muon on the unsharded model: the same ops on the same values,
// up to the float32 rounding of the gradients' reduction.
//
// Tensor parallelism: a matrix that parallelize_module cut into pieces (composable/
// tensor_placement.h) is refused at construction, on every rank, naming it: Newton-Schulz of a
// piece is not the piece of Newton-Schulz, and Muon does not gather pieces across tp groups. Give
// such matrices to AdamW (split_muon_params(..., {patterns})), or apply Muon before tensor
// parallelism. Matrices that tensor parallelism leaves whole on every tp rank are fine: the
// communicator must then span the tp ranks (the world), and each copy is written by tp rank 0.
//
// The 2-D rule: like torch.optim.Muon, every parameter given to Muon must be a matrix (its
// unsharded shape); anything else is refused on every rank naming its FQN. The usual recipe
// (Keller Jordan's, Moonshot's) steps the hidden matrices with Muon and everything else
// (biases, norms, embeddings, often the output head) with AdamW: split_muon_params does the split.
//
//   auto split = fsdp::optim::split_muon_params(*model, {"tok_emb", "lm_head"});
//   fsdp::optim::Muon muon(*model, split.muon, fsdp::optim::MuonOptions(0.02));
//   fsdp::optim::AdamW adamw(split.other, torch::optim::AdamWOptions(3e-4).weight_decay(0.01));
//   loss.backward();
//   muon.step();   // collective: every rank of the communicator
//   adamw.step();
//
// State: per parameter a `momentum_buffer` (MuonParamState, the shape of the parameter's local
// slice, as torch::optim's SGD keeps it), param groups with MuonOptions; state_dict() gives
// torch's form keyed by FQN (full momentum buffers), sharded_state_dict() this rank's views for
// fsdp::dcp::save_state/load_state.

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "fsdp_cpp/checkpoint/local_shard.h"
#include "fsdp_cpp/comm/communicator.h"

namespace fsdp::optim {

/// torch.optim.Muon's hyperparameters, with its defaults.
struct MuonOptions : public torch::optim::OptimizerCloneableOptions<MuonOptions> {
  MuonOptions(double lr = 1e-3);  // NOLINT(google-explicit-constructor): as torch::optim's options
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(double, weight_decay) = 0.1;
  TORCH_ARG(double, momentum) = 0.95;
  TORCH_ARG(bool, nesterov) = true;
  TORCH_ARG(std::vector<double>, ns_coefficients) = {3.4445, -4.7750, 2.0315};
  TORCH_ARG(double, eps) = 1e-7;
  TORCH_ARG(int64_t, ns_steps) = 5;
  /// "original", "match_rms_adamw", "spectral_unclamped", or none ("original").
  TORCH_ARG(std::optional<std::string>, adjust_lr_fn) = std::nullopt;

 public:
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
  /// The error torch.optim.Muon raises for these options, or "" when they are valid.
  std::string invalid() const;
};

/// The learning rate torch.optim.Muon applies to a matrix of `rows` x `cols` (_adjust_lr).
double muon_adjusted_lr(double lr, const std::optional<std::string>& adjust_lr_fn, int64_t rows, int64_t cols);

/// torch.optim.Muon's _zeropower_via_newtonschulz on a whole matrix: bfloat16 result.
at::Tensor muon_newton_schulz(const at::Tensor& update, const std::vector<double>& ns_coefficients, int64_t ns_steps,
                              double eps);

struct MuonParamState : public torch::optim::OptimizerCloneableParamState<MuonParamState> {
  TORCH_ARG(at::Tensor, momentum_buffer);
};

/// The state of a Muon optimizer in torch.optim.Muon's state_dict() form, parameters named by FQN
/// (as torch.distributed.checkpoint.state_dict.get_optimizer_state_dict names them).
struct MuonStateDict {
  struct ParamGroup {
    MuonOptions options;
    std::vector<std::string> params;  // FQNs
  };
  /// FQN -> momentum_buffer in the matrix's full shape, for the parameters that have state.
  std::vector<std::pair<std::string, at::Tensor>> state;
  std::vector<ParamGroup> param_groups;
};

/// What the last step() did, on this rank.
struct MuonStepStats {
  int64_t matrices = 0;        // matrices stepped (on every rank)
  int64_t orthogonalized = 0;  // of those, orthogonalized on this rank
  int64_t collectives = 0;     // collectives issued by this step
  int64_t bytes_sent = 0;      // bytes this rank put into the all-to-alls (its own part included)
  double exchange_seconds = 0; // in the collectives and assembling what they carry
  double newton_schulz_seconds = 0;
};

/// Who orthogonalizes a matrix.
enum class MuonDistribution {
  /// One owner per matrix, spread by cost (see the note above): the default.
  kOwners,
  /// Every rank assembles and orthogonalizes every matrix (two collectives, W times the
  /// Newton-Schulz work): the comparison point of tools/bench/muon_bench.cc.
  kEveryRank,
};

/// One matrix the optimizer steps, as every rank sees it.
struct MuonMatrix {
  std::string fqn;
  int64_t rows = 0;
  int64_t cols = 0;
  int owner = 0;      // the rank of the communicator that orthogonalizes it
  size_t group = 0;   // param group and index in it
  size_t index = 0;
};

class Muon : public torch::optim::Optimizer {
 public:
  /// A param group's MuonOptions are its options whole (C++ options have no unset fields to take
  /// from `defaults`, unlike Python's dicts); groups without options get `defaults`.
  /// `model`: a fully_shard root (its parameters sharded over `comm`'s ranks) or a model without
  /// fully_shard (every parameter whole on every rank). `param_groups`: parameters of `model`
  /// (by tensor identity), each a matrix. `comm`: the ranks among which the matrices are spread;
  /// default, for a fully_shard root, the default process group (comm/init.h), else none (this
  /// rank alone). Collective over `comm` (one all-gather of the placements); every error is
  /// refused on every rank of `comm` with the same message, naming the parameter.
  Muon(torch::nn::Module& model, const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
       MuonOptions defaults = {}, std::shared_ptr<comm::Communicator> comm = nullptr,
       MuonDistribution distribution = MuonDistribution::kOwners);
  Muon(torch::nn::Module& model, std::vector<at::Tensor> params, MuonOptions defaults = {},
       std::shared_ptr<comm::Communicator> comm = nullptr, MuonDistribution distribution = MuonDistribution::kOwners);

  /// One step (see [Note: Muon on flat shards]); collective over the communicator.
  at::Tensor step(LossClosure closure = nullptr) override;

  /// Every matrix, in optimizer order (param groups, then parameters), with its owner.
  const std::vector<MuonMatrix>& matrices() const { return matrices_; }
  const MuonStepStats& last_step() const { return stats_; }
  const std::shared_ptr<comm::Communicator>& communicator() const { return comm_; }

  /// torch's state dict (see MuonStateDict): collective; momentum buffers assembled on every
  /// rank, or on rank 0 only with `rank0_only` (the others get the param groups and no state).
  MuonStateDict state_dict(bool rank0_only = false);
  /// Loads a MuonStateDict (every rank passes the same one): each rank takes its slices.
  /// Collective; validated first (every FQN known, shapes, group sizes, valid options) and the
  /// outcome agreed, so it changes nothing on any rank when any rank refuses.
  void load_state_dict(const MuonStateDict& state);
  /// This rank's momentum buffers as views ("state.<fqn>.momentum_buffer", the matrix's global
  /// shape, this rank's flat offset and write flag): what fsdp::dcp::save_state writes and
  /// load_state fills. Buffers not created yet are created (zeros), so a load into a fresh
  /// optimizer fills them. No communication.
  ShardedStateDict sharded_state_dict();

  /// torch::optim's archives hold one rank's slices under parameter indices, which no other
  /// layout could load: refused (use state_dict() or sharded_state_dict()).
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 private:
  // Where one rank holds a matrix: flattened elements [offset, offset + numel).
  struct Holding {
    int64_t offset = 0;
    int64_t numel = 0;
    bool write = false;
  };
  void build(torch::nn::Module& model, MuonDistribution distribution);
  // The agreed flags of `stepped` (one per matrix) and errors; throws the lowest rank's error.
  std::vector<uint8_t> agree(const std::vector<uint8_t>& local, const std::string& error, const std::string& api);
  // Sends every rank's written slice of the matrices in `which` (`slices[m]`: this rank's elements)
  // to the ranks `dest(m)` names; returns, on each such rank, the assembled matrices (others
  // undefined).
  std::vector<at::Tensor> assemble(const std::vector<size_t>& which, const std::vector<at::Tensor>& slices,
                                   const std::vector<std::vector<int>>& dest, c10::ScalarType dtype);
  // The reverse for results held by their owners: every holder gets its slice.
  std::vector<at::Tensor> scatter(const std::vector<size_t>& which, const std::vector<at::Tensor>& full,
                                  c10::ScalarType dtype);
  at::Tensor& param_of(size_t m);
  MuonParamState* state_of(size_t m);

  std::shared_ptr<comm::Communicator> comm_;
  MuonDistribution distribution_ = MuonDistribution::kOwners;
  std::vector<MuonMatrix> matrices_;
  std::vector<std::vector<Holding>> holdings_;  // [matrix][rank]
  MuonStepStats stats_;
};

/// The parameters of `model` (a fully_shard root or a model without fully_shard) split for the
/// usual Muon recipe: `muon` holds the matrices (2-D in their unsharded shape) whose FQN contains
/// none of `exclude` (e.g. the embedding and the output head), `other` everything else (biases,
/// norms, embeddings: for AdamW). Named_parameters order; a tied parameter once, under its first
/// FQN. Local.
struct MuonParamSplit {
  std::vector<at::Tensor> muon;
  std::vector<std::string> muon_fqns;
  std::vector<at::Tensor> other;
  std::vector<std::string> other_fqns;
};
MuonParamSplit split_muon_params(torch::nn::Module& model, const std::vector<std::string>& exclude = {});

}  // namespace fsdp::optim
