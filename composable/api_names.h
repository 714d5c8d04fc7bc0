#pragma once
// The names the composable APIs register their states under in the contract's registry
// (contract/module_state.h), for the APIs that refuse each other's modules without depending on
// each other's targets (fully_shard and fully_shard_tree refuse replicate's modules; replicate
// depends on fully_shard). fully_shard's own name is the engine's (fsdp::kFullyShardApi in
// fsdp/fsdp_state.h).

namespace fsdp {

/// The name replicate's state is registered under.
inline constexpr const char* kReplicateApi = "replicate";

}  // namespace fsdp
