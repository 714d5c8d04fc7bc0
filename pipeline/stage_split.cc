#include "fsdp_cpp/pipeline/stage_split.h"

#include <algorithm>
#include <cstddef>
#include <string>

#include <c10/util/Exception.h>

namespace fsdp::pipeline {

std::vector<BlockRange> split_blocks_evenly(int64_t n_blocks, int64_t n_stages) {
  TORCH_CHECK(n_stages >= 1, "split_blocks_evenly: expected n_stages >= 1, got ", n_stages);
  TORCH_CHECK(n_blocks >= n_stages, "split_blocks_evenly: expected at least one block per stage, "
              "got ", n_blocks, " blocks for ", n_stages, " stages (use fewer stages, or explicit "
              "ranges checked by check_split(ranges, n_blocks, /*allow_empty_stages=*/true))");
  const int64_t base = n_blocks / n_stages;
  const int64_t extra = n_blocks % n_stages;  // the first `extra` stages hold base + 1 blocks
  std::vector<BlockRange> ranges;
  ranges.reserve(static_cast<size_t>(n_stages));
  int64_t begin = 0;
  for (int64_t s = 0; s < n_stages; ++s) {
    const int64_t end = begin + base + (s < extra ? 1 : 0);
    ranges.push_back(BlockRange{begin, end});
    begin = end;
  }
  return ranges;
}

void check_split(const std::vector<BlockRange>& ranges, int64_t n_blocks, bool allow_empty_stages) {
  TORCH_CHECK(!ranges.empty(), "check_split: expected at least one stage (n_stages >= 1), got no "
              "ranges for ", n_blocks, " blocks");
  TORCH_CHECK(n_blocks >= 0, "check_split: expected n_blocks >= 0, got ", n_blocks);
  const int64_t n_stages = static_cast<int64_t>(ranges.size());
  int64_t expected_begin = 0;  // where stage s must begin: the end of stage s - 1
  for (int64_t s = 0; s < n_stages; ++s) {
    const BlockRange& r = ranges[static_cast<size_t>(s)];
    TORCH_CHECK(r.begin <= r.end, "check_split: stage ", s, " of ", n_stages, ": expected a range "
                "[begin, end) with begin <= end, found the reversed range [", r.begin, ", ", r.end, ")");
    TORCH_CHECK(allow_empty_stages || r.begin < r.end, "check_split: stage ", s, " of ", n_stages,
                ": expected at least one block, found the empty range [", r.begin, ", ", r.end,
                ") (pass allow_empty_stages = true if a stage without blocks is meant)");
    TORCH_CHECK(r.begin >= 0 && r.end <= n_blocks, "check_split: stage ", s, " of ", n_stages,
                ": expected blocks within [0, ", n_blocks, "), found [", r.begin, ", ", r.end, ")");
    if (r.begin > expected_begin) {
      TORCH_CHECK(false, "check_split: stage ", s, " of ", n_stages, ": expected it to begin at block ",
                  expected_begin, (s == 0 ? "" : " (where the previous stage ends)"), ", found [",
                  r.begin, ", ", r.end, "): ",
                  (r.begin - expected_begin == 1 ? "block " : "blocks "), expected_begin,
                  (r.begin - expected_begin == 1 ? "" : " .. " + std::to_string(r.begin - 1)),
                  (r.begin - expected_begin == 1 ? " is" : " are"), " left out");
    }
    if (r.begin < expected_begin) {
      // Blocks [r.begin, min(r.end, expected_begin)) are held by this stage and an earlier one;
      // name the earliest earlier stage holding r.begin.
      int64_t other = s - 1;
      while (other > 0 && ranges[static_cast<size_t>(other - 1)].end > r.begin) --other;
      const int64_t twice_end = std::min(r.end, expected_begin);
      TORCH_CHECK(false, "check_split: stage ", s, " of ", n_stages, ": expected it to begin at block ",
                  expected_begin, " (where the previous stage ends), found [", r.begin, ", ", r.end,
                  "): ", (twice_end - r.begin == 1 ? "block " : "blocks "), r.begin,
                  (twice_end - r.begin == 1 ? "" : " .. " + std::to_string(twice_end - 1)),
                  (twice_end - r.begin == 1 ? " is" : " are"), " used twice (also held by ",
                  (other == s - 1 ? "stage " + std::to_string(other)
                                  : "stages " + std::to_string(other) + " .. " + std::to_string(s - 1)),
                  ")");
    }
    expected_begin = r.end;
  }
  TORCH_CHECK(expected_begin == n_blocks, "check_split: stage ", n_stages - 1, " of ", n_stages,
              " (the last): expected it to end at block ", n_blocks, " (n_blocks), found [",
              ranges.back().begin, ", ", ranges.back().end, "): ",
              (n_blocks - expected_begin == 1 ? "block " : "blocks "), expected_begin,
              (n_blocks - expected_begin == 1 ? "" : " .. " + std::to_string(n_blocks - 1)),
              (n_blocks - expected_begin == 1 ? " is" : " are"), " left out");
}

std::vector<int> stages_of_rank(int pp_rank, int pp_size, int n_stages) {
  TORCH_CHECK(pp_size >= 1, "stages_of_rank: expected pp_size >= 1, got ", pp_size);
  TORCH_CHECK(pp_rank >= 0 && pp_rank < pp_size, "stages_of_rank: expected 0 <= pp_rank < pp_size = ",
              pp_size, ", got pp_rank ", pp_rank);
  TORCH_CHECK(n_stages >= 1 && n_stages % pp_size == 0, "stages_of_rank: the looped placement "
              "(stage s on pipeline rank s % pp_size) needs n_stages to be a positive multiple of "
              "pp_size, got n_stages ", n_stages, " and pp_size ", pp_size);
  std::vector<int> stages;
  stages.reserve(static_cast<size_t>(n_stages / pp_size));
  for (int s = pp_rank; s < n_stages; s += pp_size) stages.push_back(s);
  return stages;
}

int rank_of_stage(int stage, int pp_size) {
  TORCH_CHECK(pp_size >= 1, "rank_of_stage: expected pp_size >= 1, got ", pp_size);
  TORCH_CHECK(stage >= 0, "rank_of_stage: expected stage >= 0, got ", stage);
  return stage % pp_size;
}

}  // namespace fsdp::pipeline
