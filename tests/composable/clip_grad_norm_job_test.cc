// Job-wide fsdp::clip_grad_norm_(roots, max_norm, norm_type, pipeline_group), over MPI on every
// world size, against torch::nn::utils::clip_grad_norm_ on the whole unsharded model (L2 and max
// norms, max_norm a quarter of the total so that clipping binds):
//   - a chain of 4 residual MLP blocks cut by hand into pipeline stages (contract::ModuleList::
//     keep_only keeps the FQNs), each stage chunk a fully_shard root with a unit per block, in every
//     layout 1-4 ranks allow: pp alone (2, 3, 4 stages), dp alone, pp=2 x dp=2 (comm::DeviceMesh),
//     pp=2 x HSDP (2 replicas), and 2 chunks per rank (interleaved placement, stage s on pipeline
//     rank s % pp; on one rank: two roots and no pipeline group);
//   - no pipeline schedule: each chunk's units compute their own gradients through backward, from
//     the input the chunk's stage gets in the unsharded model (the preceding blocks run without
//     gradients) and the gradient of this data-parallel rank's loss with respect to the chunk's
//     output (autograd on the unsharded model). fully_shard averages over the data-parallel ranks,
//     so the chunks hold slices of the whole model's gradient, each stage only its own part;
//   - the returned norm equals the whole model's (not the stage's, which differs), and every
//     clipped gradient equals the unsharded one's;
//   - refusals (negative or NaN max_norm, norm_type <= 0, a unit that is not a root before and
//     after the first forward) given on one rank only reach every rank, with the same error and
//     the gradients unchanged.
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/utils/clip_grad.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/comm/device_mesh.h"
#include "fsdp_cpp/composable/clip_grad_norm.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/summon_full_params.h"
#include "fsdp_cpp/contract/hookable_module_holder.h"
#include "fsdp_cpp/contract/hookable_module_list.h"
#include "fsdp_cpp/pipeline/stage_split.h"
#include "fsdp_cpp/tests/composable/test_models.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::testing::MlpBlock;
using fsdp::testing::rank;
using fsdp::testing::world;
using fsdp::testing::world_size;

constexpr int64_t kBlocks = 4;
constexpr int64_t kDim = 6;
constexpr int64_t kHidden = 10;

/// blocks[0] -> ... -> blocks[n-1]; a stage keeps some of them (keep_only) under their FQNs.
struct ChainImpl : torch::nn::Module {
  ChainImpl() {
    blocks = register_module("blocks", fsdp::contract::ModuleList());
    for (int64_t i = 0; i < kBlocks; ++i) blocks->push_back(MlpBlock(kDim, kHidden));
  }
  at::Tensor forward(at::Tensor x) {
    for (const auto& block : *blocks) x = block.forward<at::Tensor>(x);
    return x;
  }
  MlpBlock block(size_t position) const { return blocks->at<MlpBlock>(position); }
  fsdp::contract::ModuleList blocks{nullptr};
};
FSDP_HOOKABLE_MODULE(Chain);

Chain make_chain() {
  torch::manual_seed(2024);
  return Chain();
}

// Data-parallel rank d's batch.
std::pair<at::Tensor, at::Tensor> batch(int d) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(613 + 17 * d));
  return {at::randn({5, kDim}, gen), at::randn({5, kDim}, gen)};
}

at::Tensor run_blocks(Chain& model, at::Tensor h, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) h = model->block(static_cast<size_t>(i))(h);
  return h;
}

// The input stage [begin, end) gets in the unsharded model, and the gradient of rank d's loss
// (mse, not divided by the data-parallel size: fully_shard averages) with respect to its output.
std::pair<at::Tensor, at::Tensor> stage_io(Chain& reference, int d, int64_t begin, int64_t end) {
  const auto [x, y] = batch(d);
  at::Tensor input, output;
  {
    torch::NoGradGuard no_grad;
    input = run_blocks(reference, x, 0, begin);
    output = run_blocks(reference, input, begin, end);
  }
  at::Tensor h = output.detach().requires_grad_(true);
  const at::Tensor loss = torch::nn::functional::mse_loss(run_blocks(reference, h, end, kBlocks), y);
  return {input, torch::autograd::grad({loss}, {h})[0]};
}

struct Layout {
  std::string name;
  int pp = 1;         // pipeline ranks
  int replicate = 1;  // HSDP replicas (1: plain fully_shard)
  int shard = 1;      // ranks each unit shards across
  int chunks = 1;     // stage chunks per pipeline rank (interleaved placement)
};

std::vector<Layout> layouts() {
  switch (world_size()) {
    case 1: return {{"one rank", 1, 1, 1, 1}, {"two chunks on one rank", 1, 1, 1, 2}};
    case 2: return {{"pp=2", 2, 1, 1, 1}, {"pp=2, 2 chunks per rank", 2, 1, 1, 2}, {"dp=2", 1, 1, 2, 1}};
    case 3: return {{"pp=3", 3, 1, 1, 1}, {"dp=3", 1, 1, 3, 1}};
    default: return {{"pp=2 x dp=2", 2, 1, 2, 1}, {"pp=4", 4, 1, 1, 1}, {"pp=2 x HSDP 2 x 1", 2, 2, 1, 1},
                     {"pp=2 x dp=2, 2 chunks per rank", 2, 1, 2, 2}};
  }
}

// One rank's part of the job: its stage chunks (fully_shard roots over the data-parallel groups).
struct Part {
  std::shared_ptr<fsdp::comm::DeviceMesh> mesh;
  std::vector<Chain> chunks;
  std::vector<fsdp::pipeline::BlockRange> ranges;
  std::vector<fsdp::FSDPModule> roots;
  std::vector<std::vector<fsdp::FSDPModule>> units;  // per chunk: the block units, the root last
  int dp_rank = 0;
  int dp_size = 1;
  std::shared_ptr<fsdp::comm::Communicator> pp_group() const { return mesh->group("pp"); }
};

Part build(const Layout& layout) {
  Part part;
  part.mesh = fsdp::comm::DeviceMesh::create(world(), {layout.pp, layout.replicate, layout.shard},
                                             {"pp", "replicate", "shard"});
  part.dp_rank = part.mesh->coordinate("replicate") * layout.shard + part.mesh->coordinate("shard");
  part.dp_size = layout.replicate * layout.shard;
  const auto options = layout.replicate > 1
                           ? fsdp::FullyShardOptions().mesh(part.mesh->submesh({"replicate", "shard"}))
                           : fsdp::FullyShardOptions().communicator(part.mesh->group("shard"));
  const int stages = layout.pp * layout.chunks;
  const auto ranges = fsdp::pipeline::split_blocks_evenly(kBlocks, stages);
  for (int s : fsdp::pipeline::stages_of_rank(part.mesh->coordinate("pp"), layout.pp, stages)) {
    Chain chunk = make_chain();
    chunk->blocks->keep_only(ranges[s].begin, ranges[s].end);
    std::vector<fsdp::FSDPModule> units;
    for (size_t i = 0; i < chunk->blocks->size(); ++i) units.push_back(fsdp::fully_shard(chunk->block(i), options));
    units.push_back(fsdp::fully_shard(chunk, options));
    part.roots.push_back(units.back());
    part.units.push_back(units);
    part.chunks.push_back(chunk);
    part.ranges.push_back(ranges[s]);
  }
  return part;
}

// Each chunk's forward and backward, as its stage runs them in the whole model.
void backward_chunks(Part& part, Chain& reference) {
  for (size_t c = 0; c < part.chunks.size(); ++c) {
    const auto [input, output_grad] = stage_io(reference, part.dp_rank, part.ranges[c].begin, part.ranges[c].end);
    part.chunks[c](input).backward(output_grad);
  }
}

using Grads = std::map<std::string, at::Tensor>;

Grads grads_of(torch::nn::Module& model) {
  Grads grads;
  for (const auto& item : model.named_parameters()) grads[item.key()] = item.value().grad().clone();
  return grads;
}

// The full gradients of a chunk (all-gathered over its data-parallel group).
Grads full_grads(const fsdp::FSDPModule& root, Chain& chunk) {
  fsdp::SummonFullParams full(root, fsdp::SummonFullParamsOptions().writeback(false).with_grads(true));
  return grads_of(*chunk);
}

double norm_of(const std::vector<at::Tensor>& grads, double norm_type) {
  double total = 0.0;
  for (const auto& g : grads) {
    total = std::isinf(norm_type) ? std::max(total, g.abs().max().item<double>())
                                  : total + g.abs().pow(norm_type).sum().item<double>();
  }
  return std::isinf(norm_type) ? total : std::pow(total, 1.0 / norm_type);
}

}  // namespace

FSDP_RANKS_TEST_CASE("clip_grad_norm_ over every stage chunk equals torch's on the whole unsharded model",
                     "[clip_grad_norm][pipeline]") {
  const double inf = std::numeric_limits<double>::infinity();
  for (const Layout& layout : layouts()) {
    for (double norm_type : {2.0, inf}) {
      INFO(world_size() << " ranks, " << layout.name << ", norm_type " << norm_type);
      Part part = build(layout);
      // The reference: the whole model on every data-parallel rank's batch (mean of the losses).
      Chain reference = make_chain();
      for (int d = 0; d < part.dp_size; ++d) {
        const auto [x, y] = batch(d);
        (torch::nn::functional::mse_loss(reference(x), y) / part.dp_size).backward();
      }
      const Grads unclipped = grads_of(*reference);
      const double total = torch::nn::utils::clip_grad_norm_(reference->parameters(), inf, norm_type);
      const double max_norm = total / 4;  // binds
      const double expected = torch::nn::utils::clip_grad_norm_(reference->parameters(), max_norm, norm_type);
      const Grads clipped = grads_of(*reference);

      backward_chunks(part, reference);
      // The stages this rank holds have a smaller L2 norm than the whole model (what clipping each
      // stage by its own norm would use).
      if (layout.pp > 1 && norm_type == 2.0) {
        std::vector<at::Tensor> mine;
        for (auto& chunk : part.chunks) {
          for (const auto& item : chunk->named_parameters()) mine.push_back(unclipped.at(item.key()));
        }
        CHECK(norm_of(mine, norm_type) < expected * (1 - 1e-3));
      }
      const auto pp_group = layout.pp > 1 ? part.pp_group() : nullptr;
      const double norm = fsdp::clip_grad_norm_(part.roots, max_norm, norm_type, pp_group);
      CHECK(norm == Approx(expected).epsilon(1e-5));
      CHECK(norm > 3 * max_norm);
      for (size_t c = 0; c < part.chunks.size(); ++c) {
        for (const auto& [key, g] : full_grads(part.roots[c], part.chunks[c])) {
          INFO("gradient of " << key);
          REQUIRE(g.defined());
          CHECK(at::allclose(g, clipped.at(key), 1e-4, 1e-6));
        }
      }
    }
  }
}

FSDP_RANKS_TEST_CASE("clip_grad_norm_'s refusals on one rank reach every rank, gradients unchanged",
                     "[clip_grad_norm][pipeline][errors]") {
  const int W = world_size();
  const int bad = W - 1;  // the rank that gives the bad argument
  // Every rank of the job must hear of it: over the pipeline group (pp = W), or, on 4 ranks, over
  // the data-parallel groups and then the pipeline groups (pp=2 x dp=2; rank 3 is in neither of
  // rank 0's groups).
  const Layout layout = W == 4 ? Layout{"pp=2 x dp=2", 2, 1, 2, 1} : Layout{"pp", W, 1, 1, 1};
  INFO(W << " ranks, " << layout.name);
  Part part = build(layout);
  const auto pp_group = part.pp_group();
  const double nan = std::nan("");
  auto refused = [&](double max_norm, double norm_type, std::vector<fsdp::FSDPModule> roots) {
    const std::string e = fsdp::testing::error_of(
        [&] { fsdp::clip_grad_norm_(roots, max_norm, norm_type, pp_group); });
    CHECK(fsdp::testing::same_on_every_rank(e));
    return e;
  };
  const auto mine = [&](double good, double wrong) { return rank() == bad ? wrong : good; };
  // A unit inside a root, before the first forward (nothing is initialised yet).
  std::vector<fsdp::FSDPModule> with_inner = part.roots;
  if (rank() == bad) with_inner[0] = part.units[0][0];
  // [Note: error agreement]: the refusing rank's world rank (the mesh's groups know it).
  const std::string from_bad =
      "fsdp::clip_grad_norm_: " + (W == 1 ? std::string("this rank") : "rank " + std::to_string(bad)) + ": ";
  CHECK_THAT(refused(1.0, 2.0, with_inner), Contains(from_bad + "unit '") && Contains("' is not a root"));

  Chain reference = make_chain();
  backward_chunks(part, reference);
  std::vector<Grads> before;
  for (auto& chunk : part.chunks) before.push_back(grads_of(*chunk));
  CHECK_THAT(refused(mine(1.0, -0.5), 2.0, part.roots),
             Contains(from_bad + "max_norm must be a number >= 0 (+infinity: never clip), got -0.5"));
  CHECK_THAT(refused(mine(1.0, nan), 2.0, part.roots), Contains(from_bad + "max_norm must be a number >= 0"));
  CHECK_THAT(refused(1.0, mine(2.0, 0.0), part.roots), Contains(from_bad + "norm_type must be > 0"));
  CHECK_THAT(refused(1.0, mine(2.0, -1.0), part.roots), Contains("norm_type must be > 0") && Contains("got -1"));
  // After the first forward: the block unit's name is its FQN under the stage's root.
  with_inner = part.roots;
  if (rank() == bad) with_inner[0] = part.units[0][0];
  const std::string inner = "blocks." + std::to_string(part.ranges[0].begin);
  const std::string e = refused(1.0, 2.0, with_inner);
  CHECK_THAT(e, Contains(from_bad + "unit '") && Contains("is not a root (it is inside unit '<root>')"));
  if (rank() == bad) CHECK_THAT(e, Contains("unit '" + inner + "'"));
  for (size_t c = 0; c < part.chunks.size(); ++c) {
    for (const auto& [key, g] : grads_of(*part.chunks[c])) {
      INFO("gradient of " << key);
      CHECK(at::equal(g, before[c].at(key)));
    }
  }
  // Accepted after all that: +infinity never clips.
  CHECK(fsdp::clip_grad_norm_(part.roots, std::numeric_limits<double>::infinity(), 2.0, pp_group) > 0.0);
}
