// Checkpoints of tensor-parallel models (parallelize_module, then fully_shard over the dp group of
// a (dp, tp) mesh) on every world size: full state dicts (model and optimizer) hold GLOBAL values
// equal to the unsharded reference's after identical training and load back at another layout;
// fsdp::dcp checkpoints saved at one (dp, tp) resume at every (dp', tp') of the world and on an
// unsharded model with the same losses and parameters as an uninterrupted reference; global shapes
// that differ are refused on every rank, the model unchanged; load_pretrained reads each rank's
// TP x DP slice of a file. See [Note: tensor parallelism in state dicts] in
// checkpoint/state_dict_support.h.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/optim/adamw.h>

#include "fsdp_cpp/checkpoint/distributed_checkpoint.h"
#include "fsdp_cpp/checkpoint/full_state_dict_files.h"
#include "fsdp_cpp/checkpoint/load_pretrained.h"
#include "fsdp_cpp/checkpoint/optimizer_state_dict.h"
#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/comm/device_mesh.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/tensor_placement.h"
#include "fsdp_cpp/examples/gpt_model.h"
#include "fsdp_cpp/examples/gpt_tensor_parallel.h"
#include "fsdp_cpp/tests/composable/tp_gpt.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::testing::rank;
using fsdp::testing::world;
using fsdp::testing::world_size;
using Dict = torch::OrderedDict<std::string, at::Tensor>;

constexpr double kLr = 3e-3;

std::shared_ptr<fsdp::comm::Communicator> fresh_comm() {
  return std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
}

using fsdp::testing::tp::comparable;
using fsdp::testing::tp::kContext;
using fsdp::testing::tp::kVocab;
using fsdp::testing::tp::make_gpt;
using fsdp::testing::tp::meshes_of_world;
using fsdp::testing::tp::tokens;

torch::optim::AdamWOptions adamw() { return torch::optim::AdamWOptions(kLr).weight_decay(0.01); }

// A GPT parallelized over the tp dimension of a (dp, tp) mesh, each block and the root sharded over
// dp (sequence parallelism where tp > 1), with its AdamW.
struct TpGpt {
  std::shared_ptr<fsdp::comm::DeviceMesh> mesh;
  fsdp::examples::GPT model{nullptr};
  fsdp::examples::GptLossFunction loss_fn;
  std::vector<fsdp::FSDPModule> units;
  std::unique_ptr<torch::optim::AdamW> opt;

  TpGpt(int dp, int tp, int64_t vocab = kVocab, uint64_t seed = 42) {
    mesh = fsdp::comm::DeviceMesh::create(world(), {dp, tp}, {"dp", "tp"});
    model = make_gpt(vocab, seed);
    loss_fn = fsdp::examples::parallelize_gpt(model, mesh->group("tp"),
                                              fsdp::examples::GptTensorParallel().sequence_parallel(tp > 1));
    auto options = fsdp::FullyShardOptions().communicator(mesh->group("dp"));
    for (auto& block : model->block_list()) units.push_back(fsdp::fully_shard(block, options));
    units.push_back(fsdp::fully_shard(model, options));
    opt = std::make_unique<torch::optim::AdamW>(model->parameters(), adamw());
  }
  const fsdp::FSDPModule& root() const { return units.back(); }
  int dp() const { return mesh->size("dp"); }

  // One step on this rank's dp batch; returns the loss.
  double step(int64_t it) {
    const int q = mesh->coordinate("dp");
    at::Tensor loss = loss_fn(model(tokens(it, q, 1)), tokens(it, q, 2));
    loss.backward();
    opt->step();
    opt->zero_grad();
    return loss.item<double>();
  }
  Dict global_params() const { return fsdp::full_state_dict(root(), fsdp::FullStateDictOptions().rank0_only(false)); }
};

// The unsharded reference: one step whose gradient averages the batches of `dp` data-parallel
// ranks; returns the loss of batch `q_mine`.
double reference_step(fsdp::examples::GPT& model, torch::optim::AdamW& opt, int64_t it, int dp, int q_mine) {
  double mine = 0;
  for (int q = 0; q < dp; ++q) {
    at::Tensor lq = fsdp::examples::next_token_loss(model(tokens(it, q, 1)), tokens(it, q, 2));
    (lq / dp).backward();
    if (q == q_mine) mine = lq.item<double>();
  }
  opt.step();
  opt.zero_grad();
  return mine;
}

// Compares global values with the reference's parameters. The key bias (the middle third of
// qkv.bias) is left out (fsdp::testing::tp::comparable).
void check_params(const Dict& mine, fsdp::examples::GPT& reference, double rtol = 1e-4, double atol = 1e-5) {
  const auto ref = reference->named_parameters();
  REQUIRE(mine.size() == ref.size());
  for (const auto& item : ref) {
    INFO("parameter " << item.key());
    REQUIRE(mine.contains(item.key()));
    at::Tensor a = mine[item.key()].to(at::kFloat), b = item.value().detach();
    REQUIRE(a.sizes() == b.sizes());
    std::tie(a, b) = comparable(item.key(), a, b);
    CHECK(at::allclose(a, b, rtol, atol));
  }
}

void check_equal(const Dict& a, const Dict& b) {
  REQUIRE(a.size() == b.size());
  for (const auto& item : a) {
    INFO("key " << item.key());
    REQUIRE(b.contains(item.key()));
    CHECK(item.value().equal(b[item.key()]));
  }
}

// A plain (unsharded) model and its AdamW as a sharded state dict: every rank holds everything,
// rank 0 writes. The AdamW state is created (zeros, step 0) where missing; `steps` receives the
// step tensors to apply after a load.
fsdp::ShardedStateDict unsharded_state(fsdp::examples::GPT& model, torch::optim::AdamW& opt,
                                       std::vector<std::pair<at::Tensor, at::Tensor>>& steps) {
  fsdp::ShardedStateDict sd;
  const bool writer = rank() == 0;
  for (const auto& item : model->named_parameters()) {
    sd.emplace_back(item.key(), fsdp::LocalShard{item.value().detach().view({-1}), item.value().sizes().vec(), 0, writer});
  }
  for (const auto& item : model->named_parameters()) {
    const at::Tensor& p = item.value();
    auto& slot = opt.state()[p.unsafeGetTensorImpl()];
    if (!slot) {
      auto s = std::make_unique<torch::optim::AdamWParamState>();
      s->exp_avg(at::zeros_like(p));
      s->exp_avg_sq(at::zeros_like(p));
      slot = std::move(s);
    }
    auto& s = static_cast<torch::optim::AdamWParamState&>(*slot);
    at::Tensor step = at::full({1}, static_cast<double>(s.step()), at::kFloat);
    steps.emplace_back(p, step);
    sd.emplace_back("state." + item.key() + ".step", fsdp::LocalShard{step, {}, 0, writer});
    sd.emplace_back("state." + item.key() + ".exp_avg",
                    fsdp::LocalShard{s.exp_avg().view({-1}), p.sizes().vec(), 0, writer});
    sd.emplace_back("state." + item.key() + ".exp_avg_sq",
                    fsdp::LocalShard{s.exp_avg_sq().view({-1}), p.sizes().vec(), 0, writer});
  }
  return sd;
}

}  // namespace

FSDP_RANKS_TEST_CASE("TP full state dicts: global values equal the reference's; they load at another layout",
                     "[tp][checkpoint][full]") {
  const auto meshes = meshes_of_world();
  for (size_t m = 0; m < meshes.size(); ++m) {
    const auto [dp, tp] = meshes[m];
    INFO("mesh (dp=" << dp << ", tp=" << tp << ")");
    TpGpt run(dp, tp);
    auto reference = make_gpt();
    torch::optim::AdamW ref_opt(reference->parameters(), adamw());
    for (int64_t it = 0; it < 2; ++it) {
      const double loss = run.step(it);
      const double ref_loss = reference_step(reference, ref_opt, it, dp, run.mesh->coordinate("dp"));
      CHECK(std::abs(loss - ref_loss) < 1e-4);
    }
    // rank0_only (the default): world rank 0 only, with the global values.
    const Dict on_rank0 = fsdp::full_state_dict(run.root());
    CHECK(on_rank0.is_empty() == (rank() != 0));
    if (rank() == 0) check_params(on_rank0, reference);
    const Dict global = run.global_params();
    check_params(global, reference);
    // The optimizer's: exp_avg and exp_avg_sq with the parameters' global shapes.
    const Dict optim = fsdp::full_optimizer_state_dict(run.root(), *run.opt, fsdp::FullStateDictOptions().rank0_only(false));
    CHECK(fsdp::full_optimizer_state_dict(run.root(), *run.opt).is_empty() == (rank() != 0));
    for (const auto& item : reference->named_parameters()) {
      INFO("optimizer state of " << item.key());
      const auto& s = static_cast<torch::optim::AdamWParamState&>(*ref_opt.state().at(item.value().unsafeGetTensorImpl()));
      CHECK(optim["state." + item.key() + ".step"].item<double>() == 2);
      REQUIRE(optim["state." + item.key() + ".exp_avg"].sizes() == item.value().sizes());
      CHECK(at::allclose(optim["state." + item.key() + ".exp_avg"], s.exp_avg(), 1e-4, 1e-6));
      CHECK(at::allclose(optim["state." + item.key() + ".exp_avg_sq"], s.exp_avg_sq(), 1e-4, 1e-8));
    }
    // Load both at the next layout (from rank 0's dicts, then from every rank's): the same values.
    const auto [dp2, tp2] = meshes[(m + 1) % meshes.size()];
    INFO("loaded at (dp=" << dp2 << ", tp=" << tp2 << ")");
    for (const bool from_rank0 : {true, false}) {
      TpGpt other(dp2, tp2, kVocab, /*seed=*/7);
      const auto opts = fsdp::LoadFullStateDictOptions().broadcast_from_rank0(from_rank0);
      fsdp::load_full_state_dict(other.root(), from_rank0 ? on_rank0 : global, opts);
      const Dict optim_rank0 = fsdp::full_optimizer_state_dict(run.root(), *run.opt);
      fsdp::load_full_optimizer_state_dict(other.root(), *other.opt, from_rank0 ? optim_rank0 : optim, opts);
      check_equal(other.global_params(), global);
      check_equal(fsdp::full_optimizer_state_dict(other.root(), *other.opt, fsdp::FullStateDictOptions().rank0_only(false)),
                  optim);
    }
    // A global shape that differs (a larger vocabulary) is refused on every rank, the model unchanged.
    TpGpt wider(dp2, tp2, 2 * kVocab);
    const Dict before = wider.global_params();
    CHECK_THROWS_WITH(fsdp::load_full_state_dict(wider.root(), global),
                      Contains("fsdp::load_full_state_dict") && Contains("'tok_emb.weight' has shape [24, 24] in the state dict") &&
                          Contains("but [48, 24] in the model") && Contains("Nothing was loaded"));
    check_equal(wider.global_params(), before);
  }
}

FSDP_RANKS_TEST_CASE("TP dcp: saved at one (dp, tp), resumes at every (dp', tp') and unsharded like the reference",
                     "[tp][checkpoint][dcp]") {
  const auto meshes = meshes_of_world();
  // A mesh with tensor parallelism (the middle one), and pure fully_shard (tp = 1).
  std::vector<std::pair<int, int>> saves{meshes[meshes.size() / 2]};
  if (meshes.front() != saves.front()) saves.push_back(meshes.front());
  for (const auto& [dp, tp] : saves) {
    INFO("saved at (dp=" << dp << ", tp=" << tp << ")");
    const std::string dir = fsdp::testing::shared_tmpdir() + "/tp_ckpt_" + std::to_string(dp) + "x" + std::to_string(tp);
    {
      TpGpt run(dp, tp);
      for (int64_t it = 0; it < 2; ++it) run.step(it);
      fsdp::dcp::Extra extra;
      extra.values["step"] = "2";
      fsdp::dcp::save(dir, run.root(), run.opt.get(), extra, fsdp::dcp::SaveOptions().communicator(fresh_comm()));
    }
    // The manifest holds global shapes; the fused qkv weight's pieces are boxes of its 3 blocks
    // (each element written once: the save checks the counts).
    {
      std::ifstream in(dir + "/" + fsdp::dcp::kManifestName);
      const auto manifest = nlohmann::json::parse(in);
      bool found = false;
      for (const auto& record : manifest.at("keys")) {
        if (record.at(0) != "blocks.0.attn.qkv.weight" && record.at(0) != "state.blocks.0.attn.qkv.weight.exp_avg") continue;
        found = true;
        CHECK(record.at(2).get<std::vector<int64_t>>() == std::vector<int64_t>{72, 24});
        CHECK(record.at(3).size() >= static_cast<size_t>(tp > 1 ? 3 * tp : 1));
      }
      CHECK(found);
    }
    // Layouts to resume at: every mesh, then (dp2 = 0) an unsharded model on every rank.
    std::vector<std::pair<int, int>> loads = meshes;
    loads.emplace_back(0, 0);
    for (const auto& [dp2, tp2] : loads) {
      INFO("resumed at " << (dp2 == 0 ? std::string("an unsharded model")
                                      : "(dp=" + std::to_string(dp2) + ", tp=" + std::to_string(tp2) + ")"));
      auto reference = make_gpt();
      torch::optim::AdamW ref_opt(reference->parameters(), adamw());
      for (int64_t it = 0; it < 2; ++it) reference_step(reference, ref_opt, it, dp, 0);
      fsdp::dcp::Extra restored;
      if (dp2 == 0) {
        auto model = make_gpt(kVocab, /*seed=*/7);
        torch::optim::AdamW opt(model->parameters(), adamw());
        std::vector<std::pair<at::Tensor, at::Tensor>> steps;
        const auto sd = unsharded_state(model, opt, steps);
        fsdp::dcp::load_state(dir, sd, &restored, fsdp::dcp::LoadOptions().communicator(fresh_comm()));
        for (auto& [param, step] : steps) {
          static_cast<torch::optim::AdamWParamState&>(*opt.state().at(param.unsafeGetTensorImpl()))
              .step(std::llround(step.item<double>()));
        }
        for (int64_t it = 2; it < 4; ++it) {
          const double loss = reference_step(model, opt, it, 1, 0);
          const double ref_loss = reference_step(reference, ref_opt, it, 1, 0);
          CHECK(std::abs(loss - ref_loss) < 1e-4);
        }
        Dict mine;
        for (const auto& item : model->named_parameters()) mine.insert(item.key(), item.value().detach());
        check_params(mine, reference);
      } else {
        TpGpt resumed(dp2, tp2, kVocab, /*seed=*/7);
        fsdp::dcp::load(dir, resumed.root(), resumed.opt.get(), &restored,
                        fsdp::dcp::LoadOptions().communicator(fresh_comm()));
        for (int64_t it = 2; it < 4; ++it) {
          const double loss = resumed.step(it);
          const double ref_loss = reference_step(reference, ref_opt, it, dp2, resumed.mesh->coordinate("dp"));
          CHECK(std::abs(loss - ref_loss) < 1e-4);
        }
        check_params(resumed.global_params(), reference);
      }
      CHECK(restored.values["step"] == "2");
    }
    // A model whose global shapes differ (a larger vocabulary) is refused on every rank, unchanged.
    const auto [dp2, tp2] = meshes.back();
    TpGpt wider(dp2, tp2, 2 * kVocab);
    const Dict before = wider.global_params();
    CHECK_THROWS_WITH(fsdp::dcp::load(dir, wider.root(), wider.opt.get(), nullptr,
                                      fsdp::dcp::LoadOptions().communicator(fresh_comm())),
                      Contains("fsdp::dcp::load") && Contains("key 'tok_emb.weight' has shape [24, 24]") &&
                          Contains("[48, 24] here") && Contains("nothing was loaded"));
    check_equal(wider.global_params(), before);
  }
}

FSDP_RANKS_TEST_CASE("TP load_pretrained: each rank reads its TP x DP slice; the model equals the file",
                     "[tp][checkpoint][load_pretrained]") {
  const std::string dir = fsdp::testing::shared_tmpdir() + "/tp_pretrained";
  auto source = make_gpt(kVocab, /*seed=*/3);
  Dict file;
  for (const auto& item : source->named_parameters()) file.insert(item.key(), item.value().detach().clone());
  if (rank() == 0) fsdp::save_safetensors(dir, file);
  world().barrier();
  for (const auto& [dp, tp] : meshes_of_world()) {
    INFO("mesh (dp=" << dp << ", tp=" << tp << ")");
    TpGpt run(dp, tp);
    const auto result = fsdp::load_pretrained(run.root(), dir);
    check_equal(run.global_params(), file);
    // Bytes read: this rank's elements of every value, no more.
    int64_t elements = 0;
    for (const auto& [key, shard] : fsdp::sharded_state_dict(run.root())) elements += shard.local.numel();
    CHECK(result.stats.bytes_read == elements * 4);
  }
}
