#pragma once
// DivergenceCheck: whether this iteration's collectives are checked across the ranks of one root's
// tree ([Note: divergence check] in fsdp/divergence.h), and the check itself.
//
// Invariant: enabled() is decided once per iteration, when it begins (the first iteration, and
// every one with FSDP_DEBUG=1), so every rank checks the same iterations; callers build a
// Fingerprint only when it is set.
//
//   if (context.divergence().enabled()) context.check_ranks_agree(Fingerprint("finished its forward"));

#include <cstdint>
#include <memory>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/fsdp/divergence.h"

namespace fsdp {

class DivergenceCheck {
 public:
  explicit DivergenceCheck(std::shared_ptr<comm::Communicator> comm) : comm_(std::move(comm)) {}

  bool enabled() const { return enabled_; }
  /// An iteration begins after `completed_iterations` ended: checked when it is the first, or
  /// with FSDP_DEBUG=1.
  void begin_iteration(int64_t completed_iterations);

  /// Exchanges `fingerprint` (with `iteration` and the communicator's sequence number) across the
  /// ranks when enabled() and there are several ranks; throws the same error on every rank if they
  /// differ. Collective when it exchanges: every rank must call it at the same point.
  void check(Fingerprint fingerprint, int64_t iteration) const;
  /// The same over `comm` (a unit's own communicator, when it is a subset of the root's ranks:
  /// [Note: units on a subset of the root's ranks] in fsdp/lazy_init.cc).
  void check(comm::Communicator& comm, Fingerprint fingerprint, int64_t iteration) const;

 private:
  std::shared_ptr<comm::Communicator> comm_;
  bool enabled_ = false;
};

}  // namespace fsdp
