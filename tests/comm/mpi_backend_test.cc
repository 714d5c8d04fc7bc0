// The Open MPI c10d backend, through the Communicator wrapper, on every world size of the launch:
// every collective, every dtype, element counts that do and do not divide by the world size, empty
// tensors, against closed-form values.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <cstdio>
#include <fstream>
#include <thread>
#include <vector>

#include <ATen/ATen.h>

#include "fsdp_cpp/comm/mpi_backend.h"
#include "fsdp_cpp/comm/mpi_progress.h"
#include "fsdp_cpp/comm/mpi_runtime.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using fsdp::comm::CollectiveKind;
using fsdp::testing::rank;
using fsdp::testing::world;
using fsdp::testing::world_size;

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kDouble, at::kHalf,
                                             at::kBFloat16, at::kInt, at::kLong};
// 0 (empty), 1, and counts that do (12) and do not (7, 13, 1001) divide by 2, 3 and 4.
const std::vector<int64_t> kCounts = {0, 1, 7, 12, 13, 1001};

// Rank r's element i: small integers, exact in every dtype above (also sums over 4 ranks).
at::Tensor rank_values(int r, int64_t count, at::ScalarType dtype) {
  return (at::arange(count, at::kLong).remainder(7) + (r + 1)).to(dtype);
}

// Element-wise closed forms over ranks 0..W-1 of rank_values.
at::Tensor expected_sum(int W, at::Tensor index) {
  return index.remainder(7) * W + W * (W + 1) / 2;
}

void check_equal(const at::Tensor& actual, const at::Tensor& expected, const std::string& what) {
  INFO(what << ": dtype " << actual.scalar_type() << ", " << actual.numel() << " elements");
  REQUIRE(actual.numel() == expected.numel());
  CHECK(actual.to(at::kDouble).reshape({-1}).equal(expected.to(at::kDouble).reshape({-1})));
}

fsdp::comm::MpiBackend& world_mpi() {
  auto* mpi = dynamic_cast<fsdp::comm::MpiBackend*>(world().backend().get());
  REQUIRE(mpi != nullptr);
  return *mpi;
}

// Sets the world backend's wait path for one test case and restores it after.
class WaitPath {
 public:
  explicit WaitPath(bool wait_drives_progress) : before_(world_mpi().wait_drives_progress()) {
    world_mpi().set_wait_drives_progress(wait_drives_progress);
  }
  ~WaitPath() { world_mpi().set_wait_drives_progress(before_); }

 private:
  bool before_;
};

// Rank 0 joins late: every other rank's collective stays incomplete until then, so those ranks
// are certainly inside wait() (and drive it, if they may) when it completes.
void rank0_arrives_late() {
  if (rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(150));
}

}  // namespace

FSDP_RANKS_TEST_CASE("allreduce SUM, AVG, MAX, MIN, PRODUCT for every dtype and count", "[comm][mpi]") {
  const int W = world_size();
  for (auto dtype : kDtypes) {
    for (int64_t count : kCounts) {
      const at::Tensor index = at::arange(count, at::kLong);
      struct Case {
        c10d::ReduceOp op;
        at::Tensor expected;
      };
      const at::Tensor sum = expected_sum(W, index);
      std::vector<Case> cases = {
          {c10d::ReduceOp::SUM, sum},
          {c10d::ReduceOp::MAX, index.remainder(7) + W},
          {c10d::ReduceOp::MIN, index.remainder(7) + 1},
          {c10d::ReduceOp::AVG, at::isIntegralType(dtype, false)
                                    ? sum.div(W, "trunc")
                                    : sum.to(at::kDouble) / W},
      };
      for (auto& c : cases) {
        at::Tensor t = rank_values(rank(), count, dtype);
        world().all_reduce(t, c.op).wait();
        check_equal(t, c.expected, "allreduce op " + std::to_string(static_cast<int>(c.op.op_)));
      }
      // PRODUCT: rank r holds 2 where i % W == r, else 1: the product is 2 everywhere.
      at::Tensor t = (index.remainder(W) == rank()).to(at::kLong).add(1).to(dtype);
      world().all_reduce(t, c10d::ReduceOp::PRODUCT).wait();
      check_equal(t, at::full({count}, 2, at::kLong), "allreduce PRODUCT");
    }
  }
}

FSDP_RANKS_TEST_CASE("broadcast from the first and the last rank", "[comm][mpi]") {
  const int W = world_size();
  for (auto dtype : kDtypes) {
    for (int64_t count : kCounts) {
      for (int root : {0, W - 1}) {
        at::Tensor t = rank_values(rank(), count, dtype);
        world().broadcast(t, root).wait();
        check_equal(t, rank_values(root, count, dtype), "broadcast root " + std::to_string(root));
      }
    }
  }
}

FSDP_RANKS_TEST_CASE("all_gather_into_tensor places rank r's input at r * count", "[comm][mpi]") {
  const int W = world_size();
  for (auto dtype : kDtypes) {
    for (int64_t count : kCounts) {
      at::Tensor input = rank_values(rank(), count, dtype);
      at::Tensor output = at::full({W * count}, -1, at::TensorOptions().dtype(dtype));
      world().all_gather_into_tensor(output, input).wait();
      std::vector<at::Tensor> parts;
      for (int r = 0; r < W; ++r) parts.push_back(rank_values(r, count, dtype));
      check_equal(output, at::cat(parts), "all_gather_into_tensor");
    }
  }
}

FSDP_RANKS_TEST_CASE("all_gather into a list keeps each rank's shape", "[comm][mpi]") {
  const int W = world_size();
  for (auto dtype : kDtypes) {
    for (int64_t count : {int64_t{0}, int64_t{3}, int64_t{10}}) {
      at::Tensor input = rank_values(rank(), 2 * count, dtype).view({count, 2});
      std::vector<at::Tensor> outputs;
      for (int r = 0; r < W; ++r) outputs.push_back(at::zeros({count, 2}, dtype));
      world().all_gather(outputs, input).wait();
      for (int r = 0; r < W; ++r) {
        CHECK(outputs[r].sizes() == input.sizes());
        check_equal(outputs[r], rank_values(r, 2 * count, dtype), "all_gather list entry");
      }
    }
  }
}

FSDP_RANKS_TEST_CASE("reduce_scatter_tensor gives rank r the reduced slice r", "[comm][mpi]") {
  const int W = world_size();
  for (auto dtype : kDtypes) {
    for (int64_t count : kCounts) {  // elements per rank
      for (auto op : {c10d::ReduceOp::SUM, c10d::ReduceOp::AVG, c10d::ReduceOp::MAX}) {
        at::Tensor input = rank_values(rank(), W * count, dtype);
        at::Tensor output = at::full({count}, -1, at::TensorOptions().dtype(dtype));
        world().reduce_scatter_tensor(output, input, op).wait();
        const at::Tensor index = at::arange(rank() * count, (rank() + 1) * count, at::kLong);
        const at::Tensor sum = expected_sum(W, index);
        at::Tensor expected = sum;
        if (op == c10d::ReduceOp::AVG) {
          expected = at::isIntegralType(dtype, false) ? sum.div(W, "trunc") : sum.to(at::kDouble) / W;
        } else if (op == c10d::ReduceOp::MAX) {
          expected = index.remainder(7) + W;
        }
        check_equal(output, expected, "reduce_scatter_tensor");
      }
    }
  }
}

FSDP_RANKS_TEST_CASE("all_to_all_single sends chunk j to rank j", "[comm][mpi]") {
  const int W = world_size();
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kLong, at::kByte}) {
    for (int64_t count : {0, 1, 7, 1001}) {  // elements per rank and destination
      // Rank r's chunk j holds 10 * r + j (+ i % 3 at element i): exact in every dtype above.
      at::Tensor input = at::empty({W, count}, at::kLong);
      for (int j = 0; j < W; ++j) input[j] = at::arange(count, at::kLong).remainder(3) + 10 * rank() + j;
      at::Tensor output = at::full({W, count}, -1, at::TensorOptions().dtype(dtype));
      world().all_to_all_single(output, input.to(dtype)).wait();
      // Chunk i of the output is what rank i sent to this rank: its chunk `rank()`.
      at::Tensor expected = at::empty({W, count}, at::kLong);
      for (int i = 0; i < W; ++i) expected[i] = at::arange(count, at::kLong).remainder(3) + 10 * i + rank();
      INFO("dtype " << dtype << ", " << count << " elements per destination");
      CHECK(output.to(at::kLong).equal(expected));
    }
  }
  std::vector<int64_t> none;
  if (W == 1) return;  // every count divides by one rank
  at::Tensor odd_in = at::zeros({W * 2 + 1}), odd_out = at::zeros({W * 2 + 1});
  CHECK_THAT(fsdp::testing::error_of([&] { world().backend()->alltoall_base(odd_out, odd_in, none, none); }),
             Catch::Matchers::Contains("one equal chunk per rank"));
}

FSDP_RANKS_TEST_CASE("all_to_all sends rows split by sizes per rank, the splits from exchange_splits",
                     "[comm][mpi]") {
  const int W = world_size();
  const int r = rank();
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kLong}) {
    for (int64_t width : {1, 5}) {
      // Rank r sends (r + j) % 3 rows to rank j (some zero), each row holding 10 * r + 3 * j + its index (exact in bf16).
      std::vector<int64_t> send(W);
      for (int j = 0; j < W; ++j) send[j] = (r + j) % 3;
      std::vector<at::Tensor> pieces;
      for (int j = 0; j < W; ++j) {
        pieces.push_back((at::arange(send[j], at::kLong) + 10 * r + 3 * j).unsqueeze(1).expand({send[j], width}));
      }
      const at::Tensor input = at::cat(pieces).to(dtype).contiguous();
      const std::vector<int64_t> recv = world().exchange_splits(send, "splits");
      std::vector<at::Tensor> expected;
      for (int i = 0; i < W; ++i) {
        CHECK(recv[i] == (i + r) % 3);
        expected.push_back((at::arange(recv[i], at::kLong) + 10 * i + 3 * r).unsqueeze(1).expand({recv[i], width}));
      }
      int64_t rows = 0;
      for (int64_t n : recv) rows += n;
      at::Tensor output = at::full({rows, width}, -1, at::TensorOptions().dtype(dtype));
      world().reset_stats();
      world().all_to_all(output, input, recv, send, "rows").wait();
      CHECK(output.to(at::kLong).equal(at::cat(expected)));
      CHECK(world().stats(CollectiveKind::kAllToAllV).calls == 1);
      CHECK(world().stats(CollectiveKind::kAllToAllV).bytes == input.numel() * input.element_size());
    }
  }
  // Splits that do not add up to the rows are refused before anything is issued.
  std::vector<int64_t> wrong(W, 1);
  at::Tensor in = at::zeros({W + 1, 2}), out = at::zeros({W, 2});
  CHECK_THAT(fsdp::testing::error_of([&] { world().all_to_all(out, in, wrong, wrong); }),
             Catch::Matchers::Contains("all_to_all") && Catch::Matchers::Contains("add up to"));
  CHECK_THAT(fsdp::testing::error_of([&] { world().all_to_all(out, out, std::vector<int64_t>(W + 1, 0), wrong); }),
             Catch::Matchers::Contains("one per rank"));
}

FSDP_RANKS_TEST_CASE("several asynchronous collectives in flight at once", "[comm][mpi]") {
  const int W = world_size();
  std::vector<at::Tensor> reduced;
  std::vector<fsdp::comm::PendingCollective> pending;
  for (int k = 0; k < 8; ++k) {
    reduced.push_back(rank_values(rank(), 100 + 37 * k, at::kFloat));
    pending.push_back(world().all_reduce(reduced.back()));
  }
  at::Tensor gathered = at::empty({W * 50}, at::kFloat);
  pending.push_back(world().all_gather_into_tensor(gathered, rank_values(rank(), 50, at::kFloat)));
  at::Tensor scattered = at::empty({20}, at::kDouble);
  pending.push_back(world().reduce_scatter_tensor(scattered, rank_values(rank(), 20 * W, at::kDouble)));
  // Wait newest first: completion must not depend on the order of waits.
  for (auto it = pending.rbegin(); it != pending.rend(); ++it) it->wait();
  for (int k = 0; k < 8; ++k) {
    check_equal(reduced[k], expected_sum(W, at::arange(100 + 37 * k, at::kLong)), "in-flight allreduce");
  }
  std::vector<at::Tensor> parts;
  for (int r = 0; r < W; ++r) parts.push_back(rank_values(r, 50, at::kFloat));
  check_equal(gathered, at::cat(parts), "in-flight all-gather");
  check_equal(scattered, expected_sum(W, at::arange(rank() * 20, rank() * 20 + 20, at::kLong)),
              "in-flight reduce-scatter");
}

FSDP_RANKS_TEST_CASE("a Work reports completion and carries its outputs in its future", "[comm][mpi]") {
  auto backend = world().backend();
  std::vector<at::Tensor> tensors{at::ones({5})};
  auto work = backend->allreduce(tensors);
  work->wait();
  CHECK(work->isCompleted());
  CHECK(work->isSuccess());
  auto future = work->getFuture();
  REQUIRE(future->completed());
  const auto outputs = future->value().toTensorVector();
  REQUIRE(outputs.size() == 1);
  CHECK(outputs[0].equal(at::full({5}, world_size(), at::kFloat)));
}

FSDP_RANKS_TEST_CASE("all_gather_bytes exchanges buffers of different sizes", "[comm][mpi]") {
  const int W = world_size();
  std::vector<uint8_t> mine(rank(), static_cast<uint8_t>(rank() + 1));  // rank 0 sends nothing
  const auto all = world().all_gather_bytes(mine);
  REQUIRE(static_cast<int>(all.size()) == W);
  for (int r = 0; r < W; ++r) {
    CHECK(all[r] == std::vector<uint8_t>(r, static_cast<uint8_t>(r + 1)));
  }
}

FSDP_RANKS_TEST_CASE("barrier: nobody passes before rank 0 arrives", "[comm][mpi]") {
  const std::string marker = fsdp::testing::shared_tmpdir() + "/barrier_marker";
  if (rank() == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    std::ofstream(marker) << "rank 0 was here";
  }
  world().barrier();
  CHECK(std::ifstream(marker).good());
  world().barrier();
  if (rank() == 0) std::remove(marker.c_str());
}

FSDP_RANKS_TEST_CASE("sub-communicators from split reduce within their group", "[comm][mpi]") {
  const int W = world_size();
  auto world_backend = fsdp::comm::MpiBackend::create_world();
  fsdp::comm::MpiBackend::Options options;
  options.name = "parity group";
  auto group = world_backend->split(rank() % 2, rank(), options);
  int expected_size = 0;
  int expected_sum = 0;
  for (int r = rank() % 2; r < W; r += 2) {
    expected_size += 1;
    expected_sum += r + 1;
  }
  CHECK(group->getSize() == expected_size);
  CHECK(group->getRank() == rank() / 2);
  fsdp::comm::Communicator comm(group, at::kCPU);
  at::Tensor t = at::full({3}, rank() + 1, at::kInt);
  comm.all_reduce(t).wait();
  CHECK(t.equal(at::full({3}, expected_sum, at::kInt)));
  at::Tensor gathered = at::empty({expected_size}, at::kInt);
  comm.all_gather_into_tensor(gathered, at::full({1}, rank(), at::kInt)).wait();
  CHECK(gathered.equal(at::arange(rank() % 2, W, 2, at::kInt)));
}

FSDP_RANKS_TEST_CASE("the communicator counts calls and bytes per collective kind", "[comm][mpi]") {
  const int W = world_size();
  fsdp::comm::Communicator comm(world().backend(), at::kCPU);
  at::Tensor out = at::empty({W * 6}, at::kFloat);
  comm.all_gather_into_tensor(out, at::ones({6})).wait();
  comm.all_gather_into_tensor(out, at::ones({6})).wait();
  at::Tensor shard = at::empty({3}, at::kBFloat16);
  comm.reduce_scatter_tensor(shard, at::ones({3 * W}, at::kBFloat16)).wait();
  comm.all_reduce(at::ones({10}, at::kDouble)).wait();
  comm.all_to_all_single(at::empty({W, 5}, at::kByte), at::ones({W, 5}, at::kByte)).wait();
  CHECK(comm.stats(CollectiveKind::kAllToAll).calls == 1);
  CHECK(comm.stats(CollectiveKind::kAllToAll).bytes == W * 5);
  CHECK(comm.stats(CollectiveKind::kAllGather).calls == 2);
  CHECK(comm.stats(CollectiveKind::kAllGather).bytes == 2 * W * 6 * 4);
  CHECK(comm.stats(CollectiveKind::kReduceScatter).calls == 1);
  CHECK(comm.stats(CollectiveKind::kReduceScatter).bytes == 3 * W * 2);
  CHECK(comm.stats(CollectiveKind::kAllReduce).calls == 1);
  CHECK(comm.stats(CollectiveKind::kAllReduce).bytes == 80);
  CHECK(comm.stats(CollectiveKind::kBroadcast).calls == 0);
  comm.reset_stats();
  CHECK(comm.stats(CollectiveKind::kAllGather).calls == 0);
}

FSDP_RANKS_TEST_CASE("the trace records issue and completion order", "[comm][mpi]") {
  fsdp::comm::Communicator comm(world().backend(), at::kCPU);
  comm.set_trace_enabled(true);
  at::Tensor a = at::ones({4});
  at::Tensor b = at::ones({4});
  auto first = comm.all_reduce(a, c10d::ReduceOp::SUM, "first");
  auto second = comm.all_reduce(b, c10d::ReduceOp::SUM, "second");
  second.wait();
  first.wait();
  first.wait();  // a second wait records nothing more
  const auto trace = comm.trace();
  using Phase = fsdp::comm::TraceEvent::Phase;
  REQUIRE(trace.size() == 4);
  CHECK((trace[0].phase == Phase::kIssued && trace[0].tag == "first" && trace[0].id == 1));
  CHECK((trace[1].phase == Phase::kIssued && trace[1].tag == "second" && trace[1].id == 2));
  CHECK((trace[2].phase == Phase::kCompleted && trace[2].tag == "second"));
  CHECK((trace[3].phase == Phase::kCompleted && trace[3].tag == "first"));
  CHECK(trace[0].bytes == 16);
}

FSDP_RANKS_TEST_CASE("wrong input is a clear error naming the collective and the sizes", "[comm][mpi]") {
  const int W = world_size();
  using Catch::Matchers::Contains;
  auto backend = world().backend();
  {
    std::vector<at::Tensor> t{at::ones({4, 3}).t()};
    CHECK_THROWS_WITH(backend->allreduce(t), Contains("allreduce") && Contains("contiguous"));
  }
  {
    at::Tensor out = at::empty({W * 4 + 1});
    at::Tensor in = at::ones({4});
    CHECK_THROWS_WITH(backend->_allgather_base(out, in),
                      Contains("all_gather_into_tensor") && Contains(std::to_string(W * 4)) &&
                          Contains("got " + std::to_string(W * 4 + 1)));
  }
  {
    at::Tensor out = at::empty({2});
    at::Tensor in = at::ones({2 * W + 1});
    CHECK_THROWS_WITH(backend->_reduce_scatter_base(out, in),
                      Contains("reduce_scatter_tensor") && Contains(std::to_string(2 * W)) &&
                          Contains("got " + std::to_string(2 * W + 1)));
  }
  {
    at::Tensor out = at::empty({W * 2}, at::kDouble);
    at::Tensor in = at::ones({2}, at::kFloat);
    CHECK_THROWS_WITH(backend->_allgather_base(out, in), Contains("dtype") && Contains("Double") &&
                                                             Contains("Float"));
  }
  {
    std::vector<at::Tensor> t{at::ones({2}, at::kComplexFloat)};
    CHECK_THROWS_WITH(backend->allreduce(t), Contains("allreduce") && Contains("not supported"));
  }
  {
    std::vector<at::Tensor> t{at::ones({2})};
    c10d::BroadcastOptions opts;
    opts.rootRank = W;
    CHECK_THROWS_WITH(backend->broadcast(t, opts), Contains("broadcast") && Contains("root rank"));
  }
  {
    std::vector<std::vector<at::Tensor>> outs{{at::empty({3})}};
    std::vector<at::Tensor> in{at::ones({3})};
    if (W > 1) {
      CHECK_THROWS_WITH(backend->allgather(outs, in),
                        Contains("allgather") && Contains("expected " + std::to_string(W)));
    }
  }
  // Nothing was sent: the group still works.
  at::Tensor t = at::ones({2});
  world().all_reduce(t).wait();
  CHECK(t.equal(at::full({2}, W, at::kFloat)));
}

// [Note: MPI progress]: wait() on the only outstanding collective drives it on the waiting thread.

FSDP_RANKS_TEST_CASE("MPI runs with a thread level that lets several threads call it in turn", "[comm][mpi]") {
  const int level = fsdp::comm::mpi::thread_level();
  CHECK((level == MPI_THREAD_SERIALIZED || level == MPI_THREAD_MULTIPLE));
}

FSDP_RANKS_TEST_CASE("wait() on the only collective in flight completes it on the waiting thread", "[comm][mpi]") {
  const int W = world_size();
  WaitPath path(true);
  for (const bool late : {true, false}) {
    const auto before = fsdp::comm::mpi::progress_counters();
    if (late) rank0_arrives_late();
    at::Tensor t = rank_values(rank(), 1001, at::kFloat);
    world().all_reduce(t).wait();
    check_equal(t, expected_sum(W, at::arange(1001, at::kLong)), "all_reduce waited by the issuer");
    at::Tensor gathered = at::empty({W * 9}, at::kDouble);
    world().all_gather_into_tensor(gathered, rank_values(rank(), 9, at::kDouble)).wait();
    std::vector<at::Tensor> parts;
    for (int r = 0; r < W; ++r) parts.push_back(rank_values(r, 9, at::kDouble));
    check_equal(gathered, at::cat(parts), "all_gather waited by the issuer");
    const auto after = fsdp::comm::mpi::progress_counters();
    if (late && W > 1 && rank() != 0) {
      // The all-reduce could not complete before rank 0 arrived 150 ms later: this thread was
      // waiting then, so it drove it and completed it itself.
      CHECK(after.drives > before.drives);
      CHECK(after.completed_by_waiter > before.completed_by_waiter);
    }
    if (W == 1) {
      // One rank completes inline: the progress engine is not involved at all.
      CHECK(after.drives == before.drives);
    }
  }
}

FSDP_RANKS_TEST_CASE("wait() from another thread than the issuing one drives and completes it", "[comm][mpi]") {
  const int W = world_size();
  WaitPath path(true);
  const auto before = fsdp::comm::mpi::progress_counters();
  rank0_arrives_late();
  at::Tensor input = rank_values(rank(), 13 * W, at::kLong);
  at::Tensor output = at::full({13}, -1, at::kLong);
  auto pending = world().reduce_scatter_tensor(output, input);
  bool completed_in_thread = false;
  std::thread waiter([&] {
    pending.wait();
    completed_in_thread = pending.completed();
  });
  waiter.join();
  CHECK(completed_in_thread);
  check_equal(output, expected_sum(W, at::arange(rank() * 13, rank() * 13 + 13, at::kLong)),
              "reduce_scatter waited by another thread");
  pending.wait();  // a second wait, on the issuing thread, returns at once
  const auto after = fsdp::comm::mpi::progress_counters();
  if (W > 1 && rank() != 0) CHECK(after.completed_by_waiter > before.completed_by_waiter);
}

FSDP_RANKS_TEST_CASE("several outstanding collectives waited out of order, both wait paths mixed", "[comm][mpi]") {
  const int W = world_size();
  WaitPath path(true);
  for (int round = 0; round < 3; ++round) {
    if (round == 1) rank0_arrives_late();
    std::vector<at::Tensor> reduced;
    std::vector<fsdp::comm::PendingCollective> pending;
    for (int k = 0; k < 6; ++k) {
      // Alternate the paths: a collective the progress thread must issue stays ahead of the ones
      // issued after it on the calling thread (same order on every rank).
      world_mpi().set_wait_drives_progress(k % 2 == round % 2);
      reduced.push_back(rank_values(rank(), 50 + 11 * k, at::kDouble));
      pending.push_back(world().all_reduce(reduced.back()));
    }
    world_mpi().set_wait_drives_progress(true);
    at::Tensor gathered = at::empty({W * 5}, at::kInt);
    pending.push_back(world().all_gather_into_tensor(gathered, rank_values(rank(), 5, at::kInt)));
    // Out of order: odd ones newest first from this thread, even ones from another thread.
    std::thread other([&] {
      for (int k = 4; k >= 0; k -= 2) pending[k].wait();
    });
    pending[6].wait();
    for (int k = 5; k >= 1; k -= 2) pending[k].wait();
    other.join();
    for (auto& p : pending) CHECK(p.completed());
    for (int k = 0; k < 6; ++k) {
      check_equal(reduced[k], expected_sum(W, at::arange(50 + 11 * k, at::kLong)),
                  "out-of-order all_reduce " + std::to_string(k));
    }
    std::vector<at::Tensor> parts;
    for (int r = 0; r < W; ++r) parts.push_back(rank_values(r, 5, at::kInt));
    check_equal(gathered, at::cat(parts), "out-of-order all_gather");
  }
}

FSDP_RANKS_TEST_CASE("a collective issued while another thread drives is completed too", "[comm][mpi]") {
  const int W = world_size();
  WaitPath path(true);
  rank0_arrives_late();
  at::Tensor first = rank_values(rank(), 64, at::kFloat);
  auto first_pending = world().all_reduce(first);
  at::Tensor second = rank_values(rank(), 32, at::kFloat);
  fsdp::comm::PendingCollective second_pending;
  // The main thread waits (and drives, on ranks other than 0) while another thread issues the
  // next collective; nobody waits for the second one until the first is done.
  std::thread issuer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    second_pending = world().all_reduce(second);
  });
  first_pending.wait();
  issuer.join();
  second_pending.wait();
  check_equal(first, expected_sum(W, at::arange(64, at::kLong)), "first all_reduce");
  check_equal(second, expected_sum(W, at::arange(32, at::kLong)), "second all_reduce");
}

FSDP_RANKS_TEST_CASE("the progress thread alone still completes what nobody waits for", "[comm][mpi]") {
  const int W = world_size();
  WaitPath path(true);
  at::Tensor t = rank_values(rank(), 100, at::kFloat);
  auto pending = world().all_reduce(t);
  // Nobody calls wait(): the progress thread must complete it by itself (overlap with compute).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!pending.completed() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  CHECK(pending.completed());
  pending.wait();
  check_equal(t, expected_sum(W, at::arange(100, at::kLong)), "all_reduce nobody waited for");
}

// Completion callbacks run on the thread that completed the collective (the progress thread, or a
// driving waiter). A callback that waits for another collective must not block the engine.

namespace {

// Fails the test (and ends the process, since the threads involved cannot be unblocked) if `done`
// is not set within `limit`: a regression of the cases below hangs instead of failing otherwise.
class HangGuard {
 public:
  HangGuard(const char* what, std::chrono::seconds limit) : thread_([this, what, limit] {
      std::unique_lock<std::mutex> lock(mutex_);
      if (!cv_.wait_for(lock, limit, [&] { return done_; })) {
        std::fprintf(stderr, "[rank %d] HUNG: %s did not finish within %lld s\n", rank(), what,
                     static_cast<long long>(limit.count()));
        std::fflush(stderr);
        std::_Exit(1);
      }
    }) {}
  ~HangGuard() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

// An all-reduce through the backend itself, for its Work (and the Work's future).
c10::intrusive_ptr<c10d::Work> backend_all_reduce(at::Tensor t) {
  std::vector<at::Tensor> tensors{t};
  return world().backend()->allreduce(tensors);
}

}  // namespace

FSDP_RANKS_TEST_CASE("a completion callback on the progress thread may wait for another collective",
                     "[comm][mpi][callback]") {
  const int W = world_size();
  HangGuard guard("a collective waited for inside a completion callback", std::chrono::seconds(30));
  for (const bool drives : {true, false}) {
    WaitPath path(drives);
    at::Tensor first = rank_values(rank(), 16, at::kFloat);
    at::Tensor inner = rank_values(rank(), 8, at::kFloat);
    at::Tensor other = rank_values(rank(), 4, at::kFloat);
    auto first_work = backend_all_reduce(first);
    // Still in flight while the callback waits: the inner collective is not the only one
    // outstanding, so its wait cannot count on being alone.
    rank0_arrives_late();
    auto other_work = backend_all_reduce(other);
    std::atomic<bool> callback_done{false};
    std::string callback_error;
    first_work->getFuture()->addCallback([&](c10::ivalue::Future&) {
      try {
        backend_all_reduce(inner)->wait();
      } catch (const std::exception& e) {
        callback_error = e.what();
      }
      callback_done = true;
    });
    // Nobody waits for the first collective: the progress thread completes it and runs the
    // callback there (or the callback runs here, if it completed already).
    while (!callback_done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    first_work->wait();
    other_work->wait();
    CHECK(callback_error.empty());
    check_equal(inner, expected_sum(W, at::arange(8, at::kLong)), "all_reduce waited in a callback");
    check_equal(first, expected_sum(W, at::arange(16, at::kLong)), "all_reduce with the callback");
    check_equal(other, expected_sum(W, at::arange(4, at::kLong)), "all_reduce beside the callback");
  }
}

FSDP_RANKS_TEST_CASE("a completion callback run by a driving waiter may wait for another collective",
                     "[comm][mpi][callback]") {
  const int W = world_size();
  HangGuard guard("a collective waited for inside a callback run by the driver", std::chrono::seconds(30));
  WaitPath path(true);
  rank0_arrives_late();
  at::Tensor first = rank_values(rank(), 16, at::kFloat);
  at::Tensor inner = rank_values(rank(), 8, at::kFloat);
  auto first_work = backend_all_reduce(first);
  std::string callback_error;
  first_work->getFuture()->addCallback([&](c10::ivalue::Future&) {
    try {
      backend_all_reduce(inner)->wait();
    } catch (const std::exception& e) {
      callback_error = e.what();
    }
  });
  // The only collective in flight: this thread drives it and runs the callback itself.
  first_work->wait();
  CHECK(callback_error.empty());
  check_equal(inner, expected_sum(W, at::arange(8, at::kLong)), "all_reduce waited in a callback");
}

FSDP_RANKS_TEST_CASE("world_size() takes the MPI lock like every other MPI call", "[comm][mpi]") {
  std::atomic<bool> returned{false};
  int size = -1;
  std::thread caller;
  {
    std::lock_guard<std::mutex> held(fsdp::comm::mpi::mpi_lock());
    caller = std::thread([&] {
      size = fsdp::comm::mpi::world_size();
      returned = true;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    // While another thread holds the lock (as the progress thread does inside MPI_Test), no MPI
    // call may run.
    CHECK_FALSE(returned.load());
  }
  caller.join();
  CHECK(returned.load());
  CHECK(size == world_size());
}
