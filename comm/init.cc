#include "fsdp_cpp/comm/init.h"

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <vector>

#include <ATen/Context.h>
#include <c10/util/Exception.h>

#include "fsdp_cpp/comm/backend_registry.h"
#include "fsdp_cpp/comm/collective_timeout.h"
#include "fsdp_cpp/comm/mpi_backend.h"
#include "fsdp_cpp/comm/mpi_runtime.h"

namespace fsdp::comm {
namespace {

std::mutex g_default_lock;
std::optional<ProcessGroup> g_default;

at::Device default_device(const LaunchInfo& launch) {
  if (find_backend_factory(c10::DeviceType::CUDA) != nullptr && at::hasCUDA() &&
      at::detail::getCUDAHooks().deviceCount() > 0) {
    return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(launch.local_rank));
  }
  return at::Device(at::kCPU);
}

c10::intrusive_ptr<c10d::Backend> make_mpi_backend(const LaunchInfo& launch,
                                                   std::chrono::milliseconds timeout) {
  MpiBackend::Options options;
  options.timeout = timeout;
  auto backend = MpiBackend::create_world(options);
  TORCH_CHECK(backend->getSize() == launch.world_size,
              "fsdp comm: CPU tensors communicate through MPI, but MPI sees ", backend->getSize(),
              " process(es) while the launcher (", to_string(launch.launcher), ") announced ",
              launch.world_size,
              ". Launch CPU jobs with `mpirun -np N`, or train on CUDA tensors (NCCL) under torchrun.");
  return backend;
}

// [Note: CPU jobs under torchrun] CPU tensors communicate through the Open MPI backend, and MPI
// needs its own launcher: under torchrun every process would be a one-rank MPI job. The other CPU
// transport, c10d::ProcessGroupGloo, is exported by LibTorch's libtorch_cpu, but its header
// includes gloo's headers (gloo/context.h, gloo/transport/device.h, ...), which the wheel does not
// ship; Debian's libgloo-dev is a 2022 snapshot, not necessarily the gloo the wheel was built with,
// and compiling the header's inline code against other gloo headers is not sound unless the two
// are shown to be the same ABI, which has not been done. So a CPU job launched by the real
// torchrun (TORCHELASTIC_RUN_ID set) cannot run: every rank says why and exits with status 1,
// before MPI is touched, instead of throwing out of main (std::terminate: abort() and a C++ trace on every rank). A plain RANK/WORLD_SIZE
// launch that disagrees with MPI stays an exception (make_mpi_backend).
[[noreturn]] void refuse_cpu_job_under_torchrun(const LaunchInfo& launch) {
  std::fprintf(stderr,
               "[fsdp comm] rank %d of %d: fsdp::comm::init_process_group: this CPU job was launched by "
               "torchrun, but CPU tensors communicate through MPI, which torchrun does not start (each "
               "process would be a job of its own). Launch CPU jobs with `mpirun -np %d ...`, or train on "
               "CUDA tensors (NCCL) under torchrun.\n",
               launch.rank, launch.world_size, launch.world_size);
  std::fflush(stderr);
  std::exit(1);
}

}  // namespace

std::chrono::milliseconds resolve_timeout(const InitOptions& options) {
  if (options.timeout) return *options.timeout;
  if (const char* env = std::getenv("FSDP_COMM_TIMEOUT_S")) {
    try {
      const double seconds = std::stod(env);
      TORCH_CHECK(seconds > 0, "");
      return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
    } catch (...) {
      TORCH_CHECK(false, "fsdp comm: FSDP_COMM_TIMEOUT_S must be a positive number of seconds, got '",
                  env, "'");
    }
  }
  return kDefaultCollectiveTimeout;
}

ProcessGroup init_process_group(InitOptions options) {
  if (options.device_id) {
    TORCH_CHECK(options.device_id->is_cuda() && options.device_id->has_index(),
                "fsdp comm: init_process_group(device_id=", *options.device_id,
                ") needs a CUDA device with an index, e.g. cuda:LOCAL_RANK (as torch.distributed's "
                "device_id)");
    TORCH_CHECK(!options.device || *options.device == *options.device_id,
                "fsdp comm: init_process_group got device=", *options.device, " and device_id=",
                *options.device_id, "; they must name the same device (or set only device_id)");
  }
  ProcessGroup group;
  group.launch = read_launch_env();
  group.device = options.device_id ? *options.device_id
                                   : options.device.value_or(default_device(group.launch));
  const auto timeout = resolve_timeout(options);

  c10::intrusive_ptr<c10d::Backend> backend;
  if (group.device.is_cpu()) {
    if (group.launch.launcher == Launcher::kTorchrun && !group.launch.run_id.empty() &&
        group.launch.world_size > 1) {
      refuse_cpu_job_under_torchrun(group.launch);
    }
    backend = make_mpi_backend(group.launch, timeout);
  } else {
    BackendFactory factory = find_backend_factory(group.device.type());
    TORCH_CHECK(factory != nullptr, "fsdp comm: no backend for device ", group.device,
                " is linked into this program. For CUDA, depend on //comm:nccl.");
    BackendRequest request;
    request.device = group.device;
    request.timeout = timeout;
    request.eager_init = options.device_id.has_value();
    backend = factory(group.launch, request);
  }
  group.comm = std::make_shared<Communicator>(std::move(backend), group.device);
  std::vector<int> ranks(group.comm->size());
  for (int r = 0; r < group.comm->size(); ++r) ranks[r] = r;
  group.comm->set_world_ranks(std::move(ranks));  // the world: group rank r is world rank r

  std::lock_guard<std::mutex> guard(g_default_lock);
  g_default = group;
  return group;
}

const ProcessGroup& default_process_group() {
  std::lock_guard<std::mutex> guard(g_default_lock);
  TORCH_CHECK(g_default.has_value(),
              "fsdp comm: no process group yet; call fsdp::comm::init_process_group() first");
  return *g_default;
}

bool is_initialized() {
  std::lock_guard<std::mutex> guard(g_default_lock);
  return g_default.has_value();
}

void destroy_process_group() {
  std::optional<ProcessGroup> group;
  {
    std::lock_guard<std::mutex> guard(g_default_lock);
    group.swap(g_default);
  }
  if (!group) return;
  const c10::intrusive_ptr<c10d::Backend> backend = group->comm->backend();
  const bool mpi = backend->getBackendName() == "mpi";
  // NCCL: ProcessGroupNCCL::shutdown() destroys the communicators (as
  // torch.distributed.destroy_process_group does); the MPI backend has nothing of its own to shut.
  backend->shutdown();
  group.reset();
  // MPI is process-wide: stopping the progress thread drains the collectives in flight, then
  // MPI_Finalize. Only for an MPI default group: after NCCL (whose rendezvous may have used MPI
  // under mpirun) MPI stays usable so that init_process_group can run again.
  if (mpi) mpi::finalize();
}

}  // namespace fsdp::comm
