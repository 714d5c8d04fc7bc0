// A job where the last rank stays alive but skips a collective. Run by collective_timeout_test.sh,
// which expects the job to be aborted within the timeout with a report naming that collective.
#include <chrono>
#include <cstdio>
#include <thread>

#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>

#include "comm/communicator.h"
#include "comm/mpi_backend.h"

int main() {
  fsdp::comm::MpiBackend::Options options;
  options.timeout = std::chrono::milliseconds(2000);
  fsdp::comm::Communicator comm(fsdp::comm::MpiBackend::create_world(options), at::kCPU);
  const int W = comm.size();
  comm.all_reduce(at::ones({8})).wait();  // collective #1: everyone takes part
  if (comm.rank() == W - 1) {
    std::fprintf(stderr, "rank %d skips the all-gather and stays alive\n", comm.rank());
    std::this_thread::sleep_for(std::chrono::seconds(120));
    return 0;
  }
  at::Tensor out = at::empty({W * 16});
  comm.all_gather_into_tensor(out, at::ones({16})).wait();  // collective #2: never completes
  std::fprintf(stderr, "rank %d: the all-gather completed although a rank skipped it\n", comm.rank());
  return 0;
}
