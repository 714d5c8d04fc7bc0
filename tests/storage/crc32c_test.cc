// CRC-32C against its definition (a bit-by-bit loop) and published check values, on every
// length and alignment the word loops distinguish, and extended piece by piece.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "fsdp_cpp/storage/crc32c.h"

namespace {

uint32_t bitwise(const unsigned char* p, size_t n) {
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ ((c & 1u) ? 0x82F63B78u : 0u);
  }
  return ~c;
}

}  // namespace

TEST_CASE("crc32c matches the published check values", "[crc32c]") {
  INFO("hardware path: " << fsdp::storage::crc32c_uses_hardware());
  CHECK(fsdp::storage::crc32c("123456789", 9) == 0xE3069283u);
  CHECK(fsdp::storage::crc32c("", 0) == 0u);
  const std::vector<unsigned char> zeros(32, 0), ones(32, 0xFF);
  CHECK(fsdp::storage::crc32c(zeros.data(), 32) == 0x8A9136AAu);  // RFC 3720, B.4
  CHECK(fsdp::storage::crc32c(ones.data(), 32) == 0x62A8AB43u);
}

TEST_CASE("crc32c equals the bit-by-bit definition at every length and alignment", "[crc32c]") {
  std::mt19937 gen(7);
  std::vector<unsigned char> data(300);
  for (auto& b : data) b = static_cast<unsigned char>(gen());
  for (size_t offset = 0; offset < 8; ++offset) {
    for (size_t n = 0; n + offset <= data.size(); ++n) {
      INFO("offset " << offset << ", length " << n);
      REQUIRE(fsdp::storage::crc32c(data.data() + offset, n) == bitwise(data.data() + offset, n));
    }
  }
}

TEST_CASE("crc32c_extend over pieces equals the crc of the whole", "[crc32c]") {
  std::mt19937 gen(11);
  std::vector<unsigned char> data(5000);
  for (auto& b : data) b = static_cast<unsigned char>(gen());
  const uint32_t whole = bitwise(data.data(), data.size());
  for (size_t piece : {1, 3, 8, 31, 32, 33, 1000}) {
    uint32_t c = 0;
    for (size_t at = 0; at < data.size(); at += piece) {
      c = fsdp::storage::crc32c_extend(c, data.data() + at, std::min(piece, data.size() - at));
    }
    INFO("pieces of " << piece);
    CHECK(c == whole);
  }
}

// The long and short stretches of [Note: three CRC streams] (3 x 8 KiB and 3 x 256 bytes), their
// joins and the single-stream tail: lengths on either side of each boundary, at odd alignments.
TEST_CASE("crc32c over three streams equals the definition on long inputs", "[crc32c]") {
  std::mt19937 gen(13);
  std::vector<unsigned char> data(3 * 8192 * 2 + 3 * 256 * 3 + 64);
  for (auto& b : data) b = static_cast<unsigned char>(gen());
  for (size_t base : {size_t{767}, size_t{768}, size_t{3 * 8192}, size_t{2 * 3 * 8192}, size_t{3 * 8192 + 3 * 256}}) {
    for (size_t delta : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{255}, size_t{257}}) {
      for (size_t offset : {size_t{0}, size_t{3}}) {
        const size_t n = base + delta;
        if (offset + n > data.size()) continue;
        INFO("offset " << offset << ", length " << n);
        REQUIRE(fsdp::storage::crc32c(data.data() + offset, n) == bitwise(data.data() + offset, n));
      }
    }
  }
  // Extending across the stretches' boundaries.
  uint32_t c = 0;
  for (size_t at = 0; at < data.size(); at += 10000) {
    c = fsdp::storage::crc32c_extend(c, data.data() + at, std::min<size_t>(10000, data.size() - at));
  }
  CHECK(c == bitwise(data.data(), data.size()));
}
