#include "fsdp_cpp/storage/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <set>
#include <thread>
#include <utility>

#include <ATen/ops/empty.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "fsdp_cpp/storage/crc32c.h"

namespace fsdp::storage {
namespace {

using Json = nlohmann::ordered_json;

constexpr const char* kMetadataKey = "__metadata__";
// Largest header accepted (the Rust implementation's limit), so a corrupt length cannot make the
// reader allocate gigabytes.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// Deepest nesting of arrays and objects accepted in a header (serde_json's default recursion
// limit, which the Rust implementation reads headers with; a valid header nests 3 deep). Deeper
// headers are refused before parsing: nlohmann's ordered_json copies an object's members when it
// grows (std::pair<const std::string, json> cannot be moved), and copying a value nested a
// hundred thousand deep recursed until the stack overflowed (found by tools/fuzz).
constexpr int kMaxHeaderNesting = 128;
// Bytes handed to one write() call and checksummed just before it, so the data is still in cache.
constexpr int64_t kWriteChunkBytes = int64_t{16} << 20;
// Largest buffer verify() reads a checksum block into at once.
constexpr int64_t kVerifyChunkBytes = int64_t{8} << 20;

std::string error_text(int err) { return std::strerror(err); }

struct DtypeName {
  c10::ScalarType dtype;
  const char* name;
};

constexpr DtypeName kDtypeNames[] = {
    {c10::ScalarType::Double, "F64"},        {c10::ScalarType::Float, "F32"},
    {c10::ScalarType::Half, "F16"},          {c10::ScalarType::BFloat16, "BF16"},
    {c10::ScalarType::Long, "I64"},          {c10::ScalarType::Int, "I32"},
    {c10::ScalarType::Short, "I16"},         {c10::ScalarType::Char, "I8"},
    {c10::ScalarType::Byte, "U8"},           {c10::ScalarType::Bool, "BOOL"},
    {c10::ScalarType::UInt16, "U16"},        {c10::ScalarType::UInt32, "U32"},
    {c10::ScalarType::UInt64, "U64"},        {c10::ScalarType::ComplexFloat, "C64"},
    {c10::ScalarType::Float8_e4m3fn, "F8_E4M3"}, {c10::ScalarType::Float8_e5m2, "F8_E5M2"},
};

int64_t checked_numel(const std::vector<int64_t>& shape, bool* overflow) {
  int64_t numel = 1;
  *overflow = false;
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(numel, d, &numel)) *overflow = true;
  }
  return numel;
}

// Blocks of `block` bytes covering `nbytes` (without overflow: a header may declare any block size).
int64_t block_count(int64_t nbytes, int64_t block) { return nbytes / block + (nbytes % block != 0 ? 1 : 0); }

std::string hex8(uint32_t value) {
  char text[9];
  std::snprintf(text, sizeof(text), "%08x", value);
  return text;
}

// Writes all of [data, data + size) at file offset `offset` (loops over short writes and EINTR).
void pwrite_all(int fd, const void* data, int64_t size, int64_t offset, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::pwrite(fd, p, static_cast<size_t>(size), offset);
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n > 0, "write_safetensors: writing '", path, "' at offset ", offset, " failed: ",
                n < 0 ? error_text(errno) : std::string("no progress"));
    p += n;
    size -= n;
    offset += n;
  }
}


// Accumulates the CRC-32C of consecutive blocks of one entry's bytes, fed in pieces of any size.
class BlockCrc {
 public:
  explicit BlockCrc(int64_t block) : block_(block) {}
  void update(const unsigned char* data, int64_t size) {
    while (size > 0) {
      const int64_t take = std::min(size, block_ - filled_);
      crc_ = crc32c_extend(crc_, data, static_cast<size_t>(take));
      filled_ += take;
      data += take;
      size -= take;
      if (filled_ == block_) flush();
    }
  }
  /// The checksums of all blocks, the last (shorter) one included.
  std::vector<uint32_t> finish() {
    if (filled_ > 0) flush();
    return std::move(crcs_);
  }

 private:
  void flush() {
    crcs_.push_back(crc_);
    crc_ = 0;
    filled_ = 0;
  }
  int64_t block_;
  int64_t filled_ = 0;
  uint32_t crc_ = 0;
  std::vector<uint32_t> crcs_;
};

// The header JSON text (padded with spaces so that 8 + its length is a multiple of 8).
// `crcs[i]` are item i's block checksums, or empty placeholders of the right count.
std::string header_text(const std::vector<SafetensorsEntrySpec>& items, const std::vector<int64_t>& offsets,
                        const std::vector<std::vector<uint32_t>>& crcs,
                        const std::map<std::string, std::string>& metadata, int64_t crc_block_bytes,
                        const std::string& path) {
  Json header = Json::object();
  if (!metadata.empty() || crc_block_bytes > 0) {
    Json meta = Json::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    if (crc_block_bytes > 0) {
      Json crc = Json::object();
      for (size_t i = 0; i < items.size(); ++i) {
        Json list = Json::array();
        for (uint32_t c : crcs[i]) list.push_back(hex8(c));
        crc[items[i].key] = std::move(list);
      }
      meta[kCrcBlockKey] = std::to_string(crc_block_bytes);
      meta[kCrcKey] = crc.dump();
    }
    header[kMetadataKey] = std::move(meta);
  }
  for (size_t i = 0; i < items.size(); ++i) {
    Json entry = Json::object();
    entry["dtype"] = safetensors_dtype_name(items[i].dtype);
    entry["shape"] = items[i].shape;
    entry["data_offsets"] = {offsets[i], offsets[i + 1]};
    header[items[i].key] = std::move(entry);
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const Json::exception& e) {
    TORCH_CHECK(false, "write_safetensors: cannot encode the header of '", path,
                "' (keys and metadata must be valid UTF-8): ", e.what());
  }
  text.append((8 - (text.size() % 8)) % 8, ' ');
  return text;
}

// Closes the file and removes it unless released (a failed write leaves no half-written file).
class PartialFile {
 public:
  PartialFile(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  ~PartialFile() {
    if (fd_ >= 0) {
      ::close(fd_);
      ::unlink(path_.c_str());
    }
  }
  PartialFile(const PartialFile&) = delete;
  PartialFile& operator=(const PartialFile&) = delete;
  int fd() const { return fd_; }
  void close_and_keep() {
    const int fd = fd_;
    fd_ = -1;
    TORCH_CHECK(::close(fd) == 0, "write_safetensors: closing '", path_, "' failed: ", error_text(errno));
  }

 private:
  int fd_;
  std::string path_;
};

std::string describe(const Json& value) {
  std::string text = value.dump();
  if (text.size() > 80) text = text.substr(0, 77) + "...";
  return text;
}

}  // namespace

void pread_all(int fd, void* data, int64_t size, int64_t offset, const std::string& path, const char* api) {
  char* p = static_cast<char*>(data);
  while (size > 0) {
    const ssize_t n = ::pread(fd, p, static_cast<size_t>(size), offset);
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n >= 0, api, ": reading '", path, "' at offset ", offset, " failed: ", error_text(errno));
    TORCH_CHECK(n > 0, api, ": unexpected end of '", path, "' at offset ", offset, " (", size,
                " more bytes expected; was the file truncated?)");
    p += n;
    size -= n;
    offset += n;
  }
}

std::string safetensors_dtype_name(c10::ScalarType dtype) {
  for (const auto& d : kDtypeNames) {
    if (d.dtype == dtype) return d.name;
  }
  TORCH_CHECK(false, "safetensors: dtype ", dtype, " has no safetensors name (supported: F64, F32, F16, BF16, "
              "I64, I32, I16, I8, U64, U32, U16, U8, BOOL, C64, F8_E4M3, F8_E5M2)");
}

c10::ScalarType scalar_type_from_safetensors(const std::string& name, const std::string& context) {
  for (const auto& d : kDtypeNames) {
    if (name == d.name) return d.dtype;
  }
  TORCH_CHECK(false, "safetensors: ", context, ": unsupported dtype '", name,
              "' (supported: F64, F32, F16, BF16, I64, I32, I16, I8, U64, U32, U16, U8, BOOL, C64, F8_E4M3, "
              "F8_E5M2)");
}

int64_t SafetensorsEntry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

const SafetensorsEntry* SafetensorsHeader::find(const std::string& key) const {
  for (const auto& e : entries) {
    if (e.key == key) return &e;
  }
  return nullptr;
}

const SafetensorsEntry& SafetensorsHeader::at(const std::string& key) const {
  const auto* e = find(key);
  TORCH_CHECK(e != nullptr, "safetensors: '", path, "' has no entry '", key, "' (it has ", entries.size(),
              " entries)");
  return *e;
}

struct SafetensorsWriter::Impl {
  std::string path;
  std::vector<SafetensorsEntrySpec> entries;
  std::map<std::string, std::string> metadata;
  int64_t crc_block_bytes;
  std::map<std::string, size_t> index;
  std::vector<int64_t> offsets{0};
  std::vector<std::vector<uint32_t>> crcs;
  std::vector<bool> written;
  int64_t data_start = 0;
  size_t header_size = 0;
  std::unique_ptr<PartialFile> file;
};

SafetensorsWriter::SafetensorsWriter(std::string path, std::vector<SafetensorsEntrySpec> entries,
                                     std::map<std::string, std::string> metadata, int64_t crc_block_bytes)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.path = std::move(path);
  m.entries = std::move(entries);
  m.metadata = std::move(metadata);
  m.crc_block_bytes = crc_block_bytes;
  const std::string& p = m.path;
  TORCH_CHECK(crc_block_bytes >= 0, "write_safetensors: '", p, "': the checksum block size must be positive "
              "(or 0 for no checksums), got ", crc_block_bytes);
  if (crc_block_bytes > 0) {
    TORCH_CHECK(m.metadata.count(kCrcBlockKey) == 0 && m.metadata.count(kCrcKey) == 0, "write_safetensors: '", p,
                "': metadata keys '", kCrcBlockKey, "' and '", kCrcKey, "' are reserved for the checksums");
  }
  m.crcs.resize(m.entries.size());
  m.written.assign(m.entries.size(), false);
  for (size_t i = 0; i < m.entries.size(); ++i) {
    const auto& e = m.entries[i];
    TORCH_CHECK(!e.key.empty() && e.key != kMetadataKey, "write_safetensors: '", p, "': invalid key '", e.key, "'");
    TORCH_CHECK(m.index.emplace(e.key, i).second, "write_safetensors: '", p, "': key '", e.key, "' appears twice");
    safetensors_dtype_name(e.dtype);  // checks the dtype before any I/O
    int64_t numel = 1;
    for (const int64_t d : e.shape) {
      TORCH_CHECK(d >= 0, "write_safetensors: '", p, "': tensor '", e.key, "' has a negative dimension");
      numel *= d;
    }
    const int64_t nbytes = numel * static_cast<int64_t>(c10::elementSize(e.dtype));
    m.offsets.push_back(m.offsets.back() + nbytes);
    if (crc_block_bytes > 0) m.crcs[i].assign(static_cast<size_t>(block_count(nbytes, crc_block_bytes)), 0);
  }
  // Placeholder checksums have the same width as the real ones: the header's length is final.
  const std::string placeholder = header_text(m.entries, m.offsets, m.crcs, m.metadata, crc_block_bytes, p);
  m.header_size = placeholder.size();
  m.data_start = 8 + static_cast<int64_t>(placeholder.size());
  int raw_fd;
  do {
    raw_fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  } while (raw_fd < 0 && errno == EINTR);
  TORCH_CHECK(raw_fd >= 0, "write_safetensors: cannot create '", p, "': ", error_text(errno));
  m.file = std::make_unique<PartialFile>(raw_fd, p);
}

SafetensorsWriter::~SafetensorsWriter() = default;

void SafetensorsWriter::write(const std::string& key, const at::Tensor& tensor) {
  Impl& m = *impl_;
  const std::string& p = m.path;
  TORCH_CHECK(m.file, "write_safetensors: '", p, "' is already finished");
  const auto it = m.index.find(key);
  TORCH_CHECK(it != m.index.end(), "write_safetensors: '", p, "': key '", key, "' is not one of the file's entries");
  const size_t i = it->second;
  TORCH_CHECK(!m.written[i], "write_safetensors: '", p, "': tensor '", key, "' is written twice");
  TORCH_CHECK(tensor.defined(), "write_safetensors: '", p, "': tensor '", key, "' is undefined");
  TORCH_CHECK(tensor.layout() == c10::kStrided && !tensor.is_meta(), "write_safetensors: '", p, "': tensor '", key,
              "' has no data to write (layout ", tensor.layout(), ", device ", tensor.device(),
              "); a dense tensor with storage is expected");
  TORCH_CHECK(tensor.scalar_type() == m.entries[i].dtype && tensor.sizes().vec() == m.entries[i].shape,
              "write_safetensors: '", p, "': tensor '", key, "' is ", tensor.scalar_type(), " ", tensor.sizes(),
              ", the header says ", m.entries[i].dtype, " ", c10::IntArrayRef(m.entries[i].shape));
  at::Tensor t = tensor;
  if (!t.device().is_cpu()) t = t.to(c10::kCPU);
  t = t.resolve_conj().resolve_neg().contiguous();  // no copy when already contiguous
  const auto* bytes = static_cast<const unsigned char*>(t.const_data_ptr());
  const int64_t nbytes = m.offsets[i + 1] - m.offsets[i];
  BlockCrc crc(m.crc_block_bytes > 0 ? m.crc_block_bytes : 1);
  // CRC-32C runs several times faster than copying into the page cache: inline, chunk by chunk.
  for (int64_t done = 0; done < nbytes;) {
    const int64_t chunk = std::min(kWriteChunkBytes, nbytes - done);
    if (m.crc_block_bytes > 0) crc.update(bytes + done, chunk);
    pwrite_all(m.file->fd(), bytes + done, chunk, m.data_start + m.offsets[i] + done, p);
    // Start writing this chunk back to the disk now (asynchronously), so that the disk works
    // while the next chunks are copied and the final fsync has little left to wait for.
    ::sync_file_range(m.file->fd(), m.data_start + m.offsets[i] + done, chunk, SYNC_FILE_RANGE_WRITE);
    done += chunk;
  }
  if (m.crc_block_bytes > 0) m.crcs[i] = crc.finish();
  m.written[i] = true;
}

void SafetensorsWriter::finish() {
  Impl& m = *impl_;
  const std::string& p = m.path;
  TORCH_CHECK(m.file, "write_safetensors: '", p, "' is already finished");
  for (size_t i = 0; i < m.entries.size(); ++i) {
    TORCH_CHECK(m.written[i], "write_safetensors: '", p, "': tensor '", m.entries[i].key, "' was never written");
  }
  const std::string text = header_text(m.entries, m.offsets, m.crcs, m.metadata, m.crc_block_bytes, p);
  TORCH_INTERNAL_ASSERT(text.size() == m.header_size, "write_safetensors: header of '", p,
                        "' changed length from ", m.header_size, " to ", text.size());
  unsigned char length[8];
  for (int b = 0; b < 8; ++b) length[b] = static_cast<unsigned char>((uint64_t{text.size()} >> (8 * b)) & 0xff);
  std::string prefix(reinterpret_cast<const char*>(length), 8);
  prefix += text;
  pwrite_all(m.file->fd(), prefix.data(), static_cast<int64_t>(prefix.size()), 0, p);
  int rc;
  do {
    rc = ::fsync(m.file->fd());
  } while (rc != 0 && errno == EINTR);
  TORCH_CHECK(rc == 0, "write_safetensors: fsync of '", p, "' failed: ", error_text(errno));
  m.file->close_and_keep();
  m.file.reset();
}

void write_safetensors(const std::string& path, const std::vector<SafetensorsItem>& items,
                       const std::map<std::string, std::string>& metadata, int64_t crc_block_bytes) {
  std::vector<SafetensorsEntrySpec> specs;
  for (const auto& item : items) {
    TORCH_CHECK(item.tensor.defined(), "write_safetensors: '", path, "': tensor '", item.key, "' is undefined");
    specs.push_back({item.key, item.tensor.scalar_type(), item.tensor.sizes().vec()});
  }
  SafetensorsWriter writer(path, std::move(specs), metadata, crc_block_bytes);
  for (const auto& item : items) writer.write(item.key, item.tensor);
  writer.finish();
}

namespace {

// Closes the descriptor unless disarmed: the constructor's failures must not leak it (the
// destructor does not run then).
struct CloseOnError {
  int& fd;
  bool armed = true;
  ~CloseOnError() {
    if (armed && fd >= 0) {
      ::close(fd);
      fd = -1;
    }
  }
};

int open_for_reading(const std::string& p) {
  int fd;
  do {
    fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  TORCH_CHECK(fd >= 0, "SafetensorsFile: cannot open '", p, "': ", error_text(errno));
  return fd;
}

// The JSON header's bytes, after the 8-byte little-endian length that starts the file.
struct HeaderBytes {
  std::string text;
  int64_t file_size = 0;
  int64_t data_start = 0;  // 8 + the header's length
};

HeaderBytes read_header_bytes(int fd, const std::string& p) {
  struct stat st;
  TORCH_CHECK(::fstat(fd, &st) == 0, "SafetensorsFile: cannot stat '", p, "': ", error_text(errno));
  HeaderBytes bytes;
  bytes.file_size = st.st_size;
  TORCH_CHECK(bytes.file_size >= 8, "SafetensorsFile: '", p, "' is ", bytes.file_size,
              " bytes, too short for the 8-byte header length of a safetensors file");
  unsigned char length_bytes[8];
  pread_all(fd, length_bytes, 8, 0, p, "SafetensorsFile");
  uint64_t header_length = 0;
  for (int b = 7; b >= 0; --b) header_length = (header_length << 8) | length_bytes[b];
  TORCH_CHECK(header_length <= kMaxHeaderBytes && header_length <= static_cast<uint64_t>(bytes.file_size - 8),
              "SafetensorsFile: '", p, "' declares a header of ", header_length, " bytes but the file is ",
              bytes.file_size, " bytes (limit ", kMaxHeaderBytes, "): not a safetensors file, or truncated");
  bytes.text.assign(header_length, '\0');
  pread_all(fd, bytes.text.data(), static_cast<int64_t>(header_length), 8, p, "SafetensorsFile");
  bytes.data_start = 8 + static_cast<int64_t>(header_length);
  return bytes;
}

// The deepest nesting of arrays and objects in JSON text (brackets inside strings not counted),
// stopping as soon as it exceeds `limit`.
int json_nesting(const std::string& text, int limit) {
  int depth = 0, deepest = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size() && deepest <= limit; ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      deepest = std::max(deepest, ++depth);
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return deepest;
}

// The header as a JSON object; a key given twice at the top level is an error (the parsed object
// would silently keep only one of its values).
Json parse_header_json(const std::string& text, const std::string& p) {
  TORCH_CHECK(json_nesting(text, kMaxHeaderNesting) <= kMaxHeaderNesting, "SafetensorsFile: the header of '", p,
              "' nests arrays or objects more than ", kMaxHeaderNesting, " deep: not a safetensors header");
  std::set<std::string> seen;
  std::string duplicate;
  Json json;
  try {
    json = Json::parse(text, [&](int depth, Json::parse_event_t event, Json& parsed) {
      if (depth == 1 && event == Json::parse_event_t::key && !seen.insert(parsed.get<std::string>()).second &&
          duplicate.empty()) {
        duplicate = parsed.get<std::string>();
      }
      return true;
    });
  } catch (const Json::exception& e) {
    TORCH_CHECK(false, "SafetensorsFile: the header of '", p, "' is not valid JSON: ", e.what());
  }
  TORCH_CHECK(json.is_object(), "SafetensorsFile: the header of '", p, "' is a JSON ", json.type_name(),
              ", expected an object");
  TORCH_CHECK(duplicate.empty(), "SafetensorsFile: the header of '", p, "' has key '", duplicate, "' twice");
  return json;
}

// The checksum keys of "__metadata__", as found (validated once the entries are known).
struct ChecksumMetadata {
  bool has_block = false;
  bool has_crc = false;
  std::string block_text;
  std::string crc_text;
};

// Reads "__metadata__" into `metadata`, all but the checksum keys, which go to `checksums`.
void parse_metadata(const Json& value, const std::string& p, std::map<std::string, std::string>& metadata,
                    ChecksumMetadata& checksums) {
  TORCH_CHECK(value.is_object(), "SafetensorsFile: '", p, "': '", kMetadataKey,
              "' must be an object of strings, found ", describe(value));
  for (const auto& [mk, mv] : value.items()) {
    TORCH_CHECK(mv.is_string(), "SafetensorsFile: '", p, "': metadata '", mk, "' must be a string, found ",
                describe(mv));
    if (mk == kCrcBlockKey) {
      checksums.has_block = true;
      checksums.block_text = mv.get<std::string>();
    } else if (mk == kCrcKey) {
      checksums.has_crc = true;
      checksums.crc_text = mv.get<std::string>();
    } else {
      metadata[mk] = mv.get<std::string>();
    }
  }
}

// One tensor's entry: dtype, shape and data offsets well formed and consistent with each other.
SafetensorsEntry parse_entry(const std::string& key, const Json& value, const std::string& p) {
  TORCH_CHECK(!key.empty(), "SafetensorsFile: '", p, "' has an entry with an empty key");
  const auto fail_entry = [&](const std::string& what) {
    TORCH_CHECK(false, "SafetensorsFile: '", p, "': entry '", key, "': ", what, " (found ", describe(value), ")");
  };
  if (!value.is_object()) fail_entry("expected an object with dtype, shape and data_offsets");
  if (!value.contains("dtype") || !value["dtype"].is_string()) fail_entry("'dtype' must be a string");
  if (!value.contains("shape") || !value["shape"].is_array()) fail_entry("'shape' must be an array");
  if (!value.contains("data_offsets") || !value["data_offsets"].is_array() || value["data_offsets"].size() != 2) {
    fail_entry("'data_offsets' must be an array [begin, end]");
  }
  SafetensorsEntry entry;
  entry.key = key;
  entry.dtype = scalar_type_from_safetensors(value["dtype"].get<std::string>(), "'" + p + "' entry '" + key + "'");
  for (const auto& d : value["shape"]) {
    if (!d.is_number_unsigned()) fail_entry("'shape' must hold non-negative integers");
    const uint64_t size = d.get<uint64_t>();
    if (size > static_cast<uint64_t>(INT64_MAX)) fail_entry("a dimension is too large");
    entry.shape.push_back(static_cast<int64_t>(size));
  }
  for (int i = 0; i < 2; ++i) {
    const auto& o = value["data_offsets"][i];
    if (!o.is_number_unsigned() || o.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
      fail_entry("'data_offsets' must hold non-negative integers");
    }
  }
  entry.data_begin = value["data_offsets"][0].get<int64_t>();
  entry.data_end = value["data_offsets"][1].get<int64_t>();
  if (entry.data_end < entry.data_begin) fail_entry("'data_offsets' end is before begin");
  bool overflow = false;
  const int64_t numel = checked_numel(entry.shape, &overflow);
  const int64_t element_size = static_cast<int64_t>(c10::elementSize(entry.dtype));
  int64_t expected_bytes = 0;
  if (overflow || __builtin_mul_overflow(numel, element_size, &expected_bytes)) {
    fail_entry("the shape's byte size overflows");
  }
  TORCH_CHECK(expected_bytes == entry.nbytes(), "SafetensorsFile: '", p, "': entry '", key, "' of dtype ",
              value["dtype"].get<std::string>(), " and shape ", c10::IntArrayRef(entry.shape), " needs ",
              expected_bytes, " bytes but its data_offsets [", entry.data_begin, ", ", entry.data_end, "] hold ",
              entry.nbytes());
  return entry;
}

// Every top-level key in file order (so the first malformed one is the one reported): the
// metadata into `header.metadata`, the entries into `header.entries`. Returns the checksum keys.
ChecksumMetadata parse_items(const Json& json, SafetensorsHeader& header) {
  ChecksumMetadata checksums;
  for (const auto& [key, value] : json.items()) {
    if (key == kMetadataKey) {
      parse_metadata(value, header.path, header.metadata, checksums);
    } else {
      header.entries.push_back(parse_entry(key, value, header.path));
    }
  }
  return checksums;
}

// Sorts the entries into data order and checks that they tile the data section back to back (in
// any key order) and that the file holds all of it; sets `header.data_size`.
void check_data_layout(SafetensorsHeader& header, int64_t file_size) {
  const std::string& p = header.path;
  auto& entries = header.entries;
  std::stable_sort(entries.begin(), entries.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return a.data_begin != b.data_begin ? a.data_begin < b.data_begin : a.data_end < b.data_end;
  });
  int64_t cursor = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const auto& e = entries[i];
    if (e.data_begin < cursor) {
      TORCH_CHECK(false, "SafetensorsFile: '", p, "': the data of entry '", e.key, "' [", e.data_begin, ", ",
                  e.data_end, ") overlaps that of entry '", entries[i - 1].key, "' [", entries[i - 1].data_begin,
                  ", ", entries[i - 1].data_end, ")");
    }
    TORCH_CHECK(e.data_begin == cursor, "SafetensorsFile: '", p, "': entry '", e.key, "' starts at byte ",
                e.data_begin, " of the data but the previous entry ends at ", cursor,
                " (entries must be back to back from 0)");
    cursor = e.data_end;
  }
  header.data_size = cursor;

  // Compared as sizes left after the header, so that huge offsets cannot overflow.
  const int64_t data_available = file_size - header.data_start;
  if (header.data_size > data_available) {
    for (const auto& e : entries) {
      TORCH_CHECK(e.data_end <= data_available, "SafetensorsFile: '", p, "' is truncated: it holds ",
                  data_available, " bytes of data after its ", header.data_start, "-byte header, but entry '", e.key,
                  "' needs data bytes [", e.data_begin, ", ", e.data_end, ") and the header describes ",
                  header.data_size, " bytes");
    }
  }
}

// The checksum block size and each entry's block checksums (both keys or neither; a list of
// 8-digit hexadecimal CRC-32Cs for every entry and for no other key) into `header`.
void read_checksums(const ChecksumMetadata& checksums, SafetensorsHeader& header) {
  const std::string& p = header.path;
  TORCH_CHECK(checksums.has_block == checksums.has_crc, "SafetensorsFile: '", p, "': metadata has '",
              checksums.has_block ? kCrcBlockKey : kCrcKey, "' without '",
              checksums.has_block ? kCrcKey : kCrcBlockKey, "'");
  if (!checksums.has_block) return;
  const std::string& crc_block_text = checksums.block_text;
  int64_t block = 0;
  try {
    size_t used = 0;
    block = std::stoll(crc_block_text, &used);
    if (used != crc_block_text.size()) block = 0;
  } catch (const std::exception&) {
    block = 0;
  }
  TORCH_CHECK(block > 0, "SafetensorsFile: '", p, "': metadata '", kCrcBlockKey,
              "' must be a positive decimal number of bytes, found '", crc_block_text, "'");
  header.crc_block_bytes = block;
  Json crc;
  try {
    crc = Json::parse(checksums.crc_text);
  } catch (const Json::exception& e) {
    TORCH_CHECK(false, "SafetensorsFile: '", p, "': metadata '", kCrcKey, "' is not valid JSON: ", e.what());
  }
  TORCH_CHECK(crc.is_object(), "SafetensorsFile: '", p, "': metadata '", kCrcKey,
              "' must be a JSON object from key to checksum list");
  for (const auto& [key, list] : crc.items()) {
    TORCH_CHECK(header.find(key) != nullptr, "SafetensorsFile: '", p, "': metadata '", kCrcKey,
                "' has checksums for '", key, "', which is not an entry of the file");
  }
  for (auto& e : header.entries) {
    TORCH_CHECK(crc.contains(e.key), "SafetensorsFile: '", p, "': metadata '", kCrcKey,
                "' has no checksums for entry '", e.key, "'");
    const auto& list = crc[e.key];
    const int64_t expected = block_count(e.nbytes(), block);
    TORCH_CHECK(list.is_array() && static_cast<int64_t>(list.size()) == expected, "SafetensorsFile: '", p,
                "': entry '", e.key, "' of ", e.nbytes(), " bytes needs ", expected, " checksums of ", block,
                "-byte blocks, found ", describe(list));
    for (const auto& c : list) {
      const std::string hex = c.is_string() ? c.get<std::string>() : std::string();
      // Digits only: strtoul alone would also take a sign, spaces or "0x" ("-0000001", "0x1a2b3c").
      const bool digits = hex.size() == 8 && std::all_of(hex.begin(), hex.end(), [](char d) {
                            return (d >= '0' && d <= '9') || (d >= 'a' && d <= 'f') || (d >= 'A' && d <= 'F');
                          });
      TORCH_CHECK(digits, "SafetensorsFile: '", p, "': entry '", e.key, "': checksum ", describe(c),
                  " is not 8 hexadecimal digits");
      e.crc32c.push_back(static_cast<uint32_t>(std::strtoul(hex.c_str(), nullptr, 16)));
    }
  }
}

}  // namespace

// Phases: open, read the header's bytes, parse them as JSON, parse the metadata and every entry,
// check the entries' layout in the data section, then the checksums.
SafetensorsFile::SafetensorsFile(std::string path) {
  header_.path = std::move(path);
  fd_ = open_for_reading(header_.path);
  CloseOnError guard{fd_};
  const HeaderBytes bytes = read_header_bytes(fd_, header_.path);
  header_.data_start = bytes.data_start;
  const Json json = parse_header_json(bytes.text, header_.path);
  const ChecksumMetadata checksums = parse_items(json, header_);
  check_data_layout(header_, bytes.file_size);
  read_checksums(checksums, header_);
  guard.armed = false;
}

SafetensorsFile::~SafetensorsFile() {
  if (fd_ >= 0) ::close(fd_);
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept
    : header_(std::move(other.header_)), fd_(std::exchange(other.fd_, -1)) {}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    header_ = std::move(other.header_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

void SafetensorsFile::read(const SafetensorsEntry& entry, int64_t begin, int64_t end, void* dst) const {
  TORCH_CHECK(fd_ >= 0, "SafetensorsFile::read: the file was moved from");
  TORCH_CHECK(0 <= begin && begin <= end && end <= entry.nbytes(), "SafetensorsFile::read: '", header_.path,
              "': bytes [", begin, ", ", end, ") are outside entry '", entry.key, "' of ", entry.nbytes(), " bytes");
  pread_all(fd_, dst, end - begin, header_.data_start + entry.data_begin + begin, header_.path,
            "SafetensorsFile::read");
}

at::Tensor SafetensorsFile::read_tensor(const SafetensorsEntry& entry) const {
  auto t = at::empty(entry.shape, at::TensorOptions().dtype(entry.dtype).device(c10::kCPU));
  read(entry, 0, entry.nbytes(), t.mutable_data_ptr());
  return t;
}

void SafetensorsFile::verify(const SafetensorsEntry& entry, int64_t begin, int64_t end) const {
  TORCH_CHECK(0 <= begin && begin <= end && end <= entry.nbytes(), "SafetensorsFile::verify: '", header_.path,
              "': bytes [", begin, ", ", end, ") are outside entry '", entry.key, "' of ", entry.nbytes(), " bytes");
  const int64_t block = header_.crc_block_bytes;
  if (block == 0 || begin == end) return;
  TORCH_CHECK(static_cast<int64_t>(entry.crc32c.size()) == block_count(entry.nbytes(), block),
              "SafetensorsFile::verify: '", header_.path, "': entry '", entry.key, "' has ", entry.crc32c.size(),
              " checksums, expected ", block_count(entry.nbytes(), block));
  // Each block is checksummed where the kernel holds it (a read-only mapping of the file, one block
  // at a time, so no copy and at most one block mapped); where the file cannot be mapped, through
  // a bounded buffer filled by pread.
  static const int64_t page = ::sysconf(_SC_PAGESIZE);
  std::unique_ptr<unsigned char[]> buffer;
  for (int64_t b = begin / block; b <= (end - 1) / block; ++b) {
    const int64_t block_begin = b * block;
    const int64_t block_end = std::min(block_begin + block, entry.nbytes());
    const int64_t file_begin = header_.data_start + entry.data_begin + block_begin;
    const int64_t map_begin = file_begin / page * page;
    const size_t map_length = static_cast<size_t>(file_begin + (block_end - block_begin) - map_begin);
    void* mapped = buffer ? MAP_FAILED : ::mmap(nullptr, map_length, PROT_READ, MAP_SHARED | MAP_POPULATE, fd_, map_begin);
    uint32_t crc = 0;
    if (mapped != MAP_FAILED) {
      crc = crc32c(static_cast<const unsigned char*>(mapped) + (file_begin - map_begin),
                   static_cast<size_t>(block_end - block_begin));
      ::munmap(mapped, map_length);
    } else {
      if (!buffer) buffer.reset(new unsigned char[std::min(block, kVerifyChunkBytes)]);
      for (int64_t at = block_begin; at < block_end;) {
        const int64_t n = std::min(kVerifyChunkBytes, block_end - at);
        read(entry, at, at + n, buffer.get());
        crc = crc32c_extend(crc, buffer.get(), static_cast<size_t>(n));
        at += n;
      }
    }
    TORCH_CHECK(crc == entry.crc32c[b], "SafetensorsFile::verify: '", header_.path,
                "': checksum mismatch in entry '", entry.key, "' block ", b, " (bytes [", block_begin, ", ", block_end,
                ") of the entry): stored ", hex8(entry.crc32c[b]), ", computed ", hex8(crc),
                "; the file is corrupt");
  }
}

}  // namespace fsdp::storage
