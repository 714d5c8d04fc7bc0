// Launched by the real torchrun (--no-python): reads torchrun's variables, rendezvouses through
// fsdp::comm::rendezvous_store (a client of the agent's store, or rank 0 serving), and exchanges one
// value per rank through the default group's store (the PrefixStore chain torch.distributed's
// Python workers use, so a Python rank of the same job reads and writes the same keys).
//
//   torchrun_store_main EXPECTED_WORLD_SIZE agent|rank0
//
// Prints one "rank R/W: ..." line on success; exits 1 with the reason otherwise.
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include <c10/util/Exception.h>

#include "fsdp_cpp/comm/launch_env.h"

namespace {

std::string text(const std::vector<uint8_t>& bytes) { return std::string(bytes.begin(), bytes.end()); }

int fail(const std::string& why) {
  std::fprintf(stderr, "torchrun_store_main: FAILED: %s\n", why.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) return fail("usage: torchrun_store_main EXPECTED_WORLD_SIZE agent|rank0");
  const int expected_world = std::stoi(argv[1]);
  const std::string mode = argv[2];
  try {
    const auto launch = fsdp::comm::read_launch_env();
    if (launch.launcher != fsdp::comm::Launcher::kTorchrun) return fail("not recognised as torchrun");
    if (launch.world_size != expected_world) {
      return fail("WORLD_SIZE " + std::to_string(launch.world_size) + ", expected " +
                  std::to_string(expected_world));
    }
    // One node: local rank = rank, local world = world.
    if (launch.local_rank != launch.rank || launch.local_world_size != launch.world_size) {
      return fail("LOCAL_RANK/LOCAL_WORLD_SIZE " + std::to_string(launch.local_rank) + "/" +
                  std::to_string(launch.local_world_size) + " on one node");
    }
    if (launch.use_agent_store != (mode == "agent")) {
      return fail(std::string("TORCHELASTIC_USE_AGENT_STORE is ") +
                  (launch.use_agent_store ? "True" : "not True") + " in mode " + mode);
    }
    auto store = fsdp::comm::rendezvous_store(launch, std::chrono::seconds(60));
    auto group = fsdp::comm::default_group_store(store, "cpu");
    const int rank = launch.rank;
    const int world = launch.world_size;
    const std::string mine = "rank " + std::to_string(rank) + " of " + std::to_string(world);
    group->set("hello/" + std::to_string(rank), std::vector<uint8_t>(mine.begin(), mine.end()));
    std::string read;
    for (int other = 0; other < world; ++other) {
      const std::string value = text(group->get("hello/" + std::to_string(other)));
      const std::string expected = "rank " + std::to_string(other) + " of " + std::to_string(world);
      if (value != expected) return fail("read '" + value + "' for rank " + std::to_string(other));
      read += (other ? ", " : "") + value;
    }
    // A counter every rank adds to: the sum is known in closed form.
    group->add("sum", rank + 1);
    group->add("arrived", 1);
    group->wait({"hello/0"});
    while (group->add("arrived", 0) < world) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    const int64_t sum = group->add("sum", 0);
    if (sum != static_cast<int64_t>(world) * (world + 1) / 2) return fail("sum " + std::to_string(sum));
    // Rank 0 (the server without the agent store) leaves last: everyone says they are done first.
    group->add("left", 1);
    if (rank == 0) {
      while (group->add("left", 0) < world) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    std::printf("rank %d/%d: rendezvous ok (%s store at %s:%d, run id '%s'); read: %s; sum %ld\n", rank,
                world, launch.use_agent_store ? "agent" : "rank-0", launch.master_addr.c_str(),
                launch.master_port, launch.run_id.c_str(), read.c_str(), static_cast<long>(sum));
    return 0;
  } catch (const std::exception& e) {
    return fail(e.what());
  }
}
