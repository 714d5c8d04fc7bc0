// Ignored parameters and modules (FullyShardOptions::ignored_params / ignored_modules) over MPI on
// every world size: ignored parameters stay whole, local and in place through training, enter no
// collective, and with their gradients averaged by the test itself the whole model trains like an
// unsharded reference with gradients averaged over ranks; state dicts and clip_grad_norm_ handle
// them; misuse is refused before anything changes.
#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>

#include "fsdp_cpp/checkpoint/optimizer_state_dict.h"
#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/composable/clip_grad_norm.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/fully_shard_internal.h"
#include "fsdp_cpp/composable/summon_full_params.h"
#include "fsdp_cpp/contract/module_state.h"
#include "fsdp_cpp/tests/composable/test_models.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using fsdp::testing::error_of;
using fsdp::testing::MlpBlock;
using fsdp::testing::rank;
using fsdp::testing::world;
using fsdp::testing::world_size;

// A module with submodules and a buffer: ignored as a whole.
struct SideImpl : torch::nn::Module {
  explicit SideImpl(int64_t dim) {
    lin = register_module("lin", fsdp::contract::Linear(dim, dim));
    inner = register_module("inner", MlpBlock(dim, 4));
    offset = register_buffer("offset", at::full({dim}, 0.25));
  }
  at::Tensor forward(at::Tensor x) { return inner(lin(x)) + offset; }
  fsdp::contract::Linear lin{nullptr};
  MlpBlock inner{nullptr};
  at::Tensor offset;
};
FSDP_HOOKABLE_MODULE(Side);

// in -> *scale -> blocks -> + side -> head
struct IgnoringImpl : torch::nn::Module {
  IgnoringImpl() {
    in = register_module("in", fsdp::contract::Linear(6, 8));
    blocks = register_module("blocks", fsdp::contract::ModuleList());
    for (int i = 0; i < 2; ++i) blocks->push_back(MlpBlock(8, 16));
    side = register_module("side", Side(8));
    head = register_module("head", fsdp::contract::Linear(8, 3));
    scale = register_parameter("scale", at::linspace(0.5, 1.5, 8));
  }
  at::Tensor forward(at::Tensor x) {
    x = in(x) * scale;
    for (const auto& block : *blocks) x = block.forward<at::Tensor>(x);
    return head(x + 0.5 * side(x));
  }
  MlpBlock block(size_t i) const { return blocks->at<MlpBlock>(i); }
  fsdp::contract::Linear in{nullptr}, head{nullptr};
  fsdp::contract::ModuleList blocks{nullptr};
  Side side{nullptr};
  at::Tensor scale;
};
FSDP_HOOKABLE_MODULE(Ignoring);

// Block 0 ignores its fc1.bias (which the root must then leave alone too); the root ignores `scale`
// and the whole `side` module.
std::vector<fsdp::FSDPModule> shard(const Ignoring& model, fsdp::FullyShardOptions options) {
  std::vector<fsdp::FSDPModule> units;
  units.push_back(fsdp::fully_shard(
      model->block(0), fsdp::FullyShardOptions(options).ignored_params({model->block(0)->fc1->bias})));
  units.push_back(fsdp::fully_shard(model->block(1), options));
  units.push_back(fsdp::fully_shard(
      model, options.ignored_params({model->scale}).ignored_modules({model->side.ptr()})));
  return units;
}

// The ignored parameters, by FQN.
std::vector<std::string> ignored_fqns(const Ignoring& model) {
  std::vector<std::string> fqns{"blocks.0.fc1.bias", "scale"};
  for (const auto& item : model->side->named_parameters()) fqns.push_back("side." + item.key());
  return fqns;
}

bool is_ignored(const Ignoring& model, const std::string& fqn) {
  const auto fqns = ignored_fqns(model);
  return std::find(fqns.begin(), fqns.end(), fqn) != fqns.end();
}

at::Tensor batch(int64_t step, int q, int64_t cols, int salt) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(7000 * salt + 70 * step + q));
  return at::randn({5, cols}, gen);
}

// The user's part: average the ignored parameters' local gradients over the ranks (with the test's
// own communicator, so the units' communicator counts only FSDP's collectives).
void average_ignored_grads(const Ignoring& model) {
  for (const auto& item : model->named_parameters()) {
    if (!is_ignored(model, item.key()) || !item.value().grad().defined()) continue;
    at::Tensor g = item.value().mutable_grad();
    world().all_reduce(g).wait();
    g.div_(world_size());
  }
}

// One step of the unsharded reference on every rank's batch, gradients averaged over the ranks;
// returns this rank's loss.
at::Tensor reference_backward(Ignoring& reference, int64_t step) {
  at::Tensor mine;
  for (int q = 0; q < world_size(); ++q) {
    at::Tensor lq = torch::nn::functional::mse_loss(reference(batch(step, q, 6, 1)), batch(step, q, 3, 2));
    (lq / world_size()).backward();
    if (q == rank()) mine = lq.detach();
  }
  return mine;
}

bool close(const at::Tensor& a, const at::Tensor& b) {
  return world_size() == 1 ? a.equal(b) : at::allclose(a, b, 1e-5, 1e-6);
}

}  // namespace

FSDP_RANKS_TEST_CASE("ignored parameters stay whole and local; averaged by the user, training matches the reference",
                     "[ignored]") {
  const int W = world_size();
  torch::manual_seed(11);
  Ignoring model;
  torch::manual_seed(11);
  Ignoring reference;
  auto comm = std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
  auto units = shard(model, fsdp::FullyShardOptions().communicator(comm));

  // Ignored: in no FlatParameter, of any unit; everything else in exactly one.
  std::unordered_set<const void*> managed;
  int64_t managed_numel = 0;
  for (const auto& u : units) {
    for (const auto& h : fsdp::detail::handles_of(u)) {
      for (const auto& e : h->layout().entries) managed_numel += e.numel;
      for (const auto& p : h->params()) CHECK(managed.insert(p.param.unsafeGetTensorImpl()).second);
    }
  }
  int64_t ignored_numel = 0, total_numel = 0;
  struct Kept {
    std::string fqn;
    at::Tensor param;
    const void* impl;
    const void* data;
    std::vector<int64_t> shape;
  };
  std::vector<Kept> kept;
  const auto full_params = reference->named_parameters();  // unsharded: the full sizes
  for (const auto& item : model->named_parameters()) {
    total_numel += full_params[item.key()].numel();
    INFO("parameter " << item.key());
    if (is_ignored(model, item.key())) {
      ignored_numel += item.value().numel();
      CHECK(managed.count(item.value().unsafeGetTensorImpl()) == 0);
      CHECK(units.back().ignores(item.value()));
      kept.push_back({item.key(), item.value(), item.value().unsafeGetTensorImpl(), item.value().data_ptr(),
                      item.value().sizes().vec()});
    } else {
      CHECK(managed.count(item.value().unsafeGetTensorImpl()) == 1);
    }
  }
  CHECK(kept.size() == ignored_fqns(model).size());
  CHECK(managed_numel == total_numel - ignored_numel);
  // The block's ignored bias stays ignored by the root, which was not told about it.
  CHECK(units.front().ignores(model->block(0)->fc1->bias));
  CHECK(units.back().ignores(model->block(0)->fc1->bias));
  // The ignored module's buffer is no unit's business either.
  CHECK(fsdp::detail::state_of(units.back()).ignored_buffers().size() == 1);

  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
  torch::optim::Adam ref_opt(reference->parameters(), torch::optim::AdamOptions(1e-2));
  auto check_kept = [&](const char* when) {
    for (const auto& k : kept) {
      INFO(when << ": ignored parameter " << k.fqn);
      CHECK(k.param.unsafeGetTensorImpl() == k.impl);
      CHECK(k.param.data_ptr() == k.data);
      CHECK(k.param.sizes().vec() == k.shape);
      if (k.param.grad().defined()) CHECK(k.param.grad().sizes().vec() == k.shape);
    }
  };
  for (int64_t it = 0; it < 4; ++it) {
    comm->reset_stats();
    at::Tensor out = model(batch(it, rank(), 6, 1));
    check_kept("after forward");
    at::Tensor loss = torch::nn::functional::mse_loss(out, batch(it, rank(), 3, 2));
    loss.backward();
    check_kept("after backward");
    for (const auto& k : kept) CHECK(k.param.grad().defined());
    average_ignored_grads(model);
    opt.step();
    opt.zero_grad();
    check_kept("after the step");
    at::Tensor ref_loss = reference_backward(reference, it);
    ref_opt.step();
    ref_opt.zero_grad();
    INFO("iteration " << it << ": loss " << loss.item<double>() << ", reference " << ref_loss.item<double>());
    CHECK(close(loss.detach(), ref_loss));
    if (it >= 1) {
      // Bytes of FSDP's collectives: the FlatParameters only (two all-gathers per non-root unit,
      // one for the root; one reduce-scatter each).
      int64_t ag_bytes = 0, rs_bytes = 0;
      for (size_t u = 0; u < units.size(); ++u) {
        for (const auto& h : fsdp::detail::handles_of(units[u])) {
          const int64_t bytes = h->layout().padded_numel * 4;
          ag_bytes += (u + 1 == units.size() ? 1 : 2) * bytes;
          rs_bytes += bytes;
        }
      }
      if (W > 1) {
        CHECK(comm->stats(fsdp::comm::CollectiveKind::kAllGather).bytes == ag_bytes);
        CHECK(comm->stats(fsdp::comm::CollectiveKind::kReduceScatter).bytes == rs_bytes);
      }
      // One per backward pass: where it reaches each unit ([Note: backward reach]).
      CHECK(comm->stats(fsdp::comm::CollectiveKind::kAllReduce).calls == (W > 1 ? 1 : 0));
    }
  }
  // The root FlatParameter is smaller than the root's own parameters with the ignored ones
  // (alignment adds at most 3 elements per parameter, padding at most W - 1).
  int64_t root_padded = 0;
  for (const auto& h : fsdp::detail::handles_of(units.back())) root_padded += h->layout().padded_numel;
  const int64_t root_own = 6 * 8 + 8 + 8 * 3 + 3;  // in and head
  CHECK(root_padded <= root_own + 3 * 4 + (W - 1));

  for (auto& u : units) u.unshard();
  const auto ref_params = reference->named_parameters();
  for (const auto& item : model->named_parameters()) {
    INFO("parameter " << item.key());
    REQUIRE(item.value().sizes() == ref_params[item.key()].sizes());
    CHECK(close(item.value().detach(), ref_params[item.key()].detach()));
  }
  for (auto& u : units) u.reshard();
}

FSDP_RANKS_TEST_CASE("ignored parameters get this rank's local gradient", "[ignored]") {
  // Without the user's all-reduce an ignored parameter's gradient is that of this rank's batch
  // alone: the unsharded model's on the same batch.
  torch::manual_seed(5);
  Ignoring model;
  auto comm = std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
  auto units = shard(model, fsdp::FullyShardOptions().communicator(comm));
  torch::manual_seed(5);
  Ignoring local;  // unsharded, this rank's batch only
  at::Tensor loss = torch::nn::functional::mse_loss(model(batch(0, rank(), 6, 1)), batch(0, rank(), 3, 2));
  loss.backward();
  torch::nn::functional::mse_loss(local(batch(0, rank(), 6, 1)), batch(0, rank(), 3, 2)).backward();
  CHECK(close(model->scale.grad(), local->scale.grad()));
  CHECK(close(model->side->lin->weight.grad(), local->side->lin->weight.grad()));
  CHECK(close(model->block(0)->fc1->bias.grad(), local->block(0)->fc1->bias.grad()));
}

FSDP_RANKS_TEST_CASE("state dicts list ignored parameters under their FQNs with their local values", "[ignored]") {
  torch::manual_seed(3);
  Ignoring model;
  auto comm = std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
  auto units = shard(model, fsdp::FullyShardOptions().communicator(comm));
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
  for (int64_t it = 0; it < 2; ++it) {
    torch::nn::functional::mse_loss(model(batch(it, rank(), 6, 1)), batch(it, rank(), 3, 2)).backward();
    average_ignored_grads(model);
    opt.step();
    opt.zero_grad();
  }
  // The reference values: an unsharded copy of every parameter (ignored ones are whole already).
  std::map<std::string, at::Tensor> expected;
  {
    fsdp::SummonFullParams full(units.back());
    // Summoning leaves the ignored parameters as they are (same object, same storage).
    CHECK(model->scale.sizes() == at::IntArrayRef({8}));
    for (const auto& item : model->named_parameters()) expected[item.key()] = item.value().detach().clone();
  }
  const auto full = fsdp::full_state_dict(units.back(), fsdp::FullStateDictOptions().rank0_only(false));
  for (const auto& item : model->named_parameters()) {
    INFO("key " << item.key());
    REQUIRE(full.contains(item.key()));
    CHECK(full[item.key()].equal(expected[item.key()]));
  }
  CHECK(full.contains("side.offset"));

  // Sharded: ignored parameters are whole views of the live tensors, written by rank 0 only.
  const auto sharded = fsdp::sharded_state_dict(units.back());
  int found = 0;
  for (const auto& [key, shard] : sharded) {
    if (!is_ignored(model, key)) continue;
    INFO("key " << key);
    ++found;
    CHECK(shard.local.numel() == shard.global_numel());
    CHECK(shard.flat_offset == 0);
    CHECK(shard.write == (rank() == 0));
    CHECK(shard.local.data_ptr() == model->named_parameters()[key].data_ptr());
  }
  CHECK(found == static_cast<int>(ignored_fqns(model).size()));

  // Full optimizer state: the ignored parameters' Adam state in their shapes.
  const auto optim_full = fsdp::full_optimizer_state_dict(units.back(), opt, fsdp::FullStateDictOptions().rank0_only(false));
  REQUIRE(optim_full.contains("state.scale.exp_avg"));
  CHECK(optim_full["state.scale.exp_avg"].sizes() == at::IntArrayRef({8}));
  CHECK(optim_full.contains("state.side.inner.fc2.weight.exp_avg_sq"));

  // Round trip into a differently initialised model sharded the same way, from rank 0's dicts.
  torch::manual_seed(99);
  Ignoring other;
  auto other_units = shard(other, fsdp::FullyShardOptions().communicator(comm));
  torch::optim::Adam other_opt(other->parameters(), torch::optim::AdamOptions(1e-2));
  const auto sd0 = fsdp::full_state_dict(units.back());
  const auto osd0 = fsdp::full_optimizer_state_dict(units.back(), opt);
  fsdp::load_full_state_dict(other_units.back(), sd0, fsdp::LoadFullStateDictOptions().broadcast_from_rank0(true));
  fsdp::load_full_optimizer_state_dict(other_units.back(), other_opt, osd0,
                                       fsdp::LoadFullStateDictOptions().broadcast_from_rank0(true));
  const auto back = fsdp::full_state_dict(other_units.back(), fsdp::FullStateDictOptions().rank0_only(false));
  for (const auto& item : full) {
    INFO("key " << item.key());
    CHECK(back[item.key()].equal(item.value()));
  }
  const auto optim_back =
      fsdp::full_optimizer_state_dict(other_units.back(), other_opt, fsdp::FullStateDictOptions().rank0_only(false));
  for (const auto& item : optim_full) {
    INFO("key " << item.key());
    REQUIRE(optim_back.contains(item.key()));
    CHECK(optim_back[item.key()].equal(item.value()));
  }
  // Both keep training alike.
  for (auto* m : {&model, &other}) {
    torch::nn::functional::mse_loss((*m)(batch(5, rank(), 6, 1)), batch(5, rank(), 3, 2)).backward();
    average_ignored_grads(*m);
  }
  opt.step();
  other_opt.step();
  CHECK(model->scale.equal(other->scale));
  CHECK(model->side->lin->weight.equal(other->side->lin->weight));

  // Sharded round trip: every rank copies its own part (ignored values included).
  torch::manual_seed(98);
  Ignoring third;
  auto third_units = shard(third, fsdp::FullyShardOptions().communicator(comm));
  auto into = fsdp::sharded_state_dict(third_units.back());
  const auto from = fsdp::sharded_state_dict(units.back());
  REQUIRE(into.size() == from.size());
  for (size_t i = 0; i < into.size(); ++i) {
    c10::NoGradGuard no_grad;
    into[i].second.local.copy_(from[i].second.local);
  }
  const auto third_full = fsdp::full_state_dict(third_units.back(), fsdp::FullStateDictOptions().rank0_only(false));
  const auto model_full = fsdp::full_state_dict(units.back(), fsdp::FullStateDictOptions().rank0_only(false));
  for (const auto& item : model_full) {
    INFO("key " << item.key());
    CHECK(third_full[item.key()].equal(item.value()));
  }
}

FSDP_RANKS_TEST_CASE("clip_grad_norm_ adds ignored gradients locally and scales them", "[ignored]") {
  torch::manual_seed(21);
  Ignoring model;
  torch::manual_seed(21);
  Ignoring reference;
  auto comm = std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
  auto units = shard(model, fsdp::FullyShardOptions().communicator(comm));
  torch::nn::functional::mse_loss(model(batch(0, rank(), 6, 1)), batch(0, rank(), 3, 2)).backward();
  average_ignored_grads(model);
  reference_backward(reference, 0);
  double squares = 0.0;
  for (const auto& p : reference->parameters()) squares += p.grad().pow(2).sum().item<double>();
  const double expected = std::sqrt(squares);
  const at::Tensor scale_grad = model->scale.grad().clone();
  const double max_norm = expected / 4;
  const double norm = fsdp::clip_grad_norm_(units.back(), max_norm);
  CHECK(std::abs(norm - expected) <= 1e-5 * expected);
  CHECK(at::allclose(model->scale.grad(), scale_grad * (max_norm / (norm + 1e-6)), 1e-5, 1e-7));
}

FSDP_RANKS_TEST_CASE("misuse of ignored parameters and modules is refused before anything changes", "[ignored]") {
  auto comm = std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
  const auto options = fsdp::FullyShardOptions().communicator(comm);
  auto& registry = fsdp::contract::ModuleStateRegistry::global();
  auto unchanged = [&](const Ignoring& m) {
    CHECK_FALSE(registry.contains(*m, "fully_shard"));
    CHECK(m->in->weight.sizes() == at::IntArrayRef({8, 6}));
    CHECK(m->scale.sizes() == at::IntArrayRef({8}));
  };
  {
    Ignoring model;
    at::Tensor stranger = at::ones({3}).requires_grad_();
    const std::string message =
        error_of([&] { fsdp::fully_shard(model, fsdp::FullyShardOptions(options).ignored_params({stranger})); });
    INFO(message);
    CHECK(message.find("fully_shard: ignored_params[0]") != std::string::npos);
    CHECK(message.find("is not a parameter of module") != std::string::npos);
    CHECK(message.find("IgnoringImpl)") != std::string::npos);
    unchanged(model);
  }
  {
    Ignoring model, elsewhere;
    const std::string message = error_of(
        [&] { fsdp::fully_shard(model, fsdp::FullyShardOptions(options).ignored_modules({elsewhere->side.ptr()})); });
    INFO(message);
    CHECK(message.find("fully_shard: ignored_modules[0] (") != std::string::npos);
    CHECK(message.find("SideImpl) is not inside module") != std::string::npos);
    unchanged(model);
  }
  {
    Ignoring model;
    const std::string message =
        error_of([&] { fsdp::fully_shard(model, fsdp::FullyShardOptions(options).ignored_modules({model.ptr()})); });
    INFO(message);
    CHECK(message.find("lists itself in ignored_modules") != std::string::npos);
    unchanged(model);
  }
  {
    // An ignored module containing a unit.
    Ignoring model;
    fsdp::fully_shard(model->side->inner, options);
    const std::string message = error_of(
        [&] { fsdp::fully_shard(model, fsdp::FullyShardOptions(options).ignored_modules({model->side.ptr()})); });
    INFO(message);
    // With a unit inside, the ranks agree on the outcome first: "fully_shard: rank R: module ...".
    CHECK(message.find("fully_shard: ") == 0);
    CHECK(message.find("module '<root>' (") != std::string::npos);
    CHECK(message.find("ignores module 'side' (") != std::string::npos);
    CHECK(message.find("SideImpl), but its submodule 'side.inner' is a fully_shard unit") != std::string::npos);
    unchanged(model);
  }
  {
    // A parameter the unit below manages.
    Ignoring model;
    fsdp::fully_shard(model->block(0), options);
    const std::string message = error_of([&] {
      fsdp::fully_shard(model, fsdp::FullyShardOptions(options).ignored_params({model->block(0)->fc2->weight}));
    });
    INFO(message);
    CHECK(message.find("IgnoringImpl) ignores parameter 'blocks.0.fc2.weight', but the unit of its submodule "
                       "'blocks.0' already manages it") != std::string::npos);
    unchanged(model);
  }
  {
    // fully_shard inside an ignored module after its parent: top-down, refused.
    Ignoring model;
    fsdp::fully_shard(model, fsdp::FullyShardOptions(options).ignored_modules({model->side.ptr()}));
    const std::string message = error_of([&] { fsdp::fully_shard(model->side->inner, options); });
    INFO(message);
    CHECK(message.find("Apply fully_shard bottom-up") != std::string::npos);
    CHECK_FALSE(registry.contains(*model->side->inner, "fully_shard"));
    CHECK(model->side->inner->fc1->weight.sizes() == at::IntArrayRef({4, 8}));
  }
  {
    // fully_shard on a module that has replicate.
    Ignoring model;
    registry.insert(*model->block(1), "replicate", std::make_shared<fsdp::contract::ApiState>());
    const std::string message = error_of([&] { fsdp::fully_shard(model->block(1), options); });
    INFO(message);
    CHECK(message.find("fully_shard: module ") != std::string::npos);
    CHECK(message.find("MlpBlockImpl) already has replicate applied; fully_shard and replicate cannot be applied "
                       "to the same module") != std::string::npos);
    CHECK_FALSE(registry.contains(*model->block(1), "fully_shard"));
    CHECK(model->block(1)->fc1->weight.sizes() == at::IntArrayRef({16, 8}));
  }
}

FSDP_RANKS_TEST_CASE("a non-floating-point parameter can be ignored, and stays ignored above", "[ignored]") {
  torch::manual_seed(4);
  auto model = fsdp::testing::MlpStack(6, 8, 16, 3, 3);
  at::Tensor count =
      model->block(1)->register_parameter("count", at::arange(5, at::kLong), /*requires_grad=*/false);
  auto comm = std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
  const auto options = fsdp::FullyShardOptions().communicator(comm);
  // Not ignored, it cannot be sharded; the error says how to keep it.
  const std::string message = error_of([&] { fsdp::fully_shard(model->block(1), options); });
  CHECK(message.find("of dtype Long; only floating-point parameters can be sharded (list it in "
                     "FullyShardOptions::ignored_params") != std::string::npos);
  std::vector<fsdp::FSDPModule> units;
  units.push_back(fsdp::fully_shard(model->block(0), options));
  units.push_back(fsdp::fully_shard(model->block(1), fsdp::FullyShardOptions(options).ignored_params({count})));
  units.push_back(fsdp::fully_shard(model->block(2), options));
  units.push_back(fsdp::fully_shard(model, options));  // inherits the block's ignored parameter
  CHECK(units.back().ignores(count));
  const void* data = count.data_ptr();
  for (int it = 0; it < 2; ++it) {
    model(batch(it, rank(), 6, 1)).sum().backward();
    CHECK(count.equal(at::arange(5, at::kLong)));
    CHECK(count.data_ptr() == data);
  }
  const auto sd = fsdp::full_state_dict(units.back(), fsdp::FullStateDictOptions().rank0_only(false));
  REQUIRE(sd.contains("blocks.1.count"));
  CHECK(sd["blocks.1.count"].equal(at::arange(5, at::kLong)));
}
