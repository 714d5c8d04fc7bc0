#pragma once
// What fsdp::optim's optimizers share beside their torch::optim base: what the last step() did
// (tests and benchmarks read it) and the pack limit ([Note: flat packs]).

#include <cstdint>

namespace fsdp::optim {

/// Runs and parameters of at most this many elements are packed by default.
inline constexpr int64_t kPackMaxNumel = 16384;

struct FlatStepStats {
  int64_t flat_runs = 0;      // runs of several parameters stepped in place as one tensor
  int64_t flat_params = 0;    // parameters in those runs
  int64_t packs = 0;          // packs of small parameters stepped as one tensor ([Note: flat packs])
  int64_t packed_params = 0;  // parameters in those packs
  int64_t single_params = 0;  // parameters stepped on their own (torch::optim's way)
  int64_t adopted = 0;        // state buffers allocated ([Note: flat state])
};

/// The second base of fsdp::optim::Adam, AdamW and SGD.
class FlatStepping {
 public:
  virtual ~FlatStepping() = default;

  /// What the last step did: how many parameters were stepped in runs, in packs, alone.
  const FlatStepStats& last_step() const { return stats_; }

  /// Runs and parameters of at most `numel` elements are packed ([Note: flat packs]); 0: no
  /// packs (every run in place, every other parameter alone).
  void set_pack_max_numel(int64_t numel) { pack_max_numel_ = numel; }
  int64_t pack_max_numel() const { return pack_max_numel_; }

 protected:
  FlatStepStats stats_;
  int64_t pack_max_numel_ = kPackMaxNumel;
};

}  // namespace fsdp::optim
