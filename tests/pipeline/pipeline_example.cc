#include "fsdp_cpp/comm/device_mesh.h"              // //comm:device_mesh
#include "fsdp_cpp/comm/init.h"                     // //comm:init
#include "fsdp_cpp/composable/fully_shard_tree.h"   // //composable:fully_shard_tree
#include "fsdp_cpp/examples/gpt_model.h"            // //examples:gpt_model
#include "fsdp_cpp/pipeline/schedule.h"             // //pipeline:schedule
#include "fsdp_cpp/pipeline/stage_split.h"          // //pipeline:stage_split

#include <torch/optim/adamw.h>
#include <torch/torch.h>

int main() {
  auto pg = fsdp::comm::init_process_group();
  const int world = pg.comm->size();
  const int pp_size = world % 2 == 0 ? 2 : 1;   // (pp, dp) = (2, W / 2), or (1, W)
  auto mesh = fsdp::comm::DeviceMesh::create(*pg.comm, {pp_size, world / pp_size}, {"pp", "dp"});
  const int s = mesh->coordinate("pp");         // this rank's stage

  // The whole model from one seed, pruned to this stage's blocks (FQNs unchanged: blocks.2, ...);
  // the embeddings live on the first stage, ln_f and the output layer on the last.
  torch::manual_seed(0);
  fsdp::examples::GPT part(fsdp::examples::GPTConfig(64).n_layers(4).tie_embeddings(false));
  part->keep_stage(fsdp::pipeline::split_blocks_evenly(4, pp_size)[s], s == 0, s == pp_size - 1);
  // fully_shard inside the stage, over the data-parallel group.
  auto units = fsdp::fully_shard_tree(*part, fsdp::WrapPolicy::module_types<fsdp::examples::BlockImpl>(),
                                      fsdp::FullyShardOptions().communicator(mesh->group("dp")));
  fsdp::pipeline::PipelineStage stage([part](const at::Tensor& x) mutable { return part(x); }, s, pp_size,
                                      mesh->group("pp"));
  stage.set_fsdp_units({units.back()});   // gradients reduce-scattered once per step
  fsdp::pipeline::PipelineSchedule schedule(
      {&stage}, fsdp::examples::next_token_loss,
      fsdp::pipeline::ScheduleOptions().kind(fsdp::pipeline::ScheduleKind::k1F1B).n_microbatches(4));
  torch::optim::AdamW optim(part->parameters(), 1e-2);

  torch::manual_seed(100 + mesh->coordinate("dp"));   // each replica its batch; stages of one share it
  const at::Tensor tokens = torch::randint(64, {8, 17}, torch::kLong);
  std::vector<at::Tensor> losses;   // per microbatch, on the last stage's ranks
  double first = 0, last = 0;
  for (int step = 0; step < 10; ++step) {
    schedule.step(tokens.narrow(1, 0, 16), tokens.narrow(1, 1, 16), &losses);   // inputs, targets
    optim.step();
    optim.zero_grad();
    if (stage.is_last()) (step == 0 ? first : last) = torch::stack(losses).mean().item<double>();
  }
  fsdp::comm::destroy_process_group();
  return stage.is_last() && !(last < first) ? 1 : 0;   // the last stage saw the loss fall
}
