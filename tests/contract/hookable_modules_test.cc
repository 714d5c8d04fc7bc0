#include "fsdp_cpp/contract/hookable_modules.h"

#include <string>
#include <vector>

#include <torch/nn/module.h>

// Catch2 last: c10/util/Logging.h defines a CHECK macro of its own, and the last definition wins.
#include <catch2/catch.hpp>

namespace {

using fsdp::contract::ForwardArgs;
using fsdp::contract::RemovableHandle;
using fsdp::contract::register_forward_hook;
using fsdp::contract::register_forward_pre_hook;

// Copies `from`'s parameters into `to` (same FQNs, same order), so outputs can be compared.
void copy_parameters(torch::nn::Module& to, const torch::nn::Module& from) {
  torch::NoGradGuard no_grad;
  auto source = from.named_parameters();
  auto target = to.named_parameters();
  REQUIRE(source.keys() == target.keys());
  for (size_t i = 0; i < source.size(); ++i) {
    target[i].value().copy_(source[i].value());
  }
}

// Counts the hook calls on one module and keeps what the post-forward hook saw.
struct HookProbe {
  explicit HookProbe(torch::nn::Module& module) {
    pre = register_forward_pre_hook(module, [this](torch::nn::Module&, ForwardArgs& args) {
      ++pre_calls;
      num_args = args.size();
    });
    post = register_forward_hook(
        module, [this](torch::nn::Module&, const ForwardArgs&, c10::IValue& output) {
          ++post_calls;
          output_seen = output;
        });
  }
  int pre_calls = 0;
  int post_calls = 0;
  size_t num_args = 0;
  c10::IValue output_seen;
  RemovableHandle pre;
  RemovableHandle post;
};

}  // namespace

TEST_CASE("Linear: same output as torch::nn::Linear, with hooks firing") {
  torch::nn::Linear plain(torch::nn::LinearOptions(4, 3));
  fsdp::contract::Linear hooked(torch::nn::LinearOptions(4, 3));
  copy_parameters(*hooked, *plain);
  HookProbe probe(*hooked);
  torch::Tensor x = torch::randn({2, 4});

  torch::Tensor y = hooked(x);
  CHECK(torch::allclose(y, plain(x)));
  CHECK(probe.pre_calls == 1);
  CHECK(probe.post_calls == 1);
  CHECK(torch::equal(probe.output_seen.toTensor(), y));
  CHECK(hooked->named_parameters().keys() == plain->named_parameters().keys());
}

TEST_CASE("Embedding: same output as torch::nn::Embedding, with hooks firing") {
  torch::nn::Embedding plain(torch::nn::EmbeddingOptions(10, 4));
  fsdp::contract::Embedding hooked(torch::nn::EmbeddingOptions(10, 4));
  copy_parameters(*hooked, *plain);
  HookProbe probe(*hooked);
  torch::Tensor ids = torch::tensor({1, 7, 3}, torch::kLong);

  torch::Tensor y = hooked(ids);
  CHECK(torch::equal(y, plain(ids)));
  CHECK(probe.pre_calls == 1);
  CHECK(probe.post_calls == 1);
}

TEST_CASE("Embedding::from_pretrained keeps the given weights") {
  torch::Tensor weights = torch::randn({5, 2});
  auto hooked = fsdp::contract::Embedding::from_pretrained(weights);
  HookProbe probe(*hooked);
  torch::Tensor ids = torch::tensor({4, 0}, torch::kLong);
  CHECK(torch::equal(hooked(ids), weights.index_select(0, ids)));
  CHECK(probe.post_calls == 1);
}

TEST_CASE("LayerNorm: same output as torch::nn::LayerNorm, with hooks firing") {
  torch::nn::LayerNorm plain(torch::nn::LayerNormOptions({4}));
  fsdp::contract::LayerNorm hooked(torch::nn::LayerNormOptions({4}));
  {
    torch::NoGradGuard no_grad;
    plain->weight.uniform_();
    plain->bias.uniform_();
  }
  copy_parameters(*hooked, *plain);
  HookProbe probe(*hooked);
  torch::Tensor x = torch::randn({3, 4});

  CHECK(torch::allclose(hooked(x), plain(x)));
  CHECK(probe.pre_calls == 1);
  CHECK(probe.post_calls == 1);
}

TEST_CASE("Conv2d: same output as torch::nn::Conv2d, with hooks firing") {
  torch::nn::Conv2d plain(torch::nn::Conv2dOptions(3, 2, 3).padding(1));
  fsdp::contract::Conv2d hooked(torch::nn::Conv2dOptions(3, 2, 3).padding(1));
  copy_parameters(*hooked, *plain);
  HookProbe probe(*hooked);
  torch::Tensor x = torch::randn({1, 3, 5, 5});

  torch::Tensor y = hooked(x);
  CHECK(y.sizes() == std::vector<int64_t>{1, 2, 5, 5});
  CHECK(torch::allclose(y, plain(x)));
  CHECK(probe.pre_calls == 1);
  CHECK(probe.post_calls == 1);
}

TEST_CASE("MultiheadAttention: same outputs as torch::nn::MultiheadAttention, hooks see a tuple") {
  torch::nn::MultiheadAttention plain(8, 2);
  fsdp::contract::MultiheadAttention hooked(8, 2);
  copy_parameters(*hooked, *plain);
  HookProbe probe(*hooked);
  torch::Tensor q = torch::randn({3, 2, 8});  // (sequence, batch, embedding)
  torch::Tensor k = torch::randn({4, 2, 8});
  torch::Tensor v = torch::randn({4, 2, 8});

  auto [out, weights] = hooked(q, k, v);
  auto [plain_out, plain_weights] = plain(q, k, v);
  CHECK(torch::allclose(out, plain_out));
  CHECK(torch::allclose(weights, plain_weights));
  CHECK(probe.num_args == 3);
  REQUIRE(probe.output_seen.isTuple());
  CHECK(probe.output_seen.toTupleRef().elements().size() == 2);

  // Optional arguments pass through the hooks too (need_weights = false).
  auto [out2, no_weights] = hooked(q, k, v, torch::Tensor(), false);
  CHECK(probe.num_args == 5);
  CHECK(torch::allclose(out2, plain_out, 1e-5, 1e-6));
  CHECK(probe.pre_calls == 2);
  CHECK(probe.post_calls == 2);
}

TEST_CASE("a post-forward hook replaces the output of a shipped holder") {
  fsdp::contract::Linear hooked(2, 2);
  register_forward_hook(
      *hooked, [](torch::nn::Module&, const ForwardArgs&, c10::IValue& output) {
        output = torch::zeros_like(output.toTensor());
      });
  CHECK(torch::equal(hooked(torch::ones({1, 2})), torch::zeros({1, 2})));
}

TEST_CASE("shipped holders register as submodules under LibTorch's FQNs") {
  struct ModelImpl : torch::nn::Module {
    ModelImpl() {
      embed = register_module("embed", fsdp::contract::Embedding(10, 4));
      norm = register_module("norm", fsdp::contract::LayerNorm(torch::nn::LayerNormOptions({4})));
      proj = register_module("proj", fsdp::contract::Linear(4, 4));
    }
    fsdp::contract::Embedding embed = nullptr;
    fsdp::contract::LayerNorm norm = nullptr;
    fsdp::contract::Linear proj = nullptr;
  };
  auto model = std::make_shared<ModelImpl>();
  CHECK(model->named_parameters().keys() ==
        std::vector<std::string>{"embed.weight", "norm.weight", "norm.bias", "proj.weight",
                                 "proj.bias"});
}

// The shipped holders run hooks; LibTorch's own holders of the same modules do not.
static_assert(fsdp::contract::HookableHolder<fsdp::contract::Linear>);
static_assert(fsdp::contract::HookableHolder<fsdp::contract::Embedding>);
static_assert(fsdp::contract::HookableHolder<fsdp::contract::LayerNorm>);
static_assert(fsdp::contract::HookableHolder<fsdp::contract::Conv2d>);
static_assert(fsdp::contract::HookableHolder<fsdp::contract::MultiheadAttention>);
static_assert(!fsdp::contract::HookableHolder<torch::nn::Linear>);
static_assert(!fsdp::contract::HookableHolder<torch::nn::Embedding>);
