#pragma once
// Hugging Face checkpoints in and out of a parallel job (parallel/parallel_model.h), at any
// layout: the models' FQNs are transformers' (models/llama.h), so the name mapping is the
// identity, and the only conversion is the padded vocabulary ([Note: padded vocabulary]).
//
//   auto config = fsdp::models::read_llama_config(dir, 64);
//   auto model = fsdp::parallel::parallelize(pg.comm, fsdp::models::llama_model_spec(config, 0), options);
//   fsdp::models::load_llama_hf(model, config, dir);      // each rank reads only its slices
//   ... train ...
//   fsdp::models::export_llama_hf(model, config, out);    // AutoModelForCausalLM.from_pretrained(out)
//
// Loading: `dir` holds config.json and model.safetensors or a sharded
// model.safetensors.index.json with its files. Each stage chunk is loaded with load_pretrained
// (checkpoint/load_pretrained.h): every rank reads, with pread, only the elements of its fully_shard
// slices of its tensor-parallel pieces; the padding rows of the vocabulary stay zero. Validation
// comes first on every rank and every rank agrees over the whole job before anything is written:
// a config.json that names another architecture or differs from the model's config (the key is
// named), a missing shard file, a key of the model missing in the files or a file key that no
// stage holds, a wrong shape or dtype (bf16 files convert into float32 models), a truncated file:
// one error on every rank naming the file and key, and nothing loaded anywhere.
//
// Export: `dir` receives config.json, model.safetensors (one pipeline stage) or one file per stage
// model-0000s-of-0000n.safetensors with model.safetensors.index.json, every tensor in the model's
// dtype or HfExportOptions::dtype, the vocabulary cut to its real rows. Each stage's file is
// written by the rank holding that stage's dp and tp rank 0, streamed: its header is laid out from
// the model's shapes first, then the units are gathered one at a time (for_each_full_value,
// checkpoint/state_dict.h) and each value is written at its offset and freed
// (storage::SafetensorsWriter), so no rank holds more than one unit's full parameters (what
// training's all-gathers hold anyway) and one value. Files are written under temporary names and
// renamed; the index and config come last, so a folder with an index is complete. Collective over
// the job.

#include <cstdint>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>
#include <torch/arg.h>

#include "fsdp_cpp/models/llama.h"
#include "fsdp_cpp/parallel/parallel_model.h"

namespace fsdp::models {

struct HfExportOptions {
  /// The dtype of the exported tensors (float32 or bfloat16, say); the model's when unset.
  TORCH_ARG(std::optional<c10::ScalarType>, dtype) = std::nullopt;
};

/// What a model tells the generic load and export: its config.json text and its padded rows.
struct HfModelFiles {
  std::string config_json;
  /// FQNs whose dim 0 is the padded vocabulary, and the real vocabulary size.
  std::vector<std::string> padded_rows;
  int64_t vocab_size = 0;
};

/// The per-model wrappers use these; `check_config(dir_config_text, where)` throws when the
/// folder's config does not describe the model.
void load_hf_checkpoint(parallel::ParallelModel& model, const std::string& dir, const HfModelFiles& files,
                        const std::function<void(const std::string& text, const std::string& where)>& check_config);
void export_hf_checkpoint(parallel::ParallelModel& model, const std::string& dir, const HfModelFiles& files,
                          const HfExportOptions& options = {});

/// Llama: load from / export to a Hugging Face folder (see the top of this file). load_llama_hf
/// refuses a folder whose config.json differs from `config` in any field that shapes the model
/// (the key and both values are named).
void load_llama_hf(parallel::ParallelModel& model, const LlamaConfig& config, const std::string& dir);
void export_llama_hf(parallel::ParallelModel& model, const LlamaConfig& config, const std::string& dir,
                     const HfExportOptions& options = {});

/// The HfModelFiles of a Llama config.
HfModelFiles llama_hf_files(const LlamaConfig& config);

/// A c10::Error naming `where`, the field and both values when `expected` and `found` differ in a
/// field that shapes the model.
void check_same_llama_config(const LlamaConfig& expected, const LlamaConfig& found, const std::string& where);

}  // namespace fsdp::models
