// The ranks-as-threads backend: the same closed-form checks as the MPI backend, on 1-4 threads, and
// its errors for mismatched calls and missing ranks.
#include <mutex>

#include <ATen/ATen.h>

#include "fsdp_cpp/tests/testing/thread_backend.h"

// Last: LibTorch's c10/util/Logging.h defines its own CHECK, and the last definition wins.
#include <catch2/catch.hpp>

using fsdp::testing::run_ranks_as_threads;

TEST_CASE("thread backend collectives match closed forms on 1-4 ranks", "[testing][threads]") {
  for (int W = 1; W <= 4; ++W) {
    std::mutex m;
    std::vector<std::string> wrong;
    run_ranks_as_threads(W, [&](fsdp::comm::Communicator& comm) {
      const int r = comm.rank();
      auto note = [&](bool ok, const char* what) {
        if (!ok) {
          std::lock_guard<std::mutex> g(m);
          wrong.push_back(std::string(what) + " on rank " + std::to_string(r) + " of " + std::to_string(W));
        }
      };
      at::Tensor t = at::full({5}, r + 1, at::kFloat);
      comm.all_reduce(t).wait();
      note(t.equal(at::full({5}, W * (W + 1) / 2, at::kFloat)), "all_reduce");
      at::Tensor avg = at::full({3}, r + 1, at::kDouble);
      comm.all_reduce(avg, c10d::ReduceOp::AVG).wait();
      note(avg.equal(at::full({3}, (W + 1) / 2.0, at::kDouble)), "all_reduce AVG");
      at::Tensor out = at::empty({W * 3}, at::kLong);
      comm.all_gather_into_tensor(out, at::full({3}, r, at::kLong)).wait();
      note(out.equal(at::arange(W, at::kLong).repeat_interleave(3)), "all_gather_into_tensor");
      at::Tensor shard = at::empty({2}, at::kFloat);
      comm.reduce_scatter_tensor(shard, at::arange(2 * W, at::kFloat)).wait();
      note(shard.equal(at::arange(2 * r, 2 * r + 2, at::kFloat) * W), "reduce_scatter_tensor");
      at::Tensor b = at::full({2}, r, at::kInt);
      comm.broadcast(b, W - 1).wait();
      note(b.equal(at::full({2}, W - 1, at::kInt)), "broadcast");
      const auto bytes = comm.all_gather_bytes(std::vector<uint8_t>(r, 7));
      bool bytes_ok = static_cast<int>(bytes.size()) == W;
      for (int q = 0; bytes_ok && q < W; ++q) bytes_ok = bytes[q] == std::vector<uint8_t>(q, 7);
      note(bytes_ok, "all_gather_bytes");
      comm.barrier();
    });
    INFO("world size " << W);
    CHECK(wrong.empty());
    for (const auto& w : wrong) FAIL_CHECK(w);
  }
}

TEST_CASE("thread backend names mismatched collectives instead of hanging", "[testing][threads]") {
  CHECK_THROWS_WITH(run_ranks_as_threads(2, [](fsdp::comm::Communicator& comm) {
                      at::Tensor t = at::ones({4});
                      if (comm.rank() == 0) {
                        comm.all_reduce(t).wait();
                      } else {
                        comm.broadcast(t, 0).wait();
                      }
                    }),
                    Catch::Matchers::Contains("called 'broadcast of 4 x Float' while rank 0 called "
                                              "'allreduce of 4 x Float'"));
}

TEST_CASE("thread backend reports a rank that never arrives", "[testing][threads]") {
  CHECK_THROWS_WITH(run_ranks_as_threads(
                        3,
                        [](fsdp::comm::Communicator& comm) {
                          if (comm.rank() == 2) return;
                          comm.all_reduce(at::ones({1})).wait();
                        },
                        std::chrono::milliseconds(300)),
                    Catch::Matchers::Contains("timed out after 300 ms"));
}
