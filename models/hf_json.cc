#include "fsdp_cpp/models/hf_json.h"

#include <sys/stat.h>

#include <fstream>
#include <sstream>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

namespace fsdp::models {

std::pair<std::string, std::string> read_hf_config_text(const std::string& path) {
  struct stat st {};
  std::string file = path;
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) file = path + "/config.json";
  TORCH_CHECK(::stat(file.c_str(), &st) == 0 && S_ISREG(st.st_mode), "Hugging Face config: '", file,
              "' is not there (expected config.json, or a folder holding it)");
  TORCH_CHECK(st.st_size <= (int64_t{16} << 20), "Hugging Face config: '", file, "' has ", st.st_size,
              " bytes; a config.json over 16 MiB is refused");
  std::ifstream in(file, std::ios::binary);
  TORCH_CHECK(in, "Hugging Face config: cannot open '", file, "'");
  std::stringstream text;
  text << in.rdbuf();
  return {file, text.str()};
}

std::string rope_parameters_json(const RopeParameters& rope) {
  nlohmann::ordered_json j;
  if (rope.rope_type == "llama3") {
    j["factor"] = rope.factor;
    j["high_freq_factor"] = rope.high_freq_factor;
    j["low_freq_factor"] = rope.low_freq_factor;
    j["original_max_position_embeddings"] = rope.original_max_position_embeddings;
  }
  j["rope_theta"] = rope.rope_theta;
  j["rope_type"] = rope.rope_type;
  return j.dump();
}

struct HfJson::Impl {
  nlohmann::json j;
};

HfJson::HfJson(const std::string& text, std::string where) : impl_(std::make_unique<Impl>()), where_(std::move(where)) {
  try {
    impl_->j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, where_, ": not valid JSON (", e.what(), ")");
  }
  TORCH_CHECK(impl_->j.is_object(), where_, ": expected a JSON object, found ", impl_->j.type_name());
}

HfJson::~HfJson() = default;

namespace {
const nlohmann::json* field(const nlohmann::json& j, const std::string& key) {
  const auto it = j.find(key);
  return it == j.end() || it->is_null() ? nullptr : &*it;
}
}  // namespace

void HfJson::expect_architecture(const std::string& model_type, const std::string& architecture) const {
  const nlohmann::json* type = field(impl_->j, "model_type");
  TORCH_CHECK(type != nullptr && type->is_string(), where_, ": key 'model_type' is missing or not a string (expected \"",
              model_type, "\")");
  TORCH_CHECK(type->get<std::string>() == model_type, where_, ": key 'model_type' is \"", type->get<std::string>(),
              "\", expected \"", model_type, "\" (", architecture, ")");
  if (const nlohmann::json* archs = field(impl_->j, "architectures")) {
    TORCH_CHECK(archs->is_array(), where_, ": key 'architectures' must be a list of names");
    bool found = false;
    std::string names;
    for (const auto& a : *archs) {
      TORCH_CHECK(a.is_string(), where_, ": key 'architectures' must be a list of names");
      names += (names.empty() ? "" : ", ") + a.get<std::string>();
      found = found || a.get<std::string>() == architecture;
    }
    TORCH_CHECK(found, where_, ": key 'architectures' names [", names, "], expected ", architecture);
  }
}

int64_t HfJson::integer(const std::string& key) const {
  const nlohmann::json* v = field(impl_->j, key);
  TORCH_CHECK(v != nullptr, where_, ": key '", key, "' is missing (an integer is expected)");
  TORCH_CHECK(v->is_number_integer(), where_, ": key '", key, "' must be an integer, found ", v->dump());
  return v->get<int64_t>();
}

int64_t HfJson::integer_or(const std::string& key, int64_t fallback) const {
  return field(impl_->j, key) == nullptr ? fallback : integer(key);
}

double HfJson::number_or(const std::string& key, double fallback) const {
  const nlohmann::json* v = field(impl_->j, key);
  if (v == nullptr) return fallback;
  TORCH_CHECK(v->is_number(), where_, ": key '", key, "' must be a number, found ", v->dump());
  return v->get<double>();
}

bool HfJson::boolean_or(const std::string& key, bool fallback) const {
  const nlohmann::json* v = field(impl_->j, key);
  if (v == nullptr) return fallback;
  TORCH_CHECK(v->is_boolean(), where_, ": key '", key, "' must be true or false, found ", v->dump());
  return v->get<bool>();
}

int64_t HfJson::token_id_or(const std::string& key) const {
  const nlohmann::json* v = field(impl_->j, key);
  if (v == nullptr) return -1;
  if (v->is_array()) {
    if (v->empty()) return -1;
    TORCH_CHECK((*v)[0].is_number_integer(), where_, ": key '", key, "' must hold token ids, found ", v->dump());
    return (*v)[0].get<int64_t>();
  }
  TORCH_CHECK(v->is_number_integer(), where_, ": key '", key, "' must be a token id, found ", v->dump());
  return v->get<int64_t>();
}

std::vector<int64_t> HfJson::integers_or_empty(const std::string& key) const {
  const nlohmann::json* v = field(impl_->j, key);
  if (v == nullptr) return {};
  TORCH_CHECK(v->is_array(), where_, ": key '", key, "' must be a list of integers, found ", v->dump());
  std::vector<int64_t> out;
  for (const auto& e : *v) {
    TORCH_CHECK(e.is_number_integer(), where_, ": key '", key, "' must be a list of integers, found ", v->dump());
    out.push_back(e.get<int64_t>());
  }
  return out;
}

void HfJson::expect_string_or(const std::string& key, const std::string& expected) const {
  const nlohmann::json* v = field(impl_->j, key);
  if (v == nullptr) return;
  TORCH_CHECK(v->is_string() && v->get<std::string>() == expected, where_, ": key '", key, "' is ", v->dump(),
              "; only \"", expected, "\" is supported");
}

std::string HfJson::string_or(const std::string& key, const std::string& fallback) const {
  const nlohmann::json* v = field(impl_->j, key);
  if (v == nullptr) return fallback;
  TORCH_CHECK(v->is_string(), where_, ": key '", key, "' must be a string, found ", v->dump());
  return v->get<std::string>();
}

void HfJson::expect_zero_or_absent(const std::string& key) const {
  const double v = number_or(key, 0.0);
  TORCH_CHECK(v == 0.0, where_, ": key '", key, "' is ", v, "; only 0 is supported");
}

void HfJson::expect_one_or_absent(const std::string& key) const {
  const double v = number_or(key, 1.0);
  TORCH_CHECK(v == 1.0, where_, ": key '", key, "' is ", v, "; only 1 is supported");
}

RopeParameters HfJson::rope_parameters() const {
  RopeParameters rope;
  const nlohmann::json* params = field(impl_->j, "rope_parameters");
  if (params == nullptr) params = field(impl_->j, "rope_scaling");
  rope.rope_theta = number_or("rope_theta", rope.rope_theta);
  if (params == nullptr) return rope;
  const std::string key = field(impl_->j, "rope_parameters") ? "rope_parameters" : "rope_scaling";
  TORCH_CHECK(params->is_object(), where_, ": key '", key, "' must be an object, found ", params->dump());
  const HfJson sub(params->dump(), where_ + " (key '" + key + "')");
  rope.rope_type = sub.string_or("rope_type", sub.string_or("type", "default"));
  rope.rope_theta = sub.number_or("rope_theta", rope.rope_theta);
  if (rope.rope_type == "llama3") {
    rope.factor = sub.number_or("factor", rope.factor);
    rope.low_freq_factor = sub.number_or("low_freq_factor", rope.low_freq_factor);
    rope.high_freq_factor = sub.number_or("high_freq_factor", rope.high_freq_factor);
    rope.original_max_position_embeddings =
        sub.integer_or("original_max_position_embeddings", rope.original_max_position_embeddings);
  }
  TORCH_CHECK(rope.rope_type == "default" || rope.rope_type == "llama3", where_, ": key '", key, "' has rope_type \"",
              rope.rope_type, "\"; supported: \"default\", \"llama3\"");
  return rope;
}

}  // namespace fsdp::models
