#include "comm/nccl_backend.h"

#include <unistd.h>

#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "comm/backend_registry.h"
#include "comm/communicator.h"
#include "comm/mpi_backend.h"

namespace fsdp::comm {
namespace {

std::string local_hostname() {
  char name[256] = {0};
  if (gethostname(name, sizeof(name) - 1) != 0) return "127.0.0.1";
  return name;
}

struct StoreAddress {
  std::string host;
  int port = 0;
};

c10::intrusive_ptr<c10d::Store> make_store(const LaunchInfo& launch,
                                           std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions opts;
  opts.isServer = launch.rank == 0;
  opts.numWorkers = launch.world_size;
  opts.timeout = timeout;
  opts.useLibUV = false;
  if (!launch.master_addr.empty()) {
    TORCH_CHECK(launch.master_port > 0 && launch.master_port < 65536,
                "fsdp comm: NCCL rendezvous needs MASTER_PORT with MASTER_ADDR=", launch.master_addr);
    opts.port = static_cast<uint16_t>(launch.master_port);
    return c10::make_intrusive<c10d::TCPStore>(launch.master_addr, opts);
  }
  TORCH_CHECK(launch.launcher != Launcher::kTorchrun,
              "fsdp comm: torchrun launch without MASTER_ADDR/MASTER_PORT; NCCL cannot rendezvous");
  if (launch.world_size == 1) {
    opts.port = 0;  // a free port; nobody else needs to find it
    return c10::make_intrusive<c10d::TCPStore>("127.0.0.1", opts);
  }
  // mpirun: rank 0 hosts the store on a free port and tells the others where it is over MPI.
  Communicator world(MpiBackend::create_world(), at::kCPU);
  c10::intrusive_ptr<c10d::TCPStore> store;
  std::vector<uint8_t> address;
  if (launch.rank == 0) {
    opts.port = 0;
    opts.waitWorkers = false;
    store = c10::make_intrusive<c10d::TCPStore>("0.0.0.0", opts);
    const std::string text = local_hostname() + ":" + std::to_string(store->getPort());
    address.assign(text.begin(), text.end());
  }
  const auto all = world.all_gather_bytes(address, "nccl rendezvous");
  if (launch.rank == 0) return store;
  const std::string text(all[0].begin(), all[0].end());
  const auto colon = text.rfind(':');
  TORCH_CHECK(colon != std::string::npos, "fsdp comm: bad rendezvous address from rank 0: ", text);
  opts.port = static_cast<uint16_t>(std::stoi(text.substr(colon + 1)));
  return c10::make_intrusive<c10d::TCPStore>(text.substr(0, colon), opts);
}

const bool g_registered =
    register_backend_factory(c10::DeviceType::CUDA, "nccl", &make_nccl_backend);

}  // namespace

bool cuda_device_available() { return c10::cuda::device_count() > 0; }

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const LaunchInfo& launch, at::Device device,
                                                    std::chrono::milliseconds timeout) {
  (void)g_registered;
  TORCH_CHECK(device.is_cuda(), "fsdp comm: the NCCL backend needs a CUDA device, got ", device);
  TORCH_CHECK(cuda_device_available(), "fsdp comm: NCCL backend requested for ", device,
              " but this process sees no CUDA device");
  TORCH_CHECK(device.index() >= 0 && device.index() < c10::cuda::device_count(),
              "fsdp comm: device ", device, " does not exist; this process sees ",
              static_cast<int>(c10::cuda::device_count()), " CUDA device(s) (LOCAL_RANK=",
              launch.local_rank, ")");
  c10::cuda::set_device(device.index());
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(make_store(launch, timeout), launch.rank,
                                                     launch.world_size, options);
}

}  // namespace fsdp::comm
