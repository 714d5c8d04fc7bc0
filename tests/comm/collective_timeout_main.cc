// Jobs in which a collective cannot complete, for collective_timeout_test.sh, which expects the job
// to be aborted within the timeout (2 s) with a report naming the collective:
//   collective_timeout_main            the last rank stays alive but skips an all-gather, which the
//                                      other ranks issue inside an API scope ("fsdp::dcp::save")
//   collective_timeout_main callback   every rank: a completion callback on the progress thread
//                                      blocks on another collective's future (not through wait()),
//                                      so nobody polls any more; the deadline must still fire
//   collective_timeout_main recv       rank 0 waits for a recv from rank 1 (tag 42) that rank 1,
//                                      alive, never sends ([Note: MPI point-to-point])
//   collective_timeout_main send       rank 0 waits for a send to rank 1 (tag 43) that rank 1 never
//                                      receives
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/comm/issuing_api.h"
#include "fsdp_cpp/comm/mpi_backend.h"

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "skip";
  fsdp::comm::MpiBackend::Options options;
  options.timeout = std::chrono::milliseconds(2000);
  fsdp::comm::Communicator comm(fsdp::comm::MpiBackend::create_world(options), at::kCPU);
  const int W = comm.size();
  comm.all_reduce(at::ones({8})).wait();  // collective #1: everyone takes part
  if (mode == "callback") {
    auto backend = comm.backend();
    std::vector<at::Tensor> first{at::ones({4})};
    auto first_work = backend->allreduce(first);  // collective #2
    first_work->getFuture()->addCallback([&](c10::ivalue::Future&) {
      fsdp::comm::IssuingApi api("a callback that blocks");
      std::vector<at::Tensor> inner{at::ones({2})};
      // #3: waited for through its future, which does not drive progress.
      backend->allreduce(inner)->getFuture()->wait();
    });
    std::this_thread::sleep_for(std::chrono::seconds(120));
    std::fprintf(stderr, "rank %d: nothing aborted the job\n", comm.rank());
    return 0;
  }
  if (mode == "recv" || mode == "send") {
    if (comm.rank() == 0) {
      fsdp::comm::IssuingApi api("pipeline stage 0");
      at::Tensor t = at::ones({16});
      if (mode == "recv") {
        comm.recv(t, 1, 42, "activations").wait();
      } else {
        comm.send(t, 1, 43, "activations").wait();
      }
      std::fprintf(stderr, "rank 0: the %s completed although rank 1 never answered\n", mode.c_str());
      return 0;
    }
    std::this_thread::sleep_for(std::chrono::seconds(120));
    return 0;
  }
  if (comm.rank() == W - 1) {
    std::fprintf(stderr, "rank %d skips the all-gather and stays alive\n", comm.rank());
    std::this_thread::sleep_for(std::chrono::seconds(120));
    return 0;
  }
  fsdp::comm::IssuingApi api("fsdp::dcp::save");
  at::Tensor out = at::empty({W * 16});
  comm.all_gather_into_tensor(out, at::ones({16}), "save reports").wait();  // #2: never completes
  std::fprintf(stderr, "rank %d: the all-gather completed although a rank skipped it\n", comm.rank());
  return 0;
}
