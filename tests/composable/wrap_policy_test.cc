// Auto-wrap policies and fully_shard_tree, over MPI on every world size: selections derived by
// hand (the size policy's are FSDP1's size_based_auto_wrap_policy's for the same tree), the
// transformer sharded one unit per block by type trains like an unsharded reference, size and
// union policies train under the parity harness, and refused selections change nothing.
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/fully_shard_internal.h"
#include "fsdp_cpp/composable/fully_shard_tree.h"
#include "fsdp_cpp/composable/wrap_policy.h"
#include "fsdp_cpp/contract/module_state.h"
#include "fsdp_cpp/examples/gpt_model.h"
#include "fsdp_cpp/tests/composable/parity.h"
#include "fsdp_cpp/tests/composable/test_models.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using fsdp::testing::error_of;
using fsdp::testing::rank;
using fsdp::testing::world;
using fsdp::testing::world_size;
using fsdp::WrapPolicy;

// Parameter elements (Linear(i, o) holds i*o + o):
//   a    Linear(10, 10)                          110
//   b    Nest: x Linear(10, 20)  220, y Linear(20, 10)  210, z Linear(2, 2)  6   = 436
//   c    ModuleList [Linear(10, 5)  55, Linear(5, 5)  30]                        =  85
//   attn MultiheadAttention(8, 2): in_proj 3*8*8 + 24, out_proj 8*8 + 8          = 288
//   d    Linear(4, 4)                                                               20
//   w    the root's own parameter                                                    7
//   total                                                                         946
struct NestImpl : torch::nn::Module {
  NestImpl() {
    x = register_module("x", fsdp::contract::Linear(10, 20));
    y = register_module("y", fsdp::contract::Linear(20, 10));
    z = register_module("z", fsdp::contract::Linear(2, 2));
  }
  at::Tensor forward(at::Tensor in) { return y(x(in)); }
  fsdp::contract::Linear x{nullptr}, y{nullptr}, z{nullptr};
};
FSDP_HOOKABLE_MODULE(Nest);

struct SizedImpl : torch::nn::Module {
  SizedImpl() {
    a = register_module("a", fsdp::contract::Linear(10, 10));
    b = register_module("b", Nest());
    c = register_module("c", fsdp::contract::ModuleList(fsdp::contract::Linear(10, 5), fsdp::contract::Linear(5, 5)));
    attn = register_module("attn", fsdp::contract::MultiheadAttention(8, 2));
    d = register_module("d", fsdp::contract::Linear(4, 4));
    w = register_parameter("w", at::zeros({7}));
  }
  at::Tensor forward(at::Tensor in) { return b(a(in)); }
  fsdp::contract::Linear a{nullptr}, d{nullptr};
  Nest b{nullptr};
  fsdp::contract::ModuleList c{nullptr};
  fsdp::contract::MultiheadAttention attn{nullptr};
  at::Tensor w;
};
FSDP_HOOKABLE_MODULE(Sized);

std::vector<std::string> fqns(const std::vector<fsdp::SelectedModule>& selected) {
  std::vector<std::string> out;
  for (const auto& s : selected) out.push_back(s.fqn);
  return out;
}

using Fqns = std::vector<std::string>;

}  // namespace

TEST_CASE("the size policy selects what FSDP1's size_based_auto_wrap_policy wraps", "[wrap_policy]") {
  Sized model;
  // 200: a (110) is too small to look at; b (436) is looked into: x (220) and y (210) are
  // selected, leaving 6 in b; the ModuleList (85), attention and d stay with the root.
  CHECK(fqns(fsdp::select_modules(*model, WrapPolicy::min_num_params(200))) == Fqns{"b.x", "b.y"});
  // 100: a too; attention (288) is large but a forced leaf: neither selected nor looked into.
  CHECK(fqns(fsdp::select_modules(*model, WrapPolicy::min_num_params(100))) == Fqns{"a", "b.x", "b.y"});
  // 5: every Linear (z has 6, c's two are inside a container that is never selected), but not
  // attention's out_proj, nor b (nothing left in it).
  CHECK(fqns(fsdp::select_modules(*model, WrapPolicy::min_num_params(5))) ==
        Fqns{"a", "b.x", "b.y", "b.z", "c.0", "c.1", "d"});
  // 400: b (436) as a whole (its children are below 400, so none is selected).
  CHECK(fqns(fsdp::select_modules(*model, WrapPolicy::min_num_params(400))) == Fqns{"b"});
  CHECK(fqns(fsdp::select_modules(*model, WrapPolicy::min_num_params(436))) == Fqns{"b"});
  CHECK(fqns(fsdp::select_modules(*model, WrapPolicy::min_num_params(437))).empty());
  // 0: b too (0 left in it >= 0); never attention (a leaf), the containers nor the root (946).
  CHECK(fqns(fsdp::select_modules(*model, WrapPolicy::min_num_params(0))) ==
        Fqns{"a", "b.x", "b.y", "b.z", "b", "c.0", "c.1", "d"});
  CHECK(WrapPolicy::min_num_params(200).description() == "min_num_params(200)");
  CHECK(error_of([] { WrapPolicy::min_num_params(-1); }).find("expected a number of elements >= 0, got -1") !=
        std::string::npos);
}

TEST_CASE("select_modules leaves out ignored modules and parameters", "[wrap_policy]") {
  Sized model;
  // Without b, and with a's weight (100) ignored, nothing reaches 100 (attention is a leaf).
  CHECK(fqns(fsdp::select_modules(*model, WrapPolicy::min_num_params(100), {model->a->weight}, {model->b.get()}))
            .empty());
  // Ignoring y's weight (200) leaves y with 10: only x.
  CHECK(fqns(fsdp::select_modules(*model, WrapPolicy::min_num_params(200), {model->b->y->weight}, {})) ==
        Fqns{"b.x"});
  // A type policy never selects inside an ignored module.
  CHECK(fqns(fsdp::select_modules(*model, WrapPolicy::module_types<torch::nn::LinearImpl>(), {},
                                  {model->b.get(), model->c.get()})) == Fqns{"a", "attn.out_proj", "d"});
}

TEST_CASE("type, lambda and union policies select bottom-up in module order", "[wrap_policy]") {
  Sized model;
  // By type: every Linear (attention's out_proj too: only the size policy treats it as a leaf).
  CHECK(fqns(fsdp::select_modules(*model, WrapPolicy::module_types<torch::nn::LinearImpl>())) ==
        Fqns{"a", "b.x", "b.y", "b.z", "c.0", "c.1", "attn.out_proj", "d"});
  CHECK(WrapPolicy::module_types<NestImpl>().description().find("NestImpl") != std::string::npos);
  // Everything: children before parents, containers and the root never.
  const auto all = WrapPolicy::lambda([](const torch::nn::Module&, const std::string&, int64_t) { return true; });
  CHECK(fqns(fsdp::select_modules(*model, all)) ==
        Fqns{"a", "b.x", "b.y", "b.z", "b", "c.0", "c.1", "attn.out_proj", "attn", "d"});
  // The numbers a predicate receives: the subtree minus what was selected below.
  std::vector<std::pair<std::string, int64_t>> seen;
  const auto record = WrapPolicy::lambda(
      [&seen](const torch::nn::Module&, const std::string& fqn, int64_t numel) {
        seen.emplace_back(fqn, numel);
        return fqn == "b.x";
      },
      "b.x only");
  CHECK(fqns(fsdp::select_modules(*model, record)) == Fqns{"b.x"});
  CHECK(record.description() == "b.x only");
  const std::vector<std::pair<std::string, int64_t>> expected{
      {"a", 110}, {"b.x", 220}, {"b.y", 210}, {"b.z", 6}, {"b", 216}, {"c.0", 55}, {"c.1", 30},
      {"attn.out_proj", 72}, {"attn", 288}, {"d", 20}};
  CHECK(seen == expected);
  // Union: what either selects, looking wherever either looks (FSDP1's _or_policy): the type
  // policy looks into attention, so the size policy is offered attention itself (288 >= 100).
  const auto both = WrapPolicy::module_types<NestImpl>() | WrapPolicy::min_num_params(100);
  CHECK(fqns(fsdp::select_modules(*model, both)) == Fqns{"a", "b.x", "b.y", "b", "attn"});
  CHECK(both.description().find(" | min_num_params(100)") != std::string::npos);
  const auto with_type =
      WrapPolicy::min_num_params(1000) | WrapPolicy::module_types<torch::nn::MultiheadAttentionImpl>();
  CHECK(fqns(fsdp::select_modules(*model, with_type)) == Fqns{"attn"});
}

TEST_CASE("a module reachable by several paths is selected once", "[wrap_policy]") {
  auto shared = fsdp::contract::Linear(3, 3);
  struct TwoPathsImpl : torch::nn::Module {
    explicit TwoPathsImpl(fsdp::contract::Linear l) {
      register_module("first", l);
      register_module("second", l);
    }
  };
  auto model = std::make_shared<TwoPathsImpl>(shared);
  const auto all = WrapPolicy::lambda([](const torch::nn::Module&, const std::string&, int64_t) { return true; });
  const auto selected = fsdp::select_modules(*model, all);
  REQUIRE(selected.size() == 1);
  CHECK(selected[0].fqn == "first");
  CHECK(selected[0].module.get() == shared.ptr().get());
}

namespace {

constexpr int64_t kVocab = 19;
constexpr int64_t kContext = 10;

at::Tensor tokens(int64_t step, int q, int salt) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(3000 * salt + 30 * step + q));
  return at::randint(kVocab, {3, kContext}, gen);
}

at::Tensor lm_loss(const at::Tensor& logits, const at::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), targets.reshape({-1}));
}

fsdp::examples::GPT make_gpt() {
  return fsdp::examples::GPT(
      fsdp::examples::GPTConfig(kVocab).context_length(kContext).d_model(16).n_heads(2).n_layers(3));
}

}  // namespace

FSDP_RANKS_TEST_CASE("fully_shard_tree by block type: one unit per block and the root, training parity",
                     "[wrap_policy][transformer]") {
  const int W = world_size();
  auto close = [&](const at::Tensor& a, const at::Tensor& b) {
    return W == 1 ? a.equal(b) : at::allclose(a, b, 1e-4, 1e-6);
  };
  torch::manual_seed(8);
  auto model = make_gpt();
  torch::manual_seed(8);
  auto reference = make_gpt();
  auto comm = std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
  auto units = fsdp::fully_shard_tree(model, WrapPolicy::module_types<fsdp::examples::BlockImpl>(),
                                      fsdp::FullyShardOptions().communicator(comm));
  const auto blocks = model->block_list();
  REQUIRE(units.size() == blocks.size() + 1);
  for (size_t i = 0; i < blocks.size(); ++i) CHECK(&units[i].module() == blocks[i].ptr().get());
  CHECK(&units.back().module() == model.ptr().get());
  // The root holds the rest: embeddings (with the tied output weight) and the final LayerNorm.
  std::vector<std::string> root_params;
  for (const auto& h : fsdp::detail::handles_of(units.back())) {
    for (const auto& p : h->params()) root_params.push_back(p.fqn);
  }
  CHECK(root_params == std::vector<std::string>{"tok_emb.weight", "pos_emb.weight", "ln_f.weight", "ln_f.bias"});

  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.01));
  torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.01));
  for (int64_t it = 0; it < 3; ++it) {
    comm->reset_stats();
    at::Tensor loss = lm_loss(model(tokens(it, rank(), 1)), tokens(it, rank(), 2));
    loss.backward();
    opt.step();
    opt.zero_grad();
    at::Tensor ref_loss;
    for (int q = 0; q < W; ++q) {
      at::Tensor lq = lm_loss(reference(tokens(it, q, 1)), tokens(it, q, 2));
      (lq / W).backward();
      if (q == rank()) ref_loss = lq.detach();
    }
    ref_opt.step();
    ref_opt.zero_grad();
    INFO("iteration " << it << ": loss " << loss.item<double>() << ", reference " << ref_loss.item<double>());
    CHECK(close(loss.detach(), ref_loss));
    if (it >= 1 && W > 1) {
      // FULL_SHARD: per block two all-gathers, the root one; a reduce-scatter each.
      CHECK(comm->stats(fsdp::comm::CollectiveKind::kAllGather).calls == 2 * static_cast<int64_t>(blocks.size()) + 1);
      CHECK(comm->stats(fsdp::comm::CollectiveKind::kReduceScatter).calls == static_cast<int64_t>(units.size()));
    }
  }
  for (auto& u : units) u.unshard();
  const auto ref_params = reference->named_parameters();
  for (const auto& item : model->named_parameters()) {
    INFO("parameter " << item.key());
    at::Tensor mine = item.value().detach();
    at::Tensor theirs = ref_params[item.key()].detach();
    if (item.key().find("qkv.bias") != std::string::npos) {
      // The key bias has an exactly-zero gradient (see fully_shard_transformer_test.cc): compare
      // the query and value parts.
      const int64_t d = mine.numel() / 3;
      mine = at::cat({mine.narrow(0, 0, d), mine.narrow(0, 2 * d, d)});
      theirs = at::cat({theirs.narrow(0, 0, d), theirs.narrow(0, 2 * d, d)});
    }
    CHECK(close(mine, theirs));
  }
  for (auto& u : units) u.reshard();
}

FSDP_RANKS_TEST_CASE("fully_shard_tree by size and by a union: parity on the MLP stack", "[wrap_policy]") {
  // MlpStack(6, 8, 16, 3, 3): in 56, blocks.i = fc1 144 + fc2 136, head 27 elements.
  // min_num_params(200): the three blocks (280 each; their Linears are below 200).
  auto by_size = fsdp::testing::mlp_stack_scenario("size policy");
  auto make_size = by_size.make;
  by_size.make = [make_size] {
    auto inst = make_size();
    auto module = inst.module;
    inst.shard = [module](const fsdp::FullyShardOptions& o) {
      auto units = fsdp::fully_shard_tree(*module, WrapPolicy::min_num_params(200), o);
      REQUIRE(units.size() == 4);
      return units;
    };
    return inst;
  };
  fsdp::testing::run_parity(by_size, fsdp::testing::ParityOptions());
  // min_num_params(140) | head: every fc1 (144; fc2's 136 stay with the root) and the head.
  auto by_union = fsdp::testing::mlp_stack_scenario("union policy");
  auto make_union = by_union.make;
  by_union.make = [make_union] {
    auto inst = make_union();
    auto module = inst.module;
    inst.shard = [module](const fsdp::FullyShardOptions& o) {
      const auto head = WrapPolicy::lambda(
          [](const torch::nn::Module&, const std::string& fqn, int64_t) { return fqn == "head"; }, "the head");
      auto units = fsdp::fully_shard_tree(*module, WrapPolicy::min_num_params(140) | head, o);
      const auto stack = std::dynamic_pointer_cast<fsdp::testing::MlpStackImpl>(module);
      REQUIRE(units.size() == 5);
      for (size_t i = 0; i < 3; ++i) CHECK(&units[i].module() == stack->block(i)->fc1.ptr().get());
      CHECK(&units[3].module() == stack->head.ptr().get());
      CHECK(&units[4].module() == module.get());
      return units;
    };
    return inst;
  };
  fsdp::testing::run_parity(by_union, fsdp::testing::ParityOptions());
}

FSDP_RANKS_TEST_CASE("fully_shard_tree with ignored parameters passes each unit its own", "[wrap_policy][ignored]") {
  auto model = fsdp::testing::MlpStack(6, 8, 16, 3, 3);
  auto comm = std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
  const at::Tensor ignored = model->block(1)->fc2->weight;
  auto units = fsdp::fully_shard_tree(
      model, WrapPolicy::module_types<fsdp::testing::MlpBlockImpl>(),
      fsdp::FullyShardOptions().communicator(comm).ignored_params({ignored}).ignored_modules({model->head.ptr()}));
  REQUIRE(units.size() == 4);
  CHECK(units[1].ignores(ignored));
  CHECK_FALSE(units[0].ignores(ignored));
  CHECK(units.back().ignores(ignored));
  CHECK(units.back().ignores(model->head->weight));
  CHECK(ignored.sizes() == at::IntArrayRef({8, 16}));
  CHECK(model->head->weight.sizes() == at::IntArrayRef({3, 8}));
  at::Tensor out = model(at::randn({2, 6}));
  out.sum().backward();
  CHECK(ignored.grad().sizes() == at::IntArrayRef({8, 16}));
}

namespace {

// A hook-able root with LibTorch's Sequential inside: a type policy selecting it is refused.
struct WithSequentialImpl : torch::nn::Module {
  WithSequentialImpl() {
    first = register_module("first", fsdp::contract::Linear(4, 4));
    seq = register_module("seq", torch::nn::Sequential(torch::nn::Linear(4, 4)));
  }
  at::Tensor forward(at::Tensor x) { return seq->forward(first(x)); }
  fsdp::contract::Linear first{nullptr};
  torch::nn::Sequential seq{nullptr};
};
FSDP_HOOKABLE_MODULE(WithSequential);

}  // namespace

FSDP_RANKS_TEST_CASE("fully_shard_tree refuses selections that cannot be units before any change", "[wrap_policy]") {
  auto& registry = fsdp::contract::ModuleStateRegistry::global();
  auto comm = std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
  const auto options = fsdp::FullyShardOptions().communicator(comm);
  {
    WithSequential model;
    const std::string message = error_of([&] {
      fsdp::fully_shard_tree(model, WrapPolicy::module_types<torch::nn::SequentialImpl>(), options);
    });
    INFO(message);
    CHECK(message.find("fully_shard_tree: module 'seq', selected by policy module_types<") != std::string::npos);
    CHECK(message.find("cannot be a unit: fully_shard: module") != std::string::npos);
    CHECK(message.find("torch::nn::Sequential, which cannot run forward hooks") != std::string::npos);
    CHECK_FALSE(registry.contains(*model->first, "fully_shard"));
    CHECK_FALSE(registry.contains(*model, "fully_shard"));
    CHECK(model->first->weight.sizes() == at::IntArrayRef({4, 4}));
  }
  {
    auto model = fsdp::testing::MlpStack(6, 8, 16, 3, 3);
    fsdp::fully_shard(model->block(1), options);
    const std::string message = error_of(
        [&] { fsdp::fully_shard_tree(model, WrapPolicy::module_types<fsdp::testing::MlpBlockImpl>(), options); });
    INFO(message);
    CHECK(message.find("fully_shard_tree: module 'blocks.1', selected by policy module_types<") != std::string::npos);
    CHECK(message.find("already has fully_shard applied") != std::string::npos);
    CHECK_FALSE(registry.contains(*model->block(0), "fully_shard"));
    CHECK(model->block(0)->fc1->weight.sizes() == at::IntArrayRef({16, 8}));
  }
  {
    auto model = fsdp::testing::MlpStack(6, 8, 16, 3, 3);
    const std::string message = error_of([&] {
      fsdp::fully_shard_tree(model, WrapPolicy::min_num_params(1),
                             fsdp::FullyShardOptions(options).ignored_params({at::ones({2})}));
    });
    INFO(message);
    CHECK(message.find("fully_shard_tree: ignored_params[0] is not a parameter of the root") != std::string::npos);
    CHECK_FALSE(registry.contains(*model->block(0)->fc1, "fully_shard"));
  }
  {
    // A failure after some units were made (an integer parameter in the second block) names them.
    auto model = fsdp::testing::MlpStack(6, 8, 16, 3, 3);
    model->block(1)->register_parameter("count", at::zeros({2}, at::kLong), /*requires_grad=*/false);
    const std::string message = error_of(
        [&] { fsdp::fully_shard_tree(model, WrapPolicy::module_types<fsdp::testing::MlpBlockImpl>(), options); });
    INFO(message);
    CHECK(message.find("fully_shard_tree: fully_shard on module 'blocks.1' (unit 2 of 4, policy module_types<") !=
          std::string::npos);
    CHECK(message.find("failed; the units made before it stay units (fully_shard cannot be undone): 'blocks.0'. "
                       "The error: fully_shard: module ") != std::string::npos);
    CHECK(message.find("has parameter 'count' of dtype Long") != std::string::npos);
    CHECK(registry.contains(*model->block(0), "fully_shard"));
    CHECK_FALSE(registry.contains(*model->block(1), "fully_shard"));
  }
  {
    auto model = fsdp::testing::MlpStack(6, 8, 16, 3, 3);
    fsdp::fully_shard(model->head, options);
    const std::string message = error_of([&] {
      fsdp::fully_shard_tree(model, WrapPolicy::module_types<fsdp::testing::MlpBlockImpl>(),
                             fsdp::FullyShardOptions(options).ignored_modules({model->head.ptr()}));
    });
    INFO(message);
    CHECK(message.find("fully_shard_tree: ignored_modules[0] ") != std::string::npos);
    CHECK(message.find("contains the fully_shard unit") != std::string::npos);
    CHECK_FALSE(registry.contains(*model->block(0), "fully_shard"));
  }
}
