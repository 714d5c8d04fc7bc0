#include "fsdp_cpp/fsdp/shard_snapshot.h"

#include <algorithm>

#include <ATen/ops/equal.h>
#include <c10/core/GradMode.h>

#include "fsdp_cpp/fsdp/fsdp_state.h"

namespace fsdp {
namespace {

int64_t summed_version(const std::vector<FSDPState*>& units) {
  int64_t version = 0;
  for (const FSDPState* unit : units) {
    for (const auto& h : unit->handles()) version += h->shard_version();
  }
  return version;
}

// Evenly spaced elements of the 1-D shard (a view; at most about kSampledElements).
at::Tensor sample(const at::Tensor& shard) {
  const int64_t n = shard.numel();
  const int64_t stride = std::max<int64_t>(1, n / ShardSnapshot::kSampledElements);
  return shard.view({-1}).slice(0, 0, n, stride);
}

}  // namespace

void ShardSnapshot::take(const std::vector<FSDPState*>& units) {
  c10::NoGradGuard no_grad;
  samples_.clear();
  for (const FSDPState* unit : units) {
    for (const auto& h : unit->handles()) samples_.push_back(sample(h->local_shard()).clone());
  }
  version_ = summed_version(units);
  taken_ = true;
}

bool ShardSnapshot::changed(const std::vector<FSDPState*>& units) const {
  if (!taken_) return false;
  if (summed_version(units) != version_) return true;
  c10::NoGradGuard no_grad;
  size_t i = 0;
  for (const FSDPState* unit : units) {
    for (const auto& h : unit->handles()) {
      if (i >= samples_.size()) return true;
      const at::Tensor now = sample(h->local_shard());
      if (now.sizes() != samples_[i].sizes() || !at::equal(now, samples_[i])) return true;
      ++i;
    }
  }
  return i != samples_.size();
}

void ShardSnapshot::clear() {
  taken_ = false;
  samples_.clear();
}

}  // namespace fsdp
