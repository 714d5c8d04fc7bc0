#include "fsdp_cpp/models/hf_checkpoint.h"

#include <sys/stat.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "fsdp_cpp/checkpoint/full_state_dict_files.h"
#include "fsdp_cpp/checkpoint/load_pretrained.h"
#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/comm/agreement.h"
#include "fsdp_cpp/models/hf_json.h"
#include "fsdp_cpp/storage/safetensors.h"

namespace fsdp::models {

namespace {

constexpr const char* kLoadApi = "fsdp::models::load_hf_checkpoint";
constexpr const char* kExportApi = "fsdp::models::export_hf_checkpoint";

std::string message_of(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

template <typename F>
std::optional<std::string> attempt(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return message_of(e);
  }
  return std::nullopt;
}

// Every rank's strings, in world rank order.
std::vector<std::string> all_gather_text(comm::Communicator& world, const std::string& mine, const char* api) {
  if (world.size() == 1) return {mine};
  std::vector<std::string> out;
  for (const auto& b : world.all_gather_bytes(std::vector<uint8_t>(mine.begin(), mine.end()), api)) {
    out.emplace_back(b.begin(), b.end());
  }
  return out;
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) out.push_back(line);
  }
  return out;
}

std::string join(const std::vector<std::string>& keys, size_t limit = 8) {
  std::string out;
  for (size_t i = 0; i < keys.size() && i < limit; ++i) out += (i ? ", '" : "'") + keys[i] + "'";
  if (keys.size() > limit) out += ", ... (" + std::to_string(keys.size()) + " in all)";
  return out;
}

void write_text_file(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    TORCH_CHECK(out, "cannot write '", tmp, "'");
    out << text;
    out.flush();
    TORCH_CHECK(out, "writing '", tmp, "' failed");
  }
  TORCH_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "cannot rename '", tmp, "' to '", path, "'");
}

}  // namespace

void load_hf_checkpoint(parallel::ParallelModel& model, const std::string& dir, const HfModelFiles& files,
                        const std::function<void(const std::string&, const std::string&)>& check_config) {
  comm::Communicator& world = *model.world();
  // 1. What every rank can check alone: the config and the files' headers; then which keys the
  //    files have against the keys of every stage of the job (agreed over the job).
  std::set<std::string> mine;
  for (const auto& part : model.parts()) {
    for (const auto& item : part.module->named_parameters()) mine.insert(item.key());
    for (const auto& item : part.module->named_buffers()) mine.insert(item.key());
  }
  std::set<std::string> file_keys;
  std::optional<std::string> error = attempt([&] {
    const auto [config_file, text] = read_hf_config_text(dir);
    check_config(text, config_file);
    for (const auto& [path, keys] : safetensors_files(dir, kLoadApi).files) {
      storage::SafetensorsFile file(path);  // header parsed, size checked against it
      if (keys.empty()) {
        for (const auto& e : file.header().entries) file_keys.insert(e.key);
      } else {
        for (const auto& key : keys) {
          TORCH_CHECK(file.header().find(key) != nullptr, "the index names '", key, "' in '", path,
                      "', which that file does not hold");
          file_keys.insert(key);
        }
      }
    }
  });
  std::string mine_text;
  for (const auto& k : mine) mine_text += k + "\n";
  std::set<std::string> every;
  for (const auto& text : all_gather_text(world, error ? std::string() : mine_text, kLoadApi)) {
    for (auto& k : split_lines(text)) every.insert(std::move(k));
  }
  if (!error) {
    error = attempt([&] {
      std::vector<std::string> missing, unexpected;
      for (const auto& k : mine) {
        if (!file_keys.count(k)) missing.push_back(k);
      }
      for (const auto& k : file_keys) {
        if (!every.count(k)) unexpected.push_back(k);
      }
      TORCH_CHECK(missing.empty(), "'", dir, "' lacks ", missing.size(), " key(s) of the model: ", join(missing));
      TORCH_CHECK(unexpected.empty(), "'", dir, "' holds ", unexpected.size(),
                  " key(s) that no part of the model has: ", join(unexpected));
    });
  }
  comm::throw_if_any_error({model.world()}, error, kLoadApi);
  // 2. Each stage chunk reads its slices (load_pretrained agrees over the chunk's dp and tp
  //    groups; its shape and dtype checks come before it writes anything).
  error = attempt([&] {
    for (const auto& root : model.roots()) {
      std::vector<std::string> padded;
      for (const auto& fqn : files.padded_rows) {
        if (root.module().named_parameters().contains(fqn)) padded.push_back(fqn);
      }
      load_pretrained(root, dir, LoadPretrainedOptions().strict(false).convert_dtype(true).padded_rows(padded));
    }
  });
  if (error && model.n_stages() > 1) *error += " (other pipeline stages may have loaded: load again after fixing it)";
  comm::throw_if_any_error({model.world()}, error, kLoadApi);
}

void export_hf_checkpoint(parallel::ParallelModel& model, const std::string& dir, const HfModelFiles& files,
                          const HfExportOptions& options) {
  comm::Communicator& world = *model.world();
  const bool leader = world.rank() == 0;
  // The folder, emptied of an earlier model, before any rank writes into it.
  std::optional<std::string> error = attempt([&] {
    std::filesystem::create_directories(dir);
    if (leader) {
      for (const auto& entry : std::filesystem::directory_iterator(dir)) {
        const std::string name = entry.path().filename().string();
        if (name == "model.safetensors" || name == "model.safetensors.index.json" ||
            (name.rfind("model-", 0) == 0 && name.size() > 12 && name.substr(name.size() - 12) == ".safetensors")) {
          std::filesystem::remove(entry.path());
        }
      }
    }
  });
  comm::throw_if_any_error({model.world()}, error, kExportApi);
  // The writers: for each stage chunk, the ranks the values reach (for_each_full_value: dp and
  // tp rank 0 of the stage, and with expert parallelism the first rank holding each ep rank's
  // experts), one file each, numbered by (stage, world rank) over the job.
  auto padded = [&](const std::string& fqn) {
    return std::find(files.padded_rows.begin(), files.padded_rows.end(), fqn) != files.padded_rows.end();
  };
  std::vector<std::vector<storage::SafetensorsEntrySpec>> chunk_specs;
  std::string mine;  // "stage world-rank" per chunk this rank writes
  for (size_t c = 0; c < model.roots().size(); ++c) {
    std::vector<storage::SafetensorsEntrySpec> specs;
    for (auto& v : full_value_specs(model.roots()[c], FullStateDictOptions())) {
      if (padded(v.fqn) && !v.shape.empty() && v.shape[0] > files.vocab_size) v.shape[0] = files.vocab_size;
      if (options.dtype() && c10::isFloatingType(v.dtype)) v.dtype = *options.dtype();
      specs.push_back({v.fqn, v.dtype, v.shape});
    }
    if (!specs.empty()) mine += std::to_string(model.stages()[c]) + " " + std::to_string(world.rank()) + "\n";
    chunk_specs.push_back(std::move(specs));
  }
  std::vector<std::pair<int, int>> writers;  // (stage, world rank), sorted
  for (const auto& text : all_gather_text(world, mine, kExportApi)) {
    for (const auto& line : split_lines(text)) {
      std::istringstream in(line);
      int stage = 0, rank = 0;
      in >> stage >> rank;
      writers.emplace_back(stage, rank);
    }
  }
  std::sort(writers.begin(), writers.end());
  const int n_files = static_cast<int>(writers.size());
  auto file_name = [&](int stage) {
    if (n_files == 1) return std::string("model.safetensors");
    const int index = static_cast<int>(std::find(writers.begin(), writers.end(), std::make_pair(stage, world.rank())) -
                                       writers.begin());
    char name[64];
    std::snprintf(name, sizeof(name), "model-%05d-of-%05d.safetensors", index + 1, n_files);
    return std::string(name);
  };
  std::string written;  // "file\tkey\tbytes" lines
  error = attempt([&] {
    for (size_t c = 0; c < model.roots().size(); ++c) {
      // The file's entries, known on every rank before anything is gathered; the values stream
      // in one unit at a time (for_each_full_value) and are written at their offsets as they come.
      const auto& root = model.roots()[c];
      const auto& specs = chunk_specs[c];
      const std::string name = file_name(model.stages()[c]);
      const std::string tmp = dir + "/." + name + ".tmp";
      std::unique_ptr<storage::SafetensorsWriter> writer;  // on the rank the values reach
      std::optional<std::string> failed;  // the gathers go on (they are collectives) after a failure
      for_each_full_value(root, [&](const std::string& fqn, const at::Tensor& value) {
        if (failed) return;
        failed = attempt([&] {
          if (!writer) {
            writer = std::make_unique<storage::SafetensorsWriter>(tmp, specs,
                                                                  std::map<std::string, std::string>{{"format", "pt"}});
          }
          at::Tensor t = value;
          if (padded(fqn) && t.size(0) > files.vocab_size) t = t.narrow(0, 0, files.vocab_size);
          if (options.dtype() && t.is_floating_point()) t = t.to(*options.dtype());
          writer->write(fqn, t);
        });
      });
      TORCH_CHECK(!failed, *failed);
      if (!writer) continue;
      writer->finish();
      std::filesystem::rename(tmp, dir + "/" + name);
      for (const auto& spec : specs) {
        int64_t numel = 1;
        for (const int64_t d : spec.shape) numel *= d;
        written += name + "\t" + spec.key + "\t" + std::to_string(numel * static_cast<int64_t>(c10::elementSize(spec.dtype))) + "\n";
      }
    }
  });
  comm::throw_if_any_error({model.world()}, error, kExportApi);
  // The index and the config last: a folder with them is complete.
  const auto lines = all_gather_text(world, written, kExportApi);
  error = attempt([&] {
    if (!leader) return;
    nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
    int64_t total = 0;
    std::map<std::string, std::pair<std::string, int64_t>> sorted;
    for (const auto& text : lines) {
      for (const auto& line : split_lines(text)) {
        const auto a = line.find('\t'), b = line.rfind('\t');
        sorted[line.substr(a + 1, b - a - 1)] = {line.substr(0, a), std::stoll(line.substr(b + 1))};
      }
    }
    for (const auto& [key, where] : sorted) {
      weight_map[key] = where.first;
      total += where.second;
    }
    if (n_files > 1) {
      nlohmann::ordered_json index;
      index["metadata"] = {{"total_size", total}};
      index["weight_map"] = weight_map;
      write_text_file(dir + "/model.safetensors.index.json", index.dump(2) + "\n");
    }
    write_text_file(dir + "/config.json", files.config_json);
  });
  comm::throw_if_any_error({model.world()}, error, kExportApi);
}

HfModelFiles llama_hf_files(const LlamaConfig& config) {
  HfModelFiles files;
  files.config_json = config.to_hf_json();
  files.padded_rows = {"model.embed_tokens.weight", "lm_head.weight"};
  files.vocab_size = config.vocab_size();
  return files;
}

void check_same_llama_config(const LlamaConfig& expected, const LlamaConfig& found, const std::string& where) {
  auto same = [&](const char* key, auto a, auto b) {
    TORCH_CHECK(a == b, where, ": key '", key, "' is ", b, " but the model was built with ", a);
  };
  same("vocab_size", expected.vocab_size(), found.vocab_size());
  same("hidden_size", expected.hidden_size(), found.hidden_size());
  same("intermediate_size", expected.intermediate_size(), found.intermediate_size());
  same("num_hidden_layers", expected.num_hidden_layers(), found.num_hidden_layers());
  same("num_attention_heads", expected.num_attention_heads(), found.num_attention_heads());
  same("num_key_value_heads", expected.kv_heads(), found.kv_heads());
  same("head_dim", expected.head_size(), found.head_size());
  same("rms_norm_eps", expected.rms_norm_eps(), found.rms_norm_eps());
  same("tie_word_embeddings", expected.tie_word_embeddings(), found.tie_word_embeddings());
  same("attention_bias", expected.attention_bias(), found.attention_bias());
  same("mlp_bias", expected.mlp_bias(), found.mlp_bias());
  same("rope_parameters.rope_type", expected.rope().rope_type, found.rope().rope_type);
  same("rope_parameters.rope_theta", expected.rope().rope_theta, found.rope().rope_theta);
  if (expected.rope().rope_type == "llama3") {
    same("rope_parameters.factor", expected.rope().factor, found.rope().factor);
    same("rope_parameters.low_freq_factor", expected.rope().low_freq_factor, found.rope().low_freq_factor);
    same("rope_parameters.high_freq_factor", expected.rope().high_freq_factor, found.rope().high_freq_factor);
    same("rope_parameters.original_max_position_embeddings", expected.rope().original_max_position_embeddings,
         found.rope().original_max_position_embeddings);
  }
}

void load_llama_hf(parallel::ParallelModel& model, const LlamaConfig& config, const std::string& dir) {
  load_hf_checkpoint(model, dir, llama_hf_files(config), [&](const std::string& text, const std::string& where) {
    check_same_llama_config(config, parse_llama_config(text, where, config.vocab_multiple()), where);
  });
}

void export_llama_hf(parallel::ParallelModel& model, const LlamaConfig& config, const std::string& dir,
                     const HfExportOptions& options) {
  export_hf_checkpoint(model, dir, llama_hf_files(config), options);
}

}  // namespace fsdp::models
