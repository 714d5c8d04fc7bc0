#include "composable/distributed_checkpoint.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "comm/init.h"
#include "composable/optimizer_state_dict.h"
#include "composable/state_dict.h"
#include "storage/atomic_directory.h"
#include "storage/boxes.h"
#include "storage/safetensors.h"

namespace fsdp::dcp {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

constexpr int kFormatVersion = 1;
constexpr const char* kFormatName = "fsdp-dcp";
// torch.distributed.checkpoint's Hugging Face layout (torch/distributed/checkpoint/_hf_utils.py).
constexpr const char* kShardingInfoKey = "DCP_SHARDING_INFO";
constexpr const char* kSavedOffsetsKey = "saved_offsets";
constexpr const char* kSuffix = ".safetensors";
constexpr const char* kExtraPrefix = "extra.";

constexpr const char* kSaveApi = "fsdp::dcp::save";
constexpr const char* kLoadApi = "fsdp::dcp::load";

std::mutex g_hook_mutex;
std::function<void(const std::string&)> g_file_written_hook;

std::shared_ptr<comm::Communicator> communicator_or_default(const std::shared_ptr<comm::Communicator>& given,
                                                            const char* api) {
  if (given) return given;
  TORCH_CHECK(comm::is_initialized(), api,
              ": no communicator was given and there is no default process group; pass "
              "options.communicator(...) or call fsdp::comm::init_process_group() first");
  return comm::default_process_group().comm;
}

std::string error_text(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) return c10->what_without_backtrace();
  return e.what();
}

std::vector<uint8_t> to_bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string from_bytes(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

// Every rank passes its error ("" when it succeeded); every rank throws the lowest failing rank's
// error, naming that rank, so all of them fail the same way.
void agree_on_success(comm::Communicator& comm, const std::string& error, const char* api, const char* stage) {
  const auto all = comm.all_gather_bytes(to_bytes(error), std::string(api) + " " + stage);
  const std::string prefix = std::string(api) + ": ";
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty()) continue;
    std::string message = from_bytes(all[r]);
    if (message.starts_with(prefix)) message = message.substr(prefix.size());
    TORCH_CHECK(false, api, " failed on rank ", r, " of ", all.size(), " (", stage, "): ", message);
  }
}

std::string five_digits(int64_t value) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%05lld", static_cast<long long>(value));
  return buf;
}

std::string shard_file_name(int rank, int index, int count) {
  return "shard-" + five_digits(rank + 1) + "-model-" + five_digits(index + 1) + "-of-" + five_digits(count) + kSuffix;
}

std::string join_path(const std::string& dir, const std::string& name) { return (fs::path(dir) / name).string(); }

// "a/b/" -> "a/b", so the temporary sibling of a folder is beside it whatever the spelling.
std::string normalized(const std::string& dir) {
  std::string out = fs::path(dir).lexically_normal().string();
  while (out.size() > 1 && out.back() == '/') out.pop_back();
  return out;
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << "]";
  return out.str();
}

// ----------------------------------------------------------------------------------------------
// Saving

// What one rank writes: files of boxes, and its record of every key for the manifest.
struct RankPlan {
  std::vector<std::string> file_names;
  std::vector<std::vector<storage::SafetensorsItem>> file_items;
  std::vector<json> file_sharding;  // per file: {key: {"saved_offsets": [...]}}
  json keys = json::array();        // [[key, dtype, shape, [[file, offsets, sizes], ...]], ...]
};

// Model, optimizer and extra tensors as one sharded state dict; key collisions are refused.
ShardedStateDict collect_state(const ShardedStateDict& base, const Extra& extra, int rank, const char* api) {
  ShardedStateDict state = base;
  for (const auto& item : extra.tensors) {
    const at::Tensor t = item.value().contiguous();
    LocalShard shard;
    shard.local = t.reshape({-1});
    shard.global_shape = t.sizes().vec();
    shard.flat_offset = 0;
    shard.write = rank == 0;
    state.emplace_back(kExtraPrefix + item.key(), std::move(shard));
  }
  std::set<std::string> seen;
  for (const auto& [key, shard] : state) {
    TORCH_CHECK(seen.insert(key).second, api, ": the key '", key,
                "' appears twice in the state to save (model, optimizer and extra keys, the latter "
                "prefixed 'extra.', must be distinct)");
    TORCH_CHECK(shard.local.defined() && shard.local.dim() == 1 && shard.local.is_contiguous(), api,
                ": the local shard of '", key, "' must be a defined, contiguous 1-D tensor");
    TORCH_CHECK(shard.flat_offset >= 0 && shard.flat_offset + shard.local.numel() <= numel_of(shard.global_shape),
                api, ": the local shard of '", key, "' holds elements [", shard.flat_offset, ", ",
                shard.flat_offset + shard.local.numel(), ") of a tensor of shape ", shape_text(shard.global_shape),
                " (", numel_of(shard.global_shape), " elements)");
  }
  return state;
}

RankPlan plan_rank(const ShardedStateDict& state, int rank) {
  RankPlan plan;
  std::vector<std::vector<storage::Box>> per_key_boxes;
  size_t files = 0;
  for (const auto& [key, shard] : state) {
    std::vector<storage::Box> boxes;
    if (shard.write && shard.local.numel() > 0) {
      boxes = storage::boxes_of_flat_range(shard.global_shape, shard.flat_offset,
                                           shard.flat_offset + shard.local.numel());
    }
    files = std::max(files, boxes.size());
    json record_boxes = json::array();
    for (size_t j = 0; j < boxes.size(); ++j) {
      record_boxes.push_back(json::array({static_cast<int>(j), boxes[j].offsets, boxes[j].sizes}));
    }
    plan.keys.push_back(json::array({key, storage::safetensors_dtype_name(shard.local.scalar_type()),
                                     shard.global_shape, std::move(record_boxes)}));
    per_key_boxes.push_back(std::move(boxes));
  }
  plan.file_items.resize(files);
  plan.file_sharding.assign(files, json::object());
  for (size_t j = 0; j < files; ++j) {
    plan.file_names.push_back(shard_file_name(rank, static_cast<int>(j), static_cast<int>(files)));
  }
  for (size_t k = 0; k < state.size(); ++k) {
    const LocalShard& shard = state[k].second;
    for (size_t j = 0; j < per_key_boxes[k].size(); ++j) {
      const storage::Box& box = per_key_boxes[k][j];
      // The box's elements are contiguous in flat order: from the flat index of its first corner.
      int64_t first = 0;
      for (size_t d = 0; d < box.offsets.size(); ++d) first = first * shard.global_shape[d] + box.offsets[d];
      at::Tensor data = shard.local.narrow(0, first - shard.flat_offset, box.numel()).view(box.sizes);
      plan.file_items[j].push_back({state[k].first, std::move(data)});
      plan.file_sharding[j][state[k].first] = json{{kSavedOffsetsKey, box.offsets}};
    }
  }
  return plan;
}

}  // namespace

struct AsyncSave::State {
  std::string api;
  std::string dir;
  std::string tmp;
  std::shared_ptr<comm::Communicator> comm;
  std::map<std::string, std::string> extra_values;
  int64_t crc_block_bytes = 0;
  RankPlan plan;

  std::thread writer;
  std::atomic<bool> written{false};
  std::string write_error;   // set by the writer before `written`
  json written_files;        // [[name, bytes], ...]
  bool waited = false;
  std::string final_error;   // what wait() threw

  ~State() {
    if (writer.joinable()) writer.join();
  }

  void write_files() {
    try {
      std::function<void(const std::string&)> hook;
      {
        std::lock_guard<std::mutex> lock(g_hook_mutex);
        hook = g_file_written_hook;
      }
      const std::map<std::string, std::string> base_metadata{{"format", "pt"}, {"DCP_VERSION", "1.0"}};
      for (size_t j = 0; j < plan.file_names.size(); ++j) {
        const std::string path = join_path(tmp, plan.file_names[j]);
        auto metadata = base_metadata;
        metadata[kShardingInfoKey] = plan.file_sharding[j].dump();
        storage::write_safetensors(path, plan.file_items[j], metadata, crc_block_bytes);
        written_files.push_back(json::array({plan.file_names[j], static_cast<int64_t>(fs::file_size(path))}));
        plan.file_items[j].clear();  // release host copies as soon as they are on disk
        if (hook) hook(path);
      }
    } catch (const std::exception& e) {
      write_error = error_text(e);
    } catch (...) {
      write_error = "unknown error while writing checkpoint files";
    }
    written.store(true);
  }
};

namespace {

std::mutex g_pending_mutex;
std::weak_ptr<AsyncSave::State> g_pending;

// Builds the manifest from every rank's report; every rank computes it (and its errors) alike.
json merge_manifest(const std::vector<json>& reports, const std::map<std::string, std::string>& extra_values,
                    const char* api) {
  json files = json::array();
  std::vector<std::vector<int>> file_index(reports.size());
  for (size_t r = 0; r < reports.size(); ++r) {
    for (const auto& f : reports[r].at("files")) {
      file_index[r].push_back(static_cast<int>(files.size()));
      files.push_back(f);
    }
  }
  json keys = json::array();
  std::map<std::string, size_t> position;
  std::vector<int64_t> written;
  for (size_t r = 0; r < reports.size(); ++r) {
    for (const auto& record : reports[r].at("keys")) {
      const std::string key = record.at(0).get<std::string>();
      auto it = position.find(key);
      if (it == position.end()) {
        it = position.emplace(key, keys.size()).first;
        keys.push_back(json::array({key, record.at(1), record.at(2), json::array()}));
        written.push_back(0);
      }
      json& merged = keys[it->second];
      TORCH_CHECK(merged.at(1) == record.at(1) && merged.at(2) == record.at(2), api, ": the ranks disagree on '",
                  key, "': ", merged.at(1).dump(), " ", merged.at(2).dump(), " on one rank, ", record.at(1).dump(),
                  " ", record.at(2).dump(), " on rank ", r);
      for (const auto& box : record.at(3)) {
        const int local_file = box.at(0).get<int>();
        merged[3].push_back(json::array({file_index[r].at(local_file), box.at(1), box.at(2)}));
        written[it->second] += numel_of(box.at(2).get<std::vector<int64_t>>());
      }
    }
  }
  for (size_t k = 0; k < keys.size(); ++k) {
    const int64_t total = numel_of(keys[k].at(2).get<std::vector<int64_t>>());
    TORCH_CHECK(written[k] == total, api, ": the ranks write ", written[k], " elements of '",
                keys[k].at(0).get<std::string>(), "', which has ", total,
                " (every element must be written by exactly one rank: check the `write` flags)");
  }
  json manifest;
  manifest["format"] = kFormatName;
  manifest["version"] = kFormatVersion;
  manifest["world_size"] = reports.size();
  manifest["files"] = std::move(files);
  manifest["keys"] = std::move(keys);
  manifest["extra"] = json{{"values", extra_values}};
  return manifest;
}

// Collective: joins the writer, agrees, commits.
void finish_save(AsyncSave::State& s) {
  if (s.waited) {
    TORCH_CHECK(s.final_error.empty(), s.final_error);
    return;
  }
  s.waited = true;
  try {
    if (s.writer.joinable()) s.writer.join();
    json report{{"error", s.write_error}, {"files", s.written_files}, {"keys", s.plan.keys}};
    const auto all = s.comm->all_gather_bytes(to_bytes(report.dump()), std::string(s.api) + " reports");
    std::vector<json> reports;
    for (const auto& bytes : all) reports.push_back(json::parse(from_bytes(bytes)));
    for (size_t r = 0; r < reports.size(); ++r) {
      const std::string error = reports[r].at("error").get<std::string>();
      TORCH_CHECK(error.empty(), s.api, " failed on rank ", r, " of ", reports.size(),
                  " while writing its files: ", error, " (the previous checkpoint in '", s.dir, "' is unchanged)");
    }
    const json manifest = merge_manifest(reports, s.extra_values, s.api.c_str());
    std::string error;
    if (s.comm->rank() == 0) {
      try {
        storage::write_file(join_path(s.tmp, kManifestName), manifest.dump());
        storage::commit_directory(s.tmp, s.dir);
      } catch (const std::exception& e) {
        error = error_text(e);
      }
    }
    agree_on_success(*s.comm, error, s.api.c_str(), "commit");
  } catch (const std::exception& e) {
    s.final_error = error_text(e);
    throw;
  }
}

void wait_pending_save() {
  std::shared_ptr<AsyncSave::State> pending;
  {
    std::lock_guard<std::mutex> lock(g_pending_mutex);
    pending = g_pending.lock();
    g_pending.reset();
  }
  if (pending && !pending->waited) {
    try {
      finish_save(*pending);
    } catch (const std::exception& e) {
      // Every rank gets here alike; the save's own wait() rethrows the error.
      TORCH_WARN("fsdp::dcp: a pending save_async to '", pending->dir, "' failed: ", error_text(e));
    }
  }
}

// Collective: plans, prepares the temporary folder, and writes (now, or in a background thread).
std::shared_ptr<AsyncSave::State> start_save(const char* api, const std::string& dir, const ShardedStateDict& base,
                                             const Extra& extra, const SaveOptions& options, bool async) {
  wait_pending_save();
  auto s = std::make_shared<AsyncSave::State>();
  s->api = api;
  s->dir = normalized(dir);
  s->comm = communicator_or_default(options.communicator(), api);
  s->extra_values = extra.values;
  s->crc_block_bytes = options.crc_block_bytes();
  std::string error;
  try {
    TORCH_CHECK(!dir.empty(), api, ": the checkpoint folder name is empty");
    s->tmp = storage::temporary_sibling(s->dir);
    ShardedStateDict state = collect_state(base, extra, s->comm->rank(), api);
    if (async) {
      // The state at the call: host copies of what this rank writes.
      for (auto& [key, shard] : state) {
        if (shard.write && shard.local.numel() > 0) {
          shard.local = shard.local.to(at::kCPU, shard.local.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
        }
      }
    }
    s->plan = plan_rank(state, s->comm->rank());
    if (s->comm->rank() == 0) storage::prepare_empty_directory(s->tmp);
  } catch (const std::exception& e) {
    error = error_text(e);
  }
  agree_on_success(*s->comm, error, api, "prepare");
  if (async) {
    s->writer = std::thread([raw = s.get()] { raw->write_files(); });
    std::lock_guard<std::mutex> lock(g_pending_mutex);
    g_pending = s;
  } else {
    s->write_files();
  }
  return s;
}

ShardedStateDict model_and_optimizer_state(const FSDPModule& root, torch::optim::Optimizer* optimizer) {
  ShardedStateDict state = sharded_state_dict(root);
  if (optimizer != nullptr) {
    ShardedStateDict optim = sharded_optimizer_state_dict(root, *optimizer);
    state.insert(state.end(), std::make_move_iterator(optim.begin()), std::make_move_iterator(optim.end()));
  }
  return state;
}

// ----------------------------------------------------------------------------------------------
// Loading

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

// ----------------------------------------------------------------------------------------------
// Public API

AsyncSave::AsyncSave(std::shared_ptr<State> state) : state_(std::move(state)) {}
AsyncSave::AsyncSave(AsyncSave&&) noexcept = default;

AsyncSave& AsyncSave::operator=(AsyncSave&& other) noexcept {
  if (this != &other) {
    AsyncSave discarded(std::move(*this));
    state_ = std::move(other.state_);
  }
  return *this;
}

AsyncSave::~AsyncSave() {
  if (!state_ || state_->waited) return;
  try {
    if (state_->writer.joinable()) state_->writer.join();
  } catch (...) {
  }
  state_->waited = true;
  state_->final_error = state_->api + ": this save was discarded (its AsyncSave was destroyed before wait())";
}

void AsyncSave::wait() {
  TORCH_CHECK(state_ != nullptr, "fsdp::dcp::AsyncSave::wait: this AsyncSave holds no save (moved from?)");
  finish_save(*state_);
}

bool AsyncSave::files_written() const { return state_ != nullptr && state_->written.load(); }
bool AsyncSave::waited() const { return state_ != nullptr && state_->waited; }

void save(const std::string& dir, const FSDPModule& root, torch::optim::Optimizer* optimizer, const Extra& extra,
          const SaveOptions& options) {
  auto state = start_save(kSaveApi, dir, model_and_optimizer_state(root, optimizer), extra, options, /*async=*/false);
  finish_save(*state);
}

AsyncSave save_async(const std::string& dir, const FSDPModule& root, torch::optim::Optimizer* optimizer,
                     const Extra& extra, const SaveOptions& options) {
  return AsyncSave(start_save("fsdp::dcp::save_async", dir, model_and_optimizer_state(root, optimizer), extra,
                              options, /*async=*/true));
}

void save_state(const std::string& dir, const ShardedStateDict& state, const Extra& extra,
                const SaveOptions& options) {
  auto s = start_save("fsdp::dcp::save_state", dir, state, extra, options, /*async=*/false);
  finish_save(*s);
}

AsyncSave save_state_async(const std::string& dir, const ShardedStateDict& state, const Extra& extra,
                           const SaveOptions& options) {
  return AsyncSave(start_save("fsdp::dcp::save_state_async", dir, state, extra, options, /*async=*/true));
}

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

namespace testing {
void set_file_written_hook(std::function<void(const std::string& path)> hook) {
  std::lock_guard<std::mutex> lock(g_hook_mutex);
  g_file_written_hook = std::move(hook);
}
}  // namespace testing

}  // namespace fsdp::dcp
