// Fine-tunes a Hugging Face Llama folder on a token file at any layout, and writes the result as
// a Hugging Face folder: llama_finetune HF_DIR TOKENS OUT_DIR (under mpirun; 2 x 2 with 4 ranks).
#include <torch/torch.h>

#include "fsdp_cpp/comm/init.h"                    // fsdp::comm::init_process_group
#include "fsdp_cpp/data/token_dataset.h"           // fsdp::data::TokenDataset
#include "fsdp_cpp/models/hf_checkpoint.h"         // load_llama_hf, export_llama_hf
#include "fsdp_cpp/models/llama_parallel.h"        // llama_model_spec
#include "fsdp_cpp/parallel/parallel_model.h"      // fsdp::parallel::parallelize

int main(int argc, char** argv) {
  if (argc != 4) return 2;
  const std::string hf_dir = argv[1], tokens = argv[2], out = argv[3];
  auto pg = fsdp::comm::init_process_group();
  const int tp = pg.comm->size() % 2 == 0 ? 2 : 1;

  // The model as config.json describes it; its vocabulary padded so tp splits it evenly.
  const auto config = fsdp::models::read_llama_config(hf_dir, /*vocab_multiple=*/64);
  auto model = fsdp::parallel::parallelize(pg.comm, fsdp::models::llama_model_spec(config, /*init_seed=*/0),
                                           fsdp::parallel::ParallelOptions().dims({.dp_shard = -1, .tp = tp}));
  fsdp::models::load_llama_hf(model, config, hf_dir);  // each rank reads only its slices

  // Data by data rank: the ranks of a tp group read the same batches.
  fsdp::data::TokenDataset data(tokens, fsdp::data::TokenDatasetOptions(/*seq_len=*/64)
                                            .data_rank(model.mesh().data_rank())
                                            .data_size(model.mesh().data_world()));
  torch::optim::AdamW optim(model.parameters(), torch::optim::AdamWOptions(1e-4).weight_decay(0.1));
  for (int step = 1; step <= 10; ++step) {
    auto batch = data.next_batch(/*batch_size=*/4);
    at::Tensor loss = model.forward_backward(batch.inputs, batch.targets);
    model.clip_grad_norm_(1.0);
    optim.step();
    model.zero_grad();
    const double mean = model.global_loss(loss);  // over the global batch's tokens
    if (pg.comm->rank() == 0) std::printf("step %d: loss %.4f\n", step, mean);
  }
  fsdp::models::export_llama_hf(model, config, out);  // transformers loads it
}
