// fully_shard on models built under fsdp::MetaInitGuard ([Note: meta-device models]): shards equal
// the unsharded model materialized from the same construction, training matches it, and each rank
// materializes only the parameters it holds part of.
#include <map>
#include <set>
#include <string>
#include <vector>

#include <torch/nn/modules/normalization.h>
#include <torch/torch.h>

#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/fully_shard_internal.h"
#include "fsdp_cpp/init/meta_init.h"
#include "fsdp_cpp/tests/composable/parity.h"
#include "fsdp_cpp/tests/composable/test_models.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

#include <catch2/catch.hpp>

namespace {

using fsdp::FullyShardOptions;
using fsdp::ShardingStrategy;
using fsdp::testing::Instance;
using fsdp::testing::MlpBlock;
using fsdp::testing::ParityOptions;
using fsdp::testing::Scenario;
using fsdp::testing::world;

/// x -> in -> blocks (each with a LayerNorm) -> x @ in.weight (the head tied to `in`), plus a random
/// buffer and a parameter computed from arange: every kind of tensor a constructor makes.
struct MetaNetImpl : torch::nn::Module {
  MetaNetImpl() {
    in = register_module("in", fsdp::contract::Linear(6, 8));
    blocks = register_module("blocks", fsdp::contract::ModuleList());
    for (int i = 0; i < 3; ++i) blocks->push_back(MlpBlock(8, 13));
    norm = register_module("norm", fsdp::contract::LayerNorm(torch::nn::LayerNormOptions({8})));
    offset = register_buffer("offset", torch::randn({8}) * 0.1);
    scale = register_parameter("scale", torch::arange(1, 9, torch::kFloat) / 8);
    head_weight = register_parameter("head_weight", in->weight);  // tied: [8, 6]
  }
  torch::Tensor forward(torch::Tensor x) {
    x = in(x);
    for (const auto& block : *blocks) x = block.forward<torch::Tensor>(x);
    return (norm(x) * scale + offset).matmul(head_weight);
  }
  fsdp::contract::Linear in{nullptr};
  fsdp::contract::ModuleList blocks{nullptr};
  fsdp::contract::LayerNorm norm{nullptr};
  torch::Tensor offset, scale, head_weight;
};
FSDP_HOOKABLE_MODULE(MetaNet);

std::vector<fsdp::FSDPModule> shard_meta_net(MetaNet& model, const FullyShardOptions& options) {
  std::vector<fsdp::FSDPModule> units;
  for (const auto& block : *model->blocks) units.push_back(fsdp::fully_shard(*block.ptr(), options));
  units.push_back(fsdp::fully_shard(*model, options));
  return units;
}

MetaNet build_meta() {
  fsdp::MetaInitGuard guard;
  return MetaNet();
}

// run_parity builds the sharded instance first, then the reference, each after the same seed: the
// sharded one stays on meta until fully_shard, the reference is materialized whole.
Scenario meta_scenario() {
  auto calls = std::make_shared<int>(0);
  return {"meta MetaNet", 6, 6, [calls] {
            MetaNet model = build_meta();
            const bool reference = (*calls)++ % 2 == 1;
            if (reference) fsdp::materialize_module(*model);
            Instance inst;
            inst.module = model.ptr();
            inst.forward = [model](torch::Tensor x, int) mutable { return model(x); };
            inst.shard = [model](const FullyShardOptions& o) mutable { return shard_meta_net(model, o); };
            return inst;
          }};
}

std::shared_ptr<fsdp::comm::Communicator> cpu_comm() {
  return std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
}

TEST_CASE("Training a meta-built model matches the unsharded model materialized whole", "[meta_init]") {
  for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard}) {
    ParityOptions options;
    options.shard_options.strategy(strategy);
    fsdp::testing::run_parity(meta_scenario(), options);
  }
  ParityOptions before;  // the optimizer holds the meta parameters before they are materialized
  before.optimizer_before_shard = true;
  before.optim = fsdp::testing::Optim::kAdamW;
  fsdp::testing::run_parity(meta_scenario(), before);
}

TEST_CASE("Shards hold exactly the whole-materialized values; buffers are real", "[meta_init]") {
  const std::vector<FullyShardOptions> variants = {
      FullyShardOptions(),
      FullyShardOptions().mixed_precision(fsdp::MixedPrecision().param_dtype(torch::kBFloat16).buffer_dtype(torch::kBFloat16)),
      FullyShardOptions().strategy(ShardingStrategy::kNoShard),
      FullyShardOptions().offload_to_cpu(true)};
  for (size_t v = 0; v < variants.size(); ++v) {
    INFO("variant " << v);
    torch::manual_seed(11);
    MetaNet sharded = build_meta();
    torch::manual_seed(11);
    MetaNet reference = build_meta();
    fsdp::materialize_module(*reference);
    auto options = variants[v];
    const auto units = shard_meta_net(sharded, options.communicator(cpu_comm()));
    REQUIRE(!sharded->offset.is_meta());
    REQUIRE(torch::equal(sharded->offset, reference->offset.to(sharded->offset.scalar_type())));  // cast with mixed precision
    for (const auto& p : sharded->parameters()) REQUIRE(!p.is_meta());
    const auto full = fsdp::full_state_dict(units.back());
    if (fsdp::testing::rank() == 0) {
      for (const auto& item : reference->named_parameters()) {
        if (!full.contains(item.key())) continue;  // the tied weight is listed once
        INFO(item.key());
        REQUIRE(torch::equal(full[item.key()], item.value()));
      }
      REQUIRE(torch::equal(full["offset"], reference->offset.to(full["offset"].scalar_type())));
    }
    // The parameter objects are the ones the constructor made, now views of the shards.
    REQUIRE(sharded->head_weight.unsafeGetTensorImpl() == sharded->in->weight.unsafeGetTensorImpl());
    // Its forward computes what the reference computes (in bf16 with mixed precision).
    const auto x = torch::randn({4, 6});
    if (v == 1) {
      REQUIRE(torch::allclose(sharded(x).to(torch::kFloat), reference(x), 5e-2, 5e-2));
    } else {
      REQUIRE(torch::equal(sharded(x), reference(x)));
    }
  }
}

TEST_CASE("param_init_fn initializes each rank's parameters, and only those it holds part of", "[meta_init]") {
  const int W = fsdp::testing::world_size();
  torch::manual_seed(0);
  MetaNet model = build_meta();
  std::vector<std::pair<std::string, int64_t>> param_sizes;
  for (const auto& item : model->named_parameters()) param_sizes.push_back({item.key(), item.value().numel()});
  std::multiset<std::string> called;
  // Closed form: element k of a tensor of n elements is k / n + (n % 7).
  auto init = [&](const std::string& fqn, at::Tensor& values) {
    called.insert(fqn);
    const int64_t n = values.numel();
    values.copy_((torch::arange(n, torch::kFloat) / n + static_cast<double>(n % 7)).view(values.sizes()));
  };
  const auto units = shard_meta_net(model, FullyShardOptions().communicator(cpu_comm()).param_init_fn(init));
  const auto full = fsdp::full_state_dict(units.back());
  if (fsdp::testing::rank() == 0) {
    for (const auto& [key, n] : param_sizes) {
      if (!full.contains(key)) continue;  // a tied parameter appears under one FQN
      INFO(key);
      REQUIRE(torch::equal(full[key].reshape({-1}), torch::arange(n, torch::kFloat) / n + static_cast<double>(n % 7)));
    }
  }
  // The buffer was initialized whole on every rank; each parameter only where this rank holds some of it.
  std::multiset<std::string> expected{"offset"};
  for (const auto& unit : units) {
    for (const auto& h : fsdp::detail::handles_of(unit)) {
      const int r = h->is_sharded_strategy() ? fsdp::testing::rank() : 0;
      for (size_t i = 0; i < h->params().size(); ++i) {
        if (h->layout().slice_of(i, r).size() > 0) expected.insert(h->params()[i].fqn);
      }
    }
  }
  REQUIRE(called == expected);
  if (W > 1) REQUIRE(called.size() < param_sizes.size());  // some parameter lies wholly on other ranks
}

TEST_CASE("Meta tensors without a recorded initialization are refused before anything changes", "[meta_init]") {
  auto model = MetaNet();  // real
  auto orphan = model->register_parameter("orphan", torch::empty({5}, torch::kMeta));
  const std::string error = fsdp::testing::error_of([&] {
    fsdp::fully_shard(*model, FullyShardOptions().communicator(cpu_comm()));
  });
  REQUIRE_THAT(error, Catch::Contains("'orphan'") && Catch::Contains("no recorded initialization") &&
                          Catch::Contains("param_init_fn"));
  REQUIRE(!fsdp::fsdp_module_of(*model).has_value());
  REQUIRE(orphan.is_meta());
  REQUIRE(!model->in->weight.is_meta());
}

TEST_CASE("Units on the blocks only: the rest is materialized with materialize_module", "[meta_init]") {
  torch::manual_seed(3);
  MetaNet model = build_meta();
  torch::manual_seed(3);
  MetaNet reference = build_meta();
  fsdp::materialize_module(*reference);
  for (const auto& block : *model->blocks) fsdp::fully_shard(*block.ptr(), FullyShardOptions().communicator(cpu_comm()));
  REQUIRE(model->in->weight.is_meta());  // not in any unit
  fsdp::materialize_module(*model);
  REQUIRE(!model->in->weight.is_meta());
  const auto x = torch::randn({4, 6});
  REQUIRE(torch::equal(model(x), reference(x)));
}

}  // namespace

namespace {

TEST_CASE("A meta-built model run before it is materialized names its meta tensors and the fix", "[meta_init]") {
  torch::manual_seed(4);
  MetaNet model = build_meta();
  const auto x = torch::randn({4, 6});
  // Without the check some of its operators fail with raw device errors, others return meta
  // outputs silently.
  const std::string error = fsdp::testing::error_of([&] { model(x); });
  CHECK_THAT(error, Catch::Contains("fsdp::MetaInitGuard: the forward of ") && Catch::Contains("MetaNetImpl was called while") &&
                        Catch::Contains("of its tensors are on the meta device (shape and dtype, no memory or values)") &&
                        Catch::Contains("parameter 'scale' [8] Float") &&
                        Catch::Contains("parameter 'in.weight' [8, 6] Float") &&
                        Catch::Contains("apply fsdp::fully_shard to it") &&
                        Catch::Contains("fsdp::materialize_module(*model, device)"));
  // A submodule called directly is checked too; nothing was changed.
  CHECK_THAT(fsdp::testing::error_of([&] { model->in(x); }),
             Catch::Contains("the forward of torch::nn::LinearImpl was called") &&
                 Catch::Contains("parameter 'weight' [8, 6] Float"));
  REQUIRE(model->in->weight.is_meta());
  // Materialized, it runs (and matches a model built the same way and materialized first).
  fsdp::materialize_module(*model);
  torch::manual_seed(4);
  MetaNet reference = build_meta();
  fsdp::materialize_module(*reference);
  REQUIRE(torch::equal(model(x), reference(x)));
}

}  // namespace
