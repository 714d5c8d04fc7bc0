#include "fsdp_cpp/data/token_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <sstream>
#include <utility>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace fsdp::data {
namespace {

constexpr const char* kOpen = "fsdp::data::TokenFile";
constexpr const char* kWrite = "fsdp::data::write_token_file";

std::string error_text(int err) { return std::strerror(err); }

// Little-endian loads and stores, whatever the host's byte order.
template <typename T>
T load_le(const unsigned char* p) {
  T value = 0;
  for (size_t i = 0; i < sizeof(T); ++i) value |= static_cast<T>(p[i]) << (8 * i);
  return value;
}

template <typename T>
void store_le(unsigned char* p, T value) {
  for (size_t i = 0; i < sizeof(T); ++i) p[i] = static_cast<unsigned char>(value >> (8 * i));
}

std::string hex_bytes(const unsigned char* p, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    if (i) out += ' ';
    out += digits[p[i] >> 4];
    out += digits[p[i] & 15];
  }
  return out;
}

uint64_t fnv1a(uint64_t hash, const unsigned char* p, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    hash ^= p[i];
    hash *= 1099511628211ull;
  }
  return hash;
}

// Tokens [start, start + count) of width W at `base` into int64.
template <typename T>
void widen(const unsigned char* base, int64_t start, int64_t count, int64_t* out) {
  const unsigned char* p = base + start * static_cast<int64_t>(sizeof(T));
  if constexpr (std::endian::native == std::endian::little) {
    const T* tokens = reinterpret_cast<const T*>(p);  // aligned: the data starts at byte 32
    for (int64_t i = 0; i < count; ++i) out[i] = tokens[i];
  } else {
    for (int64_t i = 0; i < count; ++i) out[i] = load_le<T>(p + i * sizeof(T));
  }
}

}  // namespace

std::array<unsigned char, kTokenFileHeaderBytes> encode_token_file_header(const TokenFileHeader& header) {
  std::array<unsigned char, kTokenFileHeaderBytes> bytes{};
  std::memcpy(bytes.data(), kTokenFileMagic.data(), kTokenFileMagic.size());
  store_le<uint32_t>(bytes.data() + 8, header.version);
  store_le<uint32_t>(bytes.data() + 12, header.token_bytes);
  store_le<uint32_t>(bytes.data() + 16, header.eot_id);
  store_le<uint32_t>(bytes.data() + 20, header.vocab_size);
  store_le<uint64_t>(bytes.data() + 24, header.num_tokens);
  return bytes;
}

TokenFile::TokenFile(std::string path, TokenFileOptions options) : path_(std::move(path)) {
  const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, kOpen, ": cannot open '", path_, "': ", error_text(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    TORCH_CHECK(false, kOpen, ": cannot stat '", path_, "': ", error_text(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    TORCH_CHECK(false, kOpen, ": '", path_, "' is not a regular file");
  }
  const int64_t size = st.st_size;
  if (size < kTokenFileHeaderBytes) {
    ::close(fd);
    TORCH_CHECK(false, kOpen, ": '", path_, "' is truncated: expected at least the ", kTokenFileHeaderBytes,
                "-byte header, found ", size, " bytes");
  }
  void* mapped = ::mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_SHARED, fd, 0);
  const int map_errno = errno;
  ::close(fd);  // the mapping keeps the file
  TORCH_CHECK(mapped != MAP_FAILED, kOpen, ": cannot map '", path_, "' (", size, " bytes): ", error_text(map_errno));
  map_ = static_cast<const unsigned char*>(mapped);
  map_bytes_ = size;
  try {
    TORCH_CHECK(std::memcmp(map_, kTokenFileMagic.data(), kTokenFileMagic.size()) == 0, kOpen, ": '", path_,
                "' is not a token file: bad magic: expected \"FSDPTOK\\0\" (",
                hex_bytes(reinterpret_cast<const unsigned char*>(kTokenFileMagic.data()), 8), "), found ",
                hex_bytes(map_, 8));
    header_.version = load_le<uint32_t>(map_ + 8);
    header_.token_bytes = load_le<uint32_t>(map_ + 12);
    header_.eot_id = load_le<uint32_t>(map_ + 16);
    header_.vocab_size = load_le<uint32_t>(map_ + 20);
    header_.num_tokens = load_le<uint64_t>(map_ + 24);
    TORCH_CHECK(header_.version == kTokenFileVersion, kOpen, ": '", path_, "': unknown version ", header_.version,
                " (expected ", kTokenFileVersion, ")");
    TORCH_CHECK(header_.token_bytes == 2 || header_.token_bytes == 4, kOpen, ": '", path_,
                "': unknown token width ", header_.token_bytes, " bytes (expected 2 = uint16 or 4 = uint32)");
    TORCH_CHECK(header_.vocab_size > 0, kOpen, ": '", path_, "': vocabulary size 0 (expected at least 1)");
    TORCH_CHECK(header_.token_bytes == 4 || header_.vocab_size <= (1u << 16), kOpen, ": '", path_,
                "': a vocabulary of ", header_.vocab_size, " does not fit 2-byte tokens (expected at most 65536)");
    TORCH_CHECK(header_.eot_id < header_.vocab_size, kOpen, ": '", path_, "': end-of-text id ", header_.eot_id,
                " is outside the vocabulary (size ", header_.vocab_size, ")");
    const uint64_t max_tokens = static_cast<uint64_t>(std::numeric_limits<int64_t>::max() - kTokenFileHeaderBytes) /
                                header_.token_bytes;
    const uint64_t n = header_.num_tokens;
    TORCH_CHECK(n <= max_tokens, kOpen, ": '", path_, "': the header's token count ", n,
                " is too large (expected header + count * ", header_.token_bytes, " = ", size, " bytes)");
    const int64_t expected = kTokenFileHeaderBytes + static_cast<int64_t>(n) * header_.token_bytes;
    TORCH_CHECK(size == expected, kOpen, ": '", path_, "' is ", size < expected ? "truncated" : "longer than its header says",
                ": expected ", kTokenFileHeaderBytes, " + ", n, " * ", header_.token_bytes, " = ", expected,
                " bytes (", n, " tokens of ", header_.token_bytes, " bytes), found ", size, " bytes");
    if (options.check_tokens) check_tokens();
  } catch (...) {
    unmap();
    throw;
  }
}

TokenFile::~TokenFile() { unmap(); }

TokenFile::TokenFile(TokenFile&& other) noexcept
    : path_(std::move(other.path_)), header_(other.header_), map_(std::exchange(other.map_, nullptr)),
      map_bytes_(std::exchange(other.map_bytes_, 0)) {}

TokenFile& TokenFile::operator=(TokenFile&& other) noexcept {
  if (this != &other) {
    unmap();
    path_ = std::move(other.path_);
    header_ = other.header_;
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
  }
  return *this;
}

void TokenFile::unmap() noexcept {
  if (map_ != nullptr) ::munmap(const_cast<unsigned char*>(map_), static_cast<size_t>(map_bytes_));
  map_ = nullptr;
  map_bytes_ = 0;
}

int64_t TokenFile::token(int64_t i) const {
  int64_t value = 0;
  read_into(i, 1, &value);
  return value;
}

void TokenFile::read_into(int64_t start, int64_t count, int64_t* out) const {
  TORCH_CHECK(map_ != nullptr, kOpen, ": read from a moved-from TokenFile");
  TORCH_CHECK(start >= 0 && count >= 0 && start <= num_tokens() && count <= num_tokens() - start, kOpen, ": '", path_,
              "': tokens [", start, ", ", start + count, ") are outside [0, ", num_tokens(), ")");
  const unsigned char* base = map_ + kTokenFileHeaderBytes;
  if (header_.token_bytes == 2) {
    widen<uint16_t>(base, start, count, out);
  } else {
    widen<uint32_t>(base, start, count, out);
  }
}

at::Tensor TokenFile::read(int64_t start, int64_t count) const {
  at::Tensor out = at::empty({count}, at::kLong);
  read_into(start, count, out.data_ptr<int64_t>());
  return out;
}

void TokenFile::check_tokens() const {
  TORCH_CHECK(map_ != nullptr, kOpen, ": check_tokens on a moved-from TokenFile");
  constexpr int64_t kChunk = 1 << 16;
  std::vector<int64_t> buffer(kChunk);
  for (int64_t start = 0; start < num_tokens(); start += kChunk) {
    const int64_t count = std::min(kChunk, num_tokens() - start);
    read_into(start, count, buffer.data());
    for (int64_t i = 0; i < count; ++i) {
      TORCH_CHECK(buffer[i] < vocab_size(), kOpen, ": '", path_, "': token ", buffer[i], " at index ", start + i,
                  " is outside the vocabulary (expected every token < ", vocab_size(), ", the vocabulary size)");
    }
  }
}

uint64_t TokenFile::fingerprint() const {
  TORCH_CHECK(map_ != nullptr, kOpen, ": fingerprint of a moved-from TokenFile");
  uint64_t hash = fnv1a(14695981039346656037ull, map_, kTokenFileHeaderBytes);
  const unsigned char* data = map_ + kTokenFileHeaderBytes;
  const int64_t bytes = map_bytes_ - kTokenFileHeaderBytes;
  constexpr int64_t kAll = int64_t{1} << 20, kBlock = int64_t{16} << 10, kBlocks = 64;
  if (bytes <= kAll) return fnv1a(hash, data, static_cast<size_t>(bytes));
  for (int64_t i = 0; i < kBlocks; ++i) {
    const int64_t offset = (bytes - kBlock) * i / (kBlocks - 1);  // 0, ..., bytes - kBlock
    hash = fnv1a(hash, data + offset, kBlock);
  }
  return hash;
}

void write_token_file(const std::string& path, const std::vector<int64_t>& tokens, int64_t vocab_size,
                      int64_t eot_id, int token_bytes) {
  TORCH_CHECK(vocab_size > 0 && vocab_size <= (int64_t{1} << 32), kWrite, ": '", path, "': vocabulary size ",
              vocab_size, " (expected 1 to 2^32)");
  if (token_bytes == 0) token_bytes = vocab_size <= (int64_t{1} << 16) ? 2 : 4;
  TORCH_CHECK(token_bytes == 2 || token_bytes == 4, kWrite, ": '", path, "': token width ", token_bytes,
              " (expected 2 or 4)");
  TORCH_CHECK(token_bytes == 4 || vocab_size <= (int64_t{1} << 16), kWrite, ": '", path, "': a vocabulary of ",
              vocab_size, " does not fit 2-byte tokens");
  TORCH_CHECK(eot_id >= 0 && eot_id < vocab_size, kWrite, ": '", path, "': end-of-text id ", eot_id,
              " is outside the vocabulary (size ", vocab_size, ")");
  TokenFileHeader header;
  header.token_bytes = static_cast<uint32_t>(token_bytes);
  header.eot_id = static_cast<uint32_t>(eot_id);
  header.vocab_size = static_cast<uint32_t>(vocab_size);
  header.num_tokens = tokens.size();
  std::vector<unsigned char> bytes(kTokenFileHeaderBytes + tokens.size() * token_bytes);
  const auto encoded = encode_token_file_header(header);
  std::memcpy(bytes.data(), encoded.data(), encoded.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    TORCH_CHECK(tokens[i] >= 0 && tokens[i] < vocab_size, kWrite, ": '", path, "': token ", tokens[i], " at index ",
                i, " is outside the vocabulary (size ", vocab_size, ")");
    unsigned char* p = bytes.data() + kTokenFileHeaderBytes + i * token_bytes;
    if (token_bytes == 2) {
      store_le<uint16_t>(p, static_cast<uint16_t>(tokens[i]));
    } else {
      store_le<uint32_t>(p, static_cast<uint32_t>(tokens[i]));
    }
  }
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  TORCH_CHECK(f != nullptr, kWrite, ": cannot create '", tmp, "': ", error_text(errno));
  const size_t written = std::fwrite(bytes.data(), 1, bytes.size(), f);
  const int write_errno = errno;
  const bool closed = std::fclose(f) == 0;
  if (written != bytes.size() || !closed) {
    std::remove(tmp.c_str());
    TORCH_CHECK(false, kWrite, ": writing '", tmp, "' failed: ", error_text(write_errno));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    TORCH_CHECK(false, kWrite, ": renaming '", tmp, "' to '", path, "' failed: ", error_text(err));
  }
}

}  // namespace fsdp::data
