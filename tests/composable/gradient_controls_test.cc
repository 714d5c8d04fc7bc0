// The per-unit gradient controls of FSDPModule, over MPI on every world size, against an
// independent reference (an unsharded copy of the model run on every rank's batches):
//   (a) set_gradient_divide_factor(f): the gradients are the sum over the data-parallel ranks
//       divided by f (the reference's average times W / f), with fp32 and bf16 reduce dtypes,
//       with and without hybrid sharding, on one rank too; the collectives are unchanged;
//       refused factors name the unit and change nothing;
//   (b) set_requires_all_reduce(false) for every micro-batch but the last under hybrid sharding
//       (every mesh of the world): the gradients equal the reference averaged over every
//       micro-batch and rank, and those of the same run with the all-reduce every time; one
//       replicate all-reduce per unit per step; gradients kept from an earlier step are not
//       all-reduced again; mixed with set_requires_gradient_sync(false); the replicate partial's
//       and the no-sync accumulator's bytes per rank in closed form; a backward that throws
//       leaves the partial as it was. Without hybrid sharding the flag changes nothing.
#include <cmath>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/comm/device_mesh.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/fully_shard_internal.h"
#include "fsdp_cpp/composable/summon_full_params.h"
#include "fsdp_cpp/contract/hookable_module_holder.h"
#include "fsdp_cpp/contract/hookable_modules.h"
#include "fsdp_cpp/tests/composable/parity.h"
#include "fsdp_cpp/tests/composable/test_models.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::comm::CollectiveKind;
using fsdp::testing::fresh_comm;
using fsdp::testing::MlpStack;
using fsdp::testing::rank;
using fsdp::testing::world;
using fsdp::testing::world_size;

using Grads = std::map<std::string, at::Tensor>;

constexpr int64_t kRows = 5;

at::Tensor batch(int64_t step, int q, int64_t cols, int salt) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(100000 * salt + 100 * step + q));
  return at::randn({kRows, cols}, gen);
}

MlpStack make_model() {
  torch::manual_seed(4321);
  return MlpStack(6, 8, 16, 3, 3);
}

at::Tensor loss_of(MlpStack& model, int64_t step, int q) {
  return torch::nn::functional::mse_loss(model(batch(step, q, 6, 1)), batch(step, q, 3, 2));
}

// The reference: the sum over every data-parallel rank q and every step in `steps` of the
// gradient of rank q's loss, on an unsharded copy (no library code).
Grads reference_sum(const std::vector<int64_t>& steps) {
  MlpStack model = make_model();
  for (int64_t step : steps) {
    for (int q = 0; q < world_size(); ++q) loss_of(model, step, q).backward();
  }
  Grads grads;
  for (const auto& item : model->named_parameters()) grads[item.key()] = item.value().grad().clone();
  return grads;
}

// The full gradients of the sharded model (summoned: all-gathered over each shard group).
Grads full_grads(const fsdp::FSDPModule& root, torch::nn::Module& model) {
  Grads grads;
  fsdp::SummonFullParams full(root, fsdp::SummonFullParamsOptions().writeback(false).with_grads(true));
  for (const auto& item : model.named_parameters()) {
    grads[item.key()] = item.value().grad().defined() ? item.value().grad().clone() : at::Tensor();
  }
  return grads;
}

void check_close(const Grads& got, const Grads& expected, double scale, double rtol, double atol) {
  REQUIRE(got.size() == expected.size());
  for (const auto& [key, e] : expected) {
    INFO("parameter " << key);
    const at::Tensor& g = got.at(key);
    REQUIRE(g.defined());
    REQUIRE(g.sizes() == e.sizes());
    CHECK(at::allclose(g.to(at::kDouble), e.to(at::kDouble) * scale, rtol, atol));
  }
}

// Replicate all-reduces of the gradients (tagged with a unit's name), not the backward-reach
// agreement each pass begins with.
struct GradientAllReduces {
  int64_t calls = 0;
  int64_t bytes = 0;
};
GradientAllReduces gradient_all_reduces(const fsdp::comm::Communicator& group) {
  GradientAllReduces n;
  for (const auto& e : group.trace()) {
    if (e.phase != fsdp::comm::TraceEvent::Phase::kIssued || e.kind != CollectiveKind::kAllReduce) continue;
    if (e.tag == "backward reach") continue;
    ++n.calls;
    n.bytes += e.bytes;
  }
  return n;
}

// The shard sizes that divide the world (every hybrid mesh, 1 x W and W x 1 included).
std::vector<int> shard_sizes() {
  std::vector<int> sizes;
  for (int s = 1; s <= world_size(); ++s) {
    if (world_size() % s == 0) sizes.push_back(s);
  }
  return sizes;
}

FSDP_RANKS_TEST_CASE("a gradient divide factor divides the sum over the data-parallel ranks by it",
                     "[gradient_controls][divide_factor]") {
  const int W = world_size();
  struct Case {
    std::optional<double> factor;
    std::optional<c10::ScalarType> reduce_dtype;
  };
  const std::vector<Case> cases = {{std::nullopt, std::nullopt}, {1.0, std::nullopt}, {3.0, std::nullopt},
                                   {2.5, std::nullopt},          {1.0, at::kBFloat16}, {8.0, at::kBFloat16},
                                   {std::nullopt, at::kBFloat16}};
  // One mesh-less run and one per hybrid mesh (a shard group of every size dividing W).
  std::vector<int> meshes = {0};
  for (int s : shard_sizes()) meshes.push_back(s);
  const Grads ref0 = reference_sum({0});
  const Grads ref01 = reference_sum({0, 1});
  for (int shard_size : meshes) {
    for (const Case& c : cases) {
      const bool bf16 = c.reduce_dtype.has_value();
      INFO(W << " ranks, " << (shard_size == 0 ? std::string("no mesh")
                                               : "mesh " + std::to_string(W / shard_size) + " x " +
                                                     std::to_string(shard_size))
             << ", factor " << (c.factor ? std::to_string(*c.factor) : "default") << ", reduce dtype "
             << (bf16 ? "bf16" : "fp32"));
      MlpStack model = make_model();
      fsdp::FullyShardOptions o;
      std::shared_ptr<fsdp::comm::DeviceMesh> mesh;
      std::vector<std::shared_ptr<fsdp::comm::Communicator>> groups;
      if (shard_size == 0) {
        o.communicator(fresh_comm());
        groups = {o.communicator()};
      } else {
        mesh = fsdp::comm::DeviceMesh::hybrid(world(), shard_size);
        o.mesh(mesh);
        groups = {mesh->shard_group(), mesh->replicate_group()};
      }
      if (bf16) o.mixed_precision(fsdp::MixedPrecision().reduce_dtype(*c.reduce_dtype));
      auto units = fsdp::testing::shard_stack(model, o);
      fsdp::FSDPModule& root = units.back();
      if (c.factor) root.set_gradient_divide_factor(*c.factor);
      for (const auto& u : units) CHECK(u.gradient_divide_factor() == c.factor);

      const double scale = static_cast<double>(W) / c.factor.value_or(static_cast<double>(W));
      const double rtol = bf16 ? 2e-2 : 1e-5;
      const double atol = bf16 ? 2e-3 * scale : 1e-6;
      // Iteration 0 (checked: fingerprints), then iteration 1 added to it (no zero_grad), whose
      // collectives are counted.
      loss_of(model, 0, rank()).backward();
      check_close(full_grads(root, *model), ref0, 1.0 / W * scale, rtol, atol);
      for (auto& g : groups) g->reset_stats();
      loss_of(model, 1, rank()).backward();
      check_close(full_grads(root, *model), ref01, 1.0 / W * scale, rtol, atol);
      // The factor changes no collective: the counts of the default rule, and each reduce-scatter
      // carries the padded FlatParameter in the reduce dtype. (Summoning all-gathers, not counted
      // here: the second summon above ran after the pass, so count reduce-scatters only.)
      const auto expected = fsdp::testing::expected_counts(units, 1);
      int64_t rs = 0, rs_bytes = 0, expected_rs_bytes = 0;
      for (const auto& g : groups) {
        rs += g->stats(CollectiveKind::kReduceScatter).calls;
        rs_bytes += g->stats(CollectiveKind::kReduceScatter).bytes;
      }
      for (const auto& u : units) {
        for (const auto& h : fsdp::detail::handles_of(u)) {
          if (h->is_sharded_strategy()) {
            expected_rs_bytes += h->layout().padded_numel * static_cast<int64_t>(c10::elementSize(h->reduce_dtype()));
          }
        }
      }
      CHECK(rs == expected.reduce_scatters);
      CHECK(rs_bytes == expected_rs_bytes);
      // Hybrid sharding: one replicate all-reduce per trainable handle, on the reduce-scatter's
      // output in the reduce dtype ([Note: asynchronous replicate all-reduce]): half the bytes of
      // the parameters' dtype with bf16.
      if (mesh && mesh->replicate_group()->size() > 1) {
        int64_t handles = 0, expected_ar_bytes = 0;
        for (const auto& u : units) {
          for (const auto& h : fsdp::detail::handles_of(u)) {
            if (!h->requires_grad()) continue;
            ++handles;
            expected_ar_bytes += h->layout().shard_numel() * static_cast<int64_t>(c10::elementSize(h->reduce_dtype()));
          }
        }
        // Plus the backward-reach agreement ([Note: backward reach]): 4 int64 per unit and 2.
        const int64_t reach_bytes = (4 * static_cast<int64_t>(units.size()) + 2) * 8;
        const auto ar = mesh->replicate_group()->stats(CollectiveKind::kAllReduce);
        CHECK(ar.calls == handles + 1);
        CHECK(ar.bytes == expected_ar_bytes + reach_bytes);
      }
    }
  }
}

FSDP_RANKS_TEST_CASE("a refused gradient divide factor names the unit and changes nothing",
                     "[gradient_controls][divide_factor]") {
  MlpStack model = make_model();
  auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
  units.back().set_gradient_divide_factor(4.0);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  for (double bad : {0.0, -2.0, inf, -inf, nan}) {
    INFO("factor " << bad);
    CHECK_THROWS_WITH(units.back().set_gradient_divide_factor(bad),
                      Contains("FSDPModule::set_gradient_divide_factor") &&
                          Contains("unit '" + units.back().fqn() + "'") && Contains("expected a finite number > 0"));
    CHECK_THROWS_WITH(units[1].set_gradient_divide_factor(bad), Contains("unit '" + units[1].fqn() + "'"));
    for (const auto& u : units) CHECK(u.gradient_divide_factor() == std::optional<double>(4.0));
  }
  // recurse = false: this unit only.
  units[1].set_gradient_divide_factor(1.0, /*recurse=*/false);
  CHECK(units[1].gradient_divide_factor() == std::optional<double>(1.0));
  CHECK(units[0].gradient_divide_factor() == std::optional<double>(4.0));
  CHECK(units.back().gradient_divide_factor() == std::optional<double>(4.0));
}

// One training step of micro-batches under hybrid sharding.
enum class Mode {
  kAllReduceEveryPass,    // the default
  kAllReduceLastPass,     // set_requires_all_reduce(false) but for the last micro-batch
  kNoSyncThenNoAllReduce  // the first micro-batch without sync, the next without all-reduce
};

const char* to_string(Mode m) {
  switch (m) {
    case Mode::kAllReduceEveryPass: return "all-reduce every pass";
    case Mode::kAllReduceLastPass: return "all-reduce in the last pass only";
    case Mode::kNoSyncThenNoAllReduce: return "no sync, then no all-reduce, then both";
  }
  return "?";
}

FSDP_RANKS_TEST_CASE("HSDP micro-batches without the replicate all-reduce train like the reference",
                     "[gradient_controls][requires_all_reduce]") {
  const int W = world_size();
  constexpr int kMicroBatches = 3;
  constexpr int kSteps = 2;  // no zero_grad between: step 1 adds to step 0's reduced gradients
  for (int shard_size : shard_sizes()) {
    const int R = W / shard_size;
    std::map<Mode, Grads> results;
    for (Mode mode : {Mode::kAllReduceEveryPass, Mode::kAllReduceLastPass, Mode::kNoSyncThenNoAllReduce}) {
      INFO(W << " ranks, mesh " << R << " x " << shard_size << ", " << to_string(mode));
      MlpStack model = make_model();
      auto mesh = fsdp::comm::DeviceMesh::hybrid(world(), shard_size);
      auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().mesh(mesh));
      fsdp::FSDPModule& root = units.back();
      const auto& replicate = *mesh->replicate_group();
      std::vector<int64_t> steps_so_far;
      for (int step = 0; step < kSteps; ++step) {
        mesh->replicate_group()->set_trace_enabled(true);  // clears the trace
        mesh->shard_group()->reset_stats();
        for (int m = 0; m < kMicroBatches; ++m) {
          const bool last = m + 1 == kMicroBatches;
          root.set_requires_gradient_sync(!(mode == Mode::kNoSyncThenNoAllReduce && m == 0));
          root.set_requires_all_reduce(mode == Mode::kAllReduceEveryPass || last);
          for (const auto& u : units) CHECK(u.requires_all_reduce() == root.requires_all_reduce());
          const int64_t micro_step = step * kMicroBatches + m;
          loss_of(model, micro_step, rank()).backward();
          steps_so_far.push_back(micro_step);

          // Memory per rank: the replicate partial is shard-sized in the parameters' dtype; the
          // no-sync accumulator is the padded unsharded FlatParameter in the reduce dtype.
          int64_t partial = 0, accumulated = 0, expected_partial = 0, expected_accumulated = 0;
          for (const auto& u : units) {
            for (const auto& h : fsdp::detail::handles_of(u)) {
              partial += static_cast<int64_t>(h->replicate_partial_grad_bytes());
              accumulated += static_cast<int64_t>(h->accumulated_grad_bytes());
              const int64_t shard_bytes = h->layout().shard_numel() * 4;
              const int64_t unsharded_bytes = h->layout().padded_numel * 4;
              const bool no_sync = mode == Mode::kNoSyncThenNoAllReduce && m == 0;
              const bool partial_kept = R > 1 && !last && (mode == Mode::kAllReduceLastPass ||
                                                           (mode == Mode::kNoSyncThenNoAllReduce && m == 1));
              expected_partial += partial_kept ? shard_bytes : 0;
              // One rank in every group: autograd accumulates into `.grad` itself (passthrough).
              expected_accumulated += no_sync && !h->passthrough() ? unsharded_bytes : 0;
            }
          }
          CHECK(partial == expected_partial);
          CHECK(accumulated == expected_accumulated);
          if (step == 1 && rank() == 0 && partial + accumulated > 0) {
            std::cout << "[gradient_controls] " << W << " ranks, mesh " << R << " x " << shard_size << ", "
                      << to_string(mode) << ", micro-batch " << m << ": replicate partial " << partial
                      << " B, no-sync accumulator " << accumulated << " B per rank (sharded gradient "
                      << root.sharded_grad_bytes() << " B for the root)" << std::endl;
          }
          if (mode == Mode::kAllReduceLastPass && !last && R > 1 && step == 0) {
            // Not in `.grad`: nothing was held before this step's passes.
            for (const auto& u : units) CHECK(u.sharded_grad_bytes() == 0);
          }
        }
        // One replicate all-reduce per unit (each has one trainable FlatParameter) per step
        // (every pass when all-reducing every pass), each the unit's shard in fp32.
        const GradientAllReduces ar = gradient_all_reduces(replicate);
        int64_t shard_bytes = 0;
        for (const auto& u : units) shard_bytes += u.sharded_grad_bytes();
        const int64_t all_reducing_passes = mode == Mode::kAllReduceEveryPass ? kMicroBatches : 1;
        CHECK(ar.calls == (R > 1 ? all_reducing_passes * static_cast<int64_t>(units.size()) : 0));
        CHECK(ar.bytes == (R > 1 ? all_reducing_passes * shard_bytes : 0));
        // Reduce-scatters inside the shard group: one per unit per synchronised pass.
        const int64_t synced_passes = mode == Mode::kNoSyncThenNoAllReduce ? kMicroBatches - 1 : kMicroBatches;
        CHECK(mesh->shard_group()->stats(CollectiveKind::kReduceScatter).calls ==
              (shard_size > 1 ? synced_passes * static_cast<int64_t>(units.size()) : 0));
        mesh->replicate_group()->set_trace_enabled(false);
        // The reference: every micro-batch so far, averaged over every rank.
        check_close(full_grads(root, *model), reference_sum(steps_so_far), 1.0 / W, 1e-5, 1e-6);
        for (const auto& u : units) {
          for (const auto& h : fsdp::detail::handles_of(u)) CHECK(h->replicate_partial_grad_bytes() == 0);
        }
      }
      results[mode] = full_grads(root, *model);
    }
    INFO(W << " ranks, mesh " << R << " x " << shard_size << ": the runs agree");
    check_close(results[Mode::kAllReduceLastPass], results[Mode::kAllReduceEveryPass], 1.0, 1e-6, 1e-7);
    check_close(results[Mode::kNoSyncThenNoAllReduce], results[Mode::kAllReduceEveryPass], 1.0, 1e-6, 1e-7);
  }
}

FSDP_RANKS_TEST_CASE("HSDP with a divide factor and micro-batches without the all-reduce divides once",
                     "[gradient_controls][requires_all_reduce][divide_factor]") {
  const int W = world_size();
  const int shard_size = W % 2 == 0 ? W / 2 : W;  // 2 x 2 on 4 ranks, 2 x 1 on 2
  MlpStack model = make_model();
  auto mesh = fsdp::comm::DeviceMesh::hybrid(world(), shard_size);
  auto units = fsdp::testing::shard_stack(
      model, fsdp::FullyShardOptions().mesh(mesh).mixed_precision(fsdp::MixedPrecision().reduce_dtype(at::kBFloat16)));
  fsdp::FSDPModule& root = units.back();
  root.set_gradient_divide_factor(1.0);
  root.set_requires_all_reduce(false);
  loss_of(model, 0, rank()).backward();
  loss_of(model, 1, rank()).backward();
  root.set_requires_all_reduce(true);
  loss_of(model, 2, rank()).backward();
  // The sum over every rank and micro-batch: divided by nothing.
  check_close(full_grads(root, *model), reference_sum({0, 1, 2}), 1.0, 2e-2, 2e-3 * W);
}

// x -> x + tanh(layer_i(x)), each layer a unit; a backward that throws when the gradient of
// layer `throw_in_backward`'s output arrives (the layers after it have reduced by then).
struct ChainImpl : torch::nn::Module {
  ChainImpl() {
    for (int i = 0; i < 4; ++i) layers.push_back(register_module("l" + std::to_string(i), fsdp::contract::Linear(6, 6)));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (int i = 0; i < static_cast<int>(layers.size()); ++i) {
      x = x + torch::tanh(layers[i](x));
      if (i == throw_in_backward) {
        x.register_hook([](const at::Tensor&) -> at::Tensor { throw std::runtime_error("injected backward failure"); });
      }
    }
    return x;
  }
  std::vector<fsdp::contract::Linear> layers;
  int throw_in_backward = -1;
};
FSDP_HOOKABLE_MODULE(Chain);

at::Tensor chain_loss(Chain& model, int64_t step, int q) {
  return torch::nn::functional::mse_loss(model(batch(step, q, 6, 3)), batch(step, q, 6, 4));
}

FSDP_RANKS_TEST_CASE("a backward that throws leaves the replicate partial as it was before it",
                     "[gradient_controls][requires_all_reduce][errors]") {
  const int W = world_size();
  const int shard_size = W % 2 == 0 && W > 2 ? W / 2 : 1;  // a replicate group of 2 or more ranks
  // The reference: micro-batches 0, 1, 2 over every rank, averaged over the ranks.
  torch::manual_seed(99);
  Chain reference;
  for (int64_t step = 0; step < 3; ++step) {
    for (int q = 0; q < W; ++q) (chain_loss(reference, step, q) / W).backward();
  }
  // The failing pass skips the all-reduce (micro-batch 1), or is the one that all-reduces
  // (micro-batch 2, after the partial was all-reduced into the gradients of layers 3 and 2).
  for (int64_t failing : {1, 2}) {
    INFO(W << " ranks, mesh " << W / shard_size << " x " << shard_size << ", micro-batch " << failing << " throws");
    torch::manual_seed(99);
    Chain model;
    auto mesh = fsdp::comm::DeviceMesh::hybrid(world(), shard_size);
    const auto o = fsdp::FullyShardOptions().mesh(mesh);
    std::vector<fsdp::FSDPModule> units;
    for (auto& layer : model->layers) units.push_back(fsdp::fully_shard(layer, o));
    units.push_back(fsdp::fully_shard(model, o));
    fsdp::FSDPModule& root = units.back();
    for (int64_t step = 0; step < 3; ++step) {
      root.set_requires_all_reduce(step == 2);
      if (step == failing) {
        model->throw_in_backward = 1;
        at::Tensor loss = chain_loss(model, step, rank());
        CHECK_THROWS_WITH(loss.backward(), Contains("injected backward failure"));
        model->throw_in_backward = -1;
      }
      chain_loss(model, step, rank()).backward();  // the retry (discards the failed pass first)
    }
    Grads got = full_grads(root, *model);
    for (const auto& item : reference->named_parameters()) {
      INFO("parameter " << item.key());
      REQUIRE(got.at(item.key()).defined());
      CHECK(at::allclose(got.at(item.key()), item.value().grad(), 1e-5, 1e-6));
    }
    for (const auto& u : units) {
      for (const auto& h : fsdp::detail::handles_of(u)) CHECK(h->replicate_partial_grad_bytes() == 0);
    }
  }
}

FSDP_RANKS_TEST_CASE("without hybrid sharding set_requires_all_reduce changes nothing",
                     "[gradient_controls][requires_all_reduce]") {
  const int W = world_size();
  MlpStack model = make_model();
  auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
  fsdp::FSDPModule& root = units.back();
  root.set_requires_all_reduce(false);
  loss_of(model, 0, rank()).backward();
  for (const auto& u : units) {
    for (const auto& h : fsdp::detail::handles_of(u)) CHECK(h->replicate_partial_grad_bytes() == 0);
  }
  check_close(full_grads(root, *model), reference_sum({0}), 1.0 / W, 1e-5, 1e-6);
  loss_of(model, 1, rank()).backward();
  check_close(full_grads(root, *model), reference_sum({0, 1}), 1.0 / W, 1e-5, 1e-6);
}

}  // namespace
