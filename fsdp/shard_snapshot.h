#pragma once
// ShardSnapshot: what the shards of a tree's units held at one point, to tell later whether they
// were written since ([Note: open iterations] in fsdp/open_iteration.h: an optimizer step inside an
// iteration left open). Two signals, either one counts as a write:
//   - the summed version counters of every shard and of the parameters (FlatParamHandle::
//     shard_version): writes through the parameters or the shard themselves;
//   - up to kSampledElements evenly spaced elements of every shard, compared bit for bit: writes
//     that no version counter sees (LibTorch's SGD updates `p.data()`, a tensor with a counter of
//     its own). An update that leaves every sampled element unchanged is not seen (e.g. one that
//     only touches a parameter smaller than the sampling stride).
// Taking a snapshot copies about kSampledElements elements per FlatParameter (asynchronously);
// comparing copies them again and compares once per device (one synchronization on accelerators).

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace fsdp {

class FSDPState;

class ShardSnapshot {
 public:
  static constexpr int64_t kSampledElements = 1024;

  /// Records the shards of `units` now.
  void take(const std::vector<FSDPState*>& units);
  /// Whether a shard of `units` (the same units as at take()) was written since take(); false
  /// when no snapshot was taken.
  bool changed(const std::vector<FSDPState*>& units) const;
  void clear();

 private:
  bool taken_ = false;
  int64_t version_ = 0;
  std::vector<at::Tensor> samples_;  // the sampled bytes, one tensor per device
};

}  // namespace fsdp
