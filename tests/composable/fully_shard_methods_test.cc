// Methods other than forward on fully_shard models, over MPI on every world size: called through
// fsdp::contract::call_method / call_with_hooks ([Note: hooked calls] in contract/hooked_call.h)
// they run the units' hooks (the root unsharded around the method, each child unit all-gathered
// whenever the method calls it) and give the unsharded reference model's results, with and without
// grad; afterwards every unit is resharded. A child unit's method called directly inside the
// root's call, bypassing its hooks, fails in the first iteration with fully_shard's error naming
// the unit and parameter on every rank, and so does a child's method called directly after the
// child's forward resharded it (in later iterations too, on several ranks), pointing to
// call_method; a child's method called outside its root's call is refused. Activation checkpointing on a unit recomputes the unit's method in backward through
// call_method, and refuses to rerun call_with_hooks' callable. The example GPT's generate samples
// the unsharded model's tokens.
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/nn/module.h>
#include <torch/optim/sgd.h>

#include "fsdp_cpp/composable/activation_checkpoint.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/fully_shard_internal.h"
#include "fsdp_cpp/contract/hookable_module_holder.h"
#include "fsdp_cpp/contract/hookable_modules.h"
#include "fsdp_cpp/contract/hooked_call.h"
#include "fsdp_cpp/examples/gpt_model.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::contract::call_method;
using fsdp::contract::call_with_hooks;
using fsdp::testing::error_of;
using fsdp::testing::kNoError;
using fsdp::testing::world;
using fsdp::testing::world_size;

// The child unit: tanh(fc(x)) in forward; `scaled` is another method on the same parameters.
struct BlockImpl : torch::nn::Module {
  BlockImpl() { fc = register_module("fc", fsdp::contract::Linear(8, 8)); }
  at::Tensor forward(at::Tensor x) { return at::tanh(fc(x)); }
  at::Tensor scaled(at::Tensor x, double scale) { return fc(x) * scale; }
  fsdp::contract::Linear fc{nullptr};
};
FSDP_HOOKABLE_MODULE(Block);

// Not a forward value: fully_shard's hooks see None.
struct Report {
  at::Tensor logits;
  std::string label;
};

// The root: x -> inp -> block -> out, and methods other than forward on the same parameters.
struct ModelImpl : torch::nn::Module {
  ModelImpl() {
    inp = register_module("inp", fsdp::contract::Linear(4, 8));
    block = register_module("block", Block());
    out = register_module("out", fsdp::contract::Linear(8, 3));
  }
  at::Tensor forward(at::Tensor x) { return out(block(inp(x))); }

  // Reads the root's own parameters directly and runs the child unit `rounds` times.
  at::Tensor refine(at::Tensor x, int64_t rounds) {
    at::Tensor h = at::linear(x, inp->weight, inp->bias);
    for (int64_t i = 0; i < rounds; ++i) h = block(h) + h;
    return out(h);
  }
  // Greedy decoding in miniature: the argmax class of each step, fed back as the next input.
  std::vector<int64_t> greedy(at::Tensor x, int64_t steps) {
    std::vector<int64_t> picked;
    at::Tensor h = inp(x);
    for (int64_t i = 0; i < steps; ++i) {
      h = block(h);
      picked.push_back(out(h).argmax(-1).item<int64_t>());
    }
    return picked;
  }
  // The child's method through its hooks.
  at::Tensor project(at::Tensor x) { return out(call_method(block, &BlockImpl::scaled, inp(x), 0.5)); }
  // The child's method through call_with_hooks (the callable captures `h`).
  at::Tensor project_with_callable(at::Tensor x) {
    const at::Tensor h = inp(x);
    return out(call_with_hooks(block, [&] { return block->scaled(h, 0.5); }));
  }
  // The child's method called directly: its hooks do not run (unsupported; see the misuse test).
  at::Tensor project_bypassing(at::Tensor x) { return out(block->scaled(inp(x), 0.5)); }
  // The child's forward through its hooks, then its method called directly on the resharded unit.
  at::Tensor project_after_forward(at::Tensor x) {
    const at::Tensor h = block(inp(x));
    return out(block->scaled(h, 0.5));
  }

  fsdp::contract::Linear inp{nullptr};
  Block block{nullptr};
  fsdp::contract::Linear out{nullptr};
};
FSDP_HOOKABLE_MODULE(Model);

fsdp::FullyShardOptions options() {
  return fsdp::FullyShardOptions().communicator(
      std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU));
}

// The sharded model (a unit for the block, one for the root) and its unsharded reference, with the
// same initial values on every rank.
struct Pair {
  Model model{nullptr};
  Model reference{nullptr};
};

Pair make_pair(const fsdp::FullyShardOptions& o = options(), bool checkpoint_block = false) {
  Pair p;
  torch::manual_seed(5);
  p.model = Model();
  torch::manual_seed(5);
  p.reference = Model();
  if (checkpoint_block) fsdp::checkpoint_activations(*p.model->block);
  fsdp::fully_shard(p.model->block, o);
  fsdp::fully_shard(p.model, o);
  return p;
}

// The same input on every rank.
at::Tensor input(int64_t rows = 2) {
  torch::manual_seed(17);
  return at::randn({rows, 4});
}

size_t unsharded_bytes(torch::nn::Module& model) {
  size_t total = 0;
  for (const auto& item : model.named_modules()) {
    if (auto unit = fsdp::fsdp_module_of(*item.value())) {
      for (const auto& h : fsdp::detail::handles_of(*unit)) total += h->unsharded_bytes();
    }
  }
  return total;
}

// Exact on one rank (nothing is sharded); on several the all-gathered values are the same, but
// kernels may run on other addresses.
void check_same(const at::Tensor& got, const at::Tensor& expected) {
  INFO("got " << got << "\nexpected " << expected);
  REQUIRE(got.sizes() == expected.sizes());
  if (world_size() == 1) {
    CHECK(at::equal(got, expected));
  } else {
    CHECK(at::allclose(got, expected, 1e-5, 1e-6));
  }
}

// How many explanations fully_shard added to an error.
size_t count_of_explanations(const std::string& message) {
  size_t n = 0;
  for (size_t at = message.find("fully_shard: while running unit"); at != std::string::npos;
       at = message.find("fully_shard: while running unit", at + 1)) {
    ++n;
  }
  return n;
}

// One SGD step on both models from the gradients of `loss` and `reference_loss` (every rank used
// the same input, so the averaged gradient is the reference's).
void step_both(Pair& p, const at::Tensor& loss, const at::Tensor& reference_loss) {
  torch::optim::SGD optim(p.model->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD reference_optim(p.reference->parameters(), torch::optim::SGDOptions(0.1));
  loss.backward();
  reference_loss.backward();
  CHECK(unsharded_bytes(*p.model) == 0);  // every unit resharded at the end of backward
  optim.step();
  reference_optim.step();
}

}  // namespace

FSDP_RANKS_TEST_CASE("a root's method other than forward runs with the units' hooks, with and without grad",
                     "[fully_shard][methods]") {
  for (bool grad : {false, true}) {
    INFO("grad " << grad);
    Pair p = make_pair();
    const at::Tensor x = input();
    at::Tensor y, expected;
    {
      at::AutoGradMode mode(grad);
      y = call_method(p.model, &ModelImpl::refine, x, 3);  // the block's unit gathered 3 times
      expected = p.reference->refine(x, 3);
    }
    check_same(y, expected);
    CHECK(y.requires_grad() == grad);
    if (!grad) {
      CHECK(unsharded_bytes(*p.model) == 0);  // resharded when the call returned
      // The sharded parameters are as they were: forward still agrees.
      check_same(p.model(x), p.reference(x));
      continue;
    }
    // Gradients through the method train like forward's.
    step_both(p, y.pow(2).sum(), expected.pow(2).sum());
    c10::NoGradGuard no_grad;
    check_same(call_method(p.model, &ModelImpl::refine, x, 2), p.reference->refine(x, 2));
    check_same(p.model(x), p.reference(x));
    CHECK(unsharded_bytes(*p.model) == 0);
  }
}

FSDP_RANKS_TEST_CASE("a child unit's method runs through call_method inside the root's method",
                     "[fully_shard][methods]") {
  for (bool grad : {false, true}) {
    INFO("grad " << grad);
    Pair p = make_pair();
    const at::Tensor x = input();
    at::Tensor y, expected;
    {
      at::AutoGradMode mode(grad);
      y = call_method(p.model, &ModelImpl::project, x);
      expected = p.reference->project(x);
    }
    check_same(y, expected);
    if (!grad) {
      CHECK(unsharded_bytes(*p.model) == 0);
      continue;
    }
    step_both(p, y.sum(), expected.sum());
    c10::NoGradGuard no_grad;
    check_same(call_method(p.model, &ModelImpl::project, x), p.reference->project(x));
    CHECK(unsharded_bytes(*p.model) == 0);
  }
}

FSDP_RANKS_TEST_CASE("call_with_hooks returns any type; call_method any forward value", "[fully_shard][methods]") {
  Pair p = make_pair();
  const at::Tensor x = input();
  c10::NoGradGuard no_grad;
  // A struct: the hooks see None, the caller gets it whole.
  const Report report = call_with_hooks(p.model, [&] { return Report{p.model->refine(x, 2), "refined"}; });
  check_same(report.logits, p.reference->refine(x, 2));
  CHECK(report.label == "refined");
  CHECK(unsharded_bytes(*p.model) == 0);
  // A vector of integers (a forward value, no tensor in it).
  const std::vector<int64_t> picked = call_method(p.model, &ModelImpl::greedy, input(1), 4);
  CHECK(picked == p.reference->greedy(input(1), 4));
  CHECK(unsharded_bytes(*p.model) == 0);
  // Through the module rather than its holder.
  check_same(call_method(*p.model, &ModelImpl::refine, x, 1), p.reference->refine(x, 1));
}

FSDP_RANKS_TEST_CASE("call_method passes the arguments through the hooks: mixed precision casts them",
                     "[fully_shard][methods]") {
  Pair p = make_pair(options().mixed_precision(fsdp::MixedPrecision().param_dtype(at::kBFloat16)));
  const at::Tensor x = input();
  c10::NoGradGuard no_grad;
  const at::Tensor y = call_method(p.model, &ModelImpl::refine, x, 2);  // x cast to bfloat16
  CHECK(y.scalar_type() == at::kBFloat16);
  CHECK(at::allclose(y.to(at::kFloat), p.reference->refine(x, 2), 5e-2, 5e-2));
  CHECK(unsharded_bytes(*p.model) == 0);
}

FSDP_RANKS_TEST_CASE("activation checkpointing on a unit recomputes its method in backward",
                     "[fully_shard][methods][checkpoint]") {
  Pair p = make_pair(options(), /*checkpoint_block=*/true);
  const at::Tensor x = input();
  // call_method: the checkpoint wrapper keeps the call and runs the block's method again in
  // backward.
  const at::Tensor y = call_method(p.model, &ModelImpl::project, x);
  const at::Tensor expected = p.reference->project(x);
  check_same(y, expected);
  step_both(p, y.pow(2).sum(), expected.pow(2).sum());
  {
    c10::NoGradGuard no_grad;
    check_same(call_method(p.model, &ModelImpl::project, x), p.reference->project(x));
  }
  // call_with_hooks: the callable refers to the method's frame, gone by backward; refused there on
  // every rank.
  const at::Tensor z = call_method(p.model, &ModelImpl::project_with_callable, x);
  check_same(z, p.reference->project(x));
  const std::string message = error_of([&] { z.sum().backward(); });
  CHECK_THAT(message, Contains("fsdp::contract::call_with_hooks: a forward wrapper of module 'block' (") &&
                          Contains("ran the callable again after call_with_hooks returned"));
  CHECK(fsdp::testing::same_on_every_rank(message));
  // Nothing left behind: the next call starts cleanly.
  c10::NoGradGuard no_grad;
  check_same(call_method(p.model, &ModelImpl::project, x), p.reference->project(x));
  CHECK(unsharded_bytes(*p.model) == 0);
}

FSDP_RANKS_TEST_CASE("a child unit's method called around its hooks is named in the first iteration",
                     "[fully_shard][methods][misuse]") {
  for (bool grad : {false, true}) {
    INFO("grad " << grad);
    Pair p = make_pair();
    const at::Tensor x = input();
    const at::Tensor weight = p.model->block->fc->weight;
    const std::vector<int64_t> shape_before = weight.sizes().vec();
    const std::string message = error_of([&] {
      at::AutoGradMode mode(grad);
      call_method(p.model, &ModelImpl::project_bypassing, x);
    });
    // The block's parameters are empty placeholders outside its forward (on every world size): the
    // bypassed Linear fails the same way on every rank, and the root names the unit.
    CHECK_THAT(message, Contains("fully_shard: while running unit '<root>', 1 unit(s) inside it had "
                                 "not run their pre-forward in this iteration"));
    CHECK_THAT(message, Contains("unit 'block' (") && Contains("'block.fc.weight' [8, 8] held as [0] Float"));
    CHECK(fsdp::testing::same_on_every_rank(message));
    CHECK(weight.sizes().vec() == shape_before);
    // Through call_method the model runs after the failed call.
    at::AutoGradMode mode(grad);
    check_same(call_method(p.model, &ModelImpl::project, x), p.reference->project(x));
  }
}

FSDP_RANKS_TEST_CASE("a child unit's method called directly after the unit's forward names the unit and call_method",
                     "[fully_shard][methods][misuse]") {
  for (bool grad : {false, true}) {
    INFO("grad " << grad);
    Pair p = make_pair();
    const at::Tensor x = input();
    // The first iteration: after its forward the block's parameters are empty placeholders again,
    // on every world size, so the direct call fails alike on every rank.
    std::string message = error_of([&] {
      at::AutoGradMode mode(grad);
      call_method(p.model, &ModelImpl::project_after_forward, x);
    });
    CHECK_THAT(message, Contains("fully_shard: while running unit '<root>', 1 unit(s) inside it had run their "
                                 "forward in this iteration and were resharded after it"));
    CHECK_THAT(message, Contains("unit 'block' (") && Contains("'block.fc.weight' [8, 8] held as [0] Float"));
    CHECK_THAT(message, Contains("fsdp::contract::call_method(block, &BlockImpl::generate, x)") &&
                            Contains("FSDPModule::unshard()"));
    CHECK(count_of_explanations(message) == 1);
    CHECK(fsdp::testing::same_on_every_rank(message));
    // Later iterations: the parameters are this rank's shard (1-D views) after the unit's forward.
    for (int step = 0; step < 2; ++step) p.model(x).sum().backward();
    message = error_of([&] {
      at::AutoGradMode mode(grad);
      call_method(p.model, &ModelImpl::project_after_forward, x);
    });
    if (world_size() == 1) {
      // One rank: the sharded form is the full parameter; the call computes correctly.
      CHECK(message == kNoError);
    } else {
      CHECK_THAT(message, Contains("1 unit(s) inside it had run their forward in this iteration and were resharded "
                                   "after it") &&
                              Contains("unit 'block' (") && Contains("'block.fc.weight' [8, 8] held as [") &&
                              Contains("fsdp::contract::call_method"));
    }
    // Through call_method the model runs after the failed calls.
    c10::NoGradGuard no_grad;
    CHECK(call_method(p.model, &ModelImpl::project, x).sizes() == at::IntArrayRef({2, 3}));
    CHECK(unsharded_bytes(*p.model) == 0);
  }
}

FSDP_RANKS_TEST_CASE("a child unit's method called outside its root's call is refused", "[fully_shard][methods][misuse]") {
  Pair p = make_pair();
  const at::Tensor h = at::ones({2, 8});
  c10::NoGradGuard no_grad;
  // Before the root's first call, which initialises every unit inside it.
  std::string message = error_of([&] { call_method(p.model->block, &BlockImpl::scaled, h, 0.5); });
  CHECK_THAT(message, Contains("fully_shard: module 'block' (") && Contains("ran its forward before its root"));
  CHECK(fsdp::testing::same_on_every_rank(message));
  check_same(call_method(p.model, &ModelImpl::refine, input(), 1), p.reference->refine(input(), 1));
  // After it.
  message = error_of([&] { call_method(p.model->block, &BlockImpl::scaled, h, 0.5); });
  CHECK_THAT(message, Contains("fully_shard: module 'block' (") &&
                          Contains("ran its forward outside a forward of its root; call the root module"));
  CHECK(fsdp::testing::same_on_every_rank(message));
  check_same(call_method(p.model, &ModelImpl::project, input()), p.reference->project(input()));
  CHECK(unsharded_bytes(*p.model) == 0);
}

FSDP_RANKS_TEST_CASE("the example GPT generates through its root's hooks as the unsharded model does",
                     "[fully_shard][methods][gpt]") {
  using fsdp::examples::GPT;
  using fsdp::examples::GPTImpl;
  const auto config = fsdp::examples::GPTConfig(11).context_length(8).d_model(16).n_heads(2).n_layers(2);
  torch::manual_seed(3);
  GPT model(config);
  torch::manual_seed(3);
  GPT reference(config);
  const auto o = options();
  for (auto& block : model->block_list()) fsdp::fully_shard(block, o);
  fsdp::fully_shard(model, o);
  const at::Tensor prompt = at::arange(1, 4, at::kLong).unsqueeze(0);
  // 12 new tokens: past the context length, the window slides. Greedy, then sampled with a seed.
  for (double temperature : {0.0, 1.0}) {
    INFO("temperature " << temperature);
    const at::Tensor tokens = call_method(model, &GPTImpl::generate, prompt, 12, temperature, 7);
    CHECK(tokens.sizes() == at::IntArrayRef({1, 15}));
    CHECK(at::equal(tokens, reference->generate(prompt, 12, temperature, 7)));
    CHECK(unsharded_bytes(*model) == 0);  // generate runs without gradients: resharded at once
  }
}
