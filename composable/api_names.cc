#include "fsdp_cpp/composable/api_names.h"

#include <mutex>

#include "fsdp_cpp/contract/module_state.h"
#include "fsdp_cpp/fsdp/fsdp_state.h"

namespace fsdp {

// [Note: exclusive APIs] in contract/module_state.h: the composable APIs' table. Each reason says
// what was expected and what to do instead; the error adds both APIs and the modules' FQNs.
void declare_api_exclusions() {
  static std::once_flag once;
  std::call_once(once, [] {
    // One module: replicate keeps its parameters whole and all-reduces their gradients, fully_shard
    // shards them and reduce-scatters their gradients.
    contract::declare_exclusive(
        {.api = kReplicateApi,
         .existing = kFullyShardApi,
         .same_module = true,
         .both_orders = true,
         .why = "fully_shard and replicate cannot be applied to the same module (replicate keeps every "
                "parameter whole and all-reduces its gradient, fully_shard shards it and reduce-scatters "
                "its gradient: both would reduce its gradients). Apply fully_shard to its submodules and "
                "replicate to it, or use fully_shard alone (its NO_SHARD strategy replicates too; a mesh "
                "gives hybrid sharding)"});
    // replicate inside a unit (or a unit around a replicated module): the unit already reduces the
    // gradients of every parameter in its tree. fully_shard inside replicate is the composition:
    // replicate leaves the parameters a unit manages to it.
    contract::declare_exclusive(
        {.api = kReplicateApi,
         .existing = kFullyShardApi,
         .same_module = false,
         .around = true,
         .both_orders = true,
         .why = "expected replicate on a module outside every fully_shard unit (the unit already reduces "
                "the gradients of every parameter inside it). Apply replicate to the root and fully_shard "
                "to its submodules"});
    contract::declare_exclusive(
        {.api = kReplicateApi,
         .existing = kReplicateApi,
         .same_module = false,
         .around = true,
         .inside = true,
         .why = "expected one replicate per model (nested replicate would all-reduce the same gradients "
                "twice)"});
    // Tensor parallelism first: once fully_shard manages parameters they are flattened shards.
    // fully_shard after parallelize_module is the composition (it shards the tensor-parallel pieces).
    contract::declare_exclusive(
        {.api = kTensorParallelApi,
         .existing = kFullyShardApi,
         .same_module = true,
         .around = true,
         .inside = true,
         .why = "parameters managed by fully_shard are flattened shards of their values by then; apply "
                "parallelize_module before fully_shard (fully_shard then shards the tensor-parallel "
                "pieces)"});
  });
}

}  // namespace fsdp
