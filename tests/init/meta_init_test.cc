#include "fsdp_cpp/init/meta_init.h"

#include <chrono>
#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <torch/torch.h>

// Catch2 last: c10/util/Logging.h defines a CHECK macro of its own, and the last definition wins.
#include <catch2/catch.hpp>

namespace {

using Factory = std::function<std::shared_ptr<torch::nn::Module>()>;

std::map<std::string, at::Tensor> tensors_of(torch::nn::Module& m) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : m.named_parameters()) out["p:" + p.key()] = p.value();
  for (const auto& b : m.named_buffers()) out["b:" + b.key()] = b.value();
  return out;
}

std::shared_ptr<torch::nn::Module> build_meta(const Factory& make, uint64_t seed) {
  torch::manual_seed(seed);
  fsdp::MetaInitGuard guard;
  return make();
}

// Sinusoidal positions computed from arange/exp/sin/cos in the constructor: no randomness, so the
// meta-built module must materialize to exactly the eagerly built values.
struct PositionsImpl : torch::nn::Module {
  explicit PositionsImpl(int64_t n, int64_t d) {
    auto pos = torch::arange(n, torch::kFloat).unsqueeze(1);
    auto div = torch::exp(torch::arange(0, d, 2, torch::kFloat) * (-std::log(10000.0) / d));
    auto pe = torch::zeros({n, d});
    pe.index_put_({torch::indexing::Slice(), torch::indexing::Slice(0, torch::indexing::None, 2)}, torch::sin(pos * div));
    pe.index_put_({torch::indexing::Slice(), torch::indexing::Slice(1, torch::indexing::None, 2)}, torch::cos(pos * div));
    table = register_buffer("table", pe);
    scale = register_parameter("scale", torch::ones({d}) * 0.5);
    mask = register_buffer("mask", torch::ones({n, n}).tril());
    // A parameter initialized from another one (copy_ at the version it had then), then changed.
    shadow = register_parameter("shadow", torch::empty({d}));
    {
      torch::NoGradGuard no_grad;
      shadow.copy_(scale);
      scale.mul_(4);
    }
  }
  torch::Tensor table, scale, mask, shadow;
};
TORCH_MODULE(Positions);

// Every torch::nn module with parameters or buffers that a model is built from.
std::vector<std::pair<std::string, Factory>> standard_modules() {
  namespace nn = torch::nn;
  return {
      {"Linear", [] { return nn::Linear(48, 24).ptr(); }},
      {"Bilinear", [] { return nn::Bilinear(8, 6, 4).ptr(); }},
      {"Conv1d", [] { return nn::Conv1d(nn::Conv1dOptions(4, 8, 3)).ptr(); }},
      {"Conv2d", [] { return nn::Conv2d(nn::Conv2dOptions(4, 8, 3)).ptr(); }},
      {"Conv3d", [] { return nn::Conv3d(nn::Conv3dOptions(2, 4, 3)).ptr(); }},
      {"ConvTranspose2d", [] { return nn::ConvTranspose2d(nn::ConvTranspose2dOptions(4, 8, 3)).ptr(); }},
      {"Embedding", [] { return nn::Embedding(nn::EmbeddingOptions(100, 16).padding_idx(3)).ptr(); }},
      {"EmbeddingBag", [] { return nn::EmbeddingBag(nn::EmbeddingBagOptions(100, 16)).ptr(); }},
      {"LayerNorm", [] { return nn::LayerNorm(nn::LayerNormOptions({32})).ptr(); }},
      {"GroupNorm", [] { return nn::GroupNorm(4, 16).ptr(); }},
      {"BatchNorm1d", [] { return nn::BatchNorm1d(16).ptr(); }},
      {"BatchNorm2d", [] { return nn::BatchNorm2d(16).ptr(); }},
      {"InstanceNorm2d", [] { return nn::InstanceNorm2d(nn::InstanceNorm2dOptions(8).affine(true).track_running_stats(true)).ptr(); }},
      {"PReLU", [] { return nn::PReLU(nn::PReLUOptions().num_parameters(8)).ptr(); }},
      {"RNN", [] { return nn::RNN(nn::RNNOptions(8, 16).num_layers(2)).ptr(); }},
      {"LSTM", [] { return nn::LSTM(nn::LSTMOptions(8, 16).num_layers(2).bidirectional(true)).ptr(); }},
      {"GRU", [] { return nn::GRU(nn::GRUOptions(8, 16)).ptr(); }},
      {"LSTMCell", [] { return nn::LSTMCell(8, 16).ptr(); }},
      {"MultiheadAttention", [] { return nn::MultiheadAttention(nn::MultiheadAttentionOptions(32, 4)).ptr(); }},
      {"TransformerEncoderLayer", [] { return nn::TransformerEncoderLayer(nn::TransformerEncoderLayerOptions(32, 4).dim_feedforward(64)).ptr(); }},
      {"TransformerDecoderLayer", [] { return nn::TransformerDecoderLayer(nn::TransformerDecoderLayerOptions(32, 4).dim_feedforward(64)).ptr(); }},
      {"Transformer", [] { return nn::Transformer(nn::TransformerOptions(16, 2, 1, 1).dim_feedforward(32)).ptr(); }},
      {"Positions", [] { return Positions(10, 8).ptr(); }},
  };
}

TEST_CASE("Linear built under the guard is meta and materializes in place", "[meta_init]") {
  torch::manual_seed(0);
  torch::nn::Linear linear(nullptr);
  {
    fsdp::MetaInitGuard guard;
    linear = torch::nn::Linear(64, 32);
  }
  const at::Tensor weight_object = linear->weight;  // the same object after materialization
  REQUIRE(linear->weight.is_meta());
  REQUIRE(linear->bias.is_meta());
  REQUIRE(fsdp::has_recorded_init(linear->weight));
  auto w = fsdp::materialize_values(linear->weight, "weight");
  REQUIRE(!w.is_meta());
  REQUIRE(w.sizes() == linear->weight.sizes());
  const double bound = 1.0 / std::sqrt(64.0);  // kaiming_uniform_(a = sqrt(5)) on fan_in 64
  REQUIRE(w.abs().max().item<double>() <= bound);
  REQUIRE(w.std().item<double>() > 0.8 * bound / std::sqrt(3.0));
  torch::optim::SGD sgd(linear->parameters(), torch::optim::SGDOptions(0.1));
  fsdp::materialize_module(*linear);
  REQUIRE(!linear->weight.is_meta());
  REQUIRE(linear->weight.unsafeGetTensorImpl() == weight_object.unsafeGetTensorImpl());
  REQUIRE(torch::equal(linear->weight, w));
  REQUIRE(linear->weight.requires_grad());
  REQUIRE(linear->named_parameters()["weight"].unsafeGetTensorImpl() == weight_object.unsafeGetTensorImpl());
  // The optimizer made before materialization trains the materialized parameters.
  auto x = torch::randn({4, 64});
  auto expected = w - 0.1 * torch::matmul(torch::ones({4, 32}).t(), x);
  linear->forward(x).sum().backward();
  sgd.step();
  REQUIRE(torch::allclose(linear->weight, expected, 1e-6, 1e-6));
}

TEST_CASE("Every standard torch::nn module builds on meta and materializes", "[meta_init]") {
  for (const auto& [name, make] : standard_modules()) {
    INFO(name);
    torch::manual_seed(7);
    auto eager = make();
    auto meta = build_meta(make, 7);
    auto eager_tensors = tensors_of(*eager);
    auto meta_tensors = tensors_of(*meta);
    REQUIRE(eager_tensors.size() == meta_tensors.size());
    REQUIRE(!meta_tensors.empty());
    for (const auto& [key, t] : meta_tensors) {
      INFO(key);
      REQUIRE(t.is_meta());
    }
    fsdp::materialize_module(*meta);
    for (const auto& [key, t] : meta_tensors) {
      INFO(key);
      const at::Tensor& ref = eager_tensors.at(key);
      REQUIRE(!t.is_meta());
      REQUIRE(t.sizes() == ref.sizes());
      REQUIRE(t.scalar_type() == ref.scalar_type());
      if (!at::isFloatingType(ref.scalar_type()) || ref.numel() < 2 || ref.min().item<double>() == ref.max().item<double>()) {
        REQUIRE(torch::equal(t, ref));  // constants (ones, zeros, counters) are exact
        continue;
      }
      // Random inits: the same distribution as the eagerly built module (the numbers differ: each
      // tensor draws from its own generator, see [Note: meta init]).
      const double ref_max = ref.abs().max().item<double>();
      const double ref_std = ref.std().item<double>();
      if (ref.numel() >= 256) {
        const double ratio = t.std().item<double>() / ref_std;
        REQUIRE(ratio > 0.85);
        REQUIRE(ratio < 1.15);
      }
      REQUIRE(t.abs().max().item<double>() <= 1.5 * ref_max + 1e-6);
    }
  }
}

TEST_CASE("Deterministic constructions materialize to exactly the eager values", "[meta_init]") {
  auto eager = Positions(12, 8);
  auto meta = std::dynamic_pointer_cast<PositionsImpl>(build_meta([] { return Positions(12, 8).ptr(); }, 0));
  REQUIRE(meta->table.is_meta());
  fsdp::materialize_module(*meta);
  REQUIRE(torch::equal(meta->table, eager->table));
  REQUIRE(torch::equal(meta->mask, eager->mask));
  REQUIRE(torch::equal(meta->scale, eager->scale));    // ones * 0.5 * 4
  REQUIRE(torch::equal(meta->shadow, eager->shadow));  // copied before scale was multiplied
  REQUIRE(torch::equal(meta->shadow, torch::full({8}, 0.5)));
}

TEST_CASE("Same seed, same values whatever the materialization order", "[meta_init]") {
  auto make = [] { return torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::Embedding(50, 16),
                                                torch::nn::LSTM(16, 8)).ptr(); };
  auto a = build_meta(make, 3);
  auto b = build_meta(make, 3);
  auto c = build_meta(make, 4);
  // a: whole module at once; b: tensor by tensor, last first, values read before adopting.
  fsdp::materialize_module(*a);
  auto params_b = b->named_parameters();
  std::vector<at::Tensor> values(params_b.size());
  for (size_t i = params_b.size(); i-- > 0;) values[i] = fsdp::materialize_values(params_b[i].value(), params_b[i].key());
  auto params_a = a->named_parameters();
  for (size_t i = 0; i < params_a.size(); ++i) {
    INFO(params_a[i].key());
    REQUIRE(torch::equal(params_a[i].value(), values[i]));
    // Another seed gives other numbers.
    REQUIRE(!torch::equal(params_a[i].value(), fsdp::materialize_values(c->named_parameters()[i].value())));
  }
  // Two models built one after the other without reseeding differ, as without the guard.
  torch::manual_seed(5);
  std::shared_ptr<torch::nn::Module> d, e;
  {
    fsdp::MetaInitGuard guard;
    d = make();
  }
  {
    fsdp::MetaInitGuard guard;
    e = make();
  }
  REQUIRE(!torch::equal(fsdp::materialize_values(d->parameters()[0]), fsdp::materialize_values(e->parameters()[0])));
}

TEST_CASE("Random factories without a generator argument replay deterministically", "[meta_init]") {
  // torch::randn(size) and randint call overloads with no generator: they draw from the default
  // generator, which replay points at the memory's own stream for the call.
  auto make = [] {
    auto m = std::make_shared<torch::nn::Module>();
    m->register_buffer("noise", torch::randn({64}) * 0.1);
    m->register_buffer("ints", torch::randint(0, 1000, {32}));
    m->register_parameter("w", torch::rand({4, 4}));
    return m;
  };
  auto a = build_meta(make, 9);
  auto b = build_meta(make, 9);
  const auto first = fsdp::materialize_values(a->named_buffers()["noise"]);
  torch::manual_seed(123);  // the default generator's own state does not matter
  const auto expected_next = torch::rand({3});
  torch::manual_seed(123);
  REQUIRE(torch::equal(fsdp::materialize_values(a->named_buffers()["noise"]), first));
  REQUIRE(torch::equal(torch::rand({3}), expected_next));  // and is left as it was
  fsdp::materialize_module(*b);
  REQUIRE(torch::equal(b->named_buffers()["noise"], first));
  REQUIRE(first.std().item<double>() > 0.05);
  REQUIRE(b->named_buffers()["ints"].equal(fsdp::materialize_values(a->named_buffers()["ints"])));
  REQUIRE(b->named_buffers()["ints"].max().item<int64_t>() > 0);
}

TEST_CASE("An init function replaces the recorded initialization", "[meta_init]") {
  auto meta = build_meta([] { return torch::nn::Linear(8, 4).ptr(); }, 0);
  std::vector<std::string> seen;
  fsdp::materialize_module(*meta, at::kCPU, [&](const std::string& fqn, at::Tensor& values) {
    seen.push_back(fqn);
    values.fill_(static_cast<double>(seen.size()));
  });
  REQUIRE(seen == std::vector<std::string>{"weight", "bias"});
  auto params = meta->named_parameters();
  REQUIRE(torch::equal(params["weight"], torch::full({4, 8}, 1.0)));
  REQUIRE(torch::equal(params["bias"], torch::full({4}, 2.0)));
}

TEST_CASE("Explicit devices are respected inside the guard", "[meta_init]") {
  fsdp::MetaInitGuard guard;
  auto implicit = torch::zeros({3});
  auto explicit_cpu = torch::zeros({3}, torch::kCPU);
  auto literal = torch::tensor({1.0, 2.0});
  REQUIRE(implicit.is_meta());
  REQUIRE(!explicit_cpu.is_meta());
  REQUIRE(!literal.is_meta());
  REQUIRE(literal[1].item<double>() == 2.0);
}

TEST_CASE("Errors name the operator or the tensor", "[meta_init]") {
  {
    fsdp::MetaInitGuard guard;
    auto t = torch::ones({2});
    REQUIRE_THROWS_WITH(t.sum().item<double>(), Catch::Contains("fsdp::MetaInitGuard") && Catch::Contains("_local_scalar_dense"));
  }
  auto untracked = torch::empty({4}, torch::kMeta);
  REQUIRE(!fsdp::has_recorded_init(untracked));
  REQUIRE_THROWS_WITH(fsdp::materialize_values(untracked, "block.w"),
                      Catch::Contains("block.w") && Catch::Contains("not created inside a MetaInitGuard"));
  REQUIRE_THROWS_WITH(fsdp::materialize_values(torch::ones({2}), "x"), Catch::Contains("not a meta tensor"));
  torch::Tensor from_untracked;
  {
    fsdp::MetaInitGuard guard;
    from_untracked = untracked * 2;
  }
  REQUIRE_THROWS_WITH(fsdp::materialize_values(from_untracked, "y"), Catch::Contains("was not created inside a MetaInitGuard"));
}

TEST_CASE("A 10-billion-parameter model builds in no memory and little time", "[meta_init]") {
  // 40 blocks of two 40960 x 6144 Linear layers: 40 * 2 * 251.7M = 10.07e9 parameters (40 GB in fp32).
  const auto start = std::chrono::steady_clock::now();
  torch::nn::Sequential model;
  {
    fsdp::MetaInitGuard guard;
    for (int i = 0; i < 40; ++i) {
      model->push_back(torch::nn::Linear(6144, 40960));
      model->push_back(torch::nn::Linear(40960, 6144));
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  int64_t numel = 0;
  for (const auto& p : model->parameters()) {
    REQUIRE(p.is_meta());
    numel += p.numel();
  }
  REQUIRE(numel > int64_t{10'000'000'000});
  CHECK(seconds < 5.0);  // measured well under a second; eager construction takes minutes and 40 GB
  // One tensor of it materializes on its own (its own memory only).
  auto first = fsdp::materialize_values(model->parameters().back(), "last bias");
  REQUIRE(first.numel() == 6144);
}

}  // namespace
