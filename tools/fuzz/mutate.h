#pragma once
// Deterministic mutations of parser inputs (see tools/fuzz/README.md): a seeded PRNG, generic byte
// mutations, and format-aware ones for JSON text, safetensors files (8-byte length, JSON header,
// data) and .pt archives (a zip of data.pkl and storage records: pickle opcodes are mutated, then
// the archive is written again so that its directory and sizes stay consistent).
//
// Everything is a pure function of (seed bytes, Rng state): input i of a run is rebuilt from the
// run's seed and i alone, which is what the reproducer commands rely on.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::fuzz {

/// xoshiro256** seeded through splitmix64.
class Rng {
 public:
  explicit Rng(uint64_t seed);
  uint64_t next();
  /// Uniform in [0, n); n > 0.
  uint64_t below(uint64_t n);
  bool chance(double p);
  template <typename T>
  const T& pick(const std::vector<T>& v) {
    return v[below(v.size())];
  }

 private:
  uint64_t s_[4];
};

/// A hash combination of two 64-bit values (splitmix64 of their mix).
uint64_t mix(uint64_t a, uint64_t b);
uint64_t hash_text(const std::string& text);

enum class Format { kJson, kSafetensors, kPtArchive };

/// The records of a .pt archive (names without the archive's folder prefix, e.g. "data.pkl",
/// "data/0", ".data/version"), in the order the archive lists them.
struct PtArchive {
  std::vector<std::pair<std::string, std::string>> records;
  uint64_t version = 0;
  bool valid = false;
};

/// Reads a .pt archive from memory (valid = false when it cannot be read).
PtArchive read_pt_archive(const std::string& bytes);
/// Writes the records as a zip archive the way torch::pickle_save and torch.save do (stored,
/// 64-byte aligned). Records the writer adds itself (version, serialization id) are skipped.
std::string write_pt_archive(const PtArchive& archive);

struct Seed {
  std::string name;   // for reports
  std::string bytes;
  PtArchive archive;  // Format::kPtArchive only
};

/// One mutated input: a seed of `seeds` chosen by `rng`, with one or more stacked mutations.
/// `dictionary`: strings to splice (keys, dtype names, file names of the target).
std::string mutate(const std::vector<Seed>& seeds, Format format, const std::vector<std::string>& dictionary,
                   Rng& rng, std::string* description);

/// Every JSON string token of `text` (unescaped naively), for dictionaries.
std::vector<std::string> json_strings(const std::string& text);

}  // namespace fsdp::fuzz
