#pragma once
// Next-token training batches from a token file (data/token_file.h), dealt to the data-parallel
// ranks so that every window is seen exactly once per epoch across them, in an order shuffled per
// epoch, deterministic in any process, and resumable mid-epoch from a small state.
//
//   auto file = std::make_shared<const fsdp::data::TokenFile>("corpus.tokens");
//   fsdp::data::TokenDataset data(file, fsdp::data::TokenDatasetOptions(/*seq_len=*/64)
//                                           .seed(0)
//                                           .data_rank(mesh.data_rank())     // never the world rank
//                                           .data_size(mesh.data_world()));
//   auto batch = data.next_batch(8);          // inputs, targets: int64 [8, 64]
//   std::string saved = data.state().to_string();     // e.g. into a checkpoint
//   ...
//   data.load_state(fsdp::data::TokenDatasetState::parse(saved));   // continues the same stream
//
// [Note: token windows] The file's tokens are cut into N = (num_tokens - 1) / T consecutive,
// non-overlapping windows of T + 1 tokens: window k is tokens [k*T, k*T + T + 1); its inputs are
// tokens [k*T, k*T + T), its targets tokens [k*T + 1, k*T + T + 1) (the inputs shifted by one; the
// last target of window k is the first input of window k + 1). Every token but the last
// num_tokens - N*T (fewer than T + 1, the tail that fills no window) is an input of exactly one
// window. Documents are concatenated with their end-of-text ids as they are in the file: a window
// may span documents, and attention is NOT masked at document boundaries (the model sees the
// end-of-text token and learns that what follows is unrelated).
//
// [Note: the global token stream] Epoch e visits the N windows in an order shuffled by (seed, e):
// a keyed pseudo-random permutation (a balanced Feistel network over the next power of 4 >= N
// with splitmix64 round functions, cycle-walked into [0, N); O(1) memory, any position computed
// directly, independent of LibTorch's generators), or file order with shuffle(false). The epochs'
// orders are concatenated into one global stream of windows. Each call next_batch(B) on the D data
// ranks takes the next B * D windows of the stream, data rank r the B at [r*B, r*B + B) of them
// (so the ranks' batches together are the stream's next global batch). An epoch's windows are
// therefore dealt exactly once across the data ranks, none dropped, none repeated: when N is not
// a multiple of B * D, the global batch that reaches the end of an epoch WRAPS into the next
// epoch's order (TokenBatch::epochs gives each row's epoch). The stream depends on (file, T, seed,
// shuffle) only: D and the rank only cut it into batches.
//
// [Note: dataset state] The position is (epoch, position): the windows of the current epoch that
// the global stream has consumed, over every data rank. It is the same on every data rank (every
// rank calls next_batch with the same B, in lockstep) and holds no rank: a job may resume at
// another number of data ranks (or batch size) and continues the same global stream from there.
// With it, the state names the stream (file fingerprint, token count, vocabulary, T, seed,
// shuffle); load_state refuses a state of another stream, naming what differs.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include "fsdp_cpp/data/token_file.h"

namespace fsdp::data {

struct TokenDatasetOptions {
  explicit TokenDatasetOptions(int64_t seq_len) : seq_len_(seq_len) {}
  /// T: tokens per row of inputs (and of targets). At least 1, and num_tokens >= T + 1.
  TORCH_ARG(int64_t, seq_len);
  /// The shuffle's seed: with the epoch it decides each epoch's order.
  TORCH_ARG(uint64_t, seed) = 0;
  /// Visit the windows in a shuffled order (true) or in file order every epoch (false).
  TORCH_ARG(bool, shuffle) = true;
  /// This rank's data-parallel index and the number of data-parallel ranks
  /// (ParallelMesh::data_rank() and data_world(); parallel/parallel_dims.h, [Note: data ranks]).
  TORCH_ARG(int64_t, data_rank) = 0;
  TORCH_ARG(int64_t, data_size) = 1;
};

/// One data rank's batch.
struct TokenBatch {
  at::Tensor inputs;   // int64 [batch, seq_len]
  at::Tensor targets;  // int64 [batch, seq_len]: inputs shifted by one token
  /// Each row's window (its inputs are tokens [w*T, w*T + T)) and the epoch whose order it came from.
  std::vector<int64_t> windows;
  std::vector<int64_t> epochs;
};

/// [Note: dataset state]: a dataset's position and what identifies its stream.
struct TokenDatasetState {
  // The stream.
  uint64_t fingerprint = 0;  // TokenFile::fingerprint()
  int64_t num_tokens = 0;
  int64_t vocab_size = 0;
  int64_t seq_len = 0;
  uint64_t seed = 0;
  bool shuffle = true;
  // The position.
  int64_t epoch = 0;
  int64_t position = 0;  // windows of `epoch` consumed over all data ranks, in [0, num_windows)

  /// One line of JSON, e.g. {"format":"fsdp-token-dataset","version":1,"fingerprint":
  /// "9a3c...","num_tokens":2277,"vocab_size":512,"seq_len":64,"seed":0,"shuffle":true,"epoch":1,
  /// "position":48} (the fingerprint as 16 hex digits).
  std::string to_string() const;
  /// The inverse of to_string; c10::Error naming what is wrong (not JSON, another format or
  /// version, a missing or mistyped field).
  static TokenDatasetState parse(const std::string& text);
  bool operator==(const TokenDatasetState&) const = default;
};

class TokenDataset {
 public:
  /// c10::Error naming the file when seq_len < 1, the file holds fewer than seq_len + 1 tokens,
  /// data_size < 1 or data_rank is outside [0, data_size).
  TokenDataset(std::shared_ptr<const TokenFile> file, TokenDatasetOptions options);
  /// Opens `path` (TokenFileOptions default: tokens not checked against the vocabulary).
  TokenDataset(const std::string& path, TokenDatasetOptions options);

  const TokenFile& file() const { return *file_; }
  const TokenDatasetOptions& options() const { return options_; }
  int64_t seq_len() const { return options_.seq_len(); }
  /// N, the windows of one epoch ([Note: token windows]).
  int64_t num_windows() const { return num_windows_; }
  /// The current epoch and the windows of it consumed so far over all data ranks.
  int64_t epoch() const { return epoch_; }
  int64_t position() const { return position_; }

  /// The i-th window (0 <= i < num_windows()) of epoch `epoch`'s order.
  int64_t window_at(int64_t epoch, int64_t i) const;
  /// Window `window`'s inputs and targets, int64 [seq_len] each.
  std::pair<at::Tensor, at::Tensor> window(int64_t window) const;

  /// This data rank's next `batch_size` rows ([Note: the global token stream]): advances the
  /// position by batch_size * data_size windows. Every data rank must call it with the same
  /// batch_size. batch_size >= 1.
  TokenBatch next_batch(int64_t batch_size);

  /// The position and the stream's identity ([Note: dataset state]).
  TokenDatasetState state() const;
  /// Continues from `state`: the next batches are those the saved dataset would have returned
  /// next (at the same data_size and batch size; another data_size or batch size cuts the same
  /// global stream differently). c10::Error, naming the file and each field that differs, when
  /// the state is of another stream (file, seq_len, seed, shuffle), or when its position is not
  /// inside an epoch of this file. The dataset is unchanged when refused.
  void load_state(const TokenDatasetState& state);
  void load_state(const std::string& state) { load_state(TokenDatasetState::parse(state)); }

 private:
  std::shared_ptr<const TokenFile> file_;
  TokenDatasetOptions options_;
  uint64_t fingerprint_ = 0;
  int64_t num_windows_ = 0;
  int64_t epoch_ = 0;
  int64_t position_ = 0;
};

}  // namespace fsdp::data
