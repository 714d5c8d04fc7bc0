#pragma once
// Failure messages on point-to-point channels: how a rank that cannot send what its peer waits for
// tells the peer why, instead of leaving it in a recv until the collective timeout.
//
// [Note: point-to-point failure messages] A backend that implements PointToPointFailures can send,
// in place of a tensor, a failure: a text that the peer's matching recv (the next recv of that
// peer from this rank with that tag, whatever its tensor) raises as a PeerFailedError, which names
// the sender and carries the text. The channel stays in step: the failure takes the place of
// exactly one send, so the sends after it match the recvs after it, as for tensors. A rank that
// gave up on a transfer it still owes a receive for posts `recv_discard` instead: it accepts the
// next send of the peer with that tag whatever its dtype and size (the tensor is dropped, the
// sender's send completes normally) or raises the failure that came in its place.
//
// On MPI ([Note: MPI point-to-point] in comm/mpi_point_to_point.cc) a failure is an envelope of
// kind "failed" whose payload is the text; the receiver answers it like a tensor, so both
// operations complete and nothing stays in flight. NCCL has no envelope: every message is the
// tensor itself and its size is fixed by the receiver's buffer, so a failure cannot be told from
// data. NCCL would need one of: a status element appended to every transfer (the receiver checks
// it before using the data, the failure text going through the rendezvous store), or
// ncclCommAbort on every rank (the communicators are then lost). Communicator::
// supports_failure_messages() says whether a group's backend has them.

#include <string>
#include <utility>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace fsdp::comm {

/// What a recv raises when its peer sent a failure instead of the tensor ([Note: point-to-point
/// failure messages]). `failure()` is the peer's text, `peer()` its rank in the group.
class PeerFailedError : public c10::Error {
 public:
  PeerFailedError(c10::SourceLocation location, std::string what, int peer, std::string failure)
      : c10::Error(location, std::move(what)), peer_(peer), failure_(std::move(failure)) {}
  int peer() const { return peer_; }
  const std::string& failure() const { return failure_; }

 private:
  int peer_;
  std::string failure_;
};

/// Implemented by backends that can send failure messages (the MPI backend).
class PointToPointFailures {
 public:
  virtual ~PointToPointFailures() = default;
  /// Sends `failure` to `dst` with `tag` in place of a tensor: the Work completes once `dst`'s
  /// matching recv (or recv_discard) took it; that recv fails with a PeerFailedError.
  virtual c10::intrusive_ptr<c10d::Work> send_failure(const std::string& failure, int dst, int tag) = 0;
  /// Receives and drops the next send of `src` with `tag`, whatever its dtype and size; fails with
  /// a PeerFailedError when it is a failure.
  virtual c10::intrusive_ptr<c10d::Work> recv_discard(int src, int tag) = 0;
};

}  // namespace fsdp::comm
