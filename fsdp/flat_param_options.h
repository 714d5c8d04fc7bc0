#pragma once
// FlatParamHandleOptions: what one FlatParameter is told by its unit (built in one place,
// FSDPConfig::handle_options()). FlatParamStorage reads the sharding, device, dtype, offload and
// meta-value options; FlatParamGrad the reduce dtype and the replicate group.

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/fsdp/comm_codec.h"

namespace fsdp {

struct FlatParamHandleOptions {
  /// false: NO_SHARD (replicated parameters, all-reduced gradients).
  bool shard = true;
  /// Where the shard lives (default: the parameters' device). A model built on the CPU moves only
  /// its shards to the target device.
  std::optional<at::Device> device;
  /// Hybrid sharding: the replicate group across which the sharded gradient is all-reduced after
  /// the reduce-scatter inside the handle's (shard group) communicator. Null otherwise.
  std::shared_ptr<comm::Communicator> replicate;
  /// Resharding after forward to a smaller group ([Note: post-forward group] in
  /// fsdp/flat_param_handle.h): a group of consecutive ranks of the handle's communicator, of a
  /// size that divides it, inside which the backward all-gather runs. Null otherwise.
  std::shared_ptr<comm::Communicator> post_forward_group;
  /// Where the gradient reductions run ([Note: reduce communicator] in fsdp/derived_groups.h): a
  /// duplicate of the handle's communicator, or null for that communicator itself.
  std::shared_ptr<comm::Communicator> reduce_group;
  /// Mixed precision: the dtype parameters are all-gathered and computed in (a low-precision copy
  /// of the shard; the shard itself, the gradients after sync and the optimizer state stay in the
  /// parameters' dtype). Unset: the parameters' dtype.
  std::optional<c10::ScalarType> param_dtype;
  /// The dtype gradients are reduced in. Unset: param_dtype if set, else the parameters' dtype.
  std::optional<c10::ScalarType> reduce_dtype;
  /// CPU offload: the shard and the sharded gradient live in host memory (pinned when computing on
  /// CUDA), so the optimizer steps on the host; the shard is copied to `device` to be all-gathered
  /// and the reduced gradient copied back.
  bool offload_to_cpu = false;
  /// Parameters on the meta device (built under fsdp::MetaInitGuard, init/meta_init.h): returns
  /// the full values of one (any device; `fqn` as in OrigParam). Called once per meta parameter
  /// this rank holds part of, while the shard is filled; nothing else of the parameter is ever
  /// allocated. Unset: meta parameters are refused.
  std::function<at::Tensor(const std::string& fqn, const at::Tensor& param)> meta_values;
  /// Quantized communication ([Note: communication codecs] in fsdp/comm_codec.h), sharded handles
  /// only: the codec the all-gather over the handle's communicator carries the shard in, and the
  /// one the gradient reduction carries the gradient chunks in (an all-to-all replacing the
  /// reduce-scatter: [Note: quantized gradient reduction] in fsdp/flat_param_grad.h). Null: none.
  std::shared_ptr<const CommCodec> all_gather_codec;
  std::shared_ptr<const CommCodec> reduce_codec;
};

}  // namespace fsdp
