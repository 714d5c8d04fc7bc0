// Quantized communication (FullyShardOptions::all_gather_codec / reduce_codec, DeepSpeed ZeRO++'s
// qwZ and qgZ) over MPI on every world size, against an independent reference (an unsharded copy
// of the model run on every rank's batch) and the closed forms of [Note: int8 block codec] and
// [Note: quantized gradient reduction]:
//   (a) gradients reduced through int8_block_codec are within the documented bound of the
//       reference average, element by element (the bound computed here from the reference's
//       per-rank gradients laid out as the FlatParameters are, in blocks aligned to the
//       parameters, with stochastic rounding's absmax / 127): FULL_SHARD and SHARD_GRAD_OP,
//       every hybrid mesh, float32 and bfloat16 reduce dtypes and scales, a divide factor,
//       accumulation without sync; the shard group issues all-to-alls of W x encoded bytes
//       instead of reduce-scatters, the replicate all-reduce is unchanged; one rank (or a shard
//       group of one) communicates nothing encoded and is exact;
//   (b) a user-defined codec (float16, written here) plugs into the same extension point;
//   (c) ranks that disagree on a codec fail on every rank naming the unit; NO_SHARD with a codec
//       is refused naming the unit.
#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/comm/device_mesh.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/fully_shard_internal.h"
#include "fsdp_cpp/composable/summon_full_params.h"
#include "fsdp_cpp/fsdp/comm_codec.h"
#include "fsdp_cpp/tests/composable/parity.h"
#include "fsdp_cpp/tests/composable/test_models.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::comm::CollectiveKind;
using fsdp::testing::MlpStack;
using fsdp::testing::rank;
using fsdp::testing::world;
using fsdp::testing::world_size;

using Grads = std::map<std::string, at::Tensor>;

constexpr int64_t kRows = 5;
constexpr int64_t kBlock = 16;  // small blocks: many per FlatParameter, and uneven last blocks

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

// Rank q's gradients summed over `steps`, on an unsharded copy (no library code), in float64.
Grads reference_grads(const std::vector<int64_t>& steps, int q) {
  MlpStack model = make_model();
  for (int64_t step : steps) loss_of(model, step, q).backward();
  Grads grads;
  for (const auto& item : model->named_parameters()) grads[item.key()] = item.value().grad().to(at::kDouble);
  return grads;
}

// The full gradients of the sharded model (summoned: all-gathered unencoded over each shard group).
Grads full_grads(const fsdp::FSDPModule& root, torch::nn::Module& model) {
  Grads grads;
  fsdp::SummonFullParams full(root, fsdp::SummonFullParamsOptions().writeback(false).with_grads(true));
  for (const auto& item : model.named_parameters()) {
    grads[item.key()] = item.value().grad().defined() ? item.value().grad().to(at::kDouble) : at::Tensor();
  }
  return grads;
}

std::shared_ptr<fsdp::comm::Communicator> fresh_comm() {
  return std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
}

std::vector<int> shard_sizes() {
  std::vector<int> sizes;
  for (int s = 1; s <= world_size(); ++s) {
    if (world_size() % s == 0) sizes.push_back(s);
  }
  return sizes;
}

// The key (FQN relative to the model) of every parameter, by tensor identity.
std::unordered_map<const void*, std::string> keys_of(torch::nn::Module& model) {
  std::unordered_map<const void*, std::string> keys;
  for (const auto& item : model.named_parameters()) keys[item.value().unsafeGetTensorImpl()] = item.key();
  return keys;
}

// absmax of each element's block, blocks of `block` from the start of each of `chunks` rows (the
// all-gather: no row layout).
at::Tensor block_absmax(const at::Tensor& flat, int64_t chunks, int64_t block) {
  const int64_t n = flat.numel() / chunks, blocks = (n + block - 1) / block;
  at::Tensor padded = at::zeros({chunks, blocks * block}, at::kDouble);
  padded.narrow(1, 0, n).copy_(flat.view({chunks, n}).abs());
  return padded.view({chunks, blocks, block}).amax(2).repeat_interleave(block, 1).narrow(1, 0, n).reshape({-1});
}

// absmax of each element's block in a row layout ([Note: int8 block codec]): in each of `chunks`
// rows, blocks of `block` from the row's start and from each of `starts` inside the row (the
// parameters' offsets), so that no block spans two parameters.
at::Tensor aligned_block_absmax(const at::Tensor& flat, int64_t chunks, int64_t block, const std::vector<int64_t>& starts) {
  const int64_t n = flat.numel() / chunks;
  at::Tensor out = at::zeros({flat.numel()}, at::kDouble);
  for (int64_t r = 0; r < chunks; ++r) {
    std::vector<int64_t> cuts = {r * n};
    for (int64_t s : starts) {
      if (s > cuts.back() && s < (r + 1) * n) cuts.push_back(s);
    }
    cuts.push_back((r + 1) * n);
    for (size_t i = 0; i + 1 < cuts.size(); ++i) {
      for (int64_t b = cuts[i]; b < cuts[i + 1]; b += block) {
        const int64_t len = std::min(block, cuts[i + 1] - b);
        out.narrow(0, b, len).fill_(flat.narrow(0, b, len).abs().max().item<double>());
      }
    }
  }
  return out;
}

// The documented bound per element of the reduced gradient ([Note: quantized gradient
// reduction]): (1 / divisor) x sum over ranks q of absmax_q(block) / 127 (stochastic rounding:
// less than one step of the block's scale), absmax_q over rank q's padded flat gradient chunked
// as the shard group's shards in blocks aligned to the parameters, with bfloat16 scales at most
// 2^-7 larger; a bfloat16 reduce dtype adds the rounding of each rank's gradient to it (2^-8, on
// the values and on absmax). Returned per parameter key, in the parameter's shape.
Grads gradient_bound(const std::vector<fsdp::FSDPModule>& units, torch::nn::Module& model,
                     const std::vector<Grads>& per_rank, double divisor, bool bf16_scales, bool bf16_reduce) {
  const auto keys = keys_of(model);
  Grads bound;
  for (const auto& u : units) {
    for (const auto& h : fsdp::detail::handles_of(u)) {
      if (!h->requires_grad()) continue;
      const auto& layout = h->layout();
      const int64_t shards = layout.world_size;
      at::Tensor sum = at::zeros({layout.padded_numel}, at::kDouble);
      for (const Grads& g : per_rank) {
        at::Tensor flat = at::zeros({layout.padded_numel}, at::kDouble);
        for (size_t i = 0; i < layout.entries.size(); ++i) {
          const auto& e = layout.entries[i];
          flat.narrow(0, e.offset, e.numel).copy_(g.at(keys.at(h->params()[i].param.unsafeGetTensorImpl())).reshape({-1}));
        }
        std::vector<int64_t> starts;
        for (const auto& e : layout.entries) starts.push_back(e.offset);
        at::Tensor absmax = aligned_block_absmax(flat, shards, kBlock, starts);
        if (bf16_reduce) absmax = absmax * (1 + std::ldexp(1.0, -8));
        at::Tensor term = absmax / 127.0 * (bf16_scales ? 1 + std::ldexp(1.0, -7) : 1.0);
        if (bf16_reduce) term = term + flat.abs() * std::ldexp(1.0, -8);
        sum += term;
      }
      sum /= divisor;
      for (size_t i = 0; i < layout.entries.size(); ++i) {
        const auto& e = layout.entries[i];
        bound[keys.at(h->params()[i].param.unsafeGetTensorImpl())] =
            sum.narrow(0, e.offset, e.numel).view(e.shape).clone();
      }
    }
  }
  return bound;
}

// |got - expected| <= bound + float32 rounding, element by element; returns the largest error.
double check_within(const Grads& got, const Grads& expected, const Grads& bound) {
  double largest = 0;
  REQUIRE(got.size() == expected.size());
  for (const auto& [key, e] : expected) {
    INFO("parameter " << key);
    const at::Tensor& g = got.at(key);
    REQUIRE(g.defined());
    const at::Tensor error = (g - e).abs();
    const at::Tensor allowed = bound.at(key) + e.abs() * 1e-5 + 1e-7;
    const bool within = error.le(allowed).all().item<bool>();
    if (!within) {
      UNSCOPED_INFO("largest excess " << (error - allowed).max().item<double>() << ", error " << error.max().item<double>());
    }
    CHECK(within);
    largest = std::max(largest, error.max().item<double>());
  }
  return largest;
}

// W x the bytes of each trainable sharded handle's row layout ([Note: codec row layouts]): its
// shards, a tensor start at each parameter's offset.
int64_t encoded_reduction_bytes(const std::vector<fsdp::FSDPModule>& units, const fsdp::CommCodec& codec) {
  int64_t bytes = 0;
  for (const auto& u : units) {
    for (const auto& h : fsdp::detail::handles_of(u)) {
      if (h->requires_grad() && h->layout().world_size > 1) {
        fsdp::CodecRowLayout rows;
        rows.numel = h->layout().shard_numel();
        rows.shards = h->layout().world_size;
        for (const auto& e : h->layout().entries) rows.tensor_starts.push_back(e.offset);
        bytes += h->layout().world_size * codec.encoded_bytes_with_layout(rows);
      }
    }
  }
  return bytes;
}

FSDP_RANKS_TEST_CASE("gradients reduced in int8 are within the documented bound of the reference",
                     "[quantized_comm][reduce_codec]") {
  const int W = world_size();
  struct Case {
    fsdp::ShardingStrategy strategy;
    bool bf16_scales;
    bool bf16_reduce;
    std::optional<double> factor;
    bool no_sync_first;  // micro-batch 0 without sync, 1 with: one reduction of both
  };
  const std::vector<Case> cases = {
      {fsdp::ShardingStrategy::kFullShard, false, false, std::nullopt, false},
      {fsdp::ShardingStrategy::kShardGradOp, true, false, std::nullopt, false},
      {fsdp::ShardingStrategy::kFullShard, false, true, std::nullopt, false},
      {fsdp::ShardingStrategy::kFullShard, true, false, 2.0, false},
      {fsdp::ShardingStrategy::kShardGradOp, false, false, std::nullopt, true},
  };
  std::vector<int> meshes = {0};  // no mesh, then every hybrid mesh
  for (int s : shard_sizes()) meshes.push_back(s);
  std::vector<Grads> per_rank_0, per_rank_01;
  for (int q = 0; q < W; ++q) {
    per_rank_0.push_back(reference_grads({0}, q));
    per_rank_01.push_back(reference_grads({0, 1}, q));
  }
  for (int shard_size : meshes) {
    for (const Case& c : cases) {
      const int S = shard_size == 0 ? W : shard_size;
      INFO(W << " ranks, " << (shard_size == 0 ? std::string("no mesh") : "mesh " + std::to_string(W / S) + " x " +
                                                                              std::to_string(S))
             << ", " << fsdp::to_string(c.strategy) << ", " << (c.bf16_scales ? "bf16" : "fp32") << " scales, reduce "
             << (c.bf16_reduce ? "bf16" : "fp32") << ", factor " << c.factor.value_or(0) << ", no-sync first "
             << c.no_sync_first);
      auto codec = fsdp::int8_block_codec(kBlock, c.bf16_scales ? at::kBFloat16 : at::kFloat);
      MlpStack model = make_model();
      fsdp::FullyShardOptions o;
      o.strategy(c.strategy).reduce_codec(codec);
      std::shared_ptr<fsdp::comm::DeviceMesh> mesh;
      std::shared_ptr<fsdp::comm::Communicator> shard_group;
      if (shard_size == 0) {
        shard_group = fresh_comm();
        o.communicator(shard_group);
      } else {
        mesh = fsdp::comm::DeviceMesh::hybrid(world(), shard_size);
        o.mesh(mesh);
        shard_group = mesh->shard_group();
      }
      if (c.bf16_reduce) o.mixed_precision(fsdp::MixedPrecision().reduce_dtype(at::kBFloat16));
      auto units = fsdp::testing::shard_stack(model, o);
      fsdp::FSDPModule& root = units.back();
      if (c.factor) root.set_gradient_divide_factor(*c.factor);
      shard_group->reset_stats();
      if (mesh) mesh->replicate_group()->set_trace_enabled(true);  // clears it
      if (c.no_sync_first) {
        root.set_requires_gradient_sync(false);
        loss_of(model, 0, rank()).backward();
        root.set_requires_gradient_sync(true);
        loss_of(model, 1, rank()).backward();
      } else {
        loss_of(model, 0, rank()).backward();
      }
      const int64_t all_to_all = shard_group->stats(CollectiveKind::kAllToAll).calls;
      const int64_t all_to_all_bytes = shard_group->stats(CollectiveKind::kAllToAll).bytes;
      const int64_t reduce_scatters = shard_group->stats(CollectiveKind::kReduceScatter).calls;

      const std::vector<Grads>& per_rank = c.no_sync_first ? per_rank_01 : per_rank_0;
      const double divisor = c.factor.value_or(static_cast<double>(W));
      Grads expected;
      for (const auto& [key, g] : per_rank[0]) {
        at::Tensor sum = at::zeros_like(g);
        for (const Grads& r : per_rank) sum += r.at(key);
        expected[key] = sum / divisor;
      }
      const Grads bound = gradient_bound(units, *model, per_rank, divisor, c.bf16_scales, c.bf16_reduce);
      const double largest = check_within(full_grads(root, *model), expected, bound);

      // One all-to-all of W x encoded bytes per unit and synchronised pass inside a shard group of
      // several ranks, no reduce-scatter; nothing encoded in a shard group of one (exact then).
      const int64_t n_units = static_cast<int64_t>(units.size());
      if (S > 1) {
        CHECK(all_to_all == n_units);
        CHECK(all_to_all_bytes == encoded_reduction_bytes(units, *codec));
        CHECK(reduce_scatters == 0);
        CHECK(largest > 0);  // quantized: not the reference bit for bit
      } else {
        CHECK(all_to_all == 0);
        CHECK(reduce_scatters == 0);
        if (!c.bf16_reduce) CHECK(largest <= 1e-5);  // float32 rounding only
      }
      if (mesh && W / S > 1) {  // the replicate all-reduce: one per unit, the unit's shard, unencoded
        // (in the parameters' dtype, or in the reduce dtype when the engine all-reduces before
        // casting: either way shard_numel elements, not encoded bytes)
        int64_t shard_bytes = 0, shard_bytes_reduce_dtype = 0, calls = 0, bytes = 0;
        for (const auto& u : units) {
          shard_bytes += u.sharded_grad_bytes();
          for (const auto& h : fsdp::detail::handles_of(u)) {
            shard_bytes_reduce_dtype +=
                h->layout().shard_numel() * static_cast<int64_t>(c10::elementSize(h->reduce_dtype()));
          }
        }
        for (const auto& e : mesh->replicate_group()->trace()) {
          if (e.phase != fsdp::comm::TraceEvent::Phase::kIssued || e.kind != CollectiveKind::kAllReduce ||
              e.tag == "backward reach") {
            continue;
          }
          ++calls;
          bytes += e.bytes;
        }
        CHECK(calls == n_units);
        CHECK((bytes == shard_bytes || bytes == shard_bytes_reduce_dtype));
      }
      if (rank() == 0 && c.strategy == fsdp::ShardingStrategy::kFullShard && !c.factor && !c.bf16_reduce &&
          !c.bf16_scales) {
        std::cout << "[quantized_comm] " << W << " ranks, shard group " << S << ": gradient all-to-all "
                  << all_to_all_bytes << " B per step (reduce-scatter would carry "
                  << [&] {
                       int64_t b = 0;
                       for (const auto& u : units)
                         for (const auto& h : fsdp::detail::handles_of(u)) b += S > 1 ? h->layout().padded_numel * 4 : 0;
                       return b;
                     }()
                  << " B), largest gradient error " << largest << std::endl;
      }
    }
  }
}

// The reference's full parameters (float64), by key.
Grads reference_params() {
  MlpStack model = make_model();
  Grads params;
  for (const auto& item : model->named_parameters()) params[item.key()] = item.value().detach().to(at::kDouble);
  return params;
}

// The documented bound per element of an unsharded parameter gathered through int8_block_codec
// ([Note: int8 block codec]): absmax(block) / 254 over each rank's shard of the padded
// FlatParameter (bfloat16 scales: at most 2^-7 larger); a bfloat16 compute dtype adds the rounding
// of the shard to it and of the decoded value (2^-8 each).
Grads parameter_bound(const std::vector<fsdp::FSDPModule>& units, torch::nn::Module& model, const Grads& full,
                      bool bf16_scales, bool bf16_compute) {
  const auto keys = keys_of(model);
  Grads bound;
  const double u = std::ldexp(1.0, -8);
  for (const auto& unit : units) {
    for (const auto& h : fsdp::detail::handles_of(unit)) {
      const auto& layout = h->layout();
      at::Tensor flat = at::zeros({layout.padded_numel}, at::kDouble);
      for (size_t i = 0; i < layout.entries.size(); ++i) {
        const auto& e = layout.entries[i];
        flat.narrow(0, e.offset, e.numel).copy_(full.at(keys.at(h->params()[i].param.unsafeGetTensorImpl())).reshape({-1}));
      }
      at::Tensor absmax = block_absmax(flat, layout.world_size, kBlock) * (bf16_compute ? 1 + u : 1.0);
      at::Tensor b = absmax / 254.0 * (bf16_scales ? 1 + std::ldexp(1.0, -7) : 1.0);
      if (bf16_compute) b = b + flat.abs() * u + (flat.abs() + b) * u;
      for (size_t i = 0; i < layout.entries.size(); ++i) {
        const auto& e = layout.entries[i];
        bound[keys.at(h->params()[i].param.unsafeGetTensorImpl())] = b.narrow(0, e.offset, e.numel).view(e.shape).clone();
      }
    }
  }
  return bound;
}

int64_t encoded_gather_bytes(const fsdp::FSDPModule& unit, const fsdp::CommCodec& codec) {
  int64_t bytes = 0;
  for (const auto& h : fsdp::detail::handles_of(unit)) {
    if (h->layout().world_size > 1) bytes += h->layout().world_size * codec.encoded_bytes(h->layout().shard_numel());
  }
  return bytes;
}

FSDP_RANKS_TEST_CASE("parameters all-gathered in int8 are within the documented bound of the full values",
                     "[quantized_comm][all_gather_codec]") {
  const int W = world_size();
  const Grads full = reference_params();
  struct Case {
    bool bf16_scales;
    bool bf16_compute;  // mixed precision: param_dtype bf16 (the shard cast, then encoded)
    bool offload;
  };
  std::vector<int> meshes = {0};
  for (int s : shard_sizes()) meshes.push_back(s);
  for (int shard_size : meshes) {
    for (const Case& c : {Case{false, false, false}, Case{true, false, true}, Case{false, true, false}}) {
      const int S = shard_size == 0 ? W : shard_size;
      INFO(W << " ranks, shard group " << S << (shard_size == 0 ? " (no mesh)" : " (mesh)") << ", "
             << (c.bf16_scales ? "bf16" : "fp32") << " scales, compute " << (c.bf16_compute ? "bf16" : "fp32")
             << (c.offload ? ", CPU offload" : ""));
      auto codec = fsdp::int8_block_codec(kBlock, c.bf16_scales ? at::kBFloat16 : at::kFloat);
      MlpStack model = make_model();
      fsdp::FullyShardOptions o;
      o.all_gather_codec(codec).offload_to_cpu(c.offload);
      std::shared_ptr<fsdp::comm::Communicator> shard_group;
      if (shard_size == 0) {
        shard_group = fresh_comm();
        o.communicator(shard_group);
      } else {
        auto mesh = fsdp::comm::DeviceMesh::hybrid(world(), shard_size);
        o.mesh(mesh);
        shard_group = mesh->shard_group();
      }
      if (c.bf16_compute) o.mixed_precision(fsdp::MixedPrecision().param_dtype(at::kBFloat16));
      auto units = fsdp::testing::shard_stack(model, o);
      const Grads bound = parameter_bound(units, *model, full, c.bf16_scales, c.bf16_compute);
      const auto keys = keys_of(*model);
      double largest = 0;
      for (auto& unit : units) {
        shard_group->reset_stats();
        unit.unshard();
        // One all-gather of W x encoded bytes (the output), or nothing in a shard group of one.
        CHECK(shard_group->stats(CollectiveKind::kAllGather).calls == (S > 1 ? 1 : 0));
        CHECK(shard_group->stats(CollectiveKind::kAllGather).bytes == encoded_gather_bytes(unit, *codec));
        for (const auto& h : fsdp::detail::handles_of(unit)) {
          for (const auto& p : h->params()) {
            const std::string& key = keys.at(p.param.unsafeGetTensorImpl());
            INFO("parameter " << key);
            REQUIRE(p.param.sizes() == full.at(key).sizes());
            CHECK(p.param.scalar_type() == (c.bf16_compute ? at::kBFloat16 : at::kFloat));
            const at::Tensor error = (p.param.detach().to(at::kDouble) - full.at(key)).abs();
            CHECK(error.le(bound.at(key) + full.at(key).abs() * 1e-6 + 1e-8).all().item<bool>());
            largest = std::max(largest, error.max().item<double>());
          }
        }
        unit.reshard();
      }
      if (S > 1) {
        CHECK(largest > 0);  // quantized
      } else if (!c.bf16_compute) {
        CHECK(largest == 0);  // nothing gathered: the shard itself
      }
      // The shards themselves are untouched (state dicts and the optimizer see full precision).
      fsdp::SummonFullParams summoned(units.back(), fsdp::SummonFullParamsOptions().writeback(false));
      for (const auto& item : model->named_parameters()) {
        INFO("summoned " << item.key());
        CHECK(item.value().detach().to(at::kDouble).equal(full.at(item.key())));
      }
    }
  }
}

// One training step's loss on every rank's batch, and the reference's, over `steps` steps of SGD.
struct Curves {
  std::vector<double> sharded, reference;
};

Curves train(const fsdp::FullyShardOptions& options, int steps, std::vector<fsdp::FSDPModule>* units_out = nullptr,
             std::function<void(int)> after_step = nullptr) {
  const int W = world_size();
  MlpStack reference = make_model();
  MlpStack model = make_model();
  auto units = fsdp::testing::shard_stack(model, options);
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  Curves c;
  for (int step = 0; step < steps; ++step) {
    // The reference: every rank's batch, gradients averaged, the loss averaged.
    double ref_loss = 0;
    ref_opt.zero_grad();
    for (int q = 0; q < W; ++q) {
      at::Tensor l = loss_of(reference, step, q) / W;
      l.backward();
      ref_loss += l.item<double>();
    }
    ref_opt.step();
    opt.zero_grad();
    at::Tensor loss = loss_of(model, step, rank());
    loss.backward();
    opt.step();
    at::Tensor mean = loss.detach().clone();
    world().all_reduce(mean).wait();
    c.sharded.push_back(mean.item<double>() / W);
    c.reference.push_back(ref_loss);
    if (after_step) after_step(step);
  }
  if (units_out) *units_out = units;
  return c;
}

FSDP_RANKS_TEST_CASE("training with both codecs stays within 1% of the reference loss",
                     "[quantized_comm][training]") {
  const int W = world_size();
  constexpr int kSteps = 8;
  // Parity tolerance for this model (documented in docs/quantized_communication.md): the
  // mean loss over the ranks within 1% of the reference's at every step.
  constexpr double kRelativeTolerance = 0.01;
  auto codec = fsdp::int8_block_codec(kBlock);
  for (auto strategy : {fsdp::ShardingStrategy::kFullShard, fsdp::ShardingStrategy::kShardGradOp}) {
    for (bool bf16 : {false, true}) {
      for (int shard_size : shard_sizes()) {
        INFO(W << " ranks, " << fsdp::to_string(strategy) << (bf16 ? ", bf16 compute" : "") << ", shard group "
               << shard_size);
        fsdp::FullyShardOptions o;
        o.strategy(strategy).all_gather_codec(codec).reduce_codec(codec);
        std::shared_ptr<fsdp::comm::Communicator> shard_group;
        if (shard_size == W) {
          shard_group = fresh_comm();
          o.communicator(shard_group);
        } else {
          auto mesh = fsdp::comm::DeviceMesh::hybrid(world(), shard_size);
          o.mesh(mesh);
          shard_group = mesh->shard_group();
        }
        if (bf16) o.mixed_precision(fsdp::MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat));
        std::vector<fsdp::FSDPModule> units;
        int64_t ag_bytes = 0, a2a_bytes = 0, ag_calls = 0, a2a_calls = 0, rs_calls = 0;
        const Curves c = train(o, kSteps, &units, [&](int step) {
          if (step == kSteps - 2) shard_group->reset_stats();
          if (step == kSteps - 1) {  // the last step's collectives
            ag_calls = shard_group->stats(CollectiveKind::kAllGather).calls;
            ag_bytes = shard_group->stats(CollectiveKind::kAllGather).bytes;
            a2a_calls = shard_group->stats(CollectiveKind::kAllToAll).calls;
            a2a_bytes = shard_group->stats(CollectiveKind::kAllToAll).bytes;
            rs_calls = shard_group->stats(CollectiveKind::kReduceScatter).calls;
          }
        });
        double worst = 0;
        for (int step = 0; step < kSteps; ++step) {
          const double rel = std::abs(c.sharded[step] - c.reference[step]) / std::abs(c.reference[step]);
          worst = std::max(worst, rel);
          INFO("step " << step << ": " << c.sharded[step] << " against " << c.reference[step]);
          CHECK(rel <= kRelativeTolerance);
        }
        // Per step: the closed form of the plan's rule with encoded bytes (a unit resharded after
        // forward is gathered twice, the root and SHARD_GRAD_OP units once).
        int64_t expected_ag = 0, expected_ag_calls = 0;
        for (size_t u = 0; u < units.size(); ++u) {
          const bool twice = strategy == fsdp::ShardingStrategy::kFullShard && u + 1 < units.size();
          expected_ag += (twice ? 2 : 1) * encoded_gather_bytes(units[u], *codec);
          expected_ag_calls += shard_size > 1 ? (twice ? 2 : 1) : 0;
        }
        CHECK(ag_calls == expected_ag_calls);
        CHECK(ag_bytes == expected_ag);
        CHECK(a2a_calls == (shard_size > 1 ? static_cast<int64_t>(units.size()) : 0));
        CHECK(a2a_bytes == encoded_reduction_bytes(units, *codec));
        CHECK(rs_calls == 0);
        if (rank() == 0) {
          std::cout << "[quantized_comm] training " << W << " ranks, " << fsdp::to_string(strategy)
                    << (bf16 ? " bf16" : "") << ", shard group " << shard_size << ": worst relative loss difference "
                    << worst << " over " << kSteps << " steps; per step all-gather " << ag_bytes << " B, all-to-all "
                    << a2a_bytes << " B" << std::endl;
        }
      }
    }
  }
}

FSDP_RANKS_TEST_CASE("reshard_after_forward(int) with an all-gather codec encodes the forward all-gather only",
                     "[quantized_comm][all_gather_codec][post_forward_group]") {
  const int W = world_size();
  auto codec = fsdp::int8_block_codec(kBlock);
  if (W == 1) {  // no group of at least 2 ranks: refused (codec or not)
    MlpStack model = make_model();
    CHECK_THAT(fsdp::testing::error_of([&] {
                 fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(fresh_comm()).reshard_after_forward(1).all_gather_codec(codec));
               }),
               Contains("reshard_after_forward(1)"));
  }
  for (int k = 2; k <= W; ++k) {
    if (W % k != 0) continue;
    INFO(W << " ranks, post-forward group of " << k);
    auto comm = fresh_comm();
    std::vector<fsdp::FSDPModule> units;
    int64_t ag_bytes = 0;
    const Curves c = train(fsdp::FullyShardOptions().communicator(comm).reshard_after_forward(k).all_gather_codec(codec), 4,
                           &units, [&](int step) {
                             if (step == 2) comm->reset_stats();
                             if (step == 3) ag_bytes = comm->stats(CollectiveKind::kAllGather).bytes;
                           });
    for (int step = 0; step < 4; ++step) CHECK(std::abs(c.sharded[step] - c.reference[step]) <= 0.01 * c.reference[step]);
    // The world all-gathers: every unit in forward, encoded; in backward, the root none and the
    // others inside their post-forward group (its own communicator) unless k is the whole world.
    int64_t expected = 0;
    for (size_t u = 0; u < units.size(); ++u) {
      const bool backward_on_world = u + 1 < units.size() && k == W;
      expected += (backward_on_world ? 2 : 1) * encoded_gather_bytes(units[u], *codec);
    }
    CHECK(ag_bytes == expected);
  }
}

// A float16 codec written here, as a user would: the extension point with nothing of the library's.
struct Float16Codec final : fsdp::CommCodec {
  std::string name() const override { return "test_fp16"; }
  int64_t encoded_bytes(int64_t numel) const override { return 2 * numel; }
  void encode(const at::Tensor& input, at::Tensor& output) const override {
    output.copy_(input.to(at::kHalf).contiguous().view(at::kByte));
  }
  void decode(const at::Tensor& encoded, at::Tensor& output) const override {
    output.copy_(encoded.contiguous().view(at::kHalf));
  }
};

FSDP_RANKS_TEST_CASE("a user-defined codec plugs into the all-gather and the gradient reduction",
                     "[quantized_comm][extension]") {
  const int W = world_size();
  auto codec = std::make_shared<Float16Codec>();
  auto comm = fresh_comm();
  MlpStack model = make_model();
  auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(comm).all_gather_codec(codec).reduce_codec(codec));
  // Forward on float16-rounded parameters: the reference's gradients, computed on parameters
  // rounded the same way, then rounded to float16 per rank before the float32 sum.
  MlpStack rounded = make_model();
  {
    c10::NoGradGuard no_grad;
    for (auto& p : rounded->parameters()) p.copy_(W > 1 ? p.to(at::kHalf).to(at::kFloat) : p);
  }
  std::vector<Grads> per_rank;
  for (int q = 0; q < W; ++q) {
    rounded->zero_grad();
    loss_of(rounded, 0, q).backward();
    Grads g;
    for (const auto& item : rounded->named_parameters()) {
      g[item.key()] = (W > 1 ? item.value().grad().to(at::kHalf) : item.value().grad()).to(at::kDouble);
    }
    per_rank.push_back(g);
  }
  comm->reset_stats();
  loss_of(model, 0, rank()).backward();
  const int64_t all_to_all_bytes = comm->stats(CollectiveKind::kAllToAll).bytes;
  const int64_t all_gather_bytes = comm->stats(CollectiveKind::kAllGather).bytes;  // before summoning
  Grads expected, zero;
  for (const auto& [key, g] : per_rank[0]) {
    at::Tensor sum = at::zeros_like(g);
    for (const Grads& r : per_rank) sum += r.at(key);
    expected[key] = sum / W;
    zero[key] = at::zeros_like(g);
  }
  check_within(full_grads(units.back(), *model), expected, zero);  // float32 rounding only
  int64_t padded = 0, shard_gathers = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    for (const auto& h : fsdp::detail::handles_of(units[u])) {
      padded += h->layout().padded_numel;
      shard_gathers += (u + 1 < units.size() ? 2 : 1) * h->layout().padded_numel;
    }
  }
  CHECK(all_to_all_bytes == (W > 1 ? 2 * padded : 0));
  CHECK(all_gather_bytes == (W > 1 ? 2 * shard_gathers : 0));
}

FSDP_RANKS_TEST_CASE("ranks that disagree on a codec fail on every rank naming the unit; NO_SHARD refuses codecs",
                     "[quantized_comm][errors]") {
  const int W = world_size();
  const bool last = rank() == W - 1;
  auto codec = fsdp::int8_block_codec(kBlock);
  {
    // The all-gather codec on the last rank only: the first forward's check names the unit.
    MlpStack model = make_model();
    auto units = fsdp::testing::shard_stack(
        model, fsdp::FullyShardOptions().communicator(fresh_comm()).all_gather_codec(last ? codec : nullptr));
    const std::string error = fsdp::testing::error_of([&] { loss_of(model, 0, rank()).backward(); });
    INFO(error);
    if (W > 1) {
      CHECK_THAT(error, Contains("encoded by int8_block(16, Float scales)") && Contains("'<root>'"));
    } else {
      CHECK(error == fsdp::testing::kNoError);  // one rank: nothing to disagree with, nothing gathered
    }
  }
  {
    // The reduce codec on the last rank only: refused when the backward pass begins, in any
    // iteration, naming the unit and each rank's codec.
    MlpStack model = make_model();
    auto units = fsdp::testing::shard_stack(
        model, fsdp::FullyShardOptions().communicator(fresh_comm()).reduce_codec(last ? codec : nullptr));
    const std::string error = fsdp::testing::error_of([&] { loss_of(model, 0, rank()).backward(); });
    INFO(error);
    if (W > 1) {
      CHECK_THAT(error, Contains("different controls on unit") && Contains("reduce_codec int8_block(16, Float scales)") &&
                            Contains("reduce_codec none"));
    } else {
      CHECK(error == fsdp::testing::kNoError);
    }
  }
  {
    MlpStack model = make_model();
    const auto before = reference_params();
    const std::string error = fsdp::testing::error_of([&] {
      fsdp::fully_shard(*model->block(0), fsdp::FullyShardOptions()
                                            .communicator(fresh_comm())
                                            .strategy(fsdp::ShardingStrategy::kNoShard)
                                            .reduce_codec(codec));
    });
    CHECK_THAT(error, Contains("fully_shard: module ") && Contains("MlpBlockImpl") &&
                          Contains("strategy NO_SHARD with reduce_codec(int8_block(16, Float scales))") &&
                          Contains("Use FULL_SHARD or SHARD_GRAD_OP"));
    CHECK(!fsdp::fsdp_module_of(*model->block(0)).has_value());
    for (const auto& item : model->named_parameters()) CHECK(item.value().detach().to(at::kDouble).equal(before.at(item.key())));
  }
}

}  // namespace
