#pragma once
// What the example GPT supplies to the composition root (parallel/parallel_model.h): how to build
// pipeline stage s of n (the whole model built from a seed, then GPT::keep_stage, so every stage
// keeps the whole model's FQNs and values), its loss, its tensor-parallel plan (parallelize_gpt),
// and its units (each Block).
//
//   auto spec = fsdp::examples::gpt_model_spec(config.tie_embeddings(false), /*init_seed=*/1);
//   auto model = fsdp::parallel::parallelize(pg.comm, spec, options);

#include <cstdint>

#include "fsdp_cpp/examples/gpt_model.h"
#include "fsdp_cpp/examples/gpt_tensor_parallel.h"
#include "fsdp_cpp/parallel/parallel_model.h"

namespace fsdp::examples {

/// The spec above. A model split into several stages needs tie_embeddings(false) (keep_stage
/// refuses a tied model otherwise, an error every rank reports from parallelize).
parallel::ModelSpec gpt_model_spec(const GPTConfig& config, uint64_t init_seed, const GptTensorParallel& tp = {});

}  // namespace fsdp::examples
