// Resume parity across world sizes (tests/checkpoint/resume_test.sh), under mpirun:
//   resume_main train CKPT K [--mp] [--strategy full|grad_op|no_shard]
//       trains K AdamW steps of a fully_shard MlpStack on this launch's ranks and saves model,
//       optimizer and the step to CKPT (fsdp::dcp::save).
//   resume_main resume CKPT N [--mp] [--strategy ...]
//       loads CKPT into a fresh sharded model and optimizer (any world size and strategy), trains
//       up to step N, and compares every parameter with an uninterrupted unsharded run computed
//       here without the library: the same initial weights, each step's global batch of 12 rows
//       split over the ranks that trained that step (the saving launch's world size up to K, this
//       one's after), gradients averaged over ranks; with --mp the reference computes each rank's
//       gradients with bf16 copies of the fp32 parameters and sums them in fp32, as fully_shard's
//       mixed precision does.
// Exit status 0 when every parameter matches (rtol 1e-5, atol 1e-6).
//   resume_main resume CKPT N --model-only
//       the control: loads only the model (a fresh AdamW), which must NOT match; exit status 0
//       when some parameter differs, showing the comparison sees the optimizer state.

#include <cstdio>
#include <cstdlib>
#include <string>

#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>
#include <torch/torch.h>

#include "fsdp_cpp/checkpoint/distributed_checkpoint.h"
#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/tests/composable/test_models.h"

namespace {

using fsdp::testing::MlpStack;

constexpr int64_t kRows = 12;  // global batch: divisible by 1, 2, 3 and 4 ranks
constexpr double kLr = 1e-2;

struct Args {
  std::string mode, ckpt;
  int64_t steps = 0;
  bool mp = false;
  bool model_only = false;
  fsdp::ShardingStrategy strategy = fsdp::ShardingStrategy::kFullShard;
};

// Rows [q * kRows / W, (q + 1) * kRows / W) of step `it`'s global batch: the inputs and targets.
std::pair<at::Tensor, at::Tensor> batch(int64_t it, int q, int W) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(500 + it));
  const at::Tensor x = at::randn({kRows, 6}, gen);
  const at::Tensor y = at::randn({kRows, 3}, gen);
  const int64_t per = kRows / W;
  return {x.narrow(0, q * per, per), y.narrow(0, q * per, per)};
}

MlpStack make_model() {
  torch::manual_seed(11);
  return MlpStack(6, 8, 16, 2, 3);
}

fsdp::FSDPModule shard(const MlpStack& model, const Args& a) {
  auto options = fsdp::FullyShardOptions().strategy(a.strategy);
  if (a.mp) options.mixed_precision(fsdp::MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat));
  for (size_t i = 0; i < model->blocks->size(); ++i) fsdp::fully_shard(model->block(i), options);
  return fsdp::fully_shard(model, options);
}

torch::optim::AdamW make_optimizer(const MlpStack& model) {
  return torch::optim::AdamW(model->parameters(), torch::optim::AdamWOptions(kLr).weight_decay(0.05));
}

void sharded_step(MlpStack& model, torch::optim::AdamW& optim, int64_t it, int rank, int W, bool mp) {
  auto [x, y] = batch(it, rank, W);
  torch::nn::functional::mse_loss(model(x).to(at::kFloat), y).backward();
  optim.step();
  optim.zero_grad();
}

// The unsharded reference's step `it` over W ranks' batches.
void reference_step(MlpStack& model, torch::optim::AdamW& optim, int64_t it, int W, bool mp) {
  const auto param_dtype = mp ? at::kBFloat16 : at::kFloat;
  std::vector<at::Tensor> params = model->parameters();
  std::vector<at::Tensor> masters, sums;
  for (auto& p : params) {
    masters.push_back(p.detach().clone());
    sums.push_back(at::zeros_like(p));
  }
  for (int q = 0; q < W; ++q) {
    for (size_t i = 0; i < params.size(); ++i) params[i].set_data(masters[i].to(param_dtype));
    auto [x, y] = batch(it, q, W);
    torch::nn::functional::mse_loss(model(x.to(param_dtype)).to(at::kFloat), y).backward();
    for (size_t i = 0; i < params.size(); ++i) {
      sums[i].add_(params[i].grad().to(at::kFloat));
      params[i].mutable_grad() = at::Tensor();
    }
  }
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].set_data(masters[i]);
    params[i].mutable_grad() = sums[i] / W;
  }
  optim.step();
  optim.zero_grad();
}

int train(const Args& a, const fsdp::comm::Communicator& comm) {
  MlpStack model = make_model();
  auto root = shard(model, a);
  auto optim = make_optimizer(model);
  for (int64_t it = 1; it <= a.steps; ++it) sharded_step(model, optim, it, comm.rank(), comm.size(), a.mp);
  fsdp::dcp::Extra extra;
  extra.values["step"] = std::to_string(a.steps);
  extra.values["world_size"] = std::to_string(comm.size());
  fsdp::dcp::save(a.ckpt, root, &optim, extra);
  if (comm.rank() == 0) std::printf("trained %lld steps on %d ranks, saved %s\n", static_cast<long long>(a.steps), comm.size(), a.ckpt.c_str());
  return 0;
}

int resume(const Args& a, const fsdp::comm::Communicator& comm) {
  torch::manual_seed(999);  // a different initialisation: everything must come from the checkpoint
  MlpStack model(6, 8, 16, 2, 3);
  auto root = shard(model, a);
  auto optim = make_optimizer(model);
  fsdp::dcp::Extra extra;
  fsdp::dcp::load(a.ckpt, root, a.model_only ? nullptr : &optim, &extra);
  const int64_t saved_step = std::stoll(extra.values.at("step"));
  const int saved_world = std::stoi(extra.values.at("world_size"));
  for (int64_t it = saved_step + 1; it <= a.steps; ++it) sharded_step(model, optim, it, comm.rank(), comm.size(), a.mp);
  const auto resumed = fsdp::full_state_dict(root, fsdp::FullStateDictOptions().rank0_only(false));

  MlpStack reference = make_model();
  auto ref_optim = make_optimizer(reference);
  for (int64_t it = 1; it <= a.steps; ++it) reference_step(reference, ref_optim, it, it <= saved_step ? saved_world : comm.size(), a.mp);

  int mismatches = 0;
  for (const auto& item : reference->named_parameters()) {
    const at::Tensor& value = resumed[item.key()];
    if (!torch::allclose(value, item.value(), 1e-5, 1e-6)) {
      if (a.model_only) {
        ++mismatches;
        continue;
      }
      std::fprintf(stderr, "rank %d: '%s' differs from the uninterrupted run by %g\n", comm.rank(), item.key().c_str(),
                   (value - item.value()).abs().max().item<double>());
      ++mismatches;
    }
  }
  if (mismatches == 0 && comm.rank() == 0) {
    std::printf("resumed at step %lld on %d ranks (saved on %d), trained to step %lld: %zu parameters equal the "
                "uninterrupted run\n", static_cast<long long>(saved_step), comm.size(), saved_world,
                static_cast<long long>(a.steps), reference->named_parameters().size());
  }
  if (a.model_only) {
    if (comm.rank() == 0) {
      std::printf("model only (fresh AdamW): %d of %zu parameters differ from the uninterrupted run\n", mismatches,
                  reference->named_parameters().size());
    }
    return mismatches > 0 ? 0 : 1;
  }
  return mismatches == 0 ? 0 : 1;
}

Args parse(int argc, char** argv) {
  Args a;
  if (argc < 4) throw std::invalid_argument("usage: resume_main train|resume CKPT STEPS [--mp] [--strategy full|grad_op|no_shard]");
  a.mode = argv[1];
  a.ckpt = argv[2];
  a.steps = std::stoll(argv[3]);
  for (int i = 4; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--mp") {
      a.mp = true;
    } else if (flag == "--model-only") {
      a.model_only = true;
    } else if (flag == "--strategy" && i + 1 < argc) {
      const std::string s = argv[++i];
      a.strategy = s == "grad_op" ? fsdp::ShardingStrategy::kShardGradOp
                   : s == "no_shard" ? fsdp::ShardingStrategy::kNoShard
                                     : fsdp::ShardingStrategy::kFullShard;
    } else {
      throw std::invalid_argument("unexpected argument '" + flag + "'");
    }
  }
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  auto group = fsdp::comm::init_process_group();
  const auto& comm = *group.comm;
  try {
    const Args a = parse(argc, argv);
    if (a.mode == "train") return train(a, comm);
    if (a.mode == "resume") return resume(a, comm);
    throw std::invalid_argument("unknown mode '" + a.mode + "'");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "resume_main: error on rank %d: %s\n", comm.rank(), e.what());
  }
  return 1;
}
