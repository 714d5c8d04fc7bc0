#include "fsdp_cpp/examples/char_corpus.h"

#include <algorithm>
#include <array>
#include <utility>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>

namespace fsdp::examples {
namespace {

// SplitMix64's finaliser: spreads nearby keys (step 3 vs step 4) over unrelated generator seeds.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

CharTokenizer::CharTokenizer(std::string_view text) : char_to_id_(256, -1) {
  TORCH_CHECK(!text.empty(), "CharTokenizer: the text is empty; a vocabulary needs characters");
  std::array<bool, 256> present{};
  for (char c : text) present[static_cast<unsigned char>(c)] = true;
  for (int byte = 0; byte < 256; ++byte) {
    if (!present[byte]) continue;
    char_to_id_[byte] = static_cast<int64_t>(id_to_char_.size());
    id_to_char_.push_back(static_cast<char>(byte));
  }
}

std::vector<int64_t> CharTokenizer::encode(std::string_view text) const {
  std::vector<int64_t> ids;
  ids.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    const int64_t id = char_to_id_[static_cast<unsigned char>(text[i])];
    TORCH_CHECK(id >= 0, "CharTokenizer::encode: character with byte value ",
                static_cast<int>(static_cast<unsigned char>(text[i])), " at position ", i,
                " is not in the vocabulary (", vocab_size(), " characters of the training text)");
    ids.push_back(id);
  }
  return ids;
}

std::string CharTokenizer::decode(const std::vector<int64_t>& ids) const {
  std::string text;
  text.reserve(ids.size());
  for (int64_t id : ids) {
    TORCH_CHECK(id >= 0 && id < vocab_size(), "CharTokenizer::decode: token id ", id,
                " is outside the vocabulary [0, ", vocab_size(), ")");
    text.push_back(id_to_char_[static_cast<size_t>(id)]);
  }
  return text;
}

CharCorpus::CharCorpus(std::string text) : text_(std::move(text)), tokenizer_(text_) {
  tokens_ = at::tensor(tokenizer_.encode(text_), at::kLong);
}

CharCorpus CharCorpus::embedded() { return CharCorpus(std::string(embedded_corpus_text())); }

TokenBatch CharCorpus::sample_batch(const BatchKey& key, int64_t batch, int64_t context) const {
  TORCH_CHECK(batch > 0 && context > 0, "CharCorpus::sample_batch: batch and context must be "
              "positive (got batch ", batch, ", context ", context, ")");
  const int64_t starts_available = num_tokens() - context;  // windows hold context + 1 tokens
  TORCH_CHECK(starts_available > 0, "CharCorpus::sample_batch: a window of context + 1 = ",
              context + 1, " tokens does not fit in the corpus of ", num_tokens(),
              " tokens; use a shorter context");
  at::Generator gen = at::detail::createCPUGenerator(
      mix(mix(mix(key.seed) ^ static_cast<uint64_t>(key.step)) ^ static_cast<uint64_t>(key.rank)));
  const at::Tensor starts = at::randint(starts_available, {batch, 1}, gen, at::kLong);
  const at::Tensor windows = tokens_.index_select(
      0, (starts + at::arange(context + 1, at::kLong)).reshape({-1})).view({batch, context + 1});
  return {windows.narrow(1, 0, context).contiguous(), windows.narrow(1, 1, context).contiguous()};
}

}  // namespace fsdp::examples
