#pragma once
// Hugging Face folders of the Qwen3-MoE model (models/moe.h) in and out of a parallel job, built on
// the generic load_hf_checkpoint / export_hf_checkpoint of models/hf_checkpoint.h: the FQNs are
// transformers' saved keys (one module per expert), so the mapping is the identity and the only
// conversion is the padded vocabulary.
//
//   auto config = fsdp::models::read_moe_config(dir, 64);
//   auto model = fsdp::parallel::parallelize(pg.comm, fsdp::models::moe_model_spec(config, 0), options);
//   fsdp::models::load_moe_hf(model, config, dir);
//   ... train ...
//   fsdp::models::export_moe_hf(model, config, out);   // Qwen3MoeForCausalLM.from_pretrained(out)
//
// With sigmoid scoring the routers' e_score_correction_bias buffers are in the files (as DeepSeek-V3
// checkpoints hold them); the DeepSeek options are written into config.json under DeepSeek-V3's
// keys (models/moe.h), which transformers' Qwen3MoeConfig keeps but its model does not use.

#include <string>

#include "fsdp_cpp/models/hf_checkpoint.h"
#include "fsdp_cpp/models/moe.h"
#include "fsdp_cpp/parallel/parallel_model.h"

namespace fsdp::models {

/// The HfModelFiles of a MoE config (config.json text, the padded rows).
HfModelFiles moe_hf_files(const MoeConfig& config);

/// A c10::Error naming `where`, the key and both values when `found` differs from `expected` in a
/// field that shapes the model or its routing.
void check_same_moe_config(const MoeConfig& expected, const MoeConfig& found, const std::string& where);

/// Loads `dir` (config.json and model.safetensors, or a sharded index with its files) into the
/// job; refuses a config.json that differs from `config` (check_same_moe_config). Errors as
/// load_hf_checkpoint's. Collective over the job.
void load_moe_hf(parallel::ParallelModel& model, const MoeConfig& config, const std::string& dir);
/// Exports the job's model into `dir` (export_hf_checkpoint). Collective over the job.
void export_moe_hf(parallel::ParallelModel& model, const MoeConfig& config, const std::string& dir,
                   const HfExportOptions& options = {});

}  // namespace fsdp::models
