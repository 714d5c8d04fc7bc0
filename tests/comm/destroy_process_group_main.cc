// destroy_process_group() on the MPI backend, under mpirun on every world size: init, a collective
// checked in closed form, destroy (the progress thread stops, MPI_Finalize), a second destroy (a
// no-op), then init again, which must fail saying MPI cannot be initialised twice; and the process
// exits 0 with nothing left to static destruction. Prints "rank R/W: destroy ok" on success.
#include <cstdio>
#include <string>

#include <ATen/ATen.h>

#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/comm/mpi_runtime.h"

namespace {

int fail(int rank, const std::string& why) {
  std::fprintf(stderr, "destroy_process_group_main: rank %d FAILED: %s\n", rank, why.c_str());
  return 1;
}

}  // namespace

int main() {
  auto group = fsdp::comm::init_process_group();
  const int rank = group.launch.rank;
  const int world = group.launch.world_size;
  if (!fsdp::comm::is_initialized()) return fail(rank, "is_initialized() false after init");
  at::Tensor t = at::full({4}, rank + 1, at::kLong);
  group.comm->all_reduce(t).wait();
  if (!t.equal(at::full({4}, static_cast<int64_t>(world) * (world + 1) / 2, at::kLong))) {
    return fail(rank, "all_reduce gave " + std::to_string(t[0].item<int64_t>()));
  }
  // A collective still in flight when destroy starts is completed, not dropped.
  at::Tensor late = at::full({1 << 16}, 1.0f);
  auto work = group.comm->all_reduce(late);

  fsdp::comm::destroy_process_group();
  if (!work.completed()) return fail(rank, "destroy returned with a collective in flight");
  work.wait();
  if (late[0].item<float>() != static_cast<float>(world)) return fail(rank, "in-flight all_reduce wrong");
  if (fsdp::comm::is_initialized()) return fail(rank, "is_initialized() true after destroy");
  if (!fsdp::comm::mpi::finalized()) return fail(rank, "MPI not finalised by destroy");
  try {
    fsdp::comm::default_process_group();
    return fail(rank, "default_process_group() after destroy did not throw");
  } catch (const c10::Error& e) {
    if (std::string(e.what()).find("no process group yet") == std::string::npos) {
      return fail(rank, std::string("unexpected message: ") + e.what());
    }
  }
  fsdp::comm::destroy_process_group();  // idempotent
  try {
    fsdp::comm::init_process_group();
    return fail(rank, "init_process_group after destroy did not throw");
  } catch (const c10::Error& e) {
    const std::string message = e.what();
    if (message.find("MPI cannot be initialised again in the same process") == std::string::npos) {
      return fail(rank, "unexpected message: " + message);
    }
  }
  std::printf("rank %d/%d: destroy ok (all_reduce %ld before, in-flight collective completed, "
              "MPI finalised, second destroy a no-op, re-init refused)\n",
              rank, world, static_cast<long>(t[0].item<int64_t>()));
  return 0;
}
