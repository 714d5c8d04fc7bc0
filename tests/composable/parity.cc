#include "fsdp_cpp/tests/composable/parity.h"

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "fsdp_cpp/composable/fully_shard_internal.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace fsdp::testing {
namespace {

using fsdp::comm::CollectiveKind;

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Optim kind, std::vector<at::Tensor> params) {
  switch (kind) {
    case Optim::kSgdMomentum:
      return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9));
    case Optim::kAdam:
      return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2));
    case Optim::kAdamW:
      return std::make_unique<torch::optim::AdamW>(
          params, torch::optim::AdamWOptions(1e-2).weight_decay(0.05));
  }
  return nullptr;
}

at::Tensor batch(int64_t iteration, int q, int64_t rows, int64_t cols, int salt) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(100000 * salt + 100 * iteration + q));
  return at::randn({rows, cols}, gen);
}

std::vector<std::string> keys_of(const torch::nn::Module& m) {
  std::vector<std::string> keys;
  for (const auto& item : m.named_parameters()) keys.push_back(item.key());
  return keys;
}

}  // namespace

CollectiveCounts expected_counts(const std::vector<fsdp::FSDPModule>& units, int forward_calls_per_unit) {
  CollectiveCounts counts;
  for (size_t u = 0; u < units.size(); ++u) {
    const bool is_root = u + 1 == units.size();
    const auto& config = fsdp::detail::state_of(units[u]).config();
    for (const auto& h : fsdp::detail::handles_of(units[u])) {
      const bool trainable = h->requires_grad();
      if (h->is_sharded_strategy()) {
        // Forward (once per call when resharded after each) and backward (once per call: the
        // unit is resharded after each call's backward), or once when kept unsharded.
        const bool reshards = config.reshard_after_forward() && !is_root;
        // reshard_after_forward(int): backward's all-gathers run inside the post-forward group
        // (counted by its communicator, not this one).
        const bool to_group = reshards && config.post_forward_group != nullptr;
        counts.all_gathers += reshards ? (to_group ? 1 : 2) * forward_calls_per_unit : 1;
        // separate_reduce_communicator: counted on the duplicate, not on this communicator.
        counts.reduce_scatters += trainable && !config.reduce_group ? 1 : 0;
      } else if (config.comm->size() > 1) {  // NO_SHARD: all-reduced; one rank: nothing
        counts.all_reduces += trainable && !config.reduce_group ? 1 : 0;
      }
      const auto& replicate = config.replicate;
      counts.all_reduces += replicate && replicate->size() > 1 && trainable ? 1 : 0;
    }
  }
  // Each backward pass begins with the ranks agreeing where it reaches the units ([Note: backward
  // reach] in fsdp/backward_reach.h): one small all-reduce over the root's communicator, and one
  // over the replicate group under hybrid sharding.
  const auto& root = fsdp::detail::state_of(units.back()).config();
  counts.all_reduces += root.comm->size() > 1 ? 1 : 0;
  counts.all_reduces += root.replicate && root.replicate->size() > 1 ? 1 : 0;
  return counts;
}

void run_parity(const Scenario& scenario, const ParityOptions& options) {
  const int W = world_size();
  const bool exact = W == 1;
  INFO(scenario.name << ", optimizer " << static_cast<int>(options.optim) << ", set_to_none "
                     << options.set_to_none << ", " << options.micro_batches
                     << " micro-batch(es), strategy " << static_cast<int>(options.shard_options.strategy())
                     << ", " << W << " ranks");
  auto close = [&](const at::Tensor& a, const at::Tensor& b) {
    return exact ? a.equal(b) : at::allclose(a, b, options.rtol, options.atol);
  };
  torch::manual_seed(1234);
  Instance sharded = scenario.make();
  torch::manual_seed(1234);
  Instance reference = scenario.make();

  const auto keys_before = keys_of(*sharded.module);
  std::vector<const void*> impls_before;
  for (const auto& p : sharded.module->parameters()) impls_before.push_back(p.unsafeGetTensorImpl());

  auto build_optimizer = [&](torch::nn::Module& m) {
    return options.make_optimizer ? options.make_optimizer(m) : make_optimizer(options.optim, m.parameters());
  };
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (options.optimizer_before_shard) opt = build_optimizer(*sharded.module);
  auto shard_options = options.shard_options;
  std::vector<std::shared_ptr<fsdp::comm::Communicator>> comms;  // whose collectives are counted
  if (shard_options.mesh()) {
    comms = {shard_options.mesh()->shard_group(), shard_options.mesh()->replicate_group()};
    for (auto& c : comms) c->reset_stats();
  } else {
    comms = {std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU)};
    shard_options.communicator(comms[0]);
  }
  auto calls = [&](CollectiveKind kind) {
    int64_t n = 0;
    for (const auto& c : comms) n += c->stats(kind).calls;
    return n;
  };
  auto units = sharded.shard(shard_options);
  REQUIRE(!units.empty());
  CHECK(keys_of(*sharded.module) == keys_before);
  if (!opt) opt = build_optimizer(*sharded.module);
  auto ref_opt = build_optimizer(*reference.module);
  std::vector<const void*> impls_in_optimizer;
  for (const auto& group : opt->param_groups()) {
    for (const auto& p : group.params()) impls_in_optimizer.push_back(p.unsafeGetTensorImpl());
  }
  std::vector<const void*> sorted_before = impls_before;
  std::sort(sorted_before.begin(), sorted_before.end());
  std::sort(impls_in_optimizer.begin(), impls_in_optimizer.end());
  CHECK(impls_in_optimizer == sorted_before);

  // Counted from the second iteration on: the first checks the forward order across ranks.
  CollectiveCounts per_pass;

  const int64_t rows = 5;
  for (int64_t it = 0; it < options.iterations; ++it) {
    const auto ag_before = calls(CollectiveKind::kAllGather);
    const auto rs_before = calls(CollectiveKind::kReduceScatter);
    const auto ar_before = calls(CollectiveKind::kAllReduce);
    at::Tensor loss;
    for (int m = 0; m < options.micro_batches; ++m) {
      const int64_t step = it * options.micro_batches + m;
      at::Tensor x = batch(step, rank(), rows, scenario.in_dim, 1);
      at::Tensor y = batch(step, rank(), rows, scenario.out_dim, 2);
      loss = torch::nn::functional::mse_loss(sharded.forward(x, rank()), y);
      loss.backward();
    }
    opt->step();
    opt->zero_grad(options.set_to_none);

    at::Tensor ref_loss;
    for (int m = 0; m < options.micro_batches; ++m) {
      const int64_t step = it * options.micro_batches + m;
      for (int q = 0; q < W; ++q) {
        at::Tensor lq = torch::nn::functional::mse_loss(
            reference.forward(batch(step, q, rows, scenario.in_dim, 1), q),
            batch(step, q, rows, scenario.out_dim, 2));
        (lq / W).backward();
        if (q == rank()) ref_loss = lq.detach();
      }
    }
    ref_opt->step();
    ref_opt->zero_grad(options.set_to_none);

    INFO("iteration " << it << ": loss " << loss.item<double>() << " reference " << ref_loss.item<double>());
    CHECK(close(loss.detach(), ref_loss));
    for (const auto& u : units) {
      for (const auto& h : fsdp::detail::handles_of(u)) CHECK(h->unsharded_bytes() == 0);
    }
    if (it == 0) {
      per_pass = expected_counts(units, 1 + scenario.extra_forward_calls);
      per_pass.all_gathers -= scenario.unreachable_backward_all_gathers;
    }
    if (it >= 1) {
      CHECK(calls(CollectiveKind::kAllGather) - ag_before == options.micro_batches * per_pass.all_gathers);
      CHECK(calls(CollectiveKind::kReduceScatter) - rs_before == options.micro_batches * per_pass.reduce_scatters);
      CHECK(calls(CollectiveKind::kAllReduce) - ar_before == options.micro_batches * per_pass.all_reduces);
    }
  }

  CHECK(keys_of(*sharded.module) == keys_before);
  for (auto& u : units) u.unshard();
  const auto ref_params = reference.module->named_parameters();
  for (const auto& item : sharded.module->named_parameters()) {
    INFO("parameter " << item.key());
    const at::Tensor& ref = ref_params[item.key()];
    REQUIRE(item.value().sizes() == ref.sizes());
    CHECK(close(item.value().detach(), ref.detach()));
  }
  for (auto& u : units) u.reshard();
}

std::vector<fsdp::FSDPModule> shard_stack(const MlpStack& model, const fsdp::FullyShardOptions& options) {
  std::vector<fsdp::FSDPModule> units;
  for (size_t i = 0; i < model->blocks->size(); ++i) units.push_back(fsdp::fully_shard(model->block(i), options));
  units.push_back(fsdp::fully_shard(model, options));
  return units;
}

Scenario mlp_stack_scenario(std::string name, std::function<void(MlpStack&)> prepare) {
  return {std::move(name), 6, 3, [prepare] {
            auto model = MlpStack(6, 8, 16, 3, 3);
            if (prepare) prepare(model);
            Instance inst;
            inst.module = model.ptr();
            inst.forward = [model](torch::Tensor x, int) mutable { return model(x); };
            inst.shard = [model](const fsdp::FullyShardOptions& o) { return shard_stack(model, o); };
            return inst;
          }};
}

}  // namespace fsdp::testing
