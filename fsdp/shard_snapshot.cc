#include "fsdp_cpp/fsdp/shard_snapshot.h"

#include <algorithm>

#include <ATen/ops/cat.h>
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

// Evenly spaced elements of every shard (about kSampledElements each), as bytes, concatenated
// into one tensor per device (in order of first appearance), so that comparing two snapshots
// synchronizes once per device, not once per FlatParameter.
std::vector<at::Tensor> sampled_bytes(const std::vector<FSDPState*>& units) {
  c10::NoGradGuard no_grad;
  std::vector<at::Device> devices;
  std::vector<std::vector<at::Tensor>> parts;
  for (const FSDPState* unit : units) {
    for (const auto& h : unit->handles()) {
      const at::Tensor& shard = h->local_shard();
      const int64_t n = shard.numel();
      const int64_t stride = std::max<int64_t>(1, n / ShardSnapshot::kSampledElements);
      const at::Tensor sample = shard.view({-1}).slice(0, 0, n, stride).contiguous().view(at::kByte);
      const auto it = std::find(devices.begin(), devices.end(), shard.device());
      if (it == devices.end()) {
        devices.push_back(shard.device());
        parts.push_back({sample});
      } else {
        parts[static_cast<size_t>(it - devices.begin())].push_back(sample);
      }
    }
  }
  std::vector<at::Tensor> bytes;
  for (const auto& p : parts) bytes.push_back(at::cat(p));
  return bytes;
}

}  // namespace

void ShardSnapshot::take(const std::vector<FSDPState*>& units) {
  samples_ = sampled_bytes(units);
  version_ = summed_version(units);
  taken_ = true;
}

bool ShardSnapshot::changed(const std::vector<FSDPState*>& units) const {
  if (!taken_) return false;
  if (summed_version(units) != version_) return true;
  const std::vector<at::Tensor> now = sampled_bytes(units);
  if (now.size() != samples_.size()) return true;
  for (size_t i = 0; i < now.size(); ++i) {
    if (now[i].device() != samples_[i].device() || now[i].sizes() != samples_[i].sizes() ||
        !at::equal(now[i], samples_[i])) {
      return true;
    }
  }
  return false;
}

void ShardSnapshot::clear() {
  taken_ = false;
  samples_.clear();
}

}  // namespace fsdp
