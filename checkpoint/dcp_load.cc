#include "fsdp_cpp/checkpoint/distributed_checkpoint.h"
#include "fsdp_cpp/comm/issuing_api.h"

#include <algorithm>
#include <atomic>
#include <csetjmp>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif
#include <nlohmann/json.hpp>

#include "dcp_support.h"  // private to //checkpoint:distributed_checkpoint
#include "fsdp_cpp/checkpoint/optimizer_state_dict.h"
#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/checkpoint/state_dict_support.h"
#include "fsdp_cpp/comm/agreement.h"
#include "fsdp_cpp/contract/shape_text.h"
#include "fsdp_cpp/storage/atomic_directory.h"
#include "fsdp_cpp/storage/boxes.h"
#include "fsdp_cpp/storage/crc32c.h"
#include "fsdp_cpp/storage/safetensors.h"

// Loading: the index of a checkpoint's files, validation on every rank, then the reads.

namespace fsdp::dcp {
using namespace detail;
using contract::shape_string;

namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// A box of a key stored in one file. `entry` is set once the file is open (see
// CheckpointIndex::open_file).
struct Piece {
  int file = 0;
  mutable const storage::SafetensorsEntry* entry = nullptr;
  storage::Box box;
};

struct KeyIndex {
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> shape;
  std::vector<Piece> pieces;
};

// Checkpoint files opened by loads in this process (dcp::testing::checkpoint_files_opened).
std::atomic<int64_t> g_files_opened{0};

// [Note: opening only needed files] With a manifest, the index of keys and boxes comes from the
// manifest alone, and a rank opens (and reads the header of) only the files holding boxes it
// reads: from many ranks, opening every file on every rank would exceed the default limit of
// 1,024 open files and make the header reads grow with the square of the world size. Each file's
// byte size and header are checked against the manifest when it is opened. Without a manifest
// every file must be opened to learn its keys.
struct CheckpointIndex {
  std::string dir;
  std::string manifest_path;
  std::vector<std::string> file_names;
  std::vector<int64_t> file_bytes;  // from the manifest; -1 without one
  mutable std::vector<std::unique_ptr<storage::SafetensorsFile>> files;  // null until opened
  std::map<std::string, KeyIndex> keys;
  std::map<std::string, std::string> extra_values;
  // The names of Extra::tensors (keys without the prefix), as the manifest records them; without
  // a manifest (or one of a version that did not record them), every key with the prefix.
  std::optional<std::set<std::string>> extra_tensor_names;
  bool has_manifest = false;
  // Per file, the pieces it holds (with a manifest).
  std::vector<std::vector<std::pair<const std::string*, const Piece*>>> pieces_of_file;

  const storage::SafetensorsFile& open_file(int f, const char* api) const;
};

std::string path_of(const CheckpointIndex& index, int f) { return join_path(index.dir, index.file_names[f]); }

// What a JSON value is, for error messages, without serializing a nested value (dump() recurses).
std::string describe(const json& value) {
  if (value.is_array()) return "an array of " + std::to_string(value.size()) + " values";
  if (value.is_object()) return "an object of " + std::to_string(value.size()) + " members";
  std::string text = value.dump();
  return text.size() > 80 ? text.substr(0, 77) + "..." : text;
}

// JSON nested deeper than this (arrays and objects) is refused before it is parsed: a manifest
// nests 5 deep, DCP_SHARDING_INFO 3; nlohmann's dump(), copies and comparisons recurse.
constexpr int kMaxJsonNesting = 128;

// Whether JSON text nests arrays or objects deeper than kMaxJsonNesting (brackets in strings not
// counted).
bool nests_too_deep(const std::string& text) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if ((c == '{' || c == '[') && ++depth > kMaxJsonNesting) {
      return true;
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return false;
}

// Parses a file's DCP_SHARDING_INFO ({key: {"saved_offsets": [...]}}; null when absent).
json sharding_info(const storage::SafetensorsHeader& header, const char* api) {
  const auto info = header.metadata.find(kShardingInfoKey);
  if (info == header.metadata.end()) return json();
  TORCH_CHECK(!nests_too_deep(info->second), api, ": the ", kShardingInfoKey, " metadata of '", header.path,
              "' nests arrays or objects more than ", kMaxJsonNesting, " deep");
  try {
    return json::parse(info->second);
  } catch (const json::exception& e) {
    TORCH_CHECK(false, api, ": the ", kShardingInfoKey, " metadata of '", header.path, "' is not valid JSON: ",
                e.what());
  }
  return json();
}

// A JSON array of integers in [0, INT64_MAX] (offsets, sizes, shapes of a checkpoint's boxes), or
// nullopt when `value` is anything else (a float, a negative or larger number, not an array):
// nlohmann's get<std::vector<int64_t>>() would convert floats and wrap large unsigned values.
std::optional<std::vector<int64_t>> non_negative_ints(const json& value) {
  if (!value.is_array()) return std::nullopt;
  std::vector<int64_t> out;
  out.reserve(value.size());
  for (const auto& v : value) {
    if (v.is_number_unsigned()) {
      if (v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
      out.push_back(static_cast<int64_t>(v.get<uint64_t>()));
    } else if (v.is_number_integer() && v.get<int64_t>() >= 0) {
      out.push_back(v.get<int64_t>());
    } else {
      return std::nullopt;
    }
  }
  return out;
}

// Whether offsets + sizes stays within int64 in every dimension (a box's end is computed from them).
bool box_end_fits(const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes) {
  for (size_t d = 0; d < offsets.size() && d < sizes.size(); ++d) {
    if (offsets[d] > std::numeric_limits<int64_t>::max() - sizes[d]) return false;
  }
  return true;
}

std::vector<int64_t> saved_offsets(const json& sharding, const storage::SafetensorsEntry& entry,
                                   const std::string& path, const char* api) {
  if (!sharding.is_object()) return std::vector<int64_t>(entry.shape.size(), 0);
  TORCH_CHECK(sharding.contains(entry.key) && sharding[entry.key].contains(kSavedOffsetsKey), api, ": '", path,
              "' has no ", kShardingInfoKey, " entry for its key '", entry.key, "'");
  const json& value = sharding[entry.key][kSavedOffsetsKey];
  const auto offsets = non_negative_ints(value);
  TORCH_CHECK(offsets.has_value(), api, ": '", path, "': the ", kSavedOffsetsKey, " of key '", entry.key, "' in its ",
              kShardingInfoKey, " metadata must be a list of non-negative integers, found ", describe(value));
  TORCH_CHECK(offsets->size() == entry.shape.size(), api, ": '", path, "': key '", entry.key, "' has shape ",
              shape_string(entry.shape), " but saved offsets ", shape_string(*offsets));
  TORCH_CHECK(box_end_fits(*offsets, entry.shape), api, ": '", path, "': key '", entry.key, "' has saved offsets ",
              shape_string(*offsets), " too large for its shape ", shape_string(entry.shape));
  return *offsets;
}

// Opens file `f` (once), checking it against the manifest when there is one: its byte size, and
// for every box the manifest places in it an entry of the key's dtype, the box's shape and offsets.
const storage::SafetensorsFile& CheckpointIndex::open_file(int f, const char* api) const {
  if (files[f]) return *files[f];
  const std::string path = path_of(*this, f);
  if (has_manifest) {
    TORCH_CHECK(storage::exists(path), api, ": the checkpoint file '", path, "' listed in the manifest is missing");
    const auto size = static_cast<int64_t>(fs::file_size(path));
    TORCH_CHECK(size == file_bytes[f], api, ": the checkpoint file '", path, "' has ", size,
                " bytes but the manifest says ", file_bytes[f], " (truncated or modified after the save)");
  }
  auto file = std::make_unique<storage::SafetensorsFile>(path);
  ++g_files_opened;
  if (has_manifest) {
    const storage::SafetensorsHeader& header = file->header();
    const json sharding = sharding_info(header, api);
    std::map<std::string, const storage::SafetensorsEntry*> entries;
    for (const auto& e : header.entries) entries.emplace(e.key, &e);
    for (const auto& [key, piece] : pieces_of_file[f]) {
      const auto it = entries.find(*key);
      TORCH_CHECK(it != entries.end(), api, ": key '", *key, "' is listed in the manifest '", manifest_path,
                  "' in '", path, "', which has no such entry");
      const storage::SafetensorsEntry& entry = *it->second;
      const KeyIndex& k = keys.at(*key);
      TORCH_CHECK(entry.dtype == k.dtype && entry.shape == piece->box.sizes, api, ": key '", *key, "' is ",
                  storage::safetensors_dtype_name(k.dtype), " ", shape_string(piece->box.sizes), " in the manifest but ",
                  storage::safetensors_dtype_name(entry.dtype), " ", shape_string(entry.shape), " in '", path, "'");
      const auto offsets = saved_offsets(sharding, entry, path, api);
      TORCH_CHECK(offsets == piece->box.offsets, api, ": key '", *key, "' has offsets ",
                  shape_string(piece->box.offsets), " in the manifest but ", shape_string(offsets), " in '", path, "'");
      piece->entry = &entry;
    }
  }
  files[f] = std::move(file);
  return *files[f];
}

// Without a manifest: indexes every entry of file `f` from its header.
void index_file(CheckpointIndex& index, int file, const char* api) {
  const storage::SafetensorsHeader& header = index.open_file(file, api).header();
  TORCH_CHECK(header.metadata.count(kWriterKey) == 0, api, ": '", index.dir, "' has no manifest '",
              kManifestName, "' but its file '", header.path,
              "' was written by fsdp::dcp::save: the manifest was deleted, or the folder is an unfinished "
              "save; without it the checkpoint is incomplete (its Extra values, e.g. the step, are in the "
              "manifest), so it is refused. Restore '", kManifestName, "' or load another checkpoint");
  const json sharding = sharding_info(header, api);
  for (const auto& entry : header.entries) {
    storage::Box box;
    box.sizes = entry.shape;
    box.offsets = saved_offsets(sharding, entry, header.path, api);
    auto [it, fresh] = index.keys.try_emplace(entry.key);
    KeyIndex& key = it->second;
    if (fresh) {
      key.dtype = entry.dtype;
      key.shape.assign(box.sizes.size(), 0);
    }
    TORCH_CHECK(key.dtype == entry.dtype && key.shape.size() == box.sizes.size(), api, ": key '", entry.key,
                "' is stored with different dtypes or ranks in different files ('", header.path, "' has ",
                storage::safetensors_dtype_name(entry.dtype), " ", shape_string(entry.shape), ")");
    for (size_t d = 0; d < box.sizes.size(); ++d) key.shape[d] = std::max(key.shape[d], box.offsets[d] + box.sizes[d]);
    key.pieces.push_back({file, &entry, std::move(box)});
  }
}

CheckpointIndex open_checkpoint(const std::string& dir, const char* api) {
  CheckpointIndex index;
  index.dir = dir;
  TORCH_CHECK(fs::is_directory(dir), api, ": there is no checkpoint folder '", dir, "'");
  index.manifest_path = join_path(dir, kManifestName);
  const std::string& manifest_path = index.manifest_path;
  if (!storage::exists(manifest_path)) {
    for (const auto& name : storage::list_files(dir)) {
      if (name.size() > std::string(kSuffix).size() && name.ends_with(kSuffix)) index.file_names.push_back(name);
    }
    TORCH_CHECK(!index.file_names.empty(), api, ": '", dir, "' holds no checkpoint (neither ", kManifestName,
                " nor *", kSuffix, " files)");
    index.file_bytes.assign(index.file_names.size(), -1);
    index.files.resize(index.file_names.size());
    for (size_t f = 0; f < index.file_names.size(); ++f) index_file(index, static_cast<int>(f), api);
    return index;
  }
  index.has_manifest = true;
  json manifest;
  try {
    const std::string text = storage::read_file(manifest_path);
    TORCH_CHECK(!nests_too_deep(text), api, ": the manifest '", manifest_path, "' nests arrays or objects more than ",
                kMaxJsonNesting, " deep");
    manifest = json::parse(text);
  } catch (const json::exception& e) {
    TORCH_CHECK(false, api, ": the manifest '", manifest_path, "' is not valid JSON: ", e.what());
  }
  try {
    TORCH_CHECK(manifest.at("format").get<std::string>() == kFormatName, api, ": '", manifest_path,
                "' is not a checkpoint manifest of this library (format ", describe(manifest.at("format")), ")");
    const int version = manifest.at("version").get<int>();
    TORCH_CHECK(version <= kFormatVersion, api, ": '", manifest_path, "' has format version ", version,
                ", newer than this library reads (", kFormatVersion, ")");
    for (const auto& f : manifest.at("files")) {
      const std::string name = f.at(0).get<std::string>();
      // A name of a file in the folder: the manifest must not make a load read files elsewhere.
      TORCH_CHECK(!name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
                      name.find('\0') == std::string::npos,
                  api, ": the manifest '", manifest_path, "' lists the file '", name,
                  "', which is not the name of a file in the checkpoint folder");
      index.file_names.push_back(name);
      index.file_bytes.push_back(f.at(1).get<int64_t>());
    }
    index.files.resize(index.file_names.size());
    const json& extra = manifest.at("extra");
    index.extra_values = extra.at("values").get<std::map<std::string, std::string>>();
    if (extra.contains("tensors")) index.extra_tensor_names = extra.at("tensors").get<std::set<std::string>>();
    for (const auto& record : manifest.at("keys")) {
      const std::string key = record.at(0).get<std::string>();
      KeyIndex k;
      k.dtype = storage::scalar_type_from_safetensors(record.at(1).get<std::string>(), manifest_path);
      const auto shape = non_negative_ints(record.at(2));
      int64_t numel = 1;
      bool overflow = false;
      for (const int64_t d : shape.value_or(std::vector<int64_t>{})) overflow |= __builtin_mul_overflow(numel, d, &numel);
      TORCH_CHECK(shape.has_value() && !overflow, api, ": key '", key, "' has the shape ", describe(record.at(2)),
                  " in the manifest '", manifest_path, "' (a list of non-negative sizes whose product fits in int64 "
                  "expected)");
      k.shape = *shape;
      for (const auto& box : record.at(3)) {
        Piece piece;
        const json& file = box.at(0);
        TORCH_CHECK(file.is_number_integer() && file.get<int64_t>() >= 0 &&
                        file.get<int64_t>() < static_cast<int64_t>(index.file_names.size()),
                    api, ": key '", key, "' names file ", describe(file), " in the manifest '", manifest_path,
                    "', which lists ", index.file_names.size());
        piece.file = static_cast<int>(file.get<int64_t>());
        const auto offsets = non_negative_ints(box.at(1));
        const auto sizes = non_negative_ints(box.at(2));
        TORCH_CHECK(offsets && sizes && offsets->size() == k.shape.size() && sizes->size() == k.shape.size(), api,
                    ": key '", key, "' has a box that is not two lists of ", k.shape.size(),
                    " non-negative integers (the rank of its shape) in the manifest '", manifest_path, "'");
        for (size_t d = 0; d < k.shape.size(); ++d) {
          TORCH_CHECK((*sizes)[d] <= k.shape[d] && (*offsets)[d] <= k.shape[d] - (*sizes)[d], api, ": key '", key,
                      "' of shape ", shape_string(k.shape), " has a box at offsets ", shape_string(*offsets),
                      " of sizes ", shape_string(*sizes), " outside it in the manifest '", manifest_path, "'");
        }
        piece.box.offsets = *offsets;
        piece.box.sizes = *sizes;
        k.pieces.push_back(std::move(piece));
      }
      TORCH_CHECK(index.keys.emplace(key, std::move(k)).second, api, ": key '", key, "' is listed twice in '",
                  manifest_path, "'");
    }
  } catch (const json::exception& e) {
    TORCH_CHECK(false, api, ": the manifest '", manifest_path, "' is malformed: ", e.what());
  }
  index.pieces_of_file.resize(index.file_names.size());
  for (const auto& [key, k] : index.keys) {
    for (const Piece& piece : k.pieces) index.pieces_of_file[piece.file].emplace_back(&key, &piece);
  }
  return index;
}

// One contiguous read: `length` elements of `piece` from element `src` of its entry into element
// `dst` of the destination's local tensor.
struct Read {
  const Piece* piece;
  int64_t src;
  int64_t dst;
  int64_t length;
};

// An Extra tensor is allocated with the shape the checkpoint declares, before its values are read:
// refuse one that needs more bytes than the data of the files holding its boxes (opened here, so
// their sizes are checked against the manifest), so that a corrupt or hostile manifest cannot make
// a load allocate more memory than the checkpoint holds.
void check_extra_fits(const CheckpointIndex& index, const std::string& key, const KeyIndex& k, const char* api) {
  int64_t bytes = static_cast<int64_t>(c10::elementSize(k.dtype));
  bool overflow = false;
  for (const int64_t d : k.shape) overflow |= d < 0 || __builtin_mul_overflow(bytes, d, &bytes);
  std::set<int> files;
  int64_t available = 0;
  for (const Piece& piece : k.pieces) {
    if (files.insert(piece.file).second) available += index.open_file(piece.file, api).header().data_size;
  }
  TORCH_CHECK(!overflow && bytes <= available, api, ": the Extra tensor '", key, "' of the checkpoint '", index.dir,
              "' is declared as ", storage::safetensors_dtype_name(k.dtype), " ", shape_string(k.shape),
              ", more than the ", available, " bytes of data in the files holding it");
}

// Bytes [begin, end) of a piece's entry whose checksums a load verifies.
struct Span {
  const Piece* piece;
  int64_t begin;
  int64_t end;
};

struct Target {
  std::string key;
  LocalShard shard;
  std::vector<Read> reads;
  std::vector<Span> spans;  // empty unless LoadOptions::verify_checksums
};

// Plans the reads that fill `target` (its whole local range), opens the files they read from,
// checks shape, dtype and coverage, and lists the spans whose checksums verify_spans checks. Returns false when the key is absent (the
// caller lists every absent key: a strict load refuses them all in one message, zero-element
// keys included, since a checkpoint of the same model holds those too).
bool plan_target(const CheckpointIndex& index, Target& target, const LoadOptions& options, const char* api) {
  const LocalShard& shard = target.shard;
  const auto it = index.keys.find(target.key);
  if (it == index.keys.end()) return false;
  const KeyIndex& key = it->second;
  TORCH_CHECK(key.shape == shard.global_shape, api, ": key '", target.key, "' has shape ", shape_string(key.shape),
              " in the checkpoint '", index.dir, "' but ", shape_string(shard.global_shape), " here (expected the ",
              shard.piece ? "global shape of the tensor-parallel model, " : "model's shape, ",
              shape_string(shard.global_shape), ", found ", shape_string(key.shape), ")");
  const c10::ScalarType want = shard.local.scalar_type();
  TORCH_CHECK(key.dtype == want || options.convert_dtype(), api, ": key '", target.key, "' is stored as ",
              storage::safetensors_dtype_name(key.dtype), " in the checkpoint '", index.dir, "' but is ",
              c10::toString(want), " here; pass LoadOptions().convert_dtype(true) to convert it");
  // The shard's elements as contiguous runs of the global tensor (one run without a
  // tensor-parallel piece), each filled from the checkpoint's boxes.
  for (const GlobalRun& want : global_runs(shard)) {
    const int64_t begin = want.global_begin;
    const int64_t end = begin + want.length;
    std::vector<std::pair<storage::Run, const Piece*>> runs;
    for (const Piece& piece : key.pieces) {
      for (const auto& run : storage::runs_of_box(key.shape, piece.box, begin, end)) runs.emplace_back(run, &piece);
    }
    std::sort(runs.begin(), runs.end(),
              [](const auto& a, const auto& b) { return a.first.global_begin < b.first.global_begin; });
    int64_t pos = begin;
    for (const auto& [run, piece] : runs) {
      TORCH_CHECK(run.global_begin <= pos, api, ": key '", target.key, "': the checkpoint '", index.dir,
                  "' holds no value for flat elements [", pos, ", ", run.global_begin, ") (its boxes do not cover them)");
      const int64_t skip = pos - run.global_begin;
      if (skip >= run.length) continue;
      target.reads.push_back({piece, run.local_begin + skip, want.local_begin + (pos - begin), run.length - skip});
      pos = run.global_begin + run.length;
    }
    TORCH_CHECK(pos >= end, api, ": key '", target.key, "': the checkpoint '", index.dir,
                "' holds no value for flat elements [", pos, ", ", end, ") (its boxes do not cover them)");
  }
  for (const Read& read : target.reads) index.open_file(read.piece->file, api);
  if (options.verify_checksums()) {
    // Once per piece, over the span of the bytes read from it (verified by verify_spans).
    std::map<const Piece*, std::pair<int64_t, int64_t>> spans;
    for (const Read& read : target.reads) {
      auto [span, fresh] = spans.try_emplace(read.piece, read.src, read.src + read.length);
      if (!fresh) {
        span->second.first = std::min(span->second.first, read.src);
        span->second.second = std::max(span->second.second, read.src + read.length);
      }
    }
    const int64_t esize = static_cast<int64_t>(c10::elementSize(key.dtype));
    for (const auto& [piece, span] : spans) target.spans.push_back({piece, span.first * esize, span.second * esize});
  }
  return true;
}

// [Note: verify, agree, then copy] Nothing of the model or the optimizer may change unless every
// rank verified every byte it needs, so the verdict on the LAST block a rank needs comes before
// the first byte written to a destination. Keeping the verified bytes in a private staging buffer
// until the agreement would hold all of them (N bytes, not a bounded buffer: with S < N staged,
// N - S bytes are read again whatever the staging does) and would add a copy per byte; the page
// cache already holds them. So each file a rank reads is mapped once, read-only, over the bytes it
// needs (FileMapping), and both passes go through that one mapping:
//   - verify (before the agreement): per checksum block, in file order, posix_fadvise(WILLNEED)
//     keeps kReadAheadBytes of reads in flight ahead (a cold load reads the disk in large requests
//     while the CPU checksums), madvise(MADV_POPULATE_READ) maps the block's pages in one call,
//     CRC-32C on three streams ([Note: three CRC streams] in storage/crc32c.cc) checks it, and
//     MADV_DONTNEED drops the block's page-table entries again (the pages stay cached);
//   - copy (after every rank agreed): from the same mapping, a window of kMappedWindowBytes at a
//     time populated, copied and released, with no file read (pread) into a buffer: large copies
//     use non-temporal stores (copy_streaming), which do not read the destination's cache lines
//     before overwriting them as a pread or a memcpy below glibc's threshold do.
// The bytes are thus read from the file once; the CPU reads them twice from memory, the price of
// the guarantee without an N-byte buffer. Memory as before: no allocation, and the resident set
// holds one block or window of mapped page-cache pages at a time (keeping the whole mapping
// populated from the verification to the copy would spare the second populate, which is cheap,
// but would count every needed byte in the resident set). LoadOptions::max_staging_bytes still
// bounds the one buffer of the copies that cannot go straight into the destination (dtype
// conversions, non-CPU or non-contiguous tensors). A file that cannot be mapped falls back to a
// verification through a bounded buffer (storage::SafetensorsFile::verify) and a pread per run
// after the agreement; files without checksums, or loads with verify_checksums(false), are read
// with pread as before. Limits: the guarantee holds against damage at rest, not against a file
// rewritten during the load (the copy reads the page cache again); a file that shrank after the
// verification is refused before the copy starts (fstat), and one truncated while it is verified
// or copied is a c10::Error naming the file and the key, not the SIGBUS that reading a mapped
// file past its end raises ([Note: a mapping that shrinks]); after the copy has begun, such an
// error leaves a partial load ([Note: a load that fails while copying]).
constexpr int64_t kReadAheadBytes = int64_t{32} << 20;
#ifdef MADV_POPULATE_READ
constexpr int kMadvisePopulateRead = MADV_POPULATE_READ;
#else
constexpr int kMadvisePopulateRead = 22;  // Linux 5.14's value; older kernels refuse it (EINVAL)
#endif
// The copy populates, copies and releases this much of a mapping at a time (see FileMapping).
constexpr int64_t kMappedWindowBytes = int64_t{4} << 20;
// Copies at least this long use non-temporal stores.
constexpr int64_t kStreamingCopyBytes = int64_t{1} << 20;

// memcpy, with non-temporal stores for large copies on x86-64 (see the note above).
void copy_streaming(void* dst, const void* src, int64_t n) {
#if defined(__x86_64__)
  if (n >= kStreamingCopyBytes) {
    auto* d = static_cast<unsigned char*>(dst);
    const auto* s = static_cast<const unsigned char*>(src);
    const int64_t head = static_cast<int64_t>((16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15);
    std::memcpy(d, s, static_cast<size_t>(head));
    d += head;
    s += head;
    n -= head;
    const int64_t body = n & ~int64_t{63};
    for (int64_t i = 0; i < body; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
      const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
    }
    _mm_sfence();  // the streamed stores are ordered before anything that follows the load
    std::memcpy(d + body, s + body, static_cast<size_t>(n - body));
    return;
  }
#endif
  std::memcpy(dst, src, static_cast<size_t>(n));
}

// [Note: a mapping that shrinks] Reading a page of a MAP_SHARED mapping that lies past the end of
// its file (a file truncated after it was mapped) raises SIGBUS, whose default action ends the
// process. An fstat before the copy catches a file that shrank before it, not one truncated while
// it is read. So every read of a load's mappings (a checksum block of the verification, a window
// of the copy) runs in read_mapped: the reading thread puts the pages it reads and a sigjmp_buf in
// a thread-local slot, and the load's SIGBUS handler (SigbusScope: installed from the verification
// to the end of the copy, counted over concurrent loads in one process, the previous disposition
// restored when the last one ends unless someone replaced the handler meanwhile) turns a SIGBUS of
// a fault at an address in those pages on that thread into a siglongjmp back into read_mapped,
// which returns false; the caller throws a c10::Error naming the API, the file, the key, the
// file's size when it was verified and its size now. Any other SIGBUS (another thread, another
// address, a signal sent with kill) goes to the previous disposition: its handler is called, or
// the default action ends the process as before.
// Why this is safe: a fault's SIGBUS is delivered to the faulting thread, so the slot read is the
// reading thread's own (loads on several threads at once each have theirs; one load reads on its
// calling thread only: the checksums and the copies are not multi-threaded); the slot is
// initial-exec TLS (no allocation on first access in the handler); the handler calls only
// siglongjmp, sigaction, sigemptyset and raise, which are async-signal-safe; the jump leaves only
// frames of madvise, memcpy, copy_streaming and crc32c, which own nothing (no destructor is
// skipped); and read_mapped unblocks SIGBUS again (its sigsetjmp does not save the signal mask,
// which costs a system call) and fences the streamed stores before it returns. The destination of
// a failed read is partly written.
// Cost (measured on a 2-core x86-64 VM, -O2 and -O0 alike): per window of kMappedWindowBytes or
// checksum block, one sigsetjmp without the mask and two thread-local stores, 6 ns, against
// ~560 us to populate, copy and release a 4 MiB window from the page cache (512 MiB in 4 MiB
// windows: 70-72 ms with and without it, within the noise), and against the two madvise calls
// each window and block already makes; per load, four sigaction calls of ~110 ns.
struct MappedRead {
  sigjmp_buf env;
  uintptr_t begin = 0;  // the pages being read: [begin, end)
  uintptr_t end = 0;
};

#if defined(__GNUC__)
thread_local MappedRead* t_mapped_read __attribute__((tls_model("initial-exec"))) = nullptr;
#else
thread_local MappedRead* t_mapped_read = nullptr;
#endif

std::mutex g_sigbus_mutex;
int g_sigbus_scopes = 0;              // SigbusScopes alive (guarded by g_sigbus_mutex)
struct sigaction g_previous_sigbus {};  // the disposition before the first of them

void on_sigbus(int sig, siginfo_t* info, void* context) {
  MappedRead* read = t_mapped_read;
  const auto address = reinterpret_cast<uintptr_t>(info->si_addr);
  if (read != nullptr && info->si_code > 0 && address >= read->begin && address < read->end) {
    t_mapped_read = nullptr;
    siglongjmp(read->env, 1);
  }
  // Not a read of a load's mapping: what the previous disposition does.
  const struct sigaction& previous = g_previous_sigbus;
  if ((previous.sa_flags & SA_SIGINFO) != 0) {
    if (previous.sa_sigaction != nullptr) previous.sa_sigaction(sig, info, context);
  } else if (previous.sa_handler == SIG_IGN && info->si_code <= 0) {
    // A SIGBUS sent by kill() to a process that ignores it.
  } else if (previous.sa_handler == SIG_DFL || previous.sa_handler == SIG_IGN) {
    // The default action (the kernel applies it to a fault's SIGBUS even when it is ignored):
    // return with the default disposition; a fault happens again when the access is retried, a
    // sent signal is raised again (blocked until this handler returns).
    struct sigaction default_action {};
    default_action.sa_handler = SIG_DFL;
    sigemptyset(&default_action.sa_mask);
    ::sigaction(SIGBUS, &default_action, nullptr);
    if (info->si_code <= 0) ::raise(SIGBUS);
  } else {
    previous.sa_handler(sig);
  }
}

// Installs on_sigbus for its lifetime (see the note above). If the handler cannot be installed,
// reads of a shrunk mapping end the process as without it.
class SigbusScope {
 public:
  SigbusScope() {
    std::lock_guard<std::mutex> lock(g_sigbus_mutex);
    if (g_sigbus_scopes++ > 0) return;
    // The previous disposition is stored before on_sigbus can run (on another thread). on_sigbus
    // may still be installed (a handler installed during the last load, which chains to it, was
    // replaced since): then g_previous_sigbus still holds what it chains to, and stays.
    struct sigaction current {};
    if (::sigaction(SIGBUS, nullptr, &current) != 0) return;
    if ((current.sa_flags & SA_SIGINFO) != 0 && current.sa_sigaction == on_sigbus) return;
    g_previous_sigbus = current;
    struct sigaction ours {};
    ours.sa_sigaction = on_sigbus;
    ours.sa_flags = SA_SIGINFO;
    sigemptyset(&ours.sa_mask);
    ::sigaction(SIGBUS, &ours, nullptr);
  }
  ~SigbusScope() {
    std::lock_guard<std::mutex> lock(g_sigbus_mutex);
    if (--g_sigbus_scopes > 0) return;
    struct sigaction current {};
    if (::sigaction(SIGBUS, nullptr, &current) == 0 && (current.sa_flags & SA_SIGINFO) != 0 &&
        current.sa_sigaction == on_sigbus) {
      ::sigaction(SIGBUS, &g_previous_sigbus, nullptr);
    }
  }
  SigbusScope(const SigbusScope&) = delete;
  SigbusScope& operator=(const SigbusScope&) = delete;
};

// Runs `read()`, which reads the mapped bytes [p, p + n), under the handler of a live SigbusScope:
// false when a page of them lies past the end of the file (see the note above).
template <typename F>
bool read_mapped(const unsigned char* p, int64_t n, F&& read) {
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  MappedRead guard;
  guard.begin = reinterpret_cast<uintptr_t>(p) / page * page;
  guard.end = (reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(n) + page - 1) / page * page;
  if (sigsetjmp(guard.env, 0) != 0) {
    // From on_sigbus, which ran with SIGBUS blocked; the mask was not saved: unblock it.
    sigset_t bus;
    sigemptyset(&bus);
    sigaddset(&bus, SIGBUS);
    ::pthread_sigmask(SIG_UNBLOCK, &bus, nullptr);
#if defined(__x86_64__)
    _mm_sfence();  // the streamed stores made before the fault
#endif
    return false;
  }
  t_mapped_read = &guard;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  read();
  std::atomic_signal_fence(std::memory_order_seq_cst);
  t_mapped_read = nullptr;
  return true;
}

// What FileMapping::copy_out did.
enum class MappedCopy { kNotMapped, kCopied, kFileEnded };

// One file's descriptor (for the read-ahead advice) and its read-only mapping over the bytes the
// load verifies and copies (see the note above); `base` is null when the file is not mapped.
struct FileMapping {
  int fd = -1;
  void* base = nullptr;
  size_t length = 0;
  int64_t offset = 0;      // file offset of base (page aligned)
  int64_t file_bytes = 0;  // at mapping time
  ~FileMapping() {
    if (base != nullptr) ::munmap(base, length);
    if (fd >= 0) ::close(fd);
  }
  // The mapped address of file bytes [file_offset, file_offset + n), or null when not mapped.
  const unsigned char* at(int64_t file_offset, int64_t n) const {
    if (base == nullptr || file_offset < offset || file_offset + n > offset + static_cast<int64_t>(length)) {
      return nullptr;
    }
    return static_cast<const unsigned char*>(base) + (file_offset - offset);
  }
  // Maps the pages of [p, p + n) in one call (waiting for the read-ahead when cold); on kernels
  // without MADV_POPULATE_READ (before 5.14) the first access's page faults do it.
  static void populate(const unsigned char* p, int64_t n) { advise_pages(p, n, kMadvisePopulateRead); }
  // Drops the page-table entries of [p, p + n) (the pages stay in the page cache), so that the
  // resident set holds one window of the mapping at a time.
  static void release(const unsigned char* p, int64_t n) { advise_pages(p, n, MADV_DONTNEED); }
  // File bytes [file_offset, file_offset + n) into dst, one window at a time (each under
  // read_mapped). kFileEnded when the file ended inside the window starting at *window_offset
  // (dst is then partly written).
  MappedCopy copy_out(int64_t file_offset, int64_t n, void* dst, int64_t* window_offset) const {
    const unsigned char* src = at(file_offset, n);
    if (src == nullptr) return MappedCopy::kNotMapped;
    for (int64_t done = 0; done < n;) {
      const int64_t len = std::min(kMappedWindowBytes, n - done);
      const unsigned char* window = src + done;
      unsigned char* out = static_cast<unsigned char*>(dst) + done;
      const bool copied = read_mapped(window, len, [&] {
        populate(window, len);
        copy_streaming(out, window, len);
        release(window, len);
      });
      if (!copied) {
        *window_offset = file_offset + done;
        return MappedCopy::kFileEnded;
      }
      done += len;
    }
    return MappedCopy::kCopied;
  }
  // The file's size now (-1 when fstat fails).
  int64_t size_now() const {
    struct stat st {};
    return ::fstat(fd, &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
  }

 private:
  static void advise_pages(const unsigned char* p, int64_t n, int advice) {
    static const int64_t page = ::sysconf(_SC_PAGESIZE);
    const uintptr_t first = reinterpret_cast<uintptr_t>(p) / page * page;
    ::madvise(reinterpret_cast<void*>(first), static_cast<size_t>(reinterpret_cast<uintptr_t>(p) + n - first), advice);
  }
};

// The mappings of one load, by file index; they live from the verification to the end of the copy.
struct FileMappings {
  std::map<int, std::unique_ptr<FileMapping>> files;
  const FileMapping* find(int file) const {
    const auto it = files.find(file);
    return it == files.end() ? nullptr : it->second.get();
  }
};

int64_t file_offset_of(const CheckpointIndex& index, const Piece& piece, int64_t entry_byte) {
  return index.files[piece.file]->header().data_start + piece.entry->data_begin + entry_byte;
}

std::string hex8(uint32_t value) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%08x", value);
  return buf;
}

// dcp::testing::set_before_verify_hook and set_before_copy_hook.
using TestHook = std::function<void(const std::string& key, const std::string& path)>;
std::mutex g_test_hook_mutex;
TestHook g_before_verify_hook;
TestHook g_before_copy_hook;

TestHook test_hook(const TestHook& hook) {
  std::lock_guard<std::mutex> lock(g_test_hook_mutex);
  return hook;
}

// Verifies the checksums of every span, in file order per file, with read-ahead, from one mapping
// per file kept in `mappings` for the copy (see the note above). A mismatch is a c10::Error naming
// the file, the key and the block; so is a file that ends inside a block ([Note: a mapping that
// shrinks]).
void verify_spans(const CheckpointIndex& index, const std::vector<Target>& targets, FileMappings& mappings,
                  const char* api) {
  std::vector<const Span*> spans;
  for (const Target& target : targets) {
    for (const Span& span : target.spans) {
      if (span.end > span.begin) spans.push_back(&span);
    }
  }
  const auto file_offset = [&](const Span& s) { return file_offset_of(index, *s.piece, s.begin); };
  std::sort(spans.begin(), spans.end(), [&](const Span* a, const Span* b) {
    if (a->piece->file != b->piece->file) return a->piece->file < b->piece->file;
    return file_offset(*a) < file_offset(*b);
  });
  static const int64_t page = ::sysconf(_SC_PAGESIZE);
  // Per file with checksums: a descriptor, and a mapping from the first to the last block verified
  // (which covers every byte copied from it: the spans cover the reads). A failed open or mapping
  // goes without (advice skipped; verification and copy through pread).
  std::map<int, std::pair<int64_t, int64_t>> extent;  // file -> [first block begin, last block end)
  for (const Span* s : spans) {
    const storage::SafetensorsFile& file = *index.files[s->piece->file];
    const int64_t block = file.header().crc_block_bytes;
    if (block == 0) continue;
    const storage::SafetensorsEntry& entry = *s->piece->entry;
    const int64_t begin = file_offset_of(index, *s->piece, s->begin / block * block);
    const int64_t end = file_offset_of(index, *s->piece, std::min(((s->end - 1) / block + 1) * block, entry.nbytes()));
    auto [it, fresh] = extent.try_emplace(s->piece->file, begin, end);
    if (!fresh) {
      it->second.first = std::min(it->second.first, begin);
      it->second.second = std::max(it->second.second, end);
    }
  }
  for (const auto& [f, range] : extent) {
    auto mapping = std::make_unique<FileMapping>();
    mapping->fd = ::open(path_of(index, f).c_str(), O_RDONLY | O_CLOEXEC);
    struct stat st {};
    if (mapping->fd >= 0 && ::fstat(mapping->fd, &st) == 0 && st.st_size >= range.second) {
      mapping->file_bytes = st.st_size;
      mapping->offset = range.first / page * page;
      mapping->length = static_cast<size_t>(range.second - mapping->offset);
      void* base = ::mmap(nullptr, mapping->length, PROT_READ, MAP_SHARED, mapping->fd, mapping->offset);
      if (base != MAP_FAILED) mapping->base = base;
    }
    mappings.files.emplace(f, std::move(mapping));
  }
  // Read-ahead: `advised` spans (and `advised_bytes` of the next one) are advised; the reads of
  // the next kReadAheadBytes past what is being verified are kept advised.
  size_t advised = 0;
  int64_t advised_bytes = 0;  // of spans[advised]
  int64_t ahead = 0;          // bytes advised past the span being verified
  const auto advise = [&] {
    while (advised < spans.size() && ahead < kReadAheadBytes) {
      const Span& s = *spans[advised];
      const int64_t length = std::min(s.end - s.begin - advised_bytes, kReadAheadBytes - ahead);
      const FileMapping* mapping = mappings.find(s.piece->file);
      if (mapping != nullptr && mapping->fd >= 0 && length > 0) {
        ::posix_fadvise(mapping->fd, file_offset(s) + advised_bytes, length, POSIX_FADV_WILLNEED);
      }
      ahead += length;
      advised_bytes += length;
      if (advised_bytes == s.end - s.begin) {
        ++advised;
        advised_bytes = 0;
      }
    }
  };
  const TestHook hook = test_hook(g_before_verify_hook);
  for (const Span* span : spans) {
    const storage::SafetensorsFile& file = *index.files[span->piece->file];
    const storage::SafetensorsEntry& entry = *span->piece->entry;
    if (hook) hook(entry.key, path_of(index, span->piece->file));
    const FileMapping* mapping = mappings.find(span->piece->file);
    const int64_t block = file.header().crc_block_bytes;
    if (block == 0 || mapping == nullptr || mapping->base == nullptr) {
      advise();
      file.verify(entry, span->begin, span->end);  // no checksums (a no-op), or not mapped
      ahead -= span->end - span->begin;
    } else {
      const std::string& path = file.header().path;
      // (Blocks counted without overflow: a file's header may declare any block size.)
      const int64_t blocks = entry.nbytes() / block + (entry.nbytes() % block != 0 ? 1 : 0);
      TORCH_CHECK(static_cast<int64_t>(entry.crc32c.size()) == blocks, "'", path, "': entry '", entry.key, "' has ",
                  entry.crc32c.size(), " checksums, expected ", blocks);
      for (int64_t b = span->begin / block; b <= (span->end - 1) / block; ++b) {
        const int64_t block_begin = b * block;
        const int64_t block_end = std::min(block_begin + block, entry.nbytes());
        advise();  // per block, so that the advice stays kReadAheadBytes ahead within large spans
        const int64_t at = file_offset_of(index, *span->piece, block_begin);
        const unsigned char* bytes = mapping->at(at, block_end - block_begin);
        TORCH_INTERNAL_ASSERT(bytes != nullptr, "a verified block outside its file's mapping");
        uint32_t crc = 0;
        const bool read = read_mapped(bytes, block_end - block_begin, [&] {
          FileMapping::populate(bytes, block_end - block_begin);
          crc = storage::crc32c(bytes, static_cast<size_t>(block_end - block_begin));
          FileMapping::release(bytes, block_end - block_begin);
        });
        TORCH_CHECK(read, api, ": the checkpoint file '", path, "' ended while block ", b, " of entry '", entry.key,
                    "' (file bytes [", at, ", ", at + (block_end - block_begin), ")) was verified: it had ",
                    mapping->file_bytes, " bytes when the load mapped it and has ", mapping->size_now(),
                    " now (truncated during the load)");
        TORCH_CHECK(crc == entry.crc32c[b], "'", path, "': checksum mismatch in entry '", entry.key, "' block ", b,
                    " (bytes [", block_begin, ", ", block_end, ") of the entry): stored ", hex8(entry.crc32c[b]),
                    ", computed ", hex8(crc), "; the file is corrupt");
        ahead -= std::min(block_end, span->end) - std::max(block_begin, span->begin);
      }
    }
  }
}

// Copies the planned reads into the local tensors: from the file's mapping when the verification
// made one (see the note above), otherwise with pread; straight into contiguous CPU destinations of
// the file's dtype, otherwise through one staging buffer of at most `max_staging_bytes`. Every error
// names `api`, the file and the key being copied.
// [Note: copy in reverse] The verification reads every byte a rank needs in file order just before
// the agreement, and the copy reads them all again. Whatever part of them the CPU caches still hold
// when the copy starts is the part read last (a cache evicts the least recently used lines first),
// so the copy from the mappings runs in the reverse order, last file and last window first: it
// reads the recently verified windows from the caches before they are evicted by the rest of the
// copy, where copying in file order would evict each window just before reaching it once the
// bytes exceed the cache (the copy's streamed stores do not allocate cache lines). Each window is
// still copied forward. Measured on the benchmark's 300 MiB (tools/checkpoint_benchmark.sh, whose
// machine's last-level cache holds all of it): no difference beyond the noise; the order matters
// where a rank's bytes exceed the cache.
void execute_reads(const char* api, const CheckpointIndex& index, const std::vector<Target>& targets,
                   const FileMappings& mappings, int64_t max_staging_bytes) {
  // A file that shrank since it was mapped would fail in the copy: refuse it before copying.
  for (const auto& [f, mapping] : mappings.files) {
    if (mapping->base == nullptr) continue;
    const int64_t now = mapping->size_now();
    TORCH_CHECK(now == mapping->file_bytes, api, ": the checkpoint file '", path_of(index, f), "' had ",
                mapping->file_bytes, " bytes when it was verified but has ", now,
                " before the copy (truncated or rewritten during the load)");
  }
  const TestHook hook = test_hook(g_before_copy_hook);
  // Bytes [begin, end) of a read's entry into dst.
  const auto read_bytes = [&](const Target& target, const Read& read, int64_t begin, int64_t end, void* dst) {
    const FileMapping* mapping = mappings.find(read.piece->file);
    const int64_t file_begin = file_offset_of(index, *read.piece, begin);
    int64_t window = 0;
    const MappedCopy copied =
        mapping == nullptr ? MappedCopy::kNotMapped : mapping->copy_out(file_begin, end - begin, dst, &window);
    if (copied == MappedCopy::kCopied) return;
    TORCH_CHECK(copied == MappedCopy::kNotMapped, api, ": the checkpoint file '", path_of(index, read.piece->file),
                "' ended while key '", target.key, "' was copied from it: the copy needs its bytes [", file_begin,
                ", ", file_begin + (end - begin), ") and the file had ", mapping->file_bytes,
                " bytes when it was verified, but it has ", mapping->size_now(),
                " now and reading its bytes from offset ", window, " failed (SIGBUS: truncated during the load)");
    try {
      index.files[read.piece->file]->read(*read.piece->entry, begin, end, dst);  // opened by plan_target
    } catch (const std::exception& e) {
      TORCH_CHECK(false, api, ": key '", target.key, "' could not be copied from the checkpoint file '",
                  path_of(index, read.piece->file), "' (its entry's bytes [", begin, ", ", end, ")): ", error_text(e));
    }
  };
  c10::NoGradGuard no_grad;
  at::Tensor staging;
  for (const Target& target : targets) {
    const at::Tensor& local = target.shard.local;
    for (const Read& read : target.reads) {
      if (hook) hook(target.key, path_of(index, read.piece->file));
      const c10::ScalarType dtype = read.piece->entry->dtype;
      const int64_t esize = static_cast<int64_t>(c10::elementSize(dtype));
      if (local.device().is_cpu() && local.is_contiguous() && local.scalar_type() == dtype) {
        auto* dst = static_cast<char*>(local.data_ptr()) + read.dst * esize;
        read_bytes(target, read, read.src * esize, (read.src + read.length) * esize, dst);
        continue;
      }
      const int64_t chunk = std::max<int64_t>(1, max_staging_bytes / esize);
      const int64_t needed = std::min(chunk, read.length) * esize;
      if (!staging.defined() || staging.numel() < needed) staging = at::empty({needed}, at::kByte);
      for (int64_t done = 0; done < read.length; done += chunk) {
        const int64_t n = std::min(chunk, read.length - done);
        read_bytes(target, read, (read.src + done) * esize, (read.src + done + n) * esize, staging.data_ptr());
        const at::Tensor src = at::from_blob(staging.data_ptr(), {n}, at::TensorOptions().dtype(dtype));
        try {
          local.narrow(0, read.dst + done, n).copy_(src);
        } catch (const std::exception& e) {
          TORCH_CHECK(false, api, ": key '", target.key, "' could not be copied into its ", local.scalar_type(),
                      " destination on ", local.device(), ": ", error_text(e));
        }
      }
    }
  }
}

// [Note: a load that fails while copying] The copy writes into the live tensors of the model and
// the optimizer, after every rank agreed that everything it needs is present and verified. If a
// rank fails after that (a checkpoint file truncated during the copy, a failed pread, a failed
// device copy or optimizer update), the ranks agree on it (comm::throw_if_any_error over the
// load's communicator: every rank throws the same error, the lowest failing rank's, with the
// sentence of partial_load_text) and the load is not all-or-nothing: the failing rank holds part
// of the checkpoint, the others all of it (and their optimizers its steps and hyperparameters).
// Restoring the previous values would need a copy of every destination taken before the copy (a
// second copy of every shard of the model and of the optimizer state: for AdamW three times the
// parameters' bytes, on the device for device tensors), which a load must not cost; so instead,
// every rank then sets every floating-point value the load was writing to NaN (poison_targets),
// and training or evaluating from the partial state gives NaN at once instead of silently
// training a mixture (the forward pass itself is fsdp/'s, which this layer cannot make refuse).
// Integer destinations keep what they hold. `extra` is left unchanged. Loading a checkpoint again
// is the way out.
std::string partial_load_text(const char* api) {
  return std::string("; the load failed after every rank had begun copying, so it could not be undone: ") +
         (std::string(api) == kLoadApi ? "the model and the optimizer" : "the state dict's tensors") +
         " hold a partial load (on a failing rank part of the checkpoint, on the others all of it), and every "
         "floating-point value the load writes was set to NaN on every rank so that training cannot go on from it "
         "unnoticed; load a checkpoint again (this one once its files are intact, or another) before training or "
         "evaluating";
}

// Sets every floating-point (and complex) destination of the first `count` targets to NaN, on a
// failed copy (see the note above). Never throws: a destination that cannot be filled keeps what
// it holds.
void poison_targets(const std::vector<Target>& targets, size_t count) noexcept {
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < count && i < targets.size(); ++i) {
    const at::Tensor& local = targets[i].shard.local;
    try {
      if (at::isFloatingType(local.scalar_type()) || at::isComplexType(local.scalar_type())) {
        local.fill_(std::numeric_limits<double>::quiet_NaN());
      }
    } catch (...) {
    }
  }
}

std::string join_keys(const std::vector<std::string>& keys) {
  std::string out;
  for (size_t i = 0; i < keys.size(); ++i) out += (i ? ", '" : "'") + keys[i] + "'";
  return out;
}

struct LoadRequest {
  ShardedStateDict model;
  ShardedStateDict optimizer;  // empty without an optimizer
  bool has_optimizer = false;
  /// Why the destination cannot be written now ("" when it can), checked in validation.
  std::function<std::string()> precheck;
};

// The collective load of `request` (see load). Returns the number of keys loaded; `optimizer_loaded`
// says whether any optimizer key was.
int64_t load_request(const char* api, const std::string& dir, const LoadRequest& request, Extra* extra,
                     const LoadOptions& options, const std::function<void(bool optimizer_loaded)>& finish) {
  auto comm = communicator_or_default(options.communicator(), api);
  std::string error;
  std::unique_ptr<CheckpointIndex> index;
  std::vector<Target> targets;
  FileMappings mappings;  // from the verification to the end of the copy
  SigbusScope sigbus;     // as long ([Note: a mapping that shrinks])
  std::vector<std::pair<std::string, at::Tensor>> extra_tensors;
  bool optimizer_found = false;
  // Phase 1: validate everything this rank needs; nothing is modified.
  try {
    if (request.precheck) {
      const std::string busy = request.precheck();
      TORCH_CHECK(busy.empty(), api, ": ", busy);
    }
    TORCH_CHECK(options.max_staging_bytes() > 0, api, ": LoadOptions::max_staging_bytes must be positive, got ",
                options.max_staging_bytes());
    index = std::make_unique<CheckpointIndex>(open_checkpoint(normalized(dir), api));
    // The checkpoint holds optimizer state when it holds a key of this optimizer's state dict (not
    // when some key merely starts with "state.": a model may have a submodule named `state`).
    for (const auto& [key, shard] : request.optimizer) {
      if (index->keys.count(key)) optimizer_found = true;
    }
    if (request.has_optimizer && !optimizer_found) {
      TORCH_CHECK(!options.strict(), api, ": an optimizer was passed but the checkpoint '", dir,
                  "' holds no optimizer state (saved without one?); pass no optimizer, or "
                  "LoadOptions().strict(false) to leave the optimizer as it is");
    }
    std::vector<std::string> missing;
    auto add = [&](const ShardedStateDict& state) {
      for (const auto& [key, shard] : state) {
        Target target{key, shard, {}};
        if (plan_target(*index, target, options, api)) {
          targets.push_back(std::move(target));
        } else {
          missing.push_back(key);
        }
      }
    };
    add(request.model);
    if (request.has_optimizer && optimizer_found) add(request.optimizer);
    TORCH_CHECK(!options.strict() || missing.empty(), api, ": ", missing.size(),
                missing.size() == 1 ? " key is" : " keys are", " not in the checkpoint '", index->dir, "': ",
                join_keys(missing), " (saved from another model? LoadOptions().strict(false) keeps the values of "
                "missing keys)");
    if (extra != nullptr) {
      // Extra tensors are the keys the manifest names as such; without that record, every key with
      // the prefix that the model and the optimizer do not use.
      std::set<std::string> used;
      for (const auto& [key, shard] : request.model) used.insert(key);
      for (const auto& [key, shard] : request.optimizer) used.insert(key);
      ShardedStateDict wanted;
      for (const auto& [key, value] : index->keys) {
        if (!key.starts_with(kExtraPrefix) || used.count(key)) continue;
        const std::string name = key.substr(std::string(kExtraPrefix).size());
        if (index->extra_tensor_names && !index->extra_tensor_names->count(name)) continue;
        check_extra_fits(*index, key, value, api);
        at::Tensor t = at::empty(value.shape, at::TensorOptions().dtype(value.dtype));
        extra_tensors.emplace_back(name, t);
        LocalShard shard;
        shard.local = t.view({-1});
        shard.global_shape = value.shape;
        wanted.emplace_back(key, std::move(shard));
      }
      add(wanted);
    }
    verify_spans(*index, targets, mappings, api);  // last: every other check is cheaper
  } catch (const std::exception& e) {
    error = error_text(e);
  }
  agree_on_success(*comm, error, api, "validation; nothing was loaded");
  // Phase 2: read into the live tensors ([Note: a load that fails while copying]).
  const size_t loaded = targets.size() - extra_tensors.size();  // the Extra tensors' targets are last
  std::optional<std::string> copy_error;
  try {
    execute_reads(api, *index, targets, mappings, options.max_staging_bytes());
    if (finish) finish(request.has_optimizer && optimizer_found);
  } catch (const std::exception& e) {
    copy_error = error_text(e) + partial_load_text(api);
  }
  try {
    comm::throw_if_any_error({comm}, copy_error, api);
  } catch (...) {
    poison_targets(targets, loaded);
    throw;
  }
  if (extra != nullptr) {
    extra->values = index->extra_values;
    extra->tensors.clear();
    for (auto& [name, t] : extra_tensors) extra->tensors.insert(name, std::move(t));
  }
  return static_cast<int64_t>(loaded);
}

}  // namespace

void load(const std::string& dir, const FSDPModule& root, torch::optim::Optimizer* optimizer, Extra* extra,
          const LoadOptions& options) {
  comm::IssuingApi issuing_api("fsdp::dcp::load");
  wait_pending_save();
  LoadRequest request;
  request.model = sharded_state_dict(root);
  if (optimizer != nullptr) {
    request.optimizer = sharded_optimizer_state_dict(root, *optimizer);
    request.has_optimizer = true;
  }
  request.precheck = [&root] { return parameters_in_use(root); };
  load_request(kLoadApi, dir, request, extra, options, [&](bool optimizer_loaded) {
    if (optimizer_loaded) load_sharded_optimizer_state_dict(root, *optimizer, request.optimizer);
  });
}

int64_t load_state(const std::string& dir, const ShardedStateDict& state, Extra* extra, const LoadOptions& options) {
  wait_pending_save();
  LoadRequest request;
  request.model = state;
  return load_request("fsdp::dcp::load_state", dir, request, extra, options, nullptr);
}

namespace testing {
int64_t checkpoint_files_opened() { return g_files_opened.load(); }

void set_before_verify_hook(std::function<void(const std::string& key, const std::string& path)> hook) {
  std::lock_guard<std::mutex> lock(g_test_hook_mutex);
  g_before_verify_hook = std::move(hook);
}

void set_before_copy_hook(std::function<void(const std::string& key, const std::string& path)> hook) {
  std::lock_guard<std::mutex> lock(g_test_hook_mutex);
  g_before_copy_hook = std::move(hook);
}
}  // namespace testing

}  // namespace fsdp::dcp
