// The communication layer at work: run with `tools/example.sh` (2 MPI ranks on this machine) or
// under any launcher (`mpirun -np N`, or `torchrun --no-python` on GPUs with //comm:nccl linked).
//
// For each collective FSDP relies on (all-gather into one tensor, reduce-scatter from one tensor,
// all-reduce) and several sizes, it checks the result against closed-form values and prints the
// median time and bandwidth; then it shows an asynchronous all-gather overlapping a matmul, and the
// communicator's counters.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <ATen/ATen.h>

#include "comm/init.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Row {
  const char* name;
  int64_t bytes;
  double seconds;
  bool correct;
};

}  // namespace

int main(int argc, char** argv) {
  const int repeats = argc > 1 ? std::atoi(argv[1]) : 10;
  auto group = fsdp::comm::init_process_group();
  auto& comm = *group.comm;
  const int W = comm.size();
  const int rank = comm.rank();
  const auto fopts = at::TensorOptions().dtype(at::kFloat).device(group.device);
  if (rank == 0) {
    std::printf("fsdp comm demo: %d rank(s), launcher %s, device %s, backend %s, %d repeats\n", W,
                fsdp::comm::to_string(group.launch.launcher), group.device.str().c_str(),
                comm.backend()->getBackendName().c_str(), repeats);
  }

  std::vector<Row> rows;
  for (int64_t per_rank : {int64_t{1} << 10, int64_t{1} << 16, int64_t{1} << 20, int64_t{1} << 23}) {
    // Rank r contributes r + 1 everywhere: closed forms are easy to check.
    at::Tensor shard = at::full({per_rank}, rank + 1, fopts);
    at::Tensor full = at::empty({per_rank * W}, fopts);
    std::vector<double> ag, rs, ar;
    bool ag_ok = true, rs_ok = true, ar_ok = true;
    for (int i = 0; i < repeats; ++i) {
      comm.barrier();
      auto t0 = Clock::now();
      comm.all_gather_into_tensor(full, shard).wait();
      ag.push_back(seconds_since(t0));
      ag_ok &= full.view({W, per_rank}).select(1, per_rank - 1).cpu().equal(at::arange(1, W + 1, at::kFloat));

      at::Tensor grads = at::full({per_rank * W}, rank + 1, fopts);
      at::Tensor out = at::empty({per_rank}, fopts);
      comm.barrier();
      t0 = Clock::now();
      comm.reduce_scatter_tensor(out, grads, c10d::ReduceOp::AVG).wait();
      rs.push_back(seconds_since(t0));
      rs_ok &= out.cpu().eq((W + 1) / 2.0).all().item<bool>();

      at::Tensor sum = at::full({per_rank}, rank + 1, fopts);
      comm.barrier();
      t0 = Clock::now();
      comm.all_reduce(sum).wait();
      ar.push_back(seconds_since(t0));
      ar_ok &= sum.cpu().eq(W * (W + 1) / 2.0).all().item<bool>();
    }
    rows.push_back({"all_gather_into_tensor", per_rank * W * 4, median(ag), ag_ok});
    rows.push_back({"reduce_scatter_tensor(AVG)", per_rank * W * 4, median(rs), rs_ok});
    rows.push_back({"all_reduce(SUM)", per_rank * 4, median(ar), ar_ok});
  }

  // Everyone agrees on correctness (a wrong result anywhere fails the run).
  at::Tensor wrong = at::zeros({1}, at::kInt).to(group.device);
  for (const auto& r : rows) wrong.add_(r.correct ? 0 : 1);
  comm.all_reduce(wrong).wait();

  if (rank == 0) {
    std::printf("\n%-28s %12s %12s %12s %12s  %s\n", "collective", "bytes", "median us",
                "algbw GB/s", "busbw GB/s", "result");
    for (const auto& r : rows) {
      // Bus bandwidth as nccl-tests defines it: all-gather/reduce-scatter x (W-1)/W, all-reduce x 2(W-1)/W.
      const bool is_ar = std::string(r.name).rfind("all_reduce", 0) == 0;
      const double algbw = r.bytes / r.seconds / 1e9;
      const double factor = W == 1 ? 0.0 : (is_ar ? 2.0 * (W - 1) / W : double(W - 1) / W);
      std::printf("%-28s %12lld %12.1f %12.3f %12.3f  %s\n", r.name, static_cast<long long>(r.bytes),
                  r.seconds * 1e6, algbw, algbw * factor, r.correct ? "correct" : "WRONG");
    }
  }

  // Overlap: an asynchronous all-gather in flight while this rank multiplies matrices.
  const int64_t per_rank = int64_t{1} << 22;
  at::Tensor shard = at::full({per_rank}, rank + 1, fopts);
  at::Tensor full = at::empty({per_rank * W}, fopts);
  at::Tensor a = at::randn({384, 384}, fopts);
  auto compute = [&] {
    at::Tensor c = a;
    for (int i = 0; i < 20; ++i) c = at::mm(c, a).tanh_();
    return c.sum().item<float>();
  };
  std::vector<double> comm_only, compute_only, both;
  for (int i = 0; i < std::max(3, repeats / 2); ++i) {
    comm.barrier();
    auto t0 = Clock::now();
    comm.all_gather_into_tensor(full, shard).wait();
    comm_only.push_back(seconds_since(t0));
    t0 = Clock::now();
    compute();
    compute_only.push_back(seconds_since(t0));
    comm.barrier();
    t0 = Clock::now();
    auto pending = comm.all_gather_into_tensor(full, shard);
    compute();
    pending.wait();
    both.push_back(seconds_since(t0));
  }
  const double sum_ms = (median(comm_only) + median(compute_only)) * 1e3;
  const double both_ms = median(both) * 1e3;
  if (rank == 0) {
    std::printf("\noverlap: all-gather of %lld MB alone %.2f ms, matmuls alone %.2f ms, "
                "issued together %.2f ms (sequential would be %.2f ms: %.0f%% hidden)\n",
                static_cast<long long>(per_rank * W * 4 >> 20), median(comm_only) * 1e3,
                median(compute_only) * 1e3, both_ms, sum_ms,
                100.0 * std::max(0.0, sum_ms - both_ms) / std::min(median(comm_only), median(compute_only)) / 1e3);
    std::printf("\ncounters on rank 0:");
    for (int k = 0; k < fsdp::comm::kNumCollectiveKinds; ++k) {
      const auto kind = static_cast<fsdp::comm::CollectiveKind>(k);
      const auto s = comm.stats(kind);
      if (s.calls > 0) {
        std::printf("\n  %-24s %6lld calls %14lld bytes", fsdp::comm::to_string(kind),
                    static_cast<long long>(s.calls), static_cast<long long>(s.bytes));
      }
    }
    std::printf("\n\n%s\n", wrong.item<int>() == 0 ? "all results correct on every rank"
                                                  : "WRONG results on some rank");
  }
  return wrong.item<int>() == 0 ? 0 : 1;
}
