// Communicator::world_ranks() on the groups DeviceMesh makes, and agree_on_error /
// throw_if_any_error ([Note: error agreement] in comm/agreement.h) on 1-4 ranks: an error on any
// one rank reaches every rank with the same text, over one group and over the two dimensions of a
// 2x2 mesh; several errors give the lowest world rank's on every rank; no error gives nullopt;
// null and one-rank groups are skipped without communicating.
#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

#include "fsdp_cpp/comm/agreement.h"
#include "fsdp_cpp/comm/device_mesh.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::testing::fresh_comm;
using fsdp::testing::rank;
using fsdp::testing::same_on_every_rank;
using fsdp::testing::world;
using fsdp::testing::world_size;

std::vector<int> iota(int n, int start = 0, int step = 1) {
  std::vector<int> v(n);
  for (int i = 0; i < n; ++i) v[i] = start + i * step;
  return v;
}

// A communicator over the world that knows its world ranks (as init_process_group's).
std::shared_ptr<fsdp::comm::Communicator> world_with_ranks() {
  auto comm = fresh_comm();
  comm->set_world_ranks(iota(world_size()));
  return comm;
}

int64_t exchanges(const fsdp::comm::Communicator& comm) {
  return comm.stats(fsdp::comm::CollectiveKind::kAllGatherBytes).calls;
}

}  // namespace

FSDP_RANKS_TEST_CASE("world_ranks: unknown for a communicator made from a backend; the setter checks its input", "[comm][world_ranks]") {
  const int W = world_size();
  auto comm = fresh_comm();
  CHECK(!comm->world_ranks().has_value());
  CHECK(!comm->world_rank().has_value());
  CHECK_THROWS_WITH(comm->set_world_ranks(iota(W + 1)),
                    Contains("set_world_ranks") && Contains("expected " + std::to_string(W) + " world ranks") &&
                        Contains("found " + std::to_string(W + 1)));
  if (W >= 2) {
    std::vector<int> twice(W, 0);
    CHECK_THROWS_WITH(comm->set_world_ranks(twice), Contains("expected distinct world ranks"));
  }
  std::vector<int> negative = iota(W);
  negative[0] = -1;
  CHECK_THROWS_WITH(comm->set_world_ranks(negative), Contains("expected non-negative world ranks"));
  CHECK(!comm->world_ranks().has_value());
  comm->set_world_ranks(iota(W, 10));
  CHECK(comm->world_ranks() == iota(W, 10));
  CHECK(comm->world_rank() == 10 + rank());
}

FSDP_RANKS_TEST_CASE("world_ranks: every group of a mesh (create, hybrid, flattened_group, submesh) from the row-major layout", "[comm][world_ranks]") {
  const int W = world_size(), r = rank();
  // A mesh over a communicator that does not know its world ranks numbers them in it.
  auto line = fsdp::comm::DeviceMesh::create(world(), {W}, {"dp"});
  CHECK(line->group("dp")->world_ranks() == iota(W));
  CHECK(line->group("dp")->world_rank() == r);

  auto world_comm = world_with_ranks();
  for (int shard = 1; shard <= W; ++shard) {
    if (W % shard != 0) continue;
    INFO("hybrid mesh with shard size " << shard);
    auto mesh = fsdp::comm::DeviceMesh::hybrid(*world_comm, shard);
    // Shard group r / S: ranks S*(r/S) .. S*(r/S)+S-1; replicate group r % S: r % S, r % S + S, ...
    CHECK(mesh->shard_group()->world_ranks() == iota(shard, shard * (r / shard)));
    CHECK(mesh->replicate_group()->world_ranks() == iota(W / shard, r % shard, shard));
    CHECK(mesh->flattened_group({"replicate", "shard"})->world_ranks() == iota(W));
    // Flattened in the other order: ranked row-major over (shard, replicate).
    std::vector<int> transposed;
    for (int s = 0; s < shard; ++s) {
      for (int q = 0; q < W / shard; ++q) transposed.push_back(q * shard + s);
    }
    CHECK(mesh->flattened_group({"shard", "replicate"})->world_ranks() == transposed);
    auto sub = mesh->submesh({"shard"});
    CHECK(sub->group("shard")->world_ranks() == iota(shard, shard * (r / shard)));
    CHECK(sub->group("shard") == mesh->group("shard"));
  }
  if (W == 4) {
    // (a, b, c) = (1, 2, 2): b groups {r with the same a, c}, c groups {consecutive pairs}.
    auto mesh = fsdp::comm::DeviceMesh::create(*world_comm, {1, 2, 2}, {"a", "b", "c"});
    CHECK(mesh->group("a")->world_ranks() == std::vector<int>{r});
    CHECK(mesh->group("b")->world_ranks() == iota(2, r % 2, 2));
    CHECK(mesh->group("c")->world_ranks() == iota(2, 2 * (r / 2)));
    CHECK(mesh->flattened_group({"c", "b"})->world_ranks() == std::vector<int>({0, 2, 1, 3}));
    CHECK(mesh->submesh({"c", "b"})->flattened_group({"b", "c"})->world_ranks() == iota(4));
    // A mesh over a group maps its ranks to the world through the group's own world ranks: the
    // (x) mesh over the c group {2, 3} of rank 2 or 3 knows ranks 2 and 3.
    auto inner = fsdp::comm::DeviceMesh::create(*mesh->group("c"), {2}, {"x"});
    CHECK(inner->group("x")->world_ranks() == iota(2, 2 * (r / 2)));
  }
}

FSDP_RANKS_TEST_CASE("agree_on_error: no error on any rank gives nullopt on every rank", "[comm][agreement]") {
  auto comm = world_with_ranks();
  CHECK(!fsdp::comm::agree_on_error({comm}, std::nullopt, "test_api").has_value());
  CHECK_NOTHROW(fsdp::comm::throw_if_any_error({comm}, std::nullopt, "test_api"));
  CHECK(exchanges(*comm) == (world_size() > 1 ? 2 : 0));
}

FSDP_RANKS_TEST_CASE("agree_on_error: an error on one rank reaches every rank with the same text", "[comm][agreement]") {
  const int W = world_size(), r = rank();
  for (bool known : {true, false}) {
    auto comm = known ? world_with_ranks() : fresh_comm();
    for (int bad = 0; bad < W; ++bad) {
      INFO("error on rank " << bad << ", world ranks " << (known ? "known" : "unknown"));
      std::optional<std::string> mine;
      if (r == bad) mine = "the batch has 7 rows, expected 8";
      const auto agreed = fsdp::comm::agree_on_error({comm}, mine, "test_api");
      REQUIRE(agreed.has_value());
      CHECK(*agreed == "test_api: " + std::string(known ? "rank " : "group rank ") + std::to_string(bad) +
                           ": the batch has 7 rows, expected 8");
      CHECK(same_on_every_rank(*agreed));
      // throw_if_any_error: the same c10::Error on every rank; an "<api>: " prefix is not repeated.
      if (r == bad) mine = "test_api: the batch has 7 rows, expected 8";
      std::string thrown;
      try {
        fsdp::comm::throw_if_any_error({comm}, mine, "test_api");
      } catch (const c10::Error& e) {
        thrown = e.what_without_backtrace();
      }
      CHECK(thrown == *agreed);
      CHECK(same_on_every_rank(thrown));
    }
  }
}

FSDP_RANKS_TEST_CASE("agree_on_error: several errors give the lowest world rank's on every rank", "[comm][agreement]") {
  const int W = world_size(), r = rank();
  if (W < 2) return;  // needs two ranks with errors
  // World ranks in reverse order: the lowest world rank is the last group rank.
  auto comm = fresh_comm();
  std::vector<int> reversed(W);
  for (int g = 0; g < W; ++g) reversed[g] = W - 1 - g;
  comm->set_world_ranks(reversed);
  std::optional<std::string> mine;
  if (r == 0 || r == W - 1) mine = "error of group rank " + std::to_string(r);
  const auto agreed = fsdp::comm::agree_on_error({comm}, mine, "test_api");
  REQUIRE(agreed.has_value());
  // Group rank W-1 is world rank 0.
  CHECK_THAT(*agreed, Contains("test_api: rank 0: error of group rank " + std::to_string(W - 1)) &&
                          Contains("errors were also found on rank " + std::to_string(W - 1)));
  CHECK(same_on_every_rank(*agreed));
  // Without world ranks: the smallest message, the same on every rank.
  auto plain = fresh_comm();
  const auto by_content = fsdp::comm::agree_on_error({plain}, mine, "test_api");
  REQUIRE(by_content.has_value());
  CHECK_THAT(*by_content, Contains("test_api: group rank 0: error of group rank 0"));
  CHECK(same_on_every_rank(*by_content));
}

FSDP_RANKS_TEST_CASE("agree_on_error over a 2x2 mesh's groups: an error on one rank reaches all four", "[comm][agreement][mesh]") {
  if (world_size() != 4) return;  // the 2x2 mesh
  const int r = rank();
  auto mesh = fsdp::comm::DeviceMesh::create(*world_with_ranks(), {2, 2}, {"dp", "tp"});
  for (int bad = 0; bad < 4; ++bad) {
    INFO("error on rank " << bad);
    std::optional<std::string> mine;
    if (r == bad) mine = "module 'blocks.1.mlp.fc' not found";
    // Each group alone reaches only its members: the tp group of rank `bad` learns, the rest not.
    const auto tp_only = fsdp::comm::agree_on_error({mesh->group("tp")}, mine, "test_api");
    CHECK(tp_only.has_value() == (r / 2 == bad / 2));
    // tp then dp: every rank.
    const auto agreed = fsdp::comm::agree_on_error({mesh->group("tp"), mesh->group("dp")}, mine, "test_api");
    REQUIRE(agreed.has_value());
    CHECK(*agreed == "test_api: rank " + std::to_string(bad) + ": module 'blocks.1.mlp.fc' not found");
    CHECK(same_on_every_rank(*agreed));
    // dp then tp: the same.
    CHECK(fsdp::comm::agree_on_error({mesh->group("dp"), mesh->group("tp")}, mine, "test_api") == agreed);
  }
  // Errors on ranks 3 and 1 (tp groups {0,1} and {2,3}): rank 1's on every rank.
  std::optional<std::string> mine;
  if (r == 3 || r == 1) mine = "found on " + std::to_string(r);
  const auto agreed = fsdp::comm::agree_on_error({mesh->group("tp"), mesh->group("dp")}, mine, "test_api");
  REQUIRE(agreed.has_value());
  CHECK(*agreed == "test_api: rank 1: found on 1 (errors were also found on rank 3; the lowest rank's is shown)");
  CHECK(same_on_every_rank(*agreed));
  // No error: nullopt on all four.
  CHECK(!fsdp::comm::agree_on_error({mesh->group("tp"), mesh->group("dp")}, std::nullopt, "test_api").has_value());
}

FSDP_RANKS_TEST_CASE("agree_on_error: null and one-rank groups are skipped without communicating", "[comm][agreement]") {
  auto comm = world_with_ranks();
  auto single = fsdp::comm::DeviceMesh::create(*comm, {world_size(), 1}, {"dp", "one"})->group("one");
  single->reset_stats();
  comm->reset_stats();
  const auto agreed = fsdp::comm::agree_on_error({nullptr, single}, std::string("local problem"), "test_api");
  CHECK(agreed == "test_api: rank " + std::to_string(rank()) + ": local problem");
  CHECK(!fsdp::comm::agree_on_error({nullptr, single}, std::nullopt, "test_api").has_value());
  CHECK(exchanges(*single) == 0);
  CHECK(exchanges(*comm) == 0);
  CHECK(!fsdp::comm::agree_on_error({}, std::nullopt, "test_api").has_value());
  CHECK(fsdp::comm::agree_on_error({}, std::string("alone"), "test_api") == "test_api: this rank: alone");
}
