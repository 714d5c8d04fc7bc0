// torchrun's rendezvous protocol (rendezvous_store, default_group_store) with real TCPStores in one
// process, ranks as threads; and the one-GPU-per-rank check as pure functions.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <exception>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "fsdp_cpp/comm/launch_env.h"

// Last: LibTorch's c10/util/Logging.h defines its own CHECK, and the last definition wins.
#include <catch2/catch.hpp>

namespace {

using fsdp::comm::DeviceClaim;
using fsdp::comm::LaunchInfo;
using fsdp::comm::Launcher;
using Catch::Matchers::Contains;

std::string text(const std::vector<uint8_t>& bytes) { return std::string(bytes.begin(), bytes.end()); }
std::vector<uint8_t> bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

// A port nobody listens on right now (the kernel's pick for port 0).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  socklen_t len = sizeof(addr);
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  ::close(fd);
  return ntohs(addr.sin_port);
}

LaunchInfo torchrun_rank(int rank, int world, int port, bool agent_store) {
  LaunchInfo launch;
  launch.launcher = Launcher::kTorchrun;
  launch.rank = rank;
  launch.local_rank = rank;
  launch.world_size = world;
  launch.local_world_size = world;
  launch.master_addr = "127.0.0.1";
  launch.master_port = port;
  launch.use_agent_store = agent_store;
  return launch;
}

// Every rank rendezvouses, sets "value/<rank>" and reads every other rank's; returns what each rank
// read from each (or the first error).
std::vector<std::vector<std::string>> exchange(int world, int port, bool agent_store) {
  std::vector<std::vector<std::string>> seen(world);
  std::vector<std::exception_ptr> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto store = fsdp::comm::rendezvous_store(torchrun_rank(r, world, port, agent_store),
                                                  std::chrono::seconds(30));
        store->set("value/" + std::to_string(r), bytes("from " + std::to_string(r)));
        for (int other = 0; other < world; ++other) {
          seen[r].push_back(text(store->get("value/" + std::to_string(other))));
        }
        // Keep the store (rank 0's server without the agent) up until everyone is done with it.
        store->add("done", 1);
        if (r == 0) {
          while (store->add("done", 0) < world) std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) if (e) std::rethrow_exception(e);
  return seen;
}

}  // namespace

TEST_CASE("under torchrun's agent store every rank, rank 0 included, is a client", "[comm][rendezvous]") {
  for (int world : {1, 2, 3, 4}) {
    // The agent's store, as torchrun's elastic agent hosts it at MASTER_ADDR:MASTER_PORT.
    c10d::TCPStoreOptions agent_opts;
    agent_opts.port = 0;
    agent_opts.isServer = true;
    agent_opts.waitWorkers = false;
    agent_opts.useLibUV = false;
    auto agent = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", agent_opts);
    const auto seen = exchange(world, agent->getPort(), /*agent_store=*/true);
    for (int r = 0; r < world; ++r) {
      for (int other = 0; other < world; ++other) CHECK(seen[r][other] == "from " + std::to_string(other));
      // The workers' keys live in the agent's store.
      CHECK(text(agent->get("value/" + std::to_string(r))) == "from " + std::to_string(r));
    }
  }
}

TEST_CASE("under the agent store rank 0 does not serve: without the agent it cannot rendezvous",
          "[comm][rendezvous]") {
  const int port = free_port();
  CHECK_THROWS_WITH(fsdp::comm::rendezvous_store(torchrun_rank(0, 2, port, true), std::chrono::seconds(1)),
                    Contains("rank 0 could not reach the rendezvous store at 127.0.0.1:" +
                             std::to_string(port)) &&
                        Contains("hosted by torchrun's agent"));
}

TEST_CASE("without the agent store rank 0 serves on MASTER_PORT and the others connect",
          "[comm][rendezvous]") {
  for (int world : {1, 2, 3, 4}) {
    const auto seen = exchange(world, free_port(), /*agent_store=*/false);
    for (int r = 0; r < world; ++r) {
      for (int other = 0; other < world; ++other) CHECK(seen[r][other] == "from " + std::to_string(other));
    }
  }
}

TEST_CASE("rendezvous without MASTER_ADDR: a private store for one rank, an error for more",
          "[comm][rendezvous]") {
  LaunchInfo single;
  auto store = fsdp::comm::rendezvous_store(single, std::chrono::seconds(5));
  store->set("k", bytes("v"));
  CHECK(text(store->get("k")) == "v");
  LaunchInfo two;
  two.launcher = Launcher::kMpirun;
  two.world_size = 2;
  CHECK_THROWS_WITH(fsdp::comm::rendezvous_store(two, std::chrono::seconds(5)),
                    Contains("needs MASTER_ADDR and MASTER_PORT"));
  LaunchInfo bad_port = torchrun_rank(0, 2, 70000, false);
  CHECK_THROWS_WITH(fsdp::comm::rendezvous_store(bad_port, std::chrono::seconds(5)),
                    Contains("MASTER_PORT in 1..65535") && Contains("70000"));
}

TEST_CASE("the default group's store keys as torch.distributed's default group does", "[comm][rendezvous]") {
  auto store = fsdp::comm::rendezvous_store(LaunchInfo{}, std::chrono::seconds(5));
  auto cuda = fsdp::comm::default_group_store(store, "cuda");
  cuda->set("ncclUniqueId", bytes("id"));
  // PrefixStore joins with '/': "default_pg" + "/" + "0/" + "/" + "cuda/" + "/" + key.
  CHECK(text(store->get("default_pg/0//cuda//ncclUniqueId")) == "id");
  auto cpu = fsdp::comm::default_group_store(store, "cpu");
  cpu->set("k", bytes("c"));
  CHECK(text(store->get("default_pg/0//cpu//k")) == "c");
}

TEST_CASE("device claims travel through the store as text", "[comm][device_check]") {
  DeviceClaim claim{5, 1, "node-a", "GPU-00ff", 1};
  const auto back = fsdp::comm::device_claim_from_store_value(fsdp::comm::to_store_value(claim));
  CHECK(back.rank == 5);
  CHECK(back.local_rank == 1);
  CHECK(back.host == "node-a");
  CHECK(back.device_uuid == "GPU-00ff");
  CHECK(back.device_index == 1);
  CHECK_THROWS_WITH(fsdp::comm::device_claim_from_store_value("5\tnode-a"),
                    Contains("malformed device claim") && Contains("5\tnode-a"));
  CHECK_THROWS_WITH(fsdp::comm::device_claim_from_store_value("x\t1\th\tu\t0"),
                    Contains("malformed device claim"));
}

TEST_CASE("two ranks on one GPU of one host are found, with both ranks named", "[comm][device_check]") {
  // One GPU per rank: different GPUs on one host, or the same index/UUID on different hosts.
  CHECK_FALSE(fsdp::comm::find_shared_device({{0, 0, "a", "GPU-1", 0}, {1, 1, "a", "GPU-2", 1},
                                              {2, 0, "b", "GPU-1", 0}, {3, 1, "b", "GPU-2", 1}}));
  CHECK_FALSE(fsdp::comm::find_shared_device({}));
  // CUDA_VISIBLE_DEVICES narrowed to one GPU per rank: every rank uses cuda:0, all different GPUs.
  CHECK_FALSE(fsdp::comm::find_shared_device({{0, 0, "a", "GPU-1", 0}, {1, 1, "a", "GPU-2", 0}}));
  // Two local ranks picking the same device.
  const auto same_index = fsdp::comm::find_shared_device(
      {{0, 0, "a", "GPU-1", 0}, {1, 1, "a", "GPU-2", 1}, {2, 2, "a", "GPU-1", 0}});
  REQUIRE(same_index);
  CHECK_THAT(*same_index, Contains("ranks 0 (LOCAL_RANK=0, cuda:0) and 2 (LOCAL_RANK=2, cuda:0)") &&
                              Contains("host 'a'") && Contains("GPU-1") &&
                              Contains("--nproc-per-node"));
  // Same physical GPU under different indices (CUDA_VISIBLE_DEVICES set differently per rank).
  const auto same_uuid =
      fsdp::comm::find_shared_device({{4, 0, "b", "GPU-9", 0}, {5, 1, "b", "GPU-9", 1}});
  REQUIRE(same_uuid);
  CHECK_THAT(*same_uuid, Contains("ranks 4") && Contains("and 5") && Contains("CUDA_VISIBLE_DEVICES"));
}

TEST_CASE("more local ranks than GPUs, or a device that does not exist, fail before NCCL",
          "[comm][device_check]") {
  LaunchInfo launch = torchrun_rank(3, 4, 29500, true);
  launch.local_world_size = 4;
  // cuda:LOCAL_RANK on a node with 2 GPUs and 4 local ranks.
  CHECK_THROWS_WITH(fsdp::comm::check_local_device(launch, 3, 2, /*from_local_rank=*/true),
                    Contains("LOCAL_WORLD_SIZE=4 ranks were started on this node but it sees only 2") &&
                        Contains("--nproc-per-node 2"));
  // An explicit device that does not exist.
  launch.local_world_size = 1;
  CHECK_THROWS_WITH(fsdp::comm::check_local_device(launch, 5, 2, /*from_local_rank=*/false),
                    Contains("rank 3 picked cuda:5 but this process sees only 2"));
  CHECK_THROWS_WITH(fsdp::comm::check_local_device(launch, 0, 0, false), Contains("sees none"));
  // Fine: as many local ranks as GPUs; or an explicit device with a narrowed CUDA_VISIBLE_DEVICES.
  launch.local_world_size = 2;
  launch.local_rank = 1;
  CHECK_NOTHROW(fsdp::comm::check_local_device(launch, 1, 2, true));
  launch.local_world_size = 8;
  CHECK_NOTHROW(fsdp::comm::check_local_device(launch, 0, 1, false));
}
