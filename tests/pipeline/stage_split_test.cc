// pipeline/stage_split.h: the even split, the checks of explicit ranges (each error names the
// stage, what was expected and what was found) and the looped placement of stages on ranks.
#include "fsdp_cpp/pipeline/stage_split.h"

#include <string>
#include <vector>

#include "fsdp_cpp/tests/testing/errors.h"

// Catch2 last: c10/util/Logging.h defines a CHECK macro of its own, and the last definition wins.
#include <catch2/catch.hpp>

namespace {

using Catch::Matchers::Contains;
using fsdp::pipeline::BlockRange;
using fsdp::pipeline::check_split;
using fsdp::pipeline::rank_of_stage;
using fsdp::pipeline::split_blocks_evenly;
using fsdp::pipeline::stages_of_rank;
using fsdp::testing::error_of;
using fsdp::testing::kNoError;

std::vector<int64_t> sizes_of(const std::vector<BlockRange>& ranges) {
  std::vector<int64_t> out;
  for (const BlockRange& r : ranges) out.push_back(r.size());
  return out;
}

TEST_CASE("split_blocks_evenly: equal counts, the first stages take the extra blocks", "[pipeline][split]") {
  CHECK(split_blocks_evenly(4, 1) == std::vector<BlockRange>{{0, 4}});
  CHECK(split_blocks_evenly(4, 2) == std::vector<BlockRange>{{0, 2}, {2, 4}});
  CHECK(split_blocks_evenly(4, 4) == std::vector<BlockRange>{{0, 1}, {1, 2}, {2, 3}, {3, 4}});
  CHECK(split_blocks_evenly(5, 3) == std::vector<BlockRange>{{0, 2}, {2, 4}, {4, 5}});
  CHECK(split_blocks_evenly(10, 4) == std::vector<BlockRange>{{0, 3}, {3, 6}, {6, 8}, {8, 10}});
  CHECK(split_blocks_evenly(7, 7) == split_blocks_evenly(7, 7));
  // Every split of n blocks over s stages: sizes differ by at most one, larger ones first, and
  // the ranges pass check_split.
  for (int64_t n = 1; n <= 13; ++n) {
    for (int64_t s = 1; s <= n; ++s) {
      INFO(n << " blocks over " << s << " stages");
      const auto ranges = split_blocks_evenly(n, s);
      REQUIRE(static_cast<int64_t>(ranges.size()) == s);
      const auto sizes = sizes_of(ranges);
      for (int64_t i = 0; i < s; ++i) {
        CHECK(sizes[static_cast<size_t>(i)] == n / s + (i < n % s ? 1 : 0));
      }
      CHECK(error_of([&] { check_split(ranges, n); }) == kNoError);
    }
  }
}

TEST_CASE("split_blocks_evenly: refuses no stages and fewer blocks than stages", "[pipeline][split]") {
  CHECK_THAT(error_of([] { split_blocks_evenly(4, 0); }),
             Contains("split_blocks_evenly") && Contains("n_stages >= 1") && Contains("got 0"));
  CHECK_THAT(error_of([] { split_blocks_evenly(3, 4); }),
             Contains("split_blocks_evenly") && Contains("3 blocks for 4 stages"));
}

TEST_CASE("check_split: accepts contiguous covers, and empty stages only when allowed", "[pipeline][split]") {
  CHECK(error_of([] { check_split({{0, 1}, {1, 5}, {5, 6}}, 6); }) == kNoError);
  CHECK(error_of([] { check_split({{0, 6}}, 6); }) == kNoError);
  CHECK(error_of([] { check_split({{0, 0}, {0, 3}, {3, 3}}, 3, /*allow_empty_stages=*/true); }) == kNoError);
  CHECK_THAT(error_of([] { check_split({{0, 2}, {2, 2}, {2, 4}}, 4); }),
             Contains("check_split: stage 1 of 3") && Contains("expected at least one block") &&
                 Contains("empty range [2, 2)") && Contains("allow_empty_stages"));
}

TEST_CASE("check_split: errors name the stage, what was expected and what was found", "[pipeline][split]") {
  SECTION("no stage") {
    CHECK_THAT(error_of([] { check_split({}, 4); }),
               Contains("check_split") && Contains("at least one stage") && Contains("n_stages >= 1"));
  }
  SECTION("a block left out between two stages") {
    CHECK_THAT(error_of([] { check_split({{0, 2}, {3, 4}}, 4); }),
               Contains("check_split: stage 1 of 2") && Contains("expected it to begin at block 2") &&
                   Contains("found [3, 4)") && Contains("block 2 is left out"));
    CHECK_THAT(error_of([] { check_split({{0, 1}, {4, 6}}, 6); }),
               Contains("stage 1 of 2") && Contains("blocks 1 .. 3 are left out"));
  }
  SECTION("blocks left out before the first stage and after the last") {
    CHECK_THAT(error_of([] { check_split({{1, 4}}, 4); }),
               Contains("stage 0 of 1") && Contains("begin at block 0") && Contains("found [1, 4)") &&
                   Contains("block 0 is left out"));
    CHECK_THAT(error_of([] { check_split({{0, 2}, {2, 3}}, 5); }),
               Contains("stage 1 of 2 (the last)") && Contains("expected it to end at block 5") &&
                   Contains("found [2, 3)") && Contains("blocks 3 .. 4 are left out"));
  }
  SECTION("a block used twice") {
    CHECK_THAT(error_of([] { check_split({{0, 3}, {2, 4}}, 4); }),
               Contains("check_split: stage 1 of 2") && Contains("expected it to begin at block 3") &&
                   Contains("found [2, 4)") && Contains("block 2 is used twice (also held by stage 0)"));
    CHECK_THAT(error_of([] { check_split({{0, 2}, {2, 4}, {1, 6}}, 6); }),
               Contains("stage 2 of 3") && Contains("blocks 1 .. 3 are used twice") &&
                   Contains("also held by stages 0 .. 1"));
  }
  SECTION("stages out of order") {
    CHECK_THAT(error_of([] { check_split({{2, 4}, {0, 2}}, 4); }),
               Contains("stage 0 of 2") && Contains("blocks 0 .. 1 are left out"));
  }
  SECTION("a reversed range") {
    CHECK_THAT(error_of([] { check_split({{0, 2}, {4, 2}}, 4); }),
               Contains("check_split: stage 1 of 2") && Contains("begin <= end") &&
                   Contains("reversed range [4, 2)"));
    CHECK_THAT(error_of([] { check_split({{0, 2}, {4, 2}}, 4, /*allow_empty_stages=*/true); }),
               Contains("reversed range [4, 2)"));
  }
  SECTION("a range outside the model's blocks") {
    CHECK_THAT(error_of([] { check_split({{0, 2}, {2, 5}}, 4); }),
               Contains("stage 1 of 2") && Contains("within [0, 4)") && Contains("found [2, 5)"));
    CHECK_THAT(error_of([] { check_split({{-1, 2}, {2, 4}}, 4); }),
               Contains("stage 0 of 2") && Contains("found [-1, 2)"));
  }
}

TEST_CASE("stages_of_rank and rank_of_stage: the looped placement", "[pipeline][split]") {
  CHECK(stages_of_rank(0, 1, 1) == std::vector<int>{0});
  CHECK(stages_of_rank(0, 1, 3) == std::vector<int>{0, 1, 2});
  CHECK(stages_of_rank(1, 2, 4) == std::vector<int>{1, 3});
  CHECK(stages_of_rank(2, 4, 8) == std::vector<int>{2, 6});
  CHECK(stages_of_rank(3, 4, 4) == std::vector<int>{3});
  // Every stage on exactly one rank, the one rank_of_stage names.
  for (int p = 1; p <= 4; ++p) {
    for (int v = 1; v <= 3; ++v) {
      std::vector<int> owner(static_cast<size_t>(p * v), -1);
      for (int r = 0; r < p; ++r) {
        for (int s : stages_of_rank(r, p, p * v)) {
          CHECK(owner[static_cast<size_t>(s)] == -1);
          owner[static_cast<size_t>(s)] = r;
          CHECK(rank_of_stage(s, p) == r);
        }
      }
      for (int o : owner) CHECK(o >= 0);
    }
  }
}

TEST_CASE("stages_of_rank and rank_of_stage: refused values are named", "[pipeline][split]") {
  CHECK_THAT(error_of([] { stages_of_rank(0, 2, 3); }),
             Contains("stages_of_rank") && Contains("multiple of pp_size") && Contains("n_stages 3") &&
                 Contains("pp_size 2"));
  CHECK_THAT(error_of([] { stages_of_rank(0, 2, 0); }), Contains("n_stages 0"));
  CHECK_THAT(error_of([] { stages_of_rank(2, 2, 4); }),
             Contains("stages_of_rank") && Contains("pp_rank < pp_size = 2") && Contains("got pp_rank 2"));
  CHECK_THAT(error_of([] { stages_of_rank(0, 0, 4); }), Contains("pp_size >= 1"));
  CHECK_THAT(error_of([] { rank_of_stage(-1, 2); }), Contains("rank_of_stage") && Contains("stage >= 0"));
  CHECK_THAT(error_of([] { rank_of_stage(1, 0); }), Contains("rank_of_stage") && Contains("pp_size >= 1"));
}

}  // namespace
