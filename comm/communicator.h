#pragma once
// The one thin wrapper over a c10d::Backend through which every layer of the project communicates.
// It counts calls and bytes per collective kind and can keep a trace of issue/complete order, which
// tests and benchmarks read (e.g. "one all-gather per unit per forward", "never more than two
// all-gathers in flight").
//
// Bytes counted per call are the collective's full payload on one rank: the output of an all-gather,
// the input of a reduce-scatter or all-to-all, the tensor of an all-reduce or broadcast. The bytes a
// rank actually sends for an all-gather, reduce-scatter or all-to-all are that times (W-1)/W.
// Point-to-point sends and recvs count their tensor's bytes.
//
// Every operation is also recorded in the process's flight recorder (comm/flight_recorder.h,
// [Note: flight recorder]): the communicator's name, size, rank and world ranks, the sequence
// number, kind, tag, dtype, element counts, issuing API, state and times, dumped when a job hangs
// or fails.

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <c10/util/FunctionRef.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "fsdp_cpp/comm/point_to_point_failure.h"

namespace fsdp::comm {

enum class CollectiveKind : int {
  kAllGather = 0,      // all_gather_into_tensor: one input per rank into one output tensor
  kReduceScatter,      // reduce_scatter_tensor: one input tensor, one output slice per rank
  kAllReduce,
  kBroadcast,
  kAllGatherList,      // all-gather of one tensor into a list of tensors
  kAllGatherBytes,     // all-gather of variable-size byte buffers (metadata, consistency checks)
  kBarrier,
  kAllToAll,           // all_to_all_single: equal splits, chunk j of the input goes to rank j
  kSend,               // point-to-point send (the tensor's bytes)
  kRecv,               // point-to-point recv (the tensor's bytes)
  kAllToAllV,          // all_to_all: rows split per destination by sizes (expert parallel's dispatch)
};
constexpr int kNumCollectiveKinds = 11;

const char* to_string(CollectiveKind kind);

struct CollectiveStats {
  int64_t calls = 0;
  int64_t bytes = 0;
};

/// One entry of the optional trace: a collective issued, or observed complete through wait().
struct TraceEvent {
  enum class Phase { kIssued, kCompleted };
  Phase phase;
  CollectiveKind kind;
  uint64_t id;     // issue number within this communicator, from 1
  int64_t bytes;
  std::string tag; // caller-provided label (e.g. the unit's FQN)
};

class Communicator;

/// A collective (or a point-to-point send or recv) in flight. `wait()` blocks until it completed
/// (rethrowing its error) and records the completion in the trace. Waiting twice is allowed.
class PendingCollective {
 public:
  PendingCollective() = default;
  void wait();
  bool completed() const;
  bool valid() const { return static_cast<bool>(work_); }

 private:
  friend class Communicator;
  PendingCollective(Communicator* comm, c10::intrusive_ptr<c10d::Work> work, CollectiveKind kind,
                    uint64_t id, int64_t bytes, std::string tag, uint64_t flight_id);
  Communicator* comm_ = nullptr;
  c10::intrusive_ptr<c10d::Work> work_;
  CollectiveKind kind_ = CollectiveKind::kBarrier;
  uint64_t id_ = 0;
  int64_t bytes_ = 0;
  std::string tag_;
  uint64_t flight_id_ = 0;  // the flight recorder's entry (0: not recorded)
  bool waited_ = false;
};

/// Wraps a c10d::Backend (MPI, NCCL or a test backend) for the engine.
///
///   fsdp::comm::Communicator comm(fsdp::comm::MpiBackend::create_world(), at::kCPU);
///   at::Tensor out = at::empty({comm.size() * 4});
///   comm.all_gather_into_tensor(out, at::ones({4})).wait();
///   comm.stats(fsdp::comm::CollectiveKind::kAllGather).calls;   // 1
class Communicator {
 public:
  /// `device`: where this backend's tensors live (metadata exchanges allocate there).
  Communicator(c10::intrusive_ptr<c10d::Backend> backend, at::Device device);

  int rank() const { return rank_; }
  int size() const { return size_; }
  /// The group's name in flight recorder dumps and reports: its backend's group description (the
  /// MPI backend's name, e.g. "world" or "world/dp group 0"), else the backend's name ("nccl").
  const std::string& name() const { return name_; }
  at::Device device() const { return device_; }
  const c10::intrusive_ptr<c10d::Backend>& backend() const { return backend_; }

  /// The world rank of each rank of this group: `world_ranks()->at(g)` is the rank, in the job's
  /// world, of group rank g. Known for the world communicator init_process_group makes (0 .. W-1)
  /// and for every group a DeviceMesh makes (its row-major layout gives them; a mesh created over a
  /// communicator that does not know its own world ranks numbers them in that communicator).
  /// std::nullopt for a communicator made directly from a backend, which cannot tell. Errors that
  /// several ranks agree on name the lowest world rank (comm/agreement.h).
  ///
  ///   auto mesh = fsdp::comm::DeviceMesh::create(*pg.comm, {2, 2}, {"dp", "tp"});
  ///   mesh->group("dp")->world_ranks();   // rank 1: {1, 3}
  std::optional<std::vector<int>> world_ranks() const;
  /// The world rank of this rank, when world_ranks() is known.
  std::optional<int> world_rank() const;
  /// Sets world_ranks() (for the makers of communicators: init_process_group, DeviceMesh, a
  /// backend's own group splitter). `ranks` must hold size() distinct non-negative ranks; a
  /// c10::Error names what was expected and found otherwise.
  void set_world_ranks(std::vector<int> ranks);

  PendingCollective all_gather_into_tensor(at::Tensor output, at::Tensor input,
                                           std::string tag = {});
  PendingCollective reduce_scatter_tensor(at::Tensor output, at::Tensor input,
                                          c10d::ReduceOp op = c10d::ReduceOp::SUM,
                                          std::string tag = {});
  PendingCollective all_reduce(at::Tensor tensor, c10d::ReduceOp op = c10d::ReduceOp::SUM,
                               std::string tag = {});
  PendingCollective broadcast(at::Tensor tensor, int root, std::string tag = {});
  /// Gathers `input` from every rank into `outputs` (one tensor per rank, the input's shape).
  PendingCollective all_gather(std::vector<at::Tensor> outputs, at::Tensor input,
                               std::string tag = {});
  /// All-to-all with equal splits (c10d's alltoall_base; FSDP's quantized gradient reduction):
  /// `input` holds W equal chunks along its first dimension, chunk j goes to rank j, and chunk i
  /// of `output` (the input's shape and dtype) is what rank i sent this rank.
  ///
  ///   at::Tensor in = at::full({comm.size(), 4}, comm.rank()), out = at::empty_like(in);
  ///   comm.all_to_all_single(out, in).wait();   // out[i] == i everywhere
  PendingCollective all_to_all_single(at::Tensor output, at::Tensor input, std::string tag = {});
  /// All-to-all of rows with sizes per rank (c10d's alltoall_base with split sizes; MPI_Ialltoallv
  /// on MPI, NCCL's grouped send/recv on GPU): the first input_splits[0] rows of `input` (dimension
  /// 0) go to rank 0, the next input_splits[1] to rank 1, ...; `output` receives output_splits[i]
  /// rows from rank i, in rank order. Every row has the same shape and dtype on every rank. The
  /// splits must pair up: output_splits[i] on this rank equals input_splits[this rank] on rank i
  /// (exchange_splits computes them). Bytes counted: the input's. Sizes that do not add up to the
  /// tensors' rows are a c10::Error before anything is issued.
  ///
  ///   std::vector<int64_t> send = {1, 2};                   // rank 0: 1 row to rank 0, 2 to rank 1
  ///   std::vector<int64_t> recv = comm.exchange_splits(send);
  ///   at::Tensor out = at::empty({sum(recv), 4});
  ///   comm.all_to_all(out, in, recv, send).wait();
  PendingCollective all_to_all(at::Tensor output, at::Tensor input, std::vector<int64_t> output_splits,
                               std::vector<int64_t> input_splits, std::string tag = {});
  /// The output splits of an all_to_all whose input splits are `input_splits` (size() of them) on
  /// every rank: result[i] is what rank i sends this rank (blocking; one all_to_all_single of
  /// size() int64 values).
  std::vector<int64_t> exchange_splits(const std::vector<int64_t>& input_splits, std::string tag = {});
  /// Gathers a byte buffer of any size from every rank (blocking): result[r] is rank r's buffer.
  std::vector<std::vector<uint8_t>> all_gather_bytes(const std::vector<uint8_t>& local,
                                                     std::string tag = {});
  void barrier();

  /// Point-to-point: sends `tensor` (contiguous, any dtype) to rank `dst` of this group (a group
  /// rank, not a world rank) with `tag`; `label` names the transfer in traces and error reports.
  /// The receiver's matching `recv` gets the sends of this rank with that tag in issue order. On
  /// MPI the send completes once `dst` received it, and a recv whose tensor differs in dtype or
  /// element count fails on both ranks naming both sides ([Note: MPI point-to-point]); a peer that
  /// never answers ends with the collective timeout's report naming the peer and the tag. Sending
  /// to oneself, or to a rank outside the group, is a c10::Error before anything is issued.
  ///
  ///   at::Tensor act = at::ones({4, 8});
  ///   if (comm.rank() == 0) comm.send(act, /*dst=*/1, /*tag=*/0, "activations").wait();
  ///   if (comm.rank() == 1) comm.recv(act, /*src=*/0, /*tag=*/0, "activations").wait();
  ///   comm.stats(fsdp::comm::CollectiveKind::kSend);   // {calls, bytes} (rank 0: {1, 128})
  PendingCollective send(at::Tensor tensor, int dst, int tag = 0, std::string label = {});
  /// Receives into `tensor` the next send of rank `src` of this group to this rank with `tag`.
  /// When `src` sent a failure in its place (send_failure), wait() throws a PeerFailedError
  /// (comm/point_to_point_failure.h) carrying the sender's text, and `tensor` is unchanged.
  PendingCollective recv(at::Tensor tensor, int src, int tag = 0, std::string label = {});

  /// Whether this group's backend can send failures in place of tensors (the MPI backend; not
  /// NCCL, which has no envelope: [Note: point-to-point failure messages]).
  bool supports_failure_messages() const;
  /// Sends `failure` (a text) to rank `dst` in place of the next tensor this rank would send it
  /// with `tag`: the peer's matching recv (or recv_discard) fails with a PeerFailedError carrying
  /// the text; the channel stays in step. Completes once the peer took it. Counted as a send of the
  /// text's bytes. A backend without failure messages is a c10::Error before anything is issued.
  ///
  ///   try { out = stage(x); } catch (const c10::Error& e) {
  ///     comm.send_failure(e.what_without_backtrace(), /*dst=*/1, /*tag=*/0, "activations").wait();
  ///   }
  ///   // rank 1: comm.recv(t, 0, 0).wait() throws fsdp::comm::PeerFailedError; failure() is the text
  PendingCollective send_failure(const std::string& failure, int dst, int tag = 0, std::string label = {});
  /// Receives and drops the next send of rank `src` with `tag`, whatever its dtype and size (a rank
  /// that gave up on a transfer keeps the channel in step with it); wait() throws a PeerFailedError
  /// when a failure came in its place. Counted as a recv of 0 bytes. Same refusal as send_failure.
  PendingCollective recv_discard(int src, int tag = 0, std::string label = {});

  /// The issue number of the last collective recorded (0 before the first): equal on every rank
  /// while they issue the same collectives. The divergence check (fsdp/divergence.h) compares it.
  /// Point-to-point operations do not count (ranks of a pipeline issue different ones).
  uint64_t sequence_number() const;

  CollectiveStats stats(CollectiveKind kind) const;
  void reset_stats();

  /// Starts (clearing) or stops recording the trace.
  void set_trace_enabled(bool enabled);
  std::vector<TraceEvent> trace() const;

 private:
  friend class PendingCollective;
  // What the flight recorder records of an operation besides the communicator's own fields.
  struct OpInfo {
    CollectiveKind kind;
    int64_t bytes;
    const char* dtype;
    int64_t input_elements;
    int64_t output_elements;
    int peer = -1;  // point-to-point only
    int tag = -1;
  };
  // Records `op` in the flight recorder (before the backend sees it), runs `start` (the backend's
  // call) with the entry as flight_recorder::IssueScope, then record_issue. An exception of
  // `start` marks the entry failed and propagates. `tag` is moved from only after `start` ran (which
  // may read it).
  PendingCollective issue(const OpInfo& op, std::string&& tag,
                          c10::function_ref<c10::intrusive_ptr<c10d::Work>()> start);
  // all_gather_bytes once its flight recorder entry `flight_id` was made.
  std::vector<std::vector<uint8_t>> all_gather_bytes_recorded(const std::vector<uint8_t>& local, std::string tag,
                                                              uint64_t flight_id);
  // The flight recorder's entry for `op` (0 when the recorder is off).
  uint64_t flight_issue(const OpInfo& op, const std::string& label);
  PendingCollective record_issue(c10::intrusive_ptr<c10d::Work> work, CollectiveKind kind,
                                 int64_t bytes, std::string tag, uint64_t flight_id);
  void record_completion(const PendingCollective& pending);
  // Refuses a peer outside the group, or this rank itself, before anything is issued.
  void check_peer(int peer, int tag, const char* op) const;

  c10::intrusive_ptr<c10d::Backend> backend_;
  at::Device device_;
  int rank_;
  int size_;
  std::string name_;
  mutable std::mutex mutex_;
  std::optional<std::vector<int>> world_ranks_;
  std::string world_ranks_json_;  // world_ranks_ for the flight recorder ("" unknown)
  std::array<CollectiveStats, kNumCollectiveKinds> stats_{};
  uint64_t next_id_ = 0;       // trace ids: every operation
  uint64_t collectives_ = 0;   // sequence_number(): collectives only
  uint64_t point_to_point_ = 0;  // the flight recorder's sequence of point-to-point operations
  // The flight recorder's count per (send 0 / recv 1, peer, tag).
  std::map<std::array<int, 3>, uint64_t> channels_;
  bool trace_enabled_ = false;
  std::vector<TraceEvent> trace_;
};

}  // namespace fsdp::comm
