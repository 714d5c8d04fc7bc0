// Tensor parallel x fully_shard over MPI on every world size: N-d device meshes, the TP
// collectives against closed forms, loss parallel against cross_entropy on gathered logits, and
// the example GPT (Megatron-style plan) trained on every (dp, tp) mesh of the world with and
// without sequence parallelism and loss parallel, against an unsharded reference whose gradients
// are averaged over the dp groups' batches (the ranks of one tp group see the same batch).
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include "fsdp_cpp/comm/device_mesh.h"
#include "fsdp_cpp/composable/activation_checkpoint.h"
#include "fsdp_cpp/composable/clip_grad_norm.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/loss_parallel.h"
#include "fsdp_cpp/composable/plan.h"
#include "fsdp_cpp/composable/tensor_parallel.h"
#include "fsdp_cpp/composable/tensor_placement.h"
#include "fsdp_cpp/composable/tp_collectives.h"
#include "fsdp_cpp/contract/hookable_module_holder.h"
#include "fsdp_cpp/contract/hookable_modules.h"
#include "fsdp_cpp/examples/gpt_model.h"
#include "fsdp_cpp/examples/gpt_tensor_parallel.h"
#include "fsdp_cpp/init/meta_init.h"
#include "fsdp_cpp/tests/composable/tp_gpt.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::testing::rank;
using fsdp::testing::world;
using fsdp::testing::world_size;

using fsdp::testing::tp::comparable;
using fsdp::testing::tp::kContext;
using fsdp::testing::tp::kVocab;
using fsdp::testing::tp::make_gpt;
using fsdp::testing::tp::meshes_of_world;
using fsdp::testing::tp::tokens;

struct TpCase {
  bool sequence_parallel = false;
  bool loss_parallel = false;
  bool activation_checkpointing = false;  // on every block, before fully_shard
  bool offload_and_prefetch = false;      // CPU offload, forward prefetch, backward prefetch post
  std::optional<c10::ScalarType> param_dtype;  // bf16 mixed precision
};

void run_gpt_parity(int dp, int tp, const TpCase& c, int iterations = 3) {
  INFO("mesh (dp=" << dp << ", tp=" << tp << "), sequence parallel " << c.sequence_parallel << ", loss parallel "
                   << c.loss_parallel << ", bf16 " << c.param_dtype.has_value() << ", activation checkpointing "
                   << c.activation_checkpointing << ", offload and prefetch " << c.offload_and_prefetch);
  auto mesh = fsdp::comm::DeviceMesh::create(world(), {dp, tp}, {"dp", "tp"});
  auto model = make_gpt();
  auto reference = make_gpt();
  auto loss_fn = fsdp::examples::parallelize_gpt(
      model, mesh->group("tp"),
      fsdp::examples::GptTensorParallel().sequence_parallel(c.sequence_parallel).loss_parallel(c.loss_parallel));
  auto options = fsdp::FullyShardOptions().communicator(mesh->group("dp"));
  if (c.param_dtype) options.mixed_precision(fsdp::MixedPrecision().param_dtype(*c.param_dtype));
  if (c.offload_and_prefetch) {
    options.offload_to_cpu(true).forward_prefetch(true).backward_prefetch(fsdp::BackwardPrefetch::kBackwardPost);
  }
  std::vector<fsdp::FSDPModule> units;
  for (auto& block : model->block_list()) {
    if (c.activation_checkpointing) fsdp::checkpoint_activations(block);
    units.push_back(fsdp::fully_shard(block, options));
  }
  units.push_back(fsdp::fully_shard(model, options));
  // The plan sees the pieces: 13 split parameters (tok_emb; per block qkv, fc and both projections'
  // weights, qkv's and fc's biases) of 14736 elements, the projections' biases whole (and the
  // LayerNorms with sequence parallelism).
  const auto planned = fsdp::plan(units.back());
  CHECK(planned.tensor_parallel.size == tp);
  CHECK(planned.tensor_parallel.sharded_params == 13);
  CHECK(planned.tensor_parallel.whole_params == (c.sequence_parallel ? 14 : 4));
  CHECK(planned.tensor_parallel.global_numel == 14736);
  CHECK(planned.tensor_parallel.local_numel == 14736 / tp);

  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.01));
  torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.01));
  std::map<std::string, at::Tensor> initial;
  for (const auto& item : reference->named_parameters()) initial[item.key()] = item.value().detach().clone();
  std::vector<at::Tensor> my_updates, ref_updates;
  const int q_mine = mesh->coordinate("dp");
  const double rtol = c.param_dtype ? 2e-2 : 1e-4, atol = c.param_dtype ? 2e-3 : 1e-5;
  for (int64_t it = 0; it < iterations; ++it) {
    at::Tensor loss = loss_fn(model(tokens(it, q_mine, 1)), tokens(it, q_mine, 2));
    loss.backward();
    opt.step();
    opt.zero_grad();
    at::Tensor ref_loss;
    for (int q = 0; q < dp; ++q) {
      at::Tensor lq = fsdp::examples::next_token_loss(reference(tokens(it, q, 1)), tokens(it, q, 2));
      (lq / dp).backward();
      if (q == q_mine) ref_loss = lq.detach();
    }
    ref_opt.step();
    ref_opt.zero_grad();
    INFO("iteration " << it << ": loss " << loss.item<double>() << ", reference " << ref_loss.item<double>());
    CHECK(at::allclose(loss.detach().to(at::kFloat), ref_loss, rtol, atol));
  }
  for (auto& u : units) u.unshard();
  const auto ref_params = reference->named_parameters();
  for (const auto& item : model->named_parameters()) {
    INFO("parameter " << item.key());
    at::Tensor mine = item.value().detach().to(at::kFloat);
    if (auto placement = fsdp::tensor_placement(item.value())) mine = fsdp::gather_global(mine, *placement);
    at::Tensor theirs = ref_params[item.key()].detach();
    REQUIRE(mine.sizes() == theirs.sizes());
    if (c.param_dtype) {
      // bf16 forward/backward moves each AdamW step differently from the fp32 reference; compare
      // the training updates' direction over all parameters below.
      my_updates.push_back((mine - initial[item.key()]).flatten());
      ref_updates.push_back((theirs - initial[item.key()]).flatten());
      continue;
    }
    std::tie(mine, theirs) = comparable(item.key(), mine, theirs);
    CHECK(at::allclose(mine, theirs, 1e-4, 1e-5));
  }
  if (c.param_dtype) {
    const at::Tensor a = at::cat(my_updates), b = at::cat(ref_updates);
    const double cosine = (a.dot(b) / (a.norm() * b.norm())).item<double>();
    INFO("cosine of the bf16 run's parameter updates with the fp32 reference's: " << cosine);
    CHECK(cosine > 0.98);
  }
  for (auto& u : units) u.reshard();
}

}  // namespace

FSDP_RANKS_TEST_CASE("DeviceMesh: every (dp, tp) layout of the world, row-major groups", "[tp][mesh]") {
  const int W = world_size();
  for (auto [dp, tp] : meshes_of_world()) {
    INFO("mesh (" << dp << ", " << tp << ")");
    auto mesh = fsdp::comm::DeviceMesh::create(world(), {dp, tp}, {"dp", "tp"});
    CHECK(mesh->coordinate("dp") == rank() / tp);
    CHECK(mesh->coordinate("tp") == rank() % tp);
    CHECK(mesh->group("tp")->size() == tp);
    CHECK(mesh->group("dp")->size() == dp);
    CHECK(mesh->group("tp")->rank() == rank() % tp);
    // Sum of world ranks over each group, closed form.
    at::Tensor t = at::full({1}, static_cast<double>(rank()));
    mesh->group("tp")->all_reduce(t).wait();
    const int base = (rank() / tp) * tp;
    CHECK(t.item<double>() == tp * base + tp * (tp - 1) / 2);
    at::Tensor d = at::full({1}, static_cast<double>(rank()));
    mesh->group("dp")->all_reduce(d).wait();
    CHECK(d.item<double>() == dp * (rank() % tp) + tp * dp * (dp - 1) / 2);
    auto all = mesh->flattened_group({"dp", "tp"});
    CHECK(all->size() == W);
    CHECK(all->rank() == rank());
    CHECK(mesh->describe() == "(dp=" + std::to_string(dp) + ", tp=" + std::to_string(tp) + ")");
  }
  if (W == 4) {
    // 3-D (replicate, shard, tp) = (2, 1, 2) for HSDP + TP; the 2-D submesh drives hybrid sharding.
    auto mesh3 = fsdp::comm::DeviceMesh::create(world(), {2, 1, 2}, {"replicate", "shard", "tp"});
    auto hsdp = mesh3->submesh({"replicate", "shard"});
    CHECK(hsdp->replicate_group()->size() == 2);
    CHECK(hsdp->shard_group()->size() == 1);
    CHECK(mesh3->group("tp")->rank() == rank() % 2);
    CHECK_THROWS_WITH(mesh3->shard_group(), Contains("needs a 2-D mesh") && Contains("(replicate=2, shard=1, tp=2)"));
    auto hybrid = fsdp::comm::DeviceMesh::hybrid(world(), 2);
    CHECK(hybrid->names() == std::vector<std::string>{"replicate", "shard"});
    CHECK(hybrid->shard_group()->rank() == rank() % 2);
  }
  CHECK_THROWS_WITH(fsdp::comm::DeviceMesh::create(world(), {W + 1}, {"dp"}),
                    Contains("multiply to " + std::to_string(W + 1)) && Contains("expected the world size " + std::to_string(W)));
  CHECK_THROWS_WITH(fsdp::comm::DeviceMesh::create(world(), {W, 1}, {"dp"}), Contains("one name per dimension"));
  CHECK_THROWS_WITH(fsdp::comm::DeviceMesh::create(world(), {W, 1}, {"dp", "dp"}), Contains("appears twice"));
  CHECK_THROWS_WITH(fsdp::comm::DeviceMesh::create(world(), {W}, {"dp"})->group("tp"),
                    Contains("no dimension named 'tp'") && Contains("(dp="));
}

FSDP_RANKS_TEST_CASE("TP collectives: forward and backward against closed forms", "[tp][collectives]") {
  auto group = std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
  const int n = world_size(), r = rank();
  at::Tensor x = at::full({2, 3}, static_cast<double>(r + 1)).requires_grad_();
  // copy_to_tp: identity forward, sum of gradients backward.
  fsdp::tp::copy_to_tp(x, group).mul(r + 1).sum().backward();
  CHECK(x.grad().equal(at::full({2, 3}, n * (n + 1) / 2.0)));
  x.mutable_grad() = at::Tensor();
  // reduce_from_tp: sum forward, identity backward.
  at::Tensor y = fsdp::tp::reduce_from_tp(x, group);
  CHECK(y.detach().equal(at::full({2, 3}, n * (n + 1) / 2.0)));
  y.sum().backward();
  CHECK(x.grad().equal(at::ones({2, 3})));
  x.mutable_grad() = at::Tensor();
  // gather_from_tp along 1: pieces in rank order; backward takes this rank's piece.
  at::Tensor g = fsdp::tp::gather_from_tp(x, 1, group);
  REQUIRE(g.sizes() == at::IntArrayRef({2, 3 * n}));
  for (int q = 0; q < n; ++q) CHECK(g.detach().narrow(1, 3 * q, 3).equal(at::full({2, 3}, q + 1.0)));
  (g * at::arange(3 * n, at::kDouble)).sum().backward();
  CHECK(x.grad().equal((at::arange(3 * n, at::kDouble).narrow(0, 3 * r, 3)).expand({2, 3})));
  x.mutable_grad() = at::Tensor();
  // all_gather_tp / reduce_scatter_tp along 1: backward reduce-scatters / all-gathers.
  at::Tensor a = fsdp::tp::all_gather_tp(x, 1, group);
  a.sum().backward();
  CHECK(x.grad().equal(at::full({2, 3}, static_cast<double>(n))));
  x.mutable_grad() = at::Tensor();
  at::Tensor wide = at::full({2, 2 * n}, static_cast<double>(r + 1)).requires_grad_();
  at::Tensor s = fsdp::tp::reduce_scatter_tp(wide, 1, group);
  REQUIRE(s.sizes() == at::IntArrayRef({2, 2}));
  CHECK(s.detach().equal(at::full({2, 2}, n * (n + 1) / 2.0)));
  s.sum().backward();
  CHECK(wide.grad().equal(at::ones({2, 2 * n})));
  // split_to_tp: this rank's piece; backward all-gathers.
  at::Tensor whole = at::arange(2 * n, at::kDouble).reshape({1, 2 * n}).requires_grad_();
  at::Tensor piece = fsdp::tp::split_to_tp(whole, 1, group);
  CHECK(piece.detach().equal(at::arange(2 * n, at::kDouble).narrow(0, 2 * r, 2).reshape({1, 2})));
  piece.sum().backward();
  CHECK(whole.grad().equal(at::ones({1, 2 * n}, at::kDouble)));
}

FSDP_RANKS_TEST_CASE("loss parallel equals cross_entropy on the gathered logits, value and gradient", "[tp][loss_parallel]") {
  auto group = std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
  const int n = world_size(), r = rank();
  auto gen = at::detail::createCPUGenerator(11);
  at::Tensor logits = at::randn({5, 4 * n}, gen).mul(3);
  at::Tensor targets = at::randint(4 * n, {5}, gen);
  at::Tensor full = logits.clone().requires_grad_();
  at::Tensor expected = at::cross_entropy_loss(full, targets);
  expected.backward();
  at::Tensor local = logits.narrow(1, 4 * r, 4).clone().requires_grad_();
  at::Tensor loss = fsdp::tp::vocab_parallel_cross_entropy(local, targets, group);
  CHECK(at::allclose(loss.detach(), expected.detach(), 1e-6, 1e-6));
  loss.backward();
  CHECK(at::allclose(local.grad(), full.grad().narrow(1, 4 * r, 4), 1e-6, 1e-7));
  CHECK_THROWS_WITH(fsdp::tp::vocab_parallel_cross_entropy(local, targets.add(4 * n), group),
                    Contains("target ids must be in [0, " + std::to_string(4 * n) + ")"));
}

FSDP_RANKS_TEST_CASE("GPT: tensor parallel x fully_shard on every (dp, tp) mesh matches the unsharded reference", "[tp][gpt]") {
  for (auto [dp, tp] : meshes_of_world()) run_gpt_parity(dp, tp, TpCase{});
}

FSDP_RANKS_TEST_CASE("GPT: sequence parallel and loss parallel on every (dp, tp) mesh", "[tp][gpt][sp]") {
  for (auto [dp, tp] : meshes_of_world()) {
    if (tp == 1 && world_size() > 1) continue;  // the plain case above covers pure fully_shard
    run_gpt_parity(dp, tp, TpCase{.sequence_parallel = true, .loss_parallel = true});
  }
}

FSDP_RANKS_TEST_CASE("GPT: loss parallel alone, and bf16 mixed precision, on the largest tp", "[tp][gpt][mixed]") {
  const int tp = world_size(), dp = 1;
  run_gpt_parity(dp, tp, TpCase{.loss_parallel = true});
  run_gpt_parity(dp, tp, TpCase{.sequence_parallel = true, .param_dtype = at::kBFloat16});
}

FSDP_RANKS_TEST_CASE("GPT: CPU offload and forward/backward prefetch compose with TP", "[tp][gpt][offload]") {
  const auto meshes = meshes_of_world();
  const auto [dp, tp] = meshes.size() > 1 ? meshes[meshes.size() / 2] : meshes[0];
  run_gpt_parity(dp, tp, TpCase{.sequence_parallel = tp > 1, .offload_and_prefetch = true});
}

FSDP_RANKS_TEST_CASE("GPT: activation checkpointing on every block composes with TP and SP", "[tp][gpt][ac]") {
  const auto meshes = meshes_of_world();
  const auto [dp, tp] = meshes.size() > 1 ? meshes[meshes.size() / 2] : meshes[0];
  run_gpt_parity(dp, tp, TpCase{.activation_checkpointing = true});
  run_gpt_parity(1, world_size(),
                 TpCase{.sequence_parallel = true, .loss_parallel = true, .activation_checkpointing = true});
}

// A model that uses every style and layout the GPT plan does not: column-parallel output gathered
// to Replicate, row-parallel input split from Replicate, a column-parallel embedding,
// PrepareModuleInput Shard(1) -> Replicate, and SequenceParallel splitting a Replicate input.
struct StylesNetImpl : torch::nn::Module {
  StylesNetImpl() {
    emb = register_module("emb", fsdp::contract::Embedding(torch::nn::EmbeddingOptions(10, 12)));
    up = register_module("up", fsdp::contract::Linear(12, 24));
    down = register_module("down", fsdp::contract::Linear(24, 12));
    norm = register_module("norm", fsdp::contract::LayerNorm(torch::nn::LayerNormOptions({12})));
    mix = register_module("mix", fsdp::contract::Linear(12, 12));
  }
  at::Tensor forward(at::Tensor ids) {
    at::Tensor x = emb(ids);               // [B, T, 12]
    x = x + down(at::gelu(up(x)));
    x = norm(x);                           // Shard(1) out with SequenceParallel from Replicate
    return mix(x);                         // PrepareModuleInput Shard(1) -> Replicate
  }
  fsdp::contract::Embedding emb{nullptr};
  fsdp::contract::Linear up{nullptr}, down{nullptr};
  fsdp::contract::LayerNorm norm{nullptr};
  fsdp::contract::Linear mix{nullptr};
};
FSDP_HOOKABLE_MODULE(StylesNet);

FSDP_RANKS_TEST_CASE("every style and layout: outputs and gathered gradients equal the unsharded model's", "[tp][styles]") {
  const int n = world_size();
  if (12 % n != 0) return;  // 1, 2, 3, 4 divide 12
  auto group = std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
  torch::manual_seed(3);
  StylesNet model;
  torch::manual_seed(3);
  StylesNet reference;
  fsdp::parallelize_module(*model, group, {
      {"emb", fsdp::ColwiseParallel().output_layout(fsdp::Layout::replicate())},
      {"up", fsdp::ColwiseParallel().output_layout(fsdp::Layout::replicate())},
      {"down", fsdp::RowwiseParallel().input_layout(fsdp::Layout::replicate())},
      {"norm", fsdp::SequenceParallel().input_layout(fsdp::Layout::replicate())},
      {"mix", fsdp::PrepareModuleInput().input_layout(fsdp::Layout::shard(1)).desired_input_layout(fsdp::Layout::replicate())},
  });
  auto gen = at::detail::createCPUGenerator(5);
  const at::Tensor ids = at::randint(10, {2, 12}, gen);
  const at::Tensor weights = at::randn({2, 12, 12}, gen);
  at::Tensor out = model(ids);
  at::Tensor expected = reference(ids);
  REQUIRE(out.sizes() == expected.sizes());
  CHECK(at::allclose(out.detach(), expected.detach(), 1e-5, 1e-6));
  (out * weights).sum().backward();
  (expected * weights).sum().backward();
  const auto ref_params = reference->named_parameters();
  for (const auto& item : model->named_parameters()) {
    INFO("gradient of " << item.key());
    at::Tensor g = item.value().grad();
    REQUIRE(g.defined());
    if (auto p = fsdp::tensor_placement(item.value())) g = fsdp::gather_global(g, *p);
    CHECK(at::allclose(g, ref_params[item.key()].grad(), 1e-5, 1e-6));
  }
}

FSDP_RANKS_TEST_CASE("GPT: HSDP + TP on a 3-D (replicate, shard, tp) mesh", "[tp][gpt][hsdp]") {
  if (world_size() != 4) return;  // (replicate, shard, tp) = (2, 1, 2) and (1, 2, 2) need 4 ranks
  for (int shard : {1, 2}) {
    INFO("(replicate, shard, tp) = (" << 2 / shard << ", " << shard << ", 2)");
    auto mesh = fsdp::comm::DeviceMesh::create(world(), {2 / shard, shard, 2}, {"replicate", "shard", "tp"});
    auto model = make_gpt();
    auto reference = make_gpt();
    auto loss_fn = fsdp::examples::parallelize_gpt(model, mesh->group("tp"),
                                                   fsdp::examples::GptTensorParallel().sequence_parallel(true));
    auto options = fsdp::FullyShardOptions().mesh(mesh->submesh({"replicate", "shard"}));
    std::vector<fsdp::FSDPModule> units;
    for (auto& block : model->block_list()) units.push_back(fsdp::fully_shard(block, options));
    units.push_back(fsdp::fully_shard(model, options));
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-3));
    torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(3e-3));
    auto dp_group = mesh->flattened_group({"replicate", "shard"});
    const int q_mine = dp_group->rank();
    for (int64_t it = 0; it < 3; ++it) {
      at::Tensor loss = loss_fn(model(tokens(it, q_mine, 3)), tokens(it, q_mine, 4));
      loss.backward();
      opt.step();
      opt.zero_grad();
      at::Tensor ref_loss;
      for (int q = 0; q < 2; ++q) {
        at::Tensor lq = fsdp::examples::next_token_loss(reference(tokens(it, q, 3)), tokens(it, q, 4));
        (lq / 2).backward();
        if (q == q_mine) ref_loss = lq.detach();
      }
      ref_opt.step();
      ref_opt.zero_grad();
      CHECK(at::allclose(loss.detach(), ref_loss, 1e-4, 1e-5));
    }
    for (auto& u : units) u.unshard();
    const auto ref_params = reference->named_parameters();
    for (const auto& item : model->named_parameters()) {
      INFO("parameter " << item.key());
      at::Tensor mine = item.value().detach();
      if (auto placement = fsdp::tensor_placement(item.value())) mine = fsdp::gather_global(mine, *placement);
      auto [a, b] = comparable(item.key(), mine, ref_params[item.key()].detach());
      CHECK(at::allclose(a, b, 1e-4, 1e-5));
    }
    for (auto& u : units) u.reshard();
  }
}

FSDP_RANKS_TEST_CASE("parallelize_module: parameters keep their objects and FQNs; placements are queryable", "[tp][api]") {
  const int n = world_size(), r = rank();
  auto model = make_gpt();
  std::vector<std::string> names;
  std::vector<at::TensorImpl*> impls;
  for (const auto& item : model->named_parameters()) {
    names.push_back(item.key());
    impls.push_back(item.value().unsafeGetTensorImpl());
  }
  const at::Tensor qkv_global = model->block_list()[0]->attn->qkv->weight.detach().clone();
  auto group = std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
  fsdp::examples::parallelize_gpt(model, group);
  size_t i = 0;
  for (const auto& item : model->named_parameters()) {
    CHECK(item.key() == names[i]);
    CHECK(item.value().unsafeGetTensorImpl() == impls[i]);
    ++i;
  }
  const at::Tensor& qkv = model->block_list()[0]->attn->qkv->weight;
  auto placement = fsdp::tensor_placement(qkv);
  REQUIRE(placement.has_value());
  CHECK(placement->dim == 0);
  CHECK(placement->chunks == 3);
  CHECK(placement->global_shape == std::vector<int64_t>{72, 24});
  CHECK(qkv.sizes() == at::IntArrayRef({72 / n, 24}));
  // Rank r holds its rows of q, of k and of v.
  const int64_t piece = 24 / n;
  for (int c = 0; c < 3; ++c) {
    CHECK(qkv.detach().narrow(0, c * piece, piece).equal(qkv_global.narrow(0, c * 24 + r * piece, piece)));
  }
  CHECK(fsdp::gather_global(qkv.detach(), *placement).equal(qkv_global));
  auto bias = fsdp::tensor_placement(model->block_list()[0]->attn->proj->bias);
  REQUIRE(bias.has_value());
  CHECK(!bias->sharded());
  CHECK(fsdp::is_tensor_parallel(*model->block_list()[0]->attn->qkv));
}

FSDP_RANKS_TEST_CASE("parallelize_module: bad input is refused on every rank, the model unchanged", "[tp][misuse]") {
  const int n = world_size();
  auto group = std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
  auto model = make_gpt();
  const at::Tensor before = model->block_list()[0]->attn->qkv->weight.detach().clone();
  CHECK_THROWS_WITH(fsdp::parallelize_module(*model, group, {{"blocks.*.attn.qkv", fsdp::ColwiseParallel()},
                                                             {"blocks.*.atn.proj", fsdp::RowwiseParallel()}}),
                    Contains("parallelize_module") && Contains("'blocks.*.atn.proj'") && Contains("matches no module"));
  CHECK_THROWS_WITH(fsdp::parallelize_module(*model, group, {{"blocks.0.ln1", fsdp::ColwiseParallel()}}),
                    Contains("module 'blocks.0.ln1'") && Contains("ColwiseParallel supports Linear and Embedding"));
  CHECK_THROWS_WITH(fsdp::parallelize_module(*model, group, {{"ln_f", fsdp::SequenceParallel()},
                                                             {"ln_f", fsdp::RowwiseParallel()}}),
                    Contains("at most one of"));
  CHECK(model->block_list()[0]->attn->qkv->weight.equal(before));
  CHECK(!fsdp::is_tensor_parallel(*model->block_list()[0]->attn->qkv));
  if (n >= 3) {
    // 10 output features split over neither 3 nor 4 ranks.
    auto odd = fsdp::contract::Linear(torch::nn::LinearOptions(4, 10));
    CHECK_THROWS_WITH(fsdp::parallelize_module(*odd, group, {{"", fsdp::ColwiseParallel()}}),
                      Contains("module '<root>'") && Contains("the output features") &&
                      Contains("expected a multiple of " + std::to_string(n)) && Contains("found 10"));
    CHECK(odd->weight.sizes() == at::IntArrayRef({10, 4}));
  }
  // Twice on one module, and after fully_shard.
  fsdp::parallelize_module(*model, group, {{"blocks.0.mlp.fc", fsdp::ColwiseParallel()}});
  CHECK_THROWS_WITH(fsdp::parallelize_module(*model, group, {{"blocks.0.mlp.fc", fsdp::ColwiseParallel()}}),
                    Contains("module 'blocks.0.mlp.fc'") && Contains("already parallelized"));
  auto sharded = make_gpt();
  fsdp::fully_shard(sharded, fsdp::FullyShardOptions().communicator(group));
  CHECK_THROWS_WITH(fsdp::parallelize_module(*sharded, group, {{"blocks.0.mlp.fc", fsdp::ColwiseParallel()}}),
                    Contains("managed by fully_shard") && Contains("before fully_shard"));
}

FSDP_RANKS_TEST_CASE("clip_grad_norm_ counts TP-sharded gradients once per piece and TP-whole ones once", "[tp][clip]") {
  for (auto [dp, tp] : meshes_of_world()) {
    for (bool sp : {false, true}) {
      INFO("mesh (dp=" << dp << ", tp=" << tp << "), sequence parallel " << sp);
      auto mesh = fsdp::comm::DeviceMesh::create(world(), {dp, tp}, {"dp", "tp"});
      auto model = make_gpt();
      auto reference = make_gpt();
      auto loss_fn = fsdp::examples::parallelize_gpt(model, mesh->group("tp"),
                                                     fsdp::examples::GptTensorParallel().sequence_parallel(sp));
      auto options = fsdp::FullyShardOptions().communicator(mesh->group("dp"));
      std::vector<fsdp::FSDPModule> units;
      for (auto& block : model->block_list()) units.push_back(fsdp::fully_shard(block, options));
      units.push_back(fsdp::fully_shard(model, options));
      const int q_mine = mesh->coordinate("dp");
      loss_fn(model(tokens(0, q_mine, 5)), tokens(0, q_mine, 6)).backward();
      for (int q = 0; q < dp; ++q) {
        (fsdp::examples::next_token_loss(reference(tokens(0, q, 5)), tokens(0, q, 6)) / dp).backward();
      }
      double ref_sq = 0.0, ref_max = 0.0;
      for (const auto& p : reference->parameters()) {
        ref_sq += p.grad().pow(2).sum().item<double>();
        ref_max = std::max(ref_max, p.grad().abs().max().item<double>());
      }
      const double ref_norm = std::sqrt(ref_sq);
      CHECK(fsdp::clip_grad_norm_(units.back(), 1e9, std::numeric_limits<double>::infinity()) ==
            Approx(ref_max).epsilon(1e-4));
      CHECK(fsdp::clip_grad_norm_(units.back(), 1e9) == Approx(ref_norm).epsilon(1e-4));
      // Clipping to half the norm scales every gradient: the norm is then half.
      CHECK(fsdp::clip_grad_norm_(units.back(), ref_norm / 2) == Approx(ref_norm).epsilon(1e-4));
      CHECK(fsdp::clip_grad_norm_(units.back(), 1e9) == Approx(ref_norm / 2).epsilon(1e-4));
    }
  }
}

FSDP_RANKS_TEST_CASE("a GPT built on the meta device: TP x fully_shard materializes only the pieces, with the values of the unsharded build", "[tp][meta]") {
  for (auto [dp, tp] : meshes_of_world()) {
    INFO("mesh (dp=" << dp << ", tp=" << tp << ")");
    auto mesh = fsdp::comm::DeviceMesh::create(world(), {dp, tp}, {"dp", "tp"});
    auto build = [] {
      torch::manual_seed(7);
      fsdp::MetaInitGuard meta;
      return fsdp::examples::GPT(
          fsdp::examples::GPTConfig(kVocab).context_length(kContext).d_model(24).n_heads(12).n_layers(2));
    };
    auto model = build();
    auto reference = build();
    fsdp::materialize_module(*reference);
    const at::Tensor& qkv = model->block_list()[0]->attn->qkv->weight;
    fsdp::examples::parallelize_gpt(model, mesh->group("tp"));
    CHECK(qkv.is_meta());
    CHECK(qkv.sizes() == at::IntArrayRef({72 / tp, 24}));
    auto options = fsdp::FullyShardOptions().communicator(mesh->group("dp"));
    std::vector<fsdp::FSDPModule> units;
    for (auto& block : model->block_list()) units.push_back(fsdp::fully_shard(block, options));
    units.push_back(fsdp::fully_shard(model, options));
    for (const auto& p : model->parameters()) CHECK(!p.is_meta());
    for (auto& u : units) u.unshard();
    const auto ref_params = reference->named_parameters();
    for (const auto& item : model->named_parameters()) {
      INFO("parameter " << item.key());
      at::Tensor mine = item.value().detach();
      if (auto p = fsdp::tensor_placement(item.value())) mine = fsdp::gather_global(mine, *p);
      CHECK(mine.equal(ref_params[item.key()].detach()));
    }
    for (auto& u : units) u.reshard();
    // And it trains: one step runs on every rank.
    auto loss = fsdp::examples::next_token_loss(model(tokens(0, mesh->coordinate("dp"), 9)), tokens(0, 0, 10));
    loss.backward();
    CHECK(std::isfinite(loss.item<double>()));
  }
}
