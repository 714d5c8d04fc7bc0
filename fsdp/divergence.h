#pragma once
// Divergence check: ranks compare what they are about to do before fully_shard's collectives, so
// ranks that run different units, shapes or settings fail with an error naming the first
// divergence on every rank instead of an MPI truncation error or a hang.
//
//   fsdp::Fingerprint f("ran 'blocks.1'");
//   fsdp::add_all_gather_fields(f, unit.handles(), /*needs_all_gather=*/true);
//   fsdp::check_ranks_agree(*comm, f, /*iteration=*/0);   // throws the same error on every rank
//
// [Note: divergence check] fully_shard's collectives pair up across ranks by order only. In a
// checked iteration the runtime exchanges, with one small all_gather_bytes, a Fingerprint before
// each unit's forward call (its all-gather: sizes, dtypes, parameter shapes), at the end of each
// root forward, before each unit's backward (its all-gather) and before each unit's gradient
// reduction (reduce-scatter or all-reduce sizes, gradient-sync setting), each with the iteration
// number and the communicator's sequence number. The first iteration is checked; with the
// environment variable FSDP_DEBUG=1 every iteration is (as TORCH_DISTRIBUTED_DEBUG=DETAIL does in
// PyTorch). Other iterations exchange nothing, so training pays nothing for the check. Every rank
// runs the same exchanges as long as the ranks agree, so the first disagreement is found at an
// exchange on every rank, before the collectives that would mismatch: each rank throws the same
// c10::Error naming the ranks and what each was about to do. Not detectable: a rank that skips a
// whole step (forward and backward) looks like a rank one step behind until the others run a
// step it does not; they then wait in the exchange until the collective timeout names it.

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/fsdp/flat_param_handle.h"

namespace fsdp {

/// What one rank is about to do at a checked point of the runtime.
struct Fingerprint {
  Fingerprint() = default;
  explicit Fingerprint(std::string event) : event(std::move(event)) {}

  /// Appends a compared field (`name`: `value`); fields are shown where ranks differ.
  Fingerprint& add(std::string name, std::string value);

  /// What the rank is doing, shown for every rank, e.g. "ran 'blocks.1'" (a unit's forward),
  /// "finished its forward", "began the backward of 'blocks.1'", "reduces the gradients of 'a'".
  std::string event;
  /// Compared details, in order: (name, value).
  std::vector<std::pair<std::string, std::string>> fields;

  std::vector<uint8_t> serialize() const;
  static Fingerprint deserialize(const std::vector<uint8_t>& bytes);
  bool operator==(const Fingerprint& other) const {
    return event == other.event && fields == other.fields;
  }
};

/// Whether FSDP_DEBUG=1 is set: check every iteration, not only the first.
///
///   FSDP_DEBUG=1 mpirun -np 4 ./train
bool divergence_debug_enabled();

/// Adds the all-gather of `handles` to `f`: per sharded handle its elements per rank and dtype,
/// and the shapes of the parameters it holds; "none" when `needs_all_gather` is false (the unit
/// is unsharded already, or its all-gather is in flight) or no handle is sharded.
///
///   add_all_gather_fields(f, unit.handles(), !unit.is_unsharded() && !unit.unshard_in_flight());
void add_all_gather_fields(Fingerprint& f, const std::vector<std::unique_ptr<FlatParamHandle>>& handles,
                           bool needs_all_gather);

/// Adds the gradient reduction of `handles` to `f`: per trainable handle a reduce-scatter
/// (sharded) or all-reduce (replicated) with its elements and dtype, or none without `sync`.
///
///   add_reduction_fields(f, unit.handles(), unit.requires_gradient_sync);
void add_reduction_fields(Fingerprint& f, const std::vector<std::unique_ptr<FlatParamHandle>>& handles,
                          bool sync);

/// Exchanges `local` (plus `iteration` and the communicator's sequence number) across the ranks
/// of `comm` with one all_gather_bytes; if any rank differs, throws on every rank the same
/// c10::Error from describe_divergence. Collective: every rank must call it.
///
///   check_ranks_agree(*context.comm, f, context.iterations);
void check_ranks_agree(comm::Communicator& comm, Fingerprint local, int64_t iteration);

/// The error message for the ranks' fingerprints (index = rank), or "" if they all agree:
/// "fully_shard: ranks diverged ... in iteration 3: ranks 0,2 have {...}; rank 1 has {...}",
/// then one line per rank and a hint.
///
///   describe_divergence({Fingerprint("ran 'a'"), Fingerprint("ran 'b'")});
std::string describe_divergence(const std::vector<Fingerprint>& fingerprints);

}  // namespace fsdp
