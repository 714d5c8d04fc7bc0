#pragma once
// Lazy initialisation, in the root's first pre-forward: the root (the managed module with no
// managed ancestor) creates the context every unit of its tree shares, names the units relative to
// it, and places tied parameters.

namespace fsdp {

class FSDPState;

namespace runtime {

/// Initialises the tree of `state`, which must be its root (else a clear error).
void lazy_init(FSDPState& state);

}  // namespace runtime
}  // namespace fsdp
