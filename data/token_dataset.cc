#include "fsdp_cpp/data/token_dataset.h"

#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <sstream>
#include <utility>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

namespace fsdp::data {
namespace {

constexpr const char* kApi = "fsdp::data::TokenDataset";
constexpr const char* kFormat = "fsdp-token-dataset";
constexpr int kStateVersion = 1;

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// [Note: the global token stream]: a keyed permutation of [0, n). A balanced Feistel network on
// 2h bits (4^h >= n, h >= 1) is a bijection of [0, 4^h); applying it again until the value falls
// in [0, n) (cycle walking) restricts it to a bijection of [0, n), in fewer than 4 tries on average.
class FeistelPermutation {
 public:
  FeistelPermutation(int64_t n, uint64_t key) : n_(static_cast<uint64_t>(n)) {
    while ((uint64_t{1} << (2 * half_bits_)) < n_) ++half_bits_;
    mask_ = (uint64_t{1} << half_bits_) - 1;
    for (int r = 0; r < kRounds; ++r) round_keys_[r] = splitmix64(key + 0x632be59bd9b4e019ull * (r + 1));
  }
  uint64_t operator()(uint64_t i) const {
    uint64_t x = i;
    do x = encrypt(x);
    while (x >= n_);
    return x;
  }

 private:
  static constexpr int kRounds = 6;
  uint64_t encrypt(uint64_t x) const {
    uint64_t left = x >> half_bits_, right = x & mask_;
    for (int r = 0; r < kRounds; ++r) {
      const uint64_t f = splitmix64(right ^ round_keys_[r]) & mask_;
      const uint64_t next = left ^ f;
      left = right;
      right = next;
    }
    return (left << half_bits_) | right;
  }
  uint64_t n_;
  int half_bits_ = 1;
  uint64_t mask_ = 1;
  uint64_t round_keys_[kRounds] = {};
};

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016" PRIx64, v);
  return buf;
}

}  // namespace

std::string TokenDatasetState::to_string() const {
  nlohmann::ordered_json j;
  j["format"] = kFormat;
  j["version"] = kStateVersion;
  j["fingerprint"] = hex64(fingerprint);
  j["num_tokens"] = num_tokens;
  j["vocab_size"] = vocab_size;
  j["seq_len"] = seq_len;
  j["seed"] = seed;
  j["shuffle"] = shuffle;
  j["epoch"] = epoch;
  j["position"] = position;
  return j.dump();
}

TokenDatasetState TokenDatasetState::parse(const std::string& text) {
  constexpr const char* api = "fsdp::data::TokenDatasetState::parse";
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, api, ": not a dataset state (not JSON: ", e.what(), "): '", text, "'");
  }
  TORCH_CHECK(j.is_object() && j.contains("format") && j["format"] == kFormat, api,
              ": not a dataset state (expected \"format\": \"", kFormat, "\"): '", text, "'");
  TORCH_CHECK(j.contains("version") && j["version"] == kStateVersion, api, ": unknown version ",
              j.contains("version") ? j["version"].dump() : std::string("(none)"), " (expected ", kStateVersion,
              "): '", text, "'");
  auto field = [&](const char* name) -> const nlohmann::json& {
    TORCH_CHECK(j.contains(name), api, ": the state has no \"", name, "\": '", text, "'");
    return j[name];
  };
  auto integer = [&](const char* name) -> int64_t {
    const auto& v = field(name);
    TORCH_CHECK(v.is_number_integer() && (v.is_number_unsigned() ? v.get<uint64_t>() <= INT64_MAX : true), api,
                ": \"", name, "\" is ", v.dump(), " (expected an integer): '", text, "'");
    return v.get<int64_t>();
  };
  TokenDatasetState s;
  const auto& fp = field("fingerprint");
  TORCH_CHECK(fp.is_string() && fp.get<std::string>().size() == 16 &&
                  fp.get<std::string>().find_first_not_of("0123456789abcdef") == std::string::npos,
              api, ": \"fingerprint\" is ", fp.dump(), " (expected 16 lowercase hex digits): '", text, "'");
  s.fingerprint = std::stoull(fp.get<std::string>(), nullptr, 16);
  s.num_tokens = integer("num_tokens");
  s.vocab_size = integer("vocab_size");
  s.seq_len = integer("seq_len");
  const auto& seed = field("seed");
  TORCH_CHECK(seed.is_number_unsigned() || (seed.is_number_integer() && seed.get<int64_t>() >= 0), api,
              ": \"seed\" is ", seed.dump(), " (expected an unsigned integer): '", text, "'");
  s.seed = seed.get<uint64_t>();
  const auto& shuffle = field("shuffle");
  TORCH_CHECK(shuffle.is_boolean(), api, ": \"shuffle\" is ", shuffle.dump(), " (expected true or false): '", text,
              "'");
  s.shuffle = shuffle.get<bool>();
  s.epoch = integer("epoch");
  s.position = integer("position");
  return s;
}

TokenDataset::TokenDataset(std::shared_ptr<const TokenFile> file, TokenDatasetOptions options)
    : file_(std::move(file)), options_(options) {
  TORCH_CHECK(file_ != nullptr, kApi, ": no token file");
  const int64_t t = options_.seq_len();
  TORCH_CHECK(t >= 1, kApi, ": '", file_->path(), "': seq_len ", t, " (expected at least 1)");
  TORCH_CHECK(file_->num_tokens() >= 2 && (file_->num_tokens() - 1) / t >= 1, kApi, ": '", file_->path(), "' holds ",
              file_->num_tokens(), " tokens, fewer than one window of seq_len + 1 = ", t + 1);
  TORCH_CHECK(options_.data_size() >= 1, kApi, ": data_size ", options_.data_size(), " (expected at least 1)");
  TORCH_CHECK(options_.data_rank() >= 0 && options_.data_rank() < options_.data_size(), kApi, ": data_rank ",
              options_.data_rank(), " is outside [0, ", options_.data_size(), ") (data_size ", options_.data_size(), ")");
  num_windows_ = (file_->num_tokens() - 1) / t;
  fingerprint_ = file_->fingerprint();
}

TokenDataset::TokenDataset(const std::string& path, TokenDatasetOptions options)
    : TokenDataset(std::make_shared<const TokenFile>(path), options) {}

int64_t TokenDataset::window_at(int64_t epoch, int64_t i) const {
  TORCH_CHECK(epoch >= 0 && i >= 0 && i < num_windows_, kApi, ": window ", i, " of epoch ", epoch,
              " (expected epoch >= 0 and 0 <= i < ", num_windows_, ")");
  if (!options_.shuffle()) return i;
  const uint64_t key = splitmix64(options_.seed() ^ splitmix64(static_cast<uint64_t>(epoch) + 0x5851f42d4c957f2dull));
  return static_cast<int64_t>(FeistelPermutation(num_windows_, key)(static_cast<uint64_t>(i)));
}

std::pair<at::Tensor, at::Tensor> TokenDataset::window(int64_t window) const {
  TORCH_CHECK(window >= 0 && window < num_windows_, kApi, ": window ", window, " is outside [0, ", num_windows_, ")");
  const int64_t t = seq_len();
  at::Tensor tokens = file_->read(window * t, t + 1);
  return {tokens.narrow(0, 0, t).clone(), tokens.narrow(0, 1, t).clone()};
}

TokenBatch TokenDataset::next_batch(int64_t batch_size) {
  TORCH_CHECK(batch_size >= 1, kApi, ": batch_size ", batch_size, " (expected at least 1)");
  const int64_t t = seq_len();
  const int64_t d = options_.data_size();
  TORCH_CHECK(batch_size <= INT64_MAX / d, kApi, ": batch_size ", batch_size, " * data_size ", d, " overflows");
  TokenBatch batch;
  at::Tensor rows = at::empty({batch_size, t + 1}, at::kLong);
  int64_t* out = rows.data_ptr<int64_t>();
  // The stream's next global batch starts at (epoch_, position_); this rank's rows at r*B of it.
  const int64_t start = position_ + options_.data_rank() * batch_size;
  int64_t epoch = epoch_ + start / num_windows_;
  int64_t i = start % num_windows_;
  // One permutation per epoch reached (a batch may cross several epochs of a tiny file).
  for (int64_t b = 0; b < batch_size; ++b) {
    const int64_t w = window_at(epoch, i);
    file_->read_into(w * t, t + 1, out + b * (t + 1));
    batch.windows.push_back(w);
    batch.epochs.push_back(epoch);
    if (++i == num_windows_) {
      i = 0;
      ++epoch;
    }
  }
  batch.inputs = rows.narrow(1, 0, t).contiguous();
  batch.targets = rows.narrow(1, 1, t).contiguous();
  const int64_t advance = batch_size * d;
  epoch_ += advance / num_windows_;
  position_ += advance % num_windows_;
  if (position_ >= num_windows_) {
    position_ -= num_windows_;
    ++epoch_;
  }
  return batch;
}

TokenDatasetState TokenDataset::state() const {
  TokenDatasetState s;
  s.fingerprint = fingerprint_;
  s.num_tokens = file_->num_tokens();
  s.vocab_size = file_->vocab_size();
  s.seq_len = seq_len();
  s.seed = options_.seed();
  s.shuffle = options_.shuffle();
  s.epoch = epoch_;
  s.position = position_;
  return s;
}

void TokenDataset::load_state(const TokenDatasetState& state) {
  const TokenDatasetState here = this->state();
  std::ostringstream differs;
  auto compare = [&](const char* name, const auto& saved, const auto& mine) {
    if (saved == mine) return;
    differs << (differs.tellp() > 0 ? "; " : "") << name << " " << saved << " in the state, " << mine << " here";
  };
  compare("file fingerprint", hex64(state.fingerprint), hex64(here.fingerprint));
  compare("num_tokens", state.num_tokens, here.num_tokens);
  compare("vocab_size", state.vocab_size, here.vocab_size);
  compare("seq_len", state.seq_len, here.seq_len);
  compare("seed", state.seed, here.seed);
  compare("shuffle", std::string(state.shuffle ? "true" : "false"), std::string(here.shuffle ? "true" : "false"));
  TORCH_CHECK(differs.tellp() == 0, kApi, "::load_state: '", file_->path(),
              "': the state is of another stream (", differs.str(), ")");
  TORCH_CHECK(state.epoch >= 0 && state.position >= 0 && state.position < num_windows_, kApi, "::load_state: '",
              file_->path(), "': position ", state.position, " of epoch ", state.epoch,
              " is outside an epoch (expected epoch >= 0 and 0 <= position < ", num_windows_, ", the windows of an epoch)");
  epoch_ = state.epoch;
  position_ = state.position;
}

}  // namespace fsdp::data
