// fsdp::optim::Muon (with fsdp::optim::AdamW for the rest) on a fully_shard model against
// torch.optim.Muon on the unsharded model (tests/optim/muon_torch_reference.py), on this launch's
// world size: the same initial parameters and batches, five steps, then every parameter, every Muon
// momentum buffer (Muon::state_dict, by FQN) and the losses must agree within float32 tolerance
// (rtol 1e-5, atol 1e-5), in two configurations (torch's defaults; two param groups with every
// option changed). Prints the largest differences.
// Every rank trains on the whole batch, so that the gradients Muon steps with are torch's bit for bit
// (fully_shard's reduce-scatter of W equal copies, divided by W). The reason: torch's Newton-Schulz
// runs in bfloat16, and gradients that differ by float32 rounding, as sums over the ranks' rows in
// another order do (1e-6 relative), flip bfloat16 roundings: measured with torch.optim.Muon alone on
// this model, 1e-6 relative noise on the gradients moves parameters by up to 1.2e-3 after five
// steps. So a split batch compares rounding luck, not the optimizer (it failed at W=3 on one CPU and
// passed on another). Gradients over split batches are the parity tests' subject; the sharded
// optimizer against an unsharded one on the same gradients, bit for bit, is muon_test's.
// usage: mpirun -np N muon_torch_main TORCH_OUT_DIR
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>

#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/contract/hookable_modules.h"
#include "fsdp_cpp/optim/adamw.h"
#include "fsdp_cpp/optim/muon.h"
#include "fsdp_cpp/storage/safetensors.h"

namespace {

constexpr int kSteps = 5;

struct NetImpl : torch::nn::Module {
  NetImpl() {
    l0 = register_module("l0", fsdp::contract::Linear(10, 24));
    l1 = register_module("l1", fsdp::contract::Linear(24, 7));
    l2 = register_module("l2", fsdp::contract::Linear(torch::nn::LinearOptions(7, 7).bias(false)));
    head = register_module("head", fsdp::contract::Linear(7, 3));
  }
  at::Tensor forward(at::Tensor x) {
    x = at::tanh(l0(x));
    x = at::tanh(l1(x));
    x = at::tanh(l2(x));
    return head(x);
  }
  fsdp::contract::Linear l0{nullptr}, l1{nullptr}, l2{nullptr}, head{nullptr};
};
FSDP_HOOKABLE_MODULE(Net);

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s TORCH_OUT_DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  auto pg = fsdp::comm::init_process_group();
  const int rank = pg.comm->rank(), world = pg.comm->size();
  int failures = 0;
  {
    fsdp::storage::SafetensorsFile inputs(dir + "/inputs.safetensors");
    fsdp::storage::SafetensorsFile results(dir + "/results.safetensors");
    auto in = [&](const std::string& key) { return inputs.read_tensor(inputs.header().at(key)); };
    auto want = [&](const std::string& key) { return results.read_tensor(results.header().at(key)); };
    auto compare = [&](const std::string& what, const at::Tensor& mine, const at::Tensor& theirs) {
      const bool same_shape = mine.sizes() == theirs.sizes();
      const double err = same_shape ? (mine.to(at::kDouble) - theirs.to(at::kDouble)).abs().max().item<double>() : -1;
      const bool ok = same_shape && at::allclose(mine.to(at::kDouble), theirs.to(at::kDouble), 1e-5, 1e-5);
      std::printf("W=%d %-40s max |diff| %.3g%s\n", world, what.c_str(), err, ok ? "" : "  FAILED");
      if (!ok) ++failures;
      return err;
    };
    for (const std::string config : {"default", "variant"}) {
      Net model;
      {
        at::NoGradGuard no_grad;
        for (auto& item : model->named_parameters()) item.value().copy_(in("init." + item.key()));
      }
      for (auto* layer : {model->l0.ptr().get(), model->l1.ptr().get(), model->l2.ptr().get()}) {
        fsdp::fully_shard(*layer);
      }
      auto root = fsdp::fully_shard(*model);
      auto split = fsdp::optim::split_muon_params(*model, {"head"});
      std::vector<torch::optim::OptimizerParamGroup> groups;
      fsdp::optim::MuonOptions defaults(0.02);
      if (config == "default") {
        groups.emplace_back(split.muon);
      } else {
        // The split gives l0.weight, l1.weight, l2.weight in that order.
        groups.emplace_back(std::vector<at::Tensor>{split.muon[0], split.muon[1]});
        groups.emplace_back(std::vector<at::Tensor>{split.muon[2]},
                            std::make_unique<fsdp::optim::MuonOptions>(fsdp::optim::MuonOptions(0.01)
                                                                           .weight_decay(0.01)
                                                                           .momentum(0.9)
                                                                           .nesterov(true)
                                                                           .ns_coefficients({1.875, -1.25, 0.375})
                                                                           .eps(1e-5)
                                                                           .ns_steps(6)
                                                                           .adjust_lr_fn("spectral_unclamped")));
        defaults = fsdp::optim::MuonOptions(0.05)
                       .weight_decay(0.01)
                       .momentum(0.9)
                       .nesterov(false)
                       .ns_coefficients({1.875, -1.25, 0.375})
                       .eps(1e-5)
                       .ns_steps(6)
                       .adjust_lr_fn("match_rms_adamw");
      }
      fsdp::optim::Muon muon(*model, groups, defaults);
      if (rank == 0) {
        for (const auto& group : muon.param_groups()) {
          const auto& o = static_cast<const fsdp::optim::MuonOptions&>(group.options());
          std::printf("W=%d %s group of %zu: lr %g weight_decay %g momentum %g nesterov %d ns_coefficients (%g, %g, %g) "
                      "eps %g ns_steps %lld adjust_lr_fn %s\n",
                      world, config.c_str(), group.params().size(), o.lr(), o.weight_decay(), o.momentum(),
                      static_cast<int>(o.nesterov()), o.ns_coefficients()[0], o.ns_coefficients()[1],
                      o.ns_coefficients()[2], o.eps(), static_cast<long long>(o.ns_steps()),
                      o.adjust_lr_fn() ? o.adjust_lr_fn()->c_str() : "None");
        }
      }
      fsdp::optim::AdamW adamw(split.other, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
      std::vector<double> losses;
      for (int s = 0; s < kSteps; ++s) {
        const at::Tensor x = in("x" + std::to_string(s));  // the whole batch on every rank (see above)
        const at::Tensor y = in("y" + std::to_string(s));
        at::Tensor loss = torch::nn::functional::mse_loss(model(x), y);
        loss.backward();
        muon.step();
        adamw.step();
        muon.zero_grad();
        adamw.zero_grad();
        // The batch's loss: the mean of the ranks' (equal) losses.
        at::Tensor global = loss.detach().clone();
        pg.comm->all_reduce(global).wait();
        losses.push_back(global.item<double>() / world);
        if (s == 0) {
          const auto& stats = muon.last_step();
          std::printf("W=%d rank %d %s step: %lld matrices, %lld orthogonalized here, %lld collectives\n", world, rank,
                      config.c_str(), static_cast<long long>(stats.matrices),
                      static_cast<long long>(stats.orthogonalized), static_cast<long long>(stats.collectives));
          if (stats.collectives != (world > 1 ? 3 : 0)) {
            std::printf("  FAILED: expected %d collectives\n", world > 1 ? 3 : 0);
            ++failures;
          }
        }
      }
      const auto params = fsdp::full_state_dict(root, fsdp::FullStateDictOptions().rank0_only(false));
      const auto state = muon.state_dict();
      if (rank != 0) continue;
      for (const auto& item : params) compare(config + " param " + item.key(), item.value(), want(config + ".param." + item.key()));
      for (const auto& [fqn, buf] : state.state) {
        compare(config + " momentum_buffer " + fqn, buf, want(config + ".momentum_buffer." + fqn));
      }
      if (state.state.size() != 3) {
        std::printf("FAILED: %zu momentum buffers, expected 3\n", state.state.size());
        ++failures;
      }
      compare(config + " losses", at::tensor(losses, at::kDouble), want(config + ".loss"));
    }
  }
  at::Tensor any = at::full({1}, static_cast<double>(failures), at::kDouble);
  pg.comm->all_reduce(any).wait();
  fsdp::comm::destroy_process_group();
  return any.item<double>() == 0 ? 0 : 1;
}
