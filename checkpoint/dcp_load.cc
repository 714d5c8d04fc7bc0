#include "fsdp_cpp/checkpoint/distributed_checkpoint.h"
#include "fsdp_cpp/comm/issuing_api.h"

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include "dcp_support.h"  // private to //checkpoint:distributed_checkpoint
#include "fsdp_cpp/checkpoint/optimizer_state_dict.h"
#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/checkpoint/state_dict_support.h"
#include "fsdp_cpp/contract/shape_text.h"
#include "fsdp_cpp/storage/atomic_directory.h"
#include "fsdp_cpp/storage/boxes.h"
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

// Parses a file's DCP_SHARDING_INFO ({key: {"saved_offsets": [...]}}; null when absent).
json sharding_info(const storage::SafetensorsHeader& header, const char* api) {
  const auto info = header.metadata.find(kShardingInfoKey);
  if (info == header.metadata.end()) return json();
  try {
    return json::parse(info->second);
  } catch (const json::exception& e) {
    TORCH_CHECK(false, api, ": the ", kShardingInfoKey, " metadata of '", header.path, "' is not valid JSON: ",
                e.what());
  }
  return json();
}

std::vector<int64_t> saved_offsets(const json& sharding, const storage::SafetensorsEntry& entry,
                                   const std::string& path, const char* api) {
  if (!sharding.is_object()) return std::vector<int64_t>(entry.shape.size(), 0);
  TORCH_CHECK(sharding.contains(entry.key) && sharding[entry.key].contains(kSavedOffsetsKey), api, ": '", path,
              "' has no ", kShardingInfoKey, " entry for its key '", entry.key, "'");
  auto offsets = sharding[entry.key][kSavedOffsetsKey].get<std::vector<int64_t>>();
  TORCH_CHECK(offsets.size() == entry.shape.size(), api, ": '", path, "': key '", entry.key, "' has shape ",
              shape_string(entry.shape), " but saved offsets ", shape_string(offsets));
  return offsets;
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
    manifest = json::parse(storage::read_file(manifest_path));
  } catch (const json::exception& e) {
    TORCH_CHECK(false, api, ": the manifest '", manifest_path, "' is not valid JSON: ", e.what());
  }
  try {
    TORCH_CHECK(manifest.at("format").get<std::string>() == kFormatName, api, ": '", manifest_path,
                "' is not a checkpoint manifest of this library (format '", manifest.at("format").dump(), "')");
    const int version = manifest.at("version").get<int>();
    TORCH_CHECK(version <= kFormatVersion, api, ": '", manifest_path, "' has format version ", version,
                ", newer than this library reads (", kFormatVersion, ")");
    for (const auto& f : manifest.at("files")) {
      index.file_names.push_back(f.at(0).get<std::string>());
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
      k.shape = record.at(2).get<std::vector<int64_t>>();
      for (const auto& box : record.at(3)) {
        Piece piece;
        piece.file = box.at(0).get<int>();
        TORCH_CHECK(piece.file >= 0 && piece.file < static_cast<int>(index.file_names.size()), api, ": key '", key,
                    "' names file ", piece.file, " in the manifest '", manifest_path, "', which lists ",
                    index.file_names.size());
        piece.box.offsets = box.at(1).get<std::vector<int64_t>>();
        piece.box.sizes = box.at(2).get<std::vector<int64_t>>();
        TORCH_CHECK(piece.box.offsets.size() == k.shape.size() && piece.box.sizes.size() == k.shape.size(), api,
                    ": key '", key, "' has a box of another rank than its shape in the manifest '", manifest_path, "'");
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
// the first byte written to a destination: each byte is touched twice, once to checksum it and
// once to copy it. Keeping the verified bytes in between instead of reading them again is only
// possible for as many bytes as are kept: with a staging buffer of S bytes and N > S bytes needed,
// N - S bytes must be read again after the agreement whatever the staging does. On Linux the page
// cache already is that buffer: the verification below brings every needed byte into it (one
// disk read: posix_fadvise(WILLNEED) keeps kReadAheadBytes of reads in flight ahead of the
// checksums, so a cold load reads the disk in large requests while the CPU checksums), and the
// copy after the agreement is one pread per run from the page cache. A private staging copy would
// add a memcpy per staged byte and save nothing warm (it would only spare re-reading bytes that
// memory pressure evicted between the two passes), so there is none: the checksum pass maps one
// checksum block at a time (storage::SafetensorsFile::verify; resident set + one block, 4 MiB by
// default), and LoadOptions::max_staging_bytes bounds only the buffer of the copies that cannot
// go straight into the destination (dtype conversions, non-CPU or non-contiguous tensors). What
// makes the checksum pass cheap is a CRC-32C on three streams ([Note: three CRC streams] in
// storage/crc32c.cc, about 4x one stream): the pass, mapping included, now takes about half the
// copy's time from the page cache, where it took as long as the copy. The guarantee holds against damage at rest, not against a file rewritten between the
// two passes (the copy reads the file again; so did every load before this one).
constexpr int64_t kReadAheadBytes = int64_t{32} << 20;

// Verifies the checksums of every span, in file order per file, with read-ahead (see above). A
// mismatch is a c10::Error naming the file, the key and the block.
void verify_spans(const CheckpointIndex& index, const std::vector<Target>& targets) {
  std::vector<const Span*> spans;
  for (const Target& target : targets) {
    for (const Span& span : target.spans) spans.push_back(&span);
  }
  const auto file_offset = [&](const Span& s) {
    return index.files[s.piece->file]->header().data_start + s.piece->entry->data_begin + s.begin;
  };
  std::sort(spans.begin(), spans.end(), [&](const Span* a, const Span* b) {
    if (a->piece->file != b->piece->file) return a->piece->file < b->piece->file;
    return file_offset(*a) < file_offset(*b);
  });
  // Read-ahead: `advised` spans (and `advised_bytes` of the next one) are advised; the reads of
  // the next kReadAheadBytes past what is being verified are kept advised. One descriptor per
  // file, only for the advice (a failed open or advice just goes without).
  std::map<int, int> fds;
  const auto fd_of = [&](int file) {
    auto [it, fresh] = fds.try_emplace(file, -1);
    if (fresh) it->second = ::open(path_of(index, file).c_str(), O_RDONLY | O_CLOEXEC);
    return it->second;
  };
  size_t advised = 0;
  int64_t advised_bytes = 0;   // of spans[advised]
  int64_t ahead = 0;           // bytes advised past the span being verified
  const auto advise = [&] {
    while (advised < spans.size() && ahead < kReadAheadBytes) {
      const Span& s = *spans[advised];
      const int64_t length = std::min(s.end - s.begin - advised_bytes, kReadAheadBytes - ahead);
      const int fd = fd_of(s.piece->file);
      if (fd >= 0 && length > 0) ::posix_fadvise(fd, file_offset(s) + advised_bytes, length, POSIX_FADV_WILLNEED);
      ahead += length;
      advised_bytes += length;
      if (advised_bytes == s.end - s.begin) {
        ++advised;
        advised_bytes = 0;
      }
    }
  };
  try {
    for (const Span* span : spans) {
      advise();
      index.files[span->piece->file]->verify(*span->piece->entry, span->begin, span->end);
      ahead -= span->end - span->begin;
    }
  } catch (...) {
    for (const auto& [file, fd] : fds) {
      if (fd >= 0) ::close(fd);
    }
    throw;
  }
  for (const auto& [file, fd] : fds) {
    if (fd >= 0) ::close(fd);
  }
}

// Copies the planned reads into the local tensors: straight into contiguous CPU destinations of the
// file's dtype, otherwise through one staging buffer of at most `max_staging_bytes`.
void execute_reads(const CheckpointIndex& index, const std::vector<Target>& targets, int64_t max_staging_bytes) {
  c10::NoGradGuard no_grad;
  at::Tensor staging;
  for (const Target& target : targets) {
    const at::Tensor& local = target.shard.local;
    for (const Read& read : target.reads) {
      const storage::SafetensorsFile& file = *index.files[read.piece->file];  // opened by plan_target
      const c10::ScalarType dtype = read.piece->entry->dtype;
      const int64_t esize = static_cast<int64_t>(c10::elementSize(dtype));
      if (local.device().is_cpu() && local.is_contiguous() && local.scalar_type() == dtype) {
        auto* dst = static_cast<char*>(local.data_ptr()) + read.dst * esize;
        file.read(*read.piece->entry, read.src * esize, (read.src + read.length) * esize, dst);
        continue;
      }
      const int64_t chunk = std::max<int64_t>(1, max_staging_bytes / esize);
      const int64_t needed = std::min(chunk, read.length) * esize;
      if (!staging.defined() || staging.numel() < needed) staging = at::empty({needed}, at::kByte);
      for (int64_t done = 0; done < read.length; done += chunk) {
        const int64_t n = std::min(chunk, read.length - done);
        file.read(*read.piece->entry, (read.src + done) * esize, (read.src + done + n) * esize, staging.data_ptr());
        const at::Tensor src = at::from_blob(staging.data_ptr(), {n}, at::TensorOptions().dtype(dtype));
        local.narrow(0, read.dst + done, n).copy_(src);
      }
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
        at::Tensor t = at::empty(value.shape, at::TensorOptions().dtype(value.dtype));
        extra_tensors.emplace_back(name, t);
        LocalShard shard;
        shard.local = t.view({-1});
        shard.global_shape = value.shape;
        wanted.emplace_back(key, std::move(shard));
      }
      add(wanted);
    }
    verify_spans(*index, targets);  // last: every other check is cheaper
  } catch (const std::exception& e) {
    error = error_text(e);
  }
  agree_on_success(*comm, error, api, "validation; nothing was loaded");
  // Phase 2: read into the live tensors.
  try {
    execute_reads(*index, targets, options.max_staging_bytes());
    if (finish) finish(request.has_optimizer && optimizer_found);
    if (extra != nullptr) {
      extra->values = index->extra_values;
      extra->tensors.clear();
      for (auto& [name, t] : extra_tensors) extra->tensors.insert(name, std::move(t));
    }
  } catch (const std::exception& e) {
    error = error_text(e);
  }
  agree_on_success(*comm, error, api, "reading");
  return static_cast<int64_t>(targets.size() - extra_tensors.size());
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
}  // namespace testing

}  // namespace fsdp::dcp
