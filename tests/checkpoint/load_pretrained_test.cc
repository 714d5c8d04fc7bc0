// load_pretrained over MPI on every world size: files written with save_safetensors /
// write_safetensors (one file, several files with an index) and save_pt, loaded into a scrambled
// fully_shard model (several units of uneven sizes, so shards hold padding; a frozen parameter;
// buffers). Checked against independent readings of the same file: every rank's shard slices
// (sharded_state_dict's views) equal the file's elements, full_state_dict (all-gathered) equals
// the file, training equals an unsharded reference loaded from the file (parity harness), the
// bytes each rank read equal exactly its shards' bytes plus its whole values (so with W > 1 no
// rank reads the whole model), mixed precision and CPU offload compute what a model sharded from
// the loaded values computes, dtype conversion, and every error (missing / unexpected keys, shapes,
// dtypes, a corrupt block, an unsharded unit) raised on every rank with the shards unchanged.
// padded_rows: a file with the real vocabulary loaded into a model padded beyond it, on fully_shard
// slices of uneven sizes (a slice straddling the file's end, a rank holding only padding), a .pt
// file's strided view, and tensor-parallel pieces (RowwiseParallel embedding, ColwiseParallel
// head) on every (dp, tp) mesh: the loaded rows equal the file, the padding rows keep their values,
// no rank reads beyond the file's rows, and bad shapes or keys are refused on every rank.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/loss.h>

#include "fsdp_cpp/checkpoint/full_state_dict_files.h"
#include "fsdp_cpp/checkpoint/load_pretrained.h"
#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/comm/device_mesh.h"
#include "fsdp_cpp/composable/fully_shard_internal.h"
#include "fsdp_cpp/composable/tensor_parallel.h"
#include "fsdp_cpp/storage/safetensors.h"
#include "fsdp_cpp/tests/composable/parity.h"
#include "fsdp_cpp/tests/composable/tied_models.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::testing::error_of;
using fsdp::testing::rank;
using fsdp::testing::same_on_every_rank;
using fsdp::testing::world;
using fsdp::testing::world_size;
using Dict = torch::OrderedDict<std::string, at::Tensor>;

/// x + fc2(tanh(fc1(x))) * scale (a buffer)
struct LoadBlockImpl : torch::nn::Module {
  LoadBlockImpl(int64_t dim, int64_t hidden) {
    fc1 = register_module("fc1", fsdp::contract::Linear(dim, hidden));
    fc2 = register_module("fc2", fsdp::contract::Linear(hidden, dim));
    scale = register_buffer("scale", at::rand({dim}) + 0.5);
  }
  // (the buffer in the input's dtype, so that bf16 compute stays bf16)
  torch::Tensor forward(torch::Tensor x) { return x + fc2(torch::tanh(fc1(x))) * scale.to(x.scalar_type()); }
  fsdp::contract::Linear fc1{nullptr}, fc2{nullptr};
  torch::Tensor scale;
};
FSDP_HOOKABLE_MODULE(LoadBlock);

/// in(6 -> 7, frozen bias) -> 3 blocks of hidden 5, 13, 3 -> head(7 -> 3) + offset (a buffer):
/// odd sizes, so every FlatParameter is padded on 2-4 ranks.
struct LoadNetImpl : torch::nn::Module {
  LoadNetImpl() {
    in = register_module("in", fsdp::contract::Linear(6, 7));
    blocks = register_module("blocks", fsdp::contract::ModuleList());
    for (int64_t hidden : {5, 13, 3}) blocks->push_back(LoadBlock(7, hidden));
    head = register_module("head", fsdp::contract::Linear(7, 3));
    in->bias.requires_grad_(false);
    offset = register_buffer("offset", at::randn({3}));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = in(x);
    for (const auto& block : *blocks) x = block.forward<torch::Tensor>(x);
    return head(x) + offset;
  }
  LoadBlock block(size_t i) const { return blocks->at<LoadBlock>(i); }
  fsdp::contract::Linear in{nullptr}, head{nullptr};
  fsdp::contract::ModuleList blocks{nullptr};
  torch::Tensor offset;
};
FSDP_HOOKABLE_MODULE(LoadNet);

std::shared_ptr<fsdp::comm::Communicator> fresh_comm() {
  return std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
}

Dict state_of(torch::nn::Module& m) {
  Dict state;
  for (const auto& item : m.named_parameters()) state.insert(item.key(), item.value().detach().clone());
  for (const auto& item : m.named_buffers()) state.insert(item.key(), item.value().detach().clone());
  return state;
}

// The pretrained weights: a LoadNet of seed 77, the same on every rank.
Dict pretrained() {
  torch::manual_seed(77);
  LoadNet net;
  return state_of(*net);
}

// Overwrites every parameter and buffer in place (same on every rank), so a load has to change them.
void scramble(torch::nn::Module& m) {
  torch::NoGradGuard no_grad;
  at::Generator gen = at::detail::createCPUGenerator(999);
  for (auto& p : m.parameters()) p.uniform_(-3, 3, gen);
  for (auto& b : m.buffers()) b.uniform_(-3, 3, gen);
}

// Copies `state` into an unsharded model (the independent reference path).
void copy_into(torch::nn::Module& m, const Dict& state) {
  torch::NoGradGuard no_grad;
  for (const auto& item : m.named_parameters()) item.value().copy_(state[item.key()]);
  for (const auto& item : m.named_buffers()) item.value().copy_(state[item.key()]);
}

std::vector<fsdp::FSDPModule> shard_net(const LoadNet& net, const fsdp::FullyShardOptions& options) {
  std::vector<fsdp::FSDPModule> units;
  for (size_t i = 0; i < net->blocks->size(); ++i) units.push_back(fsdp::fully_shard(net->block(i), options));
  units.push_back(fsdp::fully_shard(net, options));
  return units;
}

enum class Format { kSafetensors, kSafetensorsIndex, kPt };
const char* name_of(Format f) {
  switch (f) {
    case Format::kSafetensors: return "model.safetensors";
    case Format::kSafetensorsIndex: return "index + files";
    default: return ".pt";
  }
}

// Writes `state` on rank 0 in `format` under a fresh name; returns the path to load.
std::string write_model(const std::string& name, const Dict& state, Format format, int64_t crc_block = 64) {
  static int counter = 0;
  const std::string dir = fsdp::testing::shared_tmpdir() + "/load_" + name + "_" + std::to_string(counter++);
  std::string path = dir;
  if (format == Format::kPt) path = dir + "/model.pt";
  if (rank() == 0) {
    std::filesystem::create_directories(dir);
    if (format == Format::kSafetensors) {
      std::vector<fsdp::storage::SafetensorsItem> items;
      for (const auto& item : state) items.push_back({item.key(), item.value()});
      fsdp::storage::write_safetensors(dir + "/model.safetensors", items, {{"format", "pt"}}, crc_block);
    } else if (format == Format::kSafetensorsIndex) {
      fsdp::save_safetensors(dir, state, /*max_file_bytes=*/400);
    } else {
      fsdp::save_pt(path, state);
    }
  }
  world().barrier();
  return path;
}

int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

// Every rank's shard views hold the file's elements; the all-gathered state equals the file.
void check_loaded(const fsdp::FSDPModule& root, const Dict& file) {
  for (const auto& [key, shard] : fsdp::sharded_state_dict(root)) {
    INFO("key " << key);
    const at::Tensor expected = file[key].reshape({-1}).narrow(0, shard.flat_offset, shard.local.numel());
    CHECK(shard.local.equal(expected.to(shard.local.scalar_type())));
  }
  const Dict full = fsdp::full_state_dict(root, fsdp::FullStateDictOptions().rank0_only(false));
  REQUIRE(full.keys() == file.keys());
  for (const auto& item : full) {
    INFO("key " << item.key());
    CHECK(item.value().equal(file[item.key()].to(item.value().scalar_type())));
  }
}

// The bytes this rank must read: its elements of every value (slices of sharded parameters, whole
// buffers), in the file's dtype.
int64_t expected_bytes_read(const fsdp::FSDPModule& root, const Dict& file) {
  int64_t bytes = 0;
  for (const auto& [key, shard] : fsdp::sharded_state_dict(root)) {
    bytes += shard.local.numel() * static_cast<int64_t>(file[key].element_size());
  }
  return bytes;
}

// Every parameter and buffer of the units and the root, as clones (to check that nothing changed).
std::vector<at::Tensor> snapshot(const fsdp::FSDPModule& root) {
  std::vector<at::Tensor> out;
  for (const auto& [key, shard] : fsdp::sharded_state_dict(root)) out.push_back(shard.local.clone());
  return out;
}

bool unchanged(const fsdp::FSDPModule& root, const std::vector<at::Tensor>& before) {
  const auto now = snapshot(root);
  if (now.size() != before.size()) return false;
  for (size_t i = 0; i < now.size(); ++i) {
    if (!now[i].equal(before[i])) return false;
  }
  return true;
}

FSDP_RANKS_TEST_CASE("load_pretrained: each rank reads exactly its slices into its shards", "[load_pretrained]") {
  const Dict file = pretrained();
  int64_t total_bytes = 0;
  for (const auto& item : file) total_bytes += nbytes(item.value());
  for (Format format : {Format::kSafetensors, Format::kSafetensorsIndex, Format::kPt}) {
    for (auto strategy : {fsdp::ShardingStrategy::kFullShard, fsdp::ShardingStrategy::kNoShard}) {
      INFO(name_of(format) << ", strategy " << static_cast<int>(strategy));
      const std::string path = write_model("slices", file, format);
      torch::manual_seed(5);
      LoadNet net;
      scramble(*net);
      auto units = shard_net(net, fsdp::FullyShardOptions().communicator(fresh_comm()).strategy(strategy));
      const auto& root = units.back();
      const auto result = fsdp::load_pretrained(root, path);
      CHECK(result.missing_keys.empty());
      CHECK(result.unexpected_keys.empty());
      check_loaded(root, file);
      const int64_t expected = expected_bytes_read(root, file);
      CHECK(result.stats.bytes_read == expected);
      CHECK(result.stats.header_bytes > 0);
      CHECK(result.stats.values_loaded + result.stats.values_without_local_elements ==
            static_cast<int64_t>(file.size()));
      if (format == Format::kSafetensors) {
        // 64-byte checksum blocks: at most one partial block more on each side of every value read.
        CHECK(result.stats.bytes_verified >= result.stats.bytes_read);
        CHECK(result.stats.bytes_verified <= result.stats.bytes_read + 2 * 64 * result.stats.values_loaded);
      }
      if (format == Format::kSafetensorsIndex) {
        int64_t files = 0;
        for (const auto& e : std::filesystem::directory_iterator(path)) {
          files += e.path().filename().string().starts_with("model-") ? 1 : 0;
        }
        CHECK(std::filesystem::exists(path + "/model.safetensors.index.json"));
        CHECK(files >= 3);
        CHECK(result.stats.files_opened == files);
      }
      if (strategy == fsdp::ShardingStrategy::kFullShard && world_size() > 1) {
        CHECK(result.stats.bytes_read < total_bytes);
        // The sharded values are read once across the ranks, buffers once per rank.
        at::Tensor sum = at::full({1}, result.stats.bytes_read, at::kLong);
        world().all_reduce(sum).wait();
        int64_t buffer_bytes = 0;
        for (const auto& item : net->named_buffers()) buffer_bytes += nbytes(item.value());
        CHECK(sum.item<int64_t>() == total_bytes + (world_size() - 1) * buffer_bytes);
      }
      if (strategy == fsdp::ShardingStrategy::kNoShard) CHECK(result.stats.bytes_read == total_bytes);
      std::printf("[load_pretrained] W=%d rank=%d %s strategy=%s: bytes_read=%lld (file tensors %lld B), "
                  "verified=%lld, header=%lld, files=%lld, preads=%lld\n",
                  world_size(), rank(), name_of(format),
                  strategy == fsdp::ShardingStrategy::kFullShard ? "FULL_SHARD" : "NO_SHARD",
                  static_cast<long long>(result.stats.bytes_read), static_cast<long long>(total_bytes),
                  static_cast<long long>(result.stats.bytes_verified),
                  static_cast<long long>(result.stats.header_bytes),
                  static_cast<long long>(result.stats.files_opened), static_cast<long long>(result.stats.read_calls));
    }
  }
}

// Training after loading into the shards equals an unsharded model loaded from the same file.
fsdp::testing::Scenario loaded_scenario(const std::string& path, const Dict& file) {
  return {"LoadNet from " + path, 6, 3, [path, file] {
            LoadNet net;
            copy_into(*net, file);  // the reference's values (the sharded instance's are scrambled below)
            fsdp::testing::Instance inst;
            inst.module = net.ptr();
            inst.forward = [net](torch::Tensor x, int) mutable { return net(x); };
            inst.shard = [net, path](const fsdp::FullyShardOptions& o) mutable {
              scramble(*net);
              auto units = shard_net(net, o);
              fsdp::load_pretrained(units.back(), path);
              return units;
            };
            return inst;
          }};
}

FSDP_RANKS_TEST_CASE("load_pretrained: training equals the unsharded model loaded from the file",
                     "[load_pretrained]") {
  const Dict file = pretrained();
  for (Format format : {Format::kSafetensorsIndex, Format::kPt}) {
    for (auto strategy : {fsdp::ShardingStrategy::kFullShard, fsdp::ShardingStrategy::kShardGradOp}) {
      const std::string path = write_model("parity", file, format);
      fsdp::testing::ParityOptions options;
      options.optim = fsdp::testing::Optim::kAdamW;
      options.shard_options.strategy(strategy);
      fsdp::testing::run_parity(loaded_scenario(path, file), options);
    }
  }
}

FSDP_RANKS_TEST_CASE("load_pretrained: mixed precision and CPU offload compute what the loaded values give",
                     "[load_pretrained]") {
  const Dict file = pretrained();
  const std::string path = write_model("mixed", file, Format::kSafetensors);
  for (bool offload : {false, true}) {
    INFO("offload " << offload);
    auto options = fsdp::FullyShardOptions().offload_to_cpu(offload).mixed_precision(
        fsdp::MixedPrecision().param_dtype(at::kBFloat16));
    const at::Tensor x = at::randn({4, 6}, at::TensorOptions().dtype(at::kFloat)) + rank();
    // Loaded after fully_shard, after a forward filled the low-precision copies with other values.
    LoadNet loaded;
    scramble(*loaded);
    auto units = shard_net(loaded, options.communicator(fresh_comm()));
    {
      torch::NoGradGuard no_grad;
      loaded(x);
    }
    const auto result = fsdp::load_pretrained(units.back(), path);
    CHECK(result.stats.bytes_read == expected_bytes_read(units.back(), file));
    for (const auto& u : units) {
      for (const auto& h : fsdp::detail::handles_of(u)) {
        CHECK(h->local_shard().scalar_type() == at::kFloat);  // full precision was written
        CHECK(h->local_shard().device().is_cpu());
      }
    }
    check_loaded(units.back(), file);
    // Reference: the same values before fully_shard, the same options.
    LoadNet reference;
    copy_into(*reference, file);
    shard_net(reference, options.communicator(fresh_comm()));
    at::Tensor out, ref_out;
    {
      torch::NoGradGuard no_grad;
      out = loaded(x);
      ref_out = reference(x);
    }
    CHECK(out.scalar_type() == ref_out.scalar_type());
    CHECK(out.equal(ref_out));
    // And a training step runs on the loaded shards (gradients reduced in bf16, optimizer on fp32).
    loaded(x).pow(2).mean().backward();
    for (const auto& p : loaded->parameters()) {
      if (p.requires_grad() && p.numel() > 0) CHECK(p.grad().defined());
    }
  }
}

FSDP_RANKS_TEST_CASE("load_pretrained: dtypes are converted only when asked", "[load_pretrained]") {
  const Dict file = pretrained();
  Dict bf16;
  for (const auto& item : file) bf16.insert(item.key(), item.value().to(at::kBFloat16));
  const std::string path = write_model("bf16", bf16, Format::kSafetensors);
  LoadNet net;
  scramble(*net);
  auto units = shard_net(net, fsdp::FullyShardOptions().communicator(fresh_comm()));
  const auto before = snapshot(units.back());
  const std::string error = error_of([&] { fsdp::load_pretrained(units.back(), path); });
  CHECK_THAT(error, Contains("fsdp::load_pretrained") && Contains("'blocks.0.fc1.weight' has dtype BFloat16 in the "
                                                                  "file but Float in the model") &&
                        Contains("convert_dtype(true)") && Contains("Nothing was loaded"));
  CHECK(same_on_every_rank(error));
  CHECK(unchanged(units.back(), before));

  const auto result = fsdp::load_pretrained(units.back(), path, fsdp::LoadPretrainedOptions().convert_dtype(true));
  Dict converted;
  for (const auto& item : bf16) converted.insert(item.key(), item.value().to(at::kFloat));
  check_loaded(units.back(), converted);
  // Read in the file's dtype: half the bytes of the fp32 shards.
  CHECK(result.stats.bytes_read * 2 == expected_bytes_read(units.back(), file));
}

FSDP_RANKS_TEST_CASE("load_pretrained: bad files are the same error on every rank and change nothing",
                     "[load_pretrained]") {
  const Dict file = pretrained();
  LoadNet net;
  scramble(*net);
  auto units = shard_net(net, fsdp::FullyShardOptions().communicator(fresh_comm()));
  const auto& root = units.back();
  const auto before = snapshot(root);
  const Dict scrambled = fsdp::full_state_dict(root, fsdp::FullStateDictOptions().rank0_only(false));
  auto expect_error = [&](const std::string& path, const std::vector<std::string>& parts,
                          const fsdp::LoadPretrainedOptions& options = {}) {
    const std::string error = error_of([&] { fsdp::load_pretrained(root, path, options); });
    INFO(error);
    CHECK_THAT(error, Contains("fsdp::load_pretrained") && Contains("rank ") && Contains(path));
    for (const auto& part : parts) CHECK_THAT(error, Contains(part));
    CHECK(same_on_every_rank(error));
    CHECK(unchanged(root, before));
  };

  Dict missing = file;
  missing.erase("blocks.1.fc2.bias");
  expect_error(write_model("missing", missing, Format::kSafetensors), {"missing 1 key 'blocks.1.fc2.bias'",
                                                                       "strict(false)"});
  Dict extra = file;
  extra.insert("blocks.3.fc1.weight", at::zeros({2, 2}));
  expect_error(write_model("extra", extra, Format::kSafetensorsIndex),
               {"unexpected 1 key 'blocks.3.fc1.weight'", "not in the model"});
  Dict shape = file;
  shape["head.weight"] = at::zeros({3, 8});
  expect_error(write_model("shape", shape, Format::kPt), {"'head.weight' has shape [3, 8] in the file but [3, 7]"});
  expect_error(fsdp::testing::shared_tmpdir() + "/no_such_model", {"no_such_model"});

  // A corrupt byte in the middle of the largest tensor: whichever rank reads it, all refuse.
  const std::string corrupt = write_model("corrupt", file, Format::kSafetensors, /*crc_block=*/16);
  if (rank() == 0) {
    fsdp::storage::SafetensorsFile f(corrupt + "/model.safetensors");
    const auto& e = f.header().at("blocks.1.fc1.weight");
    const int64_t at = f.header().data_start + e.data_begin + e.nbytes() / 2;
    std::fstream out(corrupt + "/model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    out.seekp(at);
    out.put(static_cast<char>(0x5a));
  }
  world().barrier();
  expect_error(corrupt, {"checksum mismatch", "blocks.1.fc1.weight"});

  // An unsharded unit (as between forward and backward) is refused.
  // (On one rank nothing is ever unsharded: the shard is the whole FlatParameter.)
  units[1].unshard();
  if (world_size() > 1) {
    CHECK(fsdp::detail::handles_of(units[1])[0]->is_unsharded());
    expect_error(write_model("unsharded", file, Format::kSafetensors), {"the unit of 'blocks.1' is unsharded"});
  } else {
    CHECK(!fsdp::detail::handles_of(units[1])[0]->is_unsharded());
  }
  units[1].reshard();

  // strict(false): the rest loads, the lists come back, the missing value keeps its value.
  Dict both = missing;
  both.insert("extra.weight", at::ones({2}));
  const auto result =
      fsdp::load_pretrained(root, write_model("lenient", both, Format::kSafetensors),
                            fsdp::LoadPretrainedOptions().strict(false));
  CHECK(result.missing_keys == std::vector<std::string>{"blocks.1.fc2.bias"});
  CHECK(result.unexpected_keys == std::vector<std::string>{"extra.weight"});
  Dict expected = file;
  expected["blocks.1.fc2.bias"] = scrambled["blocks.1.fc2.bias"];
  CHECK(!scrambled["blocks.1.fc2.bias"].equal(file["blocks.1.fc2.bias"]));
  check_loaded(root, expected);
}

/// The tensors of testdata/python_dict.pt (written by Python's torch.save) as parameters and buffers.
struct PyDictImpl : torch::nn::Module {
  PyDictImpl() {
    weight = register_parameter("weight", at::zeros({3, 4}));
    column = register_parameter("column", at::zeros({3, 2}, at::kDouble));
    register_buffer("half", at::zeros({5}, at::kHalf));
    register_buffer("bf16", at::zeros({4}, at::kBFloat16));
    register_buffer("steps", at::zeros({}, at::kLong));
    register_buffer("mask", at::zeros({3}, at::kBool));
  }
  torch::Tensor forward(torch::Tensor x) { return x.matmul(weight); }
  torch::Tensor weight, column;
};
FSDP_HOOKABLE_MODULE(PyDict);

FSDP_RANKS_TEST_CASE("load_pretrained: a .pt file of Python's torch.save, strided views included",
                     "[load_pretrained]") {
  PyDict model;
  auto root = fsdp::fully_shard(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
  const auto result = fsdp::load_pretrained(root, "tests/checkpoint/testdata/python_dict.pt");
  Dict expected;
  expected.insert("weight", at::arange(12, at::kFloat).view({3, 4}) / 4);
  expected.insert("column", at::arange(6, at::kDouble).view({2, 3}).t());
  expected.insert("half", at::arange(5, at::kHalf) - 2);
  expected.insert("bf16", at::arange(4, at::kBFloat16) * 3);
  expected.insert("steps", at::full({}, int64_t{7}, at::kLong));
  expected.insert("mask", at::tensor({1, 0, 1}, at::kInt).to(at::kBool));
  check_loaded(root, expected);
  // "weight" is read in slices; the transposed "column" as the span of its storage.
  CHECK(result.stats.bytes_read >= expected_bytes_read(root, expected));
  CHECK(result.stats.bytes_read <= expected_bytes_read(root, expected) + 6 * 8);

  // An OrderedDict (module.state_dict()) is refused with the way out.
  const std::string error =
      error_of([&] { fsdp::load_pretrained(root, "tests/checkpoint/testdata/python_state_dict.pt"); });
  CHECK_THAT(error, Contains("torch.save(dict(model.state_dict()), path)"));
}

// A tied weight (emb.weight is head.weight) loads from whichever of its FQNs the file has, as
// Hugging Face files store one FQN of tied weights; with neither it is missing.
FSDP_RANKS_TEST_CASE("load_pretrained: tied parameters load from either FQN", "[load_pretrained]") {
  torch::manual_seed(3);
  fsdp::testing::TiedSiblings source(4, 6);
  const Dict full = state_of(*source);
  REQUIRE(full["emb.weight"].equal(full["head.weight"]));
  for (const std::string& drop : {std::string("head.weight"), std::string("emb.weight"), std::string()}) {
    INFO("dropped '" << drop << "'");
    Dict file;
    for (const auto& item : full) {
      if (item.key() != drop) file.insert(item.key(), item.value());
    }
    const std::string path = write_model("tied", file, Format::kSafetensors);
    torch::manual_seed(4);
    fsdp::testing::TiedSiblings model(4, 6);
    scramble(*model);
    fsdp::fully_shard(model->body, fsdp::FullyShardOptions().communicator(fresh_comm()));
    auto root = fsdp::fully_shard(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
    const auto result = fsdp::load_pretrained(root, path);
    check_loaded(root, full);
    // The tied value is read once.
    CHECK(result.stats.bytes_read == expected_bytes_read(root, full) -
                                         nbytes(fsdp::sharded_state_dict(root).back().second.local));
  }
  Dict neither;
  for (const auto& item : full) {
    if (item.key() != "emb.weight" && item.key() != "head.weight") neither.insert(item.key(), item.value());
  }
  const std::string path = write_model("tied_neither", neither, Format::kSafetensors);
  fsdp::testing::TiedSiblings model(4, 6);
  auto root = fsdp::fully_shard(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
  CHECK_THAT(error_of([&] { fsdp::load_pretrained(root, path); }), Contains("missing 1 key 'emb.weight'"));
}

// A model of 2.1 M parameters (8.5 MB): each rank reads about 1/W of it.
FSDP_RANKS_TEST_CASE("load_pretrained: each rank reads about 1/W of a larger model", "[load_pretrained]") {
  torch::manual_seed(11);
  fsdp::testing::MlpStack source(64, 256, 1024, 4, 64);
  const Dict file = state_of(*source);
  int64_t total = 0;
  for (const auto& item : file) total += nbytes(item.value());
  const std::string path = write_model("large", file, Format::kSafetensors, /*crc_block=*/int64_t{64} << 10);
  fsdp::testing::MlpStack model(64, 256, 1024, 4, 64);
  auto units = fsdp::testing::shard_stack(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
  const auto result = fsdp::load_pretrained(units.back(), path);
  check_loaded(units.back(), file);
  int64_t shard_bytes = 0;
  for (const auto& u : units) {
    for (const auto& h : fsdp::detail::handles_of(u)) shard_bytes += nbytes(h->local_shard());
  }
  CHECK(result.stats.bytes_read == expected_bytes_read(units.back(), file));
  CHECK(result.stats.bytes_read <= shard_bytes);  // the shards less their padding
  CHECK(result.stats.bytes_read <= total / world_size() + 5 * 64);
  at::Tensor sum = at::full({1}, result.stats.bytes_read, at::kLong);
  world().all_reduce(sum).wait();
  CHECK(sum.item<int64_t>() == total);
  std::printf("[load_pretrained large] W=%d rank=%d: model %lld B, shards %lld B, bytes_read %lld B (%.4f of the "
              "model), verified %lld B, header %lld B, preads %lld\n",
              world_size(), rank(), static_cast<long long>(total), static_cast<long long>(shard_bytes),
              static_cast<long long>(result.stats.bytes_read),
              static_cast<double>(result.stats.bytes_read) / static_cast<double>(total),
              static_cast<long long>(result.stats.bytes_verified), static_cast<long long>(result.stats.header_bytes),
              static_cast<long long>(result.stats.read_calls));
}

// Hybrid sharding (shard groups of W / 2 ranks on 2 and 4 ranks, of W ranks with one replica on 1
// and 3): the replicas of a shard read the same slices; every rank holds the file's values.
FSDP_RANKS_TEST_CASE("load_pretrained: hybrid sharding", "[load_pretrained]") {
  const int W = world_size();
  const int shard_size = W % 2 == 0 ? W / 2 : W;
  const int replicas = W / shard_size;
  const Dict file = pretrained();
  const std::string path = write_model("hybrid", file, Format::kSafetensorsIndex);
  LoadNet net;
  scramble(*net);
  auto units = shard_net(net, fsdp::FullyShardOptions().mesh(fsdp::comm::DeviceMesh::hybrid(world(), shard_size)));
  const auto result = fsdp::load_pretrained(units.back(), path);
  check_loaded(units.back(), file);
  CHECK(result.stats.bytes_read == expected_bytes_read(units.back(), file));
  // Each shard group reads the sharded values once; buffers are read by every rank.
  int64_t total = 0, buffer_bytes = 0;
  for (const auto& item : file) total += nbytes(item.value());
  for (const auto& item : net->named_buffers()) buffer_bytes += nbytes(item.value());
  at::Tensor sum = at::full({1}, result.stats.bytes_read, at::kLong);
  world().all_reduce(sum).wait();
  CHECK(sum.item<int64_t>() == replicas * (total - buffer_bytes) + W * buffer_bytes);
}

// Only the blocks are units (as fully_shard_tree with a block policy leaves it): the root's own
// parameters and buffer are read whole by every rank, the blocks' in slices.
FSDP_RANKS_TEST_CASE("load_pretrained: a root that is not a unit", "[load_pretrained]") {
  const Dict file = pretrained();
  const std::string path = write_model("no_root_unit", file, Format::kPt);
  LoadNet net;
  scramble(*net);
  std::vector<fsdp::FSDPModule> blocks;
  for (size_t i = 0; i < net->blocks->size(); ++i) {
    blocks.push_back(fsdp::fully_shard(net->block(i), fsdp::FullyShardOptions().communicator(fresh_comm())));
  }
  const auto result = fsdp::load_pretrained(*net, path);
  int64_t expected_bytes = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const std::string prefix = "blocks." + std::to_string(i) + ".";
    Dict block_file;
    for (const auto& item : file) {
      if (item.key().starts_with(prefix)) block_file.insert(item.key().substr(prefix.size()), item.value());
    }
    check_loaded(blocks[i], block_file);
    expected_bytes += expected_bytes_read(blocks[i], block_file);
  }
  for (const std::string key : {"in.weight", "in.bias", "head.weight", "head.bias", "offset"}) {
    INFO("key " << key);
    const at::Tensor value = key == "offset" ? net->offset : net->named_parameters()[key];
    CHECK(value.equal(file[key]));
    expected_bytes += nbytes(file[key]);
  }
  CHECK(result.stats.bytes_read == expected_bytes);
  // The block's FQNs are relative to the module passed: the blocks alone refuse the root's keys.
  CHECK_THAT(error_of([&] { fsdp::load_pretrained(blocks[0], path); }),
             Contains("unexpected") && Contains("'in.weight'"));
  // A tree without units is refused.
  LoadNet plain;
  CHECK_THAT(error_of([&] { fsdp::load_pretrained(*plain, path); }), Contains("has no fully_shard unit"));
}

// ---- padded_rows: a padded vocabulary ----

/// emb [vocab, 5] -> mid Linear(5, 5) -> head Linear(5, vocab) (weight [vocab, 5], bias [vocab]).
struct PaddedLmImpl : torch::nn::Module {
  explicit PaddedLmImpl(int64_t vocab) {
    emb = register_module("emb", fsdp::contract::Embedding(torch::nn::EmbeddingOptions(vocab, 5)));
    mid = register_module("mid", fsdp::contract::Linear(5, 5));
    head = register_module("head", fsdp::contract::Linear(5, vocab));
  }
  torch::Tensor forward(torch::Tensor ids) { return head(torch::tanh(mid(emb(ids)))); }
  fsdp::contract::Embedding emb{nullptr};
  fsdp::contract::Linear mid{nullptr}, head{nullptr};
};
FSDP_HOOKABLE_MODULE(PaddedLm);

const std::vector<std::string> kPaddedKeys = {"emb.weight", "head.weight", "head.bias"};

// The file: a PaddedLm of the real vocabulary (seed 31, the same on every rank).
Dict real_vocabulary_file(int64_t vocab) {
  torch::manual_seed(31);
  PaddedLm source(vocab);
  return state_of(*source);
}

// What a model whose values were `before` holds after loading `file` with padded_rows: the file's
// rows first, then its own padding rows.
Dict after_padded_load(const Dict& before, const Dict& file) {
  Dict out;
  for (const auto& item : before) {
    const at::Tensor& f = file[item.key()];
    const int64_t rows = f.dim() == 0 ? 0 : f.size(0);
    out.insert(item.key(), rows == item.value().size(0)
                               ? f
                               : at::cat({f, item.value().narrow(0, rows, item.value().size(0) - rows)}));
  }
  return out;
}

// Every rank's elements of the whole values (full_state_dict: TP pieces gathered) equal `expected`.
void check_global(const fsdp::FSDPModule& root, const Dict& expected) {
  const Dict full = fsdp::full_state_dict(root, fsdp::FullStateDictOptions().rank0_only(false));
  REQUIRE(full.keys() == expected.keys());
  for (const auto& item : full) {
    INFO("key " << item.key());
    CHECK(item.value().equal(expected[item.key()]));
  }
}

FSDP_RANKS_TEST_CASE("load_pretrained: padded_rows loads the file's rows into a padded vocabulary (fully_shard)",
                     "[load_pretrained][padded]") {
  constexpr int64_t kVocab = 10;
  const Dict file = real_vocabulary_file(kVocab);
  int64_t file_bytes = 0;
  for (const auto& item : file) file_bytes += nbytes(item.value());
  for (Format format : {Format::kSafetensors, Format::kSafetensorsIndex, Format::kPt}) {
    const std::string path = write_model("padded", file, format, /*crc_block=*/16);
    // Unpadded (listed anyway), one row, two rows, and 16 rows: emb's 80 elements over 3 ranks are
    // slices [0, 27), [27, 54), [54, 80) of which the file (50) fills the first, part of the second,
    // none of the third; over 4 ranks [40, 60) straddles and [60, 80) is all padding.
    for (int64_t padded : {kVocab, kVocab + 1, kVocab + 2, int64_t{16}}) {
      INFO(name_of(format) << ", model vocabulary " << padded);
      PaddedLm model(padded);
      scramble(*model);  // the padding rows too: they must keep these values
      const Dict before = state_of(*model);
      auto emb = fsdp::fully_shard(model->emb, fsdp::FullyShardOptions().communicator(fresh_comm()));
      auto head = fsdp::fully_shard(model->head, fsdp::FullyShardOptions().communicator(fresh_comm()));
      auto root = fsdp::fully_shard(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
      const auto result =
          fsdp::load_pretrained(root, path, fsdp::LoadPretrainedOptions().padded_rows(kPaddedKeys));
      const Dict expected = after_padded_load(before, file);
      check_loaded(root, expected);
      for (const auto& key : kPaddedKeys) {
        const at::Tensor value = fsdp::full_state_dict(root, fsdp::FullStateDictOptions().rank0_only(false))[key];
        CHECK(value.narrow(0, 0, kVocab).equal(file[key]));
        CHECK(value.narrow(0, kVocab, padded - kVocab).equal(before[key].narrow(0, kVocab, padded - kVocab)));
      }
      // This rank read its slices' elements within the file's rows, nothing of the padding; the
      // ranks together read the file once.
      int64_t expected_bytes = 0, holding_only_padding = 0;
      for (const auto& [key, shard] : fsdp::sharded_state_dict(root)) {
        const int64_t in_file = file[key].numel();
        const int64_t mine = std::clamp<int64_t>(in_file - shard.flat_offset, 0, shard.local.numel());
        expected_bytes += mine * 4;
        holding_only_padding += shard.local.numel() > 0 && mine == 0 ? 1 : 0;
      }
      CHECK(result.stats.bytes_read == expected_bytes);
      at::Tensor sum = at::full({1}, result.stats.bytes_read, at::kLong);
      world().all_reduce(sum).wait();
      CHECK(sum.item<int64_t>() == file_bytes);
      CHECK(result.stats.values_loaded + result.stats.values_without_local_elements ==
            static_cast<int64_t>(file.size()));
      if (holding_only_padding > 0) CHECK(result.stats.values_without_local_elements >= holding_only_padding);
      if (format == Format::kSafetensors) {
        CHECK(result.stats.bytes_verified >= result.stats.bytes_read);
        CHECK(result.stats.bytes_verified <= result.stats.bytes_read + 2 * 16 * result.stats.values_loaded);
      }
    }
  }
}

// A .pt file of Python's torch.save whose `column` is a transposed view [3, 2] (read as the span of
// its storage), into a model keeping 5 rows of it.
struct PaddedPyDictImpl : torch::nn::Module {
  PaddedPyDictImpl() {
    weight = register_parameter("weight", at::zeros({3, 4}));
    column = register_parameter("column", at::full({5, 2}, 7.0, at::kDouble));
    register_buffer("half", at::zeros({5}, at::kHalf));
    register_buffer("bf16", at::zeros({6}, at::kBFloat16));  // padded too (4 in the file)
    register_buffer("steps", at::zeros({}, at::kLong));
    register_buffer("mask", at::zeros({3}, at::kBool));
  }
  torch::Tensor forward(torch::Tensor x) { return x.matmul(weight); }
  torch::Tensor weight, column;
};
FSDP_HOOKABLE_MODULE(PaddedPyDict);

FSDP_RANKS_TEST_CASE("load_pretrained: padded_rows with a strided .pt view and a buffer", "[load_pretrained][padded]") {
  PaddedPyDict model;
  auto root = fsdp::fully_shard(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
  fsdp::load_pretrained(root, "tests/checkpoint/testdata/python_dict.pt",
                        fsdp::LoadPretrainedOptions().padded_rows({"column", "bf16"}));
  Dict expected;
  expected.insert("weight", at::arange(12, at::kFloat).view({3, 4}) / 4);
  expected.insert("column", at::cat({at::arange(6, at::kDouble).view({2, 3}).t(), at::full({2, 2}, 7.0, at::kDouble)}));
  expected.insert("half", at::arange(5, at::kHalf) - 2);
  expected.insert("bf16", at::cat({at::arange(4, at::kBFloat16) * 3, at::zeros({2}, at::kBFloat16)}));
  expected.insert("steps", at::full({}, int64_t{7}, at::kLong));
  expected.insert("mask", at::tensor({1, 0, 1}, at::kInt).to(at::kBool));
  check_loaded(root, expected);
}

FSDP_RANKS_TEST_CASE("load_pretrained: padded_rows into tensor-parallel pieces on every (dp, tp) mesh",
                     "[load_pretrained][padded][tp]") {
  // 7 real rows of 12: over tp = 2 the pieces are rows [0, 6), [6, 12) (the second straddles the
  // file's end); tp = 3: [0, 4), [4, 8), [8, 12) (the last only padding); tp = 4: [6, 9) straddles
  // and [9, 12) is only padding. fully_shard then slices each piece over dp.
  constexpr int64_t kVocab = 7, kPadded = 12;
  const Dict file = real_vocabulary_file(kVocab);
  int64_t padded_file_bytes = 0;
  for (const auto& key : kPaddedKeys) padded_file_bytes += nbytes(file[key]);
  for (Format format : {Format::kSafetensors, Format::kPt}) {
    const std::string path = write_model("padded_tp", file, format, /*crc_block=*/16);
    for (int tp = 1; tp <= world_size(); ++tp) {
      if (world_size() % tp != 0) continue;
      const int dp = world_size() / tp;
      INFO(name_of(format) << ", mesh (dp=" << dp << ", tp=" << tp << ")");
      auto mesh = fsdp::comm::DeviceMesh::create(world(), {dp, tp}, {"dp", "tp"});
      PaddedLm model(kPadded);
      scramble(*model);
      const Dict before = state_of(*model);
      fsdp::parallelize_module(*model, mesh->group("tp"),
                               {{"emb", fsdp::RowwiseParallel().input_layout(fsdp::Layout::replicate())},
                                {"head", fsdp::ColwiseParallel()}});
      auto root = fsdp::fully_shard(model, fsdp::FullyShardOptions().communicator(mesh->group("dp")));
      const auto result =
          fsdp::load_pretrained(root, path, fsdp::LoadPretrainedOptions().padded_rows(kPaddedKeys));
      check_global(root, after_padded_load(before, file));
      // The pieces' file elements are read once over the world, mid (whole on each tp rank, sliced
      // over dp) once per tp rank; no padding.
      at::Tensor sum = at::full({1}, result.stats.bytes_read, at::kLong);
      world().all_reduce(sum).wait();
      const int64_t mid_bytes = nbytes(file["mid.weight"]) + nbytes(file["mid.bias"]);
      CHECK(sum.item<int64_t>() == padded_file_bytes + tp * mid_bytes);
      // A forward equals the unsharded model holding the same values (this rank's logit columns).
      PaddedLm reference(kPadded);
      copy_into(*reference, after_padded_load(before, file));
      const at::Tensor ids = at::arange(kVocab).view({1, kVocab});
      torch::NoGradGuard no_grad;
      const at::Tensor logits = model(ids);  // Shard(-1): this rank's columns
      const at::Tensor expected = reference(ids).narrow(-1, mesh->coordinate("tp") * (kPadded / tp), kPadded / tp);
      CHECK(at::allclose(logits, expected, 1e-5, 1e-6));
    }
  }
}

FSDP_RANKS_TEST_CASE("load_pretrained: padded_rows refuses more rows, other dims and unknown keys on every rank",
                     "[load_pretrained][padded]") {
  constexpr int64_t kVocab = 10;
  const Dict file = real_vocabulary_file(kVocab);
  PaddedLm model(12);
  scramble(*model);
  auto root = fsdp::fully_shard(model, fsdp::FullyShardOptions().communicator(fresh_comm()));
  const auto before = snapshot(root);
  auto expect_error = [&](const std::string& path, const std::vector<std::string>& parts,
                          const fsdp::LoadPretrainedOptions& options) {
    const std::string error = error_of([&] { fsdp::load_pretrained(root, path, options); });
    INFO(error);
    CHECK_THAT(error, Contains("fsdp::load_pretrained") && Contains("rank ") && Contains("Nothing was loaded"));
    for (const auto& part : parts) CHECK_THAT(error, Contains(part));
    CHECK(same_on_every_rank(error));
    CHECK(unchanged(root, before));
  };
  const auto padded = fsdp::LoadPretrainedOptions().padded_rows(kPaddedKeys);
  const std::string good = write_model("padded_errors", file, Format::kSafetensors);
  // Without padded_rows the shorter file is a shape error.
  expect_error(good, {"'emb.weight' has shape [10, 5] in the file but [12, 5] in the model"}, {});
  // A key the model does not have.
  expect_error(good, {"'tok_emb.weight' is in LoadPretrainedOptions::padded_rows but the model has no parameter"},
               fsdp::LoadPretrainedOptions().padded_rows({"emb.weight", "head.weight", "head.bias", "tok_emb.weight"}));
  // More rows in the file than in the model.
  Dict more = file;
  more["head.weight"] = at::zeros({13, 5});
  expect_error(write_model("padded_more", more, Format::kPt),
               {"'head.weight' has shape [13, 5] in the file but [12, 5] in the model (padded_rows: the file has more "
                "rows than the model)"},
               padded);
  // Another dimension differs.
  Dict wider = file;
  wider["emb.weight"] = at::zeros({10, 6});
  expect_error(write_model("padded_wider", wider, Format::kSafetensorsIndex),
               {"'emb.weight' has shape [10, 6] in the file but [12, 5] in the model (padded_rows: only dim 0 may "
                "differ"},
               padded);
  // A key not in padded_rows keeps the exact shape check.
  expect_error(good, {"'head.bias' has shape [10] in the file but [12] in the model"},
               fsdp::LoadPretrainedOptions().padded_rows({"emb.weight", "head.weight"}));
  // And the valid load goes through.
  fsdp::load_pretrained(root, good, padded);
  CHECK(!unchanged(root, before));
}

}  // namespace
