// fsdp::optim::Muon on fully_shard models over MPI, on every world size of the launch (1-4).
//
// The reference is Muon on an unsharded copy of the model in this process, stepped with the sharded
// model's gradients gathered exactly (muon_torch_test compares with torch.optim.Muon itself, on its
// own gradients). Here: the sharded step equals it bit for bit (FULL_SHARD with uneven shards and
// padding, hybrid sharding), the owners' and the
// every-rank distributions give bitwise equal parameters, a step issues three collectives, the
// owners are the same on every rank and balance the cost; bad input (a 1-D parameter, a
// tensor-parallel piece, a tensor not in the model, ranks giving different parameters, a gradient on
// some ranks only) is refused on every rank naming the parameter; state dicts (full and sharded
// through fsdp::dcp) resume a run exactly.
#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>

#include "fsdp_cpp/checkpoint/distributed_checkpoint.h"
#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/comm/device_mesh.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/tensor_parallel.h"
#include "fsdp_cpp/contract/hookable_modules.h"
#include "fsdp_cpp/optim/muon.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::optim::Muon;
using fsdp::optim::MuonDistribution;
using fsdp::optim::MuonOptions;
using fsdp::testing::error_of;
using fsdp::testing::rank;
using fsdp::testing::world_size;

constexpr int64_t kBatch = 12;  // divisible by 1-4 ranks

// Five matrices for Muon (tall, wide, square; sizes that leave uneven shards and padding on 3 and
// 4 ranks) and a head for AdamW.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    l0 = register_module("l0", fsdp::contract::Linear(10, 24));
    l1 = register_module("l1", fsdp::contract::Linear(24, 7));
    l2 = register_module("l2", fsdp::contract::Linear(torch::nn::LinearOptions(7, 7).bias(false)));
    l3 = register_module("l3", fsdp::contract::Linear(7, 34));
    l4 = register_module("l4", fsdp::contract::Linear(34, 5));
    head = register_module("head", fsdp::contract::Linear(5, 3));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto* l : {&l0, &l1, &l2, &l3, &l4}) x = at::tanh((*l)(x));
    return head(x);
  }
  std::vector<torch::nn::Module*> layers() const {
    return {l0.ptr().get(), l1.ptr().get(), l2.ptr().get(), l3.ptr().get(), l4.ptr().get()};
  }
  fsdp::contract::Linear l0{nullptr}, l1{nullptr}, l2{nullptr}, l3{nullptr}, l4{nullptr}, head{nullptr};
};
FSDP_HOOKABLE_MODULE(Net);

Net make_net() {
  torch::manual_seed(3);
  return Net();
}

// A unit per layer, then the root; `options` for every unit (default: over the world).
fsdp::FSDPModule shard(Net& net, fsdp::FullyShardOptions options = {}) {
  if (!options.mesh() && !options.communicator()) options.communicator(fsdp::testing::fresh_comm());
  for (auto* layer : net->layers()) fsdp::fully_shard(*layer, options);
  return fsdp::fully_shard(*net, options);
}

at::Tensor batch_x(int step) {
  torch::manual_seed(100 + step);
  return torch::randn({kBatch, 10});
}
at::Tensor batch_y(int step) {
  torch::manual_seed(200 + step);
  return torch::randn({kBatch, 3});
}

// Backward of this rank's rows (`rows_of_rank`), or of the whole batch.
void backward(Net& net, int step, int parts, int part) {
  const int64_t rows = kBatch / parts;
  const at::Tensor x = batch_x(step).narrow(0, part * rows, rows), y = batch_y(step).narrow(0, part * rows, rows);
  torch::nn::functional::mse_loss(net(x), y).backward();
}

MuonOptions options() { return MuonOptions(0.02).weight_decay(0.05); }

std::vector<at::Tensor> matrices_of(Net& net) { return fsdp::optim::split_muon_params(*net, {"head"}).muon; }

// The full parameters of a fully_shard root (every rank), by FQN.
std::map<std::string, at::Tensor> full_params(const fsdp::FSDPModule& root) {
  std::map<std::string, at::Tensor> out;
  for (const auto& item : fsdp::full_state_dict(root, fsdp::FullStateDictOptions().rank0_only(false))) {
    out[item.key()] = item.value();
  }
  return out;
}

// The full gradients of a fully_shard root's parameters on every rank, exactly: each element from
// the one rank that writes it, summed with zeros from the others.
std::map<std::string, at::Tensor> full_grads(const fsdp::FSDPModule& root) {
  std::map<std::string, at::Tensor> params, out;
  for (const auto& item : root.module().named_parameters()) params[item.key()] = item.value();
  for (const auto& [fqn, shard] : fsdp::sharded_state_dict(root)) {
    at::Tensor full = at::zeros(shard.global_shape);
    const at::Tensor& grad = params.at(fqn).grad();
    if (shard.write && grad.defined() && grad.numel() > 0) {
      full.view({-1}).narrow(0, shard.flat_offset, grad.numel()).copy_(grad.reshape({-1}));
    }
    fsdp::testing::world().all_reduce(full).wait();
    out[fqn] = full;
  }
  return out;
}

// The unsharded reference: Muon on a whole copy of the model in this process, stepped with the
// sharded model's gradients (gathered exactly), so that every value must be equal bit for bit.
struct Reference {
  Reference() : net(make_net()), muon(*net, matrices_of(net), options()) {}
  void step(const fsdp::FSDPModule& sharded_root) {
    const auto grads = full_grads(sharded_root);
    for (auto& item : net->named_parameters()) item.value().mutable_grad() = grads.at(item.key());
    muon.step();
    muon.zero_grad();
  }
  void check_equal(const std::map<std::string, at::Tensor>& sharded) {
    for (const auto& item : net->named_parameters()) {
      INFO(item.key() << " max |diff| " << (sharded.at(item.key()) - item.value()).abs().max().item<double>());
      CHECK(at::equal(sharded.at(item.key()), item.value().detach()));
    }
  }
  Net net;
  Muon muon;
};

}  // namespace

FSDP_RANKS_TEST_CASE("Muon on fully_shard equals the unsharded Muon; owners spread by cost; three collectives a step",
                     "[muon]") {
  const int W = world_size();
  Net owners_net = make_net(), every_net = make_net();
  auto owners_root = shard(owners_net);
  auto every_root = shard(every_net);
  auto comm = fsdp::testing::fresh_comm();
  Muon owners(*owners_net, matrices_of(owners_net), options(), comm);
  Muon every(*every_net, matrices_of(every_net), options(), fsdp::testing::fresh_comm(), MuonDistribution::kEveryRank);

  // Owners: the same on every rank, the greedy balance of rows * cols * min(rows, cols).
  REQUIRE(owners.matrices().size() == 5);
  std::string owners_text;
  std::vector<double> load(static_cast<size_t>(W), 0.0);
  double largest = 0;
  int owned_here = 0;
  for (const auto& m : owners.matrices()) {
    owners_text += m.fqn + ":" + std::to_string(m.owner) + " ";
    const double cost = static_cast<double>(m.rows * m.cols * std::min(m.rows, m.cols));
    load[static_cast<size_t>(m.owner)] += cost;
    largest = std::max(largest, cost);
    owned_here += m.owner == rank() ? 1 : 0;
  }
  INFO(owners_text);
  CHECK(fsdp::testing::same_on_every_rank(owners_text));
  CHECK(*std::max_element(load.begin(), load.end()) - *std::min_element(load.begin(), load.end()) <= largest);
  if (W >= 2) CHECK(owners.matrices()[0].owner != owners.matrices()[3].owner);  // the two costliest: l0, l3

  Reference reference;
  for (int s = 0; s < 3; ++s) {
    backward(owners_net, s, W, rank());
    backward(every_net, s, W, rank());
    reference.step(owners_root);
    comm->reset_stats();
    owners.step();
    every.step();
    owners.zero_grad();
    every.zero_grad();
    const auto& stats = owners.last_step();
    CHECK(stats.matrices == 5);
    CHECK(stats.orthogonalized == owned_here);
    CHECK(every.last_step().orthogonalized == 5);
    CHECK(stats.collectives == (W > 1 ? 3 : 0));
    CHECK(every.last_step().collectives == (W > 1 ? 2 : 0));
    using fsdp::comm::CollectiveKind;
    CHECK(comm->stats(CollectiveKind::kAllToAllV).calls == (W > 1 ? 2 : 0));
    CHECK(comm->stats(CollectiveKind::kAllGather).calls == (W > 1 ? 1 : 0));
  }
  const auto mine = full_params(owners_root);
  const auto theirs = full_params(every_root);
  for (const auto& [fqn, value] : mine) {
    INFO(fqn);
    CHECK(at::equal(value, theirs.at(fqn)));  // the same bfloat16 matrices orthogonalized alike
  }
  reference.check_equal(mine);
}

FSDP_RANKS_TEST_CASE("Muon with hybrid sharding: replicas send once, every replica gets its slices", "[muon][hsdp]") {
  const int W = world_size();
  if (W != 4) return;
  auto mesh = fsdp::comm::DeviceMesh::hybrid(fsdp::testing::world(), 2);
  Net net = make_net();
  auto root = shard(net, fsdp::FullyShardOptions().mesh(mesh));
  Muon muon(*net, matrices_of(net), options(), fsdp::testing::fresh_comm());
  Reference reference;
  for (int s = 0; s < 3; ++s) {
    backward(net, s, W, rank());
    reference.step(root);
    muon.step();
    muon.zero_grad();
  }
  reference.check_equal(full_params(root));
}

FSDP_RANKS_TEST_CASE("Muon refuses bad input on every rank, naming the parameter", "[muon][misuse]") {
  const int W = world_size();
  Net net = make_net();
  shard(net);
  auto comm = fsdp::testing::fresh_comm();

  // A 1-D parameter (torch.optim.Muon refuses it too).
  std::string message = error_of([&] { Muon m(*net, {net->l0->weight, net->l0->bias}, options(), comm); });
  INFO(message);
  CHECK_THAT(message, Contains("fsdp::optim::Muon: rank 0: parameter 'l0.bias' has shape [24]: Muon steps 2-D "
                               "matrices only"));
  CHECK(fsdp::testing::same_on_every_rank(message));

  // A tensor that is not a parameter of the model.
  at::Tensor stray = torch::zeros({4, 4}, torch::requires_grad());
  message = error_of([&] { Muon m(*net, {stray}, options(), comm); });
  CHECK_THAT(message, Contains("parameter 0 of param group 0 (shape [4, 4]) is not a parameter of the model"));

  // Invalid options, as torch.optim.Muon's constructor says.
  message = error_of([&] { Muon m(*net, {net->l0->weight}, MuonOptions(0.02).adjust_lr_fn("bogus"), comm); });
  CHECK_THAT(message, Contains("Adjust learning rate function bogus is not supported"));

  if (W > 1) {
    // Ranks that give different parameters: every rank refuses before anything is exchanged.
    std::vector<at::Tensor> params = {net->l0->weight};
    if (rank() == 0) params.push_back(net->l1->weight);
    message = error_of([&] { Muon m(*net, params, options(), comm); });
    INFO(message);
    CHECK_THAT(message, Contains("rank 0 gives Muon 2 matrices, rank 1 gives 1"));
    CHECK(fsdp::testing::same_on_every_rank(message));

    // A gradient on some ranks only: refused at the step on every rank, nothing changed.
    Muon muon(*net, matrices_of(net), options(), comm);
    backward(net, 0, W, rank());
    if (rank() == 0) net->l3->weight.mutable_grad() = at::Tensor();
    const at::Tensor before = net->l0->weight.detach().clone();
    message = error_of([&] { muon.step(); });
    INFO(message);
    CHECK_THAT(message, Contains("'l3.weight' has a gradient on " + std::to_string(W - 1) +
                                 " of the ranks holding it and none on 1"));
    CHECK(fsdp::testing::same_on_every_rank(message));
    CHECK(at::equal(before, net->l0->weight.detach()));
  }
}

FSDP_RANKS_TEST_CASE("Muon refuses tensor-parallel pieces on every rank, naming the parameter", "[muon][tp][misuse]") {
  const int W = world_size();
  if (W % 2 != 0) return;
  auto mesh = fsdp::comm::DeviceMesh::create(fsdp::testing::world(), {W / 2, 2}, {"dp", "tp"});
  Net net = make_net();
  fsdp::parallelize_module(*net, *mesh, "tp", {{"l3", fsdp::ColwiseParallel()}, {"l4", fsdp::RowwiseParallel()}});
  shard(net, fsdp::FullyShardOptions().communicator(mesh->group("dp")));
  const std::string message =
      error_of([&] { Muon m(*net, matrices_of(net), options(), fsdp::testing::fresh_comm()); });
  INFO(message);
  CHECK_THAT(message, Contains("fsdp::optim::Muon: rank 0: parameter 'l3.weight' is a tensor-parallel piece (global "
                               "shape [34, 7])"));
  CHECK(fsdp::testing::same_on_every_rank(message));
  // The matrices tensor parallelism leaves whole are fine, stepped over the world.
  Muon muon(*net, {net->l0->weight, net->l1->weight}, options(), fsdp::testing::fresh_comm());
  CHECK(muon.matrices().size() == 2);
}

FSDP_RANKS_TEST_CASE("Muon state dicts resume a run exactly: full (torch's form) and sharded through fsdp::dcp",
                     "[muon][state_dict]") {
  const int W = world_size();
  Net a = make_net();
  auto root_a = shard(a);
  Muon muon_a(*a, matrices_of(a), options(), fsdp::testing::fresh_comm());
  for (int s = 0; s < 2; ++s) {
    backward(a, s, W, rank());
    muon_a.step();
    muon_a.zero_grad();
  }
  const fsdp::optim::MuonStateDict sd = muon_a.state_dict();
  REQUIRE(sd.state.size() == 5);
  CHECK(sd.state[0].first == "l0.weight");
  CHECK(sd.state[0].second.sizes() == c10::IntArrayRef({24, 10}));
  REQUIRE(sd.param_groups.size() == 1);
  CHECK(sd.param_groups[0].params ==
        std::vector<std::string>{"l0.weight", "l1.weight", "l2.weight", "l3.weight", "l4.weight"});
  CHECK(sd.param_groups[0].options.weight_decay() == 0.05);
  const std::string dir = fsdp::testing::shared_tmpdir() + "/muon_dcp";
  fsdp::dcp::save_state(dir, muon_a.sharded_state_dict(), {},
                         fsdp::dcp::SaveOptions().communicator(fsdp::testing::fresh_comm()));
  const auto params_a = fsdp::full_state_dict(root_a, fsdp::FullStateDictOptions().rank0_only(false));

  // b: the same parameters, the full state dict; c: the same parameters, the dcp checkpoint.
  Net b = make_net(), c = make_net();
  auto root_b = shard(b), root_c = shard(c);
  fsdp::load_full_state_dict(root_b, params_a);
  fsdp::load_full_state_dict(root_c, params_a);
  Muon muon_b(*b, matrices_of(b), MuonOptions(1.0), fsdp::testing::fresh_comm());
  Muon muon_c(*c, matrices_of(c), options(), fsdp::testing::fresh_comm());
  muon_b.load_state_dict(sd);  // the options too
  fsdp::dcp::load_state(dir, muon_c.sharded_state_dict(), nullptr,
                         fsdp::dcp::LoadOptions().communicator(fsdp::testing::fresh_comm()));
  for (int s = 2; s < 4; ++s) {
    for (auto* pair : {&a, &b, &c}) backward(*pair, s, W, rank());
    muon_a.step();
    muon_b.step();
    muon_c.step();
    muon_a.zero_grad();
    muon_b.zero_grad();
    muon_c.zero_grad();
  }
  const auto end_a = full_params(root_a), end_b = full_params(root_b), end_c = full_params(root_c);
  for (const auto& [fqn, value] : end_a) {
    INFO(fqn);
    CHECK(at::equal(value, end_b.at(fqn)));
    CHECK(at::equal(value, end_c.at(fqn)));
  }

  // A state dict that does not fit is refused on every rank and changes nothing.
  fsdp::optim::MuonStateDict bad = sd;
  bad.state[1].second = at::zeros({3, 3});
  const std::string message = error_of([&] { muon_b.load_state_dict(bad); });
  INFO(message);
  CHECK_THAT(message, Contains("the momentum_buffer of 'l1.weight' should be [7, 24], got [3, 3]"));
  CHECK(fsdp::testing::same_on_every_rank(message));
}
