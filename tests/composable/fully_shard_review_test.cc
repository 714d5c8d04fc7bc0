// Defects a code review suspected in the backward engine and its collectives, each checked over
// MPI on every world size of the launch:
//   - a unit whose output the caller holds but the loss does not use (an auxiliary head) must not
//     stop the reverse-order reductions: the units before it reduce while backward runs, so at
//     most two units' unsharded gradients are alive at once, with parity;
//   - ranks that differ in whether a parameter holds a gradient when a tied parameter moves (at
//     the root's fully_shard) issue the same collectives, and end with the same gradients;
//   - a backward through the graph of an earlier iteration is refused alike whichever of the
//     unit's hooks it reaches first (its outputs' pre-backward or its inputs' post-backward).
#include <algorithm>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/fully_shard_internal.h"
#include "fsdp_cpp/contract/hookable_modules.h"
#include "fsdp_cpp/fsdp/fsdp_state.h"
#include "fsdp_cpp/tests/composable/test_models.h"
#include "fsdp_cpp/tests/composable/tied_models.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using fsdp::FullyShardOptions;
using fsdp::testing::fresh_comm;
using fsdp::testing::error_of;
using fsdp::testing::rank;
using fsdp::testing::same_on_every_rank;
using fsdp::testing::world;
using fsdp::testing::world_size;
using Catch::Matchers::Contains;

constexpr int64_t kDim = 64;
constexpr int kDepth = 6;

// h -> h + tanh(layer_i(h)) for each layer, then an auxiliary head on the last hidden state whose
// output the caller holds (`aux_out`) while the loss may not use it. `probe` runs in backward at
// every layer boundary.
struct AuxChainImpl : torch::nn::Module {
  AuxChainImpl() {
    for (int i = 0; i < kDepth; ++i) {
      layers.push_back(register_module("l" + std::to_string(i), fsdp::contract::Linear(kDim, kDim)));
    }
    aux = register_module("aux", fsdp::contract::Linear(kDim, kDim));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& layer : layers) {
      x = x + torch::tanh(layer(x));
      if (probe && x.requires_grad()) x.register_hook([p = probe](const at::Tensor&) { p(); });
    }
    aux_out = aux(x);
    return x;
  }
  std::vector<fsdp::contract::Linear> layers;
  fsdp::contract::Linear aux{nullptr};
  at::Tensor aux_out;
  std::function<void()> probe;
};
FSDP_HOOKABLE_MODULE(AuxChain);

std::vector<fsdp::FSDPModule> shard(AuxChain& model, const FullyShardOptions& options) {
  std::vector<fsdp::FSDPModule> units;
  for (auto& layer : model->layers) units.push_back(fsdp::fully_shard(layer, options));
  units.push_back(fsdp::fully_shard(model->aux, options));
  units.push_back(fsdp::fully_shard(model, options));  // the root (no parameters of its own)
  return units;
}

at::Tensor batch(int r, int64_t it) {
  torch::manual_seed(1000 + 31 * it + r);
  return at::randn({4, kDim});
}

// The loss of rank `r`: the main output's, plus the auxiliary head's when `use_aux(r)`.
at::Tensor loss_of(AuxChain& model, int r, int64_t it, bool with_aux) {
  at::Tensor loss = model(batch(r, it)).pow(2).mean();
  if (with_aux) loss = loss + model->aux_out.pow(2).mean();
  return loss;
}

// One unit's padded flat gradient in bytes at world size W (Linear(kDim, kDim): weight aligned to
// 16 bytes, then the bias, padded to a multiple of W).
int64_t padded_unit_bytes(int W) {
  const int64_t align = 4;
  int64_t n = (kDim * kDim + align - 1) / align * align + kDim;
  n = (n + W - 1) / W * W;
  return n * 4;
}

// Checks every parameter's (sharded) gradient against the reference's full gradient `ref`.
void check_gradients(const std::vector<fsdp::FSDPModule>& units, const std::vector<at::Tensor>& params,
                     const std::vector<at::Tensor>& ref) {
  const int W = world_size();
  for (const auto& u : units) {
    for (const auto& h : fsdp::detail::handles_of(u)) {
      for (size_t i = 0; i < h->params().size(); ++i) {
        const at::Tensor& p = h->params()[i].param;
        const auto it = std::find_if(params.begin(), params.end(), [&](const at::Tensor& q) { return q.is_same(p); });
        REQUIRE(it != params.end());
        const at::Tensor full = ref[static_cast<size_t>(it - params.begin())].reshape({-1});
        const auto s = h->layout().slice_of(static_cast<int>(i), W == 1 ? 0 : rank());
        const at::Tensor expected = W == 1 ? full : full.narrow(0, s.param_begin, s.size());
        INFO(u.fqn() << " '" << h->params()[i].fqn << "'");
        if (!p.grad().defined()) {  // no rank's backward reached it: no gradient, as in local training
          CHECK((expected.numel() == 0 || expected.abs().max().item<float>() == 0.0f));
          continue;
        }
        CHECK(at::allclose(p.grad().reshape({-1}), expected, 1e-5, 1e-6));
      }
    }
  }
}

// The reference gradients: every rank's batch on an unsharded copy, averaged.
std::vector<at::Tensor> reference_gradients(int64_t it, const std::function<bool(int)>& with_aux) {
  torch::manual_seed(7);
  AuxChain reference;
  std::vector<at::Tensor> sums;
  for (int r = 0; r < world_size(); ++r) {
    loss_of(reference, r, it, with_aux(r)).backward();
  }
  for (const auto& p : reference->parameters()) {
    sums.push_back(p.grad().defined() ? p.grad() / world_size() : at::zeros_like(p));
  }
  return sums;
}

FSDP_RANKS_TEST_CASE("an auxiliary head whose output is held but unused keeps reductions flowing: "
                     "at most two units' gradients alive, parity", "[review][backward][memory]") {
  const int W = world_size();
  for (auto prefetch : {fsdp::BackwardPrefetch::kBackwardPre, fsdp::BackwardPrefetch::kNone}) {
    torch::manual_seed(7);
    AuxChain model;
    const std::vector<at::Tensor> params = model->parameters();
    auto units = shard(model, FullyShardOptions().communicator(fresh_comm()).backward_prefetch(prefetch));
    int64_t peak = 0;
    model->probe = [&] {
      int64_t bytes = 0;
      for (const auto& u : units) {
        for (const auto& h : fsdp::detail::handles_of(u)) bytes += static_cast<int64_t>(h->gradient_buffer_bytes());
      }
      peak = std::max(peak, bytes);
    };
    for (int64_t it = 0; it < 2; ++it) {  // the first iteration is checked across ranks, the second not
      for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
      peak = 0;
      loss_of(model, rank(), it, /*with_aux=*/false).backward();
      INFO("W=" << W << " prefetch " << static_cast<int>(prefetch) << " iteration " << it << ": peak "
                << peak << " B of unsharded gradient buffers, one unit's " << padded_unit_bytes(W) << " B");
      // The unit computing its gradients and the one whose reduction is in flight (with their
      // shard-sized reduction outputs), never more: the head that backward reaches on no rank is
      // skipped ([Note: backward reach]) rather than hold the queue until the end of backward.
      CHECK(peak <= 2 * padded_unit_bytes(W) + 2 * padded_unit_bytes(W) / W);
      check_gradients(units, params, reference_gradients(it, [](int) { return false; }));
    }
  }
}

FSDP_RANKS_TEST_CASE("an auxiliary head used by the loss after the main path keeps parity", "[review][backward]") {
  torch::manual_seed(7);
  AuxChain model;
  const std::vector<at::Tensor> params = model->parameters();
  auto units = shard(model, FullyShardOptions().communicator(fresh_comm()));
  for (int64_t it = 0; it < 2; ++it) {
    for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
    loss_of(model, rank(), it, /*with_aux=*/true).backward();
    check_gradients(units, params, reference_gradients(it, [](int) { return true; }));
  }
}

FSDP_RANKS_TEST_CASE("an auxiliary head used by the loss on some ranks only trains with parity, "
                     "in checked iterations and later ones", "[review][backward]") {
  torch::manual_seed(7);
  AuxChain model;
  const std::vector<at::Tensor> params = model->parameters();
  auto units = shard(model, FullyShardOptions().communicator(fresh_comm()));
  // Rank 0 backpropagates through the head, the others do not: every rank all-gathers the head
  // when the backward pass begins and reduces it at its end ([Note: backward reach]), so its
  // gradient is rank 0's divided by the world size, as DDP gives it.
  for (int64_t it = 0; it < 3; ++it) {
    for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
    loss_of(model, rank(), it, rank() == 0).backward();
    check_gradients(units, params, reference_gradients(it, [](int r) { return r == 0; }));
  }
}

FSDP_RANKS_TEST_CASE("a tied parameter moves alike when ranks differ in which parameters hold gradients",
                     "[review][tied]") {
  constexpr int64_t kIn = 6, kHidden = 10;
  torch::manual_seed(5);
  auto model = fsdp::testing::TiedSiblings(kIn, kHidden);
  auto comm = fresh_comm();
  const auto o = FullyShardOptions().communicator(comm);
  auto emb = fsdp::fully_shard(model->emb, o);
  auto head = fsdp::fully_shard(model->head, o);
  // Only rank 0 holds a gradient (its shard of the tied weight, all ones) when the weight moves:
  // the other ranks must still take part in gathering it.
  const int64_t ones = rank() == 0 ? model->emb->weight.numel() : 0;
  if (rank() == 0) model->emb->weight.mutable_grad() = at::ones_like(model->emb->weight);
  auto root = fsdp::fully_shard(model, o);
  REQUIRE(root.manages(model->emb->weight));
  CHECK(same_on_every_rank(std::to_string(comm->sequence_number())));
  // Every rank holds the same full gradient (rank 0's shard of ones, zeros elsewhere), so the
  // sharded gradients add up to rank 0's count of ones; the bias held none anywhere and still has
  // none.
  const at::Tensor g = model->emb->weight.grad();
  REQUIRE(g.defined());
  at::Tensor sums = at::tensor({g.sum().item<double>(), static_cast<double>(ones)}, at::kDouble);
  world().all_reduce(sums).wait();
  CHECK(sums[0].item<double>() == sums[1].item<double>());
  CHECK(sums[1].item<double>() > 0);
  CHECK_FALSE(model->emb->bias.grad().defined());
  // Training works on after the move.
  model(at::randn({3, kIn})).sum().backward();
  CHECK(model->emb->weight.grad().defined());
}

// A unit whose forward keeps a tensor computed from its (routed) input: a backward from it reaches
// the unit's post-backward without passing its outputs' pre-backward.
struct SideImpl : torch::nn::Module {
  SideImpl() { fc = register_module("fc", fsdp::contract::Linear(kDim, kDim)); }
  torch::Tensor forward(torch::Tensor x) {
    side = x * 2;
    return fc(x);
  }
  fsdp::contract::Linear fc{nullptr};
  at::Tensor side;
};
FSDP_HOOKABLE_MODULE(Side);

struct SideModelImpl : torch::nn::Module {
  SideModelImpl() { unit = register_module("unit", Side()); }
  torch::Tensor forward(torch::Tensor x) { return torch::tanh(unit(x)); }
  Side unit{nullptr};
};
FSDP_HOOKABLE_MODULE(SideModel);

FSDP_RANKS_TEST_CASE("a backward through an earlier iteration's graph is refused at the post-backward "
                     "as at the pre-backward, on every rank", "[review][backward][errors]") {
  torch::manual_seed(3);
  SideModel model;
  const auto o = FullyShardOptions().communicator(fresh_comm());
  auto unit = fsdp::fully_shard(model->unit, o);
  auto root = fsdp::fully_shard(model, o);
  const at::Tensor x = at::randn({2, kDim}).requires_grad_();
  at::Tensor out = model(x);
  at::Tensor old_side = model->unit->side;
  out.sum().backward({}, /*retain_graph=*/true);
  model(x).sum().backward();  // a new iteration
  if (world_size() == 1) {
    // One rank runs without hooks (nothing is sharded): an old graph is plain local autograd.
    x.mutable_grad() = at::Tensor();
    old_side.sum().backward();
    CHECK(x.grad().equal(at::full_like(x, 2)));
    return;
  }
  // Through the unit's output of the first iteration: its pre-backward refuses.
  const std::string pre = error_of([&] { out.sum().backward(); });
  INFO(pre);
  CHECK_THAT(pre, Contains("graph of an earlier iteration"));
  // Through a tensor the unit computed from its input in the first iteration: the post-backward
  // of that call is reached first, and refuses alike.
  const std::string post = error_of([&] { old_side.sum().backward(); });
  INFO(post);
  CHECK_THAT(post, Contains("graph of an earlier iteration"));
  CHECK(same_on_every_rank(post));
  // Training goes on.
  for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
  model(x).sum().backward();
  CHECK(model->unit->fc->weight.grad().defined());
}

}  // namespace
