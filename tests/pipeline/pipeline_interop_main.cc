// A pipeline checkpoint read by Python (tests/pipeline/pipeline_interop_test.sh): on 2 or 4 ranks,
// a GPT as pp = 2 stages (x dp = W / 2, fully_shard inside each stage) trains 2 steps and every
// rank saves its stage with fsdp::dcp::save into OUT/ckpt (one checkpoint of the whole model).
// Then every rank loads it into the whole model (unsharded: a group of its own), and rank 0
// writes that model's full state dict as OUT/full/model.safetensors, the reference Python's
// torch.distributed.checkpoint.load of OUT/ckpt must equal bit for bit.
//   pipeline_interop_main OUT
#include <cstdio>
#include <string>
#include <vector>

#include <torch/optim/adamw.h>
#include <torch/torch.h>

#include "fsdp_cpp/checkpoint/distributed_checkpoint.h"
#include "fsdp_cpp/checkpoint/full_state_dict_files.h"
#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/comm/device_mesh.h"
#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/composable/fully_shard_tree.h"
#include "fsdp_cpp/examples/gpt_model.h"
#include "fsdp_cpp/pipeline/schedule.h"
#include "fsdp_cpp/pipeline/stage_split.h"

namespace {

fsdp::examples::GPTConfig config() {
  return fsdp::examples::GPTConfig(16).context_length(8).d_model(16).n_heads(2).n_layers(4).tie_embeddings(false);
}

std::vector<fsdp::FSDPModule> shard(fsdp::examples::GPT& model, const std::shared_ptr<fsdp::comm::Communicator>& group) {
  return fsdp::fully_shard_tree(*model, fsdp::WrapPolicy::module_types<fsdp::examples::BlockImpl>(),
                                fsdp::FullyShardOptions().communicator(group));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: pipeline_interop_main OUT\n");
    return 2;
  }
  const std::string out = argv[1];
  auto pg = fsdp::comm::init_process_group();
  const int w = pg.comm->size();
  if (w % 2 != 0) {
    std::fprintf(stderr, "pipeline_interop_main: expected an even number of ranks, got %d\n", w);
    return 2;
  }
  auto mesh = fsdp::comm::DeviceMesh::create(*pg.comm, {2, w / 2}, {"pp", "dp"});
  const int s = mesh->coordinate("pp");
  {
    torch::manual_seed(3);
    fsdp::examples::GPT part(config());
    part->keep_stage(fsdp::pipeline::split_blocks_evenly(4, 2)[s], s == 0, s == 1);
    auto units = shard(part, mesh->group("dp"));
    fsdp::pipeline::PipelineStage stage([part](const at::Tensor& x) mutable { return part(x); }, s, 2,
                                        mesh->group("pp"));
    stage.set_fsdp_units({units.back()});
    fsdp::pipeline::PipelineSchedule schedule(
        {&stage}, fsdp::examples::next_token_loss,
        fsdp::pipeline::ScheduleOptions().kind(fsdp::pipeline::ScheduleKind::k1F1B).n_microbatches(2));
    torch::optim::AdamW optim(part->parameters(), 1e-2);
    torch::manual_seed(10 + mesh->coordinate("dp"));
    const auto tokens = torch::randint(16, {4, 9}, torch::kLong);
    for (int step = 0; step < 2; ++step) {
      schedule.step(tokens.narrow(1, 0, 8), tokens.narrow(1, 1, 8));
      optim.step();
      optim.zero_grad();
    }
    fsdp::dcp::save(out + "/ckpt", units.back(), &optim, {}, fsdp::dcp::SaveOptions().communicator(pg.comm));
  }
  // The whole model, unsharded on every rank, from the checkpoint.
  auto solo = fsdp::comm::DeviceMesh::create(*pg.comm, {w, 1}, {"ranks", "solo"});
  torch::manual_seed(99);
  fsdp::examples::GPT whole(config());
  auto units = shard(whole, solo->group("solo"));
  fsdp::dcp::load(out + "/ckpt", units.back(), nullptr, nullptr, fsdp::dcp::LoadOptions().communicator(pg.comm));
  const auto full = fsdp::full_state_dict(units.back());
  if (pg.comm->rank() == 0) fsdp::save_safetensors(out + "/full", full);
  fsdp::comm::destroy_process_group();
  return 0;
}
