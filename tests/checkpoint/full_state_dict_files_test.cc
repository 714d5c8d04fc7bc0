// Full state dicts as files: Hugging Face safetensors folders (one file, or several with an
// index) and .pt files, read back equal (keys, order, dtypes, values) to what was written. The
// files are also checked by reading their bytes independently of the library's reader.
#include <cstring>
#include <filesystem>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "fsdp_cpp/checkpoint/full_state_dict_files.h"
#include "fsdp_cpp/storage/atomic_directory.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

namespace fs = std::filesystem;
using Catch::Matchers::Contains;
using StateDict = torch::OrderedDict<std::string, at::Tensor>;

std::string test_dir(const std::string& name) {
  return fsdp::testing::shared_tmpdir() + "/full_files_" + std::to_string(fsdp::testing::rank()) + "_" + name;
}

// Several dtypes and shapes, a 0-d value, an empty tensor and a non-contiguous view.
StateDict sample_state() {
  auto gen = at::detail::createCPUGenerator(7);
  StateDict state;
  state.insert("embed.weight", at::randn({40, 8}, gen));
  state.insert("layers.0.weight", at::randn({16, 8}, gen).to(at::kBFloat16));
  state.insert("layers.0.bias", at::randn({16}, gen).to(at::kHalf));
  state.insert("layers.0.steps", at::full({}, int64_t{12}, at::kLong));
  state.insert("layers.0.mask", at::randn({3, 4}, gen) > 0);
  state.insert("empty", at::empty({0, 3}));
  state.insert("head.weight", at::randn({30, 6}, gen, at::kDouble).t());
  return state;
}

void check_same(const StateDict& got, const StateDict& want) {
  REQUIRE(got.keys() == want.keys());
  for (const auto& item : want) {
    INFO(item.key());
    CHECK(got[item.key()].scalar_type() == item.value().scalar_type());
    CHECK(got[item.key()].sizes() == item.value().sizes());
    CHECK(got[item.key()].equal(item.value()));
  }
}

// The JSON header of a safetensors file, read by hand.
nlohmann::json header_of(const std::string& path) {
  const std::string bytes = fsdp::storage::read_file(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  return nlohmann::json::parse(bytes.substr(8, n));
}

}  // namespace

FSDP_RANKS_TEST_CASE("one model.safetensors round-trips", "[full_state_dict_files]") {
  const std::string dir = test_dir("single");
  const auto state = sample_state();
  fsdp::save_safetensors(dir, state);
  CHECK(fsdp::storage::list_files(dir) == std::vector<std::string>{"model.safetensors"});
  const auto header = header_of(dir + "/model.safetensors");
  CHECK(header.at("__metadata__").at("format") == "pt");
  CHECK(header.at("embed.weight").at("dtype") == "F32");
  CHECK(header.at("embed.weight").at("shape") == std::vector<int64_t>{40, 8});
  CHECK(header.at("layers.0.weight").at("dtype") == "BF16");
  CHECK(header.at("head.weight").at("shape") == std::vector<int64_t>{6, 30});
  check_same(fsdp::load_safetensors(dir), state);
  check_same(fsdp::load_safetensors(dir + "/model.safetensors"), state);
}

FSDP_RANKS_TEST_CASE("a model split over several files with an index round-trips", "[full_state_dict_files]") {
  const std::string dir = test_dir("sharded");
  const auto state = sample_state();
  fsdp::save_safetensors(dir, state, fsdp::SaveSafetensorsOptions().max_file_bytes(1000));
  // embed.weight (1280 bytes) alone; layers.0.* and empty (256 + 32 + 8 + 12 + 0) together; head.weight (1440).
  CHECK(fsdp::storage::list_files(dir) == std::vector<std::string>{"model-00001-of-00003.safetensors",
                                                                    "model-00002-of-00003.safetensors",
                                                                    "model-00003-of-00003.safetensors",
                                                                    "model.safetensors.index.json"});
  const auto index = nlohmann::json::parse(fsdp::storage::read_file(dir + "/model.safetensors.index.json"));
  int64_t total = 0;
  for (const auto& item : state) total += item.value().numel() * item.value().element_size();
  CHECK(index.at("metadata").at("total_size") == total);
  CHECK(index.at("weight_map").size() == state.size());
  CHECK(index.at("weight_map").at("embed.weight") == "model-00001-of-00003.safetensors");
  CHECK(index.at("weight_map").at("layers.0.mask") == "model-00002-of-00003.safetensors");
  CHECK(index.at("weight_map").at("head.weight") == "model-00003-of-00003.safetensors");
  CHECK(header_of(dir + "/model-00002-of-00003.safetensors").contains("layers.0.bias"));
  check_same(fsdp::load_safetensors(dir), state);
  check_same(fsdp::load_safetensors(dir + "/model.safetensors.index.json"), state);

  // Saving again as one file removes the split model (and keeps other files).
  fsdp::storage::write_file(dir + "/config.json", "{}");
  fsdp::save_safetensors(dir, state);
  CHECK(fsdp::storage::list_files(dir) == std::vector<std::string>{"config.json", "model.safetensors"});
  check_same(fsdp::load_safetensors(dir), state);
}

FSDP_RANKS_TEST_CASE("damaged safetensors models are refused naming the file", "[full_state_dict_files]") {
  const std::string dir = test_dir("damaged");
  const auto state = sample_state();
  fsdp::save_safetensors(dir, state, 1000);  // the earlier form: max_file_bytes as a number
  const std::string second = dir + "/model-00002-of-00003.safetensors";
  std::string bytes = fsdp::storage::read_file(second);
  bytes[bytes.size() - 20] ^= 0x11;  // a data byte
  fsdp::storage::write_file(second, bytes);
  CHECK_THROWS_WITH(fsdp::load_safetensors(dir), Contains("model-00002-of-00003.safetensors"));
  fs::remove(second);
  CHECK_THROWS_WITH(fsdp::load_safetensors(dir), Contains("model-00002-of-00003.safetensors") && Contains("missing"));
  CHECK_THROWS_WITH(fsdp::load_safetensors(test_dir("nothing_here")), Contains("nothing_here"));
}

FSDP_RANKS_TEST_CASE("crc_block_bytes sets the checksum blocks; 0 writes plain files", "[full_state_dict_files]") {
  const std::string dir = test_dir("crc_blocks");
  const auto state = sample_state();
  // The default: 4 MiB blocks, as dcp::SaveOptions'.
  fsdp::save_safetensors(dir, state);
  CHECK(header_of(dir + "/model.safetensors").at("__metadata__").at("FSDP_CRC32C_BLOCK") == std::to_string(4 << 20));
  // Small blocks, over several files: every file has them, and a flipped byte is still found.
  fsdp::save_safetensors(dir, state, fsdp::SaveSafetensorsOptions().max_file_bytes(1000).crc_block_bytes(64));
  for (const auto& name : fsdp::storage::list_files(dir)) {
    if (!name.ends_with(".safetensors")) continue;
    INFO(name);
    CHECK(header_of(dir + "/" + name).at("__metadata__").at("FSDP_CRC32C_BLOCK") == "64");
  }
  check_same(fsdp::load_safetensors(dir), state);
  // 0: no checksums (only "format" in the metadata), and the model loads.
  fsdp::save_safetensors(dir, state, fsdp::SaveSafetensorsOptions().crc_block_bytes(0));
  const auto metadata = header_of(dir + "/model.safetensors").at("__metadata__");
  CHECK(metadata == nlohmann::json{{"format", "pt"}});
  check_same(fsdp::load_safetensors(dir), state);
  // Out of range: refused before anything is written (the previous model stays).
  CHECK_THROWS_WITH(fsdp::save_safetensors(dir, StateDict(), fsdp::SaveSafetensorsOptions().crc_block_bytes(-1)),
                    Contains("crc_block_bytes must not be negative"));
  CHECK_THROWS_WITH(fsdp::save_safetensors(dir, StateDict(), fsdp::SaveSafetensorsOptions().max_file_bytes(0)),
                    Contains("max_file_bytes must be positive"));
  check_same(fsdp::load_safetensors(dir), state);
}

FSDP_RANKS_TEST_CASE("a .pt file round-trips", "[full_state_dict_files]") {
  const std::string dir = test_dir("pt");
  fsdp::storage::create_directories(dir);
  auto state = sample_state();
  state.insert("view", at::arange(100, at::kFloat).narrow(0, 10, 5));  // a view of a larger storage
  fsdp::save_pt(dir + "/model.pt", state);
  const auto back = fsdp::load_pt(dir + "/model.pt");
  check_same(back, state);
  CHECK(back["view"].storage().nbytes() == 5 * sizeof(float));  // only the view's elements
  CHECK_THROWS_WITH(fsdp::load_pt(dir + "/absent.pt"), Contains("absent.pt"));
}

// Fixtures written by Python's torch.save (testdata/make_python_state_dicts.py).
FSDP_RANKS_TEST_CASE(".pt files written by Python's torch.save load", "[full_state_dict_files]") {
  const std::string data = "tests/checkpoint/testdata/";  // the test runs in its runfiles folder
  StateDict expected;
  expected.insert("weight", at::arange(12, at::kFloat).view({3, 4}) / 4);
  expected.insert("half", at::arange(5, at::kHalf) - 2);
  expected.insert("bf16", at::arange(4, at::kBFloat16) * 3);
  expected.insert("steps", at::full({}, int64_t{7}, at::kLong));
  expected.insert("mask", at::tensor({1, 0, 1}, at::kInt).to(at::kBool));
  expected.insert("column", at::arange(6, at::kDouble).view({2, 3}).t());
  check_same(fsdp::load_pt(data + "python_dict.pt"), expected);

  // nn.Linear(3, 2).state_dict() is an OrderedDict, which LibTorch's unpickler cannot build.
  CHECK_THROWS_WITH(fsdp::load_pt(data + "python_state_dict.pt"),
                    Contains("python_state_dict.pt") && Contains("torch.save(dict(model.state_dict()), path)"));
}
