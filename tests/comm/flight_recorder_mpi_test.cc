// The flight recorder fed by a Communicator over the MPI backend, on every world size of the launch:
// each collective's entry (communicator, sequence number equal to sequence_number(), kind, tag, dtype,
// element counts, issuing API, started/completed and their times), point-to-point operations with
// their own counters, a collective refused by the size check recorded as failed with its error on
// every rank, a dump per rank that parses; and the recorder's cost per collective (on 1 rank: small
// all-reduces with the recorder on and off, printed).
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/comm/flight_recorder.h"
#include "fsdp_cpp/comm/issuing_api.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

namespace fr = fsdp::comm::flight_recorder;
using Catch::Matchers::Contains;
using fsdp::testing::fresh_comm;
using fsdp::testing::rank;
using fsdp::testing::world_size;

// The entries of communicator `comm` (the harness's own collectives go through another one).
std::vector<fr::Entry> entries_of(const fsdp::comm::Communicator& comm, uint64_t after_id) {
  std::vector<fr::Entry> out;
  for (auto& e : fr::entries()) {
    if (e.id > after_id && e.comm_size == comm.size() && e.comm_name == comm.name()) out.push_back(e);
  }
  return out;
}

// A c10d backend whose all-reduce completes at once (the cost benchmark).
class InstantWork : public c10d::Work {
 public:
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds) override { return true; }
};

class InstantBackend : public c10d::Backend {
 public:
  InstantBackend() : c10d::Backend(0, 1) {}
  const std::string getBackendName() const override { return "instant"; }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>&, const c10d::AllreduceOptions&) override {
    return c10::make_intrusive<InstantWork>();
  }
};

uint64_t last_id() {
  const auto all = fr::entries();
  return all.empty() ? 0 : all.back().id;
}

}  // namespace

FSDP_RANKS_TEST_CASE("flight recorder: a communicator's collectives, with their sequence numbers and states",
                     "[flight_recorder][mpi]") {
  REQUIRE(fr::enabled());
  const int W = world_size();
  auto comm = fresh_comm();
  CHECK(comm->name() == "test world");  // the harness's MPI backend's name
  const uint64_t before = last_id();
  at::Tensor t = at::ones({4});
  comm->all_reduce(t, c10d::ReduceOp::SUM, "grads").wait();
  at::Tensor out = at::empty({4 * W});
  {
    fsdp::comm::IssuingApi api("fsdp::test api");
    comm->all_gather_into_tensor(out, at::ones({4}, at::kDouble).to(at::kFloat), "params").wait();
  }
  comm->barrier();
  const auto gathered = comm->all_gather_bytes({1, 2, 3}, "metadata");
  CHECK(comm->sequence_number() == 4);

  const auto e = entries_of(*comm, before);
  REQUIRE(e.size() == 4);
  CHECK(e[0].kind == "all_reduce");
  CHECK(e[0].sequence == 1);
  CHECK(e[0].label == "grads");
  CHECK(e[0].dtype == "Float");
  CHECK(e[0].input_elements == 4);
  CHECK(e[0].output_elements == 4);
  CHECK(e[0].bytes == 16);
  CHECK(e[0].comm_size == W);
  CHECK(e[0].comm_rank == rank());
  CHECK(e[0].api.empty());
  CHECK_FALSE(e[0].point_to_point);
  CHECK(e[1].kind == "all_gather_into_tensor");
  CHECK(e[1].sequence == 2);
  CHECK(e[1].api == "fsdp::test api");  // the tag is the label, not part of the API
  CHECK(e[1].output_elements == 4 * W);
  CHECK(e[2].kind == "barrier");
  CHECK(e[2].sequence == 3);
  CHECK(e[3].kind == "all_gather_bytes");
  CHECK(e[3].sequence == 4);
  CHECK(e[3].input_elements == 3);
  if (W > 1) {
    // The MPI backend's own numbers ("#N" in its reports): the all-gather of the sizes before
    // all_gather_bytes' payload counts there too.
    CHECK(e[2].backend_sequence + 2 == e[3].backend_sequence);
    CHECK(e[1].backend_sequence + 1 == e[2].backend_sequence);
  }
  for (const auto& entry : e) {
    INFO(entry.kind);
    CHECK(entry.state == fr::State::kCompleted);
    CHECK(entry.finished_ns >= entry.issued_ns);
    // Through the progress engine (more than one rank): started once the size check passed.
    if (W > 1) CHECK(entry.started_ns >= entry.issued_ns);
    if (W > 1) CHECK(entry.finished_ns >= entry.started_ns);
  }
}

FSDP_RANKS_TEST_CASE("flight recorder: point-to-point operations have counters of their own",
                     "[flight_recorder][mpi]") {
  const int W = world_size();
  if (W < 2) return;
  auto comm = fresh_comm();
  const uint64_t before = last_id();
  at::Tensor t = at::arange(6, at::kFloat);
  if (rank() == 0) {
    comm->send(t, 1, 5, "activations").wait();
    comm->send(t, 1, 5, "activations").wait();
    comm->send(t, 1, 6, "grads").wait();
  } else if (rank() == 1) {
    comm->recv(t, 0, 5, "activations").wait();
    comm->recv(t, 0, 5, "activations").wait();
    comm->recv(t, 0, 6, "grads").wait();
  }
  CHECK(comm->sequence_number() == 0);  // point-to-point does not count there
  const auto e = entries_of(*comm, before);
  if (rank() > 1) {
    CHECK(e.empty());
    return;
  }
  REQUIRE(e.size() == 3);
  for (size_t i = 0; i < 3; ++i) {
    CHECK(e[i].point_to_point);
    CHECK(e[i].kind == (rank() == 0 ? "send" : "recv"));
    CHECK(e[i].sequence == i + 1);
    CHECK(e[i].peer == 1 - rank());
    CHECK(e[i].state == fr::State::kCompleted);
    CHECK(e[i].dtype == "Float");
  }
  CHECK(e[0].tag == 5);
  CHECK(e[0].channel_sequence == 1);
  CHECK(e[1].channel_sequence == 2);
  CHECK(e[2].tag == 6);
  CHECK(e[2].channel_sequence == 1);
  CHECK(e[2].label == "grads");
}

FSDP_RANKS_TEST_CASE("flight recorder: a collective the size check refuses is failed on every rank, with the error",
                     "[flight_recorder][mpi]") {
  const int W = world_size();
  if (W < 2) return;
  auto comm = fresh_comm();
  const uint64_t before = last_id();
  const int64_t count = rank() == W - 1 ? 5 : 4;
  at::Tensor t = at::ones({count});
  CHECK_THROWS(comm->all_reduce(t, c10d::ReduceOp::SUM, "skipped").wait());
  const auto e = entries_of(*comm, before);
  REQUIRE(e.size() == 1);
  CHECK(e[0].state == fr::State::kFailed);
  CHECK(e[0].started_ns == 0);  // refused before it started
  CHECK_THAT(e[0].error, Contains("issued different collectives"));
  CHECK(e[0].input_elements == count);
}

FSDP_RANKS_TEST_CASE("flight recorder: every rank's dump parses and names its rank", "[flight_recorder][mpi]") {
  fr::reset_for_testing(fr::kDefaultEntries, fsdp::testing::shared_tmpdir() + "/flight_recorder");
  auto comm = fresh_comm();
  comm->all_reduce(at::ones({2})).wait();
  const std::string path = fr::dump("flight_recorder_mpi_test");
  REQUIRE(!path.empty());
  CHECK_THAT(path, Contains("flight_recorder.rank" + std::to_string(rank()) + ".json"));
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  const auto j = nlohmann::json::parse(text.str());
  CHECK(j["rank"] == rank());
  CHECK(j["reason"] == "flight_recorder_mpi_test");
  REQUIRE(!j["entries"].empty());
  const auto& last = j["entries"].back();
  CHECK(last["kind"] == "all_reduce");
  CHECK(last["state"] == "completed");
  CHECK(last["comm_size"] == world_size());
}

FSDP_RANKS_TEST_CASE("flight recorder: cost per collective (recorder on and off)",
                     "[flight_recorder][mpi][benchmark]") {
  if (rank() != 0) return;
  // A backend whose collectives complete at once: what is measured is the Communicator's own work
  // per collective (counters, issuing API, the recorder), not a transport's latency.
  fsdp::comm::Communicator comm(c10::make_intrusive<InstantBackend>(), at::kCPU);
  at::Tensor t = at::ones({1});
  constexpr int kCollectives = 100000;
  auto run = [&] {
    fsdp::comm::IssuingApi api("fsdp::fully_shard forward");
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < kCollectives; ++i) comm.all_reduce(t, c10d::ReduceOp::SUM, "layers.11").wait();
    return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count() /
           kCollectives;
  };
  double on = 1e18, off = 1e18;
  for (int round = 0; round < 5; ++round) {
    fr::reset_for_testing(0);
    off = std::min(off, run());
    fr::reset_for_testing(fr::kDefaultEntries);
    on = std::min(on, run());
  }
  std::printf("flight recorder: Communicator::all_reduce(...).wait() on a backend that completes at once: %.0f ns "
              "with the recorder, %.0f ns without: %.0f ns per collective (best of 5 x %d)\n", on, off, on - off,
              kCollectives);
  CHECK(fr::entries().back().state == fr::State::kCompleted);
  CHECK(fr::entries().back().label == "layers.11");
}
