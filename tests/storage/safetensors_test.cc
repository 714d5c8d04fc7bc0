// safetensors: round trips of every dtype (0-d, empty, non-contiguous tensors, metadata), the file's
// bytes and checksums against an independent parse (nlohmann and a bit-by-bit CRC-32C over the raw file), partial and
// concurrent reads, corruption and malformed headers refused with messages naming file and key,
// and files written by Python (the `safetensors` package and torch.distributed.checkpoint).
#include "fsdp_cpp/storage/safetensors.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/view_as_complex.h>
#include <ATen/ops/view_as_real.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <nlohmann/json.hpp>

// Last: LibTorch's c10/util/Logging.h defines its own CHECK, and the last definition wins.
#include <catch2/catch.hpp>

namespace storage = fsdp::storage;
namespace fs = std::filesystem;
using Catch::Matchers::Contains;
using storage::SafetensorsFile;
using storage::SafetensorsItem;

namespace {

std::string scratch(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  const fs::path dir = fs::path(base ? base : "/tmp") / ("safetensors_test." + std::to_string(::getpid())) / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void spit(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

// A safetensors file from a header text given verbatim and raw data bytes.
std::string raw_file(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int b = 0; b < 8; ++b) out[b] = static_cast<char>((n >> (8 * b)) & 0xff);
  return out + header + data;
}

// The raw file split by hand: header JSON and data section.
struct RawFile {
  nlohmann::json header;
  uint64_t header_length = 0;
  std::string data;
};

RawFile parse_raw(const std::string& path) {
  const std::string bytes = slurp(path);
  RawFile raw;
  REQUIRE(bytes.size() >= 8);
  for (int b = 7; b >= 0; --b) raw.header_length = (raw.header_length << 8) | static_cast<unsigned char>(bytes[b]);
  REQUIRE(bytes.size() >= 8 + raw.header_length);
  raw.header = nlohmann::json::parse(bytes.substr(8, raw.header_length));
  raw.data = bytes.substr(8 + raw.header_length);
  return raw;
}

std::string bytes_of(const at::Tensor& t) {
  const auto c = t.contiguous();
  return std::string(static_cast<const char*>(c.const_data_ptr()), c.numel() * c.element_size());
}

// One tensor per dtype with closed-form values (arange-based), shapes of every rank.
std::vector<SafetensorsItem> every_dtype() {
  std::vector<SafetensorsItem> items;
  const std::vector<std::pair<c10::ScalarType, std::vector<int64_t>>> specs = {
      {at::kDouble, {5}},       {at::kFloat, {3, 4}},        {at::kHalf, {2, 3}},
      {at::kBFloat16, {2, 2, 2}}, {at::kLong, {3, 2}},       {at::kInt, {7}},
      {at::kShort, {4, 1}},     {at::kChar, {5}},            {at::kByte, {9}},
      {at::kBool, {6}},         {at::kUInt16, {3}},          {at::kUInt32, {2, 2}},
      {at::kUInt64, {2}},       {at::kFloat8_e4m3fn, {4}},   {at::kFloat8_e5m2, {4}},
  };
  for (const auto& [dtype, shape] : specs) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    at::Tensor values = at::arange(n, at::kDouble);
    if (dtype == at::kBool) {
      values = values.remainder(3).eq(0);
    } else if (at::isFloatingType(dtype)) {
      values = values * 0.5 - 1.0;
    } else if (dtype == at::kChar || dtype == at::kShort || dtype == at::kInt || dtype == at::kLong) {
      values = values * 3 - 5;
    } else {
      values = values * 7;
    }
    items.push_back({std::string("t_") + c10::toString(dtype), values.to(dtype).reshape(shape)});
  }
  items.push_back({"complex", at::arange(6, at::kFloat).reshape({3, 2})});
  items.back().tensor = at::view_as_complex(items.back().tensor);
  items.push_back({"scalar_f32", at::scalar_tensor(2.5, at::kFloat)});
  items.push_back({"scalar_i64", at::scalar_tensor(-42, at::kLong)});
  items.push_back({"empty_f32", at::zeros({0, 3}, at::kFloat)});
  items.push_back({"empty_bf16", at::zeros({0}, at::kBFloat16)});
  return items;
}

// CRC-32C bit by bit, straight from the definition (reflected polynomial 0x82F63B78): the
// reference the library's table and instruction paths are checked against.
uint32_t reference_crc32c(const unsigned char* p, size_t n) {
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ ((c & 1u) ? 0x82F63B78u : 0u);
  }
  return ~c;
}

std::vector<uint32_t> reference_block_crcs(const std::string& bytes, size_t block) {
  std::vector<uint32_t> out;
  for (size_t at = 0; at < bytes.size(); at += block) {
    const size_t n = std::min(block, bytes.size() - at);
    out.push_back(reference_crc32c(reinterpret_cast<const unsigned char*>(bytes.data() + at), n));
  }
  return out;
}

}  // namespace

TEST_CASE("dtype names follow the safetensors specification", "[storage][safetensors]") {
  CHECK(storage::safetensors_dtype_name(at::kFloat) == "F32");
  CHECK(storage::safetensors_dtype_name(at::kBFloat16) == "BF16");
  CHECK(storage::safetensors_dtype_name(at::kBool) == "BOOL");
  CHECK(storage::safetensors_dtype_name(at::kByte) == "U8");
  CHECK(storage::safetensors_dtype_name(at::kChar) == "I8");
  CHECK(storage::safetensors_dtype_name(at::kFloat8_e4m3fn) == "F8_E4M3");
  CHECK(storage::scalar_type_from_safetensors("F16", "ctx") == at::kHalf);
  CHECK(storage::scalar_type_from_safetensors("I64", "ctx") == at::kLong);
  REQUIRE_THROWS_WITH(storage::safetensors_dtype_name(at::kComplexDouble), Contains("ComplexDouble"));
  REQUIRE_THROWS_WITH(storage::scalar_type_from_safetensors("F4", "file 'x' entry 'w'"),
                      Contains("'F4'") && Contains("file 'x' entry 'w'"));
}

TEST_CASE("every dtype round-trips, with the bytes and checksums of the raw file", "[storage][safetensors]") {
  const auto dir = scratch("every_dtype");
  const auto path = dir + "/all.safetensors";
  const auto items = every_dtype();
  const std::map<std::string, std::string> metadata{{"format", "pt"}, {"step", "100"}};
  storage::write_safetensors(path, items, metadata, /*crc_block_bytes=*/8);

  // Independent parse of the raw bytes.
  const RawFile raw = parse_raw(path);
  CHECK((8 + raw.header_length) % 8 == 0);
  int64_t offset = 0;
  for (const auto& item : items) {
    INFO(item.key);
    const auto& h = raw.header.at(item.key);
    CHECK(h.at("dtype") == storage::safetensors_dtype_name(item.tensor.scalar_type()));
    CHECK(h.at("shape").get<std::vector<int64_t>>() == item.tensor.sizes().vec());
    const int64_t nbytes = item.tensor.numel() * item.tensor.element_size();
    CHECK(h.at("data_offsets") == nlohmann::json::array({offset, offset + nbytes}));
    CHECK(raw.data.substr(offset, nbytes) == bytes_of(item.tensor));
    offset += nbytes;
  }
  CHECK(static_cast<int64_t>(raw.data.size()) == offset);
  const auto& meta = raw.header.at("__metadata__");
  CHECK(meta.at("format") == "pt");
  CHECK(meta.at("step") == "100");
  CHECK(meta.at(storage::kCrcBlockKey) == "8");
  const auto crcs = nlohmann::json::parse(meta.at(storage::kCrcKey).get<std::string>());
  for (const auto& item : items) {
    INFO(item.key);
    std::vector<std::string> expected;
    for (uint32_t c : reference_block_crcs(bytes_of(item.tensor), 8)) {
      char hex[9];
      std::snprintf(hex, sizeof(hex), "%08x", c);
      expected.push_back(hex);
    }
    CHECK(crcs.at(item.key).get<std::vector<std::string>>() == expected);
  }

  // Reader.
  SafetensorsFile file(path);
  const auto& header = file.header();
  CHECK(header.path == path);
  CHECK(header.metadata == metadata);  // checksum keys removed
  CHECK(header.crc_block_bytes == 8);
  CHECK(header.data_start == 8 + static_cast<int64_t>(raw.header_length));
  CHECK(header.data_size == offset);
  REQUIRE(header.entries.size() == items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const auto& item = items[i];
    INFO(item.key);
    const auto& e = header.at(item.key);
    CHECK(&e == &header.entries[i]);  // data order
    CHECK(e.dtype == item.tensor.scalar_type());
    CHECK(e.shape == item.tensor.sizes().vec());
    CHECK(e.numel() == item.tensor.numel());
    CHECK(e.crc32c == reference_block_crcs(bytes_of(item.tensor), 8));
    const auto t = file.read_tensor(e);
    CHECK(t.device().is_cpu());
    CHECK(t.scalar_type() == item.tensor.scalar_type());
    CHECK(t.sizes() == item.tensor.sizes());
    CHECK(bytes_of(t) == bytes_of(item.tensor));
    file.verify(e, 0, e.nbytes());
  }
  CHECK(header.find("missing") == nullptr);
  REQUIRE_THROWS_WITH(header.at("missing"), Contains(path) && Contains("'missing'"));
}

TEST_CASE("non-contiguous tensors are written row-major", "[storage][safetensors]") {
  const auto dir = scratch("non_contiguous");
  const auto path = dir + "/nc.safetensors";
  const auto base = at::arange(24, at::kFloat).reshape({4, 6});
  const auto transposed = base.t();                                 // [6, 4], strides (1, 6)
  const auto strided = base.slice(1, 1, 6, 2);                      // [4, 3], every other column
  const auto expanded = at::arange(3, at::kLong).unsqueeze(0).expand({2, 3});  // stride 0
  storage::write_safetensors(path, {{"t", transposed}, {"s", strided}, {"e", expanded}});
  SafetensorsFile file(path);
  // Independent expected values, element by element.
  const auto t = file.read_tensor(file.header().at("t"));
  const auto s = file.read_tensor(file.header().at("s"));
  const auto e = file.read_tensor(file.header().at("e"));
  REQUIRE(t.sizes() == at::IntArrayRef{6, 4});
  REQUIRE(s.sizes() == at::IntArrayRef{4, 3});
  const float* tp = t.const_data_ptr<float>();
  const float* sp = s.const_data_ptr<float>();
  for (int i = 0; i < 6; ++i) {
    for (int j = 0; j < 4; ++j) CHECK(tp[i * 4 + j] == static_cast<float>(j * 6 + i));
  }
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 3; ++j) CHECK(sp[i * 3 + j] == static_cast<float>(i * 6 + 1 + 2 * j));
  }
  CHECK(at::equal(e, at::arange(6, at::kLong).remainder(3).reshape({2, 3})));
  for (const auto& entry : file.header().entries) file.verify(entry, 0, entry.nbytes());
}

TEST_CASE("an entry spanning several checksum blocks: partial reads and verification", "[storage][safetensors]") {
  const auto dir = scratch("blocks");
  const auto path = dir + "/blocks.safetensors";
  // "a": 12 bytes (one 16-byte block, short); "b": 400 bytes = 25 blocks; "c": 64 bytes = 4 blocks.
  const auto a = at::arange(3, at::kFloat);
  const auto b = at::arange(100, at::kInt) * 11;
  const auto c = at::arange(8, at::kDouble) / 3;
  storage::write_safetensors(path, {{"a", a}, {"b", b}, {"c", c}}, {}, /*crc_block_bytes=*/16);
  SafetensorsFile file(path);
  const auto& eb = file.header().at("b");
  REQUIRE(eb.crc32c.size() == 25);
  CHECK(file.header().at("a").crc32c.size() == 1);
  CHECK(file.header().at("c").crc32c.size() == 4);
  CHECK(eb.crc32c == reference_block_crcs(bytes_of(b), 16));

  // Partial reads: elements [37, 61) of b.
  std::vector<int32_t> part(24);
  file.read(eb, 37 * 4, 61 * 4, part.data());
  for (int i = 0; i < 24; ++i) CHECK(part[i] == (37 + i) * 11);
  file.verify(eb, 37 * 4, 61 * 4);
  file.verify(eb, 0, 0);  // empty range: nothing to check

  // Flip one byte in block 7 of "b" (entry bytes [112, 128)).
  std::string bytes = slurp(path);
  const int64_t flipped = file.header().data_start + eb.data_begin + 7 * 16 + 5;
  bytes[flipped] = static_cast<char>(bytes[flipped] ^ 0x40);
  spit(path, bytes);
  SafetensorsFile corrupt(path);  // the header is intact
  const auto& cb = corrupt.header().at("b");
  REQUIRE_THROWS_WITH(corrupt.verify(cb, 0, cb.nbytes()),
                      Contains(path) && Contains("entry 'b'") && Contains("block 7") && Contains("mismatch"));
  REQUIRE_THROWS_WITH(corrupt.verify(cb, 127, 128), Contains("block 7"));
  corrupt.verify(cb, 0, 112);              // blocks 0..6 are intact
  corrupt.verify(cb, 128, cb.nbytes());    // so are blocks 8..24
  corrupt.verify(corrupt.header().at("a"), 0, 12);
  corrupt.verify(corrupt.header().at("c"), 0, 64);
  REQUIRE_THROWS_WITH(corrupt.verify(cb, 0, 401), Contains("outside entry 'b'"));
  REQUIRE_THROWS_WITH(corrupt.read(cb, 396, 404, part.data()), Contains("outside entry 'b'") && Contains(path));
}

TEST_CASE("large entries with the default block size and concurrent reads", "[storage][safetensors]") {
  const auto dir = scratch("large");
  const auto path = dir + "/large.safetensors";
  // 40 MiB: several write chunks and ten 4 MiB checksum blocks.
  const auto big = at::arange(int64_t{10} << 20, at::kInt);
  const auto small = at::randn({1000}, at::kFloat);
  storage::write_safetensors(path, {{"small", small}, {"big", big}});
  SafetensorsFile file(path);
  const auto& eb = file.header().at("big");
  CHECK(file.header().crc_block_bytes == storage::kDefaultCrcBlockBytes);
  CHECK(eb.crc32c == reference_block_crcs(bytes_of(big), storage::kDefaultCrcBlockBytes));
  file.verify(eb, 0, eb.nbytes());

  // Eight threads read interleaved slices of "big"; assertions on the main thread.
  constexpr int kThreads = 8;
  constexpr int64_t kSlice = int64_t{1} << 17;  // elements
  std::atomic<int64_t> mismatches{0};
  std::vector<std::thread> threads;
  std::vector<std::string> errors(kThreads);
  for (int w = 0; w < kThreads; ++w) {
    threads.emplace_back([&, w] {
      try {
        std::vector<int32_t> buffer(kSlice);
        for (int64_t s = w; s * kSlice < big.numel(); s += kThreads) {
          file.read(eb, s * kSlice * 4, (s + 1) * kSlice * 4, buffer.data());
          for (int64_t i = 0; i < kSlice; ++i) {
            if (buffer[i] != static_cast<int32_t>(s * kSlice + i)) ++mismatches;
          }
        }
      } catch (const std::exception& e) {
        errors[w] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& e : errors) CHECK(e.empty());
  CHECK(mismatches == 0);
  CHECK(at::equal(file.read_tensor(file.header().at("small")), small));
}

TEST_CASE("files without checksums: verify is a no-op", "[storage][safetensors]") {
  const auto dir = scratch("no_crc");
  const auto path = dir + "/plain.safetensors";
  storage::write_safetensors(path, {{"w", at::arange(10, at::kFloat)}}, {}, /*crc_block_bytes=*/0);
  const RawFile raw = parse_raw(path);
  CHECK_FALSE(raw.header.contains("__metadata__"));
  std::string bytes = slurp(path);
  bytes[8 + raw.header_length + 3] ^= 0x01;  // corrupt: undetectable without checksums
  spit(path, bytes);
  SafetensorsFile file(path);
  CHECK(file.header().crc_block_bytes == 0);
  CHECK(file.header().at("w").crc32c.empty());
  file.verify(file.header().at("w"), 0, 40);
}

TEST_CASE("writer errors name the file and the key", "[storage][safetensors]") {
  const auto dir = scratch("writer_errors");
  const auto path = dir + "/bad.safetensors";
  const auto t = at::zeros({2}, at::kFloat);
  REQUIRE_THROWS_WITH(storage::write_safetensors(path, {{"a", t}, {"a", t}}),
                      Contains(path) && Contains("'a' appears twice"));
  REQUIRE_THROWS_WITH(storage::write_safetensors(path, {{"__metadata__", t}}), Contains("invalid key"));
  REQUIRE_THROWS_WITH(storage::write_safetensors(path, {{"c", at::zeros({2}, at::kComplexDouble)}}),
                      Contains("ComplexDouble"));
  REQUIRE_THROWS_WITH(storage::write_safetensors(path, {{"a", t}}, {{storage::kCrcKey, "x"}}),
                      Contains("reserved"));
  REQUIRE_THROWS_WITH(storage::write_safetensors(path, {{"a", at::zeros({2}, at::device(at::kMeta))}}),
                      Contains("tensor 'a'") && Contains("meta"));
  CHECK_FALSE(fs::exists(path));
  REQUIRE_THROWS_WITH(storage::write_safetensors(dir + "/no/such/dir/x.safetensors", {{"a", t}}),
                      Contains(dir + "/no/such/dir/x.safetensors") && Contains("No such file"));
}

TEST_CASE("a truncated file is refused at open, naming the first entry cut", "[storage][safetensors]") {
  const auto dir = scratch("truncated");
  const auto path = dir + "/t.safetensors";
  storage::write_safetensors(path, {{"first", at::zeros({4}, at::kFloat)},
                                    {"second", at::zeros({8}, at::kFloat)},
                                    {"third", at::zeros({8}, at::kFloat)}});
  const auto size = fs::file_size(path);
  fs::resize_file(path, size - 40);  // cuts the end of "second" (third is 32 bytes)
  REQUIRE_THROWS_WITH(SafetensorsFile(path),
                      Contains(path) && Contains("truncated") && Contains("entry 'second'"));
  fs::resize_file(path, 20);  // inside the header
  REQUIRE_THROWS_WITH(SafetensorsFile(path), Contains(path) && Contains("declares a header of"));
  fs::resize_file(path, 5);
  REQUIRE_THROWS_WITH(SafetensorsFile(path), Contains(path) && Contains("too short"));
  REQUIRE_THROWS_WITH(SafetensorsFile(dir + "/absent"), Contains(dir + "/absent") && Contains("No such file"));
}

TEST_CASE("malformed headers are refused with the reason", "[storage][safetensors]") {
  const auto dir = scratch("malformed");
  const auto path = dir + "/m.safetensors";
  const std::string data16(16, '\0');
  auto refused = [&](const std::string& header, const std::string& data) {
    spit(path, raw_file(header, data));
    try {
      SafetensorsFile f(path);
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("accepted");
  };
  CHECK_THAT(refused("{not json", data16), Contains(path) && Contains("not valid JSON"));
  CHECK_THAT(refused("[1, 2]", ""), Contains("array") && Contains("expected an object"));
  CHECK_THAT(refused(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                         "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})",
                     data16),
             Contains(path) && Contains("'b'") && Contains("overlaps") && Contains("'a'"));
  CHECK_THAT(refused(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                         "b": {"dtype": "F32", "shape": [1], "data_offsets": [12, 16]}})",
                     data16),
             Contains("entry 'b' starts at byte 12") && Contains("ends at 8"));
  CHECK_THAT(refused(R"({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}})", data16),
             Contains("entry 'a'") && Contains("needs 12 bytes") && Contains("hold 16"));
  CHECK_THAT(refused(R"({"a": {"dtype": "Q7", "shape": [4], "data_offsets": [0, 16]}})", data16),
             Contains("'Q7'") && Contains("entry 'a'"));
  CHECK_THAT(refused(R"({"a": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}})", data16),
             Contains("entry 'a'") && Contains("non-negative"));
  CHECK_THAT(refused(R"({"a": {"dtype": "F32", "shape": [4]}})", data16), Contains("data_offsets"));
  CHECK_THAT(refused(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                         "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})",
                     data16),
             Contains("key 'a' twice"));
  CHECK_THAT(refused(R"({"__metadata__": {"n": 3}, "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})",
                     data16),
             Contains("metadata 'n' must be a string"));
  CHECK_THAT(refused(R"({"__metadata__": {"FSDP_CRC32C_BLOCK": "8", "FSDP_CRC32C": "{\"a\": [\"00000000\"]}"},
                         "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})",
                     data16),
             Contains("entry 'a' of 16 bytes needs 2 checksums"));
  CHECK_THAT(refused(R"({"__metadata__": {"FSDP_CRC32C_BLOCK": "8"},
                         "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})",
                     data16),
             Contains("without 'FSDP_CRC32C'"));
  // The same header with a valid checksum list is accepted: the checks above are the only reasons.
  CHECK(refused(R"({"__metadata__": {"FSDP_CRC32C_BLOCK": "8", "FSDP_CRC32C": "{\"a\": [\"00000000\", \"00000000\"]}"},
                    "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})",
                data16) == "accepted");
}

TEST_CASE("files written by Python's safetensors package", "[storage][safetensors][python]") {
  // tests/storage/make_python_fixtures.py wrote it with safetensors.torch.save_file.
  SafetensorsFile file("tests/storage/testdata/python_safetensors.safetensors");
  const auto& h = file.header();
  CHECK(h.crc_block_bytes == 0);
  CHECK(h.metadata == std::map<std::string, std::string>{{"format", "pt"}});
  CHECK(h.entries.size() == 12);
  auto read = [&](const std::string& key) { return file.read_tensor(h.at(key)); };
  CHECK(at::equal(read("f32"), at::arange(12, at::kFloat).reshape({3, 4}) / 4));
  CHECK(at::equal(read("f64"), at::arange(5, at::kDouble) - 2.5));
  CHECK(at::equal(read("f16"), (at::arange(6, at::kFloat).reshape({2, 3}) / 2).to(at::kHalf)));
  CHECK(at::equal(read("bf16"), (at::arange(4, at::kFloat) * 3).to(at::kBFloat16)));
  CHECK(at::equal(read("i64"), at::arange(6, at::kLong).reshape({3, 2}) * -7));
  CHECK(at::equal(read("i32"), at::arange(3, at::kInt) + 100));
  CHECK(at::equal(read("i16"), at::arange(4, at::kShort) - 2));
  CHECK(at::equal(read("i8"), at::arange(5, at::kChar) - 3));
  CHECK(at::equal(read("u8"), at::arange(7, at::kByte) * 30));
  CHECK(at::equal(read("bool"), at::arange(5, at::kLong).remainder(2).eq(0)));
  const auto scalar = read("scalar");
  CHECK(scalar.dim() == 0);
  CHECK(scalar.item<float>() == 2.5f);
  const auto empty = read("empty");
  CHECK(empty.sizes() == at::IntArrayRef{0, 3});
  file.verify(h.at("f32"), 0, 48);  // no checksums: no-op
}

TEST_CASE("files written by torch.distributed.checkpoint's HuggingFaceStorageWriter", "[storage][safetensors][python]") {
  SafetensorsFile file("tests/storage/testdata/dcp_hf_shard.safetensors");
  const auto& h = file.header();
  REQUIRE(h.metadata.count("DCP_SHARDING_INFO") == 1);
  const auto sharding = nlohmann::json::parse(h.metadata.at("DCP_SHARDING_INFO"));
  CHECK(sharding.at("layer.weight").at("saved_offsets") == nlohmann::json::array({0, 0}));
  CHECK(at::equal(file.read_tensor(h.at("layer.weight")), at::arange(20, at::kFloat).reshape({4, 5})));
  CHECK(at::equal(file.read_tensor(h.at("layer.bias")), at::arange(4, at::kFloat) * 0.5));
}

TEST_CASE("a file for Python to read back (tests/storage/read_with_python.py)", "[storage][safetensors][python]") {
  // Writes <dir>/interop.safetensors and <dir>/interop.expected.json (the same values as plain
  // JSON numbers); the directory is $FSDP_STORAGE_INTEROP_DIR when set, so that
  //   python3 tests/storage/read_with_python.py <dir>/interop.safetensors <dir>/interop.expected.json
  // can check the file with safetensors.torch.load_file.
  const char* env = std::getenv("FSDP_STORAGE_INTEROP_DIR");
  const std::string dir = env ? std::string(env) : scratch("interop");
  fs::create_directories(dir);
  auto items = every_dtype();
  items.push_back({"transposed", at::arange(6, at::kFloat).reshape({2, 3}).t()});
  nlohmann::json expected = nlohmann::json::object();
  for (const auto& item : items) {
    const auto& t = item.tensor;
    nlohmann::json values = nlohmann::json::array();
    const auto real = t.is_complex() ? at::view_as_real(t) : t;  // complex: (re, im) pairs
    const auto flat = real.to(at::kDouble).contiguous().reshape({-1});
    for (int64_t i = 0; i < flat.numel(); ++i) values.push_back(flat.const_data_ptr<double>()[i]);
    expected[item.key] = {{"dtype", c10::toString(t.scalar_type())}, {"shape", t.sizes().vec()}, {"values", values}};
  }
  const std::string path = dir + "/interop.safetensors";
  storage::write_safetensors(path, items, {{"format", "pt"}});
  std::ofstream(dir + "/interop.expected.json") << expected.dump(1);
  SafetensorsFile file(path);
  for (const auto& item : items) {
    INFO(item.key);
    CHECK(bytes_of(file.read_tensor(file.header().at(item.key))) == bytes_of(item.tensor));
  }
}

TEST_CASE("a file with no tensors, and a reader moved to another owner", "[storage][safetensors]") {
  const auto dir = scratch("empty_and_move");
  storage::write_safetensors(dir + "/none.safetensors", {}, {{"note", "nothing"}});
  SafetensorsFile none(dir + "/none.safetensors");
  CHECK(none.header().entries.empty());
  CHECK(none.header().data_size == 0);
  CHECK(none.header().metadata == std::map<std::string, std::string>{{"note", "nothing"}});
  CHECK(static_cast<int64_t>(fs::file_size(dir + "/none.safetensors")) == none.header().data_start);

  storage::write_safetensors(dir + "/one.safetensors", {{"x", at::arange(5, at::kLong)}});
  SafetensorsFile a(dir + "/one.safetensors");
  SafetensorsFile b(std::move(a));
  CHECK(at::equal(b.read_tensor(b.header().at("x")), at::arange(5, at::kLong)));
  none = std::move(b);
  CHECK(at::equal(none.read_tensor(none.header().at("x")), at::arange(5, at::kLong)));
  std::vector<int64_t> out(5);
  REQUIRE_THROWS_WITH(b.read(none.header().at("x"), 0, 40, out.data()), Contains("moved from"));
}
