#pragma once
// [Note: streams] On CUDA, a handle's all-gathers (with the copy-in or cast of its shard) run on an
// unshard stream and its reduce-scatters on a reduce-scatter stream, each first ordered after the
// compute stream with an event (so they see the optimizer's latest update, or the gradients just
// computed), and the compute stream waits for them with an event before using their results.
// Buffers a collective reads or writes are kept alive by the handle holding references until the
// compute stream has waited for that collective (no record_stream). On the CPU (and wherever no
// stream implementation is linked) everything runs inline, in program order.
//
// The CUDA implementation lives in //fsdp:cuda_streams (links libtorch_cuda) and registers itself
// when linked, like //comm:nccl.

#include <functional>
#include <memory>

#include <c10/core/Device.h>

namespace fsdp {

class DeviceStreams {
 public:
  virtual ~DeviceStreams() = default;
  /// Runs `issue` with the unshard stream current, after that stream waited for the compute stream.
  virtual void on_unshard_stream(const std::function<void()>& issue) { issue(); }
  /// Runs `issue` with the reduce-scatter stream current, after it waited for the compute stream.
  virtual void on_reduce_stream(const std::function<void()>& issue) { issue(); }
  /// The compute stream waits for all work issued on the unshard / reduce-scatter stream so far.
  virtual void compute_waits_for_unshard() {}
  virtual void compute_waits_for_reduce() {}
  /// Whether the streams are real (false: inline execution).
  virtual bool asynchronous() const { return false; }
};

using DeviceStreamsFactory = std::shared_ptr<DeviceStreams> (*)(at::Device device);

/// Registers the streams for `type` (from static initialisers).
bool register_device_streams(c10::DeviceType type, DeviceStreamsFactory factory);

/// The streams for `device`: the registered implementation, else inline execution.
std::shared_ptr<DeviceStreams> device_streams_for(at::Device device);

}  // namespace fsdp
