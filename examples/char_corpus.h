#pragma once
// The text the examples train on, a character-level tokenizer built from it, and the per-rank
// batches of next-token prediction windows.
//
//   const fsdp::examples::CharCorpus corpus = fsdp::examples::CharCorpus::embedded();
//   auto batch = corpus.sample_batch({.seed = 0, .step = 3, .rank = 1}, /*batch=*/16,
//                                    /*context=*/64);
//   // batch.inputs, batch.targets: int64 [16, 64]; targets are inputs shifted by one character.
//
// The embedded text is examples/data/corpus.txt (public domain, written for this repository),
// compiled into the binary so programs find it wherever they run.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>

namespace fsdp::examples {

/// The text of examples/data/corpus.txt, compiled in.
std::string_view embedded_corpus_text();

/// Maps each distinct character of a text to a token id: ids follow the characters' byte order,
/// so the same text always gives the same vocabulary.
///
///   CharTokenizer tok("abca");        // vocab_size() == 3
///   tok.encode("cab");                // {2, 0, 1}
///   tok.decode({2, 0, 1});            // "cab"
class CharTokenizer {
 public:
  /// Builds the vocabulary from the characters of `text` (which must not be empty).
  explicit CharTokenizer(std::string_view text);

  int64_t vocab_size() const { return static_cast<int64_t>(id_to_char_.size()); }
  /// Token ids of `text`. A character outside the vocabulary is a c10::Error naming it.
  std::vector<int64_t> encode(std::string_view text) const;
  /// The text of `ids`. An id outside [0, vocab_size()) is a c10::Error.
  std::string decode(const std::vector<int64_t>& ids) const;

 private:
  std::vector<char> id_to_char_;
  std::vector<int64_t> char_to_id_;  // indexed by unsigned char; -1 where absent
};

/// Identifies one batch: the same key gives the same windows in every process.
struct BatchKey {
  uint64_t seed = 0;
  int64_t step = 0;
  int64_t rank = 0;
};

/// Next-token prediction batch: `targets[b][t]` is the character after `inputs[b][t]`.
struct TokenBatch {
  at::Tensor inputs;   // int64 [batch, context]
  at::Tensor targets;  // int64 [batch, context]
};

/// A tokenized text from which batches of random windows are drawn.
class CharCorpus {
 public:
  /// Tokenizes `text` with a tokenizer built from it.
  explicit CharCorpus(std::string text);
  /// The corpus of embedded_corpus_text().
  static CharCorpus embedded();

  const std::string& text() const { return text_; }
  const CharTokenizer& tokenizer() const { return tokenizer_; }
  /// All tokens of the text, int64 [num_tokens()].
  const at::Tensor& tokens() const { return tokens_; }
  int64_t num_tokens() const { return tokens_.numel(); }

  /// `batch` windows of `context + 1` consecutive tokens at random offsets drawn from a generator
  /// seeded by `key` (different ranks and steps get different windows; the same key, the same
  /// windows). A context that leaves no room in the text is a c10::Error.
  TokenBatch sample_batch(const BatchKey& key, int64_t batch, int64_t context) const;

 private:
  std::string text_;
  CharTokenizer tokenizer_;
  at::Tensor tokens_;  // int64 [num_tokens]
};

}  // namespace fsdp::examples
