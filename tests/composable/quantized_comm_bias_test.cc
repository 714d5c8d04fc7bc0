// The int8 gradient codec without systematic bias ([Note: int8 block codec], [Note: stochastic
// rounding of gradients] in fsdp/comm_codec.h; [Note: quantized gradient reduction] in
// fsdp/flat_param_grad.h):
//   (a) the codec with a row layout: blocks begin at every tensor start (sizes in closed form, a
//       small tensor next to a large one decoded to its own scale), stochastic rounding is
//       unbiased where rounding to nearest gives zero, the same seed gives the same bytes and
//       two ranks' streams differ, a decoder of one shard reads what an encoder of all wrote;
//   (b) one fully_shard unit holding three parameters with gradients around 1e-1 ("large"), 1e-4
//       ("small") and 1e-4 with a 1e-1 entry every 64 elements ("rare", as rare and frequent
//       embedding rows), 100 SGD steps on a linear loss (each step's gradient is known in closed
//       form), reduced through int8_block_codec(256) against the unquantized run: every
//       parameter within the documented bounds of the unquantized update, the small one within
//       1% of it, the rare one's small entries moving by their expected amount on average; and,
//       on the same steps, the codec before issue 35 (blocks of 256 across parameter boundaries,
//       rounded to nearest), whose small parameter and small rare entries never move, and
//       aligned blocks rounded to nearest, which move the small parameter but not the small rare
//       entries. One rank encodes nothing: every run is the unquantized one there.
#include <algorithm>
#include <cmath>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/nn/module.h>
#include <torch/optim/sgd.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/summon_full_params.h"
#include "fsdp_cpp/contract/hookable_module_holder.h"
#include "fsdp_cpp/fsdp/comm_codec.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using fsdp::comm::CollectiveKind;
using fsdp::testing::rank;
using fsdp::testing::world_size;

constexpr int64_t kLarge = 448, kSmall = 64, kRare = 256;  // float32: no alignment padding
constexpr int64_t kEvery = 64;                             // the rare parameter's large entries
constexpr int kSteps = 100;
constexpr double kLr = 0.1;
constexpr int64_t kBlock = 256;
constexpr double kSigmas = 6;  // the statistical bound: 6 standard deviations

// Three parameters in one unit, flattened in this order; a linear loss, so each step's gradient
// is the coefficient vector whatever the parameters are.
struct ThreeScalesImpl : torch::nn::Module {
  ThreeScalesImpl() {
    large = register_parameter("large", torch::zeros({kLarge}));
    small = register_parameter("small", torch::zeros({kSmall}));
    rare = register_parameter("rare", torch::zeros({kRare}));
  }
  torch::Tensor forward(torch::Tensor c) {
    return (large * c.narrow(0, 0, kLarge)).sum() + (small * c.narrow(0, kLarge, kSmall)).sum() +
           (rare * c.narrow(0, kLarge + kSmall, kRare)).sum();
  }
  torch::Tensor large, small, rare;
};
FSDP_HOOKABLE_MODULE(ThreeScales);

// Rank q's gradient in step t, [kLarge + kSmall + kRare] float64: 1e-1 and 1e-4 times a factor
// uniform in [0.75, 1.25) (so a large entry is at least 0.075, a small one below 1.25e-4).
at::Tensor coefficients(int step, int q) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(1000 * step + q + 1));
  at::Tensor c = at::rand({kLarge + kSmall + kRare}, gen, at::kDouble).mul_(0.5).add_(0.75);
  at::Tensor scale = at::full({kLarge + kSmall + kRare}, 1e-4, at::kDouble);
  scale.narrow(0, 0, kLarge).fill_(1e-1);
  for (int64_t i = 0; i < kRare; i += kEvery) scale[kLarge + kSmall + i] = 1e-1;
  return c.mul_(scale);
}

// The codec before issue 35: int8_block_codec's encode() and decode() without a row layout, i.e.
// blocks of 256 from each shard's start across parameter boundaries, rounded to nearest.
struct UnalignedNearest final : fsdp::CommCodec {
  std::shared_ptr<const fsdp::CommCodec> inner = fsdp::int8_block_codec(kBlock);
  std::string name() const override { return "unaligned_nearest"; }
  int64_t encoded_bytes(int64_t numel) const override { return inner->encoded_bytes(numel); }
  void encode(const at::Tensor& input, at::Tensor& output) const override { inner->encode(input, output); }
  void decode(const at::Tensor& encoded, at::Tensor& output) const override { inner->decode(encoded, output); }
};

// Blocks aligned to the parameters but rounded to nearest (the seed dropped): what alignment
// alone does.
struct AlignedNearest final : fsdp::CommCodec {
  std::shared_ptr<const fsdp::CommCodec> inner = fsdp::int8_block_codec(kBlock);
  std::string name() const override { return "aligned_nearest"; }
  int64_t encoded_bytes(int64_t numel) const override { return inner->encoded_bytes(numel); }
  void encode(const at::Tensor& input, at::Tensor& output) const override { inner->encode(input, output); }
  void decode(const at::Tensor& encoded, at::Tensor& output) const override { inner->decode(encoded, output); }
  int64_t encoded_bytes_with_layout(const fsdp::CodecRowLayout& layout) const override {
    return inner->encoded_bytes_with_layout(layout);
  }
  void encode_with_layout(const at::Tensor& input, at::Tensor& output, const fsdp::CodecRowLayout& layout) const override {
    fsdp::CodecRowLayout nearest = layout;
    nearest.rounding_seed.reset();
    inner->encode_with_layout(input, output, nearest);
  }
  void decode_with_layout(const at::Tensor& encoded, at::Tensor& output, const fsdp::CodecRowLayout& layout) const override {
    inner->decode_with_layout(encoded, output, layout);
  }
};

struct Run {
  std::map<std::string, at::Tensor> update;  // full parameter after kSteps minus before (zero), float64
  int64_t all_to_all_bytes_per_step = 0;
};

// kSteps of SGD (lr kLr) on every rank's coefficients through one fully_shard unit.
Run train(const std::shared_ptr<const fsdp::CommCodec>& codec) {
  ThreeScales model;
  auto comm = fsdp::testing::fresh_comm();
  fsdp::FSDPModule unit = fsdp::fully_shard(model, fsdp::FullyShardOptions().communicator(comm).reduce_codec(codec));
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(kLr));
  Run run;
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    if (step == kSteps - 1) comm->reset_stats();
    model(coefficients(step, rank()).to(at::kFloat)).backward();
    if (step == kSteps - 1) run.all_to_all_bytes_per_step = comm->stats(CollectiveKind::kAllToAll).bytes;
    opt.step();
  }
  fsdp::SummonFullParams full(unit, fsdp::SummonFullParamsOptions().writeback(false));
  for (const auto& item : model->named_parameters()) run.update[item.key()] = item.value().detach().to(at::kDouble).clone();
  return run;
}

struct Expected {
  std::map<std::string, at::Tensor> update;  // -lr x sum over steps of the mean over ranks, float64
  std::map<std::string, double> sigma;       // [Note: quantized gradient reduction]'s standard deviation
  std::map<std::string, double> worst;       // the deterministic bound: lr / W x sum of absmax / 127
};

// From the coefficients alone. absmax over the whole parameter bounds the absmax of each of its
// blocks (a block lies within one parameter).
Expected expected(int W) {
  const std::vector<std::pair<std::string, std::pair<int64_t, int64_t>>> params = {
      {"large", {0, kLarge}}, {"small", {kLarge, kSmall}}, {"rare", {kLarge + kSmall, kRare}}};
  Expected e;
  std::map<std::string, double> squares;
  for (const auto& [name, range] : params) {
    e.update[name] = at::zeros({range.second}, at::kDouble);
    squares[name] = 0;
    e.worst[name] = 0;
  }
  for (int step = 0; step < kSteps; ++step) {
    for (int q = 0; q < W; ++q) {
      const at::Tensor c = coefficients(step, q);
      for (const auto& [name, range] : params) {
        const at::Tensor g = c.narrow(0, range.first, range.second);
        e.update[name] -= g * (kLr / W);
        const double s = g.abs().max().item<double>() / 127.0;
        squares[name] += s * s;
        e.worst[name] += kLr / W * s;
      }
    }
  }
  for (const auto& [name, range] : params) e.sigma[name] = kLr / (2.0 * W) * std::sqrt(squares[name]);
  return e;
}

// The rare parameter's entries around 1e-4.
at::Tensor small_entries(const at::Tensor& rare) {
  std::vector<at::Tensor> parts;
  for (int64_t i = 0; i < kRare; i += kEvery) parts.push_back(rare.narrow(0, i + 1, kEvery - 1));
  return at::cat(parts);
}

// The closed form of the all-to-all's bytes per step: W rows of M x 4 + shard_numel bytes (rounded
// up to 4), M the most blocks of 256 any shard has when blocks begin at each parameter's start
// (768 elements: large [0, 448), small [448, 512), rare [512, 768)).
int64_t aligned_all_to_all_bytes(int W) {
  switch (W) {
    case 2:  // shards of 384: large[0:256] large[256:384] | large[384:448] small rare: M = 3
      return 2 * (3 * 4 + 384);
    case 3:  // shards of 256: large[0:256] | large[256:448] small | rare: M = 2
      return 3 * (2 * 4 + 256);
    case 4:  // shards of 192: ... | large[384:448] small rare[0:64] | rare[64:256]: M = 3
      return 4 * (3 * 4 + 192);
    default:
      return 0;
  }
}

FSDP_RANKS_TEST_CASE("int8_block_codec with a row layout: aligned blocks, unbiased stochastic rounding, streams",
                     "[quantized_comm][bias][comm_codec]") {
  // The header's example: two shards of 500, tensors at 0, 300 and 700, blocks of 128.
  auto bf16 = fsdp::int8_block_codec(128, at::kBFloat16);
  CHECK(bf16->encoded_bytes_with_layout(fsdp::CodecRowLayout{500, 2, {0, 300, 700}, {0, 1}, std::nullopt}) == 512);
  auto codec = fsdp::int8_block_codec(kBlock);
  // Without tensor starts, a layout is the plain format, byte for byte.
  {
    auto gen = at::detail::createCPUGenerator(3);
    const at::Tensor x = at::randn({3, 1000}, gen);
    const fsdp::CodecRowLayout plain{1000, 1, {}, {0, 0, 0}, std::nullopt};
    CHECK(codec->encoded_bytes_with_layout(plain) == codec->encoded_bytes(1000));
    CHECK(fsdp::encode_rows(*codec, x, plain, "test").equal(fsdp::encode_rows(*codec, x, "test")));
  }
  // A 1e-4 tensor after a 0.1 one inside one block of 256: its own block with the layout.
  at::Tensor x = at::full({1, kBlock}, 1e-4, at::kFloat);
  x[0][0] = 0.1;
  const fsdp::CodecRowLayout one_tensor{kBlock, 1, {0}, {0}, std::nullopt};
  fsdp::CodecRowLayout two_tensors{kBlock, 1, {0, 16}, {0}, std::nullopt};
  CHECK(codec->encoded_bytes_with_layout(two_tensors) == 2 * 4 + kBlock);
  auto round_trip = [&](const fsdp::CodecRowLayout& layout) {
    at::Tensor out = at::empty({1, kBlock});
    fsdp::decode_rows(*codec, fsdp::encode_rows(*codec, x, layout, "test"), out, layout, "test");
    return out;
  };
  {
    const at::Tensor aligned = round_trip(two_tensors).narrow(1, 16, kBlock - 16);
    CHECK((aligned - 1e-4).abs().max().item<double>() <= 1e-4 / 254 * (1 + 1e-5));
    CHECK(round_trip(one_tensor).narrow(1, 1, kBlock - 1).abs().max().item<double>() == 0);  // below s / 2
  }
  // Stochastic rounding of the shared block: unbiased, each draw within one step s of the value.
  const double s = 0.1 / 127;
  const int draws = 400;
  double sum = 0;
  for (int d = 0; d < draws; ++d) {
    fsdp::CodecRowLayout seeded = one_tensor;
    seeded.rounding_seed = fsdp::codec_rounding_seed("test", static_cast<uint64_t>(d), 0);
    const at::Tensor small = round_trip(seeded).narrow(1, 1, kBlock - 1).to(at::kDouble);
    CHECK((small - 1e-4).abs().max().item<double>() < s * (1 + 1e-5));
    sum += small.sum().item<double>();
  }
  const double mean = sum / (draws * (kBlock - 1));
  const double sigma = s / 2 / std::sqrt(static_cast<double>(draws * (kBlock - 1)));
  INFO("mean of the stochastically rounded 1e-4 entries: " << mean);
  CHECK(std::abs(mean - 1e-4) <= kSigmas * sigma);
  // The same seed gives the same bytes; two ranks' streams differ.
  fsdp::CodecRowLayout rank0 = one_tensor, rank1 = one_tensor;
  rank0.rounding_seed = fsdp::codec_rounding_seed("unit/w", 7, 0);
  rank1.rounding_seed = fsdp::codec_rounding_seed("unit/w", 7, 1);
  CHECK(fsdp::encode_rows(*codec, x, rank0, "test").equal(fsdp::encode_rows(*codec, x, rank0, "test")));
  CHECK_FALSE(fsdp::encode_rows(*codec, x, rank0, "test").equal(fsdp::encode_rows(*codec, x, rank1, "test")));
  // An encoder of both shards, a decoder of shard 1 only (rows of different block counts).
  {
    auto gen = at::detail::createCPUGenerator(5);
    const at::Tensor rows = at::randn({2, 500}, gen);
    const fsdp::CodecRowLayout all{500, 2, {0, 300, 700}, {0, 1}, std::nullopt};
    const fsdp::CodecRowLayout second{500, 2, {0, 300, 700}, {1}, std::nullopt};
    const at::Tensor encoded = fsdp::encode_rows(*bf16, rows, all, "test");
    at::Tensor both = at::empty({2, 500}), one = at::empty({1, 500});
    fsdp::decode_rows(*bf16, encoded, both, all, "test");
    fsdp::decode_rows(*bf16, encoded.narrow(0, 1, 1), one, second, "test");
    CHECK(one[0].equal(both[1]));
    CHECK((both - rows).abs().max().item<double>() <= rows.abs().max().item<double>() / 254 * (1 + 1e-2));
  }
}

FSDP_RANKS_TEST_CASE("a 1e-4 parameter next to a 1e-1 one moves by its expected amount through the int8 codec",
                     "[quantized_comm][bias]") {
  const int W = world_size();
  const Expected e = expected(W);
  const Run reference = train(nullptr);
  const Run stochastic = train(fsdp::int8_block_codec(kBlock));
  const Run again = train(fsdp::int8_block_codec(kBlock));
  const Run unaligned = train(std::make_shared<UnalignedNearest>());
  const Run aligned_nearest = train(std::make_shared<AlignedNearest>());

  for (const auto& [name, want] : e.update) {
    INFO("parameter " << name << ", " << W << " ranks");
    // The unquantized run is the closed form, up to float32 rounding.
    CHECK((reference.update.at(name) - want).abs().max().item<double>() <= 1e-5 * want.abs().max().item<double>());
    // Reproducible: the same streams in a second run.
    CHECK(again.update.at(name).equal(stochastic.update.at(name)));
  }
  if (W == 1) {  // nothing encoded: every run is the unquantized one
    for (const auto& [name, want] : e.update) {
      CHECK(stochastic.update.at(name).equal(reference.update.at(name)));
      CHECK(unaligned.update.at(name).equal(reference.update.at(name)));
      CHECK(aligned_nearest.update.at(name).equal(reference.update.at(name)));
    }
    CHECK(stochastic.all_to_all_bytes_per_step == 0);
    return;
  }
  CHECK(stochastic.all_to_all_bytes_per_step == aligned_all_to_all_bytes(W));
  CHECK(unaligned.all_to_all_bytes_per_step == W * fsdp::int8_block_codec(kBlock)->encoded_bytes(768 / W));

  std::map<std::string, double> relative;
  for (const auto& [name, want] : e.update) {
    INFO("parameter " << name << ", " << W << " ranks");
    const at::Tensor ref = reference.update.at(name);
    const at::Tensor error = (stochastic.update.at(name) - ref).abs();
    const double rounding = 1e-5 * ref.abs().max().item<double>();  // float32 over 100 steps
    // Every element within the worst case (every step's error at its bound) and within kSigmas
    // standard deviations of the zero-mean sum ([Note: quantized gradient reduction]).
    CHECK(error.max().item<double>() <= e.worst.at(name) + rounding);
    CHECK(error.max().item<double>() <= kSigmas * e.sigma.at(name) + rounding);
    relative[name] = (error / ref.abs()).max().item<double>();
  }
  // The small parameter: within 1% of the unquantized update, element by element (the bound
  // above is 6 sigma = 0.3% / sqrt(W) of it).
  CHECK(relative.at("small") <= 0.01);
  // The rare parameter's small entries share a block with a 0.1 entry: each moves by its expected
  // amount up to a noise of about half its update per element; their mean within kSigmas
  // standard deviations of the mean (independent roundings).
  const at::Tensor rare_ref = small_entries(reference.update.at("rare"));
  const at::Tensor rare_q = small_entries(stochastic.update.at("rare"));
  const double n_small = static_cast<double>(rare_ref.numel());
  const double mean_error = std::abs((rare_q - rare_ref).mean().item<double>());
  CHECK(mean_error <= kSigmas * e.sigma.at("rare") / std::sqrt(n_small));
  const double rare_ratio = rare_q.mean().item<double>() / rare_ref.mean().item<double>();
  CHECK(rare_ratio > 0.5);
  CHECK(rare_ratio < 1.5);

  // The codec before issue 35: the small parameter and the rare small entries never move.
  CHECK(unaligned.update.at("small").abs().max().item<double>() == 0);
  CHECK(small_entries(unaligned.update.at("rare")).abs().max().item<double>() == 0);
  CHECK(reference.update.at("small").abs().min().item<double>() > 0.5 * kLr * kSteps * 1e-4);
  // Aligned blocks alone (rounded to nearest): the small parameter moves (within its worst case,
  // half the stochastic one), the rare small entries still do not.
  const at::Tensor nearest_error = (aligned_nearest.update.at("small") - reference.update.at("small")).abs();
  CHECK(nearest_error.max().item<double>() <= e.worst.at("small") / 2 + 1e-5 * reference.update.at("small").abs().max().item<double>());
  CHECK(small_entries(aligned_nearest.update.at("rare")).abs().max().item<double>() == 0);

  if (rank() == 0) {
    auto moved = [&](const Run& r, const std::string& name) {
      return r.update.at(name).sum().item<double>() / reference.update.at(name).sum().item<double>() + 0.0;  // no -0
    };
    std::cout << "[quantized_comm_bias] " << W << " ranks, " << kSteps << " steps: update / unquantized update, summed: "
              << "small " << moved(stochastic, "small") << " (largest error per element " << relative.at("small")
              << " of it; 6 sigma " << kSigmas * e.sigma.at("small") / reference.update.at("small").abs().min().item<double>()
              << "), large " << moved(stochastic, "large") << " (largest error " << relative.at("large")
              << "), rare small entries " << rare_ratio << " (largest error per element "
              << ((rare_q - rare_ref).abs() / rare_ref.abs()).max().item<double>() << "); before (unaligned, nearest): small "
              << moved(unaligned, "small") << ", rare small entries "
              << small_entries(unaligned.update.at("rare")).sum().item<double>() / rare_ref.sum().item<double>() + 0.0
              << "; aligned nearest: small " << moved(aligned_nearest, "small") << ", rare small entries "
              << small_entries(aligned_nearest.update.at("rare")).sum().item<double>() / rare_ref.sum().item<double>() + 0.0
              << "; all-to-all " << stochastic.all_to_all_bytes_per_step << " B per step (unaligned "
              << unaligned.all_to_all_bytes_per_step << " B)" << std::endl;
  }
}

}  // namespace
