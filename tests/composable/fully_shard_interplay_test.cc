// fully_shard with what other APIs and the program put on the same parameters and groups, over MPI
// on 1-4 ranks:
//  - parameters placed by tensor parallel: a communicator (or an HSDP mesh) that contains two ranks
//    of one tp group is refused on every rank with the same error before anything changes, naming
//    the unit, a placed parameter, both groups' world ranks and the fix; the data-parallel group is
//    accepted and trains as the unsharded model does ([Note: fully_shard over tensor-parallel
//    groups] in composable/fully_shard.cc);
//  - a gradient hook the program registered on a managed parameter before the first iteration runs
//    in every iteration next to the first-iteration gradient guard ([Note: first-iteration
//    gradient guard] in fsdp/gradient_guard.h);
//  - the groups fully_shard derives (reshard_after_forward(int), separate_reduce_communicator) are
//    freed with the last unit that uses them ([Note: derived group lifetime] in
//    fsdp/derived_groups.h).
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/sgd.h>

#include "fsdp_cpp/comm/device_mesh.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/fully_shard_internal.h"
#include "fsdp_cpp/composable/tensor_parallel.h"
#include "fsdp_cpp/contract/hookable_module_holder.h"
#include "fsdp_cpp/contract/hookable_modules.h"
#include "fsdp_cpp/contract/module_state.h"
#include "fsdp_cpp/fsdp/derived_groups.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::testing::error_of;
using fsdp::testing::fresh_comm;
using fsdp::testing::kNoError;
using fsdp::testing::rank;
using fsdp::testing::same_on_every_rank;
using fsdp::testing::world_size;

// x -> up (column-parallel) -> relu -> down (row-parallel): every dimension divides over 2 ranks.
struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    up = register_module("up", fsdp::contract::Linear(8, 16));
    down = register_module("down", fsdp::contract::Linear(16, 8));
  }
  at::Tensor forward(at::Tensor x) { return down(at::relu(up(x))); }
  fsdp::contract::Linear up{nullptr}, down{nullptr};
};
FSDP_HOOKABLE_MODULE(Mlp);

const fsdp::TensorParallelPlan kPlan = {{"up", fsdp::ColwiseParallel()}, {"down", fsdp::RowwiseParallel()}};

Mlp make_mlp() {
  torch::manual_seed(7);
  return Mlp();
}

// The world as init_process_group makes it: it knows its world ranks (0 .. W-1).
std::shared_ptr<fsdp::comm::Communicator> world_with_ranks() {
  auto world = fresh_comm();
  std::vector<int> ranks(world_size());
  std::iota(ranks.begin(), ranks.end(), 0);
  world->set_world_ranks(ranks);
  return world;
}

std::string ranks_text(const std::vector<int>& ranks) {
  std::string out = "{";
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out + "}";
}

// The parameters' shapes and storages: a refused fully_shard changes none.
struct Snapshot {
  std::vector<std::vector<int64_t>> shapes;
  std::vector<const void*> data;
  explicit Snapshot(torch::nn::Module& m) {
    for (const auto& p : m.parameters()) {
      shapes.push_back(p.sizes().vec());
      data.push_back(p.data_ptr());
    }
  }
  bool operator==(const Snapshot& o) const { return shapes == o.shapes && data == o.data; }
};

at::Tensor input() {
  torch::manual_seed(23);
  return at::randn({4, 8});
}

// One SGD step of `model` (tensor parallel + fully_shard, every rank the same input) and of the
// unsharded `reference`, then the largest difference of their outputs.
double difference_after_one_step(Mlp& model, Mlp& reference) {
  const at::Tensor x = input();
  torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.5));
  torch::optim::SGD reference_optim(reference->parameters(), torch::optim::SGDOptions(0.5));
  model(x).pow(2).sum().backward();
  reference(x).pow(2).sum().backward();
  optim.step();
  reference_optim.step();
  c10::NoGradGuard no_grad;
  return (model(x) - reference(x)).abs().max().item<double>();
}

}  // namespace

FSDP_RANKS_TEST_CASE("fully_shard over a communicator holding tp peers is refused on every rank; the dp group trains",
                     "[fully_shard][tp][misuse]") {
  const int W = world_size();
  if (W % 2 != 0) return;  // a (dp, tp) mesh with tp = 2
  auto world = world_with_ranks();
  auto mesh = fsdp::comm::DeviceMesh::create(*world, {W / 2, 2}, {"dp", "tp"});
  Mlp model = make_mlp();
  Mlp reference = make_mlp();
  fsdp::parallelize_module(*model, *mesh, "tp", kPlan);
  const Snapshot before(*model);
  const std::vector<int> tp_ranks = *mesh->group("tp")->world_ranks();

  // The world communicator (the default when none is given): it holds both ranks of every tp group.
  const std::string message =
      error_of([&] { fsdp::fully_shard(model, fsdp::FullyShardOptions().communicator(world)); });
  INFO(message);
  CHECK_THAT(message, Contains("fully_shard: rank 0: module '<root>' (") &&
                          Contains("has parameter 'up.weight' placed by tensor parallel (") &&
                          Contains("mesh dimension 'tp': world ranks {0, 1}") &&
                          Contains("but its communicator (world ranks " + ranks_text([&] {
                                     std::vector<int> all(W);
                                     std::iota(all.begin(), all.end(), 0);
                                     return all;
                                   }()) + ") contains 2 ranks of that tp group {0, 1}") &&
                          Contains("communicator(mesh->group(\"dp\"))"));
  if (W == 4) CHECK_THAT(message, Contains("errors were also found on rank 1, rank 2, rank 3"));
  CHECK(same_on_every_rank(message));
  CHECK(Snapshot(*model) == before);  // nothing changed
  CHECK_FALSE(fsdp::fsdp_module_of(*model).has_value());
  CHECK(tp_ranks.size() == 2);

  // The data-parallel group: accepted, and one step equals the unsharded model's.
  REQUIRE(error_of([&] { fsdp::fully_shard(model, fsdp::FullyShardOptions().communicator(mesh->group("dp"))); }) ==
          kNoError);
  const double diff = difference_after_one_step(model, reference);
  INFO("largest difference after one step: " << diff);
  CHECK(diff < 1e-5);
}

FSDP_RANKS_TEST_CASE("an HSDP mesh over the whole world after tensor parallel is refused on every rank",
                     "[fully_shard][tp][hsdp][misuse]") {
  const int W = world_size();
  if (W % 2 != 0) return;
  auto world = world_with_ranks();
  auto mesh = fsdp::comm::DeviceMesh::create(*world, {W / 2, 2}, {"dp", "tp"});
  Mlp model = make_mlp();
  fsdp::parallelize_module(*model, *mesh, "tp", kPlan);
  const Snapshot before(*model);
  // Hybrid over the world: on 4 ranks the shard groups {0, 1}, {2, 3} are the tp groups; on 2 ranks
  // the shard groups have one rank and the replicate group {0, 1} is the tp group.
  auto hsdp = fsdp::comm::DeviceMesh::hybrid(*world, W == 4 ? 2 : 1);
  const std::string message = error_of([&] { fsdp::fully_shard(model, fsdp::FullyShardOptions().mesh(hsdp)); });
  INFO(message);
  CHECK_THAT(message, Contains("fully_shard: rank 0: module '<root>' (") &&
                          Contains("has parameter 'up.weight' placed by tensor parallel") &&
                          Contains(W == 4 ? "but its mesh's shard group (world ranks {0, 1})"
                                          : "but its mesh's replicate group (world ranks {0, 1})") &&
                          Contains("contains 2 ranks of that tp group {0, 1}") &&
                          Contains("mesh->group(\"dp\")"));
  CHECK(same_on_every_rank(message));
  CHECK(Snapshot(*model) == before);
  CHECK_FALSE(fsdp::fsdp_module_of(*model).has_value());

  // HSDP over the data-parallel dimensions of a (replicate, shard, tp) mesh is accepted.
  auto mesh3 = fsdp::comm::DeviceMesh::create(*world, {1, W / 2, 2}, {"replicate", "shard", "tp"});
  Mlp model3 = make_mlp();
  Mlp reference = make_mlp();
  fsdp::parallelize_module(*model3, *mesh3, "tp", kPlan);
  REQUIRE(error_of([&] {
            fsdp::fully_shard(model3, fsdp::FullyShardOptions().mesh(mesh3->submesh({"replicate", "shard"})));
          }) == kNoError);
  CHECK(difference_after_one_step(model3, reference) < 1e-5);
}

FSDP_RANKS_TEST_CASE("without world ranks fully_shard over the tp group itself is refused", "[fully_shard][tp][misuse]") {
  if (world_size() % 2 != 0) return;  // the Mlp's features divide over 2 and 4 ranks
  // A communicator made from a backend knows no world ranks: only the tp group itself is provably
  // wrong (see the note).
  auto group = fresh_comm();
  REQUIRE_FALSE(group->world_ranks().has_value());
  Mlp model = make_mlp();
  fsdp::parallelize_module(*model, group, kPlan);
  const Snapshot before(*model);
  const std::string message =
      error_of([&] { fsdp::fully_shard(model, fsdp::FullyShardOptions().communicator(group)); });
  CHECK_THAT(message, Contains("fully_shard: group rank 0: module '<root>' (") &&
                          Contains("has parameter 'up.weight' placed by tensor parallel") &&
                          Contains("world ranks unknown (the same group)") &&
                          Contains("contains the ranks of that tp group"));
  CHECK(same_on_every_rank(message));
  CHECK(Snapshot(*model) == before);
}

FSDP_RANKS_TEST_CASE("a gradient hook registered before the first iteration runs with the first-iteration guard",
                     "[fully_shard][hooks]") {
  Mlp model = make_mlp();
  Mlp reference = make_mlp();
  const auto options = fsdp::FullyShardOptions().communicator(fresh_comm());
  fsdp::fully_shard(model->up, options);
  fsdp::fully_shard(model, options);
  // The program's hooks, before the first forward: one on a child unit's parameter, one on the
  // root's. The guard used to assert that the parameter had no hook.
  std::vector<std::vector<int64_t>> seen_up, seen_down;
  model->up->weight.register_hook([&](const at::TensorBase& g) { seen_up.push_back(g.sizes().vec()); });
  model->down->bias.register_hook([&](const at::TensorBase& g) -> at::Tensor {
    seen_down.push_back(g.sizes().vec());
    return at::Tensor(g) * 2;  // the hook's result is what is accumulated
  });
  reference->down->bias.register_hook([](const at::TensorBase& g) -> at::Tensor { return at::Tensor(g) * 2; });
  const at::Tensor x = input();
  torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD reference_optim(reference->parameters(), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < 3; ++step) {
    INFO("step " << step);
    optim.zero_grad();
    reference_optim.zero_grad();
    REQUIRE(error_of([&] { model(x).pow(2).sum().backward(); }) == kNoError);
    reference(x).pow(2).sum().backward();
    optim.step();
    reference_optim.step();
    // Called once per iteration with the full gradient, in the first iteration (guard installed)
    // and after it.
    REQUIRE(seen_up.size() == static_cast<size_t>(step + 1));
    CHECK(seen_up.back() == std::vector<int64_t>{16, 8});
    REQUIRE(seen_down.size() == static_cast<size_t>(step + 1));
    CHECK(seen_down.back() == std::vector<int64_t>{8});
  }
  c10::NoGradGuard no_grad;
  CHECK(at::allclose(model(x), reference(x), 1e-5, 1e-6));
}

FSDP_RANKS_TEST_CASE("derived groups are freed with the last unit that uses them", "[fully_shard][groups]") {
  const int W = world_size();
  if (W < 2) return;  // nothing is derived on one rank
  auto& registry = fsdp::contract::ModuleStateRegistry::global();
  registry.prune();
  const size_t before = fsdp::cached_derived_groups();
  auto comm = fresh_comm();
  // reshard_after_forward(2) makes a post-forward group on 4 ranks (on 2 it is the communicator
  // itself; 3 has no divisor below itself); separate_reduce_communicator a duplicate everywhere.
  const bool post_forward = W == 4;
  auto options = fsdp::FullyShardOptions().communicator(comm).separate_reduce_communicator(true);
  if (post_forward) options.reshard_after_forward(2);
  std::weak_ptr<fsdp::comm::Communicator> reduce, post;
  {
    Mlp model = make_mlp();
    fsdp::fully_shard(model->up, options);
    auto root = fsdp::fully_shard(model, options);
    const auto& config = fsdp::detail::state_of(root).config();
    reduce = config.reduce_group;
    post = config.post_forward_group;
    CHECK_FALSE(reduce.expired());
    CHECK(post.expired() == !post_forward);
    // Shared by the two units, one cache entry per kind.
    CHECK(fsdp::cached_derived_groups() == before + (post_forward ? 2 : 1));
    model(input()).sum().backward();
  }
  // The model is gone; its units die at the registry's next prune (LibTorch gives no callback when
  // a module dies), and the groups with them, before any MPI_Finalize the program calls.
  registry.prune();
  CHECK(reduce.expired());
  CHECK(post.expired());
  CHECK(fsdp::cached_derived_groups() == before);
  // A new unit makes them again (collectively) and trains.
  Mlp again = make_mlp();
  fsdp::fully_shard(again, options);
  CHECK(fsdp::cached_derived_groups() == before + (post_forward ? 2 : 1));
  REQUIRE(error_of([&] { again(input()).sum().backward(); }) == kNoError);
}
