#pragma once
// The parsers the fuzz harness drives (see tools/fuzz/README.md), each through public APIs:
//
//   safetensors   storage::SafetensorsFile (header, checksums) and its read_tensor/verify
//   dcp_manifest  fsdp_checkpoint.json of a distributed checkpoint, via fsdp::dcp::load
//   dcp_shard     one safetensors file of a checkpoint (manifest sizes kept consistent), dcp::load
//   dcp_hf        a folder without manifest (torch.distributed.checkpoint's Hugging Face layout,
//                 DCP_SHARDING_INFO), via fsdp::dcp::load_state
//   hf_index      model.safetensors.index.json, via fsdp::load_safetensors, fsdp::safetensors_files
//                 and fsdp::load_pretrained
//   pt            .pt archives (zip + pickle), via fsdp::load_pt and fsdp::load_pretrained

#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "mutate.h"

namespace fsdp::fuzz {

/// What one call of a parser did with an input.
enum class Verdict { kAccepted = 0, kRefused = 1, kFinding = 2 };

/// Runs the parser calls of one input and classifies each (see Runner::call).
class Runner {
 public:
  /// `locations`: paths (or file names) a refusal's message should name. `rss_growth_mb`: a call
  /// that grows the process's peak resident set by more is a finding (0: not checked). `skip`:
  /// APIs not called (--skip_api).
  Runner(std::vector<std::string> locations, int64_t rss_growth_mb, std::set<std::string> skip)
      : locations_(std::move(locations)), rss_growth_mb_(rss_growth_mb), skip_(std::move(skip)) {}
  /// Runs `body`: returning is an acceptance; a c10::Error or std::exception with a message is a
  /// refusal; anything else is a finding (an exception that is not a std::exception, an empty
  /// message, std::bad_alloc or std::length_error or an allocator's out-of-memory error: an
  /// allocation beyond the memory limit, an internal assertion of this library: one of LibTorch's
  /// own is a refusal, counted apart). Crashes, aborts and hangs are caught by the supervising
  /// process.
  void call(const char* api, const std::function<void()>& body);

  Verdict verdict() const { return verdict_; }
  /// The first refusal's or finding's message, prefixed with the API.
  const std::string& message() const { return message_; }
  /// A short name of the finding ("allocation", "internal-assert", ...), or "".
  const std::string& finding_kind() const { return finding_kind_; }
  /// Whether some refusal's message names none of the locations.
  bool unnamed() const { return unnamed_; }
  const std::string& unnamed_message() const { return unnamed_message_; }
  /// Whether some refusal is an internal assertion of LibTorch itself (e.g. its unpickler's type
  /// checks on a malformed pickle): a refusal with a message, counted apart.
  bool torch_assert() const { return torch_assert_; }

 private:
  void refused(const char* api, const std::string& message);
  void finding(const char* api, const std::string& kind, const std::string& message);
  std::vector<std::string> locations_;
  int64_t rss_growth_mb_ = 0;
  std::set<std::string> skip_;
  Verdict verdict_ = Verdict::kAccepted;
  std::string message_;
  std::string finding_kind_;
  bool unnamed_ = false;
  bool torch_assert_ = false;
  std::string unnamed_message_;
};

class Target {
 public:
  virtual ~Target() = default;
  virtual const char* name() const = 0;
  virtual Format format() const = 0;
  /// The extension of saved inputs (".json", ".safetensors", ".pt").
  virtual const char* extension() const = 0;
  /// Writes the seeds (with the project's writers) and the folders the parsers read under
  /// `work` (an empty folder). `extra_seeds`: more seed files (e.g. written by Python).
  virtual void setup(const std::string& work, const std::vector<std::string>& extra_seeds) = 0;
  /// Puts `input` where the parsers read it and runs them through `runner`. `variant` picks
  /// options (strict or not, ...) deterministically.
  virtual void run(const std::string& input, uint64_t variant, Runner& runner) = 0;
  /// What a refusal should name.
  virtual std::vector<std::string> locations() const = 0;
  /// Hand-made inputs of the bugs tools/fuzz found (after setup): each must be refused, with a
  /// message, without a finding (parser_fuzz --regressions).
  virtual std::vector<std::pair<std::string, std::string>> regressions() const { return {}; }

  const std::vector<Seed>& seeds() const { return seeds_; }
  const std::vector<std::string>& dictionary() const { return dictionary_; }

 protected:
  void add_seed(const std::string& name, std::string bytes);
  std::vector<Seed> seeds_;
  std::vector<std::string> dictionary_;
};

std::vector<std::string> target_names();
/// nullptr for an unknown name.
std::unique_ptr<Target> make_target(const std::string& name);

std::string read_whole_file(const std::string& path);
void write_whole_file(const std::string& path, const std::string& bytes);

}  // namespace fsdp::fuzz
