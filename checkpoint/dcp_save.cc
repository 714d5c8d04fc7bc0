#include "fsdp_cpp/checkpoint/distributed_checkpoint.h"
#include "fsdp_cpp/comm/issuing_api.h"

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <mutex>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "dcp_support.h"  // private to //checkpoint:distributed_checkpoint
#include "fsdp_cpp/checkpoint/optimizer_state_dict.h"
#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/contract/shape_text.h"
#include "fsdp_cpp/storage/atomic_directory.h"
#include "fsdp_cpp/storage/boxes.h"
#include "fsdp_cpp/storage/safetensors.h"

// Saving: plans, files and the atomic commit (see [Note: checkpoint layout] in
// checkpoint/distributed_checkpoint.h).

namespace fsdp::dcp {
using namespace detail;
using contract::shape_string;

namespace {

using nlohmann::json;
namespace fs = std::filesystem;

std::mutex g_hook_mutex;
std::function<void(const std::string&)> g_file_written_hook;

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
    const std::vector<int64_t> piece_shape = shard.piece_shape();
    TORCH_CHECK(shard.flat_offset >= 0 && shard.flat_offset + shard.local.numel() <= numel_of(piece_shape),
                api, ": the local shard of '", key, "' holds elements [", shard.flat_offset, ", ",
                shard.flat_offset + shard.local.numel(), ") of a tensor of shape ", shape_string(piece_shape),
                " (", numel_of(piece_shape), " elements)",
                shard.piece ? " (its tensor-parallel piece of the global shape " + shape_string(shard.global_shape) + ")"
                            : std::string());
  }
  return state;
}

RankPlan plan_rank(const ShardedStateDict& state, int rank) {
  RankPlan plan;
  // Per key, its boxes in GLOBAL coordinates (a tensor-parallel piece: several, see
  // [Note: tensor-parallel pieces] in checkpoint/local_shard.h).
  std::vector<std::vector<GlobalBox>> per_key_boxes;
  size_t files = 0;
  for (const auto& [key, shard] : state) {
    std::vector<GlobalBox> boxes;
    if (shard.write && shard.local.numel() > 0) boxes = global_boxes(shard);
    files = std::max(files, boxes.size());
    json record_boxes = json::array();
    for (size_t j = 0; j < boxes.size(); ++j) {
      record_boxes.push_back(json::array({static_cast<int>(j), boxes[j].box.offsets, boxes[j].box.sizes}));
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
    for (size_t j = 0; j < per_key_boxes[k].size(); ++j) {
      GlobalBox& box = per_key_boxes[k][j];
      // A box that does not span the piece's trailing dimensions is strided in `local`: a copy.
      at::Tensor data = box.data.is_contiguous() ? box.data : box.data.contiguous();
      plan.file_items[j].push_back({state[k].first, std::move(data)});
      plan.file_sharding[j][state[k].first] = json{{kSavedOffsetsKey, box.box.offsets}};
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
  std::vector<std::string> extra_tensor_names;
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
      const std::map<std::string, std::string> base_metadata{
          {"format", "pt"}, {"DCP_VERSION", "1.0"}, {kWriterKey, kFormatName}};
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

// Removes a failed save's temporary folder; returns "" or a sentence saying where it was left.
std::string remove_unfinished(const std::string& tmp) {
  std::error_code ec;
  fs::remove_all(tmp, ec);
  if (!ec) return "";
  return " (the unfinished folder '" + tmp + "' could not be removed: " + ec.message() + "; remove it by hand)";
}

// The checks of the target folder that need no data written: `dir` must be a folder or not exist,
// and its nearest existing ancestor must be a folder. Every rank checks (they share the file
// system) before anything is written, and agrees on the outcome.
void check_save_target(const std::string& dir, const char* api) {
  std::error_code ec;
  const fs::path target(dir);
  const auto status = fs::symlink_status(target, ec);
  TORCH_CHECK(!fs::exists(status) || fs::is_directory(fs::status(target, ec)), api, ": cannot save into '", dir,
              "': it exists and is not a folder (a checkpoint is a folder; remove the file or choose another name)");
  for (fs::path p = target.parent_path(); !p.empty(); p = p.parent_path()) {
    const auto parent = fs::status(p, ec);
    if (fs::exists(parent)) {
      TORCH_CHECK(fs::is_directory(parent), api, ": cannot save into '", dir, "': '", p.string(),
                  "' is not a folder, so nothing can be created inside it");
      break;
    }
    if (p == p.root_path()) break;
  }
}

// Builds the manifest from every rank's report; every rank computes it (and its errors) alike.
json merge_manifest(const std::vector<json>& reports, const std::map<std::string, std::string>& extra_values,
                    const std::vector<std::string>& extra_tensor_names, const char* api) {
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
  manifest["extra"] = json{{"values", extra_values}, {"tensors", extra_tensor_names}};
  return manifest;
}

// Collective: joins the writer, agrees, commits.
void finish_save(AsyncSave::State& s) {
  if (s.waited) {
    TORCH_CHECK(s.final_error.empty(), s.final_error);
    return;
  }
  s.waited = true;
  bool all_written = false;  // every rank's writer has finished (the reports were exchanged)
  try {
    if (s.writer.joinable()) s.writer.join();
    json report{{"error", s.write_error}, {"files", s.written_files}, {"keys", s.plan.keys}};
    const auto all = s.comm->all_gather_bytes(to_bytes(report.dump()), std::string(s.api) + " reports");
    all_written = true;
    std::vector<json> reports;
    for (const auto& bytes : all) reports.push_back(json::parse(from_bytes(bytes)));
    for (size_t r = 0; r < reports.size(); ++r) {
      const std::string error = reports[r].at("error").get<std::string>();
      TORCH_CHECK(error.empty(), s.api, " failed on rank ", r, " of ", reports.size(),
                  " while writing its files: ", error, " (the previous checkpoint in '", s.dir, "' is unchanged)");
    }
    const json manifest = merge_manifest(reports, s.extra_values, s.extra_tensor_names, s.api.c_str());
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
    // Once every rank has finished writing (each joined its writer before the reports were
    // exchanged), rank 0 removes the unfinished folder, which holds up to a full checkpoint's bytes.
    if (all_written && s.comm->rank() == 0) s.final_error += remove_unfinished(s.tmp);
    TORCH_CHECK(false, s.final_error);
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
  for (const auto& item : extra.tensors) s->extra_tensor_names.push_back(item.key());
  s->crc_block_bytes = options.crc_block_bytes();
  std::string error;
  try {
    TORCH_CHECK(!dir.empty(), api, ": the checkpoint folder name is empty");
    TORCH_CHECK(s->crc_block_bytes >= 0, api, ": SaveOptions::crc_block_bytes must not be negative (0: no "
                "checksums), got ", s->crc_block_bytes);
    check_save_target(s->dir, api);
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

}  // namespace

namespace detail {

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

}  // namespace detail


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
  comm::IssuingApi issuing_api("fsdp::dcp::AsyncSave::wait");
  TORCH_CHECK(state_ != nullptr, "fsdp::dcp::AsyncSave::wait: this AsyncSave holds no save (moved from?)");
  finish_save(*state_);
}

bool AsyncSave::files_written() const { return state_ != nullptr && state_->written.load(); }
bool AsyncSave::waited() const { return state_ != nullptr && state_->waited; }

void save(const std::string& dir, const FSDPModule& root, torch::optim::Optimizer* optimizer, const Extra& extra,
          const SaveOptions& options) {
  comm::IssuingApi issuing_api(kSaveApi);
  auto state = start_save(kSaveApi, dir, model_and_optimizer_state(root, optimizer), extra, options, /*async=*/false);
  finish_save(*state);
}

AsyncSave save_async(const std::string& dir, const FSDPModule& root, torch::optim::Optimizer* optimizer,
                     const Extra& extra, const SaveOptions& options) {
  comm::IssuingApi issuing_api("fsdp::dcp::save_async");
  return AsyncSave(start_save("fsdp::dcp::save_async", dir, model_and_optimizer_state(root, optimizer), extra,
                              options, /*async=*/true));
}

void save_state(const std::string& dir, const ShardedStateDict& state, const Extra& extra,
                const SaveOptions& options) {
  comm::IssuingApi issuing_api("fsdp::dcp::save_state");
  auto s = start_save("fsdp::dcp::save_state", dir, state, extra, options, /*async=*/false);
  finish_save(*s);
}

AsyncSave save_state_async(const std::string& dir, const ShardedStateDict& state, const Extra& extra,
                           const SaveOptions& options) {
  comm::IssuingApi issuing_api("fsdp::dcp::save_state_async");
  return AsyncSave(start_save("fsdp::dcp::save_state_async", dir, state, extra, options, /*async=*/true));
}

namespace testing {
void set_file_written_hook(std::function<void(const std::string& path)> hook) {
  std::lock_guard<std::mutex> lock(g_hook_mutex);
  g_file_written_hook = std::move(hook);
}
}  // namespace testing

}  // namespace fsdp::dcp
