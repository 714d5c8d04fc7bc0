// Point-to-point send/recv through the Communicator over the MPI backend ([Note: MPI
// point-to-point]) on 1-4 ranks: values of every dtype against closed forms, many messages in
// flight matched by tag, messages with one tag in issue order, a ring exchange, recvAnysource,
// stats and trace, sub-groups of a DeviceMesh (group ranks), mismatches failing on both sides, and
// misuse refused before anything is issued. On one rank there is no peer: every test asserts that
// its sends and recvs are refused (alone_and_refused), so W = 1 is covered, not skipped.
//
// Each test case uses tags of its own, so a failure in one leaves nothing that another could match.
#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "fsdp_cpp/comm/device_mesh.h"
#include "fsdp_cpp/comm/mpi_backend.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::comm::CollectiveKind;
using fsdp::testing::error_of;
using fsdp::testing::rank;
using fsdp::testing::world;
using fsdp::testing::world_size;

int next_rank() { return (rank() + 1) % world_size(); }
int previous_rank() { return (rank() + world_size() - 1) % world_size(); }

// Rank `from`'s message `index`: exact in every dtype below (small integers; bool alternates).
at::Tensor message(int from, int index, int64_t count, at::ScalarType dtype) {
  at::Tensor values = at::arange(count, at::kLong).remainder(11) + 13 * from + 3 * index;
  if (dtype == at::kBool) return values.remainder(2).to(at::kBool);
  if (at::isComplexType(dtype)) return at::complex(values.to(at::kFloat), -values.to(at::kFloat)).to(dtype);
  return values.to(dtype);
}

// With one rank there is no peer: a send or recv to rank 0 (itself) is refused, before anything is
// issued (the communicator counts nothing). Returns whether the world is that one rank.
bool alone_and_refused(fsdp::comm::Communicator& comm) {
  if (comm.size() > 1) return false;
  at::Tensor t = at::ones({4});
  CHECK_THAT(error_of([&] { comm.send(t, 0, 1); }), Contains("rank 0 cannot send to itself"));
  CHECK_THAT(error_of([&] { comm.recv(t, 0, 1); }), Contains("rank 0 cannot receive from itself"));
  CHECK(comm.stats(CollectiveKind::kSend).calls == 0);
  CHECK(comm.stats(CollectiveKind::kRecv).calls == 0);
  return true;
}

}  // namespace

FSDP_RANKS_TEST_CASE("send/recv round-trips every dtype around the ring", "[comm][mpi][p2p]") {
  fsdp::comm::Communicator comm(world().backend(), at::kCPU);
  if (alone_and_refused(comm)) return;
  const std::vector<at::ScalarType> dtypes = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16,
                                              at::kInt, at::kLong, at::kShort, at::kByte,
                                              at::kChar, at::kBool, at::kComplexFloat};
  for (int64_t count : {0, 1, 1000}) {
    for (size_t i = 0; i < dtypes.size(); ++i) {
      const int tag = 100 + static_cast<int>(i);
      at::Tensor received = at::zeros({count}, dtypes[i]);
      auto recv = comm.recv(received, previous_rank(), tag);
      auto send = comm.send(message(rank(), 0, count, dtypes[i]), next_rank(), tag);
      send.wait();
      recv.wait();
      INFO("dtype " << dtypes[i] << ", " << count << " elements");
      CHECK(received.equal(message(previous_rank(), 0, count, dtypes[i])));
    }
  }
}

FSDP_RANKS_TEST_CASE("a ring exchange: rank r sends to r+1 and receives from r-1", "[comm][mpi][p2p]") {
  fsdp::comm::Communicator comm(world().backend(), at::kCPU);
  if (alone_and_refused(comm)) return;
  // 4 MiB travels in MPI's rendezvous protocol, 64 B eagerly; both waited send-first on every rank:
  // each send completes once its receiver (which issued its recv before waiting) took it.
  for (int64_t count : {16, 1 << 20}) {
    at::Tensor received = at::empty({count}, at::kFloat);
    auto recv = comm.recv(received, previous_rank(), 200, "from the previous stage");
    auto send = comm.send(message(rank(), 1, count, at::kFloat), next_rank(), 200, "to the next stage");
    send.wait();
    recv.wait();
    CHECK(received.equal(message(previous_rank(), 1, count, at::kFloat)));
  }
}

FSDP_RANKS_TEST_CASE("many messages in flight with different tags reach the recvs with their tags",
                     "[comm][mpi][p2p]") {
  fsdp::comm::Communicator comm(world().backend(), at::kCPU);
  if (alone_and_refused(comm)) return;
  constexpr int kMessages = 24;
  // Recvs posted in the reverse tag order of the sends, with sizes that differ by tag: a recv
  // matched to another tag's message would fail the size check or hold the wrong values.
  std::vector<at::Tensor> received;
  std::vector<fsdp::comm::PendingCollective> pending;
  for (int i = kMessages - 1; i >= 0; --i) {
    received.push_back(at::empty({i + 1}, at::kLong));
    pending.push_back(comm.recv(received.back(), previous_rank(), 300 + i));
  }
  std::vector<fsdp::comm::PendingCollective> sends;
  for (int i = 0; i < kMessages; ++i) {
    sends.push_back(comm.send(message(rank(), i, i + 1, at::kLong), next_rank(), 300 + i));
  }
  // Waited out of order: odd recvs first, then the sends, then the rest.
  for (size_t k = 1; k < pending.size(); k += 2) pending[k].wait();
  for (auto& s : sends) s.wait();
  for (auto& p : pending) p.wait();
  for (int i = kMessages - 1, k = 0; i >= 0; --i, ++k) {
    INFO("tag " << 300 + i);
    CHECK(received[k].equal(message(previous_rank(), i, i + 1, at::kLong)));
  }
}

FSDP_RANKS_TEST_CASE("messages with the same tag arrive in issue order", "[comm][mpi][p2p]") {
  fsdp::comm::Communicator comm(world().backend(), at::kCPU);
  if (alone_and_refused(comm)) return;
  constexpr int kMessages = 16;
  std::vector<fsdp::comm::PendingCollective> sends;
  for (int i = 0; i < kMessages; ++i) {
    // Sizes grow with the index (small and rendezvous-sized), so a reordering fails the size check.
    sends.push_back(comm.send(message(rank(), i, 1 + i * 20000, at::kFloat), next_rank(), 400));
  }
  std::vector<at::Tensor> received;
  std::vector<fsdp::comm::PendingCollective> recvs;
  for (int i = 0; i < kMessages; ++i) {
    received.push_back(at::empty({1 + i * 20000}, at::kFloat));
    recvs.push_back(comm.recv(received.back(), previous_rank(), 400));
  }
  for (int i = kMessages - 1; i >= 0; --i) recvs[i].wait();  // the last first
  for (auto& s : sends) s.wait();
  for (int i = 0; i < kMessages; ++i) {
    INFO("message " << i);
    CHECK(received[i].equal(message(previous_rank(), i, 1 + i * 20000, at::kFloat)));
  }
}

FSDP_RANKS_TEST_CASE("recvAnysource receives every other rank's send and names its source",
                     "[comm][mpi][p2p]") {
  auto backend = world().backend();
  if (world_size() == 1) {
    std::vector<at::Tensor> t{at::empty({2})};
    CHECK_THAT(error_of([&] { backend->recvAnysource(t, 500); }), Contains("no other rank to receive from"));
    return;
  }
  if (rank() == 0) {
    std::set<int> sources;
    for (int k = 1; k < world_size(); ++k) {
      std::vector<at::Tensor> t{at::empty({3}, at::kInt)};
      auto work = backend->recvAnysource(t, 500);
      work->wait();
      const int source = work->sourceRank();
      CHECK(t[0].equal(at::full({3}, 10 * source, at::kInt)));
      sources.insert(source);
    }
    CHECK(static_cast<int>(sources.size()) == world_size() - 1);
    CHECK(*sources.begin() == 1);
  } else {
    std::vector<at::Tensor> t{at::full({3}, 10 * rank(), at::kInt)};
    backend->send(t, 0, 500)->wait();
  }
}

FSDP_RANKS_TEST_CASE("sends and recvs are counted and traced, apart from the collective sequence",
                     "[comm][mpi][p2p]") {
  fsdp::comm::Communicator comm(world().backend(), at::kCPU);
  if (alone_and_refused(comm)) return;
  comm.set_trace_enabled(true);
  const uint64_t collectives_before = comm.sequence_number();
  at::Tensor received = at::empty({6, 5}, at::kHalf);
  auto r1 = comm.recv(received, previous_rank(), 600, "activations");
  auto s1 = comm.send(at::ones({6, 5}, at::kHalf), next_rank(), 600, "activations");
  at::Tensor small = at::empty({3}, at::kLong);
  auto r2 = comm.recv(small, previous_rank(), 601, "metadata");
  auto s2 = comm.send(at::ones({3}, at::kLong), next_rank(), 601, "metadata");
  s1.wait();
  s2.wait();
  r2.wait();
  r1.wait();
  CHECK(comm.stats(CollectiveKind::kSend).calls == 2);
  CHECK(comm.stats(CollectiveKind::kSend).bytes == 6 * 5 * 2 + 3 * 8);
  CHECK(comm.stats(CollectiveKind::kRecv).calls == 2);
  CHECK(comm.stats(CollectiveKind::kRecv).bytes == 6 * 5 * 2 + 3 * 8);
  CHECK(comm.stats(CollectiveKind::kAllReduce).calls == 0);
  // Ranks of a pipeline issue different point-to-point operations: the divergence check's
  // sequence of collectives does not move.
  CHECK(comm.sequence_number() == collectives_before);
  CHECK(std::string(fsdp::comm::to_string(CollectiveKind::kSend)) == "send");
  CHECK(std::string(fsdp::comm::to_string(CollectiveKind::kRecv)) == "recv");
  const auto trace = comm.trace();
  using Phase = fsdp::comm::TraceEvent::Phase;
  REQUIRE(trace.size() == 8);
  CHECK((trace[0].phase == Phase::kIssued && trace[0].kind == CollectiveKind::kRecv &&
         trace[0].tag == "activations" && trace[0].bytes == 60 && trace[0].id == 1));
  CHECK((trace[1].phase == Phase::kIssued && trace[1].kind == CollectiveKind::kSend && trace[1].id == 2));
  CHECK((trace[4].phase == Phase::kCompleted && trace[4].kind == CollectiveKind::kSend && trace[4].id == 2));
  CHECK((trace[7].phase == Phase::kCompleted && trace[7].kind == CollectiveKind::kRecv &&
         trace[7].tag == "activations"));
  CHECK(received.equal(at::ones({6, 5}, at::kHalf)));
}

FSDP_RANKS_TEST_CASE("a pipeline group of a DeviceMesh sends by group rank", "[comm][mpi][p2p]") {
  const int W = world_size();
  // (pp, dp): pp = 2 where W is even (W = 4: pp groups {0, 2} and {1, 3}), else all of W.
  const int pp = W % 2 == 0 ? 2 : W;
  auto mesh = fsdp::comm::DeviceMesh::create(world(), {pp, W / pp}, {"pp", "dp"});
  auto& group = *mesh->group("pp");
  if (alone_and_refused(group)) return;
  const int stage = mesh->coordinate("pp");
  CHECK(group.rank() == stage);
  const int next = (stage + 1) % pp, previous = (stage + pp - 1) % pp;
  at::Tensor received = at::empty({2}, at::kLong);
  auto recv = group.recv(received, previous, 700, "activations");
  // The payload names the sender's world rank: the peer is found by group rank, not world rank.
  group.send(at::tensor({static_cast<int64_t>(rank()), static_cast<int64_t>(stage)}), next, 700).wait();
  recv.wait();
  const int64_t previous_world_rank = previous * (W / pp) + mesh->coordinate("dp");
  CHECK(received.equal(at::tensor({previous_world_rank, static_cast<int64_t>(previous)})));
  // A world rank that is not a group rank is refused, naming the group's ranks.
  CHECK_THAT(error_of([&] { group.send(at::ones({2}), pp, 701); }),
             Contains("rank " + std::to_string(pp) + " is outside this group of " + std::to_string(pp) +
                      " ranks") && Contains("not a world rank"));
}

FSDP_RANKS_TEST_CASE("a recv whose send differs in size or dtype fails on both ranks naming both sides",
                     "[comm][mpi][p2p][mismatch]") {
  fsdp::comm::Communicator comm(world().backend(), at::kCPU);
  if (alone_and_refused(comm)) return;
  struct Case {
    int64_t sent_count;
    at::ScalarType sent_dtype;
    int64_t expected_count;
    at::ScalarType expected_dtype;
    std::string sent, expected;  // as the errors describe them
  };
  const std::vector<Case> cases = {
      {16, at::kFloat, 32, at::kFloat, "16 elements of Float (sizes [16])", "32 elements of Float (sizes [32])"},
      // Same byte count, other dtype: only the envelope tells them apart.
      {8, at::kInt, 8, at::kFloat, "8 elements of Int (sizes [8])", "8 elements of Float (sizes [8])"},
      // A large payload (rendezvous protocol) into a small tensor: drained, never truncated.
      {1 << 20, at::kFloat, 1000, at::kFloat, "1048576 elements of Float (sizes [1048576])",
       "1000 elements of Float (sizes [1000])"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const int tag = 800 + static_cast<int>(i);
    at::Tensor received = at::full({c.expected_count}, 7, c.expected_dtype);
    auto recv = comm.recv(received, previous_rank(), tag, "gradients");
    auto send = comm.send(at::ones({c.sent_count}, c.sent_dtype), next_rank(), tag, "gradients");
    const std::string send_error = error_of([&] { send.wait(); });
    const std::string recv_error = error_of([&] { recv.wait(); });
    INFO(send_error);
    INFO(recv_error);
    CHECK_THAT(send_error, Contains("send #") && Contains("to rank " + std::to_string(next_rank()) + ", tag " +
                                                          std::to_string(tag)) &&
                               Contains("issued by send labelled 'gradients'") &&
                               Contains("rank " + std::to_string(next_rank()) + "'s recv with tag " +
                                        std::to_string(tag) + " expects " + c.expected) &&
                               Contains("but this send has " + c.sent));
    CHECK_THAT(recv_error, Contains("recv #") &&
                               Contains("from rank " + std::to_string(previous_rank()) + ", tag " +
                                        std::to_string(tag)) &&
                               Contains("rank " + std::to_string(previous_rank()) + " sent " + c.sent) &&
                               Contains("but this recv expects " + c.expected) &&
                               Contains("The tensor was left unchanged"));
    CHECK_THAT(recv_error, !Contains("MPI_ERR_TRUNCATE"));
    CHECK(received.equal(at::full({c.expected_count}, 7, c.expected_dtype)));
  }
  // The channel stays in step: the next send and recv with the same tag match.
  at::Tensor received = at::empty({16}, at::kFloat);
  auto recv = comm.recv(received, previous_rank(), 800);
  comm.send(message(rank(), 2, 16, at::kFloat), next_rank(), 800).wait();
  recv.wait();
  CHECK(received.equal(message(previous_rank(), 2, 16, at::kFloat)));
}

FSDP_RANKS_TEST_CASE("misuse is refused before anything is issued", "[comm][mpi][p2p]") {
  fsdp::comm::Communicator comm(world().backend(), at::kCPU);
  const int W = world_size();
  at::Tensor t = at::ones({4, 4});
  CHECK_THAT(error_of([&] { comm.send(t, rank(), 900); }), Contains("cannot send to itself"));
  CHECK_THAT(error_of([&] { comm.recv(t, rank(), 900); }), Contains("cannot receive from itself"));
  CHECK_THAT(error_of([&] { comm.send(t, W, 900); }),
             Contains("rank " + std::to_string(W) + " is outside this group of " + std::to_string(W) + " ranks"));
  CHECK_THAT(error_of([&] { comm.recv(t, -1, 900); }), Contains("rank -1 is outside this group"));
  CHECK_THAT(error_of([&] { comm.send(t, next_rank(), -3); }), Contains("the tag must be non-negative, got -3"));
  CHECK(comm.stats(CollectiveKind::kSend).calls == 0);
  CHECK(comm.stats(CollectiveKind::kRecv).calls == 0);
  // The backend makes the same checks for direct c10d callers, and refuses what MPI cannot carry.
  auto backend = world().backend();
  std::vector<at::Tensor> self{t};
  CHECK_THAT(error_of([&] { backend->send(self, rank(), 900); }),
             Contains("MPI backend send on group 'test world': rank " + std::to_string(rank()) +
                      " cannot send to itself"));
  CHECK_THAT(error_of([&] { backend->recv(self, W + 2, 900); }),
             Contains("rank " + std::to_string(W + 2) + " is outside the group of " + std::to_string(W) + " ranks"));
  if (W > 1) {
    std::vector<at::Tensor> strided{t.t()};
    CHECK_THAT(error_of([&] { backend->send(strided, next_rank(), 900); }),
               Contains("MPI backend send: the input tensor must be contiguous"));
    std::vector<at::Tensor> two{t, t};
    CHECK_THAT(error_of([&] { backend->recv(two, next_rank(), 900); }), Contains("expected exactly one tensor, got 2"));
    CHECK_THAT(error_of([&] { backend->send(self, next_rank(), -1); }), Contains("tag -1 is outside MPI's tag range 0 .. "));
  }
}

// [Note: point-to-point failure messages]: a failure in place of a tensor makes the matching recv
// throw a PeerFailedError with the sender's text (the sender's send completes normally, the
// receiver's tensor is unchanged), recv_discard drops a tensor of any size and raises a failure,
// and the channel stays in step afterwards.
FSDP_RANKS_TEST_CASE("a failure sent in place of a tensor fails the matching recv with the sender's text",
                     "[comm][mpi][p2p][failure]") {
  fsdp::comm::Communicator comm(world().backend(), at::kCPU);
  CHECK(comm.supports_failure_messages());
  if (comm.size() == 1) {
    CHECK_THAT(error_of([&] { comm.send_failure("x", 0, 1); }), Contains("rank 0 cannot send to itself"));
    CHECK_THAT(error_of([&] { comm.recv_discard(0, 1); }), Contains("rank 0 cannot receive from itself"));
    return;
  }
  const std::string text = "stage " + std::to_string(rank()) + " failed: boom";
  const std::string previous_text = "stage " + std::to_string(previous_rank()) + " failed: boom";
  // 1. A normal recv meets a failure: PeerFailedError with the text, the tensor untouched.
  at::Tensor received = at::full({16}, 7.0f);
  auto recv = comm.recv(received, previous_rank(), 950, "activations");
  auto send = comm.send_failure(text, next_rank(), 950, "activations");
  send.wait();  // the receiver took it: the send itself succeeds
  bool caught = false;
  try {
    recv.wait();
  } catch (const fsdp::comm::PeerFailedError& e) {
    caught = true;
    CHECK(e.failure() == previous_text);
    CHECK(e.peer() == previous_rank());
    CHECK_THAT(std::string(e.what_without_backtrace()),
               Contains("rank " + std::to_string(previous_rank()) + " sent a failure in place of the tensor: " +
                        previous_text));
  }
  CHECK(caught);
  CHECK(received.equal(at::full({16}, 7.0f)));
  // 2. recv_discard takes a tensor of any dtype and size (large: MPI's rendezvous protocol) and the
  //    sender's send completes; then a failure through recv_discard.
  auto discard = comm.recv_discard(previous_rank(), 951, "gradients");
  comm.send(at::ones({1 << 20}, at::kDouble), next_rank(), 951, "gradients").wait();
  discard.wait();
  auto discard_failure = comm.recv_discard(previous_rank(), 951);
  comm.send_failure(text, next_rank(), 951).wait();
  caught = false;
  try {
    discard_failure.wait();
  } catch (const fsdp::comm::PeerFailedError& e) {
    caught = e.failure() == previous_text;
  }
  CHECK(caught);
  // 3. In step: tensors after the failures match their recvs.
  at::Tensor next = at::empty({16}, at::kFloat);
  auto in_step = comm.recv(next, previous_rank(), 950);
  comm.send(message(rank(), 5, 16, at::kFloat), next_rank(), 950).wait();
  in_step.wait();
  CHECK(next.equal(message(previous_rank(), 5, 16, at::kFloat)));
  CHECK(comm.stats(CollectiveKind::kSend).calls == 4);
  CHECK(comm.stats(CollectiveKind::kRecv).calls == 4);
}
