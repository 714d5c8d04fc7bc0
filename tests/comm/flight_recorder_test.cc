// The flight recorder's ring on its own (no MPI, no LibTorch): bounded, wraps, keeps every field,
// states only go forward, strings truncated at a character boundary, the dump is JSON that parses
// (from dump() and from the signal handlers: SIGUSR1 in-process, SIGTERM in a child that dies of
// it), off with 0 entries; and the cost of one record (issue + completion), printed.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "fsdp_cpp/comm/flight_recorder.h"

#include <catch2/catch.hpp>

namespace {

namespace fr = fsdp::comm::flight_recorder;
using Catch::Matchers::Contains;
using Catch::Matchers::EndsWith;

std::string fresh_dir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  const std::filesystem::path dir =
      std::filesystem::path(base != nullptr ? base : "/tmp") / ("fr_" + name + "_" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  return dir.string();
}

fr::Issue collective(uint64_t seq, const char* label = "blocks.0") {
  fr::Issue issue;
  issue.comm_name = "world";
  issue.comm_size = 4;
  issue.comm_rank = 1;
  issue.world_rank = 1;
  issue.world_ranks = "[0,1,2,3]";
  issue.sequence = seq;
  issue.kind = "all_gather_into_tensor";
  issue.label = label;
  issue.api = "fsdp::fully_shard forward";
  issue.dtype = "Float";
  issue.input_elements = 16;
  issue.output_elements = 64;
  issue.bytes = 256;
  return issue;
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  REQUIRE(in.good());
  std::stringstream text;
  text << in.rdbuf();
  return nlohmann::json::parse(text.str());
}

}  // namespace

TEST_CASE("flight recorder: the ring is bounded and keeps the newest entries", "[flight_recorder]") {
  fr::reset_for_testing(4, fresh_dir("ring"));
  REQUIRE(fr::enabled());
  CHECK(fr::capacity() == 4);
  for (uint64_t seq = 1; seq <= 10; ++seq) CHECK(fr::record_issue(collective(seq)) == seq);
  CHECK(fr::recorded() == 10);
  const auto kept = fr::entries();
  REQUIRE(kept.size() == 4);
  for (size_t i = 0; i < kept.size(); ++i) {
    CHECK(kept[i].id == 7 + i);
    CHECK(kept[i].sequence == 7 + i);
    CHECK(kept[i].state == fr::State::kIssued);
  }
  const auto& e = kept.back();
  CHECK(e.comm_name == "world");
  CHECK(e.comm_size == 4);
  CHECK(e.comm_rank == 1);
  CHECK(e.world_rank == 1);
  CHECK(e.world_ranks == "[0,1,2,3]");
  CHECK(e.kind == "all_gather_into_tensor");
  CHECK(e.label == "blocks.0");
  CHECK(e.api == "fsdp::fully_shard forward");
  CHECK(e.dtype == "Float");
  CHECK(e.input_elements == 16);
  CHECK(e.output_elements == 64);
  CHECK(e.bytes == 256);
  CHECK_FALSE(e.point_to_point);
  CHECK(e.issued_ns > 1600000000LL * 1000000000LL);  // wall clock
  CHECK(e.started_ns == 0);
  CHECK(e.finished_ns == 0);
}

TEST_CASE("flight recorder: states go forward only; overwritten entries are not touched", "[flight_recorder]") {
  fr::reset_for_testing(4, fresh_dir("states"));
  for (uint64_t seq = 1; seq <= 6; ++seq) fr::record_issue(collective(seq));
  fr::record_completed(1);  // overwritten by entry 5: ignored
  fr::record_started(6);
  fr::record_completed(6);
  fr::record_started(6);  // after the completion: ignored
  fr::record_completed(5);
  fr::record_failed(4, "MPI backend allreduce #4: the ranks of the group issued different collectives");
  fr::record_completed(4);  // a failure stays
  const auto kept = fr::entries();
  REQUIRE(kept.size() == 4);
  CHECK(kept[0].sequence == 3);
  CHECK(kept[0].state == fr::State::kIssued);
  CHECK(kept[1].state == fr::State::kFailed);
  CHECK_THAT(kept[1].error, Contains("issued different collectives"));
  CHECK(kept[1].finished_ns > 0);
  CHECK(kept[2].state == fr::State::kCompleted);
  CHECK(kept[2].started_ns == 0);
  CHECK(kept[3].state == fr::State::kCompleted);
  CHECK(kept[3].started_ns > 0);
  CHECK(kept[3].finished_ns >= kept[3].started_ns);
}

TEST_CASE("flight recorder: point-to-point fields, truncation at a character boundary", "[flight_recorder]") {
  fr::reset_for_testing(8, fresh_dir("p2p"));
  fr::Issue issue;
  issue.comm_name = "world/pp group 0";
  issue.comm_size = 3;
  issue.comm_rank = 2;
  issue.point_to_point = true;
  issue.sequence = 5;
  issue.kind = "recv";
  issue.peer = 1;
  issue.tag = 7;
  issue.channel_sequence = 3;
  // 200 two-byte characters: longer than the label's room, cut between two characters.
  std::string label;
  for (int i = 0; i < 200; ++i) label += "\xc3\xa9";
  issue.label = label.c_str();
  fr::record_issue(issue);
  const auto e = fr::entries().at(0);
  CHECK(e.point_to_point);
  CHECK(e.kind == "recv");
  CHECK(e.peer == 1);
  CHECK(e.tag == 7);
  CHECK(e.channel_sequence == 3);
  CHECK(e.world_rank == -1);
  CHECK(e.world_ranks.empty());
  CHECK(!e.label.empty());
  CHECK(e.label.size() < label.size());
  CHECK(e.label.size() % 2 == 0);
  CHECK(label.compare(0, e.label.size(), e.label) == 0);
}

TEST_CASE("flight recorder: dump() writes one JSON file per rank that parses", "[flight_recorder]") {
  const std::string dir = fresh_dir("dump");
  fr::reset_for_testing(3, dir);
  fr::set_rank(2);  // as the Communicator does from its world ranks
  fr::record_issue(collective(1));
  fr::record_completed(1);
  fr::record_issue(collective(2, "a \"quoted\"\nlabel\twith\\escapes"));
  fr::record_started(2);
  fr::record_issue(collective(3));
  fr::record_failed(3, "boom: \"x\"");
  fr::record_issue(collective(4));  // wraps: entry 1 goes
  const std::string path = fr::dump("the first reason");
  CHECK(path == dir + "/flight_recorder.rank2.json");
  CHECK(fr::dump_path() == path);
  nlohmann::json j = read_json(path);
  CHECK(j["version"] == 1);
  CHECK(j["rank"] == 2);
  CHECK(j["reason"] == "the first reason");
  CHECK(j["capacity"] == 3);
  CHECK(j["recorded"] == 4);
  CHECK(j["earlier_reasons"].empty());
  REQUIRE(j["entries"].size() == 3);
  const auto& e2 = j["entries"][0];
  CHECK(e2["seq"] == 2);
  CHECK(e2["label"] == "a \"quoted\"\nlabel\twith\\escapes");
  CHECK(e2["state"] == "started");
  CHECK(e2["comm"] == "world");
  CHECK(e2["world_ranks"] == nlohmann::json::array({0, 1, 2, 3}));
  CHECK(e2["world_rank"] == 1);
  CHECK(e2["op"] == "collective");
  CHECK(e2["kind"] == "all_gather_into_tensor");
  CHECK(e2["dtype"] == "Float");
  CHECK(e2["input_elements"] == 16);
  CHECK(e2["output_elements"] == 64);
  CHECK(e2["api"] == "fsdp::fully_shard forward");
  CHECK(e2["started_ns"].get<int64_t>() >= e2["issued_ns"].get<int64_t>());
  CHECK(j["entries"][1]["state"] == "failed");
  CHECK(j["entries"][1]["error"] == "boom: \"x\"");
  CHECK(j["entries"][2]["state"] == "issued");
  CHECK(j["entries"][2]["finished_ns"] == 0);
  // A second dump replaces the file and lists the first one's reason.
  fr::dump("the second reason");
  j = read_json(path);
  CHECK(j["reason"] == "the second reason");
  CHECK(j["earlier_reasons"] == nlohmann::json::array({"the first reason"}));
  // to_json is what dump() writes.
  CHECK(nlohmann::json::parse(fr::to_json("text"))["entries"].size() == 3);
}

TEST_CASE("flight recorder: SIGUSR1 dumps and the process goes on", "[flight_recorder]") {
  if (std::getenv("FSDP_FLIGHT_RECORDER_SIGNALS") != nullptr) return;
  const std::string dir = fresh_dir("usr1");
  fr::reset_for_testing(16, dir);
  fr::set_rank(2);
  for (uint64_t seq = 1; seq <= 20; ++seq) fr::record_issue(collective(seq));
  raise(SIGUSR1);
  const nlohmann::json j = read_json(dir + "/flight_recorder.rank2.json");
  CHECK(j["reason"] == "signal SIGUSR1 (dump on request)");
  REQUIRE(j["entries"].size() == 16);
  CHECK(j["entries"][0]["seq"] == 5);
  CHECK(j["entries"][15]["seq"] == 20);
}

TEST_CASE("flight recorder: SIGTERM dumps, then the process dies of it", "[flight_recorder]") {
  const std::string dir = fresh_dir("term");
  fr::reset_for_testing(16, dir);
  fr::set_rank(2);
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // The default action behind ours, not the test framework's handler.
    signal(SIGTERM, SIG_DFL);
    fr::reset_for_testing(16, dir);
    fr::set_rank(2);
    fr::record_issue(collective(1));
    fr::record_issue(collective(2));
    raise(SIGTERM);
    _exit(0);  // not reached
  }
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  CHECK(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGTERM);
  const nlohmann::json j = read_json(dir + "/flight_recorder.rank2.json");
  CHECK(j["reason"] == "signal SIGTERM");
  CHECK(j["pid"] == child);
  REQUIRE(j["entries"].size() == 2);
  CHECK(j["entries"][1]["seq"] == 2);
}

TEST_CASE("flight recorder: 0 entries turns it off", "[flight_recorder]") {
  fr::reset_for_testing(0, fresh_dir("off"));
  CHECK_FALSE(fr::enabled());
  CHECK(fr::record_issue(collective(1)) == 0);
  fr::record_completed(1);
  CHECK(fr::entries().empty());
  CHECK(fr::dump("nothing").empty());
  fr::reset_for_testing(fr::kDefaultEntries);
}

TEST_CASE("flight recorder: cost of one record (issue and completion)", "[flight_recorder][benchmark]") {
  fr::reset_for_testing(fr::kDefaultEntries, fresh_dir("cost"));
  constexpr int kRecords = 100000;
  fr::Issue issue = collective(0);
  issue.api = "fsdp::fully_shard > FSDPState::pre_forward 'layers.11'";
  double best = 1e9;
  for (int round = 0; round < 3; ++round) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < kRecords; ++i) {
      issue.sequence = static_cast<uint64_t>(i);
      fr::record_completed(fr::record_issue(issue));
    }
    const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
    best = std::min(best, ns / kRecords);
  }
  std::printf("flight recorder: %.1f ns per record (record_issue + record_completed, best of 3 x %d)\n", best,
              kRecords);
  CHECK(fr::entries().size() == static_cast<size_t>(fr::kDefaultEntries));
  CHECK(best < 20000.0);  // generous: sanitizers and a loaded 2-core machine
}
