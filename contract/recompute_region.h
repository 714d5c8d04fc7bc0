#pragma once
// Whether the current thread runs a forward whose activations are recomputed in backward
// (activation checkpointing), so that APIs whose hooks act once per forward can tell: the first
// forward runs without keeping activations ("discarding"), and backward runs it again
// ("recomputing"). The API that recomputes marks both; the others only read.
//
//   {
//     fsdp::contract::RecomputeRegionGuard region(fsdp::contract::RecomputePhase::kDiscarding, *block);
//     out = forward(args);   // a hook inside sees current_recompute_region().module == block
//   }

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace fsdp::contract {

enum class RecomputePhase {
  kNone,         // an ordinary forward (or none)
  kDiscarding,   // a forward whose activations are not kept: it will run again in backward
  kRecomputing,  // that forward running again in backward
};

struct RecomputeRegion {
  RecomputePhase phase = RecomputePhase::kNone;
  /// The module whose forward is discarded or recomputed (null with kNone).
  const torch::nn::Module* module = nullptr;
};

/// The innermost region of the current thread.
RecomputeRegion current_recompute_region();

/// Marks the current thread's region for its lifetime (regions nest; the previous one returns).
class RecomputeRegionGuard {
 public:
  RecomputeRegionGuard(RecomputePhase phase, const torch::nn::Module& module);
  ~RecomputeRegionGuard();
  RecomputeRegionGuard(const RecomputeRegionGuard&) = delete;
  RecomputeRegionGuard& operator=(const RecomputeRegionGuard&) = delete;

 private:
  RecomputeRegion previous_;
};

}  // namespace fsdp::contract
