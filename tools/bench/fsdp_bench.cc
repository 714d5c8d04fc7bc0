// fsdp_bench: measures fully_shard against plain local training of the same model, in the same
// process, on the models of tools/bench/bench_models.h (see tools/benchmark.sh, which runs it with
// the Python side, tools/bench/torch_bench.py, and renders the report).
//
//   fsdp_bench --write-init FILE                      writes weights and data for both sides
//   fsdp_bench --init FILE --out JSON [flags]         a plain run: world size 1
//   mpirun -np 2 fsdp_bench --init FILE --out JSON --local 0   world size 2
//
// Per model it trains the variants (local: no fully_shard; fsdp: fully_shard on every block, then
// the root; fsdp_flat: the same with fsdp::optim::AdamW, optim/, instead of torch::optim::AdamW,
// unless --flat-optimizer 0) step by step in turn, each step zero_grad + forward + backward +
// AdamW step, and records each step's time (forward+backward and optimizer step apart), the loss,
// and the Communicator's calls and bytes per collective kind per step (of the fsdp variant:
// fsdp_flat issues the same collectives, not counted). Then (--memory 1) it installs a
// counting CPU allocator (tools/bench/counting_allocator.h) and, on fresh copies of each variant
// (local and fsdp, on every rank), measures the peak of live bytes over whole training steps
// (forward, backward, optimizer step, zero_grad), the bytes of parameters, gradients and optimizer
// state after the step, and the peak of the unsharded buffers (see bench_memory); and the
// optimizer state of fsdp::optim::AdamW with float32 and with bfloat16 moments against its formula
// (bench_optimizer_states).
// Rank 0 writes every rank's results to one JSON file.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <exception>
#include <fstream>
#include <functional>
#include <memory>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>
#include <torch/utils.h>

#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/fully_shard_internal.h"
#include "fsdp_cpp/examples/gpt_model.h"
#include "fsdp_cpp/optim/adamw.h"
#include "fsdp_cpp/tools/bench/bench_models.h"
#include "fsdp_cpp/tools/bench/counting_allocator.h"
#include "fsdp_cpp/tools/bench/json_writer.h"

namespace {

using Clock = std::chrono::steady_clock;
using fsdp::bench::JsonWriter;
using fsdp::bench::TensorMap;
using fsdp::comm::CollectiveKind;

constexpr const char* kUsage = R"(usage:
  fsdp_bench --write-init FILE [--seed N] [--tiny-depth N] [--tiny-dim N] [--tiny-batch N]
             [--gpt-layers N] [--gpt-d-model N] [--gpt-heads N] [--gpt-context N] [--gpt-batch N]
             [--gpt-vocab N]
  fsdp_bench --init FILE --out JSON [--models tiny,gpt] [--local 0|1] [--fsdp 0|1] [--memory 0|1]
             [--flat-optimizer 0|1] [--warmup N] [--steps N] [--gpt-warmup N] [--gpt-steps N] [--lr X] [--threads N]
)";

struct Flags {
  std::string write_init;
  std::string init;
  std::string out;
  std::vector<std::string> models{"tiny", "gpt"};
  bool local = true;
  bool fsdp = true;
  bool memory = true;
  bool flat_optimizer = true;  // the fsdp_flat variant (fully_shard + fsdp::optim::AdamW)
  int64_t warmup = 10;
  int64_t steps = 40;
  int64_t gpt_warmup = 3;
  int64_t gpt_steps = 15;
  double lr = 1e-3;
  int64_t threads = 1;
  // --write-init
  uint64_t seed = 0;
  int64_t tiny_depth = 100, tiny_dim = 8, tiny_batch = 8;
  int64_t gpt_layers = 4, gpt_d_model = 128, gpt_heads = 4, gpt_context = 64, gpt_batch = 16,
          gpt_vocab = 65;
  int64_t file_ranks = 2;    // data for this many ranks
  int64_t file_batches = 4;  // batches per rank, cycled through
};

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> parts;
  std::stringstream in(s);
  for (std::string part; std::getline(in, part, sep);) {
    if (!part.empty()) parts.push_back(part);
  }
  return parts;
}

Flags parse_flags(int argc, char** argv) {
  Flags f;
  auto need = [&](int& i) -> std::string {
    if (i + 1 >= argc) throw std::invalid_argument(std::string(argv[i]) + " needs a value");
    return argv[++i];
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (a == "--write-init") f.write_init = need(i);
    else if (a == "--init") f.init = need(i);
    else if (a == "--out") f.out = need(i);
    else if (a == "--models") f.models = split(need(i), ',');
    else if (a == "--local") f.local = std::stoi(need(i)) != 0;
    else if (a == "--fsdp") f.fsdp = std::stoi(need(i)) != 0;
    else if (a == "--memory") f.memory = std::stoi(need(i)) != 0;
    else if (a == "--flat-optimizer") f.flat_optimizer = std::stoi(need(i)) != 0;
    else if (a == "--warmup") f.warmup = std::stoll(need(i));
    else if (a == "--steps") f.steps = std::stoll(need(i));
    else if (a == "--gpt-warmup") f.gpt_warmup = std::stoll(need(i));
    else if (a == "--gpt-steps") f.gpt_steps = std::stoll(need(i));
    else if (a == "--lr") f.lr = std::stod(need(i));
    else if (a == "--threads") f.threads = std::stoll(need(i));
    else if (a == "--seed") f.seed = std::stoull(need(i));
    else if (a == "--tiny-depth") f.tiny_depth = std::stoll(need(i));
    else if (a == "--tiny-dim") f.tiny_dim = std::stoll(need(i));
    else if (a == "--tiny-batch") f.tiny_batch = std::stoll(need(i));
    else if (a == "--gpt-layers") f.gpt_layers = std::stoll(need(i));
    else if (a == "--gpt-d-model") f.gpt_d_model = std::stoll(need(i));
    else if (a == "--gpt-heads") f.gpt_heads = std::stoll(need(i));
    else if (a == "--gpt-context") f.gpt_context = std::stoll(need(i));
    else if (a == "--gpt-batch") f.gpt_batch = std::stoll(need(i));
    else if (a == "--gpt-vocab") f.gpt_vocab = std::stoll(need(i));
    else throw std::invalid_argument("unknown flag '" + a + "'\n" + kUsage);
  }
  if (f.write_init.empty() && (f.init.empty() || f.out.empty())) {
    throw std::invalid_argument(std::string("give --write-init FILE, or --init FILE and --out JSON\n") +
                                kUsage);
  }
  return f;
}

// ---------------------------------------------------------------------------------------------
// The init file

void write_init(const Flags& f) {
  TensorMap t;
  torch::manual_seed(static_cast<uint64_t>(f.seed));
  {
    fsdp::bench::TinyNet net(f.tiny_dim, f.tiny_depth);
    fsdp::bench::store_parameters(*net, t, "tiny.");
    t["tiny.config"] = at::tensor(std::vector<int64_t>{f.tiny_dim, f.tiny_depth, f.tiny_batch});
    t["tiny.x"] = at::randn({f.file_ranks, f.file_batches, f.tiny_batch, f.tiny_dim});
    t["tiny.y"] = at::randn({f.file_ranks, f.file_batches, f.tiny_batch, f.tiny_dim});
  }
  {
    auto config = fsdp::examples::GPTConfig(f.gpt_vocab)
                      .context_length(f.gpt_context)
                      .d_model(f.gpt_d_model)
                      .n_heads(f.gpt_heads)
                      .n_layers(f.gpt_layers);
    fsdp::examples::GPT gpt(config);
    fsdp::bench::store_parameters(*gpt, t, "gpt.");
    t["gpt.config"] = at::tensor(std::vector<int64_t>{f.gpt_vocab, f.gpt_context, f.gpt_d_model,
                                                      f.gpt_heads, f.gpt_layers,
                                                      config.mlp_ratio(), f.gpt_batch});
    t["gpt.tokens"] = at::randint(0, f.gpt_vocab,
                                  {f.file_ranks, f.file_batches, f.gpt_batch, f.gpt_context + 1},
                                  at::kLong);
  }
  fsdp::bench::save_tensor_file(f.write_init, t);
  std::printf("wrote %s (%zu tensors)\n", f.write_init.c_str(), t.size());
}

// ---------------------------------------------------------------------------------------------
// Models under training

/// One model being trained: its module, loss on batch i of this rank, units (fsdp) and optimizer.
struct Trainee {
  std::string variant;  // "local", "fsdp" or "fsdp_flat"
  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor(int64_t)> loss;
  std::vector<fsdp::FSDPModule> units;  // the root last; empty for local
  std::unique_ptr<torch::optim::Optimizer> optim;  // AdamW: torch::optim's, or fsdp::optim's
  std::vector<double> fb_s, opt_s, step_s, cpu_s, losses;
};

int64_t cfg(const TensorMap& t, const std::string& name, int64_t i) {
  return t.at(name).data_ptr<int64_t>()[i];
}

/// Builds `model` ("tiny" or "gpt") from the init file, sharded when `fsdp`, trained with
/// fsdp::optim::AdamW when `flat_optimizer` (else torch::optim::AdamW).
std::unique_ptr<Trainee> make_trainee(const std::string& model, bool fsdp, const TensorMap& t,
                                      int rank, double lr, bool flat_optimizer = false,
                                      at::ScalarType state_dtype = at::kFloat) {
  auto trainee = std::make_unique<Trainee>();
  trainee->variant = fsdp ? (flat_optimizer ? "fsdp_flat" : "fsdp") : (flat_optimizer ? "local_flat" : "local");
  if (model == "tiny") {
    const int64_t dim = cfg(t, "tiny.config", 0), depth = cfg(t, "tiny.config", 1);
    fsdp::bench::TinyNet net(dim, depth);
    fsdp::bench::load_parameters(*net, t, "tiny.");
    if (fsdp) {
      for (auto& block : net->block_list()) trainee->units.push_back(fsdp::fully_shard(block));
      trainee->units.push_back(fsdp::fully_shard(net));
    }
    const at::Tensor x = t.at("tiny.x"), y = t.at("tiny.y");
    const int64_t file_rank = rank % x.size(0), batches = x.size(1);
    trainee->module = net.ptr();
    trainee->loss = [net, x, y, file_rank, batches](int64_t i) mutable {
      return torch::nn::functional::mse_loss(net(x[file_rank][i % batches]),
                                             y[file_rank][i % batches]);
    };
  } else if (model == "gpt") {
    auto config = fsdp::examples::GPTConfig(cfg(t, "gpt.config", 0))
                      .context_length(cfg(t, "gpt.config", 1))
                      .d_model(cfg(t, "gpt.config", 2))
                      .n_heads(cfg(t, "gpt.config", 3))
                      .n_layers(cfg(t, "gpt.config", 4))
                      .mlp_ratio(cfg(t, "gpt.config", 5));
    fsdp::examples::GPT gpt(config);
    fsdp::bench::load_parameters(*gpt, t, "gpt.");
    if (fsdp) {
      for (auto& block : gpt->block_list()) trainee->units.push_back(fsdp::fully_shard(block));
      trainee->units.push_back(fsdp::fully_shard(gpt));
    }
    const at::Tensor tokens = t.at("gpt.tokens");
    const int64_t file_rank = rank % tokens.size(0), batches = tokens.size(1);
    const int64_t context = tokens.size(3) - 1;
    trainee->module = gpt.ptr();
    trainee->loss = [gpt, tokens, file_rank, batches, context](int64_t i) mutable {
      const at::Tensor window = tokens[file_rank][i % batches];
      return fsdp::examples::next_token_loss(gpt(window.narrow(1, 0, context)),
                                             window.narrow(1, 1, context));
    };
  } else {
    throw std::invalid_argument("unknown model '" + model + "' (tiny or gpt)");
  }
  const auto options = torch::optim::AdamWOptions(lr).weight_decay(0.01);
  if (flat_optimizer) {
    trainee->optim = std::make_unique<fsdp::optim::AdamW>(
        trainee->module->parameters(), options, fsdp::optim::FlatAdamOptions().state_dtype(state_dtype));
  } else {
    trainee->optim = std::make_unique<torch::optim::AdamW>(trainee->module->parameters(), options);
  }
  return trainee;
}

double seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

/// CPU time of the whole process (every thread: the MPI backend's progress thread too), seconds.
double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

/// zero_grad + forward + backward + optimizer step on batch `i`, timed (wall and process CPU).
void train_step(Trainee& t, int64_t i) {
  const double c0 = process_cpu_seconds();
  const auto t0 = Clock::now();
  t.optim->zero_grad();
  at::Tensor loss = t.loss(i);
  loss.backward();
  const auto t1 = Clock::now();
  t.optim->step();
  const auto t2 = Clock::now();
  t.fb_s.push_back(seconds(t0, t1));
  t.opt_s.push_back(seconds(t1, t2));
  t.step_s.push_back(seconds(t0, t2));
  t.cpu_s.push_back(process_cpu_seconds() - c0);
  t.losses.push_back(loss.item<double>());
}

const char* kind_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllGather: return "all_gather";
    case CollectiveKind::kReduceScatter: return "reduce_scatter";
    case CollectiveKind::kAllReduce: return "all_reduce";
    case CollectiveKind::kBroadcast: return "broadcast";
    case CollectiveKind::kAllGatherList: return "all_gather_list";
    case CollectiveKind::kAllGatherBytes: return "all_gather_bytes";
    case CollectiveKind::kBarrier: return "barrier";
    case CollectiveKind::kAllToAll: return "all_to_all";
    case CollectiveKind::kAllToAllV: return "all_to_all_v";
    case CollectiveKind::kSend: return "send";
    case CollectiveKind::kRecv: return "recv";
  }
  return "?";
}

/// The FlatParameters of `units` (the root last), with what the formulas need.
void write_handles(JsonWriter& w, const std::vector<fsdp::FSDPModule>& units) {
  w.begin_array();
  for (size_t u = 0; u < units.size(); ++u) {
    for (const auto& h : fsdp::detail::handles_of(units[u])) {
      const auto& layout = h->layout();
      w.begin_object()
          .member("unit", h->unit_fqn())
          .member("root", u + 1 == units.size())
          .member("requires_grad", h->requires_grad())
          .member("element_size", static_cast<int64_t>(c10::elementSize(layout.dtype)))
          .member("all_gather_element_size", static_cast<int64_t>(c10::elementSize(h->compute_dtype())))
          .member("reduce_element_size", static_cast<int64_t>(c10::elementSize(h->reduce_dtype())))
          .member("unpadded_numel", layout.unpadded_numel)
          .member("padded_numel", layout.padded_numel)
          .member("shard_numel", layout.shard_numel())
          .member("world_size", static_cast<int64_t>(layout.world_size))
          .member("params", static_cast<int64_t>(h->params().size()))
          .member("local_shard_bytes", static_cast<int64_t>(h->local_shard().nbytes()))
          .member("sharded", h->is_sharded_strategy())
          .end_object();
    }
  }
  w.end_array();
}

/// Turns a `perf record --control fifo:CTL,ACK` on and off around the measured steps, when
/// FSDP_BENCH_PERF_CTL and FSDP_BENCH_PERF_ACK name that fifo pair (tools/profile_w2.sh starts perf
/// with its events disabled), so that the samples are those of the measured steps only. A no-op
/// otherwise.
class PerfControl {
 public:
  PerfControl() {
    const char* ctl = std::getenv("FSDP_BENCH_PERF_CTL");
    const char* ack = std::getenv("FSDP_BENCH_PERF_ACK");
    if (ctl != nullptr && ack != nullptr && *ctl != '\0' && *ack != '\0') {
      ctl_ = ctl;
      ack_ = ack;
    }
  }
  void enable() { send("enable"); }
  void disable() { send("disable"); }

 private:
  // Writes the command and waits for perf's "ack" (so the switch took effect before the next line).
  void send(const char* command) {
    if (ctl_.empty()) return;
    std::ofstream(ctl_) << command << "\n" << std::flush;
    std::ifstream ack(ack_);
    std::string reply;
    std::getline(ack, reply);
    TORCH_CHECK(reply.rfind("ack", 0) == 0, "fsdp_bench: perf answered '", reply, "' to '", command, "'");
  }
  std::string ctl_, ack_;
};

/// Trains the variants of `model` in turn and writes their timings, losses, the units' handles and
/// the collectives per step.
void bench_timing(JsonWriter& w, const std::string& model, const Flags& f, const TensorMap& t,
                  fsdp::comm::Communicator& comm) {
  std::vector<std::unique_ptr<Trainee>> trainees;
  if (f.local) trainees.push_back(make_trainee(model, false, t, comm.rank(), f.lr));
  if (f.fsdp) trainees.push_back(make_trainee(model, true, t, comm.rank(), f.lr));
  if (f.fsdp && f.flat_optimizer) trainees.push_back(make_trainee(model, true, t, comm.rank(), f.lr, true));
  TORCH_CHECK(!trainees.empty(), "--local 0 --fsdp 0: nothing to run");
  const int64_t warmup = model == "gpt" ? f.gpt_warmup : f.warmup;
  const int64_t steps = model == "gpt" ? f.gpt_steps : f.steps;
  std::vector<fsdp::comm::CollectiveStats> stats(fsdp::comm::kNumCollectiveKinds);
  // The collectives of the fsdp variant's measured steps only (fsdp_flat issues the same ones).
  auto counted_step = [&](Trainee& tr, int64_t i) {
    std::vector<fsdp::comm::CollectiveStats> before(fsdp::comm::kNumCollectiveKinds);
    for (int k = 0; k < fsdp::comm::kNumCollectiveKinds; ++k) before[k] = comm.stats(static_cast<CollectiveKind>(k));
    train_step(tr, i);
    if (tr.variant != "fsdp" || i < warmup) return;
    for (int k = 0; k < fsdp::comm::kNumCollectiveKinds; ++k) {
      const auto after = comm.stats(static_cast<CollectiveKind>(k));
      stats[k].calls += after.calls - before[k].calls;
      stats[k].bytes += after.bytes - before[k].bytes;
    }
  };
  PerfControl perf;
  for (int64_t i = 0; i < warmup + steps; ++i) {
    if (i == warmup) perf.enable();
    // Alternate the order, so that neither variant always runs right after the other.
    if (i % 2 == 0) {
      for (auto& tr : trainees) counted_step(*tr, i);
    } else {
      for (auto it = trainees.rbegin(); it != trainees.rend(); ++it) counted_step(**it, i);
    }
  }
  perf.disable();
  // The torch::optim fsdp variant (the last one when --fsdp 0: local).
  const Trainee& sharded = [&]() -> const Trainee& {
    for (const auto& tr : trainees) {
      if (tr->variant == "fsdp") return *tr;
    }
    return *trainees.back();
  }();
  // The collectives of one step alone, issued one after the other with the buffers allocated as the
  // handles do (an unsharded buffer per all-gather; a zeroed padded gradient buffer and an output
  // shard per reduce-scatter, divided by the world size): what communication costs by itself.
  std::vector<double> replay_s, replay_cpu_s;
  if (!sharded.units.empty()) {
    for (int64_t rep = 0; rep < std::max<int64_t>(steps, 5); ++rep) {
      const double c0 = process_cpu_seconds();
      const auto t0 = Clock::now();
      for (size_t u = 0; u < sharded.units.size(); ++u) {
        const bool root = u + 1 == sharded.units.size();
        for (const auto& h : fsdp::detail::handles_of(sharded.units[u])) {
          for (int call = 0; call < (root ? 1 : 2); ++call) {
            at::Tensor out = at::empty({h->layout().padded_numel}, h->local_shard().options());
            comm.all_gather_into_tensor(out, h->local_shard()).wait();
          }
        }
      }
      for (size_t u = sharded.units.size(); u-- > 0;) {
        for (const auto& h : fsdp::detail::handles_of(sharded.units[u])) {
          if (!h->requires_grad()) continue;
          at::Tensor in = at::zeros({h->layout().padded_numel}, h->local_shard().options());
          at::Tensor out = at::empty({h->layout().shard_numel()}, h->local_shard().options());
          comm.reduce_scatter_tensor(out, in, c10d::ReduceOp::SUM).wait();
          out.div_(comm.size());
        }
      }
      replay_s.push_back(seconds(t0, Clock::now()));
      replay_cpu_s.push_back(process_cpu_seconds() - c0);
    }
  }
  w.key(model).begin_object();
  w.member("warmup", warmup).member("steps", steps);
  w.member("units_with_params", static_cast<int64_t>(std::count_if(
                                    sharded.units.begin(), sharded.units.end(),
                                    [](const fsdp::FSDPModule& u) { return !fsdp::detail::handles_of(u).empty(); })));
  w.member("units", static_cast<int64_t>(sharded.units.size()));
  w.key("variants").begin_object();
  for (const auto& tr : trainees) {
    w.key(tr->variant).begin_object();
    w.key("step_s").array(tr->step_s);
    w.key("fb_s").array(tr->fb_s);
    w.key("opt_s").array(tr->opt_s);
    w.key("cpu_s").array(tr->cpu_s);
    w.key("losses").array(tr->losses);
    w.end_object();
  }
  w.end_object();
  w.key("collectives_alone").begin_object();
  w.key("step_s").array(replay_s);
  w.key("cpu_s").array(replay_cpu_s);
  w.end_object();
  w.key("handles");
  write_handles(w, sharded.units);
  w.key("comm_per_step").begin_object();
  for (int k = 0; k < fsdp::comm::kNumCollectiveKinds; ++k) {
    w.key(kind_name(static_cast<CollectiveKind>(k))).begin_object();
    w.member("calls", static_cast<double>(stats[k].calls) / static_cast<double>(steps));
    w.member("bytes", static_cast<double>(stats[k].bytes) / static_cast<double>(steps));
    w.end_object();
  }
  w.end_object();
  w.end_object();
}

/// Adds up the allocator's bytes behind the storages of `tensors`, each storage once.
class StorageBytes {
 public:
  explicit StorageBytes(const fsdp::bench::CountingAllocator& alloc) : alloc_(alloc) {}
  int64_t add(const at::Tensor& t) {
    if (!t.defined() || !t.has_storage()) return 0;
    const void* data = t.storage().data_ptr().get();
    if (data == nullptr || !seen_.insert(data).second) return 0;
    return alloc_.live_bytes(data);
  }

 private:
  const fsdp::bench::CountingAllocator& alloc_;
  std::set<const void*> seen_;
};

/// Warm-up and measured steps of the memory run.
constexpr int64_t kMemoryWarmupSteps = 2;
constexpr int64_t kMemoryMeasuredSteps = 3;

/// Per-rank bytes of one variant on a fresh copy of the model, counted by the allocator. Every
/// figure counts only the allocations made since the model began to be built (the allocator's
/// mark()), so it is what this training run holds, whatever memory of an earlier run is released
/// meanwhile (e.g. the states of destroyed fully_shard models, which the module-state registry
/// drops at the next fully_shard call):
///   - step peak: the peak of live bytes over a whole training step, forward + backward +
///     optimizer.step() + zero_grad(), the peak reset right before the forward and read after
///     zero_grad (the largest over the measured steps), and the peak as it stood right after the
///     forward, and right after backward;
///   - steady state after optimizer.step() (before zero_grad): the live allocations behind the
///     parameters, the gradients and AdamW's state, and all live bytes; and all live bytes after
///     zero_grad (what is held between steps);
///   - at the moment of the step peak: the live bytes allocated during the step, and those held
///     from before it;
///   - fsdp: the peak of the unsharded FlatParameter buffers over forward + backward, and the
///     unsharded buffers' bytes at the moment of the step peak.
void bench_memory(JsonWriter& w, const std::string& model, bool fsdp, const Flags& f,
                  const TensorMap& t, fsdp::comm::Communicator& comm) {
  auto& alloc = fsdp::bench::CountingAllocator::install();
  int64_t params = 0, grads = 0, optim_state = 0, persistent = 0, after_zero_grad = 0;
  int64_t transient = 0, unsharded = 0, step_peak = 0, fb_peak = 0, step_start = 0;
  int64_t unsharded_at_peak = 0, fresh_at_peak = 0;
  int64_t lib_shards = 0, lib_grads = 0, max_in_flight = 0, absolute_peak = 0;
  std::vector<int64_t> step_peaks, fb_peaks, fwd_peaks, step_starts, step_ends;
  std::vector<int64_t> unsharded_at_ends;
  alloc.mark();
  const int64_t older = alloc.current();  // live bytes of allocations made before the mark
  JsonWriter handles_json;
  {
    auto tr = make_trainee(model, fsdp, t, comm.rank(), f.lr);
    // One training step as measured: forward, backward, optimizer step, zero_grad (set_to_none).
    auto step = [&](int64_t i, const std::function<void()>& after_forward,
                    const std::function<void()>& after_backward,
                    const std::function<void()>& after_optimizer_step) {
      {
        at::Tensor loss = tr->loss(i);
        if (after_forward) after_forward();
        loss.backward();
      }
      if (after_backward) after_backward();
      tr->optim->step();
      if (after_optimizer_step) after_optimizer_step();
      tr->optim->zero_grad();
    };
    // Warm-up: lazy initialisation, and the optimizer's state (created at its first step).
    tr->optim->zero_grad();
    for (int64_t i = 0; i < kMemoryWarmupSteps; ++i) step(i, nullptr, nullptr, nullptr);
    if (fsdp) {
      // The unsharded buffers keep their StorageImpl while freed and re-grown: watch those (only
      // handles that shard have one; a handle that does not is its own shard).
      std::vector<const c10::StorageImpl*> storages;
      for (auto& unit : tr->units) {
        unit.unshard();
        for (const auto& h : fsdp::detail::handles_of(unit)) {
          const c10::StorageImpl* s = h->params().front().param.storage().unsafeGetStorageImpl();
          if (h->is_sharded_strategy() && s != h->local_shard().storage().unsafeGetStorageImpl()) {
            storages.push_back(s);
          }
        }
        unit.reshard();
      }
      alloc.watch(storages);
      max_in_flight = tr->units.back().options().max_unshards_in_flight();
    }
    for (int64_t k = 0; k < kMemoryMeasuredSteps; ++k) {
      const int64_t i = kMemoryWarmupSteps + k;
      const bool last = k + 1 == kMemoryMeasuredSteps;
      const int64_t before = alloc.current_since_mark();
      step_start = std::max(step_start, before);
      step_starts.push_back(before);
      alloc.reset_peak();
      step(
          i, [&] { fwd_peaks.push_back(alloc.peak_since_mark()); },
          [&] {
            fb_peaks.push_back(alloc.peak_since_mark());
            transient = std::max(transient, alloc.peak_since_mark() - before);
            if (fsdp) unsharded = std::max(unsharded, alloc.watched_peak());
          },
          [&] {
            if (!last) return;
            // Steady state after the step, before zero_grad: what each kind of state holds.
            persistent = alloc.current_since_mark();
            StorageBytes param_bytes(alloc), grad_bytes(alloc), optim_bytes(alloc);
            for (const auto& p : tr->module->parameters()) {
              params += param_bytes.add(p);
              grads += grad_bytes.add(p.grad());
            }
            for (const auto& entry : tr->optim->state()) {
              const auto& s = static_cast<const torch::optim::AdamWParamState&>(*entry.second);
              optim_state += optim_bytes.add(s.exp_avg()) + optim_bytes.add(s.exp_avg_sq()) +
                             optim_bytes.add(s.max_exp_avg_sq());
            }
            for (auto& unit : tr->units) {
              lib_shards += unit.sharded_param_bytes();
              lib_grads += unit.sharded_grad_bytes();
            }
          });
      const int64_t peak = alloc.peak_since_mark();
      step_peaks.push_back(peak);
      absolute_peak = std::max(absolute_peak, alloc.peak());
      if (peak >= step_peak) {
        step_peak = peak;
        unsharded_at_peak = alloc.watched_at_peak();
        fresh_at_peak = alloc.fresh_at_peak();
      }
      step_ends.push_back(alloc.current_since_mark());
      unsharded_at_ends.push_back(alloc.watched_current());
      if (last) after_zero_grad = step_ends.back();
    }
    alloc.watch({});
    if (fsdp) write_handles(handles_json, tr->units);
  }
  fb_peak = *std::max_element(fb_peaks.begin(), fb_peaks.end());
  w.key(fsdp ? "fsdp" : "local").begin_object();
  w.member("params", params).member("grads", grads).member("optimizer", optim_state);
  w.member("peak_unsharded", unsharded).member("persistent_total", persistent);
  w.member("after_zero_grad_total", after_zero_grad);
  w.member("peak_forward_backward_transient", transient);
  w.member("step_peak", step_peak).member("forward_backward_peak", fb_peak);
  w.member("forward_peak", *std::max_element(fwd_peaks.begin(), fwd_peaks.end()));
  w.member("step_start", step_start);
  // At the step peak: bytes allocated during the step, and bytes held from before it.
  w.member("step_peak_allocated_during_step", fresh_at_peak);
  w.member("step_peak_held_from_before_step", step_peak - fresh_at_peak);
  w.key("step_peaks").array(step_peaks);
  // Live bytes right before each measured step's forward, and after its zero_grad.
  w.key("step_starts").array(step_starts);
  w.key("step_ends").array(step_ends);
  // Allocations older than the mark: live when the model began to be built, and still live at
  // the end of the run; and the allocator's own peak (all live bytes) over the measured steps.
  w.member("older_live_bytes_at_start", older);
  w.member("older_live_bytes_at_end", alloc.current() - alloc.current_since_mark());
  w.member("allocator_absolute_step_peak", absolute_peak);
  w.member("warmup_steps", kMemoryWarmupSteps).member("measured_steps", kMemoryMeasuredSteps);
  if (fsdp) {
    w.member("unsharded_at_step_peak", unsharded_at_peak);
    w.key("unsharded_at_step_ends").array(unsharded_at_ends);
    w.member("library_local_shard_bytes", lib_shards).member("library_sharded_grad_bytes", lib_grads);
    w.member("max_unshards_in_flight", max_in_flight);
    w.key("handles").raw(handles_json.str());
  }
  w.end_object();
}

/// fsdp::optim::AdamW's moments in float32 and in bfloat16 ([Note: bfloat16 moments], optim/adam.h)
/// on the fully_shard model: the bytes its first step allocates (the optimizer state, counted by
/// the allocator) against the formula 2 moments x (4 or 2) bytes x this rank's elements, and the
/// bytes per parameter that shards, sharded gradients and state hold over the ranks (formula 16 and
/// 12; the shards' padding adds a little). Without mixed precision: its bf16 parameter copies are
/// transient, so the bytes held between steps are the same with it.
void bench_optimizer_states(JsonWriter& w, const std::string& model, const Flags& f, const TensorMap& t,
                            fsdp::comm::Communicator& comm) {
  auto& alloc = fsdp::bench::CountingAllocator::install();
  w.key(model).begin_object();
  for (const bool low : {false, true}) {
    auto tr = make_trainee(model, /*fsdp=*/true, t, comm.rank(), f.lr, /*flat_optimizer=*/true,
                           low ? at::kBFloat16 : at::kFloat);
    tr->optim->zero_grad();
    {
      at::Tensor loss = tr->loss(0);
      loss.backward();
    }
    int64_t elements = 0, shard_bytes = 0, grad_bytes = 0;
    for (const auto& p : tr->module->parameters()) {
      if (p.grad().defined()) elements += p.numel();  // this rank's elements of the parameter
    }
    for (const auto& u : tr->units) {
      shard_bytes += u.sharded_param_bytes();
      grad_bytes += u.sharded_grad_bytes();
    }
    alloc.mark();
    tr->optim->step();
    const int64_t state = alloc.current_since_mark();
    at::Tensor sums = at::tensor(std::vector<int64_t>{elements, shard_bytes + grad_bytes + state}, at::kLong);
    comm.all_reduce(sums, c10d::ReduceOp::SUM, "optimizer state bytes").wait();
    w.key(low ? "bf16" : "float32").begin_object();
    w.member("elements", elements).member("state_bytes", state);
    w.member("formula_bytes", (low ? 2 + 2 : 4 + 4) * elements);
    w.member("held_bytes_over_ranks", sums[1].item<int64_t>()).member("elements_over_ranks", sums[0].item<int64_t>());
    w.end_object();
  }
  w.end_object();
}

int run(const Flags& f) {
  at::set_num_threads(static_cast<int>(f.threads));
  if (!f.write_init.empty()) {
    write_init(f);
    return 0;
  }
  auto pg = fsdp::comm::init_process_group();
  auto& comm = *pg.comm;
  const TensorMap tensors = fsdp::bench::load_tensor_file(f.init);
  JsonWriter w;
  w.begin_object();
  w.member("rank", static_cast<int64_t>(comm.rank()));
  w.key("timing").begin_object();
  for (const auto& model : f.models) {
    if (comm.rank() == 0) std::fprintf(stderr, "[fsdp_bench] W=%d %s: timing\n", comm.size(), model.c_str());
    bench_timing(w, model, f, tensors, comm);
  }
  w.end_object();
  if (f.memory) {
    w.key("memory").begin_object();
    for (const auto& model : f.models) {
      if (comm.rank() == 0) std::fprintf(stderr, "[fsdp_bench] W=%d %s: memory\n", comm.size(), model.c_str());
      w.key(model).begin_object();
      bench_memory(w, model, false, f, tensors, comm);
      bench_memory(w, model, true, f, tensors, comm);
      w.end_object();
    }
    w.end_object();
    w.key("optimizer_states").begin_object();
    for (const auto& model : f.models) bench_optimizer_states(w, model, f, tensors, comm);
    w.end_object();
  }
  w.end_object();
  const std::string mine = w.str();
  const auto all = comm.all_gather_bytes(std::vector<uint8_t>(mine.begin(), mine.end()), "results");
  if (comm.rank() == 0) {
    std::ofstream out(f.out);
    TORCH_CHECK(out, "cannot write ", f.out);
    out << "{\"program\":\"fsdp_bench\",\"world_size\":" << comm.size() << ",\"threads\":"
        << at::get_num_threads() << ",\"ranks\":[";
    for (size_t r = 0; r < all.size(); ++r) {
      out << (r ? "," : "") << std::string(all[r].begin(), all[r].end());
    }
    out << "]}\n";
    std::fprintf(stderr, "[fsdp_bench] wrote %s\n", f.out.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Flags flags;
  try {
    flags = parse_flags(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp_bench: %s\n", e.what());
    return 2;
  }
  try {
    return run(flags);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp_bench: error: %s\n", e.what());
    return 1;
  }
}
