// The main example: trains a small GPT-style character-level language model with fully_shard on
// every block and on the root, over the ranks of the launch (tools/example.sh: 2 MPI ranks on the
// CPU). Each rank trains on its own random windows of the text that ships with the repository
// (examples/data/corpus.txt).
//
//   tools/example.sh [--np N] [--steps 100] [--strategy full|grad_op|no_shard] [--help] ...
//   tools/example.sh --steps 50 --save /tmp/gpt              # checkpoint after step 50
//   tools/example.sh --np 3 --steps 100 --resume /tmp/gpt    # continue on 3 ranks to step 100
//
// Rank 0 prints one line per step (loss averaged over the ranks, tokens per second), then what
// sharding saved: per-rank bytes of parameters, gradients and AdamW state next to what one rank
// would hold unsharded, and the collectives per step. Last, every rank trains the same model
// unsharded on all ranks' batches of every step (the gradient DDP would compute) and the final
// losses must agree within a relative 1e-3: the program exits 1 otherwise, and 1 on any error
// (printed with the rank), 2 on bad flags. `--save DIR` writes a distributed checkpoint (model,
// AdamW state, the step, and the world size of each step so far) at the end; `--resume DIR`
// loads one (saved on any number of ranks) and continues from the step after it: the unsharded
// comparison then replays the whole run, each step with the ranks that trained it.
//
// After training, every rank samples text from the sharded model: GPT::generate is a method other
// than forward, called through the root's hooks with fsdp::contract::call_method (each token
// all-gathers the units, so every rank runs it; greedy decoding, or a sampling seed shared by all
// ranks, gives every rank the same text, which is checked), and rank 0 prints it.

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <exception>
#include <map>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/tensor.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/cuda.h>
#include <torch/optim/adamw.h>
#include <torch/utils.h>

#include "fsdp_cpp/checkpoint/distributed_checkpoint.h"
#include "fsdp_cpp/checkpoint/full_state_dict_files.h"
#include "fsdp_cpp/checkpoint/load_pretrained.h"
#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/comm/device_mesh.h"
#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/composable/activation_checkpoint.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/fully_shard_tree.h"
#include "fsdp_cpp/composable/plan.h"
#include "fsdp_cpp/composable/wrap_policy.h"
#include "fsdp_cpp/contract/hooked_call.h"
#include "fsdp_cpp/examples/char_corpus.h"
#include "fsdp_cpp/examples/gpt_model.h"
#include "fsdp_cpp/examples/gpt_tensor_parallel.h"
#include "fsdp_cpp/optim/adamw.h"

namespace {

using Clock = std::chrono::steady_clock;
using fsdp::comm::CollectiveKind;
using fsdp::examples::GPT;
using fsdp::examples::GPTConfig;

constexpr double kParityTolerance = 1e-3;  // relative, on the final loss
// With --quantize-weights or --quantize-grads: the final loss within 2% (relative) of the
// full-precision unsharded reference (docs/quantized_communication.md; the 300-step curves in tools/bench/README.md).
constexpr double kQuantizedTolerance = 2e-2;
// With --optimizer-states bf16: the final loss within 2% (relative) of the unsharded reference,
// whose AdamW keeps float32 moments (docs/optimizers.md, "bfloat16 moments": 1.5e-2 measured at
// step 300, where one batch's loss moves; the means over 25 steps within 4.2e-3).
constexpr double kBf16StatesTolerance = 2e-2;
constexpr double kWeightDecay = 0.01;

constexpr const char* kUsage =
    R"(usage: train_gpt [flags]   (launch with mpirun, or tools/example.sh)
  --steps N              optimizer steps (default 100)
  --layers N             transformer blocks (default 4)
  --d-model N            residual width, a multiple of --heads (default 128)
  --heads N              attention heads (default 4)
  --context N            tokens per training window (default 64)
  --batch N              windows per rank per step (default 16)
  --lr X                 AdamW learning rate (default 1e-3; weight decay 0.01). From about 2e-3
                         this model's training turns unstable for a while and rounding
                         differences grow until the unsharded comparison fails
  --strategy S           full (FULL_SHARD), grad_op (SHARD_GRAD_OP), no_shard (default full)
  --seed N               model initialisation and batches (default 0)
  --check-unsharded 0|1  train an unsharded copy and compare final losses (default 1)
  --threads N            intra-op threads per rank (default 1: ranks share this machine's cores)
  --save DIR             after the last step, save a checkpoint to DIR (fsdp::dcp::save: every
                         rank writes its shards; DIR is replaced atomically)
  --resume DIR           load the checkpoint in DIR (saved on any number of ranks, any strategy)
                         and continue from the step after it up to --steps
  --export DIR           after the last step, write the trained weights as a Hugging Face
                         safetensors model in DIR (rank 0; readable with --init-from, Python's
                         safetensors, transformers)
  --profile FILE         record LibTorch's profiler over steps 2-4 on rank 0 and write a Chrome
                         trace to FILE (open in chrome://tracing or https://ui.perfetto.dev; the
                         FSDP::pre_forward, FSDP::all_gather, FSDP::reduce_scatter, ... scopes)
  --meta-init            build the model on the meta device (fsdp::MetaInitGuard: no memory) and
                         let fully_shard materialize only each rank's shards (the values are the
                         same on any number of ranks, but not those of an eager build)
  --init-from PATH       load pretrained weights (a model.safetensors file, or a folder / index of
                         model-0000k-of-0000n.safetensors) straight into the shards: each rank
                         reads only its slices (fsdp::load_pretrained)
  --tp N                 tensor parallel size (default 1): the ranks form a (dp, tp) = (np / N, N)
                         mesh; each block's attention heads and MLP and the tied embedding's
                         vocabulary are split over the N ranks of a tp group
                         (fsdp::parallelize_module, examples/gpt_tensor_parallel.h), and
                         fully_shard shards the pieces over the np / N ranks of a dp group. The
                         ranks of one tp group train on the same batch
  --vocab-divisible-by N the vocabulary is padded to a multiple of N and of --tp (default 1; as
                         Megatron's --make-vocab-size-divisible-by). Checkpoints move between tp
                         sizes when every run pads to the same size (e.g. 4 for --tp 1, 2 and 4)
  --sequence-parallel    with --tp: LayerNorms and the residual stream split along the sequence
  --loss-parallel        with --tp: the loss on vocabulary-parallel logits, never gathered
  --sample N             after training, characters to generate from the sharded model (default
                         80; 0: none). Skipped with --sequence-parallel or --loss-parallel
  --prompt TEXT          the text the sample continues (default "The keeper "; characters of the
                         training text only)
  --temperature X        0 (default): greedy decoding; above 0: sampling from softmax(logits / X)
                         with --seed (the same draws on every rank)
  --quantize-weights     all-gather the parameters in blockwise int8 (ZeRO++'s qwZ:
                         fsdp::int8_block_codec as FullyShardOptions::all_gather_codec); the
                         unsharded comparison then allows a relative 2e-2 on the final loss
  --quantize-grads       reduce the gradients in blockwise int8 (ZeRO++'s qgZ: an all-to-all
                         of int8 chunks summed in float32; FullyShardOptions::reduce_codec)
  --quant-block N        elements per int8 block, one scale each (default 256)
  --quant-scales S       fp32 or bf16 scales (default fp32)
  --reshard-after-forward K
                         FULL_SHARD resharding after forward to groups of K consecutive ranks
                         (ZeRO++'s hpZ: FullyShardOptions::reshard_after_forward(K)): each rank
                         keeps 1/K of each block's parameters until its backward, which
                         all-gathers inside the group; K must divide the ranks fully_shard shards
                         over (the plan shows the slices and the group's all-gathers)
  --optimizer-states S   fp32 (default: torch::optim::AdamW) or bf16 (fsdp::optim::AdamW with
                         bfloat16 moments, stochastic rounding seeded by --seed: 12 instead of 16
                         bytes per parameter); the unsharded comparison (float32 moments) then
                         allows a relative 2e-2 on the final loss
  --checkpoint-activations
                         activation checkpointing on every block
                         (fsdp::checkpoint_activations_tree): each block keeps only its input
                         through forward and recomputes the rest in backward (same gradients, less
                         memory, about one more forward of time)
)";

/// The command line.
struct Flags {
  int64_t steps = 100;
  int64_t layers = 4;
  int64_t d_model = 128;
  int64_t heads = 4;
  int64_t context = 64;
  int64_t batch = 16;
  double lr = 1e-3;
  std::string strategy = "full";
  uint64_t seed = 0;
  bool check_unsharded = true;
  int64_t threads = 1;
  std::string save_dir;
  std::string export_dir;
  std::string resume_dir;
  bool checkpoint_activations = false;
  bool meta_init = false;
  int64_t tp = 1;
  int64_t vocab_divisible_by = 1;
  bool sequence_parallel = false;
  bool loss_parallel = false;
  std::string init_from;
  std::string profile;
  int64_t sample = 80;
  std::string prompt = "The keeper ";
  double temperature = 0.0;
  bool quantize_weights = false;
  bool quantize_grads = false;
  int64_t quant_block = 256;
  int64_t reshard_group = 0;  // --reshard-after-forward: 0 is none
  std::string quant_scales = "fp32";
  std::string optimizer_states = "fp32";
  bool help = false;
};

int64_t parse_int(const std::string& flag, const std::string& value, int64_t min) {
  size_t used = 0;
  int64_t parsed = 0;
  try {
    parsed = std::stoll(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != value.size() || value.empty() || parsed < min) {
    throw std::invalid_argument(flag + " expects an integer >= " + std::to_string(min) +
                                " (got '" + value + "')");
  }
  return parsed;
}

double parse_positive_double(const std::string& flag, const std::string& value) {
  size_t used = 0;
  double parsed = 0.0;
  try {
    parsed = std::stod(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != value.size() || value.empty() || !(parsed > 0.0) || !std::isfinite(parsed)) {
    throw std::invalid_argument(flag + " expects a positive number (got '" + value + "')");
  }
  return parsed;
}

double parse_nonnegative_double(const std::string& flag, const std::string& value) {
  size_t used = 0;
  double parsed = -1.0;
  try {
    parsed = std::stod(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != value.size() || value.empty() || !(parsed >= 0.0) || !std::isfinite(parsed)) {
    throw std::invalid_argument(flag + " expects a number >= 0 (got '" + value + "')");
  }
  return parsed;
}

/// LibTorch's profiler (Kineto, CPU activities; CUDA ones too where a GPU is present): records
/// every operator and the library's scopes (FSDP::pre_forward, FSDP::all_gather, ...).
void start_profiler() {
  namespace profiler = torch::autograd::profiler;
  std::set<torch::profiler::impl::ActivityType> activities{torch::profiler::impl::ActivityType::CPU};
  if (torch::cuda::is_available()) activities.insert(torch::profiler::impl::ActivityType::CUDA);
  const profiler::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO);
  profiler::prepareProfiler(config, activities);
  profiler::enableProfiler(config, activities);
}

/// Stops the profiler and writes its Chrome trace.
void stop_profiler(const std::string& path, int64_t from, int64_t to) {
  std::unique_ptr<torch::autograd::profiler::ProfilerResult> result = torch::autograd::profiler::disableProfiler();
  result->save(path);
  std::printf("profile of steps %" PRId64 "-%" PRId64 " (rank 0) written to %s: open it in "
              "chrome://tracing or https://ui.perfetto.dev\n", from, to, path.c_str());
  std::fflush(stdout);
}

/// Parses `--name value` and `--name=value`; std::invalid_argument names the bad flag.
Flags parse_flags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    std::string name = argv[i];
    if (name == "--help" || name == "-h") {
      f.help = true;
      continue;
    }
    if (name == "--meta-init") {  // a switch: no value
      f.meta_init = true;
      continue;
    }
    if (name == "--checkpoint-activations") {  // a switch: no value
      f.checkpoint_activations = true;
      continue;
    }
    if (name == "--sequence-parallel") {  // a switch: no value
      f.sequence_parallel = true;
      continue;
    }
    if (name == "--loss-parallel") {  // a switch: no value
      f.loss_parallel = true;
      continue;
    }
    if (name == "--quantize-weights" || name == "--quantize-grads") {  // switches: no value
      (name == "--quantize-weights" ? f.quantize_weights : f.quantize_grads) = true;
      continue;
    }
    if (name.rfind("--", 0) != 0) throw std::invalid_argument("unexpected argument '" + name + "'");
    std::string value;
    if (const size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    } else {
      if (i + 1 >= argc) throw std::invalid_argument(name + " needs a value");
      value = argv[++i];
    }
    if (name == "--steps") f.steps = parse_int(name, value, 1);
    else if (name == "--layers") f.layers = parse_int(name, value, 1);
    else if (name == "--d-model") f.d_model = parse_int(name, value, 1);
    else if (name == "--heads") f.heads = parse_int(name, value, 1);
    else if (name == "--context") f.context = parse_int(name, value, 1);
    else if (name == "--batch") f.batch = parse_int(name, value, 1);
    else if (name == "--lr") f.lr = parse_positive_double(name, value);
    else if (name == "--seed") f.seed = static_cast<uint64_t>(parse_int(name, value, 0));
    else if (name == "--threads") f.threads = parse_int(name, value, 1);
    else if (name == "--tp") f.tp = parse_int(name, value, 1);
    else if (name == "--vocab-divisible-by") f.vocab_divisible_by = parse_int(name, value, 1);
    else if (name == "--check-unsharded") f.check_unsharded = parse_int(name, value, 0) != 0;
    else if (name == "--save") f.save_dir = value;
    else if (name == "--export") f.export_dir = value;
    else if (name == "--resume") f.resume_dir = value;
    else if (name == "--profile") f.profile = value;
    else if (name == "--init-from") f.init_from = value;
    else if (name == "--sample") f.sample = parse_int(name, value, 0);
    else if (name == "--prompt") f.prompt = value;
    else if (name == "--temperature") f.temperature = parse_nonnegative_double(name, value);
    else if (name == "--quant-block") f.quant_block = parse_int(name, value, 1);
    else if (name == "--reshard-after-forward") f.reshard_group = parse_int(name, value, 1);
    else if (name == "--quant-scales") {
      if (value != "fp32" && value != "bf16") {
        throw std::invalid_argument("--quant-scales expects fp32 or bf16 (got '" + value + "')");
      }
      f.quant_scales = value;
    }
    else if (name == "--optimizer-states") {
      if (value != "fp32" && value != "bf16") {
        throw std::invalid_argument("--optimizer-states expects fp32 or bf16 (got '" + value + "')");
      }
      f.optimizer_states = value;
    }
    else if (name == "--strategy") {
      if (value != "full" && value != "grad_op" && value != "no_shard") {
        throw std::invalid_argument("--strategy expects full, grad_op or no_shard (got '" + value +
                                    "')");
      }
      f.strategy = value;
    } else {
      throw std::invalid_argument("unknown flag '" + name + "'");
    }
  }
  if ((f.sequence_parallel || f.loss_parallel) && f.tp == 1) {
    throw std::invalid_argument("--sequence-parallel and --loss-parallel need --tp larger than 1");
  }
  if (f.prompt.empty()) throw std::invalid_argument("--prompt expects at least one character");
  if (f.d_model % f.heads != 0) {
    throw std::invalid_argument("--d-model (" + std::to_string(f.d_model) +
                                ") must be a multiple of --heads (" + std::to_string(f.heads) +
                                ")");
  }
  return f;
}

fsdp::ShardingStrategy to_strategy(const std::string& name) {
  if (name == "grad_op") return fsdp::ShardingStrategy::kShardGradOp;
  if (name == "no_shard") return fsdp::ShardingStrategy::kNoShard;
  return fsdp::ShardingStrategy::kFullShard;
}

const char* strategy_label(fsdp::ShardingStrategy strategy) {
  switch (strategy) {
    case fsdp::ShardingStrategy::kFullShard: return "FULL_SHARD";
    case fsdp::ShardingStrategy::kShardGradOp: return "SHARD_GRAD_OP";
    case fsdp::ShardingStrategy::kNoShard: return "NO_SHARD";
  }
  return "?";
}

/// The collectives per training step the design prescribes for `blocks` block units and the root.
std::string expected_collectives(fsdp::ShardingStrategy strategy, int64_t blocks) {
  const std::string units = std::to_string(blocks + 1);
  switch (strategy) {
    case fsdp::ShardingStrategy::kFullShard:
      return std::to_string(2 * blocks + 1) + " all-gathers (" + units + " in forward, " +
             std::to_string(blocks) + " in backward: the root stays unsharded), " + units +
             " reduce-scatters";
    case fsdp::ShardingStrategy::kShardGradOp:
      return units + " all-gathers (forward only), " + units + " reduce-scatters";
    case fsdp::ShardingStrategy::kNoShard:
      return "no all-gathers, " + units + " all-reduces of the gradients";
  }
  return "?";
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

/// Bytes one rank holds for training state.
struct StateBytes {
  int64_t params = 0;
  int64_t grads = 0;
  int64_t optimizer = 0;
};

int64_t nbytes(const at::Tensor& t) { return t.defined() ? static_cast<int64_t>(t.nbytes()) : 0; }

/// AdamW's state: exp_avg, exp_avg_sq (and max_exp_avg_sq with amsgrad) per parameter, plus the
/// step counter, an int64_t per parameter in LibTorch (not a tensor).
int64_t adamw_state_bytes(const torch::optim::AdamW& optim) {
  int64_t total = 0;
  for (const auto& entry : optim.state()) {
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*entry.second);
    total += nbytes(s.exp_avg()) + nbytes(s.exp_avg_sq()) + nbytes(s.max_exp_avg_sq()) +
             static_cast<int64_t>(sizeof(s.step()));
  }
  return total;
}

/// What one rank would hold training `model` unsharded with AdamW: every parameter, a gradient of
/// the same size, two moments of the same size and one int64 step per parameter.
StateBytes unsharded_bytes(const torch::nn::Module& model) {
  StateBytes b;
  int64_t count = 0;
  for (const auto& p : model.parameters()) {
    b.params += p.numel() * static_cast<int64_t>(p.element_size());
    ++count;
  }
  b.grads = b.params;
  b.optimizer = 2 * b.params + count * static_cast<int64_t>(sizeof(int64_t));
  return b;
}

/// What this rank holds under fully_shard: the units' local shards, their sharded gradients and
/// the optimizer's state for the (sharded) original parameters.
StateBytes sharded_bytes(const std::vector<fsdp::FSDPModule>& units,
                         const torch::optim::AdamW& optim) {
  StateBytes b;
  for (const auto& unit : units) {
    b.params += unit.sharded_param_bytes();
    b.grads += unit.sharded_grad_bytes();
  }
  b.optimizer = adamw_state_bytes(optim);
  return b;
}

using StatsSnapshot = std::map<CollectiveKind, fsdp::comm::CollectiveStats>;

StatsSnapshot snapshot(const fsdp::comm::Communicator& comm) {
  StatsSnapshot s;
  for (int k = 0; k < fsdp::comm::kNumCollectiveKinds; ++k) {
    const auto kind = static_cast<CollectiveKind>(k);
    s[kind] = comm.stats(kind);
  }
  return s;
}

/// The model's input and target windows of `step` for `rank`, on `device`.
fsdp::examples::TokenBatch batch_for(const fsdp::examples::CharCorpus& corpus, const Flags& f,
                                     int64_t step, int rank, at::Device device) {
  auto b = corpus.sample_batch({.seed = f.seed, .step = step, .rank = rank}, f.batch, f.context);
  return {b.inputs.to(device), b.targets.to(device)};
}

/// The model as --seed and --meta-init say: built eagerly on the CPU, or on the meta device (no
/// memory until fully_shard or materialize_module gives it values).
GPT build_model(const GPTConfig& config, const Flags& f) {
  torch::manual_seed(f.seed);
  if (!f.meta_init) return GPT(config);
  fsdp::MetaInitGuard meta;
  return GPT(config);
}

/// Trains the model unsharded for the same steps, each step on every rank's batch (step s on
/// world_sizes[s - 1] ranks): the loss is the mean of the ranks' losses, so its gradient is the
/// average of the ranks' gradients, as data parallelism computes it. Returns the loss of each step.
std::vector<double> train_unsharded_reference(const fsdp::examples::CharCorpus& corpus,
                                              const GPTConfig& config, const Flags& f,
                                              const std::vector<int>& world_sizes, at::Device device) {
  GPT model = build_model(config, f);
  if (f.meta_init) fsdp::materialize_module(*model);  // the same values fully_shard gives the shards
  if (!f.init_from.empty()) {
    const auto weights = fsdp::load_safetensors(f.init_from);
    c10::NoGradGuard no_grad;
    for (const auto& item : model->named_parameters()) {
      // A tied parameter is in the file under one of its names.
      if (const at::Tensor* w = weights.find(item.key())) item.value().copy_(*w);
    }
  }
  model->to(device);
  torch::optim::AdamW optim(model->parameters(),
                            torch::optim::AdamWOptions(f.lr).weight_decay(kWeightDecay));
  std::vector<double> losses;
  for (int64_t step = 1; step <= f.steps; ++step) {
    at::Tensor loss;
    const int world_size = world_sizes[step - 1];
    for (int q = 0; q < world_size; ++q) {
      const auto batch = batch_for(corpus, f, step, q, device);
      at::Tensor rank_loss = fsdp::examples::next_token_loss(model(batch.inputs), batch.targets);
      loss = q == 0 ? rank_loss : loss + rank_loss;
    }
    loss = loss / world_size;
    loss.backward();
    optim.step();
    optim.zero_grad();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

/// The world size of every step so far, saved with a checkpoint as runs "<ranks>x<steps>" joined by
/// commas (e.g. "2x50,3x50": 50 steps on 2 ranks, then 50 on 3).
std::string encode_world_sizes(const std::vector<int>& sizes) {
  std::string out;
  for (size_t i = 0; i < sizes.size();) {
    size_t j = i;
    while (j < sizes.size() && sizes[j] == sizes[i]) ++j;
    out += (out.empty() ? "" : ",") + std::to_string(sizes[i]) + "x" + std::to_string(j - i);
    i = j;
  }
  return out;
}

std::vector<int> decode_world_sizes(const std::string& text) {
  std::vector<int> sizes;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t comma = std::min(text.find(',', pos), text.size());
    const std::string run = text.substr(pos, comma - pos);
    const size_t x = run.find('x');
    if (x == std::string::npos) throw std::invalid_argument("bad world size history '" + text + "'");
    sizes.insert(sizes.end(), std::stoul(run.substr(x + 1)), std::stoi(run.substr(0, x)));
    pos = comma + 1;
  }
  return sizes;
}

/// Generates --sample characters after --prompt from the sharded model on every rank and prints
/// them on rank 0. GPT::generate is a method other than forward: called through the root's hooks
/// (fsdp::contract::call_method), the root's parameters are unsharded around it and each block's
/// hooks all-gather and free the block at every token, on every rank alike. Returns false when the
/// ranks did not generate the same text (they ran the same collectives either way).
bool sample_text(GPT& model, const fsdp::examples::CharCorpus& corpus, const Flags& f,
                 fsdp::comm::Communicator& metrics, at::Device device, bool main_rank) {
  if (f.sample == 0) return true;
  if (f.sequence_parallel || f.loss_parallel) {
    if (main_rank) {
      std::printf("\nsampling skipped: the model splits the sequence or returns vocabulary-parallel "
                  "logits (--sequence-parallel, --loss-parallel)\n");
    }
    return true;
  }
  const fsdp::examples::CharTokenizer& tokenizer = corpus.tokenizer();
  const at::Tensor prompt = at::tensor(tokenizer.encode(f.prompt), at::kLong).unsqueeze(0).to(device);
  const auto start = Clock::now();
  model->eval();
  at::Tensor tokens;
  {
    c10::NoGradGuard no_grad;
    tokens = fsdp::contract::call_method(model, &fsdp::examples::GPTImpl::generate, prompt, f.sample,
                                         f.temperature, static_cast<int64_t>(f.seed));
  }
  model->train();
  const double seconds = seconds_since(start);
  // The same tokens on every rank: the smallest and the largest id of each position agree.
  at::Tensor low = tokens.to(at::kDouble), high = low.clone();
  metrics.all_reduce(low, c10d::ReduceOp::MIN).wait();
  metrics.all_reduce(high, c10d::ReduceOp::MAX).wait();
  const bool same = at::equal(low, high);
  if (main_rank) {
    std::string text;
    const at::Tensor row = tokens.select(0, 0).to(at::kCPU);
    for (int64_t i = 0; i < row.numel(); ++i) {
      // The padded vocabulary's extra ids are no character ('?'); they only learn to be unlikely.
      const int64_t id = row[i].item<int64_t>();
      text += id < tokenizer.vocab_size() ? tokenizer.decode({id}) : std::string("?");
    }
    char mode[64] = "greedy";
    if (f.temperature > 0.0) {
      std::snprintf(mode, sizeof(mode), "temperature %g, seed %" PRIu64, f.temperature, f.seed);
    }
    std::printf("\nsample from the sharded model (%s; %" PRId64 " characters after the prompt, %.2f s, "
                "%s):\n%s\n", mode, f.sample, seconds,
                same ? "the same on every rank" : "DIFFERENT across ranks", text.c_str());
    std::fflush(stdout);
  }
  return same;
}

int run(const Flags& f, const fsdp::comm::ProcessGroup& group) {
  fsdp::comm::Communicator& comm = *group.comm;
  const int rank = comm.rank();
  const int world = comm.size();
  const at::Device device = group.device;
  // --tp: a (dp, tp) mesh; fully_shard communicates over the dp group, the tensor-parallel
  // layers over the tp group. Without it fully_shard uses the default process group.
  TORCH_CHECK(world % f.tp == 0, "--tp ", f.tp, " does not divide the number of ranks ", world);
  const int dp_world = world / static_cast<int>(f.tp);
  std::shared_ptr<fsdp::comm::DeviceMesh> mesh;
  if (f.tp > 1) mesh = fsdp::comm::DeviceMesh::create(comm, {dp_world, static_cast<int>(f.tp)}, {"dp", "tp"});
  fsdp::comm::Communicator& fsdp_comm = mesh ? *mesh->group("dp") : comm;
  const int dp_rank = mesh ? mesh->coordinate("dp") : rank;
  const bool main_rank = rank == 0;
  // The example's own reductions (the loss printed per step) go through a second communicator on
  // the same backend, so the default one counts exactly what fully_shard communicates.
  fsdp::comm::Communicator metrics(comm.backend(), device);

  const auto corpus = fsdp::examples::CharCorpus::embedded();
  // The vocabulary padded to a multiple of --vocab-divisible-by and of --tp (tensor parallelism
  // splits it; Megatron pads the same way): the extra rows are never a target and only ever learn
  // to be unlikely.
  const int64_t multiple = std::lcm(f.vocab_divisible_by, f.tp);
  const int64_t vocab = (corpus.tokenizer().vocab_size() + multiple - 1) / multiple * multiple;
  const GPTConfig config = GPTConfig(vocab)
                               .context_length(f.context)
                               .d_model(f.d_model)
                               .n_heads(f.heads)
                               .n_layers(f.layers);
  // Built on the CPU (fully_shard moves only the shards to `device`), or on meta (--meta-init:
  // fully_shard allocates and initializes only the shards).
  GPT model = build_model(config, f);
  const StateBytes full = unsharded_bytes(*model);
  int64_t num_params = 0;
  for (const auto& p : model->parameters()) num_params += p.numel();

  const auto strategy = to_strategy(f.strategy);
  if (main_rank) {
    std::printf(
        "train_gpt: %d rank(s) (%s), device %s, backend %s, %d thread(s) per rank\n"
        "model: GPT, %" PRId64 " blocks, d_model %" PRId64 ", %" PRId64 " heads, context %" PRId64
        ", vocab %" PRId64 " (characters of a %zu-byte text), %" PRId64 " parameters, tied "
        "embedding\n"
        "fully_shard(%s) on each of the %" PRId64 " blocks and on the root%s; AdamW lr %g; %" PRId64
        " steps of %" PRId64 " x %" PRId64 " tokens per rank\n\n",
        world, fsdp::comm::to_string(group.launch.launcher), device.str().c_str(),
        comm.backend()->getBackendName().c_str(), at::get_num_threads(), f.layers, f.d_model,
        f.heads, f.context, config.vocab_size(), corpus.text().size(), num_params,
        strategy_label(strategy), f.layers,
        f.checkpoint_activations ? ", activation checkpointing on each block" : "", f.lr, f.steps,
        f.batch, f.context);
    std::fflush(stdout);
  }

  // The type policy selects every block: activation checkpointing on each (when asked), then
  // fully_shard on each, bottom-up, and on the root (embeddings, tied output layer, ln_f).
  const auto blocks = fsdp::WrapPolicy::module_types<fsdp::examples::BlockImpl>();
  if (f.checkpoint_activations) fsdp::checkpoint_activations_tree(*model, blocks);
  // Tensor parallelism first: fully_shard then shards each rank's pieces over its dp group.
  fsdp::examples::GptLossFunction loss_of = fsdp::examples::next_token_loss;
  if (mesh) {
    loss_of = fsdp::examples::parallelize_gpt(
        model, mesh->group("tp"),
        fsdp::examples::GptTensorParallel().sequence_parallel(f.sequence_parallel).loss_parallel(f.loss_parallel));
    if (main_rank) {
      std::printf("tensor parallel: mesh %s; heads, MLP and vocabulary split over tp%s%s; fully_shard over dp\n\n",
                  mesh->describe().c_str(), f.sequence_parallel ? ", sequence parallel" : "",
                  f.loss_parallel ? ", loss parallel" : "");
    }
  }
  auto options = fsdp::FullyShardOptions().strategy(strategy).device(device);
  if (mesh) options.communicator(mesh->group("dp"));
  const bool quantized = f.quantize_weights || f.quantize_grads;
  if (quantized) {  // ZeRO++'s qwZ / qgZ ([Note: communication codecs] in fsdp/comm_codec.h)
    const auto codec = fsdp::int8_block_codec(f.quant_block, f.quant_scales == "bf16" ? at::kBFloat16 : at::kFloat);
    if (f.quantize_weights) options.all_gather_codec(codec);
    if (f.quantize_grads) options.reduce_codec(codec);
    if (main_rank) {
      std::printf("quantized communication: %s%s%s\n\n", f.quantize_weights ? "all-gathers " : "",
                  f.quantize_grads ? "gradient reductions " : "", ("in " + codec->name()).c_str());
    }
  }
  if (f.reshard_group > 0) options.reshard_after_forward(static_cast<int>(f.reshard_group));  // hpZ
  std::vector<fsdp::FSDPModule> units = fsdp::fully_shard_tree(*model, blocks, options);
  if (!f.init_from.empty()) {
    const auto load_start = Clock::now();
    const auto loaded = fsdp::load_pretrained(units.back(), f.init_from);  // collective
    if (main_rank) {
      std::printf("loaded %s into the shards in %.2f s: rank 0 read %" PRId64 " of the model's %" PRId64
                  " bytes\n\n", f.init_from.c_str(), seconds_since(load_start), loaded.stats.bytes_read,
                  full.params);
      std::fflush(stdout);
    }
  }
  // What each rank will hold and send, before the first step (no communication).
  const fsdp::ShardingPlan plan =
      fsdp::plan(units.back(), fsdp::PlanOptions().optimizer(fsdp::PlanOptimizer::kAdamW));
  if (main_rank) {
    std::ostringstream printed;
    printed << plan;
    std::printf("%s\n", printed.str().c_str());
    std::fflush(stdout);
  }

  // --optimizer-states bf16: fsdp::optim::AdamW, the moments in bfloat16 ([Note: bfloat16
  // moments] in optim/adam_family_step.h); otherwise torch::optim::AdamW.
  const auto adamw_options = torch::optim::AdamWOptions(f.lr).weight_decay(kWeightDecay);
  const bool bf16_states = f.optimizer_states == "bf16";
  std::unique_ptr<torch::optim::AdamW> optim_holder;
  if (bf16_states) {
    optim_holder = std::make_unique<fsdp::optim::AdamW>(
        model->parameters(), adamw_options, fsdp::optim::FlatAdamOptions().state_dtype(at::kBFloat16).seed(f.seed));
  } else {
    optim_holder = std::make_unique<torch::optim::AdamW>(model->parameters(), adamw_options);
  }
  torch::optim::AdamW& optim = *optim_holder;
  if (bf16_states && main_rank) std::printf("AdamW moments in bfloat16 (fsdp::optim::AdamW, stochastic rounding)\n\n");
  // Resuming: model, AdamW state and the step come from the checkpoint (saved on any world size).
  std::vector<int> world_sizes;  // of every step trained so far, this run's included
  int64_t first_step = 1;
  if (!f.resume_dir.empty()) {
    fsdp::dcp::Extra extra;
    fsdp::dcp::load(f.resume_dir, units.back(), &optim, &extra);
    first_step = std::stoll(extra.values.at("step")) + 1;
    world_sizes = decode_world_sizes(extra.values.at("world_sizes"));
    if (main_rank) {
      std::printf("resumed from %s: step %" PRId64 " (trained on %s ranks x steps)\n\n",
                  f.resume_dir.c_str(), first_step - 1, extra.values.at("world_sizes").c_str());
    }
    if (first_step > f.steps) {
      throw std::invalid_argument("the checkpoint is at step " + std::to_string(first_step - 1) +
                                  ": --steps must be larger to train further");
    }
  }
  std::vector<double> losses;
  StateBytes held;
  StatsSnapshot after_first_step;
  const StatsSnapshot before = snapshot(fsdp_comm);
  const StatsSnapshot tp_before = mesh ? snapshot(*mesh->group("tp")) : StatsSnapshot{};
  const auto train_start = Clock::now();
  // The profiled steps: the second to the fourth of this run (the first one initialises).
  const int64_t profile_from = first_step + 1, profile_to = std::min(f.steps, first_step + 3);
  const bool profiling = !f.profile.empty() && main_rank && profile_from <= profile_to;
  if (!f.profile.empty() && main_rank && !profiling) {
    std::printf("--profile: no step to profile (at least 2 steps needed)\n");
  }
  for (int64_t step = first_step; step <= f.steps; ++step) {
    if (profiling && step == profile_from) start_profiler();
    world_sizes.push_back(dp_world);
    const auto batch = batch_for(corpus, f, step, dp_rank, device);
    const auto step_start = Clock::now();
    at::Tensor loss = loss_of(model(batch.inputs), batch.targets);
    loss.backward();
    optim.step();
    if (step == f.steps) held = sharded_bytes(units, optim);  // before zero_grad frees the grads
    optim.zero_grad();
    const double step_seconds = seconds_since(step_start);
    if (step == first_step) after_first_step = snapshot(fsdp_comm);
    if (profiling && step == profile_to) stop_profiler(f.profile, profile_from, profile_to);

    at::Tensor mean_loss = loss.detach().clone();
    metrics.all_reduce(mean_loss, c10d::ReduceOp::AVG).wait();
    losses.push_back(mean_loss.item<double>());
    if (main_rank) {
      std::printf("step %3" PRId64 "/%" PRId64 "  loss %.4f  %7.0f tokens/s\n", step, f.steps,
                  losses.back(), static_cast<double>(dp_world * f.batch * f.context) / step_seconds);
      std::fflush(stdout);
    }
  }
  const double train_seconds = seconds_since(train_start);
  const StatsSnapshot after = snapshot(fsdp_comm);
  const StatsSnapshot tp_after = mesh ? snapshot(*mesh->group("tp")) : StatsSnapshot{};
  const int64_t trained = f.steps - first_step + 1;

  if (!f.save_dir.empty()) {
    fsdp::dcp::Extra extra;
    extra.values["step"] = std::to_string(f.steps);
    extra.values["world_sizes"] = encode_world_sizes(world_sizes);
    const auto save_start = Clock::now();
    fsdp::dcp::save(f.save_dir, units.back(), &optim, extra);
    if (main_rank) {
      std::printf("\nsaved step %" PRId64 " to %s in %.2f s (every rank wrote its shards)\n", f.steps,
                  f.save_dir.c_str(), seconds_since(save_start));
    }
  }

  if (!f.export_dir.empty()) {
    const auto weights = fsdp::full_state_dict(units.back());  // collective; rank 0 gets the values
    if (main_rank) {
      fsdp::save_safetensors(f.export_dir, weights);
      std::printf("\nexported the weights after step %" PRId64 " to %s (safetensors)\n", f.steps, f.export_dir.c_str());
    }
  }

  if (main_rank) {
    std::printf("\ntrained %" PRId64 " steps in %.1f s\n", trained, train_seconds);
    std::printf("\nper-rank memory after the last step (rank 0; unsharded = one rank without "
                "sharding):\n");
    auto row = [](const char* name, int64_t sharded, int64_t unsharded) {
      std::printf("  %-34s %10" PRId64 " B  unsharded %10" PRId64 " B  ratio %.3f\n", name,
                  sharded, unsharded,
                  unsharded > 0 ? static_cast<double>(sharded) / static_cast<double>(unsharded)
                                : 0.0);
    };
    row("parameters (local shards)", held.params, full.params);
    row("gradients (sharded grads)", held.grads, full.grads);
    row("AdamW state (2 moments + step)", held.optimizer, full.optimizer);
    row("total", held.params + held.grads + held.optimizer,
        full.params + full.grads + full.optimizer);

    std::printf("\ncollectives of fully_shard per step (rank 0):\n");
    std::printf("  %-24s %10s %14s %18s\n", "", "calls", "bytes", "first step: calls");
    for (const auto& [kind, total] : after) {
      const auto& start = before.at(kind);
      const auto& first = after_first_step.at(kind);
      if (total.calls == start.calls) continue;
      const int64_t steady_steps = trained > 1 ? trained - 1 : 1;
      const auto& from = trained > 1 ? first : start;
      std::printf("  %-24s %10.2f %14.0f %18" PRId64 "\n", fsdp::comm::to_string(kind),
                  static_cast<double>(total.calls - from.calls) / steady_steps,
                  static_cast<double>(total.bytes - from.bytes) / steady_steps,
                  first.calls - start.calls);
    }
    if (trained > 1) {
      std::printf("  (per step over steps %" PRId64 "-%" PRId64 "; step %" PRId64 " adds lazy "
                  "initialisation and the sharded-use check)\n", first_step + 1, f.steps, first_step);
    } else {
      std::printf("  (the only step, with lazy initialisation and the sharded-use check)\n");
    }
    std::printf("  design for %s with %" PRId64 " units: %s\n", strategy_label(strategy),
                f.layers + 1, expected_collectives(strategy, f.layers).c_str());
    if (mesh) {
      std::printf("\ntensor-parallel collectives per step over the tp group (rank 0, mean over %" PRId64
                  " steps, first included):\n", trained);
      for (const auto& [kind, total] : tp_after) {
        const auto& start = tp_before.at(kind);
        if (total.calls == start.calls) continue;
        std::printf("  %-24s %10.2f %14.0f\n", fsdp::comm::to_string(kind),
                    static_cast<double>(total.calls - start.calls) / trained,
                    static_cast<double>(total.bytes - start.bytes) / trained);
      }
    }
    std::fflush(stdout);
  }

  if (!sample_text(model, corpus, f, metrics, device, main_rank)) return 1;

  if (!f.check_unsharded) {
    if (main_rank) std::printf("\nfinal loss %.6f (unsharded comparison skipped)\n", losses.back());
    return 0;
  }
  const auto reference_start = Clock::now();
  const std::vector<double> reference =
      train_unsharded_reference(corpus, config, f, world_sizes, device);
  // This run's steps against the same steps of the reference (which replays the whole run).
  auto relative_difference = [&](size_t i) {
    const double expected = reference[first_step - 1 + i];
    return std::abs(losses[i] - expected) / std::abs(expected);
  };
  double max_relative = 0.0;
  for (size_t i = 0; i < losses.size(); ++i) {
    max_relative = std::max(max_relative, relative_difference(i));
  }
  const double final_relative = relative_difference(losses.size() - 1);
  const double tolerance = quantized ? kQuantizedTolerance : bf16_states ? kBf16StatesTolerance : kParityTolerance;
  const bool agree = final_relative <= tolerance;
  if (main_rank) {
    std::printf(
        "\nfinal loss: fully_shard %.6f, unsharded reference %.6f (same seed, all ranks' "
        "batches each step (%s ranks x steps), trained in %.1f s)\n"
        "relative difference %.2e (largest over the %" PRId64 " steps %.2e): %s within %.0e\n",
        losses.back(), reference.back(), encode_world_sizes(world_sizes).c_str(),
        seconds_since(reference_start), final_relative, trained, max_relative,
        agree ? "agree" : "DO NOT agree", tolerance);
    if (!agree) {
      std::printf(
          "step %" PRId64 " relative difference %.2e: a difference already there in the first steps "
          "points at wrong sharded gradients; one that starts near 1e-7 and grows step after "
          "step is rounding amplified by unstable training (try a lower --lr)\n",
          first_step, relative_difference(0));
    }
  }
  return agree ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  fsdp::comm::ProcessGroup group;
  try {
    group = fsdp::comm::init_process_group();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_gpt: cannot set up communication: %s\n", e.what());
    return 1;
  }
  const int rank = group.comm->rank();

  Flags flags;
  try {
    flags = parse_flags(argc, argv);
  } catch (const std::invalid_argument& e) {
    if (rank == 0) std::fprintf(stderr, "train_gpt: %s\n\n%s", e.what(), kUsage);
    return 2;
  }
  if (flags.help) {
    if (rank == 0) std::printf("%s", kUsage);
    return 0;
  }
  // Ranks of one machine share its cores: one intra-op thread each unless told otherwise.
  at::set_num_threads(static_cast<int>(flags.threads));

  try {
    return run(flags, group);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "train_gpt: error on rank %d: %s\n", rank, e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_gpt: error on rank %d: %s\n", rank, e.what());
  }
  return 1;
}
