#include "fsdp_cpp/checkpoint/full_state_dict_files.h"

#include <cstdio>
#include <algorithm>
#include <filesystem>
#include <regex>
#include <set>
#include <utility>
#include <vector>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include "fsdp_cpp/storage/atomic_directory.h"
#include "fsdp_cpp/storage/safetensors.h"

namespace fsdp {
namespace {

namespace fs = std::filesystem;
using ordered_json = nlohmann::ordered_json;

constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

std::string sharded_name(size_t index, size_t count) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05zu.safetensors", index + 1, count);
  return buf;
}

bool is_model_file(const std::string& name) {
  static const std::regex sharded(R"(model-\d{5}-of-\d{5}\.safetensors)");
  return name == kSingleFile || name == kIndexFile || std::regex_match(name, sharded);
}

// Writes to a temporary name in the same folder, then renames it into place.
void write_safetensors_atomically(const std::string& path, const std::vector<storage::SafetensorsItem>& items,
                                  int64_t crc_block_bytes) {
  const std::string tmp = path + ".partial";
  storage::write_safetensors(tmp, items, {{"format", "pt"}}, crc_block_bytes);
  fs::rename(tmp, path);
}

void read_entries_into(const storage::SafetensorsFile& file, const std::vector<std::string>& keys,
                       FullStateDict& state, const char* api) {
  for (const auto& key : keys) {
    const storage::SafetensorsEntry* entry = file.header().find(key);
    TORCH_CHECK(entry != nullptr, api, ": '", file.header().path, "' has no tensor '", key, "'");
    TORCH_CHECK(state.find(key) == nullptr, api, ": the key '", key, "' appears twice");
    file.verify(*entry, 0, entry->nbytes());
    state.insert(key, file.read_tensor(*entry));
  }
}

FullStateDict load_single(const std::string& path, const char* api) {
  storage::SafetensorsFile file(path);
  std::vector<std::string> keys;
  for (const auto& entry : file.header().entries) keys.push_back(entry.key);
  // Keys in data order: the order save_safetensors wrote them in.
  FullStateDict state;
  read_entries_into(file, keys, state, api);
  return state;
}

FullStateDict load_index(const std::string& index_path, const char* api) {
  ordered_json index;
  try {
    index = ordered_json::parse(storage::read_file(index_path));
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, api, ": '", index_path, "' is not valid JSON: ", e.what());
  }
  TORCH_CHECK(index.contains("weight_map") && index["weight_map"].is_object(), api, ": '", index_path,
              "' has no \"weight_map\" object");
  const fs::path dir = fs::path(index_path).parent_path();
  // Files in order of first appearance, each with its keys in the index's order.
  std::vector<std::pair<std::string, std::vector<std::string>>> files;
  std::vector<std::string> order;
  for (const auto& [key, file] : index["weight_map"].items()) {
    TORCH_CHECK(file.is_string(), api, ": '", index_path, "': the file of '", key, "' is not a string");
    const std::string name = file.get<std::string>();
    auto it = std::find_if(files.begin(), files.end(), [&](const auto& f) { return f.first == name; });
    if (it == files.end()) it = files.insert(files.end(), {name, {}});
    it->second.push_back(key);
    order.push_back(key);
  }
  FullStateDict by_file;
  for (const auto& [name, keys] : files) {
    const std::string path = (dir / name).string();
    TORCH_CHECK(storage::exists(path), api, ": '", path, "' (listed in '", index_path, "') is missing");
    storage::SafetensorsFile file(path);
    read_entries_into(file, keys, by_file, api);
  }
  FullStateDict state;
  for (const auto& key : order) state.insert(key, by_file[key]);
  return state;
}

// torch::pickle_save's archive (a zip of data.pkl and the tensors' storages), but without the type
// tags it puts on dicts (`torch.jit._pickle.restore_type_tag`), which Python's
// `torch.load(weights_only=True)` refuses.
std::vector<char> pickle_untagged(const c10::IValue& value) {
  std::vector<char> pickled;
  torch::jit::Pickler pickler([&](const char* data, size_t size) { pickled.insert(pickled.end(), data, data + size); },
                              /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
                              /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();
  std::vector<char> archive;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t size) {
    const auto* bytes = static_cast<const char*>(data);
    archive.insert(archive.end(), bytes, bytes + size);
    return size;
  });
  torch::jit::writeArchiveAndTensors("data", pickled.data(), pickled.size(), pickler.tensorData(), writer);
  writer.writeEndOfFile();
  return archive;
}

}  // namespace

void save_safetensors(const std::string& dir, const FullStateDict& state, const SaveSafetensorsOptions& options) {
  constexpr const char* api = "fsdp::save_safetensors";
  const int64_t max_file_bytes = options.max_file_bytes();
  TORCH_CHECK(max_file_bytes > 0, api, ": SaveSafetensorsOptions::max_file_bytes must be positive, got ",
              max_file_bytes);
  const int64_t crc_block_bytes = options.crc_block_bytes();
  TORCH_CHECK(crc_block_bytes >= 0, api, ": SaveSafetensorsOptions::crc_block_bytes must not be negative (0: no "
              "checksums), got ", crc_block_bytes);
  // Group the tensors into files, in order.
  std::vector<std::vector<storage::SafetensorsItem>> groups(1);
  int64_t in_group = 0;
  int64_t total = 0;
  for (const auto& item : state) {
    TORCH_CHECK(item.value().defined(), api, ": the tensor '", item.key(), "' is undefined");
    const int64_t bytes = item.value().numel() * static_cast<int64_t>(item.value().element_size());
    if (!groups.back().empty() && in_group + bytes > max_file_bytes) {
      groups.emplace_back();
      in_group = 0;
    }
    groups.back().push_back({item.key(), item.value()});
    in_group += bytes;
    total += bytes;
  }
  storage::create_directories(dir);
  for (const auto& name : storage::list_files(dir)) {
    if (is_model_file(name)) fs::remove(fs::path(dir) / name);
  }
  if (groups.size() == 1) {
    write_safetensors_atomically((fs::path(dir) / kSingleFile).string(), groups[0], crc_block_bytes);
  } else {
    ordered_json weight_map = ordered_json::object();
    for (size_t i = 0; i < groups.size(); ++i) {
      const std::string name = sharded_name(i, groups.size());
      write_safetensors_atomically((fs::path(dir) / name).string(), groups[i], crc_block_bytes);
      for (const auto& item : groups[i]) weight_map[item.key] = name;
    }
    ordered_json index;
    index["metadata"] = {{"total_size", total}};
    index["weight_map"] = std::move(weight_map);
    const std::string path = (fs::path(dir) / kIndexFile).string();
    storage::write_file(path + ".partial", index.dump(2));
    fs::rename(path + ".partial", path);
  }
  storage::fsync_directory(dir);
}

void save_safetensors(const std::string& dir, const FullStateDict& state, int64_t max_file_bytes) {
  save_safetensors(dir, state, SaveSafetensorsOptions().max_file_bytes(max_file_bytes));
}

FullStateDict load_safetensors(const std::string& path) {
  constexpr const char* api = "fsdp::load_safetensors";
  if (fs::is_directory(path)) {
    const fs::path dir(path);
    if (storage::exists((dir / kIndexFile).string())) return load_index((dir / kIndexFile).string(), api);
    TORCH_CHECK(storage::exists((dir / kSingleFile).string()), api, ": '", path, "' holds neither ", kIndexFile,
                " nor ", kSingleFile);
    return load_single((dir / kSingleFile).string(), api);
  }
  TORCH_CHECK(storage::exists(path), api, ": there is no file or folder '", path, "'");
  if (path.ends_with(".json")) return load_index(path, api);
  return load_single(path, api);
}

void save_pt(const std::string& path, const FullStateDict& state) {
  constexpr const char* api = "fsdp::save_pt";
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& item : state) {
    TORCH_CHECK(item.value().defined(), api, ": the tensor '", item.key(), "' is undefined");
    at::Tensor t = item.value().detach().to(at::kCPU);
    // A view would pickle its whole storage: save the tensor's own elements only.
    if (!t.is_contiguous() || t.storage().nbytes() != t.nbytes() || t.storage_offset() != 0) t = t.clone();
    dict.insert(item.key(), t);
  }
  const std::vector<char> bytes = pickle_untagged(c10::IValue(dict));
  const std::string tmp = path + ".partial";
  storage::write_file(tmp, std::string(bytes.begin(), bytes.end()));
  fs::rename(tmp, path);
}

FullStateDict load_pt(const std::string& path) {
  constexpr const char* api = "fsdp::load_pt";
  TORCH_CHECK(storage::exists(path), api, ": there is no file '", path, "'");
  const std::string text = storage::read_file(path);
  c10::IValue value;
  try {
    value = torch::jit::pickle_load(std::vector<char>(text.begin(), text.end()));
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, api, ": cannot unpickle '", path, "': ", e.what_without_backtrace(),
                " (LibTorch reads a plain dict of tensors, not the OrderedDict that Python's "
                "module.state_dict() returns: save it with torch.save(dict(model.state_dict()), path))");
  }
  TORCH_CHECK(value.isGenericDict(), api, ": '", path, "' holds a ", value.tagKind(), ", not a dict of tensors");
  FullStateDict state;
  for (const auto& entry : value.toGenericDict()) {
    TORCH_CHECK(entry.key().isString(), api, ": '", path, "' has a key that is not a string (",
                entry.key().tagKind(), ")");
    TORCH_CHECK(entry.value().isTensor(), api, ": '", path, "': the value of '", entry.key().toStringRef(),
                "' is a ", entry.value().tagKind(), ", not a tensor");
    state.insert(entry.key().toStringRef(), entry.value().toTensor());
  }
  return state;
}

}  // namespace fsdp

namespace fsdp {

SafetensorsFileList safetensors_files(const std::string& path, const std::string& api) {
  SafetensorsFileList list;
  std::string index_path;
  if (fs::is_directory(path)) {
    const fs::path dir(path);
    if (storage::exists((dir / kIndexFile).string())) {
      index_path = (dir / kIndexFile).string();
    } else {
      TORCH_CHECK(storage::exists((dir / kSingleFile).string()), api, ": '", path, "' holds neither ", kIndexFile,
                  " nor ", kSingleFile);
      list.files.push_back({(dir / kSingleFile).string(), {}});
      return list;
    }
  } else {
    TORCH_CHECK(storage::exists(path), api, ": there is no file or folder '", path, "'");
    if (!path.ends_with(".json")) {
      list.files.push_back({path, {}});
      return list;
    }
    index_path = path;
  }
  const std::string text = storage::read_file(index_path);
  list.index_path = index_path;
  list.index_bytes = static_cast<int64_t>(text.size());
  ordered_json index;
  try {
    index = ordered_json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, api, ": '", index_path, "' is not valid JSON: ", e.what());
  }
  TORCH_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(), api, ": '",
              index_path, "' has no \"weight_map\" object");
  const fs::path dir = fs::path(index_path).parent_path();
  for (const auto& [key, file] : index["weight_map"].items()) {
    TORCH_CHECK(file.is_string(), api, ": '", index_path, "': the file of '", key, "' is not a string");
    const std::string name = (dir / file.get<std::string>()).string();
    auto it = std::find_if(list.files.begin(), list.files.end(), [&](const auto& f) { return f.first == name; });
    if (it == list.files.end()) {
      TORCH_CHECK(storage::exists(name), api, ": '", name, "' (listed in '", index_path, "') is missing");
      it = list.files.insert(list.files.end(), {name, {}});
    }
    it->second.push_back(key);
  }
  return list;
}

}  // namespace fsdp
