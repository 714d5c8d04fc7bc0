#include "fsdp_cpp/models/moe_checkpoint.h"

#include <c10/util/Exception.h>

namespace fsdp::models {

HfModelFiles moe_hf_files(const MoeConfig& config) {
  HfModelFiles files;
  files.config_json = config.to_hf_json();
  files.padded_rows = {"model.embed_tokens.weight", "lm_head.weight"};
  files.vocab_size = config.vocab_size();
  return files;
}

void check_same_moe_config(const MoeConfig& expected, const MoeConfig& found, const std::string& where) {
  auto same = [&](const char* key, auto a, auto b) {
    TORCH_CHECK(a == b, where, ": key '", key, "' is ", b, " but the model was built with ", a);
  };
  // The attention's fields, as Llama's.
  check_same_llama_config(expected.attention_config(), found.attention_config(), where);
  same("moe_intermediate_size", expected.moe_intermediate_size(), found.moe_intermediate_size());
  same("num_experts", expected.num_experts(), found.num_experts());
  same("num_experts_per_tok", expected.num_experts_per_tok(), found.num_experts_per_tok());
  same("norm_topk_prob", expected.norm_topk_prob(), found.norm_topk_prob());
  for (int64_t i = 0; i < expected.num_hidden_layers(); ++i) {
    TORCH_CHECK(expected.is_sparse_layer(i) == found.is_sparse_layer(i), where, ": layer ", i, " is ",
                found.is_sparse_layer(i) ? "sparse" : "dense", " by keys 'mlp_only_layers' and 'decoder_sparse_step', "
                "but the model was built with it ", expected.is_sparse_layer(i) ? "sparse" : "dense");
  }
  same("scoring_func", expected.scoring_func(), found.scoring_func());
  same("n_group", expected.n_group(), found.n_group());
  same("topk_group", expected.topk_group(), found.topk_group());
  same("routed_scaling_factor", expected.routed_scaling_factor(), found.routed_scaling_factor());
  same("n_shared_experts", expected.n_shared_experts(), found.n_shared_experts());
}

void load_moe_hf(parallel::ParallelModel& model, const MoeConfig& config, const std::string& dir) {
  load_hf_checkpoint(model, dir, moe_hf_files(config), [&](const std::string& text, const std::string& where) {
    check_same_moe_config(config, parse_moe_config(text, where, config.vocab_multiple()), where);
  });
}

void export_moe_hf(parallel::ParallelModel& model, const MoeConfig& config, const std::string& dir,
                   const HfExportOptions& options) {
  export_hf_checkpoint(model, dir, moe_hf_files(config), options);
}

}  // namespace fsdp::models
