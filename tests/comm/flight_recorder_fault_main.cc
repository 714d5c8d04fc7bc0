// Jobs whose flight recorder dumps tools/flight_recorder.py must explain (flight_recorder_fault_test.sh):
//   flight_recorder_fault_main skip      the last rank skips collective #3 (an all-gather the others
//                                        issue inside "fsdp::dcp::save") and stays alive: the others'
//                                        collective timeout (2 s) dumps and aborts the job; the last
//                                        rank dumps on the SIGTERM that ends it
//   flight_recorder_fault_main diverge   the last rank skips that all-gather and issues the next
//                                        collective (an all-reduce 'loss'): the size check fails it on
//                                        every rank, and every rank dumps (as the divergence check does,
//                                        flight_recorder::dump(reason)) and exits 1
//   flight_recorder_fault_main recv      rank 0 waits for a recv from rank 1 (tag 7, 'activations')
//                                        that rank 1, alive, never sends (a pipeline peer that never
//                                        sends): rank 0's timeout dumps and aborts the job
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <c10/util/Exception.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/comm/flight_recorder.h"
#include "fsdp_cpp/comm/issuing_api.h"
#include "fsdp_cpp/comm/mpi_backend.h"

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode != "skip" && mode != "diverge" && mode != "recv") {
    std::fprintf(stderr, "usage: flight_recorder_fault_main skip|diverge|recv\n");
    return 2;
  }
  fsdp::comm::MpiBackend::Options options;
  options.timeout = std::chrono::milliseconds(2000);
  fsdp::comm::Communicator comm(fsdp::comm::MpiBackend::create_world(options), at::kCPU);
  const int W = comm.size();
  const int rank = comm.rank();
  comm.all_reduce(at::ones({8}), c10d::ReduceOp::SUM, "step 0 loss").wait();  // #1 everywhere
  comm.barrier();                                                               // #2 everywhere
  if (mode == "recv") {
    if (rank == 0) {
      fsdp::comm::IssuingApi api("pipeline stage 0");
      at::Tensor t = at::empty({2, 4});
      comm.recv(t, 1, 7, "activations").wait();
      std::fprintf(stderr, "rank 0: the recv completed although rank 1 never sent\n");
      return 0;
    }
    std::this_thread::sleep_for(std::chrono::seconds(60));
    return 0;
  }
  const bool skipper = rank == W - 1;
  if (skipper && mode == "skip") {
    std::fprintf(stderr, "rank %d skips the all-gather and stays alive\n", rank);
    std::this_thread::sleep_for(std::chrono::seconds(60));
    return 0;
  }
  try {
    if (!skipper) {
      fsdp::comm::IssuingApi api("fsdp::dcp::save");
      at::Tensor out = at::empty({W * 16});
      comm.all_gather_into_tensor(out, at::ones({16}), "save reports").wait();  // #3
    }
    comm.all_reduce(at::ones({1}), c10d::ReduceOp::SUM, "loss").wait();
    std::fprintf(stderr, "rank %d: no error although rank %d skipped a collective\n", rank, W - 1);
    return 0;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "rank %d: error: %s\n", rank, e.what_without_backtrace());
    fsdp::comm::flight_recorder::dump(std::string("divergence: ") + e.what_without_backtrace());
    std::_Exit(1);  // the others may be inside a collective: no MPI_Finalize
  }
}
