// Hugging Face folders that come from elsewhere (models/hf_checkpoint.h): a good folder (sharded,
// with an index) loads at every world size; each bad one is refused with one error on every rank
// naming the file and the key, and nothing of the model changes.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>

#include <torch/torch.h>

#include "fsdp_cpp/checkpoint/full_state_dict_files.h"
#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/models/hf_checkpoint.h"
#include "fsdp_cpp/models/llama.h"
#include "fsdp_cpp/models/llama_parallel.h"
#include "fsdp_cpp/storage/safetensors.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::models::LlamaConfig;

LlamaConfig tiny_config() {
  return LlamaConfig(/*vocab_size=*/37).hidden_size(16).intermediate_size(24).num_hidden_layers(2)
      .num_attention_heads(4).num_key_value_heads(2).vocab_multiple(4);
}

fsdp::parallel::ParallelModel job(uint64_t seed) {
  return fsdp::parallel::parallelize(fsdp::testing::fresh_comm(), fsdp::models::llama_model_spec(tiny_config(), seed),
                                     fsdp::parallel::ParallelOptions().dims({.dp_shard = -1}));
}

std::map<std::string, at::Tensor> values(const fsdp::parallel::ParallelModel& model) {
  std::map<std::string, at::Tensor> out;
  for (const auto& item : fsdp::full_state_dict(model.roots().front(), fsdp::FullStateDictOptions().rank0_only(false))) {
    out[item.key()] = item.value().clone();
  }
  return out;
}

bool same(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [k, v] : a) {
    if (!b.count(k) || !v.equal(b.at(k))) return false;
  }
  return true;
}

// A good folder: a model exported by this job, re-saved by rank 0 as 3 files with an index.
std::string good_folder(fsdp::parallel::ParallelModel& source, const std::string& name) {
  const std::string dir = fsdp::testing::shared_tmpdir() + "/" + name;
  fsdp::models::export_llama_hf(source, tiny_config(), dir + "-export");
  if (fsdp::testing::rank() == 0) {
    const auto sd = fsdp::load_safetensors(dir + "-export");
    fsdp::save_safetensors(dir, sd, fsdp::SaveSafetensorsOptions().max_file_bytes(4096));
    std::filesystem::copy_file(dir + "-export/config.json", dir + "/config.json",
                               std::filesystem::copy_options::overwrite_existing);
  }
  fsdp::testing::same_on_every_rank("");  // a barrier: the folder is complete
  return dir;
}

void write_text(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::trunc) << text; }

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Loads `dir` into a fresh job; the error (the same on every rank) and whether the model changed.
std::string refused(const std::string& dir) {
  auto model = job(/*seed=*/5);
  const auto before = values(model);
  const std::string error =
      fsdp::testing::error_of([&] { fsdp::models::load_llama_hf(model, tiny_config(), dir); });
  CHECK(fsdp::testing::same_on_every_rank(error));
  CHECK(same(before, values(model)));
  return error;
}

}  // namespace

FSDP_RANKS_TEST_CASE("a sharded Hugging Face folder loads at any world size, the padding rows zero", "[models]") {
  auto source = job(/*seed=*/1);
  const std::string dir = good_folder(source, "good");
  CHECK(std::filesystem::exists(dir + "/model.safetensors.index.json"));
  auto model = job(/*seed=*/2);
  fsdp::models::load_llama_hf(model, tiny_config(), dir);
  const auto got = values(model), want = values(source);
  CHECK(same(got, want));
  CHECK(got.at("lm_head.weight").size(0) == 40);
  CHECK(got.at("lm_head.weight").narrow(0, 37, 3).abs().sum().item<double>() == 0.0);
  // The export holds the real vocabulary only.
  if (fsdp::testing::rank() == 0) {
    CHECK(fsdp::load_safetensors(dir)["model.embed_tokens.weight"].size(0) == 37);
  }
}

FSDP_RANKS_TEST_CASE("Hugging Face folders from elsewhere: each bad one refused on every rank, nothing loaded",
                     "[models]") {
  auto source = job(/*seed=*/1);
  const std::string good = good_folder(source, "base");
  const bool writer = fsdp::testing::rank() == 0;
  auto variant = [&](const std::string& name, const std::function<void(const std::string&)>& spoil) {
    const std::string dir = fsdp::testing::shared_tmpdir() + "/" + name;
    if (writer) {
      std::filesystem::remove_all(dir);
      std::filesystem::copy(good, dir);
      spoil(dir);
    }
    fsdp::testing::same_on_every_rank("");
    return refused(dir);
  };
  const std::string config = read_text(good + "/config.json");
  std::vector<std::string> shards;  // the good folder's files, in order
  for (const auto& entry : std::filesystem::directory_iterator(good)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("model-", 0) == 0) shards.push_back(name);
  }
  std::sort(shards.begin(), shards.end());
  REQUIRE(shards.size() >= 3);
  auto replace = [](std::string text, const std::string& from, const std::string& to) {
    text.replace(text.find(from), from.size(), to);
    return text;
  };
  CHECK_THAT(variant("arch", [&](const std::string& d) {
               write_text(d + "/config.json", replace(config, "\"model_type\": \"llama\"", "\"model_type\": \"mistral\""));
             }),
             Contains("config.json: key 'model_type' is \"mistral\", expected \"llama\""));
  CHECK_THAT(variant("shape_config", [&](const std::string& d) {
               write_text(d + "/config.json", replace(config, "\"hidden_size\": 16", "\"hidden_size\": 32"));
             }),
             Contains("config.json: key 'hidden_size' is 32 but the model was built with 16"));
  CHECK_THAT(variant("not_json", [&](const std::string& d) { write_text(d + "/config.json", "{\"vocab_size\": "); }),
             Contains("config.json: not valid JSON"));
  CHECK_THAT(variant("missing_file", [&](const std::string& d) {
               std::filesystem::remove(d + "/" + shards[1]);
             }),
             Contains(shards[1]));
  CHECK_THAT(variant("truncated", [&](const std::string& d) {
               const std::string f = d + "/" + shards.back();
               std::filesystem::resize_file(f, std::filesystem::file_size(f) - 100);
             }),
             Contains(shards.back()));
  // A file key no part of the model has, and a model key the files lack.
  CHECK_THAT(variant("extra_key", [&](const std::string& d) {
               auto sd = fsdp::load_safetensors(d);
               sd.insert("model.layers.7.mlp.up_proj.weight", at::zeros({2, 2}));
               fsdp::save_safetensors(d, sd, fsdp::SaveSafetensorsOptions().max_file_bytes(4096));
             }),
             Contains("holds 1 key(s) that no part of the model has: 'model.layers.7.mlp.up_proj.weight'"));
  CHECK_THAT(variant("missing_key", [&](const std::string& d) {
               auto sd = fsdp::load_safetensors(d);
               fsdp::FullStateDict kept;
               for (const auto& item : sd) {
                 if (item.key() != "model.norm.weight") kept.insert(item.key(), item.value());
               }
               fsdp::save_safetensors(d, kept, fsdp::SaveSafetensorsOptions().max_file_bytes(4096));
             }),
             Contains("lacks 1 key(s) of the model: 'model.norm.weight'"));
  CHECK_THAT(variant("wrong_shape", [&](const std::string& d) {
               auto sd = fsdp::load_safetensors(d);
               sd["model.layers.1.self_attn.k_proj.weight"] = at::zeros({16, 16});
               fsdp::save_safetensors(d, sd, fsdp::SaveSafetensorsOptions().max_file_bytes(4096));
             }),
             Contains("'model.layers.1.self_attn.k_proj.weight' has shape [16, 16] in the file but [8, 16] in the model"));
  CHECK_THAT(variant("index_names_absent_file", [&](const std::string& d) {
               const std::string index = read_text(d + "/model.safetensors.index.json");
               write_text(d + "/model.safetensors.index.json",
                          replace(index, shards.front(), "model-00099-of-00099.safetensors"));
             }),
             Contains("model-00099-of-00099.safetensors"));
}
