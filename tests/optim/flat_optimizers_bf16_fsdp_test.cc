// fsdp::optim::AdamW with bfloat16 moments on fully_shard models over MPI (1-3 ranks).
//
// Two copies of one model, sharded the same way, on the same batches: one stepped by
// fsdp::optim::AdamW with FlatAdamOptions::state_dtype(kBFloat16) and round-to-nearest, one by
// torch::optim::AdamW with float32 states that this test rounds to bfloat16 after every step (the
// independent reference of [Note: bfloat16 moments]): every rank's shards and moments must be
// bitwise equal, for FULL_SHARD, SHARD_GRAD_OP, NO_SHARD and mixed precision, packs on and off.
// The allocator counts the optimizer state of a mixed-precision model: 2 + 2 bytes per element
// of this rank's parameters. Checkpoints: what the state dicts and fsdp::dcp hold, and loads
// between float32-state and bfloat16-state optimizers (working, or refused naming
// convert_dtype).
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include "fsdp_cpp/checkpoint/distributed_checkpoint.h"
#include "fsdp_cpp/checkpoint/optimizer_state_dict.h"
#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/optim/adamw.h"
#include "fsdp_cpp/tests/composable/parity.h"
#include "fsdp_cpp/tests/composable/test_models.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"
#include "fsdp_cpp/tools/bench/counting_allocator.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::FullyShardOptions;
using fsdp::ShardingStrategy;
using fsdp::optim::FlatAdamOptions;
using fsdp::optim::StateRounding;
using fsdp::testing::MlpStack;
using fsdp::testing::rank;
using fsdp::testing::world;
using fsdp::testing::world_size;
using State = torch::optim::AdamWParamState;

std::shared_ptr<fsdp::comm::Communicator> fresh_comm() {
  return std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
}

const torch::optim::AdamWOptions kOptions =
    torch::optim::AdamWOptions(1e-2).betas({0.8, 0.95}).weight_decay(0.05).amsgrad(true);

FlatAdamOptions nearest() { return FlatAdamOptions().state_dtype(at::kBFloat16).rounding(StateRounding::kNearest); }

at::Tensor batch(int it, int salt, int64_t width) {
  auto g = at::detail::createCPUGenerator(static_cast<uint64_t>(1000 * it + 10 * rank() + salt));
  return at::randn({4, width}, g);
}

enum class Opt { kBf16, kFloat32Flat, kTorch };

struct Trained {
  MlpStack model{nullptr};
  std::vector<fsdp::FSDPModule> units;
  std::unique_ptr<torch::optim::Optimizer> opt;
  int64_t in_dim = 6;
  int64_t out_dim = 3;
};

Trained make(const std::function<FullyShardOptions()>& options, Opt opt, int64_t in = 6, int64_t dim = 8,
             int64_t hidden = 16, int64_t out = 3, const torch::optim::AdamWOptions& adam = kOptions) {
  Trained t;
  torch::manual_seed(11);
  t.model = MlpStack(in, dim, hidden, 3, out);
  t.in_dim = in;
  t.out_dim = out;
  t.units = fsdp::testing::shard_stack(t.model, options());
  switch (opt) {
    case Opt::kBf16: t.opt = std::make_unique<fsdp::optim::AdamW>(t.model->parameters(), adam, nearest()); break;
    case Opt::kFloat32Flat: t.opt = std::make_unique<fsdp::optim::AdamW>(t.model->parameters(), adam); break;
    case Opt::kTorch: t.opt = std::make_unique<torch::optim::AdamW>(t.model->parameters(), adam); break;
  }
  return t;
}

void forward_backward(Trained& t, int it) {
  torch::nn::functional::mse_loss(t.model(batch(it, 1, t.in_dim)), batch(it, 2, t.out_dim)).backward();
}

void round_states(torch::optim::Optimizer& ref) {
  for (auto& entry : ref.state()) {
    auto& s = static_cast<State&>(*entry.second);
    for (at::Tensor x : {s.exp_avg(), s.exp_avg_sq(), s.max_exp_avg_sq()}) {
      if (x.defined()) x.copy_(x.to(at::kBFloat16));
    }
  }
}

// `flat`: the bf16-state optimizer's model; `ref`: torch::optim's, its states rounded.
void train_step(Trained& t, int it, bool emulate_bf16) {
  forward_backward(t, it);
  t.opt->step();
  t.opt->zero_grad();
  if (emulate_bf16) round_states(*t.opt);
}

void check_same(Trained& flat, Trained& ref) {
  auto pa = flat.model->named_parameters();
  auto pb = ref.model->named_parameters();
  REQUIRE(pa.size() == pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    INFO(pa[i].key());
    CHECK(torch::equal(pa[i].value().detach(), pb[i].value().detach()));
    auto fi = flat.opt->state().find(pa[i].value().unsafeGetTensorImpl());
    auto ri = ref.opt->state().find(pb[i].value().unsafeGetTensorImpl());
    REQUIRE((fi == flat.opt->state().end()) == (ri == ref.opt->state().end()));
    if (fi == flat.opt->state().end()) continue;
    auto& f = static_cast<State&>(*fi->second);
    auto& r = static_cast<State&>(*ri->second);
    CHECK(f.step() == r.step());
    for (auto [a, b] : {std::pair{f.exp_avg(), r.exp_avg()}, std::pair{f.exp_avg_sq(), r.exp_avg_sq()},
                        std::pair{f.max_exp_avg_sq(), r.max_exp_avg_sq()}}) {
      CHECK(torch::equal(a.to(at::kFloat), b.to(at::kFloat)));
    }
  }
}

int64_t sum_over_ranks(int64_t v) {
  at::Tensor t = at::full({1}, v, at::kLong);
  world().all_reduce(t).wait();
  return t.item<int64_t>();
}

}  // namespace

FSDP_RANKS_TEST_CASE("bf16 moments on fully_shard models: torch::optim's float32 AdamW with states rounded, bitwise",
                     "[optim][bf16]") {
  auto base = [] { return FullyShardOptions().communicator(fresh_comm()); };
  const std::vector<std::pair<std::string, std::function<FullyShardOptions()>>> setups = {
      {"full shard", base},
      {"shard grad op", [base] { return base().strategy(ShardingStrategy::kShardGradOp); }},
      {"no shard", [base] { return base().strategy(ShardingStrategy::kNoShard); }},
      {"mixed precision (bf16 parameters, fp32 reduce)",
       [base] { return base().mixed_precision(fsdp::MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat)); }},
  };
  for (const auto& [name, options] : setups) {
    for (bool packs : {true, false}) {
      INFO(name << (packs ? ", packs" : ", no packs") << ", world size " << world_size());
      Trained flat = make(options, Opt::kBf16);
      Trained ref = make(options, Opt::kTorch);
      if (!packs) dynamic_cast<fsdp::optim::FlatStepping&>(*flat.opt).set_pack_max_numel(0);
      for (int it = 0; it < 3; ++it) {
        train_step(flat, it, false);
        train_step(ref, it, true);
        check_same(flat, ref);
      }
      for (const auto& p : flat.model->parameters()) {
        auto it = flat.opt->state().find(p.unsafeGetTensorImpl());
        if (it != flat.opt->state().end()) CHECK(static_cast<State&>(*it->second).exp_avg().scalar_type() == at::kBFloat16);
      }
      const auto& stats = dynamic_cast<fsdp::optim::FlatStepping&>(*flat.opt).last_step();
      CHECK(sum_over_ranks(stats.flat_params + stats.packed_params + stats.single_params) > 0);
    }
  }
}

FSDP_RANKS_TEST_CASE("bf16 moments, mixed precision: optimizer state bytes by the allocator equal 4 per element",
                     "[optim][bf16][memory]") {
  // Every numel a multiple of 4 (no padding between a FlatParameter's members); weights up to
  // 256 x 1024, so runs in place (several ranks) and parameters alone (one rank) occur, not only packs.
  auto options = [] {
    return FullyShardOptions().communicator(fresh_comm()).mixed_precision(
        fsdp::MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat));
  };
  // Both models' bf16 forward and backward first: LibTorch's bf16 matmul allocates through
  // Allocator::raw_allocate, which the counting allocator (installed below, for the rest of the
  // process) does not serve.
  std::vector<Trained> models;
  for (const bool low : {true, false}) {
    // No amsgrad: exp_avg and exp_avg_sq only.
    models.push_back(make(options, low ? Opt::kBf16 : Opt::kFloat32Flat, 64, 256, 1024, 64,
                          torch::optim::AdamWOptions(1e-3).weight_decay(0.01)));
    forward_backward(models.back(), 0);
  }
  auto& alloc = fsdp::bench::CountingAllocator::install();
  for (size_t m = 0; m < models.size(); ++m) {
    const bool low = m == 0;
    Trained& t = models[m];
    INFO((low ? "bf16" : "float32") << " moments, world size " << world_size());
    int64_t elements = 0;
    for (const auto& p : t.model->parameters()) {
      if (p.grad().defined()) elements += p.numel();  // this rank's elements of the parameter
    }
    int64_t shard_bytes = 0, grad_bytes = 0;
    for (const auto& u : t.units) {
      shard_bytes += u.sharded_param_bytes();
      grad_bytes += u.sharded_grad_bytes();
    }
    alloc.mark();
    t.opt->step();
    const int64_t state = alloc.current_since_mark();
    const int64_t formula = (low ? 2 + 2 : 4 + 4) * elements;  // exp_avg + exp_avg_sq
    const int64_t total_elements = sum_over_ranks(elements);
    const int64_t total_bytes = sum_over_ranks(shard_bytes + grad_bytes + state);
    const auto& stats = dynamic_cast<fsdp::optim::FlatStepping&>(*t.opt).last_step();
    if (rank() == 0) {
      std::printf("world size %d, %s moments: rank 0 holds %lld elements (%lld in runs, %lld packed, %lld alone), "
                  "optimizer state %lld bytes by the allocator (formula %lld); shards + gradients + state over the "
                  "ranks %.4f bytes per parameter\n",
                  world_size(), low ? "bf16" : "float32", static_cast<long long>(elements),
                  static_cast<long long>(stats.flat_params), static_cast<long long>(stats.packed_params),
                  static_cast<long long>(stats.single_params), static_cast<long long>(state),
                  static_cast<long long>(formula), static_cast<double>(total_bytes) / static_cast<double>(total_elements));
    }
    CHECK(state == formula);
    // The shards' trailing padding aside, 12 (16) bytes per parameter.
    const double per_param = static_cast<double>(total_bytes) / static_cast<double>(total_elements);
    CHECK(per_param >= (low ? 12.0 : 16.0));
    CHECK(per_param < (low ? 12.0 : 16.0) * 1.001);
    t.opt->zero_grad();
  }
}

FSDP_RANKS_TEST_CASE("bf16 moments: state dicts and fsdp::dcp between float32-state and bf16-state optimizers",
                     "[optim][bf16][checkpoint]") {
  auto options = [] { return FullyShardOptions().communicator(fresh_comm()); };
  const auto all = fsdp::FullStateDictOptions().rank0_only(false);
  // Reference runs: bf16 states (nearest) and float32 states, two steps.
  Trained low = make(options, Opt::kBf16);
  Trained f32 = make(options, Opt::kFloat32Flat);
  for (int it = 0; it < 2; ++it) {
    train_step(low, it, false);
    train_step(f32, it, false);
  }

  // What they hold: the sharded dict views the live bfloat16 moments; the full dict of a sharded
  // FlatParameter assembles the shards in the parameter's dtype (float32, exact).
  const auto sharded = fsdp::sharded_optimizer_state_dict(low.units.back(), *low.opt);
  for (const auto& [key, shard] : sharded) {
    if (key.find(".exp_avg") != std::string::npos) CHECK(shard.local.scalar_type() == at::kBFloat16);
  }
  const auto full_low = fsdp::full_optimizer_state_dict(low.units.back(), *low.opt, all);
  for (const auto& item : full_low) {
    if (item.key().find(".exp_avg") != std::string::npos) {
      INFO(item.key());
      CHECK(item.value().scalar_type() == at::kFloat);
      CHECK(torch::equal(item.value(), item.value().to(at::kBFloat16).to(at::kFloat)));  // bf16 values
    }
  }

  // A float32 full dict into a fresh bf16-state optimizer (and into torch::optim, rounded): both
  // continue alike; the bf16 one's next step rounds the loaded moments to nearest.
  const auto full_f32 = fsdp::full_optimizer_state_dict(f32.units.back(), *f32.opt, all);
  Trained low_from_f32 = make(options, Opt::kBf16);
  Trained ref_from_f32 = make(options, Opt::kTorch);
  for (Trained* t : {&low_from_f32, &ref_from_f32}) {
    fsdp::load_full_state_dict(t->units.back(), fsdp::full_state_dict(f32.units.back(), all));
    fsdp::load_full_optimizer_state_dict(t->units.back(), *t->opt, full_f32);
  }
  round_states(*ref_from_f32.opt);

  // The bf16 one's full dict back into a fresh float32-state fsdp::optim::AdamW and into
  // torch::optim: float32 values (exact), both continue alike.
  Trained f32_from_low = make(options, Opt::kFloat32Flat);
  Trained ref_from_low = make(options, Opt::kTorch);
  for (Trained* t : {&f32_from_low, &ref_from_low}) {
    fsdp::load_full_state_dict(t->units.back(), fsdp::full_state_dict(low.units.back(), all));
    fsdp::load_full_optimizer_state_dict(t->units.back(), *t->opt, full_low);
  }

  // fsdp::dcp: the bf16-state optimizer saves bfloat16 moments. Into a fresh optimizer (whose
  // missing state the load offers as float32 zeros) that is refused naming convert_dtype, and
  // loads with it (exact: bf16 values are float32 values); into a stepped bf16-state optimizer
  // it loads as it is.
  const std::string dir = fsdp::testing::shared_tmpdir() + "/optim_bf16_states";
  fsdp::dcp::save(dir, low.units.back(), low.opt.get(), {}, fsdp::dcp::SaveOptions().communicator(fresh_comm()));
  Trained low_from_dcp = make(options, Opt::kBf16);
  const std::string refused = fsdp::testing::error_of([&] {
    fsdp::dcp::load(dir, low_from_dcp.units.back(), low_from_dcp.opt.get(), nullptr,
                    fsdp::dcp::LoadOptions().communicator(fresh_comm()));
  });
  CHECK_THAT(refused, Contains("exp_avg") && Contains("BF16") && Contains("convert_dtype(true)"));
  fsdp::dcp::load(dir, low_from_dcp.units.back(), low_from_dcp.opt.get(), nullptr,
                  fsdp::dcp::LoadOptions().communicator(fresh_comm()).convert_dtype(true));
  Trained low_again = make(options, Opt::kBf16);
  train_step(low_again, 0, false);  // stepped: bf16 live states
  fsdp::dcp::load(dir, low_again.units.back(), low_again.opt.get(), nullptr,
                  fsdp::dcp::LoadOptions().communicator(fresh_comm()));

  for (int it = 2; it < 4; ++it) {
    for (Trained* t : {&low, &low_from_f32, &f32_from_low, &low_from_dcp, &low_again}) train_step(*t, it, false);
    train_step(ref_from_f32, it, true);
    train_step(ref_from_low, it, false);
    check_same(low_from_f32, ref_from_f32);
    check_same(f32_from_low, ref_from_low);
    check_same(low_from_dcp, low);
    check_same(low_again, low);
  }
}
