// TokenDataset over real data-parallel processes (MPI, 1-4 ranks): each rank reads only its own
// batches, yet the ranks' windows, all-gathered, cover every window of the file exactly once per
// epoch, they are the global stream any single process computes from the same arguments, and the
// ranks' states are the same string.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "fsdp_cpp/data/token_dataset.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using fsdp::data::TokenDataset;
using fsdp::data::TokenDatasetOptions;
using fsdp::data::TokenFile;

}  // namespace

FSDP_RANKS_TEST_CASE("data ranks in separate processes see every window exactly once per epoch", "[data]") {
  auto& world = fsdp::testing::world();
  const int64_t d = world.size(), rank = world.rank();
  const int64_t t = 8, n_windows = 50, b = 3;
  const std::string path = fsdp::testing::shared_tmpdir() + "/stream.tokens";
  if (rank == 0) {
    std::vector<int64_t> tokens(n_windows * t + 3);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = int64_t((i * 2654435761u) % 1000);
    fsdp::data::write_token_file(path, tokens, 1000, /*eot_id=*/999);
  }
  world.barrier();
  auto file = std::make_shared<const TokenFile>(path, fsdp::data::TokenFileOptions{.check_tokens = true});
  TokenDataset data(file, TokenDatasetOptions(t).seed(17).data_rank(rank).data_size(d));
  REQUIRE(data.num_windows() == n_windows);

  const int64_t steps = 2 * n_windows / (b * d) + 2;  // two whole epochs and part of a third
  std::vector<int64_t> mine;                           // (epoch, window) pairs, flattened
  for (int64_t s = 0; s < steps; ++s) {
    const auto batch = data.next_batch(b);
    for (int64_t i = 0; i < b; ++i) {
      const int64_t w = batch.windows[i];
      REQUIRE(batch.inputs[i].equal(file->read(w * t, t)));
      REQUIRE(batch.targets[i].equal(file->read(w * t + 1, t)));
      mine.push_back(batch.epochs[i]);
      mine.push_back(w);
    }
  }
  std::vector<at::Tensor> gathered;
  for (int64_t r = 0; r < d; ++r) gathered.push_back(at::empty({int64_t(mine.size())}, at::kLong));
  world.all_gather(gathered, at::tensor(mine, at::kLong)).wait();

  // The global stream: step s's global batch is rank 0's rows, then rank 1's, ...
  std::vector<std::pair<int64_t, int64_t>> stream;
  for (int64_t s = 0; s < steps; ++s) {
    for (int64_t r = 0; r < d; ++r) {
      const int64_t* p = gathered[r].data_ptr<int64_t>();
      for (int64_t i = 0; i < b; ++i) stream.emplace_back(p[2 * (s * b + i)], p[2 * (s * b + i) + 1]);
    }
  }
  // The same as one process computes alone.
  TokenDataset alone(file, TokenDatasetOptions(t).seed(17));
  for (int64_t s = 0; s < steps; ++s) {
    const auto batch = alone.next_batch(b * d);
    for (int64_t i = 0; i < b * d; ++i) {
      REQUIRE(stream[s * b * d + i] == std::make_pair(batch.epochs[i], batch.windows[i]));
    }
  }
  // Every window once in each whole epoch.
  for (int64_t e = 0; e < 2; ++e) {
    std::vector<int64_t> windows;
    for (const auto& [epoch, w] : stream) {
      if (epoch == e) windows.push_back(w);
    }
    std::sort(windows.begin(), windows.end());
    REQUIRE(windows.size() == size_t(n_windows));
    for (int64_t i = 0; i < n_windows; ++i) CHECK(windows[i] == i);
  }
  CHECK(fsdp::testing::same_on_every_rank(data.state().to_string()));
  CHECK(data.state() == alone.state());
}
