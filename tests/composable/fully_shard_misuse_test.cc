// fully_shard's refusals and first-iteration guards against misuse, over MPI on every world size:
// LibTorch's containers refused as units (holders that cannot run hooks are refused at compile
// time), units called around their hooks named when the forward fails, parameters read while
// sharded named with their unit, parameters touched outside any unit's forward (an L2 penalty
// after the forward) caught at the end of the first backward, and module->to(dtype) after
// sharding. Every error names the API, the FQNs, what was expected and what was found, and is
// raised on every rank (the harness exchanges each test case's outcome across ranks).
//
// On one rank a sharded parameter is the whole parameter in its full shape, but in the first
// forwards every parameter outside its unit's forward is an empty placeholder on every world size
// ([Note: hidden parameters] in fsdp/sharded_use_guard.h): a module called around its hooks fails
// the same way on every rank and world size. Penalties over the parameters after the forward
// compute correctly on one rank and are reported at the end of the first backward on several.
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/fully_shard_internal.h"
#include "fsdp_cpp/contract/forward_hooks.h"
#include "fsdp_cpp/fsdp/root_context.h"
#include "fsdp_cpp/fsdp/gradient_guard.h"
#include "fsdp_cpp/tests/composable/parity.h"
#include "fsdp_cpp/tests/composable/test_models.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::testing::fresh_comm;
using fsdp::testing::error_of;  // tests/testing/errors.h, through multi_rank.h
using fsdp::testing::kNoError;
using fsdp::testing::world;
using fsdp::testing::world_size;

fsdp::FullyShardOptions options() { return fsdp::FullyShardOptions().communicator(fresh_comm()); }

size_t unsharded_bytes(torch::nn::Module& model) {
  size_t total = 0;
  for (const auto& item : model.named_modules()) {
    if (auto unit = fsdp::fsdp_module_of(*item.value())) {
      for (const auto& h : fsdp::detail::handles_of(*unit)) total += h->unsharded_bytes();
    }
  }
  return total;
}

size_t count_of(const std::string& text, const std::string& part) {
  size_t count = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++count;
  return count;
}

// The holder overload of fully_shard refuses, at compile time, holders whose call operator cannot
// run forward hooks (its static_assert says to use FSDP_HOOKABLE_MODULE / the hook-able holders).
static_assert(fsdp::contract::HookableHolder<fsdp::testing::MlpStack>);
static_assert(fsdp::contract::HookableHolder<fsdp::contract::Sequential>);
static_assert(fsdp::contract::HookableHolder<fsdp::contract::Linear>);
static_assert(!fsdp::contract::HookableHolder<torch::nn::Sequential>);
static_assert(!fsdp::contract::HookableHolder<torch::nn::Linear>);
static_assert(!fsdp::contract::HookableHolder<torch::nn::ModuleDict>);
static_assert(!fsdp::contract::HookableHolder<fsdp::contract::ModuleList>);

// How the root reaches its child unit, a Linear(3, 3) with a bias: a 1-D sharded weight fails in
// addmm ("mat2 must be a matrix").
enum class Reach { kThroughHooks, kTorchSequential, kBypassForward, kModuleDict, kAnyModule, kPlainHolder };

struct RootImpl : torch::nn::Module {
  explicit RootImpl(Reach reach) : reach(reach) {
    fc = register_module("fc", fsdp::contract::Linear(3, 3));
    auto impl = std::make_shared<torch::nn::LinearImpl>(3, 3);
    child = fsdp::contract::Linear(impl);
    plain = torch::nn::Linear(impl);
    switch (reach) {
      case Reach::kTorchSequential:
        seq = register_module("seq", torch::nn::Sequential(impl));
        break;
      case Reach::kModuleDict:
        dict = register_module(
            "dict", torch::nn::ModuleDict(std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>{
                        {"proj", impl}}));
        break;
      default:
        register_module("child", child);
        any = torch::nn::AnyModule(impl);
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(fc(x));
    switch (reach) {
      case Reach::kThroughHooks: return child(x);
      case Reach::kTorchSequential: return seq->forward(x);
      case Reach::kBypassForward: return child->forward(x);
      case Reach::kModuleDict: return (*dict)["proj"]->as<torch::nn::LinearImpl>()->forward(x);
      case Reach::kAnyModule: return any.forward(x);
      case Reach::kPlainHolder: return plain(x);  // LibTorch's holder: no hooks
    }
    return x;
  }
  // The child's FQN.
  std::string child_fqn() const {
    return reach == Reach::kTorchSequential ? "seq.0" : reach == Reach::kModuleDict ? "dict.proj" : "child";
  }
  Reach reach;
  fsdp::contract::Linear fc{nullptr};
  fsdp::contract::Linear child{nullptr};  // a hook-able holder of the child, wherever it is registered
  torch::nn::Sequential seq{nullptr};
  torch::nn::ModuleDict dict{nullptr};
  torch::nn::AnyModule any;
  torch::nn::Linear plain{nullptr};
};
FSDP_HOOKABLE_MODULE(Root);

// x -> block(x), where the block calls its own child unit through LibTorch's Sequential: the error
// crosses the block's unit first.
struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    fc = register_module("fc", fsdp::contract::Linear(3, 3));
    seq = register_module("seq", torch::nn::Sequential(torch::nn::Linear(3, 3)));
  }
  torch::Tensor forward(torch::Tensor x) { return seq->forward(fc(x)); }
  fsdp::contract::Linear fc{nullptr};
  torch::nn::Sequential seq{nullptr};
};
FSDP_HOOKABLE_MODULE(Block);

struct OuterImpl : torch::nn::Module {
  OuterImpl() {
    in = register_module("in", fsdp::contract::Linear(3, 3));
    block = register_module("block", Block());
  }
  torch::Tensor forward(torch::Tensor x) { return block(in(x)); }
  fsdp::contract::Linear in{nullptr};
  Block block{nullptr};
};
FSDP_HOOKABLE_MODULE(Outer);

// 1-D parameter `scale`: forward multiplies by its sum (a sharded scale computes silently). The
// parent reads it outside the child's forward: before calling the child, or after.
struct ScaleImpl : torch::nn::Module {
  ScaleImpl() { scale = register_parameter("scale", at::arange(1, 5, at::kFloat)); }
  torch::Tensor forward(torch::Tensor x) { return x * scale.sum(); }
  torch::Tensor scale;
};
FSDP_HOOKABLE_MODULE(Scale);

struct ReaderImpl : torch::nn::Module {
  explicit ReaderImpl(bool call_child) : call_child(call_child) {
    fc = register_module("fc", fsdp::contract::Linear(3, 3));
    child = register_module("child", Scale());
  }
  torch::Tensor forward(torch::Tensor x) {
    x = fc(x);
    if (call_child) x = child(x);
    return x * child->scale.sum();
  }
  bool call_child;
  fsdp::contract::Linear fc{nullptr};
  Scale child{nullptr};
};
FSDP_HOOKABLE_MODULE(Reader);

at::Tensor l2_penalty(torch::nn::Module& model) {
  at::Tensor sum = at::zeros({});
  for (const auto& p : model.parameters()) sum = sum + p.pow(2).sum();
  return sum;
}

}  // namespace

FSDP_RANKS_TEST_CASE("LibTorch's containers are refused as units, leaving the model as it was", "[fully_shard][misuse]") {
  const auto o = options();
  torch::nn::Sequential seq(torch::nn::Linear(3, 3));
  const at::Tensor weight = seq->ptr(0)->named_parameters()["weight"];
  CHECK_THROWS_WITH(fsdp::fully_shard(*seq, o),
                    Contains("fully_shard: module '<root>' (torch::nn::SequentialImpl) is LibTorch's "
                             "torch::nn::Sequential") &&
                        Contains("Expected a module called through a hook-able holder") &&
                        Contains("use fsdp::contract::Sequential"));
  CHECK(weight.sizes() == at::IntArrayRef({3, 3}));
  CHECK(fsdp::contract::num_forward_pre_hooks(*seq) == 0);
  CHECK_FALSE(fsdp::fsdp_module_of(*seq).has_value());

  torch::nn::ModuleList list(torch::nn::Linear(3, 3));
  CHECK_THROWS_WITH(fsdp::fully_shard(*list, o),
                    Contains("fully_shard: module '<root>' (torch::nn::ModuleListImpl) is LibTorch's "
                             "torch::nn::ModuleList, which has no forward") &&
                        Contains("apply fully_shard to the modules it holds"));
  torch::nn::ModuleDict dict(std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>{
      {"fc", torch::nn::Linear(3, 3).ptr()}});
  CHECK_THROWS_WITH(fsdp::fully_shard(*dict, o), Contains("torch::nn::ModuleDict, which has no forward"));

  // One unit of siblings, one of them refused: nothing is applied to the other either.
  fsdp::contract::Linear fc(3, 3);
  CHECK_THROWS_WITH(fsdp::fully_shard({fc.ptr().get(), seq.ptr().get()}, o),
                    Contains("torch::nn::Sequential"));
  CHECK_FALSE(fsdp::fsdp_module_of(*fc).has_value());
  CHECK(fsdp::contract::num_forward_pre_hooks(*fc) == 0);
  CHECK(fc->weight.sizes() == at::IntArrayRef({3, 3}));

  // The module through its hook-able holder is fine.
  CHECK_NOTHROW(fsdp::fully_shard(fc, o));
}

FSDP_RANKS_TEST_CASE("a unit called around its hooks is named when the root's forward fails", "[fully_shard][misuse]") {
  // On every world size, one rank included, and with the same message on every rank: in the
  // first forward the bypassed child's parameters are empty placeholders on every rank (a
  // sharded weight has another size on each rank, so ranks used to fail differently or not at
  // all, and one rank computed silently).
  for (Reach reach : {Reach::kTorchSequential, Reach::kBypassForward, Reach::kModuleDict, Reach::kAnyModule,
                      Reach::kPlainHolder}) {
    torch::manual_seed(3);
    auto model = Root(reach);
    const std::string fqn = model->child_fqn();
    INFO("child " << fqn);
    const auto o = options();
    fsdp::fully_shard(*model->child, o);  // through the module: the holder it is called by differs
    fsdp::fully_shard(model, o);
    const at::Tensor x = at::randn({2, 3});
    const at::Tensor weight = model->child->weight;
    const std::vector<int64_t> shape_before = weight.sizes().vec();
    const void* data_before = weight.data_ptr();
    const std::string message = error_of([&] { model(x); });
    CHECK_THAT(message, Contains("fully_shard: while running unit '<root>', 1 unit(s) inside it had "
                                 "not run their pre-forward in this iteration"));
    CHECK_THAT(message, Contains("unit '" + fqn + "' (torch::nn::LinearImpl): '" + fqn +
                                 ".weight' [3, 3] held as [0] Float"));
    CHECK_THAT(message, Contains("not `module->forward(x)`") && Contains("FSDP_HOOKABLE_MODULE") &&
                            Contains("fsdp::contract::Sequential"));
    CHECK(count_of(message, "fully_shard: while running unit") == 1);
    CHECK(fsdp::testing::same_on_every_rank(message));
    // The failed forward left the parameters as they were: shards (full on one rank).
    CHECK(weight.sizes().vec() == shape_before);
    CHECK(weight.data_ptr() == data_before);

    // Called through its hooks, the model trains after the failed forward (every rank threw at
    // the same point, so the next forward starts cleanly on all of them).
    model->reach = Reach::kThroughHooks;
    at::Tensor out = model(x);
    out.sum().backward();
    CHECK(unsharded_bytes(*model) == 0);
  }
}

FSDP_RANKS_TEST_CASE("with mixed precision a unit called around its hooks is named on every world size", "[fully_shard][misuse]") {
  // Outside its forward the child's weight stays in float32 (and sharded on several ranks), while
  // the root computes in bfloat16: the bypassed Linear fails on one rank too.
  torch::manual_seed(3);
  auto model = Root(Reach::kTorchSequential);
  const auto o = options().mixed_precision(fsdp::MixedPrecision().param_dtype(at::kBFloat16));
  fsdp::fully_shard(*model->child, o);
  fsdp::fully_shard(model, o);
  const std::string message = error_of([&] { model(at::randn({2, 3})); });
  CHECK_THAT(message, Contains("fully_shard: while running unit '<root>', 1 unit(s) inside it") &&
                          Contains("unit 'seq.0' (torch::nn::LinearImpl): 'seq.0.weight' [3, 3] held as [") &&
                          Contains("] Float") && Contains("fsdp::contract::Sequential"));
}

FSDP_RANKS_TEST_CASE("the innermost unit a forward error crosses explains it", "[fully_shard][misuse]") {
  torch::manual_seed(3);
  auto model = Outer();
  const auto o = options();
  fsdp::fully_shard(*model->block->seq->ptr(0), o);
  fsdp::fully_shard(model->block, o);
  fsdp::fully_shard(model, o);
  const at::Tensor x = at::randn({2, 3});
  const std::string message = error_of([&] { model(x); });
  CHECK_THAT(message, Contains("fully_shard: while running unit 'block', 1 unit(s) inside it") &&
                          Contains("unit 'block.seq.0' (torch::nn::LinearImpl): 'block.seq.0.weight' [3, 3]"));
  CHECK(count_of(message, "fully_shard: while running unit") == 1);
  CHECK(fsdp::testing::same_on_every_rank(message));
}

FSDP_RANKS_TEST_CASE("fully_shard's own errors inside a forward are left as they are", "[fully_shard][misuse]") {
  // A forward order that differs across ranks fails in a unit's pre-forward, inside the root's
  // forward, while the other unit has not run: the root does not add its explanation.
  torch::manual_seed(3);
  auto model = fsdp::testing::Order(4);
  const auto o = options();
  fsdp::fully_shard(model->a, o);
  fsdp::fully_shard(model->b, o);
  fsdp::fully_shard(model, o);
  const std::string message = error_of([&] { model(at::randn({2, 4}), fsdp::testing::rank() % 2 == 1); });
  if (world_size() == 1) {
    CHECK(message == kNoError);
    return;
  }
  CHECK_THAT(message, Contains("fully_shard: the forward order differs across ranks"));
  CHECK_THAT(message, !Contains("while running unit"));
}

FSDP_RANKS_TEST_CASE("a parameter read outside its unit's forward is named with its unit", "[fully_shard][misuse]") {
  for (bool call_child : {false, true}) {
    INFO("call_child " << call_child);
    torch::manual_seed(3);
    auto model = Reader(call_child);
    const auto o = options();
    fsdp::fully_shard(model->child, o);
    fsdp::fully_shard(model, o);
    const at::Tensor x = at::randn({2, 3});
    const std::string message = error_of([&] { model(x); });
    CHECK_THAT(message, Contains("fully_shard: parameters were used in the forward while sharded") &&
                            Contains("child.scale (used with shape [0], expected [4]") &&
                            Contains("rank 0:") && Contains("rank " + std::to_string(world_size() - 1) + ":"));
    CHECK_THAT(message, Contains(call_child ? "unit 'child', read outside its forward"
                                            : "unit 'child', whose pre-forward did not run"));
    CHECK(fsdp::testing::same_on_every_rank(message));
  }
}

FSDP_RANKS_TEST_CASE("an L2 penalty over the sharded parameters fails at the end of the first backward", "[fully_shard][misuse]") {
  const int W = world_size();
  torch::manual_seed(7);
  auto model = fsdp::testing::MlpStack(4, 8, 8, 2, 2);
  torch::manual_seed(7);
  auto reference = fsdp::testing::MlpStack(4, 8, 8, 2, 2);
  const auto units = fsdp::testing::shard_stack(model, options());
  fsdp::RootContext* context = nullptr;
  torch::manual_seed(11);
  const at::Tensor x = at::randn({3, 4});
  const at::Tensor w = model->block(0)->fc1->weight;

  at::Tensor loss = model(x).pow(2).mean();
  loss = loss + 0.01 * l2_penalty(*model);  // outside any forward: sharded parameters
  context = fsdp::detail::state_of(units.back()).root_context();
  REQUIRE(context != nullptr);
  CHECK(fsdp::first_iteration_guard_active(*context));
  CHECK(torch::autograd::impl::hooks(w).size() == 1);  // the guard's gradient hook
  if (W == 1) {
    // One rank: the parameters are whole outside forward too, and the penalty's gradients are
    // correct.
    loss.backward();
    at::Tensor ref_loss = reference(x).pow(2).mean() + 0.01 * l2_penalty(*reference);
    ref_loss.backward();
    const auto ref_params = reference->named_parameters();
    for (const auto& item : model->named_parameters()) {
      INFO(item.key());
      REQUIRE(item.value().grad().defined());
      CHECK(at::allclose(item.value().grad().reshape({-1}), ref_params[item.key()].grad().reshape({-1}),
                         1e-5, 1e-6));
    }
  } else {
    const std::string message = error_of([&] { loss.backward(); });
    CHECK_THAT(message, Contains("fully_shard: in the first iteration, parameters got gradients "
                                 "from outside their unit's forward"));
    CHECK_THAT(message, Contains("'blocks.0.fc1.weight' (unit 'blocks.0': a gradient of shape [") &&
                            Contains("], expected [8, 8])"));
    CHECK_THAT(message, Contains("'in.weight' (unit '<root>': a gradient of shape [8, 4] while the "
                                 "unit was not in its backward)"));
    CHECK_THAT(message, Contains("rank 0: ") && Contains("rank " + std::to_string(W - 1) + ": "));
    CHECK_THAT(message, Contains("weight_decay") && Contains("mixed_precision"));
  }
  // The guard is gone after the first backward: no hooks, no per-step cost.
  CHECK_FALSE(fsdp::first_iteration_guard_active(*context));
  CHECK(torch::autograd::impl::hooks(w).empty());
  CHECK(unsharded_bytes(*model) == 0);

  // Training goes on (without the penalty).
  model(x).pow(2).mean().backward();
  CHECK(unsharded_bytes(*model) == 0);
  CHECK(w.grad().defined());
}

FSDP_RANKS_TEST_CASE("a correct first iteration passes the guard, which then removes itself", "[fully_shard][misuse]") {
  torch::manual_seed(7);
  auto model = fsdp::testing::MlpStack(4, 8, 8, 2, 2);
  const auto units = fsdp::testing::shard_stack(model, options());
  const at::Tensor x = at::randn({3, 4});
  // A forward without backward first: the guard waits for the first backward.
  {
    c10::NoGradGuard no_grad;
    model(x);
  }
  const fsdp::RootContext& context = *fsdp::detail::state_of(units.back()).root_context();
  CHECK(fsdp::first_iteration_guard_active(context));
  model(x).pow(2).mean().backward();
  CHECK_FALSE(fsdp::first_iteration_guard_active(context));
  for (const auto& p : model->parameters()) CHECK(torch::autograd::impl::hooks(p).empty());
  model(x).pow(2).mean().backward();
  CHECK(unsharded_bytes(*model) == 0);
}

FSDP_RANKS_TEST_CASE("module->to(dtype) after fully_shard is an error naming the parameter", "[fully_shard][misuse]") {
  torch::manual_seed(7);
  auto model = fsdp::testing::MlpStack(4, 8, 8, 2, 2);
  fsdp::testing::shard_stack(model, options());
  model->to(at::kDouble);
  const std::string message = error_of([&] { model(at::randn({2, 4}, at::kDouble)); });
  CHECK_THAT(message, Contains("fully_shard: parameter '") &&
                          Contains("' of unit '<root>' was replaced while sharded by a tensor of dtype Double"));
  CHECK_THAT(message, Contains("expected Float") && Contains("module->to(") &&
                          Contains("FullyShardOptions::mixed_precision"));
}

FSDP_RANKS_TEST_CASE("non-floating mixed-precision dtypes are refused before fully_shard changes anything", "[fully_shard][misuse]") {
  // Before its checks fully_shard moved the tied weight out of the unit below (rebuilding it),
  // broadcast rank 0's values (sync_module_states) and cast buffers: all of that must wait.
  struct Bad {
    const char* name;
    fsdp::MixedPrecision mp;
    const char* found;
  };
  const std::vector<Bad> cases = {
      {"param_dtype", fsdp::MixedPrecision().param_dtype(at::kInt).buffer_dtype(at::kHalf), "param_dtype Int"},
      {"reduce_dtype",
       fsdp::MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kLong).buffer_dtype(at::kHalf),
       "reduce_dtype Long"},
      {"buffer_dtype", fsdp::MixedPrecision().buffer_dtype(at::kInt), "buffer_dtype Int"},
  };
  const double r = fsdp::testing::rank();
  for (const auto& bad : cases) {
    INFO(bad.name);
    torch::manual_seed(5);
    auto model = fsdp::testing::Tied(4, 6);
    const at::Tensor stat = model->register_buffer("stat", at::full({4}, 1.0 + r));
    {
      torch::NoGradGuard no_grad;  // values that differ across ranks: a broadcast would change them
      for (auto& p : model->parameters()) p.add_(r);
    }
    auto enc = fsdp::fully_shard(model->enc, options());  // holds the tied weight until the root takes it
    std::vector<at::Tensor> values;
    std::vector<const void*> data;
    for (const auto& p : model->parameters()) {
      values.push_back(p.detach().clone());
      data.push_back(p.data_ptr());
    }
    const std::string message = error_of([&] {
      fsdp::fully_shard(model, options().mixed_precision(bad.mp).sync_module_states(true));
    });
    // On several ranks the outcome is agreed first ([Note: error agreement]): "fully_shard: rank R: ...".
    CHECK_THAT(message, Contains("fully_shard: ") &&
                            Contains("module '<root>' (fsdp::testing::TiedImpl): mixed precision needs floating-point "
                                     "dtypes") &&
                            Contains(bad.found));
    CHECK(fsdp::testing::same_on_every_rank(message));
    CHECK_FALSE(fsdp::fsdp_module_of(*model).has_value());
    CHECK(fsdp::contract::num_forward_pre_hooks(*model) == 0);
    CHECK(enc.manages(model->enc->weight));  // the tied weight did not move
    CHECK(stat.scalar_type() == at::kFloat);
    CHECK(stat.equal(at::full({4}, 1.0 + r)));
    const auto params = model->parameters();
    REQUIRE(params.size() == values.size());
    for (size_t i = 0; i < params.size(); ++i) {
      CHECK(params[i].data_ptr() == data[i]);
      CHECK(params[i].detach().equal(values[i]));
    }
    // The same call with valid dtypes then works.
    CHECK_NOTHROW(fsdp::fully_shard(model, options().mixed_precision(fsdp::MixedPrecision().buffer_dtype(at::kHalf))));
    CHECK(stat.scalar_type() == at::kHalf);
  }
}

FSDP_RANKS_TEST_CASE("a check that fails on one rank only refuses fully_shard on every rank", "[fully_shard][misuse]") {
  // The call communicates (a tied weight to move in, sync_module_states): the ranks agree on the
  // checks first, so the ranks whose checks passed do not wait in a collective the last skips.
  const int W = world_size();
  torch::manual_seed(5);
  auto model = fsdp::testing::Tied(4, 6);
  auto enc = fsdp::fully_shard(model->enc, options());
  const bool last = fsdp::testing::rank() == W - 1;
  const auto mp = last ? fsdp::MixedPrecision().param_dtype(at::kInt) : fsdp::MixedPrecision();
  const std::string message = error_of([&] {
    fsdp::fully_shard(model, options().mixed_precision(mp).sync_module_states(true));
  });
  CHECK_THAT(message, Contains("param_dtype Int"));
  if (W > 1) {
    // Agreed over the communicator ([Note: error agreement]): the refusing rank's error, named by
    // its rank, on every rank.
    CHECK_THAT(message, Contains("fully_shard: group rank " + std::to_string(W - 1) +
                                 ": module '<root>' (fsdp::testing::TiedImpl): mixed precision needs"));
  }
  CHECK(fsdp::testing::same_on_every_rank(message));
  CHECK_FALSE(fsdp::fsdp_module_of(*model).has_value());
  CHECK(enc.manages(model->enc->weight));
  CHECK_NOTHROW(fsdp::fully_shard(model, options().sync_module_states(true)));
}

FSDP_RANKS_TEST_CASE("a strategy and a reshard_after_forward that contradict it are refused, leaving the model as it was", "[fully_shard][misuse]") {
  using fsdp::ShardingStrategy;
  struct Bad {
    ShardingStrategy strategy;
    bool reshard_after_forward;
    const char* found;
  };
  const std::vector<Bad> cases = {
      {ShardingStrategy::kNoShard, true, "strategy NO_SHARD with reshard_after_forward(true)"},
      {ShardingStrategy::kFullShard, false, "strategy FULL_SHARD with reshard_after_forward(false)"},
      {ShardingStrategy::kShardGradOp, true, "strategy SHARD_GRAD_OP with reshard_after_forward(true)"},
  };
  const double r = fsdp::testing::rank();
  for (const auto& bad : cases) {
    INFO(bad.found);
    torch::manual_seed(5);
    auto model = fsdp::testing::Tied(4, 6);
    {
      torch::NoGradGuard no_grad;  // values that differ across ranks: a broadcast would change them
      for (auto& p : model->parameters()) p.add_(r);
    }
    auto enc = fsdp::fully_shard(model->enc, options());
    std::vector<at::Tensor> values;
    std::vector<const void*> data;
    for (const auto& p : model->parameters()) {
      values.push_back(p.detach().clone());
      data.push_back(p.data_ptr());
    }
    // Either order of the two setters.
    for (auto given : std::vector<fsdp::FullyShardOptions>{
             options().strategy(bad.strategy).reshard_after_forward(bad.reshard_after_forward),
             options().reshard_after_forward(bad.reshard_after_forward).strategy(bad.strategy)}) {
      const std::string message = error_of([&] { fsdp::fully_shard(model, given.sync_module_states(true)); });
      CHECK_THAT(message, Contains("fully_shard: module '<root>' (fsdp::testing::TiedImpl) was given ") &&
                              Contains(bad.found) && Contains("contradict each other"));
      CHECK(fsdp::testing::same_on_every_rank(message));
    }
    CHECK_FALSE(fsdp::fsdp_module_of(*model).has_value());
    CHECK(fsdp::contract::num_forward_pre_hooks(*model) == 0);
    CHECK(enc.manages(model->enc->weight));  // the tied weight did not move
    const auto params = model->parameters();
    REQUIRE(params.size() == values.size());
    for (size_t i = 0; i < params.size(); ++i) {
      CHECK(params[i].data_ptr() == data[i]);
      CHECK(params[i].detach().equal(values[i]));
    }
    // The strategy alone is accepted.
    CHECK(fsdp::fully_shard(model, options().strategy(bad.strategy)).options().strategy() == bad.strategy);
  }
}

FSDP_RANKS_TEST_CASE("reshard_after_forward alone is the shorthand for the strategy, and agrees with it when both are given", "[fully_shard][misuse]") {
  using fsdp::ShardingStrategy;
  CHECK(fsdp::FullyShardOptions().strategy() == ShardingStrategy::kFullShard);
  CHECK(fsdp::FullyShardOptions().reshard_after_forward());
  CHECK(fsdp::FullyShardOptions().reshard_after_forward(false).strategy() == ShardingStrategy::kShardGradOp);
  CHECK(fsdp::FullyShardOptions().reshard_after_forward(true).strategy() == ShardingStrategy::kFullShard);
  CHECK_FALSE(fsdp::FullyShardOptions().strategy(ShardingStrategy::kNoShard).reshard_after_forward());
  struct Agreeing {
    fsdp::FullyShardOptions given;
    ShardingStrategy strategy;
  };
  const std::vector<Agreeing> cases = {
      {options().reshard_after_forward(false), ShardingStrategy::kShardGradOp},
      {options().reshard_after_forward(true), ShardingStrategy::kFullShard},
      {options().strategy(ShardingStrategy::kFullShard).reshard_after_forward(true), ShardingStrategy::kFullShard},
      {options().strategy(ShardingStrategy::kShardGradOp).reshard_after_forward(false), ShardingStrategy::kShardGradOp},
      {options().strategy(ShardingStrategy::kNoShard).reshard_after_forward(false), ShardingStrategy::kNoShard},
  };
  for (const auto& c : cases) {
    INFO(fsdp::to_string(c.strategy));
    auto model = fsdp::testing::Tied(4, 6);
    const auto unit = fsdp::fully_shard(model, c.given);
    CHECK(unit.options().strategy() == c.strategy);
    for (const auto& h : fsdp::detail::handles_of(unit)) {
      CHECK(h->is_sharded_strategy() == (c.strategy != ShardingStrategy::kNoShard && world_size() > 1));
    }
  }
}
