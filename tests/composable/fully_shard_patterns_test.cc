// fully_shard under the training patterns real loops use, over MPI on every world size of the
// launch, each against an unsharded reference (same initial weights; gradients averaged over every
// rank's batch, as data parallelism gives): several forwards before one backward, a second
// backward through a retained graph, an evaluation forward with grad mode on, a unit run under
// NoGradGuard or on a detached input mid-forward, and steps whose forward or backward throws (the
// next steps must match a reference that skipped the failed one). Memory is counted in bytes by a
// counting CPU allocator: the unsharded gradients alive in backward are bounded (ZeRO-3, not all
// of the model's), and so are the units unsharded at once.
#include <algorithm>
#include <cstdio>
#include <functional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/fully_shard_internal.h"
#include "fsdp_cpp/fsdp/root_context.h"
#include "fsdp_cpp/tests/composable/test_models.h"
#include "fsdp_cpp/tools/bench/counting_allocator.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using fsdp::testing::rank;
using fsdp::testing::world;
using fsdp::testing::world_size;
using Catch::Matchers::Contains;

// x -> x + tanh(layer_i(x)) for each layer. Options per forward: layer `teacher` runs under
// NoGradGuard (a frozen teacher on the side), layer `detached` sees a detached input, a forward
// that throws after layer `throw_after`, a backward that throws at layer `throw_in_backward`.
struct ChainImpl : torch::nn::Module {
  ChainImpl(int64_t dim, int64_t depth) {
    for (int64_t i = 0; i < depth; ++i) {
      layers.push_back(register_module("l" + std::to_string(i), fsdp::contract::Linear(dim, dim)));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (int i = 0; i < static_cast<int>(layers.size()); ++i) {
      if (i == teacher) {
        at::Tensor t;
        {
          torch::NoGradGuard no_grad;
          t = layers[i](x);
        }
        x = x + torch::tanh(t);
      } else if (i == detached) {
        x = x + torch::tanh(layers[i](x.detach()));
      } else {
        x = x + torch::tanh(layers[i](x));
      }
      if (i == throw_after) throw std::runtime_error("injected forward failure");
      if (probe && x.requires_grad()) x.register_hook([p = probe](const at::Tensor&) { p(); });
      if (i == throw_in_backward) {
        x.register_hook([](const at::Tensor&) -> at::Tensor { throw std::runtime_error("injected backward failure"); });
      }
    }
    return x;
  }
  std::vector<fsdp::contract::Linear> layers;
  int teacher = -1, detached = -1, throw_after = -1, throw_in_backward = -1;
  std::function<void()> probe;  // runs in backward, as each layer's output gradient arrives
};
FSDP_HOOKABLE_MODULE(Chain);

// Units returning a view of their output, which the caller modifies in place:
// x -> tanh(u_i(x)) where u_i(x) = fc(x).t() and the caller does `.mul_(2)` on that view.
struct ViewOutImpl : torch::nn::Module {
  explicit ViewOutImpl(int64_t dim) { fc = register_module("fc", fsdp::contract::Linear(dim, dim)); }
  torch::Tensor forward(torch::Tensor x) { return fc(x).t(); }
  fsdp::contract::Linear fc{nullptr};
};
FSDP_HOOKABLE_MODULE(ViewOut);

struct ViewChainImpl : torch::nn::Module {
  ViewChainImpl(int64_t dim, int64_t depth) {
    for (int64_t i = 0; i < depth; ++i) layers.push_back(register_module("u" + std::to_string(i), ViewOut(dim)));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& layer : layers) {
      at::Tensor v = layer(x);
      v.mul_(2);  // in place on the unit's output view
      x = x + torch::tanh(v.t());
    }
    return x;
  }
  std::vector<ViewOut> layers;
};
FSDP_HOOKABLE_MODULE(ViewChain);

// Units returning a fresh tensor, which the caller modifies in place through views it takes itself
// (`out.view(...).mul_(2)`, `out.narrow(...).add_(1)`): autograd rebases the output's history onto
// CopySlices, and the unit's pre-backward hook, registered on the output's original history, must
// still run.
struct BaseOutImpl : torch::nn::Module {
  explicit BaseOutImpl(int64_t dim) { fc = register_module("fc", fsdp::contract::Linear(dim, dim)); }
  torch::Tensor forward(torch::Tensor x) { return fc(x); }
  fsdp::contract::Linear fc{nullptr};
};
FSDP_HOOKABLE_MODULE(BaseOut);

struct CallerViewChainImpl : torch::nn::Module {
  CallerViewChainImpl(int64_t dim, int64_t depth) {
    for (int64_t i = 0; i < depth; ++i) layers.push_back(register_module("u" + std::to_string(i), BaseOut(dim)));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& layer : layers) {
      at::Tensor out = layer(x);
      out.view({-1}).mul_(2);       // a view of the whole output
      out.narrow(1, 0, 2).add_(1);  // a view of part of it
      x = x + torch::tanh(out);
    }
    return x;
  }
  std::vector<BaseOut> layers;
};
FSDP_HOOKABLE_MODULE(CallerViewChain);

constexpr int64_t kDim = 8;
constexpr int64_t kDepth = 6;

at::Tensor batch(int64_t it, int q, int salt) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(1000 * salt + 10 * it + q));
  return at::randn({3, kDim}, gen);
}

template <typename Model>
at::Tensor loss_of(Model& m, int64_t it, int q, int salt = 1) {
  return torch::nn::functional::mse_loss(m(batch(it, q, salt)), batch(it, q, salt + 50));
}

template <typename Model>
std::vector<fsdp::FSDPModule> shard_chain(Model& model, fsdp::FullyShardOptions o) {
  o.communicator(std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU));
  std::vector<fsdp::FSDPModule> units;
  for (auto& layer : model->layers) units.push_back(fsdp::fully_shard(layer, o));
  units.push_back(fsdp::fully_shard(model, o));
  return units;
}

// One training step's forwards and backwards on `model`, for rank q's data, the losses scaled by
// `scale` (1 on the sharded model, 1/W on the reference, which runs every rank's step). Returns
// the loss to compare.
template <typename Model = Chain>
using Step = std::function<at::Tensor(Model& model, int64_t it, int q, double scale, bool sharded)>;

struct PatternOptions {
  int iterations = 4;
  fsdp::FullyShardOptions shard;
  // Steps expected to throw on the sharded model (the reference skips them).
  std::function<bool(int64_t)> fails;
  std::string error;  // what the failure's message must contain
};

template <typename Model = Chain>
void check_parity(const std::string& name, const std::type_identity_t<Step<Model>>& step,
                  const PatternOptions& o = {}) {
  const int W = world_size();
  INFO(name << " on " << W << " ranks");
  torch::manual_seed(77);
  Model model(kDim, kDepth);
  torch::manual_seed(77);
  Model reference(kDim, kDepth);
  auto units = shard_chain(model, o.shard);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto close = [&](const at::Tensor& a, const at::Tensor& b) {
    return W == 1 ? a.equal(b) : at::allclose(a, b, 1e-5, 1e-6);
  };
  for (int64_t it = 0; it < o.iterations; ++it) {
    if (o.fails && o.fails(it)) {
      INFO("iteration " << it << " must fail");
      CHECK_THROWS_WITH(step(model, it, rank(), 1.0, true), Contains(o.error));
      continue;  // no zero_grad: the failed step must leave no gradient behind
    }
    at::Tensor loss = step(model, it, rank(), 1.0, true);
    opt.step();
    opt.zero_grad();
    at::Tensor ref_loss;
    for (int q = 0; q < W; ++q) {
      at::Tensor l = step(reference, it, q, 1.0 / W, false);
      if (q == rank()) ref_loss = l;
    }
    ref_opt.step();
    ref_opt.zero_grad();
    INFO("iteration " << it << ": loss " << loss.item<double>() << ", reference " << ref_loss.item<double>());
    CHECK(close(loss, ref_loss));
    for (const auto& u : units) {
      for (const auto& h : fsdp::detail::handles_of(u)) CHECK(h->unsharded_bytes() == 0);
    }
  }
  for (auto& u : units) u.unshard();
  const auto ref_params = reference->named_parameters();
  for (const auto& item : model->named_parameters()) {
    INFO("parameter " << item.key());
    CHECK(close(item.value().detach(), ref_params[item.key()].detach()));
  }
  for (auto& u : units) u.reshard();
}

template <typename Model = Chain>
at::Tensor plain_step(Model& m, int64_t it, int q, double scale, bool) {
  at::Tensor loss = loss_of(m, it, q);
  (loss * scale).backward();
  return loss.detach();
}

FSDP_RANKS_TEST_CASE("two root forwards, then one backward of the summed losses", "[patterns][forwards]") {
  for (auto strategy : {fsdp::ShardingStrategy::kFullShard, fsdp::ShardingStrategy::kShardGradOp}) {
    PatternOptions o;
    o.shard.strategy(strategy);
    check_parity("two forwards", [](Chain& m, int64_t it, int q, double scale, bool) {
      at::Tensor loss = loss_of(m, it, q, 1) + loss_of(m, it, q, 2);
      (loss * scale).backward();
      return loss.detach();
    }, o);
  }
}

FSDP_RANKS_TEST_CASE("backward with retain_graph, then backward again", "[patterns][retain_graph]") {
  check_parity("retain_graph", [](Chain& m, int64_t it, int q, double scale, bool) {
    at::Tensor loss = loss_of(m, it, q);
    (loss * scale).backward({}, /*retain_graph=*/true);
    (loss * scale).backward();
    return loss.detach();
  });
}

FSDP_RANKS_TEST_CASE("an evaluation forward with grad mode on before the training forward", "[patterns][eval]") {
  check_parity("evaluation forward first", [](Chain& m, int64_t it, int q, double scale, bool) {
    m(batch(it, q, 7));  // output dropped: its graph is freed, no backward will come
    return plain_step(m, it, q, scale, true);
  });
}

FSDP_RANKS_TEST_CASE("an inference forward under NoGradGuard between forward and backward", "[patterns][eval]") {
  check_parity("inference in between", [](Chain& m, int64_t it, int q, double scale, bool) {
    at::Tensor loss = loss_of(m, it, q);
    {
      torch::NoGradGuard no_grad;
      m(batch(it, q, 9));
    }
    (loss * scale).backward();
    return loss.detach();
  });
}

FSDP_RANKS_TEST_CASE("a unit run under NoGradGuard mid-forward, and one on a detached input", "[patterns][no_grad]") {
  for (int mode = 0; mode < 2; ++mode) {
    check_parity(mode == 0 ? "teacher layer" : "detached input", [mode](Chain& m, int64_t it, int q, double scale, bool) {
      (mode == 0 ? m->teacher : m->detached) = 2;
      return plain_step(m, it, q, scale, true);
    });
  }
}

FSDP_RANKS_TEST_CASE("a forward that throws leaves no stale state", "[patterns][errors]") {
  PatternOptions o;
  o.fails = [](int64_t it) { return it == 1 || it == 2; };
  o.error = "injected forward failure";
  check_parity("forward throws", [](Chain& m, int64_t it, int q, double scale, bool sharded) {
    m->throw_after = sharded && (it == 1 || it == 2) ? 3 : -1;
    return plain_step(m, it, q, scale, sharded);
  }, o);
}

FSDP_RANKS_TEST_CASE("a backward that throws leaves no partial gradients", "[patterns][errors]") {
  PatternOptions o;
  o.fails = [](int64_t it) { return it == 1; };
  o.error = "injected backward failure";
  check_parity("backward throws", [](Chain& m, int64_t it, int q, double scale, bool sharded) {
    // Layers 4 and 5 finished their backward (and reductions) when layer 3's gradient throws.
    m->throw_in_backward = sharded && it == 1 ? 3 : -1;
    return plain_step(m, it, q, scale, sharded);
  }, o);
}

FSDP_RANKS_TEST_CASE("a unit's output view modified in place by the caller", "[patterns][views]") {
  for (auto strategy : {fsdp::ShardingStrategy::kFullShard, fsdp::ShardingStrategy::kShardGradOp}) {
    PatternOptions o;
    o.shard.strategy(strategy);
    check_parity<ViewChain>("in-place on output views", &plain_step<ViewChain>, o);
  }
}

FSDP_RANKS_TEST_CASE("a unit's output modified in place by the caller through views it takes", "[patterns][views]") {
  for (auto strategy : {fsdp::ShardingStrategy::kFullShard, fsdp::ShardingStrategy::kShardGradOp}) {
    PatternOptions o;
    o.shard.strategy(strategy);
    check_parity<CallerViewChain>("in-place through the caller's views", &plain_step<CallerViewChain>, o);
  }
}

FSDP_RANKS_TEST_CASE("a double backward (create_graph) is refused on every rank, the model stays usable", "[patterns][errors]") {
  // One rank keeps full parameters throughout (nothing is sharded): the double backward works
  // there, with parity. On more ranks it is refused and the model trains on.
  const int W = world_size();
  PatternOptions o;
  o.fails = [W](int64_t it) { return it == 1 && W > 1; };
  o.error = "create_graph";
  check_parity("gradient penalty", [W](Chain& m, int64_t it, int q, double scale, bool sharded) {
    if (it == 1 && (sharded || W == 1)) {
      at::Tensor loss = loss_of(m, it, q);
      auto grads = torch::autograd::grad({loss}, {m->layers[0]->weight}, {}, true, /*create_graph=*/true);
      ((loss + grads[0].pow(2).sum()) * scale).backward();
      return loss.detach();
    }
    return plain_step(m, it, q, scale, sharded);
  }, o);
}

// Memory: 8 equal units (Linear(256, 256)) under a parameter-free root. In backward the rise of
// live CPU bytes must stay far below the unsharded model's (all 8 units' gradients), and the
// units unsharded at once within max_unshards_in_flight.
struct MemoryRun {
  int64_t backward_rise = 0;  // peak live bytes during backward() minus live bytes before it
  int64_t peak_gradient_buffers = 0;  // unsharded gradient buffers alive at once, sampled in backward
  int peak_unsharded = 0;
};

constexpr int64_t kMemDim = 256;
constexpr int kMemDepth = 8;

MemoryRun measure(bool sharded, const fsdp::FullyShardOptions& options, int teacher = -1, int detached = -1) {
  auto& alloc = fsdp::bench::CountingAllocator::install();
  torch::manual_seed(5);
  Chain model(kMemDim, kMemDepth);
  model->teacher = teacher;
  model->detached = detached;
  std::vector<fsdp::FSDPModule> units;
  if (sharded) units = shard_chain(model, options);
  MemoryRun run;
  if (sharded) {
    model->probe = [&run, &units] {
      int64_t bytes = 0;
      for (const auto& u : units) {
        for (const auto& h : fsdp::detail::handles_of(u)) bytes += static_cast<int64_t>(h->gradient_buffer_bytes());
      }
      run.peak_gradient_buffers = std::max(run.peak_gradient_buffers, bytes);
    };
  }
  for (int it = 0; it < 3; ++it) {  // the last iteration is measured (lazy init and warm-up before)
    at::Tensor x = at::randn({2, kMemDim});
    at::Tensor loss = model(x).pow(2).mean();
    if (sharded) fsdp::detail::state_of(units.back()).root_context()->reset_peak_unsharded();
    const int64_t before = alloc.current();
    alloc.reset_peak();
    run.peak_gradient_buffers = 0;
    loss.backward();
    run.backward_rise = alloc.peak() - before;
    if (sharded) run.peak_unsharded = fsdp::detail::state_of(units.back()).root_context()->peak_unsharded();
    for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();  // zero_grad(set_to_none)
  }
  return run;
}

// One unit's padded flat gradient in bytes at world size W (the layout pads to a multiple of W
// after aligning each parameter).
int64_t units_padded_bytes(int W) {
  int64_t weight = kMemDim * kMemDim, bias = kMemDim;
  const int64_t align = 4;  // 16 bytes of fp32
  int64_t n = (weight + align - 1) / align * align + bias;
  n = (n + W - 1) / W * W;
  return n * 4;
}

FSDP_RANKS_TEST_CASE("backward keeps a bounded number of unsharded gradients alive (ZeRO-3)", "[patterns][memory]") {
  const int W = world_size();
  const int64_t unit_grad = (kMemDim * kMemDim + kMemDim) * 4;
  const int64_t all_grads = kMemDepth * unit_grad;
  const MemoryRun local = measure(false, {});
  INFO("unsharded model: backward rise " << local.backward_rise << " B; one unit's gradients " << unit_grad << " B");
  // Every unit's gradients become alive (less the few activations backward frees).
  CHECK(local.backward_rise >= all_grads - unit_grad / 2);
  for (auto prefetch : {fsdp::BackwardPrefetch::kBackwardPre, fsdp::BackwardPrefetch::kBackwardPost,
                        fsdp::BackwardPrefetch::kNone}) {
    // Plain, a unit under NoGradGuard mid-forward, a unit on a detached input mid-forward.
    for (auto [teacher, detached] : {std::pair{-1, -1}, std::pair{3, -1}, std::pair{-1, 3}}) {
      const MemoryRun run = measure(true, fsdp::FullyShardOptions().backward_prefetch(prefetch), teacher, detached);
      INFO("W=" << W << " prefetch " << static_cast<int>(prefetch) << " teacher " << teacher << " detached " << detached
                << ": backward rise " << run.backward_rise << " B = " << double(run.backward_rise) / unit_grad
                << " units; unsharded model " << double(local.backward_rise) / unit_grad << " units");
      if (fsdp::testing::rank() == 0) {  // the figures for the record (test.log)
        std::fprintf(stderr, "[memory] W=%d backward_prefetch=%d teacher=%d detached=%d: backward rise %.2f units "
                     "of gradients (%lld B); gradient buffers at once %.2f units; unsharded model %.2f units; "
                     "all gradients / W = %.2f units\n",
                     W, static_cast<int>(prefetch), teacher, detached, double(run.backward_rise) / unit_grad,
                     static_cast<long long>(run.backward_rise), double(run.peak_gradient_buffers) / unit_grad,
                     double(local.backward_rise) / unit_grad,
                     double(kMemDepth) / W);
      }
      // Unsharded gradient buffers: the unit computing its gradients and the one whose
      // reduction is in flight (plus their shard-sized reduction outputs), never more.
      const int64_t padded_unit = units_padded_bytes(W);
      CHECK(run.peak_gradient_buffers <= 2 * padded_unit + 2 * padded_unit / W);
      // One rank: autograd writes `.grad` as in local training, no buffer of the library's.
      CHECK(run.peak_gradient_buffers >= (W > 1 ? padded_unit : 0));
      if (W > 1) {
        // Everything backward adds: the new sharded gradients (1/W of all), and at most: the
        // gradient buffer being filled, autograd's gradient of the layer being computed (one unit
        // here, one parameter in general) before it is added in, the previous unit's reduction
        // input and output while its reduce-scatter is in flight, and the all-gathered
        // parameters of the units unsharded (2 with backward prefetch, 1 without).
        const int64_t unsharded_units = prefetch == fsdp::BackwardPrefetch::kNone ? 1 : 2;
        // A unit on a detached input cannot be seen finishing its backward: it keeps its
        // parameters and gradient buffer until the end of the pass (the units before it reduce
        // as usual).
        const int64_t held_to_end = detached >= 0 ? 2 : 0;
        CHECK(run.backward_rise <
              (3 + unsharded_units + held_to_end) * unit_grad + unit_grad / W + all_grads / W + 4096);
        // The unsharded model adds all 8 units' gradients; from 3 ranks on, the sharded gradients
        // and the few units in flight are less.
        if (W >= 3 && detached < 0) CHECK(run.backward_rise < local.backward_rise);
      }
      CHECK(run.peak_unsharded <= 2);
    }
  }
}

FSDP_RANKS_TEST_CASE("no more units unsharded at once than max_unshards_in_flight, with prefetch on or off", "[patterns][memory]") {
  for (int max : {1, 2, 3}) {
    for (bool forward_prefetch : {false, true}) {
      for (auto prefetch : {fsdp::BackwardPrefetch::kBackwardPre, fsdp::BackwardPrefetch::kBackwardPost,
                            fsdp::BackwardPrefetch::kNone}) {
        auto o = fsdp::FullyShardOptions().max_unshards_in_flight(max).forward_prefetch(forward_prefetch).backward_prefetch(prefetch);
        const MemoryRun run = measure(true, o);
        INFO("max " << max << ", forward prefetch " << forward_prefetch << ", backward prefetch " << static_cast<int>(prefetch));
        CHECK(run.peak_unsharded <= max);
        if (world_size() > 1) CHECK(run.peak_unsharded >= 1);
      }
    }
  }
}

}  // namespace
