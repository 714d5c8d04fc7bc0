#include "targets.h"

#include <sys/resource.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <new>
#include <stdexcept>
#include <utility>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>
#include <torch/optim/adamw.h>
#include <torch/torch.h>

#include "fsdp_cpp/checkpoint/distributed_checkpoint.h"
#include "fsdp_cpp/checkpoint/full_state_dict_files.h"
#include "fsdp_cpp/checkpoint/load_pretrained.h"
#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/contract/hookable_module_holder.h"
#include "fsdp_cpp/contract/hookable_modules.h"
#include "fsdp_cpp/storage/safetensors.h"
#include "self_backend.h"

namespace fsdp::fuzz {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

// ------------------------------------------------------------------------------------------------
// Runner

namespace {

bool contains(const std::string& text, const char* what) { return text.find(what) != std::string::npos; }

// Messages of allocations that failed: an input made a parser allocate beyond the memory limit.
bool is_allocation_failure(const std::string& message) {
  return contains(message, "not enough memory") || contains(message, "can't allocate memory") ||
         contains(message, "bad_alloc") || contains(message, "Cannot allocate memory") ||
         contains(message, "CPU out of memory") || contains(message, "OutOfMemory");
}

}  // namespace

void Runner::refused(const char* api, const std::string& message) {
  bool named = locations_.empty();
  for (const auto& location : locations_) named = named || contains(message, location.c_str());
  if (!named && !unnamed_) {
    unnamed_ = true;
    unnamed_message_ = std::string(api) + ": " + message;
  }
  if (verdict_ == Verdict::kAccepted) {
    verdict_ = Verdict::kRefused;
    message_ = std::string(api) + ": " + message;
  }
}

void Runner::finding(const char* api, const std::string& kind, const std::string& message) {
  if (verdict_ != Verdict::kFinding) {
    verdict_ = Verdict::kFinding;
    finding_kind_ = kind;
    message_ = std::string(api) + ": " + message;
  }
}

namespace {
int64_t max_rss_kb() {
  struct rusage usage {};
  ::getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss;
}
}  // namespace

void Runner::call(const char* api, const std::function<void()>& body) {
  if (skip_.count(api) != 0) return;
  const int64_t rss_before = max_rss_kb();
  const auto classify = [&](const std::string& message) {
    if (message.empty()) {
      finding(api, "empty-message", "an exception without a message");
    } else if (is_allocation_failure(message)) {
      finding(api, "allocation", message);
    } else if (contains(message, "INTERNAL ASSERT FAILED")) {
      // LibTorch's own (its sources were built under /__w/pytorch/, its headers are
      // external/libtorch/): its unpickler asserts the types of what it pops, a refusal of the
      // input; the library's are findings.
      const size_t at = message.find("INTERNAL ASSERT FAILED at \"");
      const std::string where = at == std::string::npos ? "" : message.substr(at + 27, 80);
      if (where.rfind("/__w/pytorch/", 0) == 0 || where.rfind("external/libtorch/", 0) == 0) {
        torch_assert_ = true;
        refused(api, message);
      } else {
        finding(api, "internal-assert", message);
      }
    } else {
      refused(api, message);
    }
  };
  try {
    body();
  } catch (const c10::Error& e) {
    classify(e.what_without_backtrace());
  } catch (const std::bad_alloc& e) {
    finding(api, "allocation", std::string("std::bad_alloc: ") + e.what());
  } catch (const std::length_error& e) {
    finding(api, "allocation", std::string("std::length_error: ") + e.what());
  } catch (const std::exception& e) {
    classify(e.what());
  } catch (...) {
    finding(api, "non-std-exception", "an exception that is not a std::exception");
  }
  // The peak resident set only grows: a call that raised it by more than the bound allocated (and
  // touched) that much for this input, whether or not it then refused it.
  const int64_t grown_mb = (max_rss_kb() - rss_before) / 1024;
  if (rss_growth_mb_ > 0 && grown_mb > rss_growth_mb_) {
    finding(api, "memory", "the resident set grew by " + std::to_string(grown_mb) + " MiB during the call (" +
                               (message_.empty() ? std::string("accepted") : message_) + ")");
  }
}

// ------------------------------------------------------------------------------------------------
// Files

std::string read_whole_file(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) throw std::runtime_error("cannot open '" + path + "': " + std::strerror(errno));
  std::string out;
  char buffer[1 << 16];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof(buffer), f)) > 0) out.append(buffer, n);
  std::fclose(f);
  return out;
}

void write_whole_file(const std::string& path, const std::string& bytes) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) throw std::runtime_error("cannot create '" + path + "': " + std::strerror(errno));
  const bool ok = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  if (std::fclose(f) != 0 || !ok) throw std::runtime_error("cannot write '" + path + "'");
}

void Target::add_seed(const std::string& name, std::string bytes) {
  Seed seed;
  seed.name = name;
  seed.bytes = std::move(bytes);
  if (format() == Format::kPtArchive) seed.archive = read_pt_archive(seed.bytes);
  if (format() == Format::kJson) {
    for (auto& s : json_strings(seed.bytes)) dictionary_.push_back(std::move(s));
  } else if (format() == Format::kSafetensors && seed.bytes.size() >= 8) {
    uint64_t length = 0;
    for (int b = 7; b >= 0; --b) length = (length << 8) | static_cast<unsigned char>(seed.bytes[static_cast<size_t>(b)]);
    if (length <= seed.bytes.size() - 8) {
      for (auto& s : json_strings(seed.bytes.substr(8, length))) dictionary_.push_back(std::move(s));
    }
  } else if (format() == Format::kPtArchive) {
    for (const auto& [record, data] : seed.archive.records) dictionary_.push_back(record);
  }
  seeds_.push_back(std::move(seed));
}

namespace {

// ------------------------------------------------------------------------------------------------
// A one-rank fully_shard model (two units, a buffer) and an AdamW that has stepped once.

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", contract::Linear(4, 6));
    fc2 = register_module("fc2", contract::Linear(6, 3));
    steps = register_buffer("steps", torch::arange(2, torch::kLong));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x))); }
  contract::Linear fc1{nullptr};
  contract::Linear fc2{nullptr};
  torch::Tensor steps;
};
FSDP_HOOKABLE_MODULE(Net);

struct Model {
  std::shared_ptr<comm::Communicator> comm;
  Net net{nullptr};
  std::vector<FSDPModule> units;
  std::unique_ptr<torch::optim::AdamW> optim;
  const FSDPModule& root() const { return units.back(); }
};

std::unique_ptr<Model> make_model() {
  torch::manual_seed(0);
  auto m = std::make_unique<Model>();
  m->comm = one_rank_communicator();
  m->net = Net();
  const auto options = FullyShardOptions().communicator(m->comm);
  m->units.push_back(fully_shard(m->net->fc1, options));
  m->units.push_back(fully_shard(m->net, options));
  m->optim = std::make_unique<torch::optim::AdamW>(m->net->parameters(), torch::optim::AdamWOptions(1e-2));
  at::Tensor loss = m->net(torch::randn({2, 4})).pow(2).mean();
  loss.backward();
  m->optim->step();
  m->optim->zero_grad();
  return m;
}

// Tensors of many dtypes and shapes (0-d, empty, not contiguous).
std::vector<storage::SafetensorsItem> varied_items() {
  torch::manual_seed(1);
  return {
      {"w", torch::randn({2, 3})},
      {"half", torch::arange(5, torch::kHalf)},
      {"bf16", torch::arange(4, torch::kBFloat16) * 3},
      {"steps", torch::tensor(7, torch::kLong)},
      {"mask", torch::tensor({true, false, true})},
      {"empty", torch::zeros({0, 4})},
      {"double", torch::arange(4, torch::kDouble).view({2, 2}).t()},
      {"bytes", torch::arange(7, torch::kByte)},
  };
}

std::string header_dictionary_file(const std::string& path) { return fs::path(path).filename().string(); }

// Regression inputs ------------------------------------------------------------------------------

std::string nested(size_t depth, const std::string& inner) {
  return std::string(depth, '[') + inner + std::string(depth, ']');
}

std::string le64(uint64_t v) {
  std::string out(8, '\0');
  for (int b = 0; b < 8; ++b) out[static_cast<size_t>(b)] = static_cast<char>((v >> (8 * b)) & 0xff);
  return out;
}

// A safetensors file of `header` (JSON text) and `data`.
std::string safetensors_bytes(const std::string& header, const std::string& data) {
  return le64(header.size()) + header + data;
}

// The header (JSON) and the data of a safetensors file's bytes.
std::pair<Json, std::string> split_safetensors(const std::string& bytes) {
  uint64_t length = 0;
  for (int b = 7; b >= 0; --b) length = (length << 8) | static_cast<unsigned char>(bytes[static_cast<size_t>(b)]);
  return {Json::parse(bytes.substr(8, length)), bytes.substr(8 + length)};
}

// `archive` with its data.pkl replaced by `pickle`.
std::string with_pickle(const PtArchive& archive, const std::string& pickle) {
  PtArchive a = archive;
  for (auto& [name, data] : a.records) {
    if (name == "data.pkl") data = pickle;
  }
  return write_pt_archive(a);
}

// ------------------------------------------------------------------------------------------------
// safetensors: storage::SafetensorsFile and its reads.

class SafetensorsTarget final : public Target {
 public:
  const char* name() const override { return "safetensors"; }
  Format format() const override { return Format::kSafetensors; }
  const char* extension() const override { return ".safetensors"; }
  void setup(const std::string& work, const std::vector<std::string>& extra_seeds) override {
    path_ = work + "/input.safetensors";
    const std::string seed_path = work + "/seed.safetensors";
    const auto items = varied_items();
    storage::write_safetensors(seed_path, items, {{"format", "pt"}}, 8);
    add_seed("checksummed", read_whole_file(seed_path));
    storage::write_safetensors(seed_path, items, {{"format", "pt"}}, 0);
    add_seed("plain", read_whole_file(seed_path));
    storage::write_safetensors(seed_path, {items[0]}, {}, 4);
    add_seed("one-entry", read_whole_file(seed_path));
    storage::write_safetensors(seed_path, {}, {{"format", "pt"}, {"note", "metadata only"}}, 16);
    add_seed("metadata-only", read_whole_file(seed_path));
    for (const auto& extra : extra_seeds) add_seed(header_dictionary_file(extra), read_whole_file(extra));
  }
  void run(const std::string& input, uint64_t /*variant*/, Runner& runner) override {
    write_whole_file(path_, input);
    runner.call("storage::SafetensorsFile", [&] {
      storage::SafetensorsFile file(path_);
      for (const auto& entry : file.header().entries) {
        file.header().at(entry.key);
        file.verify(entry, 0, entry.nbytes());
        file.read_tensor(entry);
      }
    });
  }
  std::vector<std::string> locations() const override { return {path_}; }
  std::vector<std::pair<std::string, std::string>> regressions() const override {
    auto [header, data] = split_safetensors(seeds_[0].bytes);
    Json huge_block = header;
    huge_block["__metadata__"]["FSDP_CRC32C_BLOCK"] = "9223372036854775807";
    Json zero_x = header;
    std::string crc = zero_x["__metadata__"]["FSDP_CRC32C"].get<std::string>();
    crc.replace(crc.find(":[\"") + 3, 8, "0x1a2b3c");
    zero_x["__metadata__"]["FSDP_CRC32C"] = crc;
    return {
        // nlohmann's ordered_json copied the deep value recursively when the object grew.
        {"a value nested 100000 deep",
         safetensors_bytes("{\"w\":{\"dtype\":" + nested(100000, "") + ",\"shape\":[1]}}", "")},
        {"a checksum block size of 2^63-1 (block counts overflowed)", safetensors_bytes(huge_block.dump(), data)},
        {"a checksum written 0x1a2b3c", safetensors_bytes(zero_x.dump(), data)},
    };
  }

 private:
  std::string path_;
};

// ------------------------------------------------------------------------------------------------
// Distributed checkpoints

// Saves the model, its optimizer and Extra values and tensors with fsdp::dcp::save into `dir`;
// returns the manifest.
Json save_checkpoint(const Model& m, const std::string& dir) {
  dcp::Extra extra;
  extra.values["step"] = "7";
  extra.values["loader"] = "epoch=1;offset=32";
  extra.tensors.insert("rng", torch::arange(5, torch::kLong));
  dcp::save(dir, m.root(), m.optim.get(), extra, dcp::SaveOptions().communicator(m.comm).crc_block_bytes(16));
  return Json::parse(read_whole_file(dir + "/" + dcp::kManifestName));
}

// The same values in a layout a two-rank save could have made: every key with two rows or more
// split along dimension 0 into two boxes, the first in split-a.safetensors (with checksums), the
// second in split-b.safetensors (without); returns the manifest that describes them.
Json split_checkpoint(const std::string& dir, const Json& manifest) {
  std::map<std::string, std::unique_ptr<storage::SafetensorsFile>> files;
  std::vector<storage::SafetensorsItem> a_items, b_items;
  Json a_info = Json::object(), b_info = Json::object();
  Json keys = Json::array();
  for (const auto& record : manifest.at("keys")) {
    const std::string key = record.at(0).get<std::string>();
    const auto shape = record.at(2).get<std::vector<int64_t>>();
    const auto& box = record.at(3).at(0);
    const std::string file = manifest.at("files").at(box.at(0).get<size_t>()).at(0).get<std::string>();
    auto& open = files[file];
    if (!open) open = std::make_unique<storage::SafetensorsFile>(dir + "/" + file);
    const at::Tensor t = open->read_tensor(open->header().at(key));
    Json boxes = Json::array();
    std::vector<int64_t> zeros(shape.size(), 0);
    if (!shape.empty() && shape[0] >= 2 && t.sizes().vec() == shape) {
      const int64_t h = shape[0] / 2;
      auto b_offsets = zeros;
      b_offsets[0] = h;
      a_items.push_back({key, t.narrow(0, 0, h)});
      b_items.push_back({key, t.narrow(0, h, shape[0] - h)});
      a_info[key] = {{"saved_offsets", zeros}};
      b_info[key] = {{"saved_offsets", b_offsets}};
      auto a_sizes = shape, b_sizes = shape;
      a_sizes[0] = h;
      b_sizes[0] = shape[0] - h;
      boxes.push_back({0, zeros, a_sizes});
      boxes.push_back({1, b_offsets, b_sizes});
    } else {
      a_items.push_back({key, t});
      a_info[key] = {{"saved_offsets", zeros}};
      boxes.push_back({0, zeros, t.sizes().vec()});
    }
    keys.push_back({key, record.at(1), shape, boxes});
  }
  storage::write_safetensors(dir + "/split-a.safetensors", a_items,
                             {{"DCP_SHARDING_INFO", a_info.dump()}, {"FSDP_DCP_WRITER", "fsdp-dcp"}}, 16);
  storage::write_safetensors(dir + "/split-b.safetensors", b_items,
                             {{"DCP_SHARDING_INFO", b_info.dump()}, {"FSDP_DCP_WRITER", "fsdp-dcp"}}, 0);
  Json out = manifest;
  out["world_size"] = 2;
  out["files"] = Json::array({Json::array({"split-a.safetensors", fs::file_size(dir + "/split-a.safetensors")}),
                              Json::array({"split-b.safetensors", fs::file_size(dir + "/split-b.safetensors")})});
  out["keys"] = keys;
  return out;
}

dcp::LoadOptions load_options(const Model& m, uint64_t variant) {
  return dcp::LoadOptions().communicator(m.comm).strict(variant % 2 == 0).convert_dtype(variant % 3 == 0);
}

// fsdp_checkpoint.json, through fsdp::dcp::load (model, optimizer, Extra).
class DcpManifestTarget final : public Target {
 public:
  const char* name() const override { return "dcp_manifest"; }
  Format format() const override { return Format::kJson; }
  const char* extension() const override { return ".json"; }
  void setup(const std::string& work, const std::vector<std::string>& /*extra_seeds*/) override {
    model_ = make_model();
    dir_ = work + "/checkpoint";
    const Json manifest = save_checkpoint(*model_, dir_);
    add_seed("one-rank", manifest.dump(2));
    add_seed("split", split_checkpoint(dir_, manifest).dump());
  }
  void run(const std::string& input, uint64_t variant, Runner& runner) override {
    write_whole_file(dir_ + "/" + dcp::kManifestName, input);
    runner.call("fsdp::dcp::load", [&] {
      dcp::Extra extra;
      dcp::load(dir_, model_->root(), model_->optim.get(), &extra, load_options(*model_, variant));
    });
  }
  std::vector<std::string> locations() const override { return {dir_}; }
  std::vector<std::pair<std::string, std::string>> regressions() const override {
    const Json manifest = Json::parse(seeds_[0].bytes);
    std::vector<std::pair<std::string, std::string>> out;
    const auto edited = [&](const std::string& name, const std::function<void(Json&)>& edit) {
      Json m = manifest;
      edit(m);
      out.emplace_back(name, m.dump());
    };
    edited("a box offset of 2^63-1 (offset + size overflowed)", [](Json& m) {
      m["keys"][0][3][0][1][0] = std::numeric_limits<int64_t>::max();
    });
    edited("a file index of 2^32 (wrapped to 0 by get<int>)", [](Json& m) { m["keys"][0][3][0][0] = 1ULL << 32; });
    edited("a negative box size", [](Json& m) { m["keys"][0][3][0][2][0] = -1; });
    edited("a float box offset", [](Json& m) { m["keys"][0][3][0][1][0] = 1e300; });
    edited("a file outside the folder", [](Json& m) { m["files"][0][0] = "../" + m["files"][0][0].get<std::string>(); });
    edited("an Extra tensor of 2^40 elements (allocated before any check)", [](Json& m) {
      for (auto& record : m["keys"]) {
        if (record[0] == "extra.rng") record[2] = {int64_t{1} << 40};  // its one box still [0, 5)
      }
    });
    edited("a shape nested 100000 deep (dump() in an error message recursed)", [](Json& m) {
      m["keys"][0][3][0][0] = "FILE";
    });
    std::string& deep = out.back().second;
    deep.replace(deep.find("\"FILE\""), 6, nested(100000, ""));
    out.back().first = "a file index nested 100000 deep (dump() in the error message recursed)";
    return out;
  }

 private:
  std::unique_ptr<Model> model_;
  std::string dir_;
};

// One safetensors file of a checkpoint (its size in the manifest kept up to date), through dcp::load.
class DcpShardTarget final : public Target {
 public:
  const char* name() const override { return "dcp_shard"; }
  Format format() const override { return Format::kSafetensors; }
  const char* extension() const override { return ".safetensors"; }
  void setup(const std::string& work, const std::vector<std::string>& /*extra_seeds*/) override {
    model_ = make_model();
    dir_ = work + "/checkpoint";
    manifest_ = save_checkpoint(*model_, dir_);
    file_ = dir_ + "/" + manifest_.at("files").at(0).at(0).get<std::string>();
    add_seed("saved", read_whole_file(file_));
    // The same entries and metadata without checksums.
    storage::SafetensorsFile saved(file_);
    std::vector<storage::SafetensorsItem> items;
    for (const auto& e : saved.header().entries) items.push_back({e.key, saved.read_tensor(e)});
    const std::string plain = work + "/plain.safetensors";
    storage::write_safetensors(plain, items, saved.header().metadata, 0);
    add_seed("no-checksums", read_whole_file(plain));
  }
  void run(const std::string& input, uint64_t variant, Runner& runner) override {
    write_whole_file(file_, input);
    manifest_["files"][0][1] = input.size();
    write_whole_file(dir_ + "/" + dcp::kManifestName, manifest_.dump());
    runner.call("fsdp::dcp::load", [&] {
      dcp::Extra extra;
      dcp::load(dir_, model_->root(), model_->optim.get(), &extra, load_options(*model_, variant));
    });
  }
  std::vector<std::string> locations() const override { return {dir_}; }

 private:
  std::unique_ptr<Model> model_;
  std::string dir_;
  std::string file_;
  Json manifest_;
};

// A checkpoint folder without manifest (PyTorch DCP's Hugging Face layout): one of its two files,
// through fsdp::dcp::load_state.
class DcpHfTarget final : public Target {
 public:
  const char* name() const override { return "dcp_hf"; }
  Format format() const override { return Format::kSafetensors; }
  const char* extension() const override { return ".safetensors"; }
  void setup(const std::string& work, const std::vector<std::string>& extra_seeds) override {
    comm_ = one_rank_communicator();
    dir_ = work + "/hf_checkpoint";
    fs::create_directories(dir_);
    const at::Tensor w = torch::arange(24, torch::kFloat).view({6, 4});
    const at::Tensor b = torch::arange(4, torch::kFloat);
    const at::Tensor rng = torch::arange(3, torch::kLong);
    const Json a_info = {{"w", {{"saved_offsets", {0, 0}}}},
                         {"b", {{"saved_offsets", {0}}}},
                         {"extra.rng", {{"saved_offsets", {0}}}}};
    const Json b_info = {{"w", {{"saved_offsets", {3, 0}}}}};
    file_ = dir_ + "/shard-00001-model-00001-of-00001.safetensors";
    storage::write_safetensors(dir_ + "/shard-00002-model-00001-of-00001.safetensors", {{"w", w.narrow(0, 3, 3)}},
                               {{"DCP_SHARDING_INFO", b_info.dump()}}, 0);
    const std::vector<storage::SafetensorsItem> items = {{"w", w.narrow(0, 0, 3)}, {"b", b}, {"extra.rng", rng}};
    storage::write_safetensors(file_, items, {{"DCP_SHARDING_INFO", a_info.dump()}}, 16);
    add_seed("checksummed", read_whole_file(file_));
    storage::write_safetensors(file_, items, {{"DCP_SHARDING_INFO", a_info.dump()}}, 0);
    add_seed("plain", read_whole_file(file_));
    storage::write_safetensors(file_, items, {}, 8);
    add_seed("no-sharding-info", read_whole_file(file_));
    for (const auto& extra : extra_seeds) add_seed(header_dictionary_file(extra), read_whole_file(extra));
    state_.emplace_back("w", LocalShard{torch::zeros({24}), {6, 4}});
    state_.emplace_back("b", LocalShard{torch::zeros({4}), {4}});
  }
  void run(const std::string& input, uint64_t variant, Runner& runner) override {
    write_whole_file(file_, input);
    runner.call("fsdp::dcp::load_state", [&] {
      dcp::Extra extra;
      dcp::load_state(dir_, state_, &extra,
                      dcp::LoadOptions().communicator(comm_).strict(variant % 2 == 0).convert_dtype(variant % 3 == 0));
    });
  }
  std::vector<std::string> locations() const override { return {dir_}; }
  std::vector<std::pair<std::string, std::string>> regressions() const override {
    auto [header, data] = split_safetensors(seeds_[1].bytes);  // without checksums
    Json info = Json::parse(header["__metadata__"]["DCP_SHARDING_INFO"].get<std::string>());
    info["w"]["saved_offsets"] = {std::numeric_limits<int64_t>::max(), 0};
    Json overflow = header;
    overflow["__metadata__"]["DCP_SHARDING_INFO"] = info.dump();
    info["w"]["saved_offsets"] = {"0", 0};
    Json strings = header;
    strings["__metadata__"]["DCP_SHARDING_INFO"] = info.dump();
    Json deep = header;
    deep["__metadata__"]["DCP_SHARDING_INFO"] = nested(100000, "");
    return {
        {"saved offsets of 2^63-1 (offset + size overflowed)", safetensors_bytes(overflow.dump(), data)},
        {"saved offsets that are strings (a json type_error naming no file)", safetensors_bytes(strings.dump(), data)},
        {"DCP_SHARDING_INFO nested 100000 deep", safetensors_bytes(deep.dump(), data)},
    };
  }

 private:
  std::shared_ptr<comm::Communicator> comm_;
  std::string dir_;
  std::string file_;
  ShardedStateDict state_;
};

// ------------------------------------------------------------------------------------------------
// model.safetensors.index.json

class HfIndexTarget final : public Target {
 public:
  const char* name() const override { return "hf_index"; }
  Format format() const override { return Format::kJson; }
  const char* extension() const override { return ".json"; }
  void setup(const std::string& work, const std::vector<std::string>& /*extra_seeds*/) override {
    model_ = make_model();
    dir_ = work + "/model";
    save_safetensors(dir_, full_state_dict(model_->root()),
                     SaveSafetensorsOptions().max_file_bytes(40).crc_block_bytes(16));
    index_ = dir_ + "/model.safetensors.index.json";
    const std::string text = read_whole_file(index_);
    add_seed("saved", text);
    Json index = Json::parse(text);
    index.erase("metadata");
    add_seed("no-metadata", index.dump());
    for (const auto& name : fs::directory_iterator(dir_)) dictionary_.push_back(name.path().filename().string());
  }
  void run(const std::string& input, uint64_t variant, Runner& runner) override {
    write_whole_file(index_, input);
    runner.call("fsdp::load_safetensors", [&] { load_safetensors(dir_); });
    runner.call("fsdp::safetensors_files", [&] { safetensors_files(dir_, "fuzz"); });
    runner.call("fsdp::load_pretrained", [&] {
      load_pretrained(model_->root(), dir_,
                      LoadPretrainedOptions().strict(variant % 2 == 0).convert_dtype(variant % 3 == 0));
    });
  }
  std::vector<std::string> locations() const override { return {dir_}; }
  std::vector<std::pair<std::string, std::string>> regressions() const override {
    Json escaping = Json::parse(seeds_[0].bytes);
    for (auto& [key, file] : escaping["weight_map"].items()) file = "../model/" + file.get<std::string>();
    Json root = Json::parse(seeds_[0].bytes);
    for (auto& [key, file] : root["weight_map"].items()) file = "/";
    return {
        // ordered_json copied "metadata" recursively when "weight_map" was added after it.
        {"metadata nested 100000 deep before the weight map",
         "{\"metadata\":" + nested(100000, "") + ",\"weight_map\":{}}"},
        {"files listed through '..' (outside the index's folder)", escaping.dump()},
        {"the folder '/' listed as a file", root.dump()},
    };
  }

 private:
  std::unique_ptr<Model> model_;
  std::string dir_;
  std::string index_;
};

// ------------------------------------------------------------------------------------------------
// .pt files

class PtTarget final : public Target {
 public:
  const char* name() const override { return "pt"; }
  Format format() const override { return Format::kPtArchive; }
  const char* extension() const override { return ".pt"; }
  void setup(const std::string& work, const std::vector<std::string>& extra_seeds) override {
    model_ = make_model();
    path_ = work + "/input.pt";
    const std::string seed_path = work + "/seed.pt";
    const FullStateDict sd = full_state_dict(model_->root());
    save_pt(seed_path, sd);
    add_seed("model", read_whole_file(seed_path));
    FullStateDict varied;
    for (const auto& item : varied_items()) varied.insert(item.key, item.tensor);
    save_pt(seed_path, varied);
    add_seed("varied", read_whole_file(seed_path));
    for (const auto& extra : extra_seeds) add_seed(header_dictionary_file(extra), read_whole_file(extra));
    for (const auto& item : sd) dictionary_.push_back(item.key());
  }
  void run(const std::string& input, uint64_t variant, Runner& runner) override {
    write_whole_file(path_, input);
    runner.call("fsdp::load_pt", [&] { load_pt(path_); });
    runner.call("fsdp::load_pretrained", [&] {
      load_pretrained(model_->root(), path_,
                      LoadPretrainedOptions().strict(variant % 2 == 0).convert_dtype(variant % 3 == 0));
    });
  }
  std::vector<std::string> locations() const override { return {path_}; }
  std::vector<std::pair<std::string, std::string>> regressions() const override {
    const PtArchive& archive = seeds_[0].archive;
    const std::string proto = "\x80\x02";
    return {
        // LibTorch's unpickler allocates (and zero-fills) a string's declared length first.
        {"a string declaring 4 GiB", with_pickle(archive, proto + "X\xff\xff\xff\xff" "abc.")},
        // ... and grows its memo table to a LONG_BINPUT's index.
        {"a memo index of 2^32-1", with_pickle(archive, proto + "N" + "r\xff\xff\xff\xff" + ".")},
        // ... reads DICT items in pairs, one past the end of the stack for an odd count.
        {"a dict of three items", with_pickle(archive, proto + "(NNNd.")},
        // ... computes a tuple's size as the stack size minus a mark left above it by TUPLE2.
        {"a mark above the stack", with_pickle(archive, proto + "NN(\x86t.")},
        // ... and destroys nested tuples recursively.
        {"tuples nested 200000 deep", with_pickle(archive, proto + "N" + std::string(200000, '\x85') + ".")},
        {"lists nested 200000 deep", with_pickle(archive, [&] {
           std::string p = proto;
           for (int i = 0; i < 200000; ++i) p += "](";
           return p + std::string(200000, 'e') + ".";
         }())},
    };
  }

 private:
  std::unique_ptr<Model> model_;
  std::string path_;
};

}  // namespace

std::vector<std::string> target_names() {
  return {"safetensors", "dcp_manifest", "dcp_shard", "dcp_hf", "hf_index", "pt"};
}

std::unique_ptr<Target> make_target(const std::string& name) {
  if (name == "safetensors") return std::make_unique<SafetensorsTarget>();
  if (name == "dcp_manifest") return std::make_unique<DcpManifestTarget>();
  if (name == "dcp_shard") return std::make_unique<DcpShardTarget>();
  if (name == "dcp_hf") return std::make_unique<DcpHfTarget>();
  if (name == "hf_index") return std::make_unique<HfIndexTarget>();
  if (name == "pt") return std::make_unique<PtTarget>();
  return nullptr;
}

}  // namespace fsdp::fuzz
