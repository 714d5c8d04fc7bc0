#include "fsdp_cpp/storage/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace fsdp::storage {
namespace {

constexpr uint32_t kPolynomial = 0x82F63B78;  // 0x1EDC6F41, bit-reversed

// Slicing-by-8 tables: kTables[k][b] is the CRC of byte b followed by k zero bytes.
struct Tables {
  std::array<std::array<uint32_t, 256>, 8> t{};
  Tables() {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t c = b;
      for (int i = 0; i < 8; ++i) c = (c >> 1) ^ ((c & 1) ? kPolynomial : 0);
      t[0][b] = c;
    }
    for (uint32_t b = 0; b < 256; ++b) {
      for (int k = 1; k < 8; ++k) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xff];
    }
  }
};

const Tables& tables() {
  static const Tables instance;
  return instance;
}

// `crc` is the running (inverted) register.
uint32_t software(uint32_t crc, const unsigned char* p, size_t n) {
  const auto& t = tables().t;
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);  // little-endian (x86, ARM)
    const uint64_t x = word ^ crc;
    crc = t[7][x & 0xff] ^ t[6][(x >> 8) & 0xff] ^ t[5][(x >> 16) & 0xff] ^ t[4][(x >> 24) & 0xff] ^
          t[3][(x >> 32) & 0xff] ^ t[2][(x >> 40) & 0xff] ^ t[1][(x >> 48) & 0xff] ^ t[0][x >> 56];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xff];
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t hardware(uint32_t crc, const unsigned char* p, size_t n) {
  uint64_t c = crc;
  while (n >= 32) {  // four independent loads per iteration keep the instruction's pipeline busy
    uint64_t w[4];
    std::memcpy(w, p, 32);
    c = _mm_crc32_u64(c, w[0]);
    c = _mm_crc32_u64(c, w[1]);
    c = _mm_crc32_u64(c, w[2]);
    c = _mm_crc32_u64(c, w[3]);
    p += 32;
    n -= 32;
  }
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n-- > 0) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}

bool detect_hardware() { return __builtin_cpu_supports("sse4.2"); }
#else
uint32_t hardware(uint32_t crc, const unsigned char* p, size_t n) { return software(crc, p, n); }
bool detect_hardware() { return false; }
#endif

}  // namespace

bool crc32c_uses_hardware() {
  static const bool yes = detect_hardware();
  return yes;
}

uint32_t crc32c_extend(uint32_t crc, const void* data, size_t size) {
  const auto* p = static_cast<const unsigned char*>(data);
  const uint32_t reg = ~crc;
  return ~(crc32c_uses_hardware() ? hardware(reg, p, size) : software(reg, p, size));
}

}  // namespace fsdp::storage
