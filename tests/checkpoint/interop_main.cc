// One side of the checkpoint interoperability tests (tests/checkpoint/interop_test.sh), run under
// mpirun on the C++ model of interop_model.h:
//   interop_main write OUT        trains 2 AdamW steps under fully_shard, saves a distributed
//                                 checkpoint to OUT/ckpt (fsdp::dcp::save) and, on rank 0, the full
//                                 state dict as OUT/full/model.safetensors, as
//                                 OUT/full_split/model-0000k-of-0000n.safetensors + index, and as
//                                 OUT/full.pt, for Python to compare.
//   interop_main read CKPT REF    loads CKPT (e.g. written by PyTorch's FSDP2 + DCP) into the sharded
//                                 model and compares its full state dict with REF (a safetensors
//                                 file of the expected full values): equal bit for bit.
// Exit status 0 on success; errors are printed with the rank.

#include <cstdio>
#include <string>

#include <torch/optim/adamw.h>
#include <torch/torch.h>

#include "fsdp_cpp/checkpoint/distributed_checkpoint.h"
#include "fsdp_cpp/checkpoint/full_state_dict_files.h"
#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/tests/checkpoint/interop_model.h"

namespace {

using fsdp::testing::InteropModel;

fsdp::FSDPModule shard(InteropModel& model) {
  fsdp::fully_shard(model->emb);
  fsdp::fully_shard(model->w1);
  fsdp::fully_shard(model->w2);
  fsdp::fully_shard(model->norm);
  return fsdp::fully_shard(model);
}

int write(const std::string& out, fsdp::comm::Communicator& comm) {
  torch::manual_seed(7);
  InteropModel model;
  auto root = shard(model);
  torch::optim::AdamW optim(model->parameters(), torch::optim::AdamWOptions(1e-2));
  for (int step = 0; step < 2; ++step) {
    torch::manual_seed(100 + 10 * step + comm.rank());
    const auto idx = torch::randint(0, 10, {4, 5}, torch::kLong);
    const auto target = torch::randn({4, 5, 7});
    (model(idx) - target).pow(2).mean().backward();
    optim.step();
    optim.zero_grad();
  }
  fsdp::dcp::Extra extra;
  extra.values["step"] = "2";
  fsdp::dcp::save(out + "/ckpt", root, &optim, extra);
  const auto full = fsdp::full_state_dict(root);  // rank 0 only
  if (comm.rank() == 0) {
    fsdp::save_safetensors(out + "/full", full);
    fsdp::save_safetensors(out + "/full_split", full, /*max_file_bytes=*/1024);
    fsdp::save_pt(out + "/full.pt", full);
  }
  comm.barrier();
  return 0;
}

int read(const std::string& ckpt, const std::string& reference_path, const fsdp::comm::Communicator& comm) {
  torch::manual_seed(12345);  // another initialisation than the checkpoint's
  InteropModel model;
  auto root = shard(model);
  fsdp::dcp::load(ckpt, root);
  const auto loaded = fsdp::full_state_dict(root, fsdp::FullStateDictOptions().rank0_only(false));
  const auto reference = fsdp::load_safetensors(reference_path);
  int mismatches = 0;
  for (const auto& item : reference) {
    const at::Tensor* value = loaded.find(item.key());
    if (value == nullptr) {
      std::fprintf(stderr, "rank %d: '%s' is in the reference but not in the model\n", comm.rank(),
                   item.key().c_str());
      ++mismatches;
    } else if (!value->sizes().equals(item.value().sizes()) || !torch::equal(*value, item.value())) {
      std::fprintf(stderr, "rank %d: '%s' differs from the reference (max abs diff %g)\n", comm.rank(),
                   item.key().c_str(),
                   value->sizes().equals(item.value().sizes())
                       ? (*value - item.value()).abs().max().item<double>()
                       : -1.0);
      ++mismatches;
    }
  }
  if (loaded.size() != reference.size()) {
    std::fprintf(stderr, "rank %d: the model has %zu entries, the reference %zu\n", comm.rank(),
                 loaded.size(), reference.size());
    ++mismatches;
  }
  if (mismatches == 0 && comm.rank() == 0) {
    std::printf("loaded %s at world size %d: %zu tensors equal to %s\n", ckpt.c_str(), comm.size(),
                reference.size(), reference_path.c_str());
  }
  return mismatches == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  auto group = fsdp::comm::init_process_group();
  auto& comm = *group.comm;
  const std::string mode = argc > 1 ? argv[1] : "";
  try {
    if (mode == "write" && argc == 3) return write(argv[2], comm);
    if (mode == "read" && argc == 4) return read(argv[2], argv[3], comm);
    std::fprintf(stderr, "usage: interop_main write OUT | read CKPT REFERENCE.safetensors\n");
    return 2;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "interop_main: error on rank %d: %s\n", comm.rank(), e.what_without_backtrace());
  }
  return 1;
}
