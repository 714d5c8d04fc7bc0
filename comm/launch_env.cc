#include "fsdp_cpp/comm/launch_env.h"

#include <cstdint>
#include <cstdlib>
#include <map>
#include <sstream>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace fsdp::comm {
namespace {

using Getenv = std::function<std::optional<std::string>(const char*)>;

std::optional<int> read_int(const Getenv& getenv, const char* name) {
  const auto value = getenv(name);
  if (!value) return std::nullopt;
  char* end = nullptr;
  const long parsed = std::strtol(value->c_str(), &end, 10);
  TORCH_CHECK(!value->empty() && end != nullptr && *end == '\0' && parsed >= INT32_MIN &&
                  parsed <= INT32_MAX,
              "fsdp comm: environment variable ", name, " must be an integer, got '", *value, "'");
  return static_cast<int>(parsed);
}

void check_consistent(const LaunchInfo& info, const char* rank_var, const char* size_var) {
  TORCH_CHECK(info.world_size >= 1, "fsdp comm: ", size_var, " must be at least 1, got ",
              info.world_size);
  TORCH_CHECK(info.rank >= 0 && info.rank < info.world_size, "fsdp comm: ", rank_var, "=",
              info.rank, " is outside the world of ", size_var, "=", info.world_size, " ranks");
  TORCH_CHECK(info.local_rank >= 0, "fsdp comm: the local rank must be non-negative, got ",
              info.local_rank);
}

}  // namespace

const char* to_string(Launcher launcher) {
  switch (launcher) {
    case Launcher::kNone: return "none (single process)";
    case Launcher::kTorchrun: return "torchrun";
    case Launcher::kMpirun: return "mpirun";
  }
  return "?";
}

LaunchInfo read_launch_env(const Getenv& getenv_in) {
  const Getenv getenv = getenv_in ? getenv_in : Getenv([](const char* name) -> std::optional<std::string> {
    const char* value = std::getenv(name);
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  });

  LaunchInfo info;
  const auto rank = read_int(getenv, "RANK");
  const auto world = read_int(getenv, "WORLD_SIZE");
  if (rank || world) {
    TORCH_CHECK(rank && world, "fsdp comm: torchrun-style launch needs both RANK and WORLD_SIZE; ",
                rank ? "WORLD_SIZE" : "RANK", " is not set");
    info.launcher = Launcher::kTorchrun;
    info.rank = *rank;
    info.world_size = *world;
    info.local_rank = read_int(getenv, "LOCAL_RANK").value_or(0);
    info.local_world_size = read_int(getenv, "LOCAL_WORLD_SIZE").value_or(0);
    info.group_rank = read_int(getenv, "GROUP_RANK").value_or(0);
    info.master_addr = getenv("MASTER_ADDR").value_or("");
    info.master_port = read_int(getenv, "MASTER_PORT").value_or(0);
    // torchrun writes str(True) / str(False); rendezvous.py compares with "True" exactly.
    info.use_agent_store = getenv("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True";
    info.run_id = getenv("TORCHELASTIC_RUN_ID").value_or("");
    check_consistent(info, "RANK", "WORLD_SIZE");
    TORCH_CHECK(info.local_world_size == 0 || info.local_rank < info.local_world_size,
                "fsdp comm: LOCAL_RANK=", info.local_rank, " is outside LOCAL_WORLD_SIZE=",
                info.local_world_size);
    // Under mpirun as well (a user exporting RANK/WORLD_SIZE themselves): the two must agree.
    const auto ompi_rank = read_int(getenv, "OMPI_COMM_WORLD_RANK");
    const auto ompi_size = read_int(getenv, "OMPI_COMM_WORLD_SIZE");
    if (ompi_rank && ompi_size) {
      TORCH_CHECK(*ompi_rank == info.rank && *ompi_size == info.world_size,
                  "fsdp comm: RANK/WORLD_SIZE (", info.rank, "/", info.world_size,
                  ") disagree with mpirun's OMPI_COMM_WORLD_RANK/SIZE (", *ompi_rank, "/",
                  *ompi_size, ")");
      info.launcher = Launcher::kMpirun;
    }
    return info;
  }

  struct MpiVars { const char* rank; const char* size; const char* local_rank; const char* local_size; };
  for (const MpiVars vars : {MpiVars{"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                                     "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"},
                             MpiVars{"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"}}) {
    const auto mpi_rank = read_int(getenv, vars.rank);
    const auto mpi_size = read_int(getenv, vars.size);
    if (!mpi_rank && !mpi_size) continue;
    TORCH_CHECK(mpi_rank && mpi_size, "fsdp comm: mpirun-style launch needs both ", vars.rank,
                " and ", vars.size);
    info.launcher = Launcher::kMpirun;
    info.rank = *mpi_rank;
    info.world_size = *mpi_size;
    info.local_rank = read_int(getenv, vars.local_rank).value_or(0);
    info.local_world_size = read_int(getenv, vars.local_size).value_or(0);
    info.master_addr = getenv("MASTER_ADDR").value_or("");
    info.master_port = read_int(getenv, "MASTER_PORT").value_or(0);
    check_consistent(info, vars.rank, vars.size);
    return info;
  }
  return info;  // a plain run: one process
}

c10::intrusive_ptr<c10d::Store> rendezvous_store(const LaunchInfo& launch,
                                                 std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions opts;
  opts.numWorkers = static_cast<std::size_t>(launch.world_size);
  opts.timeout = timeout;
  // The wire protocol is the same for both server implementations; the classic one is always built.
  opts.useLibUV = false;
  if (launch.master_addr.empty()) {
    TORCH_CHECK(launch.world_size == 1, "fsdp comm: rendezvous of ", launch.world_size,
                " ranks launched by ", to_string(launch.launcher),
                " needs MASTER_ADDR and MASTER_PORT (torchrun sets both; under mpirun export them, "
                "e.g. MASTER_ADDR=<first node> MASTER_PORT=29500)");
    opts.port = 0;  // a free port; nobody else needs to find it
    opts.isServer = true;
    return c10::make_intrusive<c10d::TCPStore>("127.0.0.1", opts);
  }
  TORCH_CHECK(launch.master_port > 0 && launch.master_port < 65536,
              "fsdp comm: rendezvous needs MASTER_PORT in 1..65535 with MASTER_ADDR=",
              launch.master_addr, ", got ", launch.master_port);
  opts.port = static_cast<uint16_t>(launch.master_port);
  if (launch.use_agent_store) {
    // torchrun's agent serves the store at its own MASTER_ADDR:MASTER_PORT: everyone is a client.
    opts.isServer = false;
  } else {
    opts.isServer = launch.rank == 0;
    opts.multiTenant = true;
  }
  try {
    return c10::make_intrusive<c10d::TCPStore>(launch.master_addr, opts);
  } catch (const std::exception& error) {
    const auto* c10_error = dynamic_cast<const c10::Error*>(&error);
    const char* cause = c10_error ? c10_error->what_without_backtrace() : error.what();
    TORCH_CHECK(false, "fsdp comm: rank ", launch.rank, " could not ",
                opts.isServer ? "serve" : "reach", " the rendezvous store at ", launch.master_addr,
                ":", launch.master_port, " (launcher ", to_string(launch.launcher),
                launch.use_agent_store ? ", hosted by torchrun's agent" :
                                         (opts.isServer ? ", hosted by this rank" : ", hosted by rank 0"),
                launch.run_id.empty() ? std::string() : ", run id " + launch.run_id,
                ") within ", timeout.count(), " ms: ", cause);
  }
}

c10::intrusive_ptr<c10d::Store> default_group_store(const c10::intrusive_ptr<c10d::Store>& store,
                                                    const std::string& device_type) {
  TORCH_CHECK(store, "fsdp comm: default_group_store needs a store");
  auto pg = c10::make_intrusive<c10d::PrefixStore>("default_pg", store);
  auto group = c10::make_intrusive<c10d::PrefixStore>("0/", pg);
  return c10::make_intrusive<c10d::PrefixStore>(device_type + "/", group);
}

std::string to_store_value(const DeviceClaim& claim) {
  std::ostringstream out;
  out << claim.rank << '\t' << claim.local_rank << '\t' << claim.host << '\t' << claim.device_uuid
      << '\t' << claim.device_index;
  return out.str();
}

DeviceClaim device_claim_from_store_value(const std::string& text) {
  std::vector<std::string> fields;
  std::string::size_type start = 0;
  while (true) {
    const auto tab = text.find('\t', start);
    fields.push_back(text.substr(start, tab == std::string::npos ? std::string::npos : tab - start));
    if (tab == std::string::npos) break;
    start = tab + 1;
  }
  TORCH_CHECK(fields.size() == 5, "fsdp comm: malformed device claim in the rendezvous store: '",
              text, "' (expected rank, local rank, host, GPU UUID, device index)");
  auto as_int = [&](const std::string& field) {
    char* end = nullptr;
    const long value = std::strtol(field.c_str(), &end, 10);
    TORCH_CHECK(!field.empty() && *end == '\0' && value >= 0 && value <= INT32_MAX,
                "fsdp comm: malformed device claim in the rendezvous store: '", text, "'");
    return static_cast<int>(value);
  };
  DeviceClaim claim;
  claim.rank = as_int(fields[0]);
  claim.local_rank = as_int(fields[1]);
  claim.host = fields[2];
  claim.device_uuid = fields[3];
  claim.device_index = as_int(fields[4]);
  return claim;
}

std::optional<std::string> find_shared_device(const std::vector<DeviceClaim>& claims) {
  std::map<std::pair<std::string, std::string>, const DeviceClaim*> first_owner;
  for (const DeviceClaim& claim : claims) {
    const auto [it, inserted] = first_owner.emplace(std::make_pair(claim.host, claim.device_uuid), &claim);
    if (inserted) continue;
    const DeviceClaim& other = *it->second;
    std::ostringstream out;
    out << "fsdp comm: ranks " << other.rank << " (LOCAL_RANK=" << other.local_rank << ", cuda:"
        << other.device_index << ") and " << claim.rank << " (LOCAL_RANK=" << claim.local_rank
        << ", cuda:" << claim.device_index << ") on host '" << claim.host
        << "' would share one GPU (UUID " << claim.device_uuid
        << "); NCCL needs one GPU per rank. Start at most as many ranks per node as it has GPUs "
           "(torchrun --nproc-per-node), map LOCAL_RANK to distinct devices, and do not narrow "
           "CUDA_VISIBLE_DEVICES to the same GPU for several ranks";
    return out.str();
  }
  return std::nullopt;
}

void check_local_device(const LaunchInfo& launch, int device_index, int device_count,
                        bool from_local_rank) {
  TORCH_CHECK(device_count > 0, "fsdp comm: rank ", launch.rank,
              " needs a CUDA device for NCCL but sees none (check CUDA_VISIBLE_DEVICES)");
  // Ranks narrowed to one GPU each by CUDA_VISIBLE_DEVICES all use cuda:0 legitimately, so a
  // LOCAL_WORLD_SIZE above the device count is only an error when this rank's device is missing;
  // ranks that share a visible GPU are found through the store (find_shared_device).
  if (from_local_rank && launch.local_world_size > device_count && device_index >= device_count) {
    TORCH_CHECK(false, "fsdp comm: LOCAL_WORLD_SIZE=", launch.local_world_size,
                " ranks were started on this node but it sees only ", device_count,
                " CUDA device(s), so ranks would share a GPU (rank ", launch.rank, " has LOCAL_RANK=",
                launch.local_rank, "). Start at most ", device_count,
                " ranks per node (torchrun --nproc-per-node ", device_count, ")");
  }
  TORCH_CHECK(device_index >= 0 && device_index < device_count, "fsdp comm: rank ", launch.rank,
              " picked cuda:", device_index, from_local_rank ? " (from LOCAL_RANK)" : "",
              " but this process sees only ", device_count,
              " CUDA device(s) (LOCAL_RANK=", launch.local_rank, ", LOCAL_WORLD_SIZE=",
              launch.local_world_size, ")");
}

}  // namespace fsdp::comm
