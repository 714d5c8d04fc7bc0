#include "fsdp_cpp/checkpoint/full_state_dict_files.h"

#include <cstdio>
#include <cstring>
#include <algorithm>
#include <filesystem>
#include <limits>
#include <memory>
#include <regex>
#include <set>
#include <sstream>
#include <unordered_map>
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
// Deepest nesting of arrays and objects accepted in an index (a valid one nests 2 deep): nlohmann's
// ordered_json copies an object's members when the object grows, recursively, so a value nested
// a hundred thousand deep overflowed the stack while the index was parsed (found by tools/fuzz).
constexpr int kMaxIndexNesting = 128;

// The deepest nesting of arrays and objects in JSON text (brackets in strings not counted),
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

// The path of the safetensors file `name` that an index lists, in the index's folder `dir`: a
// relative path to a regular file inside that folder, so that an index cannot make a load read a
// file elsewhere ('/etc/passwd', '../x') or a folder (found by tools/fuzz: "/" was opened).
std::string listed_file(const fs::path& dir, const std::string& name, const std::string& index_path,
                        const std::string& api) {
  const fs::path relative(name);
  bool inside = !name.empty() && relative.is_relative() && name.find('\0') == std::string::npos;
  for (const auto& part : relative) inside = inside && part != "..";
  const std::string path = (dir / relative).string();
  TORCH_CHECK(inside, api, ": '", index_path, "' lists the file '", name,
              "', which is not a path inside the index's folder");
  TORCH_CHECK(storage::exists(path), api, ": '", path, "' (listed in '", index_path, "') is missing");
  std::error_code error;
  TORCH_CHECK(fs::is_regular_file(path, error), api, ": '", path, "' (listed in '", index_path,
              "') is not a regular file");
  return path;
}

// The index as JSON (errors name `api` and the file).
ordered_json parse_index(const std::string& text, const std::string& index_path, const std::string& api) {
  TORCH_CHECK(json_nesting(text, kMaxIndexNesting) <= kMaxIndexNesting, api, ": '", index_path,
              "' nests arrays or objects more than ", kMaxIndexNesting, " deep: not a safetensors index");
  try {
    return ordered_json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, api, ": '", index_path, "' is not valid JSON: ", e.what());
  }
  return ordered_json();
}

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
  ordered_json index = parse_index(storage::read_file(index_path), index_path, api);
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
    storage::SafetensorsFile file(listed_file(dir, name, index_path, api));
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

// The most a zip record may expand (deflate's largest ratio is about 1032:1): a record declaring a
// larger uncompressed size than that many times the archive is refused before LibTorch allocates
// its declared size.
constexpr uint64_t kMaxRecordExpansion = 1032;

// Checks the archive's record sizes and its pickle ([Note: pickle pre-check]) before LibTorch reads
// them.
void check_pt_archive(const std::string& bytes, const std::string& path, const char* api) {
  std::string pickle;
  std::string too_large;  // a record declaring more bytes than the archive can hold
  try {
    std::istringstream in(bytes);
    caffe2::serialize::PyTorchStreamReader reader(&in);
    for (const auto& name : reader.getAllRecords()) {
      const uint64_t size = reader.getRecordSize(name);
      if (too_large.empty() && size > kMaxRecordExpansion * bytes.size()) {
        too_large = "the zip record '" + name + "' declares " + std::to_string(size) + " bytes, more than an archive of " +
                    std::to_string(bytes.size()) + " bytes can hold";
      }
    }
    if (too_large.empty() && reader.hasRecord("data.pkl")) {
      const auto [data, size] = reader.getRecord("data.pkl");
      pickle.assign(static_cast<const char*>(data.get()), size);
    } else if (too_large.empty()) {
      too_large = "it is a zip archive without data.pkl: not a file of torch.save";
    }
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, api, ": cannot read '", path, "' as a .pt archive: ", e.what_without_backtrace());
  } catch (const std::exception& e) {  // e.g. std::invalid_argument "stoull": a version record not a number
    TORCH_CHECK(false, api, ": cannot read '", path, "' as a .pt archive: ", e.what());
  }
  TORCH_CHECK(too_large.empty(), api, ": '", path, "': ", too_large);
  check_pt_pickle(pickle.data(), pickle.size(), std::string(api) + ": '" + path + "'");
}

}  // namespace

// [Note: pickle pre-check] LibTorch's Unpickler trusts the structure of what it reads: a string's
// declared length is allocated (and zero-filled) before its bytes are read (a 3 KB file made
// fsdp::load_pt allocate gigabytes), a LONG_BINPUT index grows the memo table to that index, DICT
// and SETITEMS read their items in pairs (one past the end of the stack for an odd count), a mark
// above the stack underflows a size, and nested tuples and lists are destroyed recursively (one
// byte per level, TUPLE1, overflows the stack). So the pickle is walked first, building no value,
// with the stack effects of Python's pickletools: every opcode known, every argument inside the
// data, no opcode taking more values than the stack holds above the innermost mark, dict items in
// pairs, memo indexes below the pickle's size, containers nested at most kMaxPickleNesting deep
// (tracked per stack slot), and a STOP. What passes is then read by LibTorch's unpickler, whose
// own checks (types, globals, storages, sizes against storages) still apply.
void check_pt_pickle(const char* data, size_t size, const std::string& context) {
  constexpr int kMaxPickleNesting = 1000;
  std::vector<int> stack;     // per value: how deeply it nests containers (0: not a container)
  std::vector<size_t> marks;  // stack sizes at each MARK
  std::unordered_map<uint64_t, int> memo;
  uint64_t memoized = 0;      // MEMOIZE's next index
  size_t pos = 0;
  size_t at = 0;  // the current opcode's offset
  const auto fail = [&](const std::string& why) {
    TORCH_CHECK(false, context, ": malformed pickle (data.pkl, byte ", at, "): ", why);
  };
  const auto need = [&](uint64_t n) {
    if (n > size - pos) fail("an argument runs past the end of the pickle");
  };
  const auto read_uint = [&](int width) {
    need(static_cast<uint64_t>(width));
    uint64_t v = 0;
    for (int b = width; b-- > 0;) v = (v << 8) | static_cast<unsigned char>(data[pos + static_cast<size_t>(b)]);
    pos += static_cast<size_t>(width);
    return v;
  };
  const auto skip_bytes = [&](uint64_t n) {
    need(n);
    pos += static_cast<size_t>(n);
  };
  const auto skip_line = [&] {
    const void* nl = pos < size ? std::memchr(data + pos, '\n', size - pos) : nullptr;
    if (nl == nullptr) fail("a text argument has no end of line");
    pos = static_cast<size_t>(static_cast<const char*>(nl) - data) + 1;
  };
  const auto floor = [&] { return marks.empty() ? size_t{0} : marks.back(); };
  const auto push = [&](int nesting) {
    if (nesting > kMaxPickleNesting) fail("containers nest more than " + std::to_string(kMaxPickleNesting) + " deep");
    stack.push_back(nesting);
  };
  // Pops n values above the innermost mark; returns their deepest nesting.
  const auto pop = [&](size_t n) {
    if (stack.size() < floor() + n) fail("an opcode takes more values than the stack holds above its mark");
    int deepest = 0;
    for (size_t i = 0; i < n; ++i) {
      deepest = std::max(deepest, stack.back());
      stack.pop_back();
    }
    return deepest;
  };
  // Pops the innermost mark and the values above it: (their deepest nesting, their count).
  const auto pop_mark = [&] {
    if (marks.empty()) fail("an opcode needs a MARK and there is none");
    const size_t mark = marks.back();
    marks.pop_back();
    int deepest = 0;
    for (size_t i = mark; i < stack.size(); ++i) deepest = std::max(deepest, stack[i]);
    const size_t count = stack.size() - mark;
    stack.resize(mark);
    return std::make_pair(deepest, count);
  };
  // The container under the mark (or under the popped values) takes values nested `nesting` deep.
  const auto extend_top = [&](int nesting) {
    if (stack.size() <= floor()) fail("no container to add the values to");
    stack.back() = std::max(stack.back(), nesting + 1);
    if (stack.back() > kMaxPickleNesting) fail("containers nest more than " + std::to_string(kMaxPickleNesting) + " deep");
  };
  const auto memo_put = [&](uint64_t index) {
    if (stack.empty()) fail("a memo opcode with an empty stack");
    if (index >= size) fail("memo index " + std::to_string(index) + " is larger than the pickle");
    memo[index] = stack.back();
  };
  const auto memo_get = [&](uint64_t index) {
    const auto it = memo.find(index);
    push(it == memo.end() ? 0 : it->second);
  };
  while (true) {
    at = pos;
    if (pos >= size) fail("it ends without a STOP opcode");
    const auto op = static_cast<unsigned char>(data[pos++]);
    switch (op) {
      case '.': return;                                    // STOP
      case 0x80: read_uint(1); break;                      // PROTO
      case 0x95: read_uint(8); break;                      // FRAME (its length only groups opcodes)
      case '(': marks.push_back(stack.size()); break;      // MARK
      case 'N': case 0x88: case 0x89: push(0); break;      // None, True, False
      case ']': case ')': case '}': case 0x8f: push(1); break;  // empty list, tuple, dict, set
      case 'K': case 0x82: read_uint(1); push(0); break;
      case 'M': case 0x83: read_uint(2); push(0); break;
      case 'J': case 0x84: read_uint(4); push(0); break;
      case 'G': read_uint(8); push(0); break;              // BINFLOAT
      case 0x8a: case 'U': case 'C': case 0x8c: skip_bytes(read_uint(1)); push(0); break;  // 1-byte length
      case 'X': case 'B': skip_bytes(read_uint(4)); push(0); break;                         // 4-byte length
      case 'T': case 0x8b: {                                                                // signed 4-byte length
        const uint64_t n = read_uint(4);
        if (n > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())) fail("a negative length");
        skip_bytes(n);
        push(0);
        break;
      }
      case 0x8d: case 0x8e: case 0x96: skip_bytes(read_uint(8)); push(0); break;           // 8-byte length
      case 'I': case 'L': case 'F': case 'S': case 'V': case 'P': case 'g': skip_line(); push(0); break;
      case 'p': skip_line(); if (stack.empty()) fail("PUT with an empty stack"); break;
      case 'c': skip_line(); skip_line(); push(0); break;  // GLOBAL
      case 'i': {                                          // INST
        skip_line();
        skip_line();
        push(pop_mark().first + 1);
        break;
      }
      case 'h': memo_get(read_uint(1)); break;             // BINGET
      case 'j': memo_get(read_uint(4)); break;             // LONG_BINGET
      case 'q': memo_put(read_uint(1)); break;             // BINPUT
      case 'r': memo_put(read_uint(4)); break;             // LONG_BINPUT
      case 0x94: memo_put(memoized++); break;              // MEMOIZE
      case '0':                                            // POP (a value, or a mark on top)
        if (stack.size() > floor()) {
          stack.pop_back();
        } else if (!marks.empty()) {
          marks.pop_back();
        } else {
          fail("POP with an empty stack");
        }
        break;
      case '1': pop_mark(); break;                         // POP_MARK
      case '2': if (stack.size() <= floor()) fail("DUP with an empty stack"); push(stack.back()); break;
      case 't': case 'l': case 0x91: push(pop_mark().first + 1); break;  // TUPLE, LIST, FROZENSET
      case 'o': {                                          // OBJ
        const auto [deepest, count] = pop_mark();
        if (count < 1) fail("OBJ without a class");
        push(deepest + 1);
        break;
      }
      case 'd': {                                          // DICT
        const auto [deepest, count] = pop_mark();
        if (count % 2 != 0) fail("a dict of an odd number of keys and values");
        push(deepest + 1);
        break;
      }
      case 'u': {                                          // SETITEMS
        const auto [deepest, count] = pop_mark();
        if (count % 2 != 0) fail("SETITEMS with an odd number of keys and values");
        extend_top(deepest);
        break;
      }
      case 'e': case 0x90: extend_top(pop_mark().first); break;  // APPENDS, ADDITEMS
      case 0x85: push(pop(1) + 1); break;                  // TUPLE1
      case 0x86: push(pop(2) + 1); break;                  // TUPLE2
      case 0x87: push(pop(3) + 1); break;                  // TUPLE3
      case 'a': extend_top(pop(1)); break;                 // APPEND
      case 's': extend_top(pop(2)); break;                 // SETITEM
      // A call's result may be (part of) its arguments: counted as nested as they are.
      case 'R': case 'b': case 0x81: push(pop(2)); break;  // REDUCE, BUILD, NEWOBJ
      case 0x92: push(pop(3)); break;                      // NEWOBJ_EX
      case 0x93: pop(2); push(0); break;                   // STACK_GLOBAL
      case 'Q': pop(1); push(0); break;                    // BINPERSID (a storage)
      case 0x97: push(0); break;                           // NEXT_BUFFER
      case 0x98: if (stack.size() <= floor()) fail("READONLY_BUFFER with an empty stack"); break;
      default: {
        char hex[8];
        std::snprintf(hex, sizeof(hex), "0x%02x", op);
        fail(std::string("unknown opcode ") + hex);
      }
    }
  }
}

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
  check_pt_archive(text, path, api);  // [Note: pickle pre-check]
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
  ordered_json index = parse_index(text, index_path, api);
  TORCH_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(), api, ": '",
              index_path, "' has no \"weight_map\" object");
  const fs::path dir = fs::path(index_path).parent_path();
  for (const auto& [key, file] : index["weight_map"].items()) {
    TORCH_CHECK(file.is_string(), api, ": '", index_path, "': the file of '", key, "' is not a string");
    const std::string name = (dir / file.get<std::string>()).string();
    auto it = std::find_if(list.files.begin(), list.files.end(), [&](const auto& f) { return f.first == name; });
    if (it == list.files.end()) {
      listed_file(dir, file.get<std::string>(), index_path, api);
      it = list.files.insert(list.files.end(), {name, {}});
    }
    it->second.push_back(key);
  }
  return list;
}

}  // namespace fsdp
