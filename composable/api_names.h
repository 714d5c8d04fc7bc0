#pragma once
// The names the composable APIs register their states under in the contract's registry
// (contract/module_state.h), and which of them exclude each other ([Note: exclusive APIs]), in
// one place for the APIs that do not depend on each other's targets (fully_shard refuses
// replicate's modules without linking replicate). fully_shard's own name is the engine's
// (fsdp::kFullyShardApi in fsdp/fsdp_state.h).

namespace fsdp {

/// The name replicate's state is registered under.
inline constexpr const char* kReplicateApi = "replicate";

/// The name parallelize_module registers its state under in the contract's registry.
inline constexpr const char* kTensorParallelApi = "tensor_parallel";

/// Declares, once per process, which composable APIs exclude each other
/// (contract::declare_exclusive; the table is in api_names.cc). Every composable API calls it
/// before its checks; after the first call it costs one atomic load.
void declare_api_exclusions();

}  // namespace fsdp
