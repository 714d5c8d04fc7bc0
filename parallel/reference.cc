#include "fsdp_cpp/parallel/reference.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/nn/utils/clip_grad.h>

#include "fsdp_cpp/parallel/rng.h"

namespace fsdp::parallel {

UnshardedReference::UnshardedReference(const ModelSpec& spec, const ParallelOptions& options)
    : spec_(spec), options_(options) {
  TORCH_CHECK(spec.build && spec.loss, "fsdp::parallel::UnshardedReference: expected a ModelSpec with build and loss");
  const int n = options.dims().pp * options.stages_per_rank();
  for (int s = 0; s < n; ++s) parts_.push_back(spec.build(s, n));
}

std::vector<at::Tensor> UnshardedReference::parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& part : parts_) {
    for (const auto& p : part.module->parameters()) out.push_back(p);
  }
  return out;
}

at::Tensor UnshardedReference::forward_backward(int64_t step, const std::vector<Batch>& global) {
  const int m = options_.n_microbatches();
  const int dp = static_cast<int>(global.size());
  TORCH_CHECK(dp >= 1, "fsdp::parallel::UnshardedReference::forward_backward: expected one batch per data rank, "
              "found none");
  // [Note: token-weighted loss] with ModelSpec::ignore_index: each microbatch's mean weighted by
  // its counted targets over those of the whole step.
  double counted = 0;
  if (spec_.ignore_index) {
    for (const auto& b : global) counted += static_cast<double>((b.targets != *spec_.ignore_index).sum().item<int64_t>());
  }
  at::Tensor total;
  for (int q = 0; q < dp; ++q) {
    const auto xs = global[q].inputs.chunk(m, 0), ys = global[q].targets.chunk(m, 0);
    TORCH_CHECK(static_cast<int>(xs.size()) == m && static_cast<int>(ys.size()) == m,
                "fsdp::parallel::UnshardedReference::forward_backward: data rank ", q, "'s batch does not split into ",
                m, " microbatches");
    for (int j = 0; j < m; ++j) {
      at::Tensor h = xs[j];
      for (size_t s = 0; s < parts_.size(); ++s) {
        seed_forward(options_.seed(), step, q, j, static_cast<int64_t>(s));
        h = parts_[s].forward(h);
      }
      at::Tensor loss = spec_.loss(h, ys[j]);
      if (spec_.ignore_index) {
        const double n = static_cast<double>((ys[j] != *spec_.ignore_index).sum().item<int64_t>());
        loss = counted == 0 || n == 0 ? loss.nan_to_num() * 0.0 : loss * (n * m * dp / counted);
      }
      (loss / (m * dp)).backward();
      total = total.defined() ? total + loss.detach() : loss.detach();
    }
  }
  return total / (m * dp);
}

double UnshardedReference::clip_grad_norm_(double max_norm, double norm_type) {
  return torch::nn::utils::clip_grad_norm_(parameters(), max_norm, norm_type);
}

void UnshardedReference::zero_grad() {
  for (auto& part : parts_) part.module->zero_grad();
}

}  // namespace fsdp::parallel
