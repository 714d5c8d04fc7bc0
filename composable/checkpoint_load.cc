#include "composable/distributed_checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <utility>
#include <vector>

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "composable/checkpoint_support.h"
#include "composable/optimizer_state_dict.h"
#include "composable/state_dict.h"
#include "storage/atomic_directory.h"
#include "storage/boxes.h"
#include "storage/safetensors.h"

// Loading: the index of a checkpoint's files, validation on every rank, then the reads.

namespace fsdp::dcp {
using namespace detail;

namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// A box of a key stored in one file.
struct Piece {
  int file = 0;
  const storage::SafetensorsEntry* entry = nullptr;
  storage::Box box;
};

struct KeyIndex {
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> shape;
  std::vector<Piece> pieces;
};

struct CheckpointIndex {
  std::string dir;
  std::vector<storage::SafetensorsFile> files;
  std::map<std::string, KeyIndex> keys;
  std::map<std::string, std::string> extra_values;
  bool has_manifest = false;
};

void index_file(CheckpointIndex& index, int file, const char* api) {
  const storage::SafetensorsHeader& header = index.files[file].header();
  json sharding;
  const auto info = header.metadata.find(kShardingInfoKey);
  if (info != header.metadata.end()) {
    try {
      sharding = json::parse(info->second);
    } catch (const json::exception& e) {
      TORCH_CHECK(false, api, ": the ", kShardingInfoKey, " metadata of '", header.path, "' is not valid JSON: ",
                  e.what());
    }
  }
  for (const auto& entry : header.entries) {
    storage::Box box;
    box.sizes = entry.shape;
    if (sharding.is_object()) {
      TORCH_CHECK(sharding.contains(entry.key) && sharding[entry.key].contains(kSavedOffsetsKey), api, ": '",
                  header.path, "' has no ", kShardingInfoKey, " entry for its key '", entry.key, "'");
      box.offsets = sharding[entry.key][kSavedOffsetsKey].get<std::vector<int64_t>>();
      TORCH_CHECK(box.offsets.size() == box.sizes.size(), api, ": '", header.path, "': key '", entry.key,
                  "' has shape ", shape_text(box.sizes), " but saved offsets ", shape_text(box.offsets));
    } else {
      box.offsets.assign(box.sizes.size(), 0);
    }
    auto [it, fresh] = index.keys.try_emplace(entry.key);
    KeyIndex& key = it->second;
    if (fresh) {
      key.dtype = entry.dtype;
      key.shape.assign(box.sizes.size(), 0);
    }
    TORCH_CHECK(key.dtype == entry.dtype && key.shape.size() == box.sizes.size(), api, ": key '", entry.key,
                "' is stored with different dtypes or ranks in different files ('", header.path, "' has ",
                storage::safetensors_dtype_name(entry.dtype), " ", shape_text(entry.shape), ")");
    for (size_t d = 0; d < box.sizes.size(); ++d) key.shape[d] = std::max(key.shape[d], box.offsets[d] + box.sizes[d]);
    key.pieces.push_back({file, &entry, std::move(box)});
  }
}

CheckpointIndex open_checkpoint(const std::string& dir, const char* api) {
  CheckpointIndex index;
  index.dir = dir;
  TORCH_CHECK(fs::is_directory(dir), api, ": there is no checkpoint folder '", dir, "'");
  const std::string manifest_path = join_path(dir, kManifestName);
  std::vector<std::string> names;
  json manifest;
  if (storage::exists(manifest_path)) {
    index.has_manifest = true;
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
        const std::string name = f.at(0).get<std::string>();
        const int64_t bytes = f.at(1).get<int64_t>();
        const std::string path = join_path(dir, name);
        TORCH_CHECK(storage::exists(path), api, ": the checkpoint file '", path,
                    "' listed in the manifest is missing");
        const auto size = static_cast<int64_t>(fs::file_size(path));
        TORCH_CHECK(size == bytes, api, ": the checkpoint file '", path, "' has ", size,
                    " bytes but the manifest says ", bytes, " (truncated or modified after the save)");
        names.push_back(name);
      }
      index.extra_values = manifest.at("extra").at("values").get<std::map<std::string, std::string>>();
    } catch (const json::exception& e) {
      TORCH_CHECK(false, api, ": the manifest '", manifest_path, "' is malformed: ", e.what());
    }
  } else {
    for (const auto& name : storage::list_files(dir)) {
      if (name.size() > std::string(kSuffix).size() && name.ends_with(kSuffix)) names.push_back(name);
    }
    TORCH_CHECK(!names.empty(), api, ": '", dir, "' holds no checkpoint (neither ", kManifestName, " nor *",
                kSuffix, " files)");
  }
  index.files.reserve(names.size());
  for (const auto& name : names) index.files.emplace_back(join_path(dir, name));
  for (size_t f = 0; f < index.files.size(); ++f) index_file(index, static_cast<int>(f), api);
  if (!index.has_manifest) return index;
  // The manifest and the headers must tell the same story.
  try {
    for (const auto& record : manifest.at("keys")) {
      const std::string key = record.at(0).get<std::string>();
      const auto dtype = storage::scalar_type_from_safetensors(record.at(1).get<std::string>(), manifest_path);
      const auto shape = record.at(2).get<std::vector<int64_t>>();
      const auto boxes = record.at(3);
      auto it = index.keys.find(key);
      if (it == index.keys.end()) {
        TORCH_CHECK(boxes.empty(), api, ": key '", key, "' is listed in the manifest but in none of its files");
        index.keys[key] = KeyIndex{dtype, shape, {}};
        continue;
      }
      TORCH_CHECK(it->second.dtype == dtype && it->second.shape == shape, api, ": key '", key,
                  "' is ", record.at(1).get<std::string>(), " ", shape_text(shape), " in the manifest but ",
                  storage::safetensors_dtype_name(it->second.dtype), " ", shape_text(it->second.shape),
                  " in the files");
      TORCH_CHECK(it->second.pieces.size() == boxes.size(), api, ": key '", key, "' has ", boxes.size(),
                  " boxes in the manifest but ", it->second.pieces.size(), " in the files");
    }
  } catch (const json::exception& e) {
    TORCH_CHECK(false, api, ": the manifest '", manifest_path, "' is malformed: ", e.what());
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

struct Target {
  std::string key;
  LocalShard shard;
  std::vector<Read> reads;
};

// Plans the reads that fill `target` (its whole local range) and checks shape, dtype, coverage
// and checksums. Returns false when the key is absent and `strict` is off.
bool plan_target(const CheckpointIndex& index, Target& target, const LoadOptions& options, const char* api) {
  const LocalShard& shard = target.shard;
  const auto it = index.keys.find(target.key);
  if (it == index.keys.end()) {
    if (numel_of(shard.global_shape) == 0) return false;  // nothing to load
    TORCH_CHECK(!options.strict(), api, ": key '", target.key, "' is not in the checkpoint '", index.dir,
                "' (saved from another model? LoadOptions().strict(false) keeps the values of missing keys)");
    return false;
  }
  const KeyIndex& key = it->second;
  TORCH_CHECK(key.shape == shard.global_shape, api, ": key '", target.key, "' has shape ", shape_text(key.shape),
              " in the checkpoint '", index.dir, "' but ", shape_text(shard.global_shape), " here");
  const c10::ScalarType want = shard.local.scalar_type();
  TORCH_CHECK(key.dtype == want || options.convert_dtype(), api, ": key '", target.key, "' is stored as ",
              storage::safetensors_dtype_name(key.dtype), " in the checkpoint '", index.dir, "' but is ",
              c10::toString(want), " here; pass LoadOptions().convert_dtype(true) to convert it");
  const int64_t begin = shard.flat_offset;
  const int64_t end = begin + shard.local.numel();
  if (begin == end) return true;
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
    target.reads.push_back({piece, run.local_begin + skip, pos - begin, run.length - skip});
    pos = run.global_begin + run.length;
  }
  TORCH_CHECK(pos >= end, api, ": key '", target.key, "': the checkpoint '", index.dir,
              "' holds no value for flat elements [", pos, ", ", end, ") (its boxes do not cover them)");
  if (options.verify_checksums()) {
    // Once per piece, over the span of the bytes read from it.
    std::map<const Piece*, std::pair<int64_t, int64_t>> spans;
    for (const Read& read : target.reads) {
      auto [span, fresh] = spans.try_emplace(read.piece, read.src, read.src + read.length);
      if (!fresh) {
        span->second.first = std::min(span->second.first, read.src);
        span->second.second = std::max(span->second.second, read.src + read.length);
      }
    }
    const int64_t esize = static_cast<int64_t>(c10::elementSize(key.dtype));
    for (const auto& [piece, span] : spans) {
      index.files[piece->file].verify(*piece->entry, span.first * esize, span.second * esize);
    }
  }
  return true;
}

// Copies the planned reads into the local tensors: straight into contiguous CPU destinations of the
// file's dtype, otherwise through one staging buffer of at most `staging_bytes`.
void execute_reads(const CheckpointIndex& index, const std::vector<Target>& targets, int64_t staging_bytes) {
  c10::NoGradGuard no_grad;
  at::Tensor staging;
  for (const Target& target : targets) {
    const at::Tensor& local = target.shard.local;
    for (const Read& read : target.reads) {
      const storage::SafetensorsFile& file = index.files[read.piece->file];
      const c10::ScalarType dtype = read.piece->entry->dtype;
      const int64_t esize = static_cast<int64_t>(c10::elementSize(dtype));
      if (local.device().is_cpu() && local.is_contiguous() && local.scalar_type() == dtype) {
        auto* dst = static_cast<char*>(local.data_ptr()) + read.dst * esize;
        file.read(*read.piece->entry, read.src * esize, (read.src + read.length) * esize, dst);
        continue;
      }
      const int64_t chunk = std::max<int64_t>(1, staging_bytes / esize);
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

bool is_optimizer_key(const std::string& key) {
  return key.starts_with("state.") || key.starts_with("param_groups.");
}

struct LoadRequest {
  ShardedStateDict model;
  ShardedStateDict optimizer;  // empty without an optimizer
  bool has_optimizer = false;
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
    TORCH_CHECK(options.staging_bytes() > 0, api, ": LoadOptions::staging_bytes must be positive");
    index = std::make_unique<CheckpointIndex>(open_checkpoint(normalized(dir), api));
    for (const auto& [key, value] : index->keys) {
      if (is_optimizer_key(key)) optimizer_found = true;
    }
    if (request.has_optimizer && !optimizer_found) {
      TORCH_CHECK(!options.strict(), api, ": an optimizer was passed but the checkpoint '", dir,
                  "' holds no optimizer state (saved without one?); pass no optimizer, or "
                  "LoadOptions().strict(false) to leave the optimizer as it is");
    }
    auto add = [&](const ShardedStateDict& state) {
      for (const auto& [key, shard] : state) {
        Target target{key, shard, {}};
        if (plan_target(*index, target, options, api)) targets.push_back(std::move(target));
      }
    };
    add(request.model);
    if (request.has_optimizer && optimizer_found) add(request.optimizer);
    if (extra != nullptr) {
      ShardedStateDict wanted;
      for (const auto& [key, value] : index->keys) {
        if (!key.starts_with(kExtraPrefix)) continue;
        at::Tensor t = at::empty(value.shape, at::TensorOptions().dtype(value.dtype));
        extra_tensors.emplace_back(key.substr(std::string(kExtraPrefix).size()), t);
        LocalShard shard;
        shard.local = t.view({-1});
        shard.global_shape = value.shape;
        wanted.emplace_back(key, std::move(shard));
      }
      add(wanted);
    }
  } catch (const std::exception& e) {
    error = error_text(e);
  }
  agree_on_success(*comm, error, api, "validation; nothing was loaded");
  // Phase 2: read into the live tensors.
  try {
    execute_reads(*index, targets, options.staging_bytes());
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
  wait_pending_save();
  LoadRequest request;
  request.model = sharded_state_dict(root);
  if (optimizer != nullptr) {
    request.optimizer = sharded_optimizer_state_dict(root, *optimizer);
    request.has_optimizer = true;
  }
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


}  // namespace fsdp::dcp
