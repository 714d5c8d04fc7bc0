#pragma once
// [Note: streams] On CUDA, a handle's all-gathers (with the copy-in or cast of its shard) run on an
// unshard stream and its reduce-scatters on a reduce-scatter stream; the compute stream gets their
// results back through events. The order follows PyTorch's FSDP2 (_fully_shard/_fsdp_state.py,
// _fsdp_param_group.py), so that a unit's all-gather overlaps the previous unit's compute even
// without forward prefetch (the CPU issues unit k+1's all-gather while the GPU still runs unit k):
//
//   - The unshard stream waits for the compute stream only where its input may have been written
//     there: at the first all-gather of an iteration (begin_iteration(), called at the root's
//     pre-forward: the optimizer step and any state-dict load ran before it), when the caller says
//     the shard was written since (`input_written`: FlatParamHandle compares version counters),
//     and at every issue outside an iteration (summon_full_params, FSDPModule::unshard, ...).
//   - All-gather outputs are allocated while the unshard stream is current (the caching
//     allocator then hands them out in that stream's order), and handed to compute with an event
//     recorded on the unshard stream after the collective's wait (hand_unshard_to_compute()).
//   - A resharded buffer is not given back to the allocator at once (release_after_compute()):
//     the compute stream may still read it, and the next all-gather could reuse the block. It is
//     held with an event recorded on the compute stream and freed, with the unshard stream first
//     waiting for that event, at the first all-gather issued after the compute stream received
//     the next all-gather's result. So unit k+1's all-gather (issued right after unit k was
//     resharded, no prefetch) never waits for unit k's forward; it may wait for unit k-1's. At
//     most one more unit's buffer is alive than with compute-stream allocation; none outside an
//     iteration (end_iteration() frees them).
//   - A reduce-scatter's stream waits for the compute stream at every issue (it reads the
//     gradients just computed); its input is allocated on the compute stream and kept alive by the
//     handle until the compute stream waited for the reduction (hand_reduce_to_compute()), so no
//     record_stream is needed anywhere.
// On the CPU (and wherever no stream implementation is linked) everything runs inline, in program
// order, and memory is freed at once.
//
// The CUDA implementation lives in //fsdp:cuda_streams (links libtorch_cuda) and registers itself
// when linked, like //comm:nccl. One DeviceStreams object per device is shared by every handle on it.
//
//   auto streams = fsdp::device_streams_for(at::Device(at::kCUDA, 0));
//   streams->begin_iteration();                                  // root pre-forward
//   streams->on_unshard_stream([&] { work = comm.all_gather_into_tensor(out, shard); });
//   streams->hand_unshard_to_compute([&] { work.wait(); });     // compute may read `out` now
//   streams->release_storage(*out.storage().unsafeGetStorageImpl());  // reshard
//   streams->end_iteration();                                    // end of backward

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <c10/core/Device.h>
#include <c10/core/StorageImpl.h>

namespace fsdp {

class DeviceStreams {
 public:
  virtual ~DeviceStreams() = default;
  /// Start of a root's forward: the local shards may have been written on the compute stream (an
  /// optimizer step), so the next all-gather issue waits for the compute stream; later issues in
  /// the iteration do not (unless their input was written). Frees no memory by itself.
  virtual void begin_iteration() {}
  /// End of an iteration (backward done, or forward without backward, or a failed iteration):
  /// frees the held buffers, and every later all-gather issue waits for the compute stream again
  /// until the next begin_iteration().
  virtual void end_iteration() {}
  /// Runs `issue` (allocate the output, copy in, issue the all-gather) with the unshard stream
  /// current. The stream first waits for the compute stream at the first issue of an iteration,
  /// outside an iteration, or when `input_written` (the shard was written since it was last
  /// gathered); it always first waits for the compute events of held buffers it may reuse.
  virtual void on_unshard_stream(const std::function<void()>& issue, bool input_written = false) {
    issue();
  }
  /// Runs `issue` with the reduce-scatter stream current, after it waited for the compute stream.
  virtual void on_reduce_stream(const std::function<void()>& issue) { issue(); }
  /// Runs `wait` (the all-gather's wait) with the unshard stream current, then makes the compute
  /// stream wait for an event recorded on the unshard stream after it: the all-gathered buffer
  /// (and the copy-in before it) are ready for compute.
  virtual void hand_unshard_to_compute(const std::function<void()>& wait) { wait(); }
  /// The same for a reduction: the compute stream may read its output and free its input after.
  virtual void hand_reduce_to_compute(const std::function<void()>& wait) { wait(); }
  /// Frees `memory` once the work enqueued on the compute stream so far no longer needs it, before
  /// any later all-gather can reuse it (see the note). Inline: frees it now.
  virtual void release_after_compute(c10::DataPtr memory) {}
  /// Frees `storage`'s memory through release_after_compute(): nbytes becomes 0, the StorageImpl
  /// (and so every view of it, including views autograd saved) keeps its identity.
  void release_storage(c10::StorageImpl& storage);
  /// Debugging: with `on`, every all-gather issue waits for the compute stream (the ordering
  /// before FSDP2's: no overlap of a unit's all-gather with the previous unit's compute unless it
  /// is prefetched), to rule a stream-ordering problem in or out, or to measure the difference.
  /// FSDP_SERIALIZE_STREAMS=1 in the environment sets it when the streams are created.
  virtual void set_serialized(bool on) {}
  virtual bool serialized() const { return true; }
  /// Whether the streams are real (false: inline execution).
  virtual bool asynchronous() const { return false; }
};

/// The bookkeeping of [Note: streams] without any device: when the unshard stream waits for the
/// compute stream, and which held (resharded) buffers are freed when. CudaStreams drives it with
/// CUDA events; tests drive it with the runtime's real call sequence on the CPU.
///
///   fsdp::UnshardOrder order;
///   order.begin_iteration();
///   order.issue(false).wait_for_compute;   // true: the first all-gather of the iteration
///   order.handed_to_compute();            // unit 1's result used by compute
///   order.hold(1);                        // unit 1 resharded: its buffer (id 1) is held
///   order.issue(false).free;              // {} : unit 2's all-gather must not wait for unit 1
class UnshardOrder {
 public:
  struct Issue {
    bool wait_for_compute = false;  // the unshard stream waits for the compute stream first
    std::vector<uint64_t> free;     // held buffers to free, after the unshard stream waited for
                                    // their events (all of them when wait_for_compute)
  };
  void begin_iteration();
  /// The held buffers to free (after the unshard stream waited for their events).
  std::vector<uint64_t> end_iteration();
  Issue issue(bool input_written);
  /// The compute stream received an all-gather's result.
  void handed_to_compute() { ++handoffs_; }
  /// A resharded buffer: true when it is held under `id`, false when it is to be freed now
  /// (outside an iteration; after the unshard stream waited for its event).
  bool hold(uint64_t id);
  void set_serialized(bool on) { serialized_ = on; }
  bool serialized() const { return serialized_; }
  bool in_iteration() const { return in_iteration_; }
  size_t held() const { return held_.size(); }

 private:
  struct Held {
    uint64_t id;
    uint64_t handoffs;  // results handed to compute before it was released
  };
  bool serialized_ = false;
  bool in_iteration_ = false;
  bool wait_for_compute_ = true;
  uint64_t handoffs_ = 0;
  std::vector<Held> held_;  // oldest first
};

using DeviceStreamsFactory = std::shared_ptr<DeviceStreams> (*)(at::Device device);

/// Registers the streams for `type` (from static initialisers). The factory is called for every
/// device_streams_for() and should return one shared object per device.
bool register_device_streams(c10::DeviceType type, DeviceStreamsFactory factory);

/// The streams for `device`: the registered implementation, else inline execution.
std::shared_ptr<DeviceStreams> device_streams_for(at::Device device);

}  // namespace fsdp
