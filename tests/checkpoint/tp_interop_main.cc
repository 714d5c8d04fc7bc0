// Tensor-parallel checkpoints across the language boundary (tests/checkpoint/tp_interop_test.sh),
// with PyTorch's FSDP2 + DTensor tensor parallelism (tests/python/fsdp2_tp_checkpoint.py), on the
// example GPT (vocabulary 24, context 12, d_model 24, 12 heads, 2 blocks) parallelized with
// fsdp::examples::parallelize_gpt over tp and fully_shard over dp of a (dp, tp) mesh:
//
//   tp_interop_main save OUT DP TP SEED   values randn (torch::manual_seed(SEED), named_parameters
//                                          order); fsdp::dcp::save to OUT/ckpt; rank 0 writes the
//                                          full state dict (global values) to OUT/full
//   tp_interop_main load CKPT REFERENCE.safetensors DP TP
//                                          fsdp::dcp::load of CKPT (e.g. written by PyTorch), then
//                                          the full state dict must equal REFERENCE bit for bit
//
// The world size must be DP * TP. Exit 0 on success, 1 with the differing keys otherwise.
#include <cstdio>
#include <string>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/torch.h>

#include "fsdp_cpp/checkpoint/distributed_checkpoint.h"
#include "fsdp_cpp/checkpoint/full_state_dict_files.h"
#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/comm/device_mesh.h"
#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/examples/gpt_model.h"
#include "fsdp_cpp/examples/gpt_tensor_parallel.h"

namespace {

struct Model {
  fsdp::examples::GPT gpt{nullptr};
  std::vector<fsdp::FSDPModule> units;
};

// Values randn from `seed` (before parallelizing, so they are the global values), then TP + FSDP.
Model build(const fsdp::comm::Communicator& world, int dp, int tp, uint64_t seed) {
  Model m;
  m.gpt = fsdp::examples::GPT(fsdp::examples::GPTConfig(24).context_length(12).d_model(24).n_heads(12).n_layers(2));
  torch::manual_seed(seed);
  {
    c10::NoGradGuard no_grad;
    for (auto& item : m.gpt->named_parameters()) item.value().copy_(torch::randn(item.value().sizes()));
  }
  auto mesh = fsdp::comm::DeviceMesh::create(world, {dp, tp}, {"dp", "tp"});
  fsdp::examples::parallelize_gpt(m.gpt, mesh->group("tp"));
  const auto options = fsdp::FullyShardOptions().communicator(mesh->group("dp"));
  for (auto& block : m.gpt->block_list()) m.units.push_back(fsdp::fully_shard(block, options));
  m.units.push_back(fsdp::fully_shard(m.gpt, options));
  return m;
}

int save(const std::string& out, int dp, int tp, uint64_t seed, fsdp::comm::Communicator& world) {
  Model m = build(world, dp, tp, seed);
  fsdp::dcp::save(out + "/ckpt", m.units.back());
  const auto full = fsdp::full_state_dict(m.units.back());  // world rank 0 only
  if (world.rank() == 0) {
    fsdp::save_safetensors(out + "/full", full);
    std::printf("saved at (dp=%d, tp=%d): %zu tensors\n", dp, tp, full.size());
  }
  world.barrier();
  return 0;
}

int load(const std::string& ckpt, const std::string& reference_path, int dp, int tp, fsdp::comm::Communicator& world) {
  Model m = build(world, dp, tp, /*seed=*/12345);  // other values than the checkpoint's
  fsdp::dcp::load(ckpt, m.units.back());
  const auto loaded = fsdp::full_state_dict(m.units.back(), fsdp::FullStateDictOptions().rank0_only(false));
  const auto reference = fsdp::load_safetensors(reference_path);
  int mismatches = 0;
  for (const auto& item : reference) {
    const at::Tensor* value = loaded.find(item.key());
    if (value == nullptr || !value->sizes().equals(item.value().sizes()) || !torch::equal(*value, item.value())) {
      std::fprintf(stderr, "rank %d: '%s' is missing or differs from the reference\n", world.rank(), item.key().c_str());
      ++mismatches;
    }
  }
  if (loaded.size() != reference.size()) {
    std::fprintf(stderr, "rank %d: the model has %zu entries, the reference %zu\n", world.rank(), loaded.size(),
                 reference.size());
    ++mismatches;
  }
  if (mismatches == 0 && world.rank() == 0) {
    std::printf("loaded %s at (dp=%d, tp=%d): %zu tensors equal %s\n", ckpt.c_str(), dp, tp, reference.size(),
                reference_path.c_str());
  }
  return mismatches == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  auto group = fsdp::comm::init_process_group();
  auto& world = *group.comm;
  const std::string mode = argc > 1 ? argv[1] : "";
  try {
    if (mode == "save" && argc == 6) return save(argv[2], std::stoi(argv[3]), std::stoi(argv[4]), std::stoull(argv[5]), world);
    if (mode == "load" && argc == 6) return load(argv[2], argv[3], std::stoi(argv[4]), std::stoi(argv[5]), world);
    std::fprintf(stderr, "usage: tp_interop_main save OUT DP TP SEED | load CKPT REFERENCE.safetensors DP TP\n");
    return 2;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "tp_interop_main: error on rank %d: %s\n", world.rank(), e.what_without_backtrace());
  }
  return 1;
}
