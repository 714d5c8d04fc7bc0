// An MPI application embedding the library, which initialises and finalises MPI itself: it makes
// the process group, a hybrid mesh (groups split from the world) and the groups fully_shard
// derives (post-forward and reduce groups, kept in a process-wide cache until static
// destruction), communicates on each, calls MPI_Finalize itself and returns 0. The communicators
// still alive then are destroyed after MPI_Finalize: the MPI backend must make no MPI call then
// (comm/mpi_backend.h), so the process exits 0 with no "after MPI_FINALIZE" abort. Prints
// "rank R/W: own finalize ok" just before returning.
//   mpirun -np 2 own_mpi_finalize_main
#include <mpi.h>

#include <cstdio>
#include <string>

#include <ATen/ATen.h>

#include "fsdp_cpp/comm/device_mesh.h"
#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/comm/mpi_runtime.h"
#include "fsdp_cpp/fsdp/derived_groups.h"

namespace {

int fail(int rank, const std::string& why) {
  std::fprintf(stderr, "own_mpi_finalize_main: rank %d FAILED: %s\n", rank, why.c_str());
  return 1;
}

// An all-reduce of ones over `comm`: its size everywhere.
bool sums_to_size(fsdp::comm::Communicator& comm) {
  at::Tensor t = at::ones({8});
  comm.all_reduce(t).wait();
  return t.equal(at::full({8}, static_cast<float>(comm.size())));
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  if (MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS) return 2;
  int rank = 0, world = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  {
    auto group = fsdp::comm::init_process_group();
    if (world % 2 != 0) return fail(rank, "run on an even number of ranks");
    auto mesh = fsdp::comm::DeviceMesh::hybrid(*group.comm, /*shard_size=*/2);
    auto shard = mesh->group("shard");
    auto post_forward = fsdp::post_forward_group(shard, 2);  // cached until static destruction
    auto reduce = fsdp::reduce_group(shard);                 // cached too
    for (auto* comm : {group.comm.get(), shard.get(), mesh->group("replicate").get(), post_forward.get(),
                       reduce.get()}) {
      if (!sums_to_size(*comm)) return fail(rank, "an all_reduce gave a wrong sum");
    }
    if (fsdp::comm::mpi::finalized()) return fail(rank, "finalized() true before MPI_Finalize");
    MPI_Barrier(MPI_COMM_WORLD);
    MPI_Finalize();  // the application's own, with the library's communicators still alive
    if (!fsdp::comm::mpi::finalized()) return fail(rank, "finalized() false after the program's MPI_Finalize");
  }  // the mesh and the process group's copies are released here, the cache at exit
  std::fprintf(stderr, "rank %d/%d: own finalize ok\n", rank, world);
  return 0;
}
