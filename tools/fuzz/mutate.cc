#include "mutate.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>

#include <caffe2/serialize/inline_container.h>
#include <nlohmann/json.hpp>

namespace fsdp::fuzz {

// ------------------------------------------------------------------------------------------------
// Random numbers

namespace {
uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
}  // namespace

Rng::Rng(uint64_t seed) {
  for (auto& s : s_) s = splitmix64(seed);
}

uint64_t Rng::next() {
  const uint64_t result = rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = rotl(s_[3], 45);
  return result;
}

uint64_t Rng::below(uint64_t n) { return n <= 1 ? 0 : next() % n; }

bool Rng::chance(double p) { return static_cast<double>(next() >> 11) * 0x1.0p-53 < p; }

uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t x = a ^ (b + 0x9e3779b97f4a7c15ULL + (a << 6) + (a >> 2));
  return splitmix64(x);
}

uint64_t hash_text(const std::string& text) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : text) h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

namespace {

// ------------------------------------------------------------------------------------------------
// Interesting values

const std::vector<int64_t> kInterestingInts = {
    0, 1, -1, 2, 3, 7, 8, 15, 16, 31, 63, 64, 127, 128, 255, 256, -128, -129, 1000, 4095, 4096, 32767, 32768,
    65535, 65536, int64_t{1} << 24, std::numeric_limits<int32_t>::max(), int64_t{std::numeric_limits<int32_t>::max()} + 1,
    std::numeric_limits<int32_t>::min(), std::numeric_limits<uint32_t>::max(),
    int64_t{std::numeric_limits<uint32_t>::max()} + 1, int64_t{1} << 40, int64_t{1} << 53, 3037000500,
    int64_t{1} << 62, std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min(),
    std::numeric_limits<int64_t>::max() - 7, std::numeric_limits<int64_t>::min() + 1};

const std::vector<std::string> kInterestingNumbers = {
    "0", "-0", "1", "-1", "2", "3", "7", "8", "16", "63", "64", "65", "255", "256", "4096", "65535", "65536",
    "2147483647", "2147483648", "-2147483648", "-2147483649", "4294967295", "4294967296", "9007199254740993",
    "3037000500", "4611686018427387904", "9223372036854775807", "9223372036854775808", "-9223372036854775808",
    "-9223372036854775809", "18446744073709551615", "18446744073709551616", "123456789012345678901234567890",
    "1e308", "1e309", "-1e309", "1.5", "0.5", "-0.0", "1e-400", "2.0", "1E2", "0x10", "01", "+1", ".5", "1."};

const std::vector<std::string> kJsonTokens = {
    "{", "}", "[", "]", ",", ":", "\"", "null", "true", "false", "0", "-1", "\"\"", "{}", "[]", "[[", "]]", "\\",
    "\"\\u0000\"", "\"\\ud800\"", "\"a\":1", ",\"a\":1", "\"__metadata__\":{}", "1e999", "NaN", "Infinity", "//",
    "/*", "\xff", "\xc0\x80", "\x00", "\t", "\"x\":", ":{}", ",,", "[,]", "{,}"};

const std::vector<std::string> kJsonValues = {
    "null", "true", "false", "0", "-1", "1", "\"\"", "\"x\"", "[]", "{}", "[0]", "[-1]", "[0,0]", "[1,2,3]",
    "{\"a\":1}", "18446744073709551615", "9223372036854775807", "-9223372036854775808", "1e308", "0.5",
    "[18446744073709551615]", "[9223372036854775807,9223372036854775807]", "[\"F32\",[1],[[0,[0],[1]]]]",
    "\"F32\"", "\"BF16\"", "\"BOOL\"", "\"I64\"", "\"U8\"", "\"F8_E4M3\"", "\"C64\"", "\"F4\"", "\"Q4\""};

const std::vector<std::string> kCommonStrings = {
    "", " ", "x", "F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "U16", "U32", "U64", "BOOL", "C64",
    "F8_E4M3", "F8_E5M2", "F4", "f32", "__metadata__", "dtype", "shape", "data_offsets", "FSDP_CRC32C",
    "FSDP_CRC32C_BLOCK", "DCP_SHARDING_INFO", "saved_offsets", "FSDP_DCP_WRITER", "fsdp-dcp", "format", "pt",
    "weight_map", "metadata", "total_size", "model.safetensors", "model-00001-of-00002.safetensors",
    "model.safetensors.index.json", "fsdp_checkpoint.json", ".", "..", "/", "../model.safetensors", "a/../b",
    "x.safetensors", "extra.", "extra.rng", "values", "tensors", "version", "files", "keys", "world_size",
    "00000000", "ffffffff", "0000000g", "-0000001", "+1a2b3c4", " 1a2b3c4", "1a2b3c4d5", "0", "1", "-1", "16",
    "9223372036854775807", "99999999999999999999", "{}", "[]", "{\"a\":[]}", "[\"00000000\"]",
    "{\"w\":{\"saved_offsets\":[0,0]}}", "\xff\xfe", "\xc3\x28", "\xed\xa0\x80", "\x01", "\\"};

// Globals a .pt's pickle may name (module, name).
const std::vector<std::pair<std::string, std::string>> kPickleGlobals = {
    {"torch._utils", "_rebuild_tensor_v2"}, {"torch._utils", "_rebuild_tensor"},
    {"torch._utils", "_rebuild_qtensor"}, {"torch._utils", "_rebuild_sparse_tensor"},
    {"torch._utils", "_rebuild_parameter"}, {"torch._tensor", "_rebuild_from_type_v2"},
    {"collections", "OrderedDict"}, {"torch", "FloatStorage"}, {"torch", "DoubleStorage"},
    {"torch", "LongStorage"}, {"torch", "HalfStorage"}, {"torch", "BFloat16Storage"}, {"torch", "BoolStorage"},
    {"torch", "ByteStorage"}, {"torch", "QInt8Storage"}, {"torch", "ComplexFloatStorage"},
    {"torch", "per_tensor_affine"}, {"torch", "per_channel_affine"}, {"torch", "device"}, {"torch", "Tensor"},
    {"torch", "Nope"}, {"builtins", "complex"}, {"builtins", "set"}, {"torch.jit._pickle", "restore_type_tag"},
    {"torch.jit._pickle", "build_intlist"}, {"torch.jit._pickle", "build_tensorlist"},
    {"torch.jit._pickle", "build_doublelist"}, {"torch.jit._pickle", "build_boollist"},
    {"torch.jit._pickle", "build_tensor_from_id"}, {"__main__", "TensorID"}, {"__main__", "IntList"},
    {"__main__", "Other"}, {"torch.distributed.rpc", "rref"}, {"x", "y"}, {"", ""}};

const std::vector<std::string> kPickleStrings = {
    "storage", "cpu", "cuda", "meta", "cuda:0", "cpu:0", "cpu:-1", "hpu", "xpu", "mps", "lazy", "0", "1", "2", "7",
    "99", "-1", "../0", "data.pkl", "", "Dict[str, Tensor]", "List[int]", "List[Tensor]", "Tuple[int, int]",
    "Dict[str, List[Tuple[int, Tensor]]]", "Tensor", "int", "Optional[int]", "(((((((", "Dict[", "List[List[List[",
    "Future[int]", "Union[int, str]", "__torch__.Foo", "weight", "bias", "fc1.weight", "steps"};

// ------------------------------------------------------------------------------------------------
// Generic byte mutations

std::string random_bytes(Rng& rng, size_t n) {
  std::string out(n, '\0');
  for (auto& c : out) c = static_cast<char>(rng.next() & 0xff);
  return out;
}

std::string int_bytes(uint64_t v, int width, bool big_endian) {
  std::string out(static_cast<size_t>(width), '\0');
  for (int i = 0; i < width; ++i) {
    const int shift = 8 * (big_endian ? width - 1 - i : i);
    out[static_cast<size_t>(i)] = static_cast<char>((v >> shift) & 0xff);
  }
  return out;
}

int64_t interesting_int(Rng& rng) {
  if (rng.chance(0.15)) return static_cast<int64_t>(rng.below(1000)) - 10;
  return rng.pick(kInterestingInts);
}

// One generic mutation of bytes [lo, hi) of `s` (hi may be s.size(): the end may move).
void byte_mutation(std::string& s, size_t lo, size_t hi, const std::vector<std::string>& dictionary, Rng& rng,
                   std::string& what) {
  hi = std::min(hi, s.size());
  lo = std::min(lo, hi);
  const size_t span = hi - lo;
  const auto pos = [&] { return lo + static_cast<size_t>(rng.below(span + 1)); };
  const auto inside = [&] { return lo + static_cast<size_t>(rng.below(std::max<size_t>(span, 1))); };
  switch (rng.below(11)) {
    case 0: {  // bit flips
      if (span == 0) break;
      const int n = 1 + static_cast<int>(rng.below(4));
      for (int i = 0; i < n; ++i) s[inside()] ^= static_cast<char>(1 << rng.below(8));
      what += " flip";
      return;
    }
    case 1: {  // a byte set
      if (span == 0) break;
      static const unsigned char kBytes[] = {0, 1, 0x7f, 0x80, 0xff, ' ', '"', '\\', '{', '[', '-', '9', '\n'};
      s[inside()] = static_cast<char>(rng.chance(0.5) ? kBytes[rng.below(sizeof(kBytes))] : rng.next() & 0xff);
      what += " set-byte";
      return;
    }
    case 2: {  // bytes inserted
      const size_t n = 1 + static_cast<size_t>(rng.below(rng.chance(0.8) ? 8 : 256));
      s.insert(pos(), rng.chance(0.5) ? random_bytes(rng, n) : std::string(n, static_cast<char>(rng.next() & 0xff)));
      what += " insert";
      return;
    }
    case 3: {  // a range deleted
      if (span == 0) break;
      const size_t at = inside();
      const size_t n = 1 + static_cast<size_t>(rng.below(std::min<size_t>(hi - at, rng.chance(0.8) ? 8 : 4096)));
      s.erase(at, n);
      what += " delete";
      return;
    }
    case 4: {  // a range copied elsewhere
      if (span == 0) break;
      const size_t from = inside();
      const size_t n = 1 + static_cast<size_t>(rng.below(std::min<size_t>(hi - from, 64)));
      const std::string chunk = s.substr(from, n);
      s.insert(pos(), chunk);
      what += " duplicate";
      return;
    }
    case 5: {  // truncated
      if (hi != s.size() || span == 0) break;
      s.resize(inside());
      what += " truncate";
      return;
    }
    case 6: {  // an integer written over
      const int width = 1 << rng.below(4);  // 1, 2, 4, 8
      if (span < static_cast<size_t>(width)) break;
      const size_t at = lo + static_cast<size_t>(rng.below(span - width + 1));
      const std::string v = int_bytes(static_cast<uint64_t>(interesting_int(rng)), width, rng.chance(0.2));
      s.replace(at, static_cast<size_t>(width), v);
      what += " int" + std::to_string(width * 8);
      return;
    }
    case 7: {  // garbage appended
      if (hi != s.size()) break;
      s += random_bytes(rng, 1 + static_cast<size_t>(rng.below(64)));
      what += " append";
      return;
    }
    case 8: {  // a dictionary string inserted or written over
      if (dictionary.empty()) break;
      const std::string& word = rng.pick(dictionary);
      const size_t at = pos();
      if (rng.chance(0.5)) {
        s.insert(at, word);
      } else {
        s.replace(at, std::min(word.size(), hi - at), word);
      }
      what += " splice-word";
      return;
    }
    case 9: {  // an arithmetic change to one byte
      if (span == 0) break;
      const size_t at = inside();
      s[at] = static_cast<char>(static_cast<unsigned char>(s[at]) + static_cast<int>(rng.below(35)) - 17);
      what += " arith";
      return;
    }
    default: {  // a run of one byte value
      if (span == 0) break;
      const size_t at = inside();
      const size_t n = std::min<size_t>(hi - at, 1 + static_cast<size_t>(rng.below(32)));
      std::fill_n(s.begin() + static_cast<std::ptrdiff_t>(at), n, static_cast<char>(rng.chance(0.5) ? 0 : 0xff));
      what += " fill";
      return;
    }
  }
  // The chosen mutation did not apply (empty span): insert a byte instead.
  s.insert(pos(), 1, static_cast<char>(rng.next() & 0xff));
  what += " insert1";
}

// ------------------------------------------------------------------------------------------------
// JSON text: tokens and value spans (tolerant of malformed text)

struct Token {
  size_t begin;
  size_t end;
  char kind;  // one of {}[],: or 's' string, 'n' number, 'l' literal, '?' other
};

std::vector<Token> tokenize(const std::string& s, size_t limit = 400000) {
  std::vector<Token> out;
  const size_t n = s.size();
  size_t i = 0;
  while (i < n && out.size() < limit) {
    const char c = s[i];
    if (c == ' ' || c == '\n' || c == '\r' || c == '\t') {
      ++i;
      continue;
    }
    if (std::strchr("{}[],:", c) != nullptr && c != '\0') {
      out.push_back({i, i + 1, c});
      ++i;
    } else if (c == '"') {
      size_t j = i + 1;
      while (j < n && s[j] != '"') j += s[j] == '\\' ? 2 : 1;
      const size_t end = std::min(j + 1, n);
      out.push_back({i, end, 's'});
      i = end;
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      size_t j = i + 1;
      while (j < n && std::strchr("0123456789+-.eE", s[j]) != nullptr && s[j] != '\0') ++j;
      out.push_back({i, j, 'n'});
      i = j;
    } else if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
      size_t j = i + 1;
      while (j < n && ((s[j] >= 'a' && s[j] <= 'z') || (s[j] >= 'A' && s[j] <= 'Z'))) ++j;
      out.push_back({i, j, 'l'});
      i = j;
    } else {
      out.push_back({i, i + 1, '?'});
      ++i;
    }
  }
  return out;
}

bool starts_value(char kind) { return kind == '{' || kind == '[' || kind == 's' || kind == 'n' || kind == 'l'; }

// The index of the last token of the value starting at token k (bracket matching).
size_t value_end(const std::vector<Token>& t, size_t k) {
  if (t[k].kind != '{' && t[k].kind != '[') return k;
  int depth = 0;
  for (size_t i = k; i < t.size(); ++i) {
    if (t[i].kind == '{' || t[i].kind == '[') ++depth;
    if (t[i].kind == '}' || t[i].kind == ']') {
      if (--depth == 0) return i;
    }
  }
  return t.size() - 1;
}

// Tokens that start a value (not a member key).
std::vector<size_t> value_starts(const std::vector<Token>& t) {
  std::vector<size_t> out;
  for (size_t i = 0; i < t.size(); ++i) {
    if (!starts_value(t[i].kind)) continue;
    if (t[i].kind == 's' && i + 1 < t.size() && t[i + 1].kind == ':') continue;
    out.push_back(i);
  }
  return out;
}

std::string quote(const std::string& raw) {
  std::string out = "\"";
  for (char c : raw) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

std::string string_content_variant(const std::string& content, const std::vector<std::string>& dictionary, Rng& rng) {
  switch (rng.below(9)) {
    case 0: return "";
    case 1: return content + content;
    case 2: return content.substr(0, static_cast<size_t>(rng.below(content.size() + 1)));
    case 3: return content + "x";
    case 4: return std::string(1 + static_cast<size_t>(rng.below(rng.chance(0.9) ? 300 : 100000)), 'A');
    case 5: {
      static const std::vector<std::string> kEscapes = {"\\u0000", "\\ud800", "\\udc00", "\\x41", "\\u12", "\\",
                                                        "\\/", "\\n", "\\\"", "\xff", "\xc3\x28", "\x01"};
      return content + rng.pick(kEscapes);
    }
    default:
      if (dictionary.empty()) return content;
      return rng.chance(0.5) ? rng.pick(dictionary) : rng.pick(kCommonStrings);
  }
}

// A JSON value of interesting shape (nlohmann), for semantic mutations.
nlohmann::ordered_json interesting_json(Rng& rng, const std::vector<std::string>& dictionary) {
  using J = nlohmann::ordered_json;
  switch (rng.below(12)) {
    case 0: return J(nullptr);
    case 1: return J(rng.chance(0.5));
    case 2: return J(interesting_int(rng));
    case 3: return J(std::numeric_limits<uint64_t>::max() - rng.below(3));
    case 4: return J(rng.chance(0.5) ? 0.5 : 1e308);
    case 5: return J::array();
    case 6: return J::object();
    case 7: return J(dictionary.empty() ? std::string("x") : rng.pick(dictionary));
    case 8: return J(rng.pick(kCommonStrings));
    case 9: {
      J a = J::array();
      const int n = static_cast<int>(rng.below(4));
      for (int i = 0; i < n; ++i) a.push_back(interesting_int(rng));
      return a;
    }
    case 10: return J(static_cast<uint64_t>(interesting_int(rng)));
    default: return J(-static_cast<int64_t>(rng.below(5)) - 1);
  }
}

bool json_text_mutation(std::string& s, const std::vector<std::string>& dictionary, Rng& rng, std::string& what,
                        int nesting);

// Whether JSON text nests arrays or objects deeper than `limit` (nlohmann's ordered_json copies,
// compares and dumps recursively: the mutator itself must not parse what the parsers refuse).
bool nests_deeper_than(const std::string& text, int limit) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if ((c == '{' || c == '[') && ++depth > limit) {
      return true;
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return false;
}

// Parses `s`, changes one node, dumps it again. False when `s` is not JSON.
bool json_semantic_mutation(std::string& s, const std::vector<std::string>& dictionary, Rng& rng,
                            std::string& what, int nesting) {
  using J = nlohmann::ordered_json;
  if (nests_deeper_than(s, 100)) return false;
  J root = J::parse(s, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return false;
  std::vector<J*> nodes;
  std::vector<J*> todo{&root};
  while (!todo.empty() && nodes.size() < 20000) {
    J* n = todo.back();
    todo.pop_back();
    nodes.push_back(n);
    if (n->is_structured()) {
      for (auto& child : *n) todo.push_back(&child);
    }
  }
  J* node = rng.pick(nodes);
  switch (rng.below(10)) {
    case 0:
    case 1: *node = interesting_json(rng, dictionary); what += " json-set"; break;
    case 2: *node = J(*rng.pick(nodes)); what += " json-copy"; break;
    case 3:
      if (node->is_array()) {
        if (!node->empty() && rng.chance(0.5)) {
          node->erase(node->begin() + static_cast<std::ptrdiff_t>(rng.below(node->size())));
          what += " json-erase-elem";
        } else {
          J copy = node->empty() ? interesting_json(rng, dictionary) : J((*node)[rng.below(node->size())]);
          node->push_back(std::move(copy));
          what += " json-push";
        }
      } else if (node->is_object()) {
        if (!node->empty() && rng.chance(0.5)) {
          auto it = node->begin();
          std::advance(it, static_cast<std::ptrdiff_t>(rng.below(node->size())));
          node->erase(it.key());
          what += " json-erase-key";
        } else {
          const std::string key = rng.chance(0.5) && !dictionary.empty() ? rng.pick(dictionary) : rng.pick(kCommonStrings);
          (*node)[key] = rng.chance(0.5) ? J(*rng.pick(nodes)) : interesting_json(rng, dictionary);
          what += " json-add-key";
        }
      } else {
        *node = interesting_json(rng, dictionary);
        what += " json-set";
      }
      break;
    case 4:
      if (node->is_number_integer() || node->is_number_unsigned()) {
        const int64_t v = node->get<int64_t>();
        static const int64_t kDeltas[] = {1, -1, 2, -2, 8, -8};
        if (rng.chance(0.3)) {
          *node = -v;
        } else if (rng.chance(0.3)) {
          *node = v * 2 + 1;
        } else {
          *node = v + kDeltas[rng.below(6)];
        }
        what += " json-arith";
      } else if (node->is_string()) {
        std::string text = node->get<std::string>();
        // A string holding JSON (checksums, DCP_SHARDING_INFO): mutate the JSON inside.
        if (nesting < 2 && !text.empty() && (text[0] == '{' || text[0] == '[') &&
            json_text_mutation(text, dictionary, rng, what, nesting + 1)) {
          *node = text;
          what += " (nested)";
        } else {
          *node = string_content_variant(text, dictionary, rng);
          what += " json-string";
        }
      } else {
        *node = interesting_json(rng, dictionary);
        what += " json-set";
      }
      break;
    case 5:
      if (node->is_object() && !node->empty()) {  // a key renamed
        auto it = node->begin();
        std::advance(it, static_cast<std::ptrdiff_t>(rng.below(node->size())));
        const std::string old_key = it.key();
        J value = it.value();
        node->erase(old_key);
        (*node)[string_content_variant(old_key, dictionary, rng)] = std::move(value);
        what += " json-rename";
      } else if (node->is_array() && node->size() > 1) {
        std::reverse(node->begin(), node->end());
        what += " json-reverse";
      } else {
        *node = J::array({*node});
        what += " json-wrap";
      }
      break;
    case 6: {  // wrapped in an array or object
      *node = rng.chance(0.5) ? J::array({*node}) : J::object({{"x", *node}});
      what += " json-wrap";
      break;
    }
    case 7:
      if (node->is_string()) {
        std::string text = node->get<std::string>();
        if (nesting < 2 && !text.empty() && (text[0] == '{' || text[0] == '[') &&
            json_semantic_mutation(text, dictionary, rng, what, nesting + 1)) {
          *node = text;
          what += " (nested)";
          break;
        }
      }
      *node = interesting_json(rng, dictionary);
      what += " json-set";
      break;
    default: {
      // One entry duplicated into many (big headers, many keys).
      if (node->is_object() && !node->empty()) {
        const J first = node->begin().value();
        const int n = 1 + static_cast<int>(rng.below(rng.chance(0.9) ? 16 : 2000));
        for (int i = 0; i < n; ++i) (*node)["k" + std::to_string(i)] = first;
        what += " json-many-keys";
      } else if (node->is_array() && !node->empty()) {
        const J first = (*node)[0];
        const int n = 1 + static_cast<int>(rng.below(rng.chance(0.9) ? 16 : 2000));
        for (int i = 0; i < n; ++i) node->push_back(first);
        what += " json-many-elems";
      } else {
        *node = interesting_json(rng, dictionary);
        what += " json-set";
      }
    }
  }
  try {
    s = root.dump(rng.chance(0.2) ? 1 : -1);
  } catch (const std::exception&) {
    return false;  // invalid UTF-8 put in a string: not representable
  }
  return true;
}

bool json_text_mutation(std::string& s, const std::vector<std::string>& dictionary, Rng& rng, std::string& what,
                        int nesting) {
  const std::vector<Token> t = tokenize(s);
  if (t.empty()) return false;
  const auto pick_kind = [&](auto accept) -> std::optional<size_t> {
    std::vector<size_t> found;
    for (size_t i = 0; i < t.size(); ++i) {
      if (accept(i)) found.push_back(i);
    }
    if (found.empty()) return std::nullopt;
    return rng.pick(found);
  };
  switch (rng.below(12)) {
    case 0:
    case 1: {  // a number replaced
      const auto k = pick_kind([&](size_t i) { return t[i].kind == 'n'; });
      if (!k) return false;
      s.replace(t[*k].begin, t[*k].end - t[*k].begin, rng.pick(kInterestingNumbers));
      what += " number";
      return true;
    }
    case 2: {  // a string replaced
      const auto k = pick_kind([&](size_t i) { return t[i].kind == 's'; });
      if (!k) return false;
      const std::string content = s.substr(t[*k].begin + 1, t[*k].end - t[*k].begin - std::min<size_t>(2, t[*k].end - t[*k].begin));
      const std::string v = string_content_variant(content, dictionary, rng);
      s.replace(t[*k].begin, t[*k].end - t[*k].begin, rng.chance(0.7) ? quote(v) : "\"" + v + "\"");
      what += " string";
      return true;
    }
    case 3: {  // a token inserted
      const Token& at = rng.pick(t);
      const size_t pos = rng.chance(0.5) ? at.begin : at.end;
      s.insert(pos, rng.chance(0.8) ? rng.pick(kJsonTokens) : quote(rng.pick(dictionary.empty() ? kCommonStrings : dictionary)));
      what += " token-insert";
      return true;
    }
    case 4: {  // a token deleted
      const Token& at = rng.pick(t);
      s.erase(at.begin, at.end - at.begin);
      what += " token-delete";
      return true;
    }
    case 5: {  // a member or an element duplicated (duplicate keys)
      const auto k = pick_kind([&](size_t i) {
        return (t[i].kind == 's' && i + 2 < t.size() && t[i + 1].kind == ':') ||
               (starts_value(t[i].kind) && i > 0 && (t[i - 1].kind == '[' || t[i - 1].kind == ','));
      });
      if (!k) return false;
      const bool member = t[*k].kind == 's' && *k + 2 < t.size() && t[*k + 1].kind == ':';
      const size_t last = member ? value_end(t, *k + 2) : value_end(t, *k);
      const std::string text = s.substr(t[*k].begin, t[last].end - t[*k].begin);
      const std::string copy = member && rng.chance(0.3) ? text.substr(0, t[*k + 2].begin - t[*k].begin) +
                                                               rng.pick(kJsonValues)
                                                         : text;
      s.insert(t[last].end, "," + copy);
      what += member ? " duplicate-key" : " duplicate-elem";
      return true;
    }
    case 6: {  // a value replaced by another value of the text, or a literal
      const std::vector<size_t> starts = value_starts(t);
      if (starts.empty()) return false;
      const size_t k = rng.pick(starts);
      const size_t last = value_end(t, k);
      std::string with;
      if (rng.chance(0.5)) {
        const size_t o = rng.pick(starts);
        with = s.substr(t[o].begin, t[value_end(t, o)].end - t[o].begin);
      } else {
        with = rng.pick(kJsonValues);
      }
      s.replace(t[k].begin, t[last].end - t[k].begin, with);
      what += " value-replace";
      return true;
    }
    case 7: {  // deep nesting
      const std::vector<size_t> starts = value_starts(t);
      if (starts.empty()) return false;
      const size_t k = rng.pick(starts);
      const size_t last = value_end(t, k);
      static const size_t kDepths[] = {32, 256, 2048, 20000, 200000};
      const size_t depth = kDepths[rng.below(rng.chance(0.7) ? 5 : 3)];
      const bool object = rng.chance(0.3);
      std::string open, close;
      for (size_t i = 0; i < depth; ++i) open += object ? "{\"a\":" : "[";
      if (rng.chance(0.8)) close.assign(depth, object ? '}' : ']');
      s.insert(t[last].end, close);
      s.insert(t[k].begin, open);
      what += " nest" + std::to_string(depth);
      return true;
    }
    case 8: {  // two values swapped
      const std::vector<size_t> starts = value_starts(t);
      if (starts.size() < 2) return false;
      size_t a = rng.pick(starts), b = rng.pick(starts);
      if (a > b) std::swap(a, b);
      const size_t a_last = value_end(t, a);
      if (a == b || b <= a_last) return false;
      const size_t b_last = value_end(t, b);
      const std::string va = s.substr(t[a].begin, t[a_last].end - t[a].begin);
      const std::string vb = s.substr(t[b].begin, t[b_last].end - t[b].begin);
      s.replace(t[b].begin, vb.size(), va);
      s.replace(t[a].begin, va.size(), vb);
      what += " swap";
      return true;
    }
    case 9:
    case 10: return json_semantic_mutation(s, dictionary, rng, what, nesting);
    default: byte_mutation(s, 0, s.size(), dictionary, rng, what); return true;
  }
}

void json_mutation(std::string& s, const std::vector<std::string>& dictionary, Rng& rng, std::string& what) {
  for (int attempt = 0; attempt < 4; ++attempt) {
    if (json_text_mutation(s, dictionary, rng, what, 0)) return;
  }
  byte_mutation(s, 0, s.size(), dictionary, rng, what);
}

// ------------------------------------------------------------------------------------------------
// safetensors: [8-byte little-endian length][JSON header][data]

void safetensors_mutation(std::string& s, const std::vector<std::string>& dictionary, Rng& rng, std::string& what) {
  uint64_t length = 0;
  const bool framed = s.size() >= 8;
  if (framed) {
    for (int b = 7; b >= 0; --b) length = (length << 8) | static_cast<unsigned char>(s[static_cast<size_t>(b)]);
  }
  const bool header_ok = framed && length <= s.size() - 8;
  const uint64_t choice = rng.below(100);
  if (header_ok && choice < 60) {
    std::string header = s.substr(8, length);
    std::string data = s.substr(8 + length);
    json_mutation(header, dictionary, rng, what);
    if (rng.chance(0.5)) header.append((8 - header.size() % 8) % 8, ' ');  // the writer's padding
    uint64_t new_length = header.size();
    if (rng.chance(0.08)) {
      new_length = length;  // the old length kept: the header and the data shift
      what += " stale-length";
    }
    s = int_bytes(new_length, 8, false) + header + data;
    return;
  }
  if (framed && choice < 72) {
    uint64_t v;
    if (rng.chance(0.5)) {
      v = static_cast<uint64_t>(interesting_int(rng));
    } else {
      v = length + static_cast<uint64_t>(static_cast<int64_t>(rng.below(33)) - 16);
    }
    s.replace(0, 8, int_bytes(v, 8, false));
    what += " length";
    return;
  }
  if (header_ok && choice < 87) {
    byte_mutation(s, 8 + length, s.size(), dictionary, rng, what);
    what += " (data)";
    return;
  }
  byte_mutation(s, 0, s.size(), dictionary, rng, what);
}

// ------------------------------------------------------------------------------------------------
// Pickles (data.pkl of a .pt archive)

enum class ArgKind { kNone, kFixed, kLen1, kLen4, kLen8, kLine, kTwoLines, kUnknown };

ArgKind arg_kind(unsigned char op, size_t* fixed) {
  *fixed = 0;
  switch (op) {
    case '(': case '.': case '0': case '1': case '2': case 'N': case 'Q': case 'R': case 'a': case 'b': case 'd':
    case '}': case 'e': case 'l': case ']': case 'o': case 's': case 't': case ')': case 'u': case 0x81: case 0x85:
    case 0x86: case 0x87: case 0x88: case 0x89: case 0x8f: case 0x90: case 0x91: case 0x92: case 0x93: case 0x94:
    case 0x97: case 0x98:
      return ArgKind::kNone;
    case 'F': case 'I': case 'L': case 'P': case 'S': case 'V': case 'g': case 'p': return ArgKind::kLine;
    case 'c': case 'i': return ArgKind::kTwoLines;
    case 'K': case 'h': case 'q': case 0x80: case 0x82: *fixed = 1; return ArgKind::kFixed;
    case 'M': case 0x83: *fixed = 2; return ArgKind::kFixed;
    case 'J': case 'j': case 'r': case 0x84: *fixed = 4; return ArgKind::kFixed;
    case 'G': case 0x95: *fixed = 8; return ArgKind::kFixed;
    case 'U': case 'C': case 0x8a: case 0x8c: return ArgKind::kLen1;
    case 'T': case 'X': case 'B': case 0x8b: return ArgKind::kLen4;
    case 0x8d: case 0x8e: case 0x96: return ArgKind::kLen8;
    default: return ArgKind::kUnknown;
  }
}

struct PickleOp {
  size_t begin;
  size_t end;
  unsigned char code;  // 0 for an unparseable tail
};

std::vector<PickleOp> pickle_ops(const std::string& p) {
  std::vector<PickleOp> ops;
  size_t i = 0;
  while (i < p.size()) {
    const auto code = static_cast<unsigned char>(p[i]);
    size_t fixed = 0;
    size_t end = i + 1;
    switch (arg_kind(code, &fixed)) {
      case ArgKind::kNone: break;
      case ArgKind::kFixed: end += fixed; break;
      case ArgKind::kLine: {
        const size_t nl = p.find('\n', end);
        end = nl == std::string::npos ? p.size() + 1 : nl + 1;
        break;
      }
      case ArgKind::kTwoLines: {
        size_t nl = p.find('\n', end);
        if (nl != std::string::npos) nl = p.find('\n', nl + 1);
        end = nl == std::string::npos ? p.size() + 1 : nl + 1;
        break;
      }
      case ArgKind::kLen1:
      case ArgKind::kLen4:
      case ArgKind::kLen8: {
        const ArgKind k = arg_kind(code, &fixed);
        const size_t width = k == ArgKind::kLen1 ? 1 : k == ArgKind::kLen4 ? 4 : 8;
        if (end + width > p.size()) {
          end = p.size() + 1;
          break;
        }
        uint64_t n = 0;
        for (size_t b = width; b-- > 0;) n = (n << 8) | static_cast<unsigned char>(p[end + b]);
        end = n > p.size() ? p.size() + 1 : end + width + static_cast<size_t>(n);
        break;
      }
      case ArgKind::kUnknown: end = p.size() + 1; break;
    }
    if (end > p.size()) {
      ops.push_back({i, p.size(), 0});
      break;
    }
    ops.push_back({i, end, code});
    i = end;
  }
  return ops;
}

std::string pickle_int(int64_t v, Rng& rng) {
  switch (rng.below(5)) {
    case 0: return "K" + int_bytes(static_cast<uint64_t>(v), 1, false);
    case 1: return "M" + int_bytes(static_cast<uint64_t>(v), 2, false);
    case 2: return "J" + int_bytes(static_cast<uint64_t>(v), 4, false);
    case 3: {
      const size_t width = rng.chance(0.8) ? 8 : static_cast<size_t>(rng.below(10));
      return std::string("\x8a") + static_cast<char>(width) + int_bytes(static_cast<uint64_t>(v), 8, false).substr(0, width) +
             std::string(width > 8 ? width - 8 : 0, '\0');
    }
    default:
      if (v >= 0 && v < 256) return "K" + int_bytes(static_cast<uint64_t>(v), 1, false);
      if (v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max()) {
        return "J" + int_bytes(static_cast<uint64_t>(v), 4, false);
      }
      return std::string("\x8a\x08") + int_bytes(static_cast<uint64_t>(v), 8, false);
  }
}

std::string pickle_string(const std::string& v, Rng& rng) {
  switch (rng.below(8)) {
    case 0: return std::string("\x8c") + static_cast<char>(v.size() & 0xff) + v;
    case 1: return std::string("\x8d") + int_bytes(v.size(), 8, false) + v;
    case 2: return "U" + std::string(1, static_cast<char>(v.size() & 0xff)) + v;
    case 3: return "V" + v + "\n";
    default: return "X" + int_bytes(v.size(), 4, false) + v;
  }
}

std::string random_pickle_op(Rng& rng, const std::vector<std::string>& dictionary) {
  static const std::string kSimple = "(.012NQRabd}el]ostu)\x81\x85\x86\x87\x88\x89\x8f\x90\x91\x92\x93\x94\x97\x98";
  switch (rng.below(10)) {
    case 0:
    case 1: return std::string(1, kSimple[rng.below(kSimple.size())]);
    case 2: return pickle_int(interesting_int(rng), rng);
    case 3: {
      const std::string& w = rng.chance(0.5) || dictionary.empty() ? rng.pick(kPickleStrings) : rng.pick(dictionary);
      return pickle_string(w, rng);
    }
    case 4: {
      const auto& g = rng.pick(kPickleGlobals);
      return "c" + g.first + "\n" + g.second + "\n";
    }
    case 5: {
      static const char kMemo[] = {'h', 'q', 'j', 'r'};
      const char op = kMemo[rng.below(4)];
      const int width = op == 'h' || op == 'q' ? 1 : 4;
      return std::string(1, op) + int_bytes(static_cast<uint64_t>(interesting_int(rng)), width, false);
    }
    case 6: return "G" + random_bytes(rng, 8);
    case 7: return std::string("\x80") + static_cast<char>(rng.chance(0.5) ? 2 : rng.next() & 0xff);
    case 8: {
      static const std::vector<std::string> kLines = {"I1\n", "I-1\n", "I99999999999999999999\n", "L5L\n",
                                                      "F1.5\n", "Pkey\n", "S'x'\n", "g0\n", "p0\n", "I\n"};
      return rng.pick(kLines);
    }
    default: {
      // A length field that lies.
      static const char kLen[] = {'X', 'B', 'T'};
      return std::string(1, kLen[rng.below(3)]) + int_bytes(static_cast<uint64_t>(interesting_int(rng)), 4, false) + "abc";
    }
  }
}

void pickle_mutation(std::string& p, const std::vector<std::string>& dictionary, Rng& rng, std::string& what) {
  const std::vector<PickleOp> ops = pickle_ops(p);
  if (ops.empty() || rng.chance(0.15)) {
    byte_mutation(p, 0, p.size(), dictionary, rng, what);
    what += " (pickle bytes)";
    return;
  }
  const auto replace = [&](const PickleOp& op, const std::string& with) {
    p.replace(op.begin, op.end - op.begin, with);
  };
  const auto pick_code = [&](const std::string& codes) -> const PickleOp* {
    std::vector<const PickleOp*> found;
    for (const auto& op : ops) {
      if (op.code != 0 && codes.find(static_cast<char>(op.code)) != std::string::npos) found.push_back(&op);
    }
    return found.empty() ? nullptr : rng.pick(found);
  };
  switch (rng.below(14)) {
    case 0:
    case 1: {  // an integer changed
      const PickleOp* op = pick_code("KMJ\x8a");
      if (op == nullptr) break;
      replace(*op, pickle_int(interesting_int(rng), rng));
      what += " pickle-int";
      return;
    }
    case 2: {  // a string changed
      const PickleOp* op = pick_code("XTUBC\x8c\x8d");
      if (op == nullptr) break;
      std::string content;
      size_t fixed = 0;
      const ArgKind k = arg_kind(op->code, &fixed);
      const size_t width = k == ArgKind::kLen1 ? 1 : k == ArgKind::kLen4 ? 4 : 8;
      if (op->end > op->begin + 1 + width) content = p.substr(op->begin + 1 + width, op->end - op->begin - 1 - width);
      std::vector<std::string> words = kPickleStrings;
      words.insert(words.end(), dictionary.begin(), dictionary.end());
      replace(*op, pickle_string(rng.chance(0.7) ? rng.pick(words) : string_content_variant(content, words, rng), rng));
      what += " pickle-string";
      return;
    }
    case 3: {  // a length field lies
      const PickleOp* op = pick_code("XTUBC\x8a\x8b\x8c\x8d\x8e\x96");
      if (op == nullptr) break;
      size_t fixed = 0;
      const ArgKind k = arg_kind(op->code, &fixed);
      const int width = k == ArgKind::kLen1 ? 1 : k == ArgKind::kLen4 ? 4 : 8;
      const uint64_t remaining = p.size() - op->begin;
      static const uint64_t kLies[] = {0, 1, 7, 9, 0x7fffffffULL, 0xffffffffULL, 0x7fffffffffffffffULL,
                                       0xffffffffffffffffULL, 1ULL << 32, 1ULL << 40};
      const uint64_t v = rng.chance(0.3) ? remaining + rng.below(3) : kLies[rng.below(10)];
      p.replace(op->begin + 1, static_cast<size_t>(width), int_bytes(v, width, false));
      what += " pickle-length";
      return;
    }
    case 4: {  // a memo index changed
      const PickleOp* op = pick_code("hjqr");
      if (op == nullptr) break;
      const int width = op->code == 'h' || op->code == 'q' ? 1 : 4;
      p.replace(op->begin + 1, static_cast<size_t>(width),
                int_bytes(static_cast<uint64_t>(interesting_int(rng)), width, false));
      what += " pickle-memo";
      return;
    }
    case 5: {  // a global changed
      const PickleOp* op = pick_code("c");
      if (op == nullptr) break;
      const auto& g = rng.pick(kPickleGlobals);
      replace(*op, "c" + g.first + "\n" + g.second + "\n");
      what += " pickle-global";
      return;
    }
    case 6: {  // an opcode deleted
      const PickleOp& op = rng.pick(ops);
      p.erase(op.begin, op.end - op.begin);
      what += " pickle-delete";
      return;
    }
    case 7: {  // an opcode duplicated
      const PickleOp& op = rng.pick(ops);
      p.insert(op.end, p.substr(op.begin, op.end - op.begin));
      what += " pickle-dup";
      return;
    }
    case 8: {  // an opcode moved
      const PickleOp& op = rng.pick(ops);
      const std::string text = p.substr(op.begin, op.end - op.begin);
      p.erase(op.begin, text.size());
      const std::vector<PickleOp> after = pickle_ops(p);
      const size_t at = after.empty() ? 0 : rng.pick(after).begin;
      p.insert(std::min(at, p.size()), text);
      what += " pickle-move";
      return;
    }
    case 9:
    case 10: {  // a random opcode inserted
      const PickleOp& op = rng.pick(ops);
      p.insert(rng.chance(0.5) ? op.begin : op.end, random_pickle_op(rng, dictionary));
      what += " pickle-insert";
      return;
    }
    case 11: {  // truncated at an opcode, or the STOP removed
      const PickleOp& op = rng.pick(ops);
      p.resize(op.begin);
      what += " pickle-truncate";
      return;
    }
    case 12: {  // deep nesting: TUPLE1 chains, or lists nested in lists
      static const size_t kDepths[] = {100, 2000, 100000, 1000000};
      const size_t depth = kDepths[rng.below(4)];
      const PickleOp& op = rng.pick(ops);
      std::string nest;
      if (rng.chance(0.5)) {
        nest.assign(depth, '\x85');  // wraps the value on top of the stack in a tuple, depth times
      } else {
        nest.reserve(3 * depth);
        for (size_t i = 0; i < depth; ++i) nest += "](";
        nest.append(depth, 'e');
      }
      p.insert(op.end, nest);
      what += " pickle-nest" + std::to_string(depth);
      return;
    }
    default: {  // two opcodes swapped
      if (ops.size() < 2) break;
      size_t a = rng.below(ops.size()), b = rng.below(ops.size());
      if (a == b) break;
      if (a > b) std::swap(a, b);
      const std::string ta = p.substr(ops[a].begin, ops[a].end - ops[a].begin);
      const std::string tb = p.substr(ops[b].begin, ops[b].end - ops[b].begin);
      p.replace(ops[b].begin, tb.size(), ta);
      p.replace(ops[a].begin, ta.size(), tb);
      what += " pickle-swap";
      return;
    }
  }
  byte_mutation(p, 0, p.size(), dictionary, rng, what);
  what += " (pickle bytes)";
}

// ------------------------------------------------------------------------------------------------
// .pt archives

// A read adapter over a string for PyTorchStreamReader.
class StringReadAdapter final : public caffe2::serialize::ReadAdapterInterface {
 public:
  explicit StringReadAdapter(const std::string& data) : data_(data) {}
  size_t size() const override { return data_.size(); }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/) const override {
    if (pos >= data_.size()) return 0;
    n = std::min<size_t>(n, data_.size() - static_cast<size_t>(pos));
    std::memcpy(buf, data_.data() + pos, n);
    return n;
  }

 private:
  const std::string& data_;
};

void archive_mutation(PtArchive& a, const std::vector<std::string>& dictionary, Rng& rng, std::string& what) {
  const auto find = [&](const std::string& name) -> std::string* {
    for (auto& [n, data] : a.records) {
      if (n == name) return &data;
    }
    return nullptr;
  };
  std::vector<size_t> storages;
  for (size_t i = 0; i < a.records.size(); ++i) {
    if (a.records[i].first.rfind("data/", 0) == 0) storages.push_back(i);
  }
  const uint64_t choice = rng.below(100);
  std::string* pickle = find("data.pkl");
  if (pickle != nullptr && choice < 72) {
    pickle_mutation(*pickle, dictionary, rng, what);
    return;
  }
  if (!storages.empty() && choice < 86) {
    std::string& data = a.records[rng.pick(storages)].second;
    switch (rng.below(3)) {
      case 0: data.resize(static_cast<size_t>(rng.below(data.size() + 1))); what += " record-truncate"; return;
      case 1: data.append(1 + static_cast<size_t>(rng.below(64)), '\0'); what += " record-extend"; return;
      default: byte_mutation(data, 0, data.size(), dictionary, rng, what); what += " (record)"; return;
    }
  }
  if (choice < 94 && !a.records.empty()) {
    const size_t i = rng.below(a.records.size());
    switch (rng.below(3)) {
      case 0: a.records.erase(a.records.begin() + static_cast<std::ptrdiff_t>(i)); what += " record-drop"; return;
      case 1: a.records[i].first = "data/" + std::to_string(rng.below(12)); what += " record-rename"; return;
      default:
        a.records.emplace_back("data/" + std::to_string(50 + rng.below(50)), random_bytes(rng, rng.below(64)));
        what += " record-add";
        return;
    }
  }
  static const uint64_t kVersions[] = {0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 20, 99, 1ULL << 32, 1ULL << 63};
  a.version = kVersions[rng.below(17)];
  for (auto& [name, data] : a.records) {
    if (name == ".data/version" || name == "version") {
      data = rng.chance(0.7) ? std::to_string(a.version) + "\n" : rng.pick(kCommonStrings);
    }
  }
  what += " version";
}

}  // namespace

PtArchive read_pt_archive(const std::string& bytes) {
  PtArchive out;
  try {
    caffe2::serialize::PyTorchStreamReader reader(std::make_shared<StringReadAdapter>(bytes));
    out.version = reader.version();
    for (const auto& name : reader.getAllRecords()) {
      auto [data, size] = reader.getRecord(name);
      out.records.emplace_back(name, std::string(static_cast<const char*>(data.get()), size));
    }
    out.valid = true;
  } catch (const std::exception&) {
    out.records.clear();
    out.valid = false;
  }
  return out;
}

std::string write_pt_archive(const PtArchive& archive) {
  for (const bool keep_version : {true, false}) {
    std::string out;
    try {
      caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t size) {
        out.append(static_cast<const char*>(data), size);
        return size;
      });
      if (archive.version > 0 && archive.version < (uint64_t{1} << 62)) writer.setMinVersion(archive.version);
      for (const auto& [name, data] : archive.records) {
        if (name == ".data/serialization_id") continue;
        if (!keep_version && (name == ".data/version" || name == "version")) continue;
        writer.writeRecord(name, data.data(), data.size());
      }
      writer.writeEndOfFile();
      return out;
    } catch (const std::exception&) {
      // e.g. a version record the writer also writes: again without it.
    }
  }
  return std::string();
}

std::vector<std::string> json_strings(const std::string& text) {
  std::vector<std::string> out;
  for (const Token& t : tokenize(text)) {
    if (t.kind == 's' && t.end >= t.begin + 2) out.push_back(text.substr(t.begin + 1, t.end - t.begin - 2));
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::string mutate(const std::vector<Seed>& seeds, Format format, const std::vector<std::string>& dictionary,
                   Rng& rng, std::string* description) {
  const Seed& seed = seeds[rng.below(seeds.size())];
  std::string what = "seed '" + seed.name + "':";
  int count = 1;
  while (count < 8 && rng.chance(0.45)) ++count;
  std::string s;
  if (format == Format::kPtArchive && seed.archive.valid && rng.chance(0.85)) {
    PtArchive a = seed.archive;
    for (int i = 0; i < count; ++i) archive_mutation(a, dictionary, rng, what);
    s = write_pt_archive(a);
    if (rng.chance(0.1)) {
      byte_mutation(s, 0, s.size(), dictionary, rng, what);
      what += " (zip bytes)";
    }
  } else {
    s = seed.bytes;
    for (int i = 0; i < count; ++i) {
      switch (format) {
        case Format::kJson: json_mutation(s, dictionary, rng, what); break;
        case Format::kSafetensors: safetensors_mutation(s, dictionary, rng, what); break;
        case Format::kPtArchive:
          byte_mutation(s, 0, s.size(), dictionary, rng, what);
          what += " (zip bytes)";
          break;
      }
    }
  }
  if (description != nullptr) *description = what;
  return s;
}

}  // namespace fsdp::fuzz
