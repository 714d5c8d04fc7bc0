// Point-to-point latency on 2 ranks: p50 and p90 of a send/recv round trip (rank 0 sends, rank 1
// receives and sends it back) for 4 B and 4 MiB, through the Communicator (envelope, payload and
// answer: [Note: MPI point-to-point]) and, as the floor, plain blocking MPI_Send/MPI_Recv on the
// same processes. Prints the machine's load averages too (figures taken on a busy machine vary).
//
//   bazel build -c opt //tests/comm:p2p_latency_main
//   mpirun -np 2 bazel-bin/tests/comm/p2p_latency_main
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/comm/mpi_backend.h"
#include "fsdp_cpp/comm/mpi_runtime.h"

namespace {

using Clock = std::chrono::steady_clock;

double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(p * (v.size() - 1))];
}

std::string load_averages() {
  std::ifstream in("/proc/loadavg");
  std::string one, five, fifteen;
  in >> one >> five >> fifteen;
  return one + " " + five + " " + fifteen;
}

// Round trips through the Communicator, in microseconds.
std::vector<double> communicator_round_trips(fsdp::comm::Communicator& comm, int64_t bytes, int iterations) {
  at::Tensor buffer = at::ones({bytes}, at::kByte);
  std::vector<double> us;
  for (int i = 0; i < iterations; ++i) {
    const auto t0 = Clock::now();
    if (comm.rank() == 0) {
      auto recv = comm.recv(buffer, 1, 1);  // issued first, as a pipeline stage does
      comm.send(buffer, 1, 0).wait();
      recv.wait();
    } else {
      comm.recv(buffer, 0, 0).wait();
      comm.send(buffer, 0, 1).wait();
    }
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  return us;
}

// The same with plain blocking MPI on MPI_COMM_WORLD (nothing else is in flight meanwhile).
std::vector<double> mpi_round_trips(int rank, int64_t bytes, int iterations) {
  std::vector<uint8_t> buffer(bytes, 1);
  std::vector<double> us;
  std::lock_guard<std::mutex> guard(fsdp::comm::mpi::mpi_lock());
  for (int i = 0; i < iterations; ++i) {
    const auto t0 = Clock::now();
    if (rank == 0) {
      MPI_Send(buffer.data(), static_cast<int>(bytes), MPI_BYTE, 1, 0, MPI_COMM_WORLD);
      MPI_Recv(buffer.data(), static_cast<int>(bytes), MPI_BYTE, 1, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    } else {
      MPI_Recv(buffer.data(), static_cast<int>(bytes), MPI_BYTE, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      MPI_Send(buffer.data(), static_cast<int>(bytes), MPI_BYTE, 0, 1, MPI_COMM_WORLD);
    }
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  return us;
}

}  // namespace

int main() {
  fsdp::comm::Communicator comm(fsdp::comm::MpiBackend::create_world(), at::kCPU);
  if (comm.size() != 2) {
    if (comm.rank() == 0) std::fprintf(stderr, "p2p_latency_main: run on 2 ranks (mpirun -np 2)\n");
    return 1;
  }
  if (comm.rank() == 0) std::printf("load averages before: %s\n", load_averages().c_str());
  struct Size {
    int64_t bytes;
    const char* name;
    int iterations;
  };
  for (const Size& s : {Size{4, "4 B", 2000}, Size{4 << 20, "4 MiB", 100}}) {
    comm.barrier();
    communicator_round_trips(comm, s.bytes, s.iterations / 10);  // warm-up
    const auto ours = communicator_round_trips(comm, s.bytes, s.iterations);
    comm.barrier();
    mpi_round_trips(comm.rank(), s.bytes, s.iterations / 10);
    const auto plain = mpi_round_trips(comm.rank(), s.bytes, s.iterations);
    if (comm.rank() == 0) {
      std::printf("%-6s round trip (%d): Communicator send/recv p50 %8.1f us p90 %8.1f us | plain MPI_Send/Recv "
                  "p50 %8.1f us p90 %8.1f us | p50 ratio %.2fx\n",
                  s.name, s.iterations, percentile(ours, 0.5), percentile(ours, 0.9), percentile(plain, 0.5),
                  percentile(plain, 0.9), percentile(ours, 0.5) / percentile(plain, 0.5));
    }
  }
  if (comm.rank() == 0) std::printf("load averages after: %s\n", load_averages().c_str());
  comm.barrier();
  return 0;
}
