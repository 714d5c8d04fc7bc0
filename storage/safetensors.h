#pragma once
// The safetensors file format (https://huggingface.co/docs/safetensors): 8 bytes little-endian
// header length N, N bytes of JSON (`{"key": {"dtype": "F32", "shape": [..], "data_offsets":
// [begin, end]}, ..., "__metadata__": {"str": "str"}}`, padded with spaces), then the data,
// each entry row-major, offsets relative to the end of the header.
//
// Checksums (this project's addition, ignored by other readers): `__metadata__` holds
// "FSDP_CRC32C_BLOCK" (bytes, decimal) and "FSDP_CRC32C", a JSON object from key to the list of
// the CRC-32C (storage/crc32c.h) of each block of that entry's bytes (the last block may be shorter; an empty entry
// has an empty list), each written as 8 lowercase hexadecimal digits, so a reader that needs part
// of an entry verifies only the blocks it reads. Both values are JSON strings, as safetensors
// requires of metadata: `"FSDP_CRC32C": "{\"w\":[\"1a2b3c4d\",\"00ff00ff\"]}"`.
//
// Files of the `safetensors` Python package and of torch.distributed.checkpoint's
// HuggingFaceStorageWriter (whose "DCP_SHARDING_INFO" metadata is kept in `metadata`) are read
// as they are; without checksums `crc_block_bytes` is 0 and verify() does nothing. The header is
// padded with spaces so that the data starts at a multiple of 8 bytes, as the Rust writer does.
//
//   fsdp::storage::write_safetensors(path, {{"w", w}, {"b", b}}, {{"format", "pt"}});
//   fsdp::storage::SafetensorsFile f(path);     // header parsed and checked
//   f.read(f.header().at("w"), 0, 64, dst);      // bytes [0, 64) of entry "w" (pread)
//   f.verify(f.header().at("w"), 0, 64);         // CRC-32C of the blocks covering them

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

namespace fsdp::storage {

/// The safetensors name of a dtype ("F32", "BF16", "I64", "BOOL", ...) and back. Unsupported
/// dtypes are a c10::Error naming them and `context`.
std::string safetensors_dtype_name(c10::ScalarType dtype);
c10::ScalarType scalar_type_from_safetensors(const std::string& name, const std::string& context);

inline constexpr const char* kCrcBlockKey = "FSDP_CRC32C_BLOCK";
inline constexpr const char* kCrcKey = "FSDP_CRC32C";
inline constexpr int64_t kDefaultCrcBlockBytes = int64_t{4} << 20;

struct SafetensorsEntry {
  std::string key;
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> shape;
  int64_t data_begin = 0;  // bytes, relative to the start of the data section
  int64_t data_end = 0;
  std::vector<uint32_t> crc32c;  // per block of `crc_block_bytes` (empty: the file has no checksums)
  int64_t nbytes() const { return data_end - data_begin; }
  int64_t numel() const;
};

struct SafetensorsHeader {
  std::string path;
  std::vector<SafetensorsEntry> entries;         // in data order
  std::map<std::string, std::string> metadata;   // "__metadata__", checksum keys removed
  int64_t data_start = 0;                        // 8 + header length: file offset of the data
  int64_t data_size = 0;                         // end of the last entry's data
  int64_t crc_block_bytes = 0;                   // 0: no checksums
  /// The entry named `key`; a c10::Error naming the file and the key when absent.
  const SafetensorsEntry& at(const std::string& key) const;
  /// The entry named `key`, or nullptr (a linear search over `entries`).
  const SafetensorsEntry* find(const std::string& key) const;
};

/// Reads exactly bytes [offset, offset + size) of the open file `fd` into `data` (loops over short
/// reads and EINTR). An error or a file that ends first is a c10::Error naming `api` and `path`.
void pread_all(int fd, void* data, int64_t size, int64_t offset, const std::string& path, const char* api);

/// One tensor to write: any dtype safetensors knows, any device, any layout (written row-major).
struct SafetensorsItem {
  std::string key;
  at::Tensor tensor;
};

/// Writes `items` (keys unique) and `metadata` to `path` in one pass over the data: the header is
/// reserved first and rewritten with the checksums at the end; contiguous CPU tensors are written
/// straight from their memory, others copied to the host one at a time. fsync()s the file before
/// returning. Errors (I/O, a full disk) are a c10::Error naming the file; a file that failed
/// halfway is removed. `crc_block_bytes` = 0 writes no checksums (a plain safetensors file).
void write_safetensors(const std::string& path, const std::vector<SafetensorsItem>& items,
                       const std::map<std::string, std::string>& metadata = {},
                       int64_t crc_block_bytes = kDefaultCrcBlockBytes);

/// The dtype and shape of one tensor a SafetensorsWriter will be given.
struct SafetensorsEntrySpec {
  std::string key;
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> shape;
};

/// A safetensors file written one tensor at a time, in any order, so that a program holds one
/// tensor at a time (e.g. each gathered when it is needed): the entries are declared first (the
/// header's length is final: keys, dtypes, shapes, placeholder checksums), each write() pwrites a
/// tensor at its offset and checksums it, finish() writes the header with the checksums and
/// fsync()s. A file not finished (an error, or destroyed early) is removed. The same checks and
/// errors as write_safetensors, plus a key written twice, one not declared, a tensor of another
/// dtype or shape than declared, and finish() before every entry is written.
///
///   fsdp::storage::SafetensorsWriter w(path, {{"w", at::kFloat, {4, 4}}}, {{"format", "pt"}});
///   w.write("w", gathered);
///   w.finish();
class SafetensorsWriter {
 public:
  SafetensorsWriter(std::string path, std::vector<SafetensorsEntrySpec> entries,
                    std::map<std::string, std::string> metadata = {}, int64_t crc_block_bytes = kDefaultCrcBlockBytes);
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  void write(const std::string& key, const at::Tensor& tensor);
  void finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// An open safetensors file (read only): the constructor reads and checks the header (well-formed
/// JSON, known dtypes, shapes matching byte sizes, entries back to back and in bounds, checksum
/// lists of the right length, the file not shorter than header + data; a truncated file names
/// the first entry whose data is cut, and a key that appears twice is refused). Every error is a
/// c10::Error naming the file (and the key where one is concerned).
class SafetensorsFile {
 public:
  explicit SafetensorsFile(std::string path);
  ~SafetensorsFile();
  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const SafetensorsHeader& header() const { return header_; }
  /// Reads bytes [begin, end) of `entry`'s data into `dst` (pread; safe from several threads, as
  /// are read_tensor() and verify()).
  void read(const SafetensorsEntry& entry, int64_t begin, int64_t end, void* dst) const;
  /// The whole entry as a CPU tensor of its dtype and shape.
  at::Tensor read_tensor(const SafetensorsEntry& entry) const;
  /// Checksums the blocks of `entry` covering bytes [begin, end) (in a read-only mapping of the
  /// file, or read through a bounded buffer where it cannot be mapped) against their CRC-32C;
  /// a mismatch is a c10::Error naming the file, the key and the block. No-op without checksums.
  void verify(const SafetensorsEntry& entry, int64_t begin, int64_t end) const;

 private:
  SafetensorsHeader header_;
  int fd_ = -1;
};

}  // namespace fsdp::storage
