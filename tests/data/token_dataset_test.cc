// TokenDataset (data/token_dataset.h) in one process, its data ranks simulated by one dataset per
// rank: every window, hence every token, seen exactly once per epoch across 1-4 data ranks (the
// last global batch of an epoch wrapping into the next), rows that are the file's windows, other
// orders in other epochs and seeds, the same stream from the same arguments, a resumed dataset
// continuing the uninterrupted stream (also at another number of data ranks), and the refusals.
#include "fsdp_cpp/data/token_dataset.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "fsdp_cpp/tests/testing/errors.h"

// Last: LibTorch's c10/util/Logging.h defines its own CHECK, and the last definition wins.
#include <catch2/catch.hpp>

namespace {

using Catch::Matchers::Contains;
using fsdp::data::TokenDataset;
using fsdp::data::TokenDatasetOptions;
using fsdp::data::TokenDatasetState;
using fsdp::data::TokenFile;
using fsdp::testing::error_of;

std::string temp_path(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  const std::string base = dir ? dir : std::filesystem::temp_directory_path().string();
  return base + "/token_dataset_test_" + std::to_string(::getpid()) + "_" + name;
}

// A file whose token i is i % vocab (positions recoverable from values when n <= vocab), with
// end-of-text ids every 37 tokens.
std::shared_ptr<const TokenFile> make_file(const std::string& name, int64_t n, int64_t vocab = 1 << 16) {
  std::vector<int64_t> tokens(n);
  for (int64_t i = 0; i < n; ++i) tokens[i] = i % 37 == 36 ? 0 : i % vocab;
  const std::string path = temp_path(name);
  fsdp::data::write_token_file(path, tokens, vocab, /*eot_id=*/0);
  return std::make_shared<const TokenFile>(path);
}

std::vector<TokenDataset> ranks_of(const std::shared_ptr<const TokenFile>& file, int64_t t, int64_t d, uint64_t seed = 0) {
  std::vector<TokenDataset> ranks;
  for (int64_t r = 0; r < d; ++r) ranks.emplace_back(file, TokenDatasetOptions(t).seed(seed).data_rank(r).data_size(d));
  return ranks;
}

// The global stream of windows (epoch, window) from `steps` global batches of `b` rows per rank.
std::vector<std::pair<int64_t, int64_t>> global_stream(std::vector<TokenDataset>& ranks, int64_t b, int64_t steps) {
  std::vector<std::pair<int64_t, int64_t>> stream;
  for (int64_t s = 0; s < steps; ++s) {
    for (auto& rank : ranks) {
      const auto batch = rank.next_batch(b);
      for (size_t i = 0; i < batch.windows.size(); ++i) stream.emplace_back(batch.epochs[i], batch.windows[i]);
    }
  }
  return stream;
}

}  // namespace

TEST_CASE("every window and every token is seen exactly once per epoch across 1-4 data ranks", "[data]") {
  const int64_t t = 8;
  auto file = make_file("cover", 8 * 53 + 5);  // 53 windows; a 4-token tail that fills no window
  for (int64_t d = 1; d <= 4; ++d) {
    for (int64_t b : {1, 3, 4}) {
      INFO("data ranks " << d << ", batch " << b);
      auto ranks = ranks_of(file, t, d, /*seed=*/7);
      REQUIRE(ranks[0].num_windows() == 53);
      // Enough global batches for 3 whole epochs (and part of a 4th).
      const int64_t steps = 3 * 53 / (b * d) + 2;
      std::map<int64_t, std::vector<int64_t>> seen_by_epoch;
      std::map<int64_t, std::vector<int64_t>> input_tokens_by_epoch;
      for (int64_t s = 0; s < steps; ++s) {
        for (int64_t r = 0; r < d; ++r) {
          const auto batch = ranks[r].next_batch(b);
          REQUIRE(batch.inputs.sizes() == at::IntArrayRef({b, t}));
          REQUIRE(batch.targets.sizes() == at::IntArrayRef({b, t}));
          REQUIRE(batch.inputs.scalar_type() == at::kLong);
          for (int64_t i = 0; i < b; ++i) {
            const int64_t w = batch.windows[i];
            seen_by_epoch[batch.epochs[i]].push_back(w);
            // The row is window w of the file: inputs tokens [w*T, w*T + T), targets shifted by one.
            const at::Tensor expected = file->read(w * t, t + 1);
            REQUIRE(batch.inputs[i].equal(expected.narrow(0, 0, t)));
            REQUIRE(batch.targets[i].equal(expected.narrow(0, 1, t)));
            for (int64_t k = 0; k < t; ++k) input_tokens_by_epoch[batch.epochs[i]].push_back(w * t + k);
          }
        }
        // Every rank is at the same position.
        for (int64_t r = 1; r < d; ++r) REQUIRE(ranks[r].state() == ranks[0].state());
      }
      // Epochs 0-2 complete: each window exactly once, each of tokens [0, 53*T) an input exactly once.
      for (int64_t e = 0; e < 3; ++e) {
        INFO("epoch " << e);
        std::vector<int64_t> windows = seen_by_epoch.at(e);
        REQUIRE(windows.size() == 53);
        std::sort(windows.begin(), windows.end());
        for (int64_t i = 0; i < 53; ++i) CHECK(windows[i] == i);
        std::vector<int64_t> positions = input_tokens_by_epoch.at(e);
        std::sort(positions.begin(), positions.end());
        REQUIRE(positions.size() == size_t(53 * t));
        for (int64_t i = 0; i < 53 * t; ++i) CHECK(positions[i] == i);
      }
      // The position counts the windows consumed over all ranks.
      const int64_t consumed = steps * b * d;
      CHECK(ranks[0].epoch() == consumed / 53);
      CHECK(ranks[0].position() == consumed % 53);
    }
  }
}

TEST_CASE("a global batch that reaches the end of an epoch wraps into the next epoch's order", "[data]") {
  auto file = make_file("wrap", 4 * 10 + 1);  // 10 windows of T = 4
  auto ranks = ranks_of(file, 4, /*d=*/2, /*seed=*/3);
  auto stream = global_stream(ranks, /*b=*/3, /*steps=*/2);  // 12 windows: all of epoch 0, 2 of epoch 1
  REQUIRE(stream.size() == 12);
  for (int64_t i = 0; i < 12; ++i) {
    CHECK(stream[i].first == (i < 10 ? 0 : 1));
    CHECK(stream[i].second == ranks[0].window_at(i / 10, i % 10));
  }
  CHECK(ranks[0].epoch() == 1);
  CHECK(ranks[0].position() == 2);
}

TEST_CASE("epochs and seeds shuffle differently; the same arguments give the same stream", "[data]") {
  auto file = make_file("order", 16 * 200 + 1);  // 200 windows
  TokenDataset a(file, TokenDatasetOptions(16).seed(1));
  auto order = [&](const TokenDataset& ds, int64_t epoch) {
    std::vector<int64_t> o;
    for (int64_t i = 0; i < ds.num_windows(); ++i) o.push_back(ds.window_at(epoch, i));
    return o;
  };
  std::set<std::vector<int64_t>> orders;
  for (int64_t e = 0; e < 5; ++e) {
    auto o = order(a, e);
    auto sorted = o;
    std::sort(sorted.begin(), sorted.end());
    for (int64_t i = 0; i < 200; ++i) REQUIRE(sorted[i] == i);  // a permutation
    // Shuffled: few windows in their own place.
    int64_t fixed = 0;
    for (int64_t i = 0; i < 200; ++i) fixed += o[i] == i;
    CHECK(fixed < 20);
    orders.insert(o);
  }
  CHECK(orders.size() == 5);
  TokenDataset other_seed(file, TokenDatasetOptions(16).seed(2));
  CHECK(order(other_seed, 0) != order(a, 0));
  TokenDataset same(file, TokenDatasetOptions(16).seed(1));
  CHECK(order(same, 3) == order(a, 3));
  TokenDataset unshuffled(file, TokenDatasetOptions(16).seed(1).shuffle(false));
  for (int64_t i = 0; i < 200; ++i) REQUIRE(unshuffled.window_at(4, i) == i);

  // Two datasets built alike return the same batches.
  TokenDataset x(file, TokenDatasetOptions(16).seed(9).data_rank(1).data_size(3));
  TokenDataset y(std::make_shared<const TokenFile>(file->path()), TokenDatasetOptions(16).seed(9).data_rank(1).data_size(3));
  for (int s = 0; s < 30; ++s) {
    const auto bx = x.next_batch(4), by = y.next_batch(4);
    REQUIRE(bx.windows == by.windows);
    REQUIRE(bx.inputs.equal(by.inputs));
  }

  // A one-window file and permutations of every small size.
  for (int64_t n = 1; n <= 70; ++n) {
    auto f = make_file("small" + std::to_string(n), 2 * n + 1);
    TokenDataset ds(f, TokenDatasetOptions(2).seed(n));
    REQUIRE(ds.num_windows() == n);
    auto o = order(ds, 0);
    std::sort(o.begin(), o.end());
    for (int64_t i = 0; i < n; ++i) REQUIRE(o[i] == i);
    std::filesystem::remove(f->path());
  }
}

TEST_CASE("a dataset resumed mid-epoch from its state continues the uninterrupted stream", "[data]") {
  auto file = make_file("resume", 8 * 45 + 3);  // 45 windows
  for (int64_t d = 1; d <= 4; ++d) {
    INFO("data ranks " << d);
    const int64_t b = 2;
    auto uninterrupted = ranks_of(file, 8, d, /*seed=*/11);
    const auto whole = global_stream(uninterrupted, b, 20);

    auto first = ranks_of(file, 8, d, 11);
    auto head = global_stream(first, b, 7);  // mid-epoch (7 * 2 * d is not a multiple of 45)
    const std::string saved = first[0].state().to_string();
    for (int64_t r = 0; r < d; ++r) REQUIRE(first[r].state().to_string() == saved);  // no rank in it

    auto resumed = ranks_of(file, 8, d, 11);
    for (auto& rank : resumed) rank.load_state(saved);
    auto tail = global_stream(resumed, b, 13);
    head.insert(head.end(), tail.begin(), tail.end());
    CHECK(head == whole);
    CHECK(resumed[0].state() == uninterrupted[0].state());
  }

  // The state is one line of JSON and parses back.
  TokenDataset ds(file, TokenDatasetOptions(8).seed(11));
  ds.next_batch(5);
  const TokenDatasetState s = ds.state();
  CHECK(s.epoch == 0);
  CHECK(s.position == 5);
  const std::string text = s.to_string();
  CHECK_THAT(text, Contains("\"format\":\"fsdp-token-dataset\",\"version\":1,"));
  CHECK_THAT(text, Contains("\"num_tokens\":363,\"vocab_size\":65536,\"seq_len\":8,\"seed\":11,\"shuffle\":true,"
                            "\"epoch\":0,\"position\":5}"));
  CHECK(TokenDatasetState::parse(text) == s);
  TokenDatasetState big = s;
  big.seed = ~uint64_t{0};
  big.fingerprint = ~uint64_t{0} - 5;
  CHECK(TokenDatasetState::parse(big.to_string()) == big);
}

TEST_CASE("a resumed job at another number of data ranks continues the same global stream", "[data]") {
  auto file = make_file("relayout", 4 * 30 + 1);  // 30 windows
  auto two = ranks_of(file, 4, 2, 5);
  auto whole = global_stream(two, 3, 12);  // 72 windows
  auto before = ranks_of(file, 4, 2, 5);
  auto stream = global_stream(before, 3, 4);  // 24 windows
  auto three = ranks_of(file, 4, 3, 5);
  for (auto& rank : three) rank.load_state(before[1].state());
  auto tail = global_stream(three, 2, 8);  // 48 windows, 6 per global batch
  stream.insert(stream.end(), tail.begin(), tail.end());
  CHECK(stream == whole);
}

TEST_CASE("a state of another stream, or outside an epoch, is refused naming what differs", "[data]") {
  auto file = make_file("refuse", 8 * 20 + 1);
  auto other = make_file("refuse_other", 8 * 20 + 1, 1000);
  TokenDataset ds(file, TokenDatasetOptions(8).seed(4));
  ds.next_batch(3);
  const TokenDatasetState saved = ds.state();

  TokenDataset other_seq(file, TokenDatasetOptions(4).seed(4));
  CHECK_THAT(error_of([&] { other_seq.load_state(saved); }),
             Contains("TokenDataset::load_state: '" + file->path() +
                      "': the state is of another stream (seq_len 8 in the state, 4 here)"));
  TokenDataset other_seed(file, TokenDatasetOptions(8).seed(5).shuffle(false));
  CHECK_THAT(error_of([&] { other_seed.load_state(saved); }),
             Contains("(seed 4 in the state, 5 here; shuffle true in the state, false here)"));
  TokenDataset other_file(other, TokenDatasetOptions(8).seed(4));
  const std::string e = error_of([&] { other_file.load_state(saved); });
  CHECK_THAT(e, Contains("the state is of another stream (file fingerprint "));
  CHECK_THAT(e, Contains("vocab_size 65536 in the state, 1000 here"));
  CHECK(other_file.position() == 0);  // unchanged

  TokenDatasetState outside = saved;
  outside.position = 20;
  CHECK_THAT(error_of([&] { ds.load_state(outside); }),
             Contains("position 20 of epoch 0 is outside an epoch (expected epoch >= 0 and 0 <= position < 20, "
                      "the windows of an epoch)"));
  CHECK(ds.position() == 3);

  CHECK_THAT(error_of([&] { TokenDatasetState::parse("step=3"); }), Contains("not a dataset state (not JSON"));
  CHECK_THAT(error_of([&] { TokenDatasetState::parse("{\"format\":\"x\"}"); }),
             Contains("not a dataset state (expected \"format\": \"fsdp-token-dataset\")"));
  CHECK_THAT(error_of([&] { TokenDatasetState::parse("{\"format\":\"fsdp-token-dataset\",\"version\":9}"); }),
             Contains("unknown version 9 (expected 1)"));
  std::string no_epoch = saved.to_string();
  no_epoch.replace(no_epoch.find("\"epoch\""), 7, "\"epoc\"");
  CHECK_THAT(error_of([&] { TokenDatasetState::parse(no_epoch); }), Contains("the state has no \"epoch\""));

  // Construction.
  CHECK_THAT(error_of([&] { TokenDataset(file, TokenDatasetOptions(0)); }), Contains("seq_len 0 (expected at least 1)"));
  CHECK_THAT(error_of([&] { TokenDataset(file, TokenDatasetOptions(161)); }),
             Contains("holds 161 tokens, fewer than one window of seq_len + 1 = 162"));
  CHECK_THAT(error_of([&] { TokenDataset(file, TokenDatasetOptions(8).data_rank(2).data_size(2)); }),
             Contains("data_rank 2 is outside [0, 2)"));
  CHECK_THAT(error_of([&] { ds.next_batch(0); }), Contains("batch_size 0 (expected at least 1)"));
}
