#pragma once
// Token files: a tokenized corpus on disk, read through a read-only memory mapping (never read
// whole), for next-token training (data/token_dataset.h). tools/tokenize_text.py writes them from
// text files with a Hugging Face tokenizer; write_token_file writes them from C++.
//
//   fsdp::data::TokenFile file("examples/data/corpus.tokens");   // header and size validated
//   file.num_tokens();  file.vocab_size();  file.eot_id();
//   at::Tensor t = file.read(0, 65);                              // int64 [65]
//   file.check_tokens();                                          // optional: every id < vocab
//
// [Note: token file format] Little-endian, a 32-byte header then the tokens:
//   bytes 0-7    magic "FSDPTOK" and a zero byte
//   bytes 8-11   uint32 version, 1
//   bytes 12-15  uint32 token width in bytes: 2 (uint16 tokens) or 4 (uint32 tokens)
//   bytes 16-19  uint32 end-of-text id (< vocabulary size): separates documents
//   bytes 20-23  uint32 vocabulary size (> 0; at most 65536 with 2-byte tokens)
//   bytes 24-31  uint64 token count
//   bytes 32-    the tokens, count * width bytes; the file is exactly 32 + count * width bytes
// Documents are concatenated with the end-of-text id between them (tools/tokenize_text.py puts it
// between documents, none before the first or after the last). The tokens start at byte 32, so
// they are aligned for their width in the mapping.
//
// Opening validates the header and the size, each failure a c10::Error naming the file, what was
// expected and what was found (bad magic, unknown version, unknown width, a vocabulary that does
// not fit the width, an end-of-text id outside the vocabulary, a file shorter or longer than
// header + count * width). Whether every token is below the vocabulary size is checked only on
// request (check_tokens, or TokenFileOptions::check_tokens), since it reads the whole file.
//
// The file must not be truncated or rewritten while it is open (the mapping would fault, SIGBUS):
// write a new file and rename it over the old one instead (rename leaves open mappings intact).

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace fsdp::data {

inline constexpr std::array<char, 8> kTokenFileMagic = {'F', 'S', 'D', 'P', 'T', 'O', 'K', '\0'};
inline constexpr uint32_t kTokenFileVersion = 1;
inline constexpr int64_t kTokenFileHeaderBytes = 32;

/// The header's values ([Note: token file format]).
struct TokenFileHeader {
  uint32_t version = kTokenFileVersion;
  uint32_t token_bytes = 2;
  uint32_t eot_id = 0;
  uint32_t vocab_size = 0;
  uint64_t num_tokens = 0;
};

struct TokenFileOptions {
  /// Also check every token against the vocabulary size at open (reads the whole file once).
  bool check_tokens = false;
};

/// A token file mapped read-only. Move-only; the mapping lives until destruction. const methods
/// are safe to call from several threads.
class TokenFile {
 public:
  /// Opens and validates `path` (see the top of this file); c10::Error naming the file otherwise.
  explicit TokenFile(std::string path, TokenFileOptions options = {});
  ~TokenFile();
  TokenFile(TokenFile&& other) noexcept;
  TokenFile& operator=(TokenFile&& other) noexcept;
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  const std::string& path() const { return path_; }
  const TokenFileHeader& header() const { return header_; }
  int64_t num_tokens() const { return static_cast<int64_t>(header_.num_tokens); }
  int64_t vocab_size() const { return header_.vocab_size; }
  int64_t eot_id() const { return header_.eot_id; }
  int token_bytes() const { return static_cast<int>(header_.token_bytes); }

  /// Token `i` (0 <= i < num_tokens(), checked).
  int64_t token(int64_t i) const;
  /// Tokens [start, start + count) as int64 [count] (a new CPU tensor; the range is checked).
  at::Tensor read(int64_t start, int64_t count) const;
  /// Copies tokens [start, start + count) into `out` (int64, count elements; the range is checked).
  void read_into(int64_t start, int64_t count, int64_t* out) const;
  /// Reads every token: the first that is >= vocab_size() is a c10::Error naming the file, the
  /// token, its index and the vocabulary size.
  void check_tokens() const;
  /// 64-bit FNV-1a of the header and of the token bytes: all of them up to 1 MiB, else 64 blocks
  /// of 16 KiB spread evenly over them (first and last included). Identifies the file in a
  /// dataset's state (a file changed only between the sampled blocks is not told apart).
  uint64_t fingerprint() const;

 private:
  void unmap() noexcept;
  std::string path_;
  TokenFileHeader header_;
  const unsigned char* map_ = nullptr;  // the whole file
  int64_t map_bytes_ = 0;
};

/// Writes a token file: `tokens` (each in [0, vocab_size)) with the given header values.
/// `token_bytes` 0 picks 2 when vocab_size <= 65536, else 4. Writes to a temporary file beside
/// `path` and renames it over `path`. c10::Error naming the file on an invalid argument or I/O error.
void write_token_file(const std::string& path, const std::vector<int64_t>& tokens, int64_t vocab_size,
                      int64_t eot_id, int token_bytes = 0);

/// The header as its 32 bytes (little-endian), e.g. to build a file by hand.
std::array<unsigned char, kTokenFileHeaderBytes> encode_token_file_header(const TokenFileHeader& header);

}  // namespace fsdp::data
