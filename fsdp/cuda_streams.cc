// The CUDA implementation of [Note: streams] (fsdp/device_streams.h). Linking //fsdp:cuda_streams
// registers it for CUDA devices.
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "fsdp/device_streams.h"

namespace fsdp {
namespace {

// `waiter` waits for the work enqueued on `producer` so far.
void wait_for(const c10::cuda::CUDAStream& waiter, const c10::cuda::CUDAStream& producer) {
  if (waiter == producer) return;
  at::cuda::CUDAEvent event;
  event.record(producer);
  event.block(waiter);
}

class CudaStreams final : public DeviceStreams {
 public:
  explicit CudaStreams(at::Device device)
      : device_(device.index()),
        unshard_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device_)),
        reduce_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_)) {}

  void on_unshard_stream(const std::function<void()>& issue) override { run_on(unshard_, issue); }
  void on_reduce_stream(const std::function<void()>& issue) override { run_on(reduce_, issue); }
  void compute_waits_for_unshard() override { wait_for(c10::cuda::getCurrentCUDAStream(device_), unshard_); }
  void compute_waits_for_reduce() override { wait_for(c10::cuda::getCurrentCUDAStream(device_), reduce_); }
  bool asynchronous() const override { return true; }

 private:
  void run_on(const c10::cuda::CUDAStream& stream, const std::function<void()>& issue) {
    wait_for(stream, c10::cuda::getCurrentCUDAStream(device_));
    c10::cuda::CUDAStreamGuard guard(stream);
    issue();  // NCCL orders its own stream after this (current) one when the collective is issued
  }

  c10::DeviceIndex device_;
  c10::cuda::CUDAStream unshard_;
  c10::cuda::CUDAStream reduce_;
};

std::shared_ptr<DeviceStreams> make_cuda_streams(at::Device device) {
  return std::make_shared<CudaStreams>(device);
}

const bool g_registered = register_device_streams(c10::DeviceType::CUDA, &make_cuda_streams);

}  // namespace
}  // namespace fsdp
