#pragma once
// Reading Hugging Face config.json files: typed fields with errors that name the file and the key.
// Shared by the models' config readers (models/llama.h, models/moe.h).
//
//   const fsdp::models::HfJson j(text, "/models/x/config.json");
//   j.expect_architecture("llama", "LlamaForCausalLM");
//   int64_t vocab = j.integer("vocab_size");      // missing or not an integer: c10::Error

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fsdp_cpp/models/llama.h"

namespace fsdp::models {

/// The file config.json at `path` (a file, or a folder holding config.json) and its text. A
/// missing or unreadable file, or one over 16 MiB, is a c10::Error naming it.
std::pair<std::string, std::string> read_hf_config_text(const std::string& path);

/// transformers 5's `rope_parameters` object of `rope` (llama3's fields only for that type), as
/// JSON text: what the models' to_hf_json write.
std::string rope_parameters_json(const RopeParameters& rope);

class HfJson {
 public:
  /// Parses `text`; not JSON or not an object: a c10::Error naming `where`.
  HfJson(const std::string& text, std::string where);
  ~HfJson();

  /// model_type must be `model_type` and architectures (if present) hold `architecture`.
  void expect_architecture(const std::string& model_type, const std::string& architecture) const;
  int64_t integer(const std::string& key) const;
  int64_t integer_or(const std::string& key, int64_t fallback) const;
  double number_or(const std::string& key, double fallback) const;
  bool boolean_or(const std::string& key, bool fallback) const;
  /// A token id, null or absent (-1); a list (several eos ids) gives its first.
  int64_t token_id_or(const std::string& key) const;
  /// A list of integers, absent: empty.
  std::vector<int64_t> integers_or_empty(const std::string& key) const;
  /// A string field that, when present and not null, must equal `expected`.
  void expect_string_or(const std::string& key, const std::string& expected) const;
  std::string string_or(const std::string& key, const std::string& fallback) const;
  /// A number field that, when present and not null, must be 0 (or 1).
  void expect_zero_or_absent(const std::string& key) const;
  void expect_one_or_absent(const std::string& key) const;
  /// rope_parameters (transformers 5) or rope_theta + rope_scaling (earlier files).
  RopeParameters rope_parameters() const;
  const std::string& where() const { return where_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string where_;
};

}  // namespace fsdp::models
