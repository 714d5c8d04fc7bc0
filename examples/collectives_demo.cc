// The communication layer at work: run with `tools/example.sh` (2 MPI ranks on this machine) or
// under any launcher (`mpirun -np N`, or `torchrun --no-python` on GPUs with //comm:nccl linked).
//
// For each collective FSDP relies on (all-gather into one tensor, reduce-scatter from one tensor,
// all-reduce) and several sizes, it checks the result against closed-form values and prints the
// median time and bandwidth; then it shows an asynchronous all-gather overlapping a matmul, and the
// communicator's counters.
//
//   collectives_demo [REPEATS]                 the table above (default 10 repeats)
//   collectives_demo --latency [--iters N]     small-collective round trips on the MPI backend:
//       median and p90 microseconds of issue + wait() for all_reduce, all_gather_into_tensor and
//       reduce_scatter_tensor of 4 B, 256 B and 4 KiB per rank, with wait() driving progress
//       (the default) and with the progress thread alone (MpiBackend::set_wait_drives_progress
//       (false), the behaviour before), in alternating blocks of one run, and their ratio.
//   collectives_demo --overlap [--iters N]     an all-gather and a reduce-scatter in flight at once
//       (FSDP's backward: the next unit's prefetch beside this unit's reduction), issued on one
//       communicator and on two (separate_reduce_communicator, [Note: reduce communicator]): the
//       median wall time of issue + both waits, against each alone, in alternating rounds.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "fsdp_cpp/comm/device_mesh.h"
#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/comm/mpi_backend.h"

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

// The q-quantile (0..1) of `v`.
double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))];
}

// --latency: round trips of small collectives, wait() driving progress vs the progress thread alone.
int run_latency(const fsdp::comm::ProcessGroup& group, int iters) {
  auto& comm = *group.comm;
  const int W = comm.size();
  const int rank = comm.rank();
  auto* mpi = dynamic_cast<fsdp::comm::MpiBackend*>(comm.backend().get());
  if (mpi == nullptr) {
    if (rank == 0) std::printf("--latency compares the MPI backend's two wait paths; this run uses %s\n",
                               comm.backend()->getBackendName().c_str());
    return 2;
  }
  const bool initial_mode = mpi->wait_drives_progress();
  constexpr int kBlock = 25;  // round trips per block; the two modes alternate block by block
  const int blocks = std::max(2, 2 * ((iters + kBlock - 1) / kBlock));
  if (rank == 0) {
    std::printf("fsdp comm latency: %d rank(s), %d round trips per mode and case (blocks of %d, "
                "modes alternating), times on rank 0\n", W, blocks / 2 * kBlock, kBlock);
    std::printf("  old = progress thread issues and completes, wait() sleeps until it did\n"
                "  new = issued by the caller, wait() drives progress when nothing else is outstanding\n\n");
    std::printf("%-24s %9s %10s %10s %10s %10s %9s %9s  %s\n", "collective", "bytes/rank",
                "old p50 us", "old p90 us", "new p50 us", "new p90 us", "p50 new/old", "p90 new/old",
                "result");
  }
  const auto fopts = at::TensorOptions().dtype(at::kFloat);
  bool all_ok = true;
  for (const char* name : {"all_reduce(SUM)", "all_gather_into_tensor", "reduce_scatter_tensor"}) {
    for (int64_t n : {int64_t{1}, int64_t{64}, int64_t{1024}}) {
      at::Tensor input = at::full({std::strcmp(name, "reduce_scatter_tensor") == 0 ? n * W : n},
                                  rank + 1, fopts);
      at::Tensor output = at::empty({std::strcmp(name, "all_gather_into_tensor") == 0 ? n * W : n}, fopts);
      at::Tensor reduced = at::empty({n}, fopts);
      auto one = [&] {
        if (std::strcmp(name, "all_reduce(SUM)") == 0) {
          reduced.fill_(rank + 1);
          comm.all_reduce(reduced).wait();
        } else if (std::strcmp(name, "all_gather_into_tensor") == 0) {
          comm.all_gather_into_tensor(output, input).wait();
        } else {
          comm.reduce_scatter_tensor(output, input).wait();
        }
      };
      std::vector<double> times[2];  // [0] old, [1] new
      for (int b = -2; b < blocks; ++b) {  // two warm-up blocks, one per mode
        const bool drives = ((b + 2) % 2) == 1;
        mpi->set_wait_drives_progress(drives);
        comm.barrier();
        for (int i = 0; i < kBlock; ++i) {
          const auto t0 = Clock::now();
          one();
          if (b >= 0) times[drives ? 1 : 0].push_back(seconds_since(t0) * 1e6);
        }
      }
      // Closed forms: every rank r contributes r + 1.
      bool ok;
      if (std::strcmp(name, "all_reduce(SUM)") == 0) {
        ok = reduced.eq(W * (W + 1) / 2.0).all().item<bool>();
      } else if (std::strcmp(name, "all_gather_into_tensor") == 0) {
        ok = output.view({W, n}).select(1, n - 1).equal(at::arange(1, W + 1, at::kFloat));
      } else {
        ok = output.eq(W * (W + 1) / 2.0).all().item<bool>();
      }
      all_ok &= ok;
      if (rank == 0) {
        const double old50 = quantile(times[0], 0.5), old90 = quantile(times[0], 0.9);
        const double new50 = quantile(times[1], 0.5), new90 = quantile(times[1], 0.9);
        std::printf("%-24s %9lld %10.1f %10.1f %10.1f %10.1f %9.2f %9.2f  %s\n", name,
                    static_cast<long long>(n * 4), old50, old90, new50, new90, new50 / old50,
                    new90 / old90, ok ? "correct" : "WRONG");
      }
    }
  }
  mpi->set_wait_drives_progress(initial_mode);
  at::Tensor wrong = at::full({1}, all_ok ? 0 : 1, at::kInt);
  comm.all_reduce(wrong).wait();
  if (rank == 0) {
    std::printf("\n%s\n", wrong.item<int>() == 0 ? "all results correct on every rank"
                                                   : "WRONG results on some rank");
  }
  return wrong.item<int>() == 0 ? 0 : 1;
}

// --overlap: an all-gather and a reduce-scatter in flight together, on one communicator or two.
int run_overlap(const fsdp::comm::ProcessGroup& group, int iters) {
  auto& comm = *group.comm;
  const int W = comm.size();
  const int rank = comm.rank();
  // A duplicate of the world (same ranks, same order), as separate_reduce_communicator makes one.
  auto mesh = fsdp::comm::DeviceMesh::create(comm, {W}, {"reduce"});
  auto& second = *mesh->group("reduce");
  const auto fopts = at::TensorOptions().dtype(at::kFloat).device(group.device);
  if (rank == 0) {
    std::printf("fsdp comm overlap: %d rank(s), backend %s, %d rounds per case (cases alternating), "
                "median microseconds on rank 0\n\n", W, comm.backend()->getBackendName().c_str(), iters);
    std::printf("%12s %12s %12s %14s %14s %12s %12s  %s\n", "bytes/rank", "all-gather", "reduce-sc.",
                "both, 1 comm", "both, 2 comms", "sum/1 comm", "sum/2 comms", "result");
  }
  bool all_ok = true;
  for (int64_t n : {int64_t{1} << 12, int64_t{1} << 16, int64_t{1} << 20, int64_t{1} << 22}) {
    at::Tensor shard = at::full({n}, rank + 1, fopts);
    at::Tensor full = at::empty({n * W}, fopts);
    at::Tensor grads = at::full({n * W}, rank + 1, fopts);
    at::Tensor reduced = at::empty({n}, fopts);
    std::vector<double> t[4];  // all-gather alone, reduce-scatter alone, both on one, both on two
    for (int i = -2; i < iters; ++i) {
      for (int c = 0; c < 4; ++c) {
        comm.barrier();
        const auto t0 = Clock::now();
        if (c == 0) {
          comm.all_gather_into_tensor(full, shard).wait();
        } else if (c == 1) {
          comm.reduce_scatter_tensor(reduced, grads).wait();
        } else {
          auto& rs_comm = c == 2 ? comm : second;
          auto ag = comm.all_gather_into_tensor(full, shard);
          auto rs = rs_comm.reduce_scatter_tensor(reduced, grads);
          ag.wait();
          rs.wait();
        }
        if (i >= 0) t[c].push_back(seconds_since(t0) * 1e6);
      }
    }
    // Closed forms: every rank r contributes r + 1.
    const bool ok = full.view({W, n}).select(1, n - 1).equal(at::arange(1, W + 1, fopts)) &&
                    reduced.eq(W * (W + 1) / 2.0).all().item<bool>();
    all_ok &= ok;
    if (rank == 0) {
      const double ag = median(t[0]), rs = median(t[1]), one = median(t[2]), two = median(t[3]);
      std::printf("%12lld %12.1f %12.1f %14.1f %14.1f %12.2f %12.2f  %s\n", static_cast<long long>(n * 4), ag, rs,
                  one, two, (ag + rs) / one, (ag + rs) / two, ok ? "correct" : "WRONG");
    }
  }
  at::Tensor wrong = at::full({1}, all_ok ? 0 : 1, at::kInt);
  comm.all_reduce(wrong).wait();
  if (rank == 0) {
    std::printf("\nsum/N comms > 1: the two collectives overlapped (1.0: serialized). %s\n",
                wrong.item<int>() == 0 ? "All results correct on every rank." : "WRONG results on some rank.");
  }
  return wrong.item<int>() == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  bool latency = false;
  bool overlap = false;
  int iters = 400;
  int repeats = 10;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--latency") {
      latency = true;
    } else if (arg == "--overlap") {
      overlap = true;
    } else if (arg == "--iters" && i + 1 < argc) {
      iters = std::atoi(argv[++i]);
    } else if (!arg.empty() && arg[0] != '-') {
      repeats = std::atoi(arg.c_str());
    } else {
      std::fprintf(stderr, "usage: %s [REPEATS] | --latency [--iters N] | --overlap [--iters N]\n", argv[0]);
      return 2;
    }
  }
  auto group = fsdp::comm::init_process_group();
  if (latency) return run_latency(group, iters);
  if (overlap) return run_overlap(group, std::min(iters, 50));
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
