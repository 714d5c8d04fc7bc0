// Token files (data/token_file.h): round trips at both widths against the documented byte layout,
// and every malformed file refused with a message naming the file, what was expected and what was
// found (truncated, longer than its header, bad magic, unknown version, unknown width, a vocabulary
// that does not fit the width, an end-of-text id or a token outside the vocabulary).
#include "fsdp_cpp/data/token_file.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "fsdp_cpp/tests/testing/errors.h"

// Last: LibTorch's c10/util/Logging.h defines its own CHECK, and the last definition wins.
#include <catch2/catch.hpp>

namespace {

using Catch::Matchers::Contains;
using fsdp::data::TokenFile;
using fsdp::data::TokenFileHeader;
using fsdp::testing::error_of;

std::string temp_path(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  const std::string base = dir ? dir : std::filesystem::temp_directory_path().string();
  return base + "/token_file_test_" + std::to_string(::getpid()) + "_" + name;
}

std::vector<unsigned char> file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::vector<unsigned char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// A header followed by raw token bytes, whatever they say.
std::vector<unsigned char> file_of(const TokenFileHeader& header, size_t token_bytes_written) {
  const auto h = fsdp::data::encode_token_file_header(header);
  std::vector<unsigned char> bytes(h.begin(), h.end());
  bytes.resize(bytes.size() + token_bytes_written, 0);
  return bytes;
}

}  // namespace

TEST_CASE("a token file round-trips at both widths in the documented layout", "[data]") {
  for (int width : {2, 4}) {
    INFO("width " << width);
    const int64_t vocab = width == 2 ? 65536 : 100000;
    const std::vector<int64_t> tokens = {0, 1, 7, vocab - 1, 3, 0, 42, vocab - 2};
    const std::string path = temp_path("roundtrip" + std::to_string(width));
    fsdp::data::write_token_file(path, tokens, vocab, /*eot_id=*/3, width);

    // The bytes, by hand: magic, version, width, eot, vocab, count, then little-endian tokens.
    const auto bytes = file_bytes(path);
    REQUIRE(bytes.size() == 32 + tokens.size() * width);
    CHECK(std::memcmp(bytes.data(), "FSDPTOK\0", 8) == 0);
    auto u32 = [&](size_t at) { return bytes[at] | bytes[at + 1] << 8 | bytes[at + 2] << 16 | uint32_t(bytes[at + 3]) << 24; };
    CHECK(u32(8) == 1);
    CHECK(u32(12) == uint32_t(width));
    CHECK(u32(16) == 3);
    CHECK(u32(20) == uint32_t(vocab));
    CHECK(u32(24) == tokens.size());
    CHECK(u32(28) == 0);
    for (size_t i = 0; i < tokens.size(); ++i) {
      int64_t v = 0;
      for (int b = 0; b < width; ++b) v |= int64_t(bytes[32 + i * width + b]) << (8 * b);
      CHECK(v == tokens[i]);
    }

    TokenFile file(path, {.check_tokens = true});
    CHECK(file.num_tokens() == int64_t(tokens.size()));
    CHECK(file.vocab_size() == vocab);
    CHECK(file.eot_id() == 3);
    CHECK(file.token_bytes() == width);
    const at::Tensor all = file.read(0, file.num_tokens());
    CHECK(all.scalar_type() == at::kLong);
    CHECK(all.equal(at::tensor(tokens, at::kLong)));
    CHECK(file.read(2, 3).equal(at::tensor(std::vector<int64_t>{7, vocab - 1, 3}, at::kLong)));
    CHECK(file.token(3) == vocab - 1);
    CHECK(file.read(8, 0).numel() == 0);
    CHECK_THAT(error_of([&] { file.read(6, 3); }), Contains("tokens [6, 9) are outside [0, 8)"));
    CHECK_THAT(error_of([&] { file.token(-1); }), Contains("outside [0, 8)"));

    // Moving keeps the mapping; the moved-from file refuses reads.
    TokenFile moved(std::move(file));
    CHECK(moved.token(2) == 7);
    CHECK_THAT(error_of([&] { file.token(0); }), Contains("moved-from"));  // NOLINT(bugprone-use-after-move)
    std::filesystem::remove(path);
  }
}

TEST_CASE("a token file's fingerprint follows its contents", "[data]") {
  const std::string a = temp_path("fp_a"), b = temp_path("fp_b");
  std::vector<int64_t> tokens(1000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = int64_t(i * 7 % 500);
  fsdp::data::write_token_file(a, tokens, 500, 0);
  fsdp::data::write_token_file(b, tokens, 500, 0);
  CHECK(TokenFile(a).fingerprint() == TokenFile(b).fingerprint());
  tokens[500] = 1;
  fsdp::data::write_token_file(b, tokens, 500, 0);
  CHECK(TokenFile(a).fingerprint() != TokenFile(b).fingerprint());
  fsdp::data::write_token_file(b, std::vector<int64_t>(tokens.begin(), tokens.begin() + 999), 500, 0);
  CHECK(TokenFile(a).fingerprint() != TokenFile(b).fingerprint());

  // Above 1 MiB the fingerprint samples blocks: the first and last tokens are among them.
  std::vector<int64_t> big(1 << 20);
  for (size_t i = 0; i < big.size(); ++i) big[i] = int64_t(i % 60000);
  fsdp::data::write_token_file(a, big, 60000, 0);
  const uint64_t before = TokenFile(a).fingerprint();
  big.back() = 5;
  fsdp::data::write_token_file(b, big, 60000, 0);
  CHECK(TokenFile(b).fingerprint() != before);
  std::filesystem::remove(a);
  std::filesystem::remove(b);
}

TEST_CASE("malformed token files are refused naming the file, what was expected and what was found", "[data]") {
  const std::string path = temp_path("bad");
  TokenFileHeader good;
  good.token_bytes = 2;
  good.eot_id = 0;
  good.vocab_size = 100;
  good.num_tokens = 10;

  SECTION("truncated") {
    auto bytes = file_of(good, 19);
    write_bytes(path, bytes);
    const std::string e = error_of([&] { TokenFile f(path); });
    CHECK_THAT(e, Contains(path));
    CHECK_THAT(e, Contains("is truncated: expected 32 + 10 * 2 = 52 bytes (10 tokens of 2 bytes), found 51 bytes"));
  }
  SECTION("shorter than the header") {
    write_bytes(path, {'F', 'S', 'D', 'P'});
    CHECK_THAT(error_of([&] { TokenFile f(path); }),
               Contains("'" + path + "' is truncated: expected at least the 32-byte header, found 4 bytes"));
  }
  SECTION("longer than its header says") {
    write_bytes(path, file_of(good, 22));
    CHECK_THAT(error_of([&] { TokenFile f(path); }),
               Contains("longer than its header says: expected 32 + 10 * 2 = 52 bytes (10 tokens of 2 bytes), found 54 bytes"));
  }
  SECTION("bad magic") {
    auto bytes = file_of(good, 20);
    std::memcpy(bytes.data(), "GPT2TOKS", 8);
    write_bytes(path, bytes);
    const std::string e = error_of([&] { TokenFile f(path); });
    CHECK_THAT(e, Contains("'" + path + "' is not a token file: bad magic: expected \"FSDPTOK\\0\" "
                           "(46 53 44 50 54 4f 4b 00), found 47 50 54 32 54 4f 4b 53"));
  }
  SECTION("unknown version") {
    TokenFileHeader h = good;
    h.version = 2;
    write_bytes(path, file_of(h, 20));
    CHECK_THAT(error_of([&] { TokenFile f(path); }), Contains("'" + path + "': unknown version 2 (expected 1)"));
  }
  SECTION("unknown width") {
    TokenFileHeader h = good;
    h.token_bytes = 3;
    write_bytes(path, file_of(h, 30));
    CHECK_THAT(error_of([&] { TokenFile f(path); }),
               Contains("'" + path + "': unknown token width 3 bytes (expected 2 = uint16 or 4 = uint32)"));
  }
  SECTION("the wrong width: a uint32 file whose header says 2 bytes") {
    // 10 uint32 tokens behind a header claiming uint16: the size tells.
    write_bytes(path, file_of(good, 40));
    CHECK_THAT(error_of([&] { TokenFile f(path); }),
               Contains("expected 32 + 10 * 2 = 52 bytes (10 tokens of 2 bytes), found 72 bytes"));
  }
  SECTION("a vocabulary that does not fit 2-byte tokens") {
    TokenFileHeader h = good;
    h.vocab_size = 70000;
    write_bytes(path, file_of(h, 20));
    CHECK_THAT(error_of([&] { TokenFile f(path); }),
               Contains("a vocabulary of 70000 does not fit 2-byte tokens (expected at most 65536)"));
  }
  SECTION("an end-of-text id outside the vocabulary") {
    TokenFileHeader h = good;
    h.eot_id = 100;
    write_bytes(path, file_of(h, 20));
    CHECK_THAT(error_of([&] { TokenFile f(path); }),
               Contains("end-of-text id 100 is outside the vocabulary (size 100)"));
  }
  SECTION("an empty vocabulary") {
    TokenFileHeader h = good;
    h.vocab_size = 0;
    write_bytes(path, file_of(h, 20));
    CHECK_THAT(error_of([&] { TokenFile f(path); }), Contains("vocabulary size 0 (expected at least 1)"));
  }
  SECTION("a token count that overflows") {
    TokenFileHeader h = good;
    h.num_tokens = ~uint64_t{0} / 2;
    write_bytes(path, file_of(h, 20));
    CHECK_THAT(error_of([&] { TokenFile f(path); }), Contains("is too large"));
  }
  SECTION("a token outside the vocabulary, when checked") {
    TokenFileHeader h = good;
    h.token_bytes = 4;
    auto bytes = file_of(h, 40);
    bytes[32 + 6 * 4] = 0x2c;  // token 6 = 300
    bytes[32 + 6 * 4 + 1] = 0x01;
    write_bytes(path, bytes);
    TokenFile unchecked(path);  // the default open does not read the tokens
    CHECK(unchecked.token(6) == 300);
    const std::string expected = "'" + path + "': token 300 at index 6 is outside the vocabulary "
                                 "(expected every token < 100, the vocabulary size)";
    CHECK_THAT(error_of([&] { unchecked.check_tokens(); }), Contains(expected));
    CHECK_THAT(error_of([&] { TokenFile f(path, {.check_tokens = true}); }), Contains(expected));
  }
  SECTION("a missing file") {
    CHECK_THAT(error_of([&] { TokenFile f(path + ".none"); }), Contains("cannot open '" + path + ".none'"));
  }
  SECTION("the writer refuses tokens outside the vocabulary") {
    CHECK_THAT(error_of([&] { fsdp::data::write_token_file(path, {1, 2, 100}, 100, 0); }),
               Contains("token 100 at index 2 is outside the vocabulary (size 100)"));
    CHECK_THAT(error_of([&] { fsdp::data::write_token_file(path, {1}, 70000, 0, 2); }),
               Contains("a vocabulary of 70000 does not fit 2-byte tokens"));
  }
  std::filesystem::remove(path);
}
