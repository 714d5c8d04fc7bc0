// NCCL through LibTorch's ProcessGroupNCCL, rendezvous through c10d::TCPStore: constructs the
// backend on one rank and runs an all-gather and a reduce-scatter on the GPU. Where this process
// sees no CUDA device it says so ("skipped: no CUDA device") and exits 0; nccl_smoke_test.sh then
// still checks that the binary links with no unresolved symbols.
#include <cstdio>

#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/comm/launch_env.h"
#include "fsdp_cpp/comm/nccl_backend.h"

int main() {
  // Throws "without ATen_cuda library" unless libtorch_cuda really registered its CUDA hooks.
  std::printf("CUDA hooks registered by libtorch_cuda (CUDA runtime %ld)\n",
              static_cast<long>(at::detail::getCUDAHooks().versionCUDART()));
  if (!fsdp::comm::cuda_device_available()) {
    std::printf("skipped: no CUDA device\n");
    return 0;
  }
  fsdp::comm::LaunchInfo launch;  // one rank
  const at::Device device(at::kCUDA, 0);
  fsdp::comm::Communicator comm(
      fsdp::comm::make_nccl_backend(launch, device, std::chrono::seconds(60), /*eager_init=*/true), device);
  const auto options = at::TensorOptions().device(device);
  at::Tensor input = at::arange(8, options.dtype(at::kFloat));
  at::Tensor gathered = at::empty({8}, options.dtype(at::kFloat));
  comm.all_gather_into_tensor(gathered, input).wait();
  at::Tensor reduced = at::empty({8}, options.dtype(at::kBFloat16));
  comm.reduce_scatter_tensor(reduced, input.to(at::kBFloat16)).wait();
  const bool ok = gathered.cpu().equal(input.cpu()) &&
                  reduced.cpu().to(at::kFloat).equal(input.cpu()) &&
                  comm.backend()->getBackendName() == "nccl";
  std::printf("NCCL on %s: all-gather %s, reduce-scatter %s (backend %s)\n",
              device.str().c_str(), gathered.cpu().equal(input.cpu()) ? "ok" : "WRONG",
              reduced.cpu().to(at::kFloat).equal(input.cpu()) ? "ok" : "WRONG",
              comm.backend()->getBackendName().c_str());
  return ok ? 0 : 1;
}
