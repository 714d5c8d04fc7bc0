// train_lm: a Llama (models/llama.h) or a Qwen3-MoE (models/moe.h, --model moe) trained on a token
// file (data/token_dataset.h) through the composition root (parallel/parallel_model.h) on any
// (dp_replicate, dp_shard, tp, pp) layout of the MPI ranks, from scratch or from a Hugging Face
// folder, exported back to one at the end.
// Prints the layout, a line per step (loss over the global batch's tokens, grad norm, tokens/s,
// MFU against a stated peak) and at the end every step's loss next to the same training unsharded
// on one process (parallel/reference.h), which it must match.
//
//   tools/example.sh --model llama                                  # 2 ranks, fully_shard
//   tools/example.sh --model llama --np 4 --dp 2 --tp 2             # fully_shard x tensor parallel
//   tools/example.sh --model llama --np 4 --pp 2 --dp 2             # pipeline x fully_shard
//   tools/example.sh --model llama --hf-init /models/tiny-llama --export-hf /tmp/out
//   tools/example.sh --model moe --np 4 --dp 2 --tp 2              # 8 experts, top-2, aux loss
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/optim/adamw.h>
#include <torch/torch.h>

#include "fsdp_cpp/checkpoint/full_state_dict_files.h"
#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/data/token_dataset.h"
#include "fsdp_cpp/examples/example_main.h"
#include "fsdp_cpp/examples/flags.h"
#include "fsdp_cpp/tools/bench/counting_allocator.h"
#include "fsdp_cpp/models/hf_checkpoint.h"
#include "fsdp_cpp/models/llama.h"
#include "fsdp_cpp/models/llama_parallel.h"
#include "fsdp_cpp/models/moe.h"
#include "fsdp_cpp/models/moe_checkpoint.h"
#include "fsdp_cpp/models/moe_parallel.h"
#include "fsdp_cpp/parallel/parallel_model.h"
#include "fsdp_cpp/parallel/reference.h"

namespace {

using fsdp::examples::parse_double_flag;
using fsdp::examples::parse_int_flag;

constexpr const char* kUsage = R"(usage: train_lm [options]   (launched by tools/example.sh --model llama|moe ...)
  --model llama|moe      a Llama, or a Qwen3-MoE (default llama)
  --data FILE            token file (default examples/data/corpus.tokens: corpus.txt, BPE vocabulary 512)
  --hf-init DIR          start from a Hugging Face folder (config.json + safetensors); the model's
                         shape flags are then ignored
  --export-hf DIR        write the trained model as a Hugging Face folder at the end
  --dp-replicate R --dp D --tp T --pp P   the layout (dp: ranks each replica is sharded over,
                         default the ranks left)
  --schedule S           gpipe, 1f1b or interleaved_1f1b (default 1f1b)
  --microbatches M       microbatches per step (default: 2, or pp with a pipeline)
  --checkpoint-activations   activation checkpointing on each decoder layer
  --sequence-parallel    with --tp: the residual stream and norms split along the sequence
  --cp C                 context parallel: each sequence split over C ranks (ring attention; --seq
                         must divide into 2 x C pieces); Llama
  --ep E                 expert parallel: the experts split over E of the data-parallel ranks
                         (dp x cp must divide by E; tokens dispatched by all-to-all); MoE
  --steps S --layers L --hidden H --heads N --kv-heads K --intermediate I --seq T --batch B (per data rank)
  --lr X --clip X (0: off) --seed N --threads N
  MoE: --experts E (8) --top-k K (2) --moe-intermediate I (64) --shared-experts N (0)
       --aux-coef X (load-balancing loss, 0.01; 0: off) --scoring softmax|sigmoid
       --bias-rate X (sigmoid: DeepSeek-V3's aux-loss-free bias update per step, default 0.001)
  --peak-tflops X        the peak per rank that MFU is stated against (default 0.1: about what one core
                         of this class of CPU does in float32; an H100's bf16 dense peak is 989)
  --check-unsharded 0|1  train the unsharded model on one process too and compare (default 1)
  --activation-budget-mib X   stop after the first step, on every rank, when its forward/backward peak
                         above the held state exceeds X MiB on some rank (the memory a rank can give to
                         activations; --cp splits them)
)";

struct Flags {
  std::string model = "llama", data = "examples/data/corpus.tokens", hf_init, export_hf, schedule = "1f1b",
              scoring = "softmax";
  int64_t experts = 8, top_k = 2, moe_intermediate = 64, shared_experts = 0;
  double aux_coef = 0.01, bias_rate = 0.001;
  int dp_replicate = 1, dp = -1, tp = 1, pp = 1, cp = 1, ep = 1, microbatches = 0;
  bool checkpoint_activations = false, sequence_parallel = false, check_unsharded = true;
  int64_t steps = 20, layers = 4, hidden = 64, heads = 4, kv_heads = 2, intermediate = 176, seq = 64, batch = 4,
          threads = 1;
  double lr = 3e-3, clip = 1.0, peak_tflops = 0.1, activation_budget_mib = 0;
  uint64_t seed = 0;
};

Flags parse_flags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string name = argv[i];
    if (name == "--help" || name == "-h") throw std::invalid_argument("help");
    if (name == "--checkpoint-activations") { f.checkpoint_activations = true; continue; }
    if (name == "--sequence-parallel") { f.sequence_parallel = true; continue; }
    if (i + 1 >= argc) throw std::invalid_argument(name + " expects a value");
    const std::string value = argv[++i];
    if (name == "--model") {
      if (value != "llama" && value != "moe") throw std::invalid_argument("--model expects llama or moe (got '" + value + "')");
      f.model = value;
    }
    else if (name == "--scoring") f.scoring = value;
    else if (name == "--experts") f.experts = parse_int_flag(name, value, 1);
    else if (name == "--top-k") f.top_k = parse_int_flag(name, value, 1);
    else if (name == "--moe-intermediate") f.moe_intermediate = parse_int_flag(name, value, 1);
    else if (name == "--shared-experts") f.shared_experts = parse_int_flag(name, value, 0);
    else if (name == "--aux-coef") f.aux_coef = parse_double_flag(name, value, 0.0);
    else if (name == "--bias-rate") f.bias_rate = parse_double_flag(name, value, 0.0);
    else if (name == "--data") f.data = value;
    else if (name == "--hf-init") f.hf_init = value;
    else if (name == "--export-hf") f.export_hf = value;
    else if (name == "--schedule") f.schedule = value;
    else if (name == "--dp-replicate") f.dp_replicate = static_cast<int>(parse_int_flag(name, value, 1));
    else if (name == "--dp") f.dp = static_cast<int>(parse_int_flag(name, value, 1));
    else if (name == "--tp") f.tp = static_cast<int>(parse_int_flag(name, value, 1));
    else if (name == "--pp") f.pp = static_cast<int>(parse_int_flag(name, value, 1));
    else if (name == "--cp") f.cp = static_cast<int>(parse_int_flag(name, value, 1));
    else if (name == "--ep") f.ep = static_cast<int>(parse_int_flag(name, value, 1));
    else if (name == "--microbatches") f.microbatches = static_cast<int>(parse_int_flag(name, value, 1));
    else if (name == "--steps") f.steps = parse_int_flag(name, value, 1);
    else if (name == "--layers") f.layers = parse_int_flag(name, value, 1);
    else if (name == "--hidden") f.hidden = parse_int_flag(name, value, 1);
    else if (name == "--heads") f.heads = parse_int_flag(name, value, 1);
    else if (name == "--kv-heads") f.kv_heads = parse_int_flag(name, value, 1);
    else if (name == "--intermediate") f.intermediate = parse_int_flag(name, value, 1);
    else if (name == "--seq") f.seq = parse_int_flag(name, value, 1);
    else if (name == "--batch") f.batch = parse_int_flag(name, value, 1);
    else if (name == "--threads") f.threads = parse_int_flag(name, value, 1);
    else if (name == "--seed") f.seed = static_cast<uint64_t>(parse_int_flag(name, value, 0));
    else if (name == "--lr") f.lr = parse_double_flag(name, value, 1e-12);
    else if (name == "--clip") f.clip = parse_double_flag(name, value, 0.0);
    else if (name == "--peak-tflops") f.peak_tflops = parse_double_flag(name, value, 1e-9);
    else if (name == "--activation-budget-mib") f.activation_budget_mib = parse_double_flag(name, value, 0.0);
    else if (name == "--check-unsharded") f.check_unsharded = parse_int_flag(name, value, 0) != 0;
    else throw std::invalid_argument("unknown argument '" + name + "'");
  }
  if (f.microbatches == 0) f.microbatches = f.pp > 1 ? f.pp : 2;
  fsdp::pipeline::parse_schedule(f.schedule);  // a c10::Error naming the schedules
  return f;
}

using Clock = std::chrono::steady_clock;

fsdp::data::TokenDataset dataset(const std::shared_ptr<const fsdp::data::TokenFile>& file, const Flags& f,
                                 int64_t data_rank, int64_t data_size) {
  return fsdp::data::TokenDataset(
      file, fsdp::data::TokenDatasetOptions(f.seq).seed(f.seed).data_rank(data_rank).data_size(data_size));
}

// What the loop needs of a model: its spec, Hugging Face load and export, a description, its
// FLOPs per token, and what runs after each optimizer step (the MoE's router bias).
struct LanguageModel {
  fsdp::parallel::ModelSpec spec;
  int64_t vocab_size = 0;
  std::string description;
  double flops_per_token = 0;
  std::function<void(fsdp::parallel::ParallelModel&, const std::string&)> load, save;
  std::function<void(fsdp::parallel::ParallelModel&)> after_step;
  std::function<void(fsdp::parallel::UnshardedReference&)> reference_after_step;
  /// Lines of the plan about this model's cp/ep communication (closed forms), or empty.
  std::function<std::string(const Flags&, const fsdp::parallel::ParallelDims&)> plan;
};

std::string megabytes(int64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.2f MB", static_cast<double>(bytes) / 1e6);
  return text;
}

LanguageModel llama(const Flags& f, int64_t vocab, int64_t vocab_multiple, uint64_t init_seed) {
  const fsdp::models::LlamaConfig config =
      f.hf_init.empty() ? fsdp::models::LlamaConfig(vocab)
                              .hidden_size(f.hidden)
                              .intermediate_size(f.intermediate)
                              .num_hidden_layers(f.layers)
                              .num_attention_heads(f.heads)
                              .num_key_value_heads(f.kv_heads)
                              .max_position_embeddings(std::max<int64_t>(f.seq, 2048))
                              .rope(fsdp::models::RopeParameters{.rope_type = "llama3", .rope_theta = 500000.0,
                                                                 .original_max_position_embeddings = 1024})
                              .vocab_multiple(vocab_multiple)
                        : fsdp::models::read_llama_config(f.hf_init, vocab_multiple);
  LanguageModel m;
  m.spec = fsdp::models::llama_model_spec(config, init_seed,
                                          fsdp::models::LlamaParallel().sequence_parallel(f.sequence_parallel));
  m.vocab_size = config.vocab_size();
  char text[256];
  std::snprintf(text, sizeof(text), "Llama, %" PRId64 " layers, hidden %" PRId64 ", %" PRId64 " heads (%" PRId64
                " kv), intermediate %" PRId64 ", vocabulary %" PRId64 " (padded to %" PRId64 "), %.2fM parameters",
                config.num_hidden_layers(), config.hidden_size(), config.num_attention_heads(), config.kv_heads(),
                config.intermediate_size(), config.vocab_size(), config.padded_vocab_size(),
                static_cast<double>(config.num_parameters()) / 1e6);
  m.description = text;
  m.flops_per_token = config.training_flops_per_token(f.seq);
  m.load = [config](fsdp::parallel::ParallelModel& model, const std::string& dir) {
    fsdp::models::load_llama_hf(model, config, dir);
  };
  m.save = [config](fsdp::parallel::ParallelModel& model, const std::string& dir) {
    fsdp::models::export_llama_hf(model, config, dir);
  };
  m.plan = [config](const Flags& f, const fsdp::parallel::ParallelDims& dims) {
    if (dims.cp == 1) return std::string();
    return "plan: context parallel: the ring sends " +
           megabytes(fsdp::models::llama_ring_bytes_per_step(config, dims, f.batch, f.seq, f.microbatches,
                                                             f.checkpoint_activations)) +
           " per rank per step (K/V forward, K/V/dK/dV backward" +
           (f.checkpoint_activations ? ", K/V again in the recomputed forward" : "") + ")\n";
  };
  return m;
}

LanguageModel moe(const Flags& f, int64_t vocab, int64_t vocab_multiple, uint64_t init_seed) {
  TORCH_CHECK(f.scoring == "softmax" || f.scoring == "sigmoid", "--scoring expects softmax or sigmoid (got '",
              f.scoring, "')");
  const fsdp::models::MoeConfig config =
      f.hf_init.empty() ? fsdp::models::MoeConfig(vocab)
                              .hidden_size(f.hidden)
                              .intermediate_size(f.intermediate)
                              .moe_intermediate_size(f.moe_intermediate)
                              .num_hidden_layers(f.layers)
                              .num_attention_heads(f.heads)
                              .num_key_value_heads(f.kv_heads)
                              .max_position_embeddings(std::max<int64_t>(f.seq, 2048))
                              .num_experts(f.experts)
                              .num_experts_per_tok(f.top_k)
                              .norm_topk_prob(true)
                              .n_shared_experts(f.shared_experts)
                              .scoring_func(f.scoring)
                              .router_bias_update_rate(f.scoring == "sigmoid" ? f.bias_rate : 0.0)
                              .output_router_logits(f.aux_coef > 0)
                              .router_aux_loss_coef(f.aux_coef)
                              .vocab_multiple(vocab_multiple)
                        : fsdp::models::read_moe_config(f.hf_init, vocab_multiple);
  LanguageModel m;
  m.spec = fsdp::models::moe_model_spec(config, init_seed);
  m.vocab_size = config.vocab_size();
  char text[320];
  std::snprintf(text, sizeof(text), "Qwen3-MoE, %" PRId64 " layers (%" PRId64 " with experts), hidden %" PRId64
                ", %" PRId64 " heads (%" PRId64 " kv), %" PRId64 " experts of %" PRId64 ", top-%" PRId64
                " (%s scores), %" PRId64 " shared, aux-loss coefficient %.3g, vocabulary %" PRId64,
                config.num_hidden_layers(), config.num_sparse_layers(), config.hidden_size(),
                config.num_attention_heads(), config.kv_heads(), config.num_experts(), config.moe_intermediate_size(),
                config.num_experts_per_tok(), config.scoring_func().c_str(), config.n_shared_experts(),
                config.has_aux_loss() ? config.router_aux_loss_coef() : 0.0, config.vocab_size());
  m.description = text;
  m.flops_per_token = config.training_flops_per_token(f.seq);
  m.load = [config](fsdp::parallel::ParallelModel& model, const std::string& dir) {
    fsdp::models::load_moe_hf(model, config, dir);
  };
  m.save = [config](fsdp::parallel::ParallelModel& model, const std::string& dir) {
    fsdp::models::export_moe_hf(model, config, dir);
  };
  m.plan = [config](const Flags& f, const fsdp::parallel::ParallelDims& dims) {
    if (dims.ep == 1) return std::string();
    return "plan: expert parallel: " + std::to_string(config.num_experts() / dims.ep) +
           " experts per ep rank; the all-to-alls move " +
           megabytes(fsdp::models::moe_all_to_all_bytes_per_step(config, dims, f.batch, f.seq, f.microbatches)) +
           " per rank per step with balanced routing (dispatch and combine, forward and backward; the measured "
           "figure follows the routing)\n";
  };
  if (config.has_score_correction_bias() && config.router_bias_update_rate() > 0) {
    m.after_step = [](fsdp::parallel::ParallelModel& model) { fsdp::models::update_moe_router_bias(model); };
    m.reference_after_step = [](fsdp::parallel::UnshardedReference& reference) {
      for (const auto& part : reference.parts()) {
        auto& whole = dynamic_cast<fsdp::models::MoeForCausalLMImpl&>(*part.module);
        whole.update_router_bias(whole.router_loads());  // one process sees every data rank's tokens
      }
    };
  }
  return m;
}

int run(const Flags& f, const fsdp::comm::ProcessGroup& group) {
  const auto file = std::make_shared<const fsdp::data::TokenFile>(f.data);
  // The vocabulary padded so that every tp up to 8 splits it evenly ([Note: padded vocabulary]).
  const int64_t vocab_multiple = std::lcm<int64_t>(8, f.tp);
  const uint64_t init_seed = f.seed + 1;
  const LanguageModel lm = f.model == "moe" ? moe(f, file->vocab_size(), vocab_multiple, init_seed)
                                            : llama(f, file->vocab_size(), vocab_multiple, init_seed);
  TORCH_CHECK(file->vocab_size() <= lm.vocab_size, "the token file '", f.data, "' has a vocabulary of ",
              file->vocab_size(), " ids but the model's config has vocab_size ", lm.vocab_size,
              (f.hf_init.empty() ? "" : " ('" + f.hf_init + "/config.json')"),
              ": tokens of another tokenizer would index past the embedding");
  const fsdp::parallel::ModelSpec& spec = lm.spec;
  const auto options = fsdp::parallel::ParallelOptions()
                           .dims({.dp_replicate = f.dp_replicate, .dp_shard = f.dp, .tp = f.tp, .pp = f.pp,
                                  .cp = f.cp, .ep = f.ep})
                           .schedule(fsdp::pipeline::parse_schedule(f.schedule))
                           .n_microbatches(f.microbatches)
                           .checkpoint_activations(f.checkpoint_activations)
                           .seed(f.seed);
  auto model = fsdp::parallel::parallelize(group.comm, spec, options);
  if (!f.hf_init.empty()) lm.load(model, f.hf_init);
  const auto& mesh = model.mesh();
  const bool main_rank = group.comm->rank() == 0;
  const int world = group.comm->size();
  const double flops_per_token = lm.flops_per_token;
  if (main_rank) {
    std::printf("train_lm: %s\n", model.describe().c_str());
    std::printf("model: %s%s\n"
                "data: %s, %" PRId64 " tokens; batch %" PRId64 " x %" PRId64 " tokens per data rank, %d data ranks\n"
                "MFU: %.3g GFLOP per token (6N + attention) against a stated peak of %.3g TFLOP/s per rank\n\n",
                lm.description.c_str(), f.hf_init.empty() ? "" : (", from " + f.hf_init).c_str(), f.data.c_str(),
                file->num_tokens(), f.batch, f.seq, mesh.data_world(), flops_per_token / 1e9, f.peak_tflops);
    if (lm.plan) std::printf("%s", lm.plan(f, mesh.dims()).c_str());
    std::fflush(stdout);
  }
  // The optimizer and the data: by data rank, never by world rank.
  torch::optim::AdamW optim(model.parameters(), torch::optim::AdamWOptions(f.lr).weight_decay(0.1));
  auto data = dataset(file, f, mesh.data_rank(), mesh.data_world());
  std::vector<double> losses;
  // What the cp ring and the ep all-to-alls move, measured (their groups carry nothing else), and
  // the CPU allocator's peak above what was held before each step's forward (activations,
  // unsharded units, gradients), counted by tools/bench's CountingAllocator.
  auto& alloc = fsdp::bench::CountingAllocator::install();
  auto moved = [&] {
    int64_t b = 0;
    if (mesh.dims().cp > 1) b += mesh.cp()->stats(fsdp::comm::CollectiveKind::kSend).bytes;
    if (mesh.dims().ep > 1) b += mesh.ep()->stats(fsdp::comm::CollectiveKind::kAllToAllV).bytes;
    return b;
  };
  int64_t step_peak = 0;
  // The forward/backward peak above the state held before it, the largest over the ranks.
  auto largest_peak = [&] {
    at::Tensor peak = at::tensor({static_cast<double>(step_peak)}, at::kDouble);
    group.comm->all_reduce(peak, c10d::ReduceOp::MAX, "train_lm peak").wait();
    return peak.item<double>();
  };
  for (int64_t step = 1; step <= f.steps; ++step) {
    const auto b = data.next_batch(f.batch);
    const int64_t moved_before = moved();
    alloc.mark();
    const auto t0 = Clock::now();
    const at::Tensor loss = model.forward_backward(b.inputs, b.targets);
    step_peak = std::max(step_peak, alloc.peak_since_mark());
    const double norm = f.clip > 0 ? model.clip_grad_norm_(f.clip) : 0.0;
    optim.step();
    if (lm.after_step) lm.after_step(model);
    model.zero_grad();
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    if (step == 1 && f.activation_budget_mib > 0) {
      const double mib = largest_peak() / (1 << 20);
      TORCH_CHECK(mib <= f.activation_budget_mib, "the first step's forward/backward peak above the held state is ",
                  mib, " MiB on some rank, over the budget of ", f.activation_budget_mib, " MiB per rank (",
                  f.seq, "-token sequences at cp = ", mesh.dims().cp, "): split the sequences over more ranks "
                  "with --cp");
      if (main_rank) std::printf("activation budget: %.2f of %.2f MiB per rank\n", mib, f.activation_budget_mib);
    }
    losses.push_back(model.global_loss(loss));
    if (main_rank && (step == 1 || step % 5 == 0 || step == f.steps)) {
      const double tokens_per_s = static_cast<double>(f.batch * f.seq * mesh.data_world()) / seconds;
      const double mfu = flops_per_token * tokens_per_s / (world * f.peak_tflops * 1e12);
      std::printf("step %3" PRId64 "  loss %.4f  grad norm %.4f  %.0f tokens/s (%.0f per rank)  MFU %.1f%%", step,
                  losses.back(), norm, tokens_per_s, tokens_per_s / world, 100.0 * mfu);
      if (mesh.dims().cp > 1 || mesh.dims().ep > 1) {
        std::printf("  %s %.2f MB", mesh.dims().cp > 1 ? "ring" : "all-to-all", (moved() - moved_before) / 1e6);
      }
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  const double peak = largest_peak();  // collective: every rank
  if (main_rank) {
    std::printf("forward/backward peak above the held state: %.2f MiB per rank (largest rank; the "
                "allocator's count)\n", peak / (1 << 20));
  }
  if (!f.export_hf.empty()) {
    lm.save(model, f.export_hf);
    if (main_rank) std::printf("\nexported to %s (transformers.AutoModelForCausalLM.from_pretrained loads it)\n", f.export_hf.c_str());
  }
  if (!f.check_unsharded || !main_rank) return 0;
  // The same training, unsharded on this process: the same seeds, the same global batches.
  fsdp::parallel::UnshardedReference reference(spec, options);
  if (!f.hf_init.empty()) {
    torch::NoGradGuard no_grad;
    const auto weights = fsdp::load_safetensors(f.hf_init);
    for (const auto& part : reference.parts()) {
      auto values = part.module->named_parameters();
      for (const auto& item : part.module->named_buffers()) values.insert(item.key(), item.value());  // router biases
      for (auto& item : values) {
        const at::Tensor* w = weights.find(item.key());
        TORCH_CHECK(w != nullptr, "'", f.hf_init, "' has no '", item.key(), "'");
        item.value().narrow(0, 0, w->size(0)).copy_(*w);  // the padding rows stay zero
      }
    }
  }
  std::vector<fsdp::data::TokenDataset> ref_data;
  for (int q = 0; q < mesh.data_world(); ++q) ref_data.push_back(dataset(file, f, q, mesh.data_world()));
  return fsdp::examples::unsharded_difference(
      reference, torch::optim::AdamWOptions(f.lr).weight_decay(0.1), f.clip, losses, "same seeds, same batches",
      [&](int64_t) {
        std::vector<fsdp::parallel::Batch> global;
        for (auto& d : ref_data) {
          const auto b = d.next_batch(f.batch);
          global.push_back({b.inputs, b.targets});
        }
        return global;
      },
      lm.reference_after_step);
}

}  // namespace

int main(int argc, char** argv) {
  return fsdp::examples::example_main<Flags>("train_lm", kUsage, argc, argv, parse_flags, run);
}
