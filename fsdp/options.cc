#include "fsdp_cpp/fsdp/options.h"

#include <c10/util/Exception.h>

namespace fsdp {

const char* to_string(ShardingStrategy strategy) {
  switch (strategy) {
    case ShardingStrategy::kFullShard: return "FULL_SHARD";
    case ShardingStrategy::kShardGradOp: return "SHARD_GRAD_OP";
    case ShardingStrategy::kNoShard: return "NO_SHARD";
  }
  return "?";
}

ShardingStrategy FullyShardOptions::strategy() const {
  if (strategy_) return *strategy_;
  if (reshard_after_forward_ && !*reshard_after_forward_) return ShardingStrategy::kShardGradOp;
  return ShardingStrategy::kFullShard;
}

bool FullyShardOptions::reshard_after_forward() const { return reshards_after_forward(strategy()); }

bool reshards_after_forward(ShardingStrategy strategy) { return strategy == ShardingStrategy::kFullShard; }

bool shards(ShardingStrategy strategy) { return strategy != ShardingStrategy::kNoShard; }

std::optional<c10::ScalarType> forward_input_dtype(const MixedPrecision& mixed_precision) {
  if (!mixed_precision.cast_forward_inputs()) return std::nullopt;
  return mixed_precision.param_dtype();
}

std::string strategy_conflict(const FullyShardOptions& options) {
  const auto& strategy = options.strategy_setting();
  const auto& reshard = options.reshard_after_forward_setting();
  if (!strategy || !reshard || reshards_after_forward(*strategy) == *reshard) return "";
  const auto& group = options.post_forward_group_size();
  return std::string("strategy ") + to_string(*strategy) + " with reshard_after_forward(" +
         (group ? std::to_string(*group) : *reshard ? "true" : "false") + ")";
}

std::string codec_conflict(const FullyShardOptions& options) {
  if (shards(options.strategy())) return "";
  std::string conflict;
  if (options.all_gather_codec()) conflict += "all_gather_codec(" + options.all_gather_codec()->name() + ")";
  if (options.reduce_codec()) {
    conflict += (conflict.empty() ? "" : " and ") + std::string("reduce_codec(") + options.reduce_codec()->name() + ")";
  }
  return conflict.empty() ? "" : std::string("strategy ") + to_string(options.strategy()) + " with " + conflict;
}

void check_codecs_fit_strategy(const FullyShardOptions& options, const std::string& fqn) {
  const std::string conflict = codec_conflict(options);
  TORCH_CHECK(conflict.empty(), "fully_shard: module ", fqn, " was given ", conflict,
              ", but NO_SHARD replicates its parameters and all-reduces its gradients: there is no "
              "all-gather or reduce-scatter to encode. Use FULL_SHARD or SHARD_GRAD_OP, or drop the codecs");
}

}  // namespace fsdp
