#pragma once
// A c10d::Backend over Open MPI for CPU tensors.
//
// LibTorch's PyPI build ships no gloo headers, so a C++ program cannot construct ProcessGroupGloo;
// this backend is the CPU transport of the project (and runs across nodes under mpirun).
//
// Contract (as for every c10d backend): all ranks of a backend call the same collectives in the same
// order. Each call validates its tensors at once (a c10::Error naming the collective, the expected and
// the actual sizes), then returns an asynchronous Work; errors of the transfer surface from
// `wait()`. Tensors must stay untouched until `wait()` returns. A collective that does not complete
// within the timeout aborts the job with a report naming it and the API that issued it
// (comm/issuing_api.h; see [Note: MPI progress]). Ranks that issue different collectives, or the same
// one with different sizes, get an error from `wait()` on every rank naming it, this rank's sizes
// and the issuing API, never MPI_ERR_TRUNCATE or a hang; the group stays usable ([Note: MPI size
// check] in the .cc: every collective is checked; one that repeats what earlier iterations issued
// at the same point starts beside its check instead of after it, and where such a collective
// mismatches, its outputs are not valid on the ranks that started it, as the error says).
//
// Latency: by default a collective is issued on the calling thread, and `wait()` on a collective
// that is the only one outstanding polls MPI itself instead of sleeping until the progress thread
// noticed the completion (no thread hand-off, no back-off); the progress thread still completes
// collectives nobody waits for, so communication overlaps compute as before
// (`wait_drives_progress`, [Note: MPI progress] in comm/mpi_progress.h).
//
// Point-to-point: send, recv and recvAnysource (tagged, asynchronous, any dtype, contiguous CPU
// tensors; [Note: MPI point-to-point] in comm/mpi_point_to_point.cc). Unlike collectives they need
// no agreement of the whole group: a recv matches the sends of its peer with its tag in issue order.
// A send completes once the receiver has checked it (so `wait()` on a send before the peer issued
// its recv waits for that recv, as with NCCL); a send and its recv whose tensors differ in dtype or
// element count both fail, naming both sides, and the receiver's tensor is left untouched.
//
// Supported: broadcast, allreduce (SUM, AVG = SUM then divide, MAX, MIN, PRODUCT), allgather of a
// list, allgather into one tensor, reduce-scatter from one tensor, all-to-all with equal splits
// (alltoall_base without split sizes), all-to-all of rows with split sizes (MPI_Ialltoallv), barrier; dtypes float32, float64,
// float16, bfloat16 (16-bit reductions compute in float), int32, int64, uint8, int8, bool.

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <mpi.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "fsdp_cpp/comm/collective_timeout.h"
#include "fsdp_cpp/comm/point_to_point_failure.h"

namespace fsdp::comm {

struct MpiBackendOptions {
  /// How long one collective may take before the job is aborted.
  std::chrono::milliseconds timeout = kDefaultCollectiveTimeout;
  /// Names the group in error reports.
  std::string name = "world";
  /// Whether `wait()` drives progress on the waiting thread when its collective is the only one
  /// outstanding (and collectives are issued on the calling thread). false: the progress thread
  /// issues and completes everything, and `wait()` sleeps until it did (the behaviour before; kept
  /// to measure the difference). Default: true, or false when the environment sets
  /// FSDP_MPI_WAIT_DRIVES_PROGRESS=0.
  bool wait_drives_progress = default_wait_drives_progress();

  /// false when FSDP_MPI_WAIT_DRIVES_PROGRESS=0 is set, else true.
  static bool default_wait_drives_progress();

  /// Whether every collective checks that all ranks issue the same kind with the same sizes (one
  /// small all-reduce before it, or beside it once the collective repeats what earlier iterations
  /// issued at that point; [Note: MPI size check]). false: a mismatch surfaces as MPI
  /// reports it (MPI_ERR_TRUNCATE, a hang until the timeout, or wrong data). Default: true, or
  /// false when the environment sets FSDP_MPI_CHECK_SIZES=0.
  bool check_sizes = default_check_sizes();

  /// false when FSDP_MPI_CHECK_SIZES=0 is set, else true.
  static bool default_check_sizes();
};

class MpiBackend final : public c10d::Backend, public PointToPointFailures {
 public:
  using Options = MpiBackendOptions;

  /// A backend over every rank of the job (a private duplicate of MPI_COMM_WORLD).
  ///
  ///   auto world = fsdp::comm::MpiBackend::create_world();
  ///   std::vector<at::Tensor> t{at::ones({4})};
  ///   world->allreduce(t)->wait();   // t == world size everywhere
  static c10::intrusive_ptr<MpiBackend> create_world(Options options = {});

  /// Collective over this backend's ranks: the ranks passing the same `color` form a new backend,
  /// ranked by `key` (ties by current rank). Hybrid sharding builds its groups with it.
  c10::intrusive_ptr<MpiBackend> split(int color, int key, Options options) const;
  using c10d::Backend::split;  // c10d's own overloads stay visible

  /// Wraps `comm`, which the backend owns from now on (freed with it). Prefer create_world/split.
  MpiBackend(MPI_Comm comm, int rank, int size, Options options);
  ~MpiBackend() override;

  const std::string getBackendName() const override { return "mpi"; }
  uint64_t getSequenceNumberForGroup() override { return sequence_.load(); }
  void setTimeout(std::chrono::milliseconds timeout) override { options_.timeout = timeout; }
  std::chrono::milliseconds timeout() const { return options_.timeout; }
  const std::string& name() const { return options_.name; }

  /// Switches `Options::wait_drives_progress` for collectives issued from now on (thread-safe).
  /// Every rank should switch at the same point; results are the same either way, only latency
  /// differs.
  ///
  ///   backend->set_wait_drives_progress(false);   // measure the progress-thread-only path
  void set_wait_drives_progress(bool enabled) { wait_drives_progress_.store(enabled); }
  bool wait_drives_progress() const { return wait_drives_progress_.load(); }

  /// Switches `Options::check_sizes` for collectives issued from now on. Every rank must switch at
  /// the same point (the check is itself a collective).
  void set_check_sizes(bool enabled) { check_sizes_.store(enabled); }
  bool check_sizes() const { return check_sizes_.load(); }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts = {}) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts = {}) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts = {}) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts = {}) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts = {}) override;
  /// Equal splits only (empty split sizes, or W equal ones): the input's first dimension holds W
  /// chunks, chunk j goes to rank j (MPI_Ialltoall).
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts = {}) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts = {}) override;

  /// Sends the one tensor in `tensors` to `dstRank` (a rank of this group, not this rank) with `tag`
  /// (0 .. MPI_TAG_UB, at least 32767). The Work completes once `dstRank` received it, or fails when
  /// the receiver's tensor differs in dtype or element count.
  ///
  ///   std::vector<at::Tensor> t{at::arange(4.0)};
  ///   if (backend->getRank() == 0) backend->send(t, /*dstRank=*/1, /*tag=*/7)->wait();
  ///   if (backend->getRank() == 1) backend->recv(t, /*srcRank=*/0, /*tag=*/7)->wait();
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  /// Receives into the one tensor in `tensors` the next send of `srcRank` to this rank with `tag`.
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  /// As recv, from whichever rank's send with `tag` arrives first; the Work's sourceRank() names it
  /// once `wait()` returned.
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

  /// [Note: point-to-point failure messages] (comm/point_to_point_failure.h): `failure` sent to
  /// `dstRank` in place of the next tensor with `tag`; its recv fails with a PeerFailedError.
  ///
  ///   if (backend->getRank() == 0) backend->send_failure("stage 0 failed", 1, 7)->wait();
  ///   if (backend->getRank() == 1) backend->recv(t, 0, 7)->wait();   // PeerFailedError
  c10::intrusive_ptr<c10d::Work> send_failure(const std::string& failure, int dstRank, int tag) override;
  /// Receives and drops the next send of `srcRank` with `tag` (any dtype and size), or fails with
  /// the PeerFailedError of a failure sent in its place.
  c10::intrusive_ptr<c10d::Work> recv_discard(int srcRank, int tag) override;

 private:
  // recv and recvAnysource (`src` -1).
  c10::intrusive_ptr<c10d::Work> receive(std::vector<at::Tensor>& tensors, int src, int tag,
                                         const char* name);
  // The checks every send and recv makes before anything is issued.
  void check_point_to_point(const std::vector<at::Tensor>& tensors, int peer, int tag,
                            const char* name) const;

  c10::intrusive_ptr<c10d::Work> alltoallv(at::Tensor& output, at::Tensor& input,
                                           const std::vector<int64_t>& output_splits,
                                           const std::vector<int64_t>& input_splits);

  // What the size check compares across ranks (besides the kind).
  struct Shape {
    at::ScalarType dtype;
    int64_t count;  // elements per rank
    int64_t param;  // broadcast: the root; reductions: the c10d reduce op; else 0
  };

  // Hands a collective to the progress engine. `start` issues the non-blocking MPI call; `after`
  // runs once it completed (e.g. the division of AVG); `outputs` become the Work's result.
  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, const char* collective,
                                         const std::string& sizes, const Shape& shape,
                                         std::function<int(MPI_Request*)> start,
                                         std::function<void()> after,
                                         std::vector<at::Tensor> outputs,
                                         std::vector<at::Tensor> keep_alive);

  MPI_Comm comm_;
  MPI_Comm check_comm_ = MPI_COMM_NULL;  // the size checks ([Note: MPI size check])
  // The verified descriptions, which let a collective start beside its check ([Note: MPI size check]).
  class CheckHistory;
  std::shared_ptr<CheckHistory> check_history_;
  MPI_Comm split_comm_ = MPI_COMM_NULL;  // split() (blocking, in program order)
  // Point-to-point ([Note: MPI point-to-point]): envelopes (matched by the caller's tag), payloads
  // and acknowledgements (matched by the sender's payload tag), each on its own communicator.
  MPI_Comm envelope_comm_ = MPI_COMM_NULL;
  MPI_Comm payload_comm_ = MPI_COMM_NULL;
  MPI_Comm ack_comm_ = MPI_COMM_NULL;
  int tag_ub_ = 32767;  // MPI_TAG_UB of this MPI
  std::atomic<uint64_t> p2p_sequence_{0};
  std::atomic<uint64_t> next_payload_tag_{0};
  Options options_;
  std::atomic<uint64_t> sequence_{0};
  std::atomic<bool> wait_drives_progress_;
  std::atomic<bool> check_sizes_{options_.check_sizes};
};

}  // namespace fsdp::comm
