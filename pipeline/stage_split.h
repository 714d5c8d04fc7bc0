#pragma once
// Which blocks of a model each pipeline stage holds, and which pipeline rank runs each stage.
//
// A model made of a stack of n_blocks blocks (a GPT's `blocks.0` .. `blocks.<n-1>`) is cut into
// n_stages stages of consecutive blocks; stage s holds the blocks [begin, end) of ranges[s]. Each
// stage keeps the original FQNs of what it holds (contract::ModuleList::keep_only, [Note: pruned
// ModuleList]), so checkpoints and optimizer state name parameters as in the whole model.
//
//   auto ranges = fsdp::pipeline::split_blocks_evenly(/*n_blocks=*/10, /*n_stages=*/4);
//   // {[0, 3), [3, 6), [6, 8), [8, 10)}: the first 10 % 4 = 2 stages hold one block more
//   for (int s : fsdp::pipeline::stages_of_rank(pp_rank, pp_size, /*n_stages=*/4)) {
//     GPT stage(config);                          // every stage built from the same seed
//     stage->keep_stage(ranges[s], s == 0, s == 3);
//   }
//
// Placement is "looped", as torch.distributed.pipelining's interleaved schedules expect: stage s
// runs on pipeline rank s % pp_size, so with pp_size ranks and v * pp_size stages each rank holds
// v stages (rank r: r, r + pp_size, ...).

#include <cstdint>
#include <vector>

namespace fsdp::pipeline {

/// The blocks [begin, end) of one stage.
struct BlockRange {
  int64_t begin = 0;
  int64_t end = 0;

  /// The number of blocks, end - begin.
  int64_t size() const noexcept { return end - begin; }
  bool operator==(const BlockRange&) const = default;
};

/// Splits n_blocks consecutive blocks over n_stages stages as evenly as possible: every stage
/// holds n_blocks / n_stages blocks and the FIRST n_blocks % n_stages stages one more (as
/// numpy.array_split; the last stage, which also computes the output layer and the loss, is never
/// the one with the extra block unless every stage has it).
///
///   split_blocks_evenly(5, 3);   // {[0, 2), [2, 4), [4, 5)}
///
/// Needs n_stages >= 1 and n_blocks >= n_stages (every stage holds a block); fails with a
/// c10::Error naming both otherwise. The result passes check_split(ranges, n_blocks).
std::vector<BlockRange> split_blocks_evenly(int64_t n_blocks, int64_t n_stages);

/// Checks explicit ranges (one per stage, in stage order) against a model of n_blocks blocks:
/// at least one stage; each range within [0, n_blocks), not reversed, and not empty unless
/// `allow_empty_stages` (a stage that holds no block, e.g. only the embeddings); consecutive (each
/// begins where the previous one ends), so that together they cover [0, n_blocks) exactly once.
/// Fails with a c10::Error naming check_split, the stage, what was expected and what was found
/// (the blocks left out, or used twice and by which stages).
///
///   check_split({{0, 2}, {2, 4}}, 4);   // fine
///   check_split({{0, 2}, {3, 4}}, 4);   // "... stage 1 ... block 2 is left out ..."
void check_split(const std::vector<BlockRange>& ranges, int64_t n_blocks, bool allow_empty_stages = false);

/// The stages pipeline rank `pp_rank` of `pp_size` runs under the looped placement (stage s on
/// rank s % pp_size), in increasing order: {pp_rank, pp_rank + pp_size, ...}. n_stages must be a
/// positive multiple of pp_size (each rank runs n_stages / pp_size stages) and 0 <= pp_rank <
/// pp_size; a c10::Error names the values otherwise.
///
///   stages_of_rank(1, 2, 4);   // {1, 3}
std::vector<int> stages_of_rank(int pp_rank, int pp_size, int n_stages);

/// The pipeline rank that runs `stage` under the looped placement: stage % pp_size. Needs
/// stage >= 0 and pp_size >= 1.
int rank_of_stage(int stage, int pp_size);

}  // namespace fsdp::pipeline
