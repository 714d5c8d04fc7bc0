// The MPI backend's point-to-point operations: send, recv, recvAnysource.
//
// [Note: MPI point-to-point] A plain MPI_Isend/MPI_Irecv pair cannot tell that the two sides
// disagree: a sender with more data than the receiver's buffer gives MPI_ERR_TRUNCATE on the
// receiver (after overwriting its buffer) and nothing on the sender, one with less or another dtype
// of the same byte count completes with garbage. So, as collectives exchange their description
// first ([Note: MPI size check]), every send travels in three messages, each on a communicator of
// its own (duplicates of the group's):
//  1. the envelope (sender rank, dtype, element count, bytes, sizes, a payload tag the sender
//     picked), on the envelope communicator with the caller's tag: the only message matched by the
//     caller's (source, tag), so MPI's ordering rule (messages between two ranks with one tag are
//     received in the order they were sent) is the order of the caller's sends and recvs;
//  2. the payload, raw bytes, on the payload communicator with the payload tag (a counter of the
//     sending backend, unique among its messages in flight), so the receiver matches exactly the
//     payload of the envelope it received, whatever order its recvs' envelopes complete in;
//  3. the receiver's answer (its own envelope: accepted or refused), on the acknowledgement
//     communicator with the payload tag.
// The sender issues all three at once (one stage of three requests in the progress engine,
// [Note: MPI progress]); its Work completes when the answer came. The receiver first receives the
// envelope (the stage where collectives run their size check), compares dtype and element count
// with its tensor, then receives the payload (into its tensor, or into scratch memory when they
// differ, so the sender's transfer completes and the channel stays in step) and sends its answer.
// A mismatch fails both Works with errors naming both sides; the receiver's tensor is untouched.
// A recv whose send never comes, or a send nobody receives, ends with the timeout's report naming
// the operation, its peer and its tag (the watchdog aborts the job, as for a collective).
// Point-to-point operations take no part in the collectives' order (`order` null), so a recv never
// waits behind a collective whose other ranks are still busy, and they have their own sequence
// numbers ("send #3"): the group's collective sequence is unchanged by them.
// Cost: two small extra messages per send (a 128-byte envelope and answer), and a send's `wait()`
// returns only once the receiver issued its recv (as NCCL's send).
// Failures ([Note: point-to-point failure messages] in comm/point_to_point_failure.h): an envelope
// of kind kFailed announces, in place of a tensor, a payload holding the sender's failure text. Its
// receiver takes that payload into scratch memory whatever its own tensor, answers "accepted" (so
// the sender's Work completes normally) and fails with a PeerFailedError carrying the text. A
// discarding recv (recv_discard) has no tensor: it takes any payload into scratch memory, answers
// "accepted", and completes normally unless the envelope was a failure.
#include <array>
#include <climits>
#include <cstring>
#include <memory>
#include <string>

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include "fsdp_cpp/comm/flight_recorder.h"
#include "fsdp_cpp/comm/issuing_api.h"
#include "fsdp_cpp/comm/mpi_backend.h"
#include "fsdp_cpp/comm/mpi_progress.h"
#include "fsdp_cpp/comm/mpi_work.h"
#include "fsdp_cpp/comm/point_to_point_failure.h"

namespace fsdp::comm {
namespace {

using mpi::MpiWork;

// The envelope a sender sends first and the answer its receiver returns have one layout.
constexpr int kEnvelopeFields = 16;
constexpr int kMaxEnvelopeDims = 8;
enum Field : int { kKind = 0, kRank, kDtype, kNumel, kBytes, kPayloadTag, kTag, kDims, kSizes };
static_assert(kSizes + kMaxEnvelopeDims == kEnvelopeFields);
enum Kind : int64_t { kSent = 1, kAccepted = 2, kRefused = 3, kFailed = 4 };
using Envelope = std::array<int64_t, kEnvelopeFields>;

Envelope envelope_of(const at::Tensor& t, Kind kind, int rank, int64_t payload_tag, int tag) {
  Envelope e{};
  e[kKind] = kind;
  e[kRank] = rank;
  e[kDtype] = static_cast<int64_t>(t.scalar_type());
  e[kNumel] = t.numel();
  e[kBytes] = static_cast<int64_t>(t.nbytes());
  e[kPayloadTag] = payload_tag;
  e[kTag] = tag;
  e[kDims] = t.dim();
  for (int64_t d = 0; d < t.dim() && d < kMaxEnvelopeDims; ++d) e[kSizes + d] = t.size(d);
  return e;
}

// "16 elements of Float (sizes [4, 4])"
std::string describe_envelope(const Envelope& e) {
  std::string sizes;
  if (e[kDims] > kMaxEnvelopeDims) {
    sizes = fmt::format("{} dimensions", e[kDims]);
  } else {
    for (int64_t d = 0; d < e[kDims]; ++d) sizes += (d == 0 ? "" : ", ") + std::to_string(e[kSizes + d]);
    sizes = "[" + sizes + "]";
  }
  return fmt::format("{} elements of {} (sizes {})", e[kNumel],
                     c10::toString(static_cast<at::ScalarType>(e[kDtype])), sizes);
}

const char* kAdvice =
    "A send and its recv must use tensors of the same dtype and element count (a pipeline stage and "
    "its neighbour agree on the activations' shapes before sending them).";

const char* kTimeoutAdvice =
    "Every recv needs a send from its peer with the same tag, and every send a recv: a rank that "
    "skipped one, or waits for something its peer does only afterwards (two ranks each waiting for "
    "its send before issuing its recv), causes this.";

struct SendState {
  Envelope envelope{};
  Envelope answer{};
};

struct RecvState {
  Envelope mine{};      // this rank's tensor
  Envelope envelope{};  // the sender's
  Envelope answer{};    // sent back
  bool discard = false; // recv_discard: no tensor, any payload is taken and dropped
  bool accepted = false;  // the payload goes into this rank's tensor
  bool failed = false;    // the sender sent a failure (its text is the payload)
  at::Tensor scratch;   // receives a refused, discarded or failure payload
};

}  // namespace

void MpiBackend::check_point_to_point(const std::vector<at::Tensor>& tensors, int peer, int tag,
                                      const char* name) const {
  TORCH_CHECK(tensors.size() == 1, "MPI backend ", name, ": expected exactly one tensor, got ", tensors.size());
  const bool sending = std::string(name) == "send";
  mpi::check_cpu_contiguous(tensors[0], name, sending ? "input" : "output");
  const char* to_from = sending ? "to" : "from";
  if (peer >= 0 || std::string(name) != "recvAnysource") {
    TORCH_CHECK(peer >= 0 && peer < size_, "MPI backend ", name, " on group '", options_.name, "': rank ",
                peer, " is outside the group of ", size_, " ranks; a peer is a rank of this group (0 .. ",
                size_ - 1, "), not a rank of the world");
    TORCH_CHECK(peer != rank_, "MPI backend ", name, " on group '", options_.name, "': rank ", rank_,
                " cannot ", sending ? "send to" : "receive from", " itself (nothing would ever match it; "
                "copy the tensor instead)");
  } else {
    TORCH_CHECK(size_ > 1, "MPI backend recvAnysource on group '", options_.name,
                "': a group of one rank has no other rank to receive from");
  }
  TORCH_CHECK(tag >= 0 && tag <= tag_ub_, "MPI backend ", name, " ", to_from, " rank ", peer, ": tag ", tag,
              " is outside MPI's tag range 0 .. ", tag_ub_);
  TORCH_CHECK(tensors[0].nbytes() <= static_cast<size_t>(INT_MAX), "MPI backend ", name, ": ",
              tensors[0].nbytes(), " bytes exceed MPI's count limit of ", INT_MAX, " bytes per message; ",
              "send the tensor in parts");
}

c10::intrusive_ptr<c10d::Work> MpiBackend::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  check_point_to_point(tensors, dstRank, tag, "send");
  at::Tensor t = tensors[0];
  const uint64_t sequence = ++p2p_sequence_;
  flight_recorder::record_backend_sequence(flight_recorder::IssueScope::current(), sequence);
  const int payload_tag = static_cast<int>(next_payload_tag_++ % (static_cast<uint64_t>(tag_ub_) + 1));
  auto state = std::make_shared<SendState>();
  state->envelope = envelope_of(t, kSent, rank_, payload_tag, tag);
  auto work = c10::make_intrusive<MpiWork>(rank_, c10d::OpType::SEND, std::vector<at::Tensor>{t});

  mpi::PendingCollective op;
  const std::string api = IssuingApi::current();
  op.description = fmt::format("send #{} ({} to rank {}, tag {}) on MPI group '{}' (rank {} of {}), issued by {}",
                               sequence, mpi::describe(t), dstRank, tag, options_.name, rank_, size_,
                               api.empty() ? "an API that did not name itself" : api);
  op.timeout = options_.timeout;
  const int bytes = static_cast<int>(t.nbytes());
  const MPI_Comm envelope_comm = envelope_comm_, payload_comm = payload_comm_, ack_comm = ack_comm_;
  // [Note: MPI point-to-point]: envelope, payload and the receiver's answer, in one stage.
  op.start = [=](MPI_Request* r) {
    int rc = MPI_Isend(state->envelope.data(), kEnvelopeFields, MPI_INT64_T, dstRank, tag, envelope_comm, &r[0]);
    if (rc == MPI_SUCCESS) rc = MPI_Isend(t.data_ptr(), bytes, MPI_BYTE, dstRank, payload_tag, payload_comm, &r[1]);
    if (rc == MPI_SUCCESS) {
      rc = MPI_Irecv(state->answer.data(), kEnvelopeFields, MPI_INT64_T, dstRank, payload_tag, ack_comm, &r[2]);
    }
    return rc;
  };
  op.after = [state, t, dstRank, description = op.description] {
    if (state->answer[kKind] == kAccepted) return;
    TORCH_CHECK(false, "MPI backend ", description, ": rank ", dstRank, "'s recv with tag ",
                state->envelope[kTag], " expects ", describe_envelope(state->answer), ", but this send has ",
                describe_envelope(state->envelope), ". The recv fails on rank ", dstRank,
                " too and its tensor was left unchanged. ", kAdvice);
  };
  op.finish = [work](std::exception_ptr error) { work->complete(error); };
  op.waiting_running = fmt::format(
      "rank {} has not received this send: it issued no recv from rank {} with tag {} (or is stuck "
      "before it)", dstRank, rank_, tag);
  op.timeout_advice = kTimeoutAdvice;
  work->set_submitted(mpi::submit(std::move(op), wait_drives_progress_.load()));
  return work;
}

c10::intrusive_ptr<c10d::Work> MpiBackend::send_failure(const std::string& failure, int dstRank, int tag) {
  // The text travels as the payload: one byte tensor, checked like any send's.
  at::Tensor text = at::empty({static_cast<int64_t>(failure.size())}, at::kByte);
  if (!failure.empty()) std::memcpy(text.data_ptr(), failure.data(), failure.size());
  std::vector<at::Tensor> tensors{text};
  check_point_to_point(tensors, dstRank, tag, "send");
  const uint64_t sequence = ++p2p_sequence_;
  flight_recorder::record_backend_sequence(flight_recorder::IssueScope::current(), sequence);
  const int payload_tag = static_cast<int>(next_payload_tag_++ % (static_cast<uint64_t>(tag_ub_) + 1));
  auto state = std::make_shared<SendState>();
  state->envelope = envelope_of(text, kFailed, rank_, payload_tag, tag);
  auto work = c10::make_intrusive<MpiWork>(rank_, c10d::OpType::SEND, std::vector<at::Tensor>{text});

  mpi::PendingCollective op;
  const std::string api = IssuingApi::current();
  op.description = fmt::format("send #{} (a failure, in place of a tensor, to rank {}, tag {}) on MPI group '{}' "
                               "(rank {} of {}), issued by {}",
                               sequence, dstRank, tag, options_.name, rank_, size_,
                               api.empty() ? "an API that did not name itself" : api);
  op.timeout = options_.timeout;
  const int bytes = static_cast<int>(text.nbytes());
  const MPI_Comm envelope_comm = envelope_comm_, payload_comm = payload_comm_, ack_comm = ack_comm_;
  op.start = [=](MPI_Request* r) {
    int rc = MPI_Isend(state->envelope.data(), kEnvelopeFields, MPI_INT64_T, dstRank, tag, envelope_comm, &r[0]);
    if (rc == MPI_SUCCESS) rc = MPI_Isend(text.data_ptr(), bytes, MPI_BYTE, dstRank, payload_tag, payload_comm, &r[1]);
    if (rc == MPI_SUCCESS) {
      rc = MPI_Irecv(state->answer.data(), kEnvelopeFields, MPI_INT64_T, dstRank, payload_tag, ack_comm, &r[2]);
    }
    return rc;
  };
  op.after = [state, dstRank, description = op.description] {
    TORCH_CHECK(state->answer[kKind] == kAccepted, "MPI backend ", description, ": rank ", dstRank,
                " answered the failure with kind ", state->answer[kKind], " instead of accepting it (",
                kAccepted, "); both ranks must run this build of the backend");
  };
  op.finish = [work](std::exception_ptr error) { work->complete(error); };
  op.waiting_running = fmt::format(
      "rank {} has not received this failure: it issued no recv from rank {} with tag {} (or is stuck "
      "before it)", dstRank, rank_, tag);
  op.timeout_advice = kTimeoutAdvice;
  work->set_submitted(mpi::submit(std::move(op), wait_drives_progress_.load()));
  return work;
}

c10::intrusive_ptr<c10d::Work> MpiBackend::recv_discard(int srcRank, int tag) {
  // A placeholder for the checks; nothing is received into it.
  std::vector<at::Tensor> tensors{at::empty({0}, at::kByte)};
  return receive(tensors, srcRank, tag, "recv_discard");
}

c10::intrusive_ptr<c10d::Work> MpiBackend::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  return receive(tensors, srcRank, tag, "recv");
}

c10::intrusive_ptr<c10d::Work> MpiBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return receive(tensors, -1, tag, "recvAnysource");
}

c10::intrusive_ptr<c10d::Work> MpiBackend::receive(std::vector<at::Tensor>& tensors, int src, int tag,
                                                   const char* name) {
  check_point_to_point(tensors, src, tag, name);
  at::Tensor t = tensors[0];
  const uint64_t sequence = ++p2p_sequence_;
  flight_recorder::record_backend_sequence(flight_recorder::IssueScope::current(), sequence);
  auto state = std::make_shared<RecvState>();
  state->mine = envelope_of(t, kAccepted, rank_, 0, tag);
  state->discard = std::string(name) == "recv_discard";
  const c10d::OpType type = src < 0 ? c10d::OpType::RECVANYSOURCE : c10d::OpType::RECV;
  auto work = c10::make_intrusive<MpiWork>(rank_, type, std::vector<at::Tensor>{t});

  mpi::PendingCollective op;
  const std::string api = IssuingApi::current();
  const std::string peer = src < 0 ? std::string("any rank") : "rank " + std::to_string(src);
  op.description = fmt::format("{} #{} ({} from {}, tag {}) on MPI group '{}' (rank {} of {}), issued by {}",
                               name, sequence, state->discard ? std::string("anything") : mpi::describe(t), peer,
                               tag, options_.name, rank_, size_,
                               api.empty() ? "an API that did not name itself" : api);
  op.timeout = options_.timeout;
  const MPI_Comm envelope_comm = envelope_comm_, payload_comm = payload_comm_, ack_comm = ack_comm_;
  // [Note: MPI point-to-point]: first the sender's envelope ...
  op.check_start = [=](MPI_Request* r) {
    return MPI_Irecv(state->envelope.data(), kEnvelopeFields, MPI_INT64_T, src < 0 ? MPI_ANY_SOURCE : src, tag,
                     envelope_comm, r);
  };
  op.check_verify = [state] {
    const Envelope& e = state->envelope;
    state->failed = e[kKind] == kFailed;
    state->accepted = !state->discard && e[kKind] == kSent && e[kDtype] == state->mine[kDtype] &&
                      e[kNumel] == state->mine[kNumel];
    state->answer = state->mine;
    state->answer[kKind] = state->accepted || state->failed || state->discard ? kAccepted : kRefused;
    state->answer[kPayloadTag] = e[kPayloadTag];
  };
  // ... then its payload (into scratch memory when refused) and the answer.
  op.start = [=](MPI_Request* r) {
    const int sender = static_cast<int>(state->envelope[kRank]);
    const int payload_tag = static_cast<int>(state->envelope[kPayloadTag]);
    void* buffer = t.data_ptr();
    int bytes = static_cast<int>(t.nbytes());
    if (!state->accepted) {
      state->scratch = at::empty({state->envelope[kBytes]}, at::kByte);
      buffer = state->scratch.data_ptr();
      bytes = static_cast<int>(state->envelope[kBytes]);
    }
    int rc = MPI_Irecv(buffer, bytes, MPI_BYTE, sender, payload_tag, payload_comm, &r[0]);
    if (rc == MPI_SUCCESS) {
      rc = MPI_Isend(state->answer.data(), kEnvelopeFields, MPI_INT64_T, sender, payload_tag, ack_comm, &r[1]);
    }
    return rc;
  };
  op.after = [state, t, description = op.description] {
    const Envelope& e = state->envelope;
    if (state->failed) {
      std::string failure;
      if (state->scratch.numel() > 0) {
        failure.assign(static_cast<const char*>(state->scratch.data_ptr()), static_cast<size_t>(state->scratch.numel()));
      }
      throw PeerFailedError(c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                            fmt::format("MPI backend {}: rank {} sent a failure in place of the tensor: {}",
                                        description, e[kRank], failure),
                            static_cast<int>(e[kRank]), failure);
    }
    if (state->accepted || state->discard) return;
    TORCH_CHECK(false, "MPI backend ", description, ": rank ", e[kRank], " sent ", describe_envelope(e),
                " with tag ", e[kTag], ", but this recv expects ", describe_envelope(state->mine),
                ". The tensor was left unchanged, and the send fails on rank ", e[kRank], " too. ", kAdvice);
  };
  op.finish = [work, state](std::exception_ptr error) {
    if (state->envelope[kKind] == kSent || state->envelope[kKind] == kFailed) work->set_source_rank(static_cast<int>(state->envelope[kRank]));
    work->complete(error);
  };
  op.waiting_first_stage =
      src < 0 ? fmt::format("no rank sent to this rank with tag {} (or every sender is stuck before it)", tag)
              : fmt::format("no send to this rank with tag {} arrived from rank {}: rank {} did not issue it "
                            "(or is stuck before it)", tag, src, src);
  op.waiting_running = "the matching send's envelope arrived, but its payload did not finish";
  op.timeout_advice = kTimeoutAdvice;
  work->set_submitted(mpi::submit(std::move(op), wait_drives_progress_.load()));
  return work;
}

}  // namespace fsdp::comm
