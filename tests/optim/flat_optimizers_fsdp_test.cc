// fsdp::optim on fully_shard models over MPI, on every world size of the launch (1-4).
//
// Two copies of one model, sharded the same way: one stepped by fsdp::optim's optimizer, one by
// torch::optim's, on the same batches. Both see the same gradients (the same collectives on the
// same values), so after every step every rank's shards of the two must be bitwise equal
// (torch::equal), for FULL_SHARD, SHARD_GRAD_OP and NO_SHARD, mixed precision, CPU offload,
// hybrid sharding (2 and 4 ranks), frozen parameters, gradient clipping, meta-device init and param
// groups that split a FlatParameter; and the flat optimizer must have stepped runs (summed over the
// ranks). The optimizer state dicts of the two are equal under the same keys, and checkpoints
// (optimizer state dicts and fsdp::dcp) move between the two kinds of optimizer.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "fsdp_cpp/checkpoint/distributed_checkpoint.h"
#include "fsdp_cpp/checkpoint/optimizer_state_dict.h"
#include "fsdp_cpp/comm/device_mesh.h"
#include "fsdp_cpp/composable/clip_grad_norm.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/init/meta_init.h"
#include "fsdp_cpp/optim/adam.h"
#include "fsdp_cpp/optim/adamw.h"
#include "fsdp_cpp/optim/sgd.h"
#include "fsdp_cpp/tests/composable/parity.h"
#include "fsdp_cpp/tests/composable/test_models.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using fsdp::FullyShardOptions;
using fsdp::ShardingStrategy;
using fsdp::testing::MlpStack;
using fsdp::testing::rank;
using fsdp::testing::world;
using fsdp::testing::world_size;
using Dict = torch::OrderedDict<std::string, at::Tensor>;

enum class Kind { kAdamW, kAdam, kSgd };

const char* name_of(Kind k) { return k == Kind::kAdamW ? "AdamW" : k == Kind::kAdam ? "Adam" : "SGD"; }

std::shared_ptr<fsdp::comm::Communicator> fresh_comm() {
  return std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
}

// The param groups: one, or two that split block 0's FlatParameter between fc1 and fc2.
std::vector<torch::optim::OptimizerParamGroup> groups(const MlpStack& model, Kind kind, bool split) {
  auto options = [kind](int g) -> std::unique_ptr<torch::optim::OptimizerOptions> {
    const double lr = g == 0 ? 1e-2 : 3e-2;
    switch (kind) {
      case Kind::kAdamW:
        return std::make_unique<torch::optim::AdamWOptions>(
            torch::optim::AdamWOptions(lr).betas({0.8, 0.95}).weight_decay(g == 0 ? 0.05 : 0).amsgrad(g == 1));
      case Kind::kAdam:
        return std::make_unique<torch::optim::AdamOptions>(
            torch::optim::AdamOptions(lr).weight_decay(g == 0 ? 0 : 0.01).amsgrad(g == 0));
      case Kind::kSgd:
        return std::make_unique<torch::optim::SGDOptions>(
            torch::optim::SGDOptions(lr).momentum(0.9).dampening(g == 0 ? 0 : 0.1).nesterov(g == 0).weight_decay(0.01));
    }
    return nullptr;
  };
  std::vector<at::Tensor> first, second;
  for (const auto& item : model->named_parameters()) {
    const bool in_first = !split || item.key().rfind("in.", 0) == 0 || item.key().rfind("blocks.0.fc1.", 0) == 0;
    (in_first ? first : second).push_back(item.value());
  }
  std::vector<torch::optim::OptimizerParamGroup> g;
  g.emplace_back(first, options(0));
  if (split) g.emplace_back(second, options(1));
  return g;
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const MlpStack& model, Kind kind, bool flat, bool split) {
  auto g = groups(model, kind, split);
  switch (kind) {
    case Kind::kAdamW:
      if (flat) return std::make_unique<fsdp::optim::AdamW>(g);
      return std::make_unique<torch::optim::AdamW>(g);
    case Kind::kAdam:
      if (flat) return std::make_unique<fsdp::optim::Adam>(g);
      return std::make_unique<torch::optim::Adam>(g);
    case Kind::kSgd:
      if (flat) return std::make_unique<fsdp::optim::SGD>(g, torch::optim::SGDOptions(1e-2));
      return std::make_unique<torch::optim::SGD>(g, torch::optim::SGDOptions(1e-2));
  }
  return nullptr;
}

fsdp::optim::FlatStepping& flat_of(torch::optim::Optimizer& opt) { return dynamic_cast<fsdp::optim::FlatStepping&>(opt); }

struct Setup {
  std::string name;
  std::function<FullyShardOptions()> options;
  bool meta = false;
  bool frozen = false;
  bool clip = false;
  bool split_groups = false;
};

std::vector<Setup> setups() {
  auto base = [] { return FullyShardOptions().communicator(fresh_comm()); };
  std::vector<Setup> s{
      {"full shard", base},
      {"shard grad op", [base] { return base().strategy(ShardingStrategy::kShardGradOp); }},
      {"no shard", [base] { return base().strategy(ShardingStrategy::kNoShard); }},
      {"mixed precision (bf16 parameters, fp32 reduce)",
       [base] { return base().mixed_precision(fsdp::MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat)); }},
      {"cpu offload", [base] { return base().offload_to_cpu(true); }},
      {"frozen parameters", base, false, true},
      {"gradient clipping", base, false, false, true},
      {"meta-device init", base, true},
      {"param groups inside a FlatParameter", base, false, false, false, true},
  };
  const int W = world_size();
  if (W == 2 || W == 4) {
    s.push_back({"hybrid", [W] { return FullyShardOptions().mesh(fsdp::comm::DeviceMesh::hybrid(world(), W / 2)); }});
  }
  return s;
}

at::Tensor batch(int it, int salt) {
  auto g = at::detail::createCPUGenerator(static_cast<uint64_t>(1000 * it + 10 * rank() + salt));
  return at::randn({4, salt == 1 ? 6 : 3}, g);
}

// A sharded model and its optimizer.
struct Trained {
  MlpStack model{nullptr};
  std::vector<fsdp::FSDPModule> units;
  std::unique_ptr<torch::optim::Optimizer> opt;
};

Trained make(const Setup& setup, Kind kind, bool flat) {
  Trained t;
  torch::manual_seed(11);
  if (setup.meta) {
    fsdp::MetaInitGuard guard;
    t.model = MlpStack(6, 8, 16, 3, 3);
  } else {
    t.model = MlpStack(6, 8, 16, 3, 3);
  }
  if (setup.frozen) {
    t.model->block(1)->fc1->weight.requires_grad_(false);
    t.model->in->bias.requires_grad_(false);
  }
  t.units = fsdp::testing::shard_stack(t.model, setup.options());
  t.opt = make_optimizer(t.model, kind, flat, setup.split_groups);
  return t;
}

void train_step(Trained& t, const Setup& setup, int it) {
  torch::nn::functional::mse_loss(t.model(batch(it, 1)), batch(it, 2)).backward();
  if (setup.clip) fsdp::clip_grad_norm_(t.units.back(), 0.05);
  t.opt->step();
  t.opt->zero_grad();
}

// Every rank's shards of the two models bitwise equal.
void check_same_shards(Trained& a, Trained& b) {
  auto pa = a.model->named_parameters();
  auto pb = b.model->named_parameters();
  REQUIRE(pa.size() == pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    INFO(pa[i].key());
    CHECK(torch::equal(pa[i].value().detach(), pb[i].value().detach()));
  }
}

int64_t sum_over_ranks(int64_t v) {
  at::Tensor t = at::full({1}, v, at::kLong);
  world().all_reduce(t).wait();
  return t.item<int64_t>();
}

}  // namespace

FSDP_RANKS_TEST_CASE("fsdp::optim steps fully_shard models bit for bit as torch::optim", "[optim]") {
  for (const Setup& setup : setups()) {
    for (Kind kind : {Kind::kAdamW, Kind::kAdam, Kind::kSgd}) {
      INFO(setup.name << ", " << name_of(kind) << ", world size " << world_size());
      for (bool packs : {true, false}) {
        INFO((packs ? "small parameters packed" : "no packs: runs in place"));
        Trained flat = make(setup, kind, true);
        Trained ref = make(setup, kind, false);
        if (!packs) flat_of(*flat.opt).set_pack_max_numel(0);
        for (int it = 0; it < 3; ++it) {
          train_step(flat, setup, it);
          train_step(ref, setup, it);
          check_same_shards(flat, ref);
          const auto& stats = flat_of(*flat.opt).last_step();
          if (packs) {
            // Every parameter with a gradient is small: all in packs.
            CHECK(stats.single_params == 0);
            CHECK(sum_over_ranks(stats.packed_params) > 0);
          } else if (world_size() > 1 || setup.name.rfind("mixed", 0) == 0 || setup.name == "cpu offload") {
            // One rank in the parameters' own dtype and device: autograd's separate gradients
            // ([Note: passthrough backward]), no runs; otherwise the FlatParameters' runs.
            CHECK(sum_over_ranks(stats.flat_params) > 0);
          }
        }
      }
    }
  }
}

FSDP_RANKS_TEST_CASE("Optimizer state dicts and fsdp::dcp move between fsdp::optim and torch::optim", "[optim][checkpoint]") {
  const Setup setup{"full shard", [] { return FullyShardOptions().communicator(fresh_comm()); }};
  for (Kind kind : {Kind::kAdamW, Kind::kSgd}) {
    INFO(name_of(kind) << ", world size " << world_size());
    Trained flat = make(setup, kind, true);
    Trained ref = make(setup, kind, false);
    for (int it = 0; it < 2; ++it) {
      train_step(flat, setup, it);
      train_step(ref, setup, it);
    }
    // The same keys and values, bitwise.
    const auto all = fsdp::FullStateDictOptions().rank0_only(false);
    const Dict full_flat = fsdp::full_optimizer_state_dict(flat.units.back(), *flat.opt, all);
    const Dict full_ref = fsdp::full_optimizer_state_dict(ref.units.back(), *ref.opt, all);
    REQUIRE(full_flat.keys() == full_ref.keys());
    for (const auto& item : full_ref) {
      INFO(item.key());
      CHECK(torch::equal(full_flat[item.key()], item.value()));
    }

    // Full dicts across: the flat optimizer's into a fresh torch::optim one and the other way.
    Trained ref_from_flat = make(setup, kind, false);
    Trained flat_from_ref = make(setup, kind, true);
    fsdp::load_full_state_dict(ref_from_flat.units.back(), fsdp::full_state_dict(flat.units.back(), all));
    fsdp::load_full_state_dict(flat_from_ref.units.back(), fsdp::full_state_dict(ref.units.back(), all));
    fsdp::load_full_optimizer_state_dict(ref_from_flat.units.back(), *ref_from_flat.opt, full_flat);
    fsdp::load_full_optimizer_state_dict(flat_from_ref.units.back(), *flat_from_ref.opt, full_ref);

    // fsdp::dcp across: saved with one kind, loaded into the other.
    const std::string dir_flat = fsdp::testing::shared_tmpdir() + "/optim_flat_" + name_of(kind);
    const std::string dir_ref = fsdp::testing::shared_tmpdir() + "/optim_ref_" + name_of(kind);
    fsdp::dcp::save(dir_flat, flat.units.back(), flat.opt.get(), {}, fsdp::dcp::SaveOptions().communicator(fresh_comm()));
    fsdp::dcp::save(dir_ref, ref.units.back(), ref.opt.get(), {}, fsdp::dcp::SaveOptions().communicator(fresh_comm()));
    Trained ref_from_dcp = make(setup, kind, false);
    Trained flat_from_dcp = make(setup, kind, true);
    fsdp::dcp::load(dir_flat, ref_from_dcp.units.back(), ref_from_dcp.opt.get(), nullptr,
                    fsdp::dcp::LoadOptions().communicator(fresh_comm()));
    fsdp::dcp::load(dir_ref, flat_from_dcp.units.back(), flat_from_dcp.opt.get(), nullptr,
                    fsdp::dcp::LoadOptions().communicator(fresh_comm()));

    // Sharded dict of torch::optim's into a never-stepped flat optimizer.
    Trained flat_from_sharded = make(setup, kind, true);
    fsdp::load_full_state_dict(flat_from_sharded.units.back(), fsdp::full_state_dict(ref.units.back(), all));
    fsdp::load_sharded_optimizer_state_dict(flat_from_sharded.units.back(), *flat_from_sharded.opt,
                                            fsdp::sharded_optimizer_state_dict(ref.units.back(), *ref.opt));

    // All continue exactly as the originals do.
    for (int it = 2; it < 4; ++it) {
      for (Trained* t : {&flat, &ref, &ref_from_flat, &flat_from_ref, &ref_from_dcp, &flat_from_dcp, &flat_from_sharded}) {
        train_step(*t, setup, it);
      }
      check_same_shards(flat, ref);
      check_same_shards(ref_from_flat, ref);
      check_same_shards(flat_from_ref, ref);
      check_same_shards(ref_from_dcp, ref);
      check_same_shards(flat_from_dcp, ref);
      check_same_shards(flat_from_sharded, ref);
    }
    CHECK(sum_over_ranks(flat_of(*flat_from_dcp.opt).last_step().packed_params) > 0);
  }
}
