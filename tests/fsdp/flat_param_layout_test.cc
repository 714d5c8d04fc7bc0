// FlatParameter layout: exact numbers for alignment, padding and per-rank slices.
#include "fsdp_cpp/fsdp/flat_param_layout.h"

// Last: LibTorch's c10/util/Logging.h defines its own CHECK, and the last definition wins.
#include <catch2/catch.hpp>

using fsdp::FlatParamInput;
using fsdp::make_flat_param_layout;

namespace {

// Three bias-free Linears (3->7, 7->5, 5->5): weights [7,3], [5,7], [5,5].
std::vector<FlatParamInput> three_linears() {
  return {{"0.weight", {7, 3}}, {"1.weight", {5, 7}}, {"2.weight", {5, 5}}};
}

}  // namespace

TEST_CASE("fp32 parameters start on 16-byte boundaries", "[fsdp][layout]") {
  const auto layout = make_flat_param_layout(three_linears(), at::kFloat, 1);
  REQUIRE(layout.entries.size() == 3);
  CHECK(layout.alignment == 4);
  CHECK(layout.entries[0].offset == 0);
  CHECK(layout.entries[0].numel == 21);
  CHECK(layout.entries[1].offset == 24);  // 3 elements of padding
  CHECK(layout.entries[1].numel == 35);
  CHECK(layout.entries[2].offset == 60);  // 1 element of padding
  CHECK(layout.entries[2].numel == 25);
  CHECK(layout.unpadded_numel == 85);     // 21 + 3 + 35 + 1 + 25
  CHECK(layout.padded_numel == 85);
}

TEST_CASE("two ranks: padded to 86, rank 0 holds 0.weight[0:21] and 1.weight[0:19]", "[fsdp][layout]") {
  const auto layout = make_flat_param_layout(three_linears(), at::kFloat, 2);
  CHECK(layout.padded_numel == 86);
  CHECK(layout.shard_numel() == 43);
  const auto r0 = layout.slices_for_rank(0);
  REQUIRE(r0.size() == 2);
  CHECK((r0[0].entry == 0 && r0[0].param_begin == 0 && r0[0].param_end == 21 && r0[0].shard_offset == 0));
  CHECK((r0[1].entry == 1 && r0[1].param_begin == 0 && r0[1].param_end == 19 && r0[1].shard_offset == 24));
  const auto r1 = layout.slices_for_rank(1);
  REQUIRE(r1.size() == 2);
  CHECK((r1[0].entry == 1 && r1[0].param_begin == 19 && r1[0].param_end == 35 && r1[0].shard_offset == 0));
  CHECK((r1[1].entry == 2 && r1[1].param_begin == 0 && r1[1].param_end == 25 && r1[1].shard_offset == 17));
}

TEST_CASE("four ranks: padded to 88, rank 2 holds 1.weight[20:35] and 2.weight[0:6]", "[fsdp][layout]") {
  const auto layout = make_flat_param_layout(three_linears(), at::kFloat, 4);
  CHECK(layout.padded_numel == 88);
  CHECK(layout.shard_numel() == 22);
  const auto r2 = layout.slices_for_rank(2);
  REQUIRE(r2.size() == 2);
  CHECK((r2[0].entry == 1 && r2[0].param_begin == 20 && r2[0].param_end == 35 && r2[0].shard_offset == 0));
  CHECK((r2[1].entry == 2 && r2[1].param_begin == 0 && r2[1].param_end == 6 && r2[1].shard_offset == 16));
  // Rank 3 holds the rest of 2.weight and the padding.
  const auto r3 = layout.slices_for_rank(3);
  REQUIRE(r3.size() == 1);
  CHECK((r3[0].entry == 2 && r3[0].param_begin == 6 && r3[0].param_end == 25 && r3[0].shard_offset == 0));
  // Entry 0 is held by rank 0 only.
  CHECK(layout.slice_of(0, 1).size() == 0);
}

TEST_CASE("every element of every parameter is held by exactly one rank", "[fsdp][layout]") {
  for (int W = 1; W <= 8; ++W) {
    const auto layout = make_flat_param_layout(
        {{"a", {3, 3}}, {"b", {1}}, {"c", {0}}, {"d", {2, 5, 3}}, {"e", {1, 1}}}, at::kFloat, W);
    INFO("world size " << W);
    CHECK(layout.padded_numel % W == 0);
    CHECK(layout.padded_numel >= layout.unpadded_numel);
    CHECK(layout.padded_numel - layout.unpadded_numel < W);
    for (int e = 0; e < static_cast<int>(layout.entries.size()); ++e) {
      int64_t covered = 0;
      int64_t next = 0;
      for (int r = 0; r < W; ++r) {
        const auto s = layout.slice_of(e, r);
        if (s.size() == 0) continue;
        CHECK(s.param_begin == next);  // contiguous, in rank order
        next = s.param_end;
        covered += s.size();
        CHECK(s.shard_offset + s.size() <= layout.shard_numel());
        CHECK(r * layout.shard_numel() + s.shard_offset == layout.entries[e].offset + s.param_begin);
      }
      CHECK(covered == layout.entries[e].numel);
    }
  }
}

TEST_CASE("alignment follows the element size", "[fsdp][layout]") {
  const std::vector<FlatParamInput> params = {{"a", {3}}, {"b", {3}}};
  CHECK(make_flat_param_layout(params, at::kDouble, 1).entries[1].offset == 4);   // 2 per 16 bytes
  CHECK(make_flat_param_layout(params, at::kBFloat16, 1).entries[1].offset == 8); // 8 per 16 bytes
  CHECK(make_flat_param_layout(params, at::kFloat, 1).entries[1].offset == 4);
}

TEST_CASE("a parameter smaller than the world size", "[fsdp][layout]") {
  // Linear(3,3) weight and bias plus Linear(1,1) on 4 ranks.
  const auto layout = make_flat_param_layout(
      {{"0.weight", {3, 3}}, {"0.bias", {3}}, {"1.weight", {1, 1}}, {"1.bias", {1}}}, at::kFloat, 4);
  CHECK(layout.entries[1].offset == 12);
  CHECK(layout.entries[2].offset == 16);
  CHECK(layout.entries[3].offset == 20);
  CHECK(layout.unpadded_numel == 21);
  CHECK(layout.padded_numel == 24);
  CHECK(layout.slices_for_rank(3).size() == 1);  // 1.bias
  CHECK(layout.slice_of(3, 3).shard_offset == 2);
  CHECK(layout.slice_of(2, 3).size() == 0);
  CHECK(layout.slice_of(2, 2).size() == 1);
}

TEST_CASE("bad input is a clear error", "[fsdp][layout]") {
  CHECK_THROWS_WITH(make_flat_param_layout({{"a", {2}}}, at::kFloat, 0),
                    Catch::Matchers::Contains("world size must be at least 1"));
  CHECK_THROWS_WITH(make_flat_param_layout({{"a", {2}}}, at::kFloat, 2).slices_for_rank(2),
                    Catch::Matchers::Contains("rank 2 is outside the world of 2"));
}
