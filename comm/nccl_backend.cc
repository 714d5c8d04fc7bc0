#include "fsdp_cpp/comm/nccl_backend.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>

#include <cuda_runtime_api.h>

#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "fsdp_cpp/comm/backend_registry.h"
#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/comm/mpi_backend.h"

namespace fsdp::comm {
namespace {

std::string local_hostname() {
  char name[256] = {0};
  if (gethostname(name, sizeof(name) - 1) != 0) return "127.0.0.1";
  return name;
}

// The rendezvous store: torchrun's protocol when MASTER_ADDR is set (rendezvous_store), else under
// mpirun rank 0 hosts a store on a free port and tells the others where it is over MPI.
c10::intrusive_ptr<c10d::Store> make_store(const LaunchInfo& launch,
                                           std::chrono::milliseconds timeout) {
  if (!launch.master_addr.empty() || launch.world_size == 1) return rendezvous_store(launch, timeout);
  TORCH_CHECK(launch.launcher == Launcher::kMpirun, "fsdp comm: ", to_string(launch.launcher),
              " launch of ", launch.world_size,
              " ranks without MASTER_ADDR/MASTER_PORT; NCCL cannot rendezvous");
  c10d::TCPStoreOptions opts;
  opts.numWorkers = launch.world_size;
  opts.timeout = timeout;
  opts.useLibUV = false;
  Communicator world(MpiBackend::create_world(), at::kCPU);
  c10::intrusive_ptr<c10d::TCPStore> store;
  std::vector<uint8_t> address;
  if (launch.rank == 0) {
    opts.isServer = true;
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

std::string device_uuid(int index) {
  cudaDeviceProp prop{};
  const cudaError_t rc = cudaGetDeviceProperties(&prop, index);
  TORCH_CHECK(rc == cudaSuccess, "fsdp comm: cudaGetDeviceProperties(", index, ") failed: ",
              cudaGetErrorString(rc));
  std::string text = "GPU-";
  char byte[3];
  for (int i = 0; i < 16; ++i) {
    std::snprintf(byte, sizeof(byte), "%02x", static_cast<unsigned char>(prop.uuid.bytes[i]));
    text += byte;
  }
  return text;
}

// Every rank claims its GPU under its host's key; once all arrived, each reads its own host's claims
// (O(ranks per node) per rank) and fails if two name one GPU. `generation` keeps a second
// init_process_group in the same job (same store) apart from the first.
void check_one_gpu_per_rank(c10d::Store& store, const LaunchInfo& launch, int device_index) {
  static std::atomic<int> generation{0};
  const std::string prefix = "fsdp/device_check/" + std::to_string(generation++) + "/";
  DeviceClaim claim;
  claim.rank = launch.rank;
  claim.local_rank = launch.local_rank;
  claim.host = local_hostname();
  claim.device_uuid = device_uuid(device_index);
  claim.device_index = device_index;
  const std::string host_prefix = prefix + "host/" + claim.host + "/";
  const int64_t slot = store.add(host_prefix + "count", 1);
  const std::string value = to_store_value(claim);
  store.set(host_prefix + std::to_string(slot), std::vector<uint8_t>(value.begin(), value.end()));
  if (store.add(prefix + "arrived", 1) == launch.world_size) store.set(prefix + "all", std::vector<uint8_t>{1});
  store.wait({prefix + "all"});
  const int64_t count = store.add(host_prefix + "count", 0);
  std::vector<std::string> keys;
  for (int64_t i = 1; i <= count; ++i) keys.push_back(host_prefix + std::to_string(i));
  std::vector<DeviceClaim> claims;
  for (const auto& bytes : store.multiGet(keys)) {
    claims.push_back(device_claim_from_store_value(std::string(bytes.begin(), bytes.end())));
  }
  if (auto error = find_shared_device(claims)) TORCH_CHECK(false, *error);
}

c10::intrusive_ptr<c10d::Backend> make_from_request(const LaunchInfo& launch,
                                                    const BackendRequest& request) {
  return make_nccl_backend(launch, request.device, request.timeout, request.eager_init);
}

// What a group of an NCCL world needs: the world's rendezvous store (each group rendezvous under
// its own prefix), the timeout and the bound device. Keyed by the world backend.
struct NcclWorld {
  c10::intrusive_ptr<c10d::Store> store;
  std::chrono::milliseconds timeout{0};
  at::Device device{at::kCUDA};
  bool eager_init = false;
  int64_t splits = 0;  // groups made so far (the same count on every rank: splits are collective)
};

std::mutex& worlds_mutex() {
  static std::mutex m;
  return m;
}

std::map<const c10d::Backend*, NcclWorld>& worlds() {
  static auto* w = new std::map<const c10d::Backend*, NcclWorld>();  // never destroyed
  return *w;
}

// [Note: NCCL groups] A new ProcessGroupNCCL per group, rendezvousing through the world's store
// under "fsdp_group/<split number>/<label>/<color>/": ranks of one color meet there, other colors
// elsewhere. Every rank of the world calls this in the same order (DeviceMesh creation is
// collective), so the split number matches. The NCCL communicator itself is created at the
// group's first collective (or now with eager init, on the world's device).
c10::intrusive_ptr<c10d::Backend> split_nccl(const c10::intrusive_ptr<c10d::Backend>& parent, int color, int key,
                                             int size, const std::string& label) {
  NcclWorld world;
  int64_t split = 0;
  {
    std::lock_guard<std::mutex> lock(worlds_mutex());
    auto it = worlds().find(parent.get());
    TORCH_CHECK(it != worlds().end(), "fsdp comm: this NCCL backend was not made by init_process_group "
                "(make_nccl_backend), so its rendezvous store is unknown and it cannot be split into groups");
    split = it->second.splits++;
    world = it->second;
  }
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = world.timeout;
  auto store = c10::make_intrusive<c10d::PrefixStore>(
      "fsdp_group/" + std::to_string(split) + "/" + label + "/" + std::to_string(color) + "/", world.store);
  auto group = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, key, size, options);
  if (world.eager_init) {
    group->setBoundDeviceId(world.device);
    group->eagerConnectSingleDevice(world.device);
  }
  return group;
}

const bool g_registered =
    register_backend_factory(c10::DeviceType::CUDA, "nccl", &make_from_request) &&
    register_group_splitter("nccl", &split_nccl);

}  // namespace

bool cuda_device_available() { return c10::cuda::device_count() > 0; }

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const LaunchInfo& launch, at::Device device,
                                                    std::chrono::milliseconds timeout,
                                                    bool eager_init) {
  (void)g_registered;
  TORCH_CHECK(device.is_cuda(), "fsdp comm: the NCCL backend needs a CUDA device, got ", device);
  const int count = static_cast<int>(c10::cuda::device_count());
  const bool from_local_rank = !device.has_index() || device.index() == launch.local_rank;
  const int index = device.has_index() ? device.index() : launch.local_rank;
  check_local_device(launch, index, count, from_local_rank);
  const at::Device bound(at::kCUDA, static_cast<c10::DeviceIndex>(index));
  c10::cuda::set_device(bound.index());
  auto store = make_store(launch, timeout);
  check_one_gpu_per_rank(*store, launch, index);
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  auto backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(
      default_group_store(store, "cuda"), launch.rank, launch.world_size, options);
  if (eager_init) {
    backend->setBoundDeviceId(bound);
    backend->eagerConnectSingleDevice(bound);
  }
  {
    std::lock_guard<std::mutex> lock(worlds_mutex());
    worlds()[backend.get()] = NcclWorld{store, timeout, bound, eager_init, 0};
  }
  return backend;
}

}  // namespace fsdp::comm
