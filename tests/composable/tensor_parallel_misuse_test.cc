// parallelize_module misuse on 2-4 ranks: ranks whose models or plans differ all throw the same
// c10::Error within seconds and keep their models unchanged ([Note: tensor-parallel agreement]),
// and a parallelized Linear or Embedding called as `module->forward(x)` is refused in the first
// backward pass, with or without fully_shard around it ([Note: bypassed tensor-parallel modules]).
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/utils.h>

#include "fsdp_cpp/comm/device_mesh.h"
#include "fsdp_cpp/composable/activation_checkpoint.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/tensor_parallel.h"
#include "fsdp_cpp/contract/hookable_module_holder.h"
#include "fsdp_cpp/contract/hookable_modules.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::testing::error_of;
using fsdp::testing::fresh_comm;
using fsdp::testing::kNoError;
using fsdp::testing::rank;
using fsdp::testing::same_on_every_rank;
using fsdp::testing::world;
using fsdp::testing::world_size;

// Every dimension divides over 2, 3 and 4 ranks. `extra` only when asked (a model that differs).
struct MlpImpl : torch::nn::Module {
  MlpImpl(int64_t hidden, bool with_extra, std::string bypass) : bypass(std::move(bypass)) {
    emb = register_module("emb", fsdp::contract::Embedding(torch::nn::EmbeddingOptions(12, 12)));
    up = register_module("up", fsdp::contract::Linear(12, hidden));
    down = register_module("down", fsdp::contract::Linear(hidden, 12));
    if (with_extra) extra = register_module("extra", fsdp::contract::Linear(12, 12));
  }
  at::Tensor forward(at::Tensor ids) {
    if (bypass == "up") return down(at::relu(up->forward(emb(ids))));
    if (bypass == "down") return down->forward(at::relu(up(emb(ids))));
    if (bypass == "emb") return down(at::relu(up(emb->forward(ids))));
    return down(at::relu(up(emb(ids))));
  }
  std::string bypass;
  fsdp::contract::Embedding emb{nullptr};
  fsdp::contract::Linear up{nullptr}, down{nullptr}, extra{nullptr};
};
FSDP_HOOKABLE_MODULE(Mlp);

// A column-parallel Embedding (its output Shard(-1)) into a row-parallel Linear.
struct EmbNetImpl : torch::nn::Module {
  explicit EmbNetImpl(bool bypass) : bypass(bypass) {
    emb = register_module("emb", fsdp::contract::Embedding(torch::nn::EmbeddingOptions(12, 12)));
    proj = register_module("proj", fsdp::contract::Linear(12, 12));
  }
  at::Tensor forward(at::Tensor ids) { return proj(bypass ? emb->forward(ids) : emb(ids)); }
  bool bypass;
  fsdp::contract::Embedding emb{nullptr};
  fsdp::contract::Linear proj{nullptr};
};
FSDP_HOOKABLE_MODULE(EmbNet);

Mlp make_mlp(int64_t hidden = 24, bool with_extra = true, const std::string& bypass = "") {
  torch::manual_seed(11);
  return Mlp(hidden, with_extra, bypass);
}

const fsdp::TensorParallelPlan kPlan = {
    {"emb", fsdp::RowwiseParallel().input_layout(fsdp::Layout::replicate())},
    {"up", fsdp::ColwiseParallel()},
    {"down", fsdp::RowwiseParallel()},
    {"extra", fsdp::ColwiseParallel().output_layout(fsdp::Layout::replicate())},
};

std::map<std::string, at::Tensor> snapshot(torch::nn::Module& m) {
  std::map<std::string, at::Tensor> out;
  for (const auto& item : m.named_parameters()) out[item.key()] = item.value().detach().clone();
  return out;
}

bool unchanged(torch::nn::Module& m, const std::map<std::string, at::Tensor>& before) {
  for (const auto& item : m.named_parameters()) {
    if (!item.value().equal(before.at(item.key()))) return false;
  }
  for (const auto& item : m.named_modules()) {
    if (fsdp::is_tensor_parallel(*item.value())) return false;
  }
  return true;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

at::Tensor ids() {
  auto gen = at::detail::createCPUGenerator(3);
  return at::randint(12, {2, 6}, gen);
}

}  // namespace

FSDP_RANKS_TEST_CASE("parallelize_module: a plan naming a module one rank lacks is refused on every rank, models unchanged", "[tp][agreement]") {
  const int W = world_size(), r = rank();
  for (int lacking = 0; lacking < W; ++lacking) {
    INFO("rank " << lacking << " lacks 'extra'");
    auto group = fresh_comm();
    group->set_world_ranks([&] {
      std::vector<int> v(W);
      for (int i = 0; i < W; ++i) v[i] = i;
      return v;
    }());
    Mlp model = make_mlp(24, /*with_extra=*/r != lacking);
    const auto before = snapshot(*model);
    const auto t0 = std::chrono::steady_clock::now();
    const std::string error = error_of([&] { fsdp::parallelize_module(*model, group, kPlan); });
    CHECK(seconds_since(t0) < 5.0);
    CHECK_THAT(error, Contains("parallelize_module: rank " + std::to_string(lacking) + ": ") &&
                          Contains("the plan entry 'extra' (ColwiseParallel) matches no module"));
    CHECK(same_on_every_rank(error));
    CHECK(unchanged(*model, before));
  }
}

FSDP_RANKS_TEST_CASE("parallelize_module: ranks whose models differ in a shape are refused on every rank, naming the module", "[tp][agreement]") {
  const int W = world_size(), r = rank();
  auto group = fresh_comm();  // no world ranks: named by group rank
  // The last rank's hidden layer has 48 features instead of 24 (both divide over 2-4 ranks).
  Mlp model = make_mlp(r == W - 1 ? 48 : 24);
  const auto before = snapshot(*model);
  const auto t0 = std::chrono::steady_clock::now();
  const std::string error = error_of([&] { fsdp::parallelize_module(*model, group, kPlan); });
  CHECK(seconds_since(t0) < 5.0);
  CHECK_THAT(error, Contains("parallelize_module: group rank " + std::to_string(W - 1) + ": ") &&
                        Contains("applied different plans or models") && Contains("'up:[48, 12]") &&
                        Contains("where group rank 0 applies 'up:[24, 12]"));
  CHECK(same_on_every_rank(error));
  CHECK(unchanged(*model, before));
}

FSDP_RANKS_TEST_CASE("parallelize_module over a (dp, tp) mesh: only the tp group of the differing rank refuses", "[tp][agreement][mesh]") {
  if (world_size() != 4) return;  // the 2x2 mesh
  const int r = rank();
  auto mesh = fsdp::comm::DeviceMesh::create(world(), {2, 2}, {"dp", "tp"});
  Mlp model = make_mlp(24, /*with_extra=*/r != 3);
  const auto before = snapshot(*model);
  const std::string error = error_of([&] { fsdp::parallelize_module(*model, *mesh, "tp", kPlan); });
  if (r >= 2) {
    CHECK_THAT(error, Contains("parallelize_module: rank 3: ") && Contains("'extra'") && Contains("matches no module"));
    CHECK(unchanged(*model, before));
  } else {
    CHECK(error == kNoError);
    CHECK(fsdp::is_tensor_parallel(*model->up));
  }
}

FSDP_RANKS_TEST_CASE("a tensor-parallel Linear or Embedding called as module->forward(x) is refused in the first backward", "[tp][bypass]") {
  // Linear: column-parallel `up` or row-parallel `down` bypassed (without its collectives the
  // output or the input's gradient is wrong).
  for (const std::string bypassed : {"up", "down"}) {
    INFO("bypassed: " << bypassed);
    Mlp model = make_mlp(24, /*with_extra=*/false, bypassed);
    fsdp::parallelize_module(*model, fresh_comm(), {kPlan[0], kPlan[1], kPlan[2]});
    at::Tensor out = model(ids());
    const std::string error = error_of([&] { out.sum().backward(); });
    const std::string style = bypassed == "up" ? "ColwiseParallel" : "RowwiseParallel";
    CHECK_THAT(error, Contains("parallelize_module: module '" + bypassed + "' (" + style + "): its parameter '") &&
                          Contains("received a gradient") && Contains("never called through its hook-able holder") &&
                          Contains("module->forward(x)"));
    CHECK(same_on_every_rank(error));
  }
  // Embedding: a column-parallel embedding bypassed.
  {
    torch::manual_seed(5);
    EmbNet model(/*bypass=*/true);
    fsdp::parallelize_module(*model, fresh_comm(), {{"emb", fsdp::ColwiseParallel()}, {"proj", fsdp::RowwiseParallel()}});
    at::Tensor out = model(ids());
    const std::string error = error_of([&] { out.sum().backward(); });
    CHECK_THAT(error, Contains("parallelize_module: module 'emb' (ColwiseParallel): its parameter 'weight' received a "
                               "gradient") && Contains("fsdp::contract::Embedding"));
    CHECK(same_on_every_rank(error));
  }
  // Through the holders: the unsharded model's output, and backward runs (also for activation
  // checkpointing's recompute, which is the call that builds the graph).
  Mlp model = make_mlp(24, false);
  Mlp reference = make_mlp(24, false);
  fsdp::parallelize_module(*model, fresh_comm(), {kPlan[0], kPlan[1], kPlan[2]});
  at::Tensor out = model(ids());
  CHECK(at::allclose(out.detach(), reference(ids()).detach(), 1e-5, 1e-6));
  CHECK(error_of([&] { out.sum().backward(); }) == kNoError);
  torch::manual_seed(5);
  EmbNet emb_model(/*bypass=*/false);
  fsdp::parallelize_module(*emb_model, fresh_comm(), {{"emb", fsdp::ColwiseParallel()}, {"proj", fsdp::RowwiseParallel()}});
  fsdp::checkpoint_activations(emb_model);
  at::Tensor emb_out = emb_model(ids());
  CHECK(error_of([&] { emb_out.sum().backward(); }) == kNoError);
  CHECK(emb_model->emb->weight.grad().defined());
}

FSDP_RANKS_TEST_CASE("a bypassed tensor-parallel Linear inside fully_shard is refused in the first backward", "[tp][bypass][fsdp]") {
  const int W = world_size();
  for (int tp : {2, W}) {
    if (W % tp != 0) continue;
    INFO("(dp, tp) = (" << W / tp << ", " << tp << ")");
    auto mesh = fsdp::comm::DeviceMesh::create(world(), {W / tp, tp}, {"dp", "tp"});
    Mlp model = make_mlp(24, /*with_extra=*/false, "down");
    fsdp::parallelize_module(*model, *mesh, "tp", {kPlan[0], kPlan[1], kPlan[2]});
    fsdp::fully_shard(model, fsdp::FullyShardOptions().communicator(mesh->group("dp")));
    at::Tensor out = model(ids());
    const std::string error = error_of([&] { out.sum().backward(); });
    CHECK_THAT(error, Contains("parallelize_module: module 'down' (RowwiseParallel)") &&
                          Contains("never called through its hook-able holder"));
    CHECK(same_on_every_rank(error));
  }
}

FSDP_RANKS_TEST_CASE("ranks of a tp group given different replicated inputs are refused at the module's first call", "[tp][inputs]") {
  if (world_size() < 2) return;  // one rank: no group to differ from
  // [Note: replicated inputs]: the ids are seeded by world rank (the mistake); the Embedding's
  // RowwiseParallel takes a Replicate input, so its first call refuses on every rank.
  Mlp model = make_mlp();
  fsdp::parallelize_module(*model, fresh_comm(), kPlan);
  auto gen = at::detail::createCPUGenerator(100 + rank());
  const at::Tensor mine = at::randint(12, {2, 6}, gen);
  const auto t0 = std::chrono::steady_clock::now();
  const std::string e = error_of([&] { model(mine); });
  CHECK(seconds_since(t0) < 10);
  CHECK_THAT(e, Contains("parallelize_module: module 'emb' (RowwiseParallel) takes a Replicate input"));
  CHECK_THAT(e, Contains("seed it by data-parallel rank, not world rank"));
  CHECK(same_on_every_rank(e));
  // A refused call does not count as the checked one: still refused.
  CHECK_THAT(error_of([&] { model(mine); }), Contains("takes a Replicate input"));
  // The same data on every rank: accepted, and later calls are not checked again (no collective).
  const std::string ok = error_of([&] { model(ids()).sum().backward(); });
  CHECK(ok == kNoError);
}
