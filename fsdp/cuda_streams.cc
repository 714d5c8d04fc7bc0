// The CUDA implementation of [Note: streams] (fsdp/device_streams.h). Linking //fsdp:cuda_streams
// registers it for CUDA devices.
#include <array>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "fsdp_cpp/fsdp/device_streams.h"

namespace fsdp {
namespace {

// `waiter` waits for the work enqueued on `producer` so far.
void wait_for(const c10::cuda::CUDAStream& waiter, const c10::cuda::CUDAStream& producer) {
  if (waiter == producer) return;
  at::cuda::CUDAEvent event;
  event.record(producer);
  event.block(waiter);
}

bool serialized_by_environment() {
  const char* value = std::getenv("FSDP_SERIALIZE_STREAMS");
  return value != nullptr && std::strcmp(value, "") != 0 && std::strcmp(value, "0") != 0;
}

class CudaStreams final : public DeviceStreams {
 public:
  explicit CudaStreams(c10::DeviceIndex device)
      : device_(device),
        unshard_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device_)),
        reduce_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_)) {
    order_.set_serialized(serialized_by_environment());
  }

  void begin_iteration() override {
    std::lock_guard<std::mutex> lock(mutex_);
    order_.begin_iteration();
  }

  void end_iteration() override {
    c10::cuda::CUDAGuard device_guard(device_);
    std::lock_guard<std::mutex> lock(mutex_);
    // The buffers' last readers are on the compute stream: the unshard stream waits for them, so
    // a later all-gather reusing the memory comes after.
    free_held(order_.end_iteration());
  }

  void on_unshard_stream(const std::function<void()>& issue, bool input_written) override {
    c10::cuda::CUDAGuard device_guard(device_);
    const c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream(device_);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const UnshardOrder::Issue order = order_.issue(input_written);
      if (order.wait_for_compute) {
        wait_for(unshard_, compute);  // covers the held buffers' events too
        for (uint64_t id : order.free) held_.erase(id);
      } else {
        free_held(order.free);
      }
    }
    c10::cuda::CUDAStreamGuard guard(unshard_);
    issue();  // NCCL orders its own stream after this (current) one when the collective is issued
  }

  void on_reduce_stream(const std::function<void()>& issue) override {
    c10::cuda::CUDAGuard device_guard(device_);
    wait_for(reduce_, c10::cuda::getCurrentCUDAStream(device_));
    c10::cuda::CUDAStreamGuard guard(reduce_);
    issue();
  }

  void hand_unshard_to_compute(const std::function<void()>& wait) override {
    hand_to_compute(unshard_, wait);
    std::lock_guard<std::mutex> lock(mutex_);
    order_.handed_to_compute();
  }

  void hand_reduce_to_compute(const std::function<void()>& wait) override { hand_to_compute(reduce_, wait); }

  void release_after_compute(c10::DataPtr memory) override {
    if (!memory) return;
    c10::cuda::CUDAGuard device_guard(device_);
    Held held{std::move(memory), at::cuda::CUDAEvent()};
    held.event.record(c10::cuda::getCurrentCUDAStream(device_));
    std::lock_guard<std::mutex> lock(mutex_);
    const uint64_t id = ++next_id_;
    if (order_.hold(id)) {
      held_.emplace(id, std::move(held));
    } else {  // no all-gather to overlap: freed now, after the unshard stream waited for its event
      held.event.block(unshard_);
    }
  }

  void set_serialized(bool on) override {
    std::lock_guard<std::mutex> lock(mutex_);
    order_.set_serialized(on);
  }
  bool serialized() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return order_.serialized();
  }
  bool asynchronous() const override { return true; }

 private:
  // A resharded buffer not given back to the allocator yet, and the compute-stream event after
  // its last use.
  struct Held {
    c10::DataPtr memory;
    at::cuda::CUDAEvent event;
  };

  // Frees held buffers after the unshard stream waited for their events (mutex_ held).
  void free_held(const std::vector<uint64_t>& ids) {
    for (uint64_t id : ids) {
      auto it = held_.find(id);
      if (it == held_.end()) continue;
      it->second.event.block(unshard_);
      held_.erase(it);
    }
  }

  void hand_to_compute(const c10::cuda::CUDAStream& stream, const std::function<void()>& wait) {
    c10::cuda::CUDAGuard device_guard(device_);
    const c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream(device_);
    {
      c10::cuda::CUDAStreamGuard guard(stream);
      wait();  // NCCL: `stream` waits for the collective's end event
    }
    wait_for(compute, stream);
  }

  c10::DeviceIndex device_;
  c10::cuda::CUDAStream unshard_;
  c10::cuda::CUDAStream reduce_;
  mutable std::mutex mutex_;
  UnshardOrder order_;
  uint64_t next_id_ = 0;
  std::map<uint64_t, Held> held_;
};

std::shared_ptr<DeviceStreams> make_cuda_streams(at::Device device) {
  // One object per device, shared by every handle (one unshard and one reduce-scatter stream per
  // device, as FSDP2's comm context; per-stream allocator pools would not share memory otherwise).
  // Never destroyed: held buffers and events must not be freed during static destruction.
  static std::mutex lock;
  static auto* per_device = new std::array<std::shared_ptr<CudaStreams>, C10_COMPILE_TIME_MAX_GPUS>();
  const c10::DeviceIndex index = device.has_index() ? device.index() : c10::cuda::current_device();
  std::lock_guard<std::mutex> guard(lock);
  auto& streams = per_device->at(static_cast<size_t>(index));
  if (streams == nullptr) streams = std::make_shared<CudaStreams>(index);
  return streams;
}

const bool g_registered = register_device_streams(c10::DeviceType::CUDA, &make_cuda_streams);

}  // namespace
}  // namespace fsdp
