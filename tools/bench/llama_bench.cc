// llama_bench: the Llama training step through the composition root (parallel/parallel_model.h:
// parallelize(llama_model_spec(...)) at a layout), next to PyTorch's on the same weights and data
// (tools/llama_benchmark.sh runs it under mpirun beside tools/bench/torch_llama_bench.py).
//
//   mpirun -np 2 llama_bench --init DIR --out JSON --layouts dp2
//   mpirun -np 4 llama_bench --init DIR --out JSON --layouts dp2xtp2,pp2xdp2
//            [--warmup N] [--steps N] [--microbatches M] [--memory 0|1] [--threads N] [--lr X]
//            [--weight-decay X] [--vocab-multiple N]
//
// DIR is what `torch_llama_bench.py init` writes: DIR/hf, a Hugging Face folder (config.json +
// model.safetensors, transformers' save_pretrained), loaded at every layout with
// fsdp::models::load_llama_hf; DIR/tokens.safetensors, `tokens` [batches, global batch, seq + 1].
//
// A layout is "ppP", "dpD" and "tpT" joined by 'x' (missing ones are 1), e.g. "dp2xtp2",
// "pp2xdp2": ParallelDims{.dp_shard = D, .tp = T, .pp = P}, the 1F1B schedule with --microbatches
// microbatches under pp (one otherwise), llama_model_spec's defaults (loss parallel under tp,
// every decoder layer a fully_shard unit, fully_shard's default options; under pp
// --pp-reshard-after-forward 0 gives every unit reshard_after_forward(false), torchtitan's policy
// there), AdamW (betas 0.9, 0.999,
// eps 1e-8). Data rank q of D takes sequences [q B, (q + 1) B) of each global batch, B = global
// batch / D (ParallelMesh::data_rank(): the ranks of a tp group and of a pipeline read the same).
//
// Timing: the layouts train step by step in turn (the order rotates every step), a barrier before
// each step; a step is forward_backward + optimizer.step() + zero_grad(); its time is the slowest
// rank's. The loss of the global batch (ParallelModel::global_loss, on a communicator of its own)
// is taken after each step, outside the timed region. The communicators of the job (tp,
// dp_shard, pp groups and the world) count calls and bytes per kind; each layout adds up the
// counters' changes around its own measured steps (the world communicator is shared by the
// layouts of a run), printed per step against the closed forms below (tp_formula, dp_formula,
// pp_formula, world_formula), on every rank against its own. Memory (--memory 1, after
// the timings): the counting allocator (tools/bench/counting_allocator.h) is installed, each layout
// is built anew (mark() first) and trained 2 warm-up + 3 measured steps; the step peak is
// peak_since_mark() over a whole step (reset_peak() right before forward_backward, read after
// optimizer.step() and zero_grad()), the largest of the 3, per rank. Rank 0 writes the JSON.

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <exception>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>
#include <torch/optim/adamw.h>

#include "fsdp_cpp/checkpoint/full_state_dict_files.h"
#include "fsdp_cpp/comm/device_mesh.h"
#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/fully_shard_internal.h"
#include "fsdp_cpp/models/hf_checkpoint.h"
#include "fsdp_cpp/models/llama.h"
#include "fsdp_cpp/models/llama_parallel.h"
#include "fsdp_cpp/parallel/parallel_model.h"
#include "fsdp_cpp/tools/bench/counting_allocator.h"
#include "fsdp_cpp/tools/bench/json_writer.h"

namespace {

using Clock = std::chrono::steady_clock;
using fsdp::bench::JsonWriter;
using fsdp::comm::CollectiveKind;
using fsdp::comm::Communicator;

constexpr const char* kUsage = R"(usage:
  mpirun -np N llama_bench --init DIR --out JSON [--layouts dp2xtp2,pp2xdp2] [--warmup N] [--steps N]
           [--microbatches M] [--memory 0|1] [--threads N] [--lr X] [--weight-decay X] [--vocab-multiple N]
           [--pp-reshard-after-forward 0|1]
)";

struct Flags {
  std::string init, out, layouts = "dp2xtp2,pp2xdp2";
  int64_t warmup = 3, steps = 12, threads = 1, microbatches = 4, vocab_multiple = 8;
  bool memory = true, pp_reshard_after_forward = true;
  double lr = 1e-3, weight_decay = 0.1;
};

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
    } else if (a == "--init") f.init = need(i);
    else if (a == "--out") f.out = need(i);
    else if (a == "--layouts") f.layouts = need(i);
    else if (a == "--warmup") f.warmup = std::stoll(need(i));
    else if (a == "--steps") f.steps = std::stoll(need(i));
    else if (a == "--threads") f.threads = std::stoll(need(i));
    else if (a == "--microbatches") f.microbatches = std::stoll(need(i));
    else if (a == "--vocab-multiple") f.vocab_multiple = std::stoll(need(i));
    else if (a == "--memory") f.memory = std::stoi(need(i)) != 0;
    else if (a == "--pp-reshard-after-forward") f.pp_reshard_after_forward = std::stoi(need(i)) != 0;
    else if (a == "--lr") f.lr = std::stod(need(i));
    else if (a == "--weight-decay") f.weight_decay = std::stod(need(i));
    else throw std::invalid_argument("unknown flag '" + a + "'\n" + kUsage);
  }
  if (f.init.empty() || f.out.empty()) throw std::invalid_argument(std::string("give --init DIR and --out JSON\n") + kUsage);
  if (f.steps < 1) throw std::invalid_argument("--steps must be at least 1");
  return f;
}

// ---------------------------------------------------------------------------------------------
// Layouts, runs

struct Layout {
  int pp = 1, dp = 1, tp = 1;
  std::string name;
};

std::vector<Layout> parse_layouts(const std::string& text, int world) {
  std::vector<Layout> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    if (item.empty()) continue;
    Layout l;
    l.name = item;
    std::stringstream parts(item);
    for (std::string p; std::getline(parts, p, 'x');) {
      TORCH_CHECK(p.size() > 2, "llama_bench: layout '", item, "': expected ppN, dpN, tpN joined by 'x'");
      const std::string key = p.substr(0, 2);
      const int v = std::stoi(p.substr(2));
      if (key == "pp") l.pp = v;
      else if (key == "dp") l.dp = v;
      else if (key == "tp") l.tp = v;
      else TORCH_CHECK(false, "llama_bench: layout '", item, "': unknown dimension '", key, "' (pp, dp, tp)");
    }
    TORCH_CHECK(l.pp * l.dp * l.tp == world, "llama_bench: layout '", item, "' needs ", l.pp * l.dp * l.tp,
                " ranks; the world has ", world);
    out.push_back(l);
  }
  return out;
}

/// Calls and bytes per kind, summed over the measured steps of one layout (deltas around its own
/// steps: the world communicator is shared by every layout of a run).
struct Counts {
  int64_t calls[fsdp::comm::kNumCollectiveKinds]{}, bytes[fsdp::comm::kNumCollectiveKinds]{};
};
Counts snapshot(const Communicator& c) {
  Counts out;
  for (int k = 0; k < fsdp::comm::kNumCollectiveKinds; ++k) {
    const auto s = c.stats(static_cast<CollectiveKind>(k));
    out.calls[k] = s.calls;
    out.bytes[k] = s.bytes;
  }
  return out;
}

struct Data {
  at::Tensor tokens;  // [batches, global batch, seq + 1]
  int64_t batches = 0, global_batch = 0, seq = 0;
};

/// One layout's model under training.
struct Run {
  Layout layout;
  int microbatches = 1;
  bool reshard_after_forward = true;
  std::optional<fsdp::parallel::ParallelModel> model;
  std::unique_ptr<torch::optim::AdamW> optim;
  at::Tensor tokens;  // [batches, B, T + 1]: this data rank's sequences
  int64_t batch = 0;
  std::vector<double> step_s, fb_s, opt_s, cpu_s, global_losses;
  std::vector<std::pair<std::string, std::shared_ptr<Communicator>>> groups;  // tp, dp_shard, pp, world
  std::vector<Counts> counts;                                                 // per group, measured steps
};

std::unique_ptr<Run> make_run(const Layout& l, const Flags& f, const fsdp::models::LlamaConfig& config,
                              const Data& data, const std::shared_ptr<Communicator>& world) {
  auto run = std::make_unique<Run>();
  run->layout = l;
  run->microbatches = l.pp > 1 ? static_cast<int>(f.microbatches) : 1;
  run->reshard_after_forward = l.pp == 1 || f.pp_reshard_after_forward;
  const auto spec = fsdp::models::llama_model_spec(config, /*init_seed=*/0);
  const auto options = fsdp::parallel::ParallelOptions()
                           .dims({.dp_replicate = 1, .dp_shard = l.dp, .tp = l.tp, .pp = l.pp})
                           .schedule(fsdp::pipeline::ScheduleKind::k1F1B)
                           .n_microbatches(run->microbatches)
                           .fully_shard(fsdp::FullyShardOptions().reshard_after_forward(
                               l.pp == 1 || f.pp_reshard_after_forward))
                           .seed(0);
  run->model.emplace(fsdp::parallel::parallelize(world, spec, options));
  fsdp::models::load_llama_hf(*run->model, config, f.init + "/hf");
  run->optim = std::make_unique<torch::optim::AdamW>(
      run->model->parameters(),
      torch::optim::AdamWOptions(f.lr).betas({0.9, 0.999}).eps(1e-8).weight_decay(f.weight_decay));
  TORCH_CHECK(data.global_batch % l.dp == 0, "llama_bench: the global batch ", data.global_batch,
              " is not a multiple of dp = ", l.dp);
  run->batch = data.global_batch / l.dp;
  const auto& mesh = run->model->mesh();
  const int64_t q = mesh.data_rank();
  run->tokens = data.tokens.narrow(1, q * run->batch, run->batch);
  run->groups = {{"tp", mesh.tp()}, {"dp_shard", mesh.group("dp_shard")}, {"pp", mesh.pp()},
                 {"world", run->model->world()}};
  run->counts.resize(run->groups.size());
  return run;
}

double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

/// Busy seconds of the whole machine (all CPUs) from /proc/stat.
double machine_busy_seconds() {
  std::ifstream in("/proc/stat");
  std::string cpu;
  int64_t user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0;
  in >> cpu >> user >> nice >> system >> idle >> iowait >> irq >> softirq;
  return static_cast<double>(user + nice + system + irq + softirq) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

double load1() {
  double l = -1;
  std::ifstream("/proc/loadavg") >> l;
  return l;
}

/// One training step on batch i; returns the step's loss as forward_backward gave it.
at::Tensor train_step(Run& r, int64_t i, bool timed) {
  const at::Tensor window = r.tokens[i % r.tokens.size(0)];
  const int64_t T = window.size(1) - 1;
  const at::Tensor x = window.narrow(1, 0, T).contiguous(), y = window.narrow(1, 1, T).contiguous();
  std::vector<Counts> before;
  if (timed) {
    for (const auto& [name, g] : r.groups) before.push_back(snapshot(*g));
  }
  const double c0 = process_cpu_seconds();
  const auto t0 = Clock::now();
  at::Tensor loss = r.model->forward_backward(x, y);
  const auto t1 = Clock::now();
  r.optim->step();
  r.model->zero_grad();
  const auto t2 = Clock::now();
  if (timed) {
    for (size_t g = 0; g < r.groups.size(); ++g) {
      const Counts after = snapshot(*r.groups[g].second);
      for (int k = 0; k < fsdp::comm::kNumCollectiveKinds; ++k) {
        r.counts[g].calls[k] += after.calls[k] - before[g].calls[k];
        r.counts[g].bytes[k] += after.bytes[k] - before[g].bytes[k];
      }
    }
    r.fb_s.push_back(seconds(t0, t1));
    r.opt_s.push_back(seconds(t1, t2));
    r.step_s.push_back(seconds(t0, t2));
    r.cpu_s.push_back(process_cpu_seconds() - c0);
  }
  return loss;
}

// ---------------------------------------------------------------------------------------------
// Closed forms: calls and bytes (comm/communicator.h's convention: the whole payload per call) per
// training step, per group and kind, on this rank.

struct KindCount {
  int64_t calls = 0, bytes = 0;
  bool known = true;  // false: no closed form for the bytes (variable-size metadata)
};

struct Formula {
  KindCount k[fsdp::comm::kNumCollectiveKinds];
  KindCount& operator[](CollectiveKind kind) { return k[static_cast<int>(kind)]; }
  const KindCount& operator[](CollectiveKind kind) const { return k[static_cast<int>(kind)]; }
};

/// The tp group (tp > 1), from composable/tensor_parallel.cc's styles, composable/loss_parallel.cc
/// and models/llama_parallel.cc's plan (no sequence parallelism, loss parallel, untied), fp32; per
/// microbatch of b sequences of T positions, width D, L decoder layers on this stage:
///   forward: embed_tokens (RowwiseParallel, output Replicate: all-reduce, first stage) + o_proj
///     and down_proj per layer (RowwiseParallel: all-reduce);
///   backward: the inputs of q/k/v_proj and gate/up_proj per layer and of lm_head (last stage)
///     (ColwiseParallel, input Replicate: copy_to_tp, all-reduce of its gradient);
///   loss parallel (last stage): 3 all-reduces of b T fp32 values (row max, sum of exponentials,
///     target logit).
/// Each all-reduce of activations carries b T D values; summed over the m microbatches of a step,
/// B = m b sequences per data rank.
Formula tp_formula(const Run& r, const fsdp::models::LlamaConfig& c, int64_t T, bool first, bool last,
                   int64_t layers) {
  Formula g;
  if (r.layout.tp == 1) return g;
  const int64_t e = 4, D = c.hidden_size(), B = r.batch, m = r.microbatches;
  const int64_t act = (first ? 1 : 0) + 7 * layers + (last ? 1 : 0);
  auto& ar = g[CollectiveKind::kAllReduce];
  ar.calls = m * (act + (last ? 3 : 0));
  ar.bytes = act * B * T * D * e + (last ? 3 * B * T * e : 0);
  return g;
}

/// The dp_shard group (dp > 1), fully_shard's defaults (FULL_SHARD, reshard after forward), from
/// the FlatParameters' layouts: per handle that shards, padded numel x element size per all-gather;
/// reduce-scattered once per step (the pipeline and gradient accumulation sync only in the last
/// microbatch's backward).
///   without pipeline (1 microbatch): each decoder layer unit all-gathered twice (forward, and again
///     in backward after its reshard), the root once (it stays unsharded from its forward to the end
///     of backward).
///   pipeline, m microbatches: each layer unit twice per microbatch (its forward and its backward),
///     the root once per microbatch (unsharded from its forward to the end of that backward); with
///     --pp-reshard-after-forward 0 (SHARD_GRAD_OP, torchtitan's policy under pp) each layer unit
///     once per microbatch (resharded after each microbatch's backward).
///   one all-reduce of the units' backward reach per backward pass (below); under the pipeline one
///   all_gather_bytes per step: the schedule's error agreement over the stages' data-parallel
///   groups ([Note: pipeline step agreement] in pipeline/schedule.cc), a few bytes.
Formula dp_formula(const Run& r, const std::vector<fsdp::FSDPModule>& layer_units, const fsdp::FSDPModule& root) {
  Formula g;
  if (r.layout.dp == 1) return g;
  const int64_t m = r.microbatches;
  auto add = [&](const fsdp::FSDPModule& unit, int64_t gathers) {
    for (const auto& h : fsdp::detail::handles_of(unit)) {
      const auto& layout = h->layout();
      if (!h->is_sharded_strategy() || layout.world_size <= 1) continue;
      auto& ag = g[CollectiveKind::kAllGather];
      ag.calls += gathers;
      ag.bytes += gathers * layout.padded_numel * static_cast<int64_t>(c10::elementSize(h->compute_dtype()));
      if (h->requires_grad()) {
        auto& rs = g[CollectiveKind::kReduceScatter];
        rs.calls += 1;
        rs.bytes += layout.padded_numel * static_cast<int64_t>(c10::elementSize(h->reduce_dtype()));
      }
    }
  };
  for (const auto& u : layer_units) add(u, r.reshard_after_forward ? 2 * m : m);
  add(root, m);
  // [Note: backward reach] (fsdp/backward_reach.cc): every backward pass begins with one MAX
  // all-reduce of 4 n + 2 int64 fields over the root's group (n units: the layers and the root).
  const int64_t n = static_cast<int64_t>(layer_units.size()) + 1;
  g[CollectiveKind::kAllReduce] = {m, m * (4 * n + 2) * 8};
  if (r.layout.pp > 1) g[CollectiveKind::kAllGatherBytes] = {1, 0, false};
  return g;
}

/// The pp group (pp > 1): each microbatch's activation [b, T, D] fp32 sent forward and its gradient
/// sent back, over the one boundary between the 2 stages of each rank's pipeline: a rank sends m
/// tensors and receives m, B T D x 4 bytes each way per step.
Formula pp_formula(const Run& r, const fsdp::models::LlamaConfig& c, int64_t T) {
  Formula g;
  if (r.layout.pp == 1) return g;
  const int64_t bytes = r.batch * T * c.hidden_size() * 4;
  // Stage s sends to s + 1 (activations) and s - 1 (gradients): inner stages send twice.
  const int peers = r.layout.pp > 2 ? 2 : 1;
  g[CollectiveKind::kSend] = {peers * r.microbatches, peers * bytes};
  g[CollectiveKind::kRecv] = {peers * r.microbatches, peers * bytes};
  // [Note: pipeline step agreement]: the step's descriptors, the error agreement before the step
  // and the exchange of failures after it: 3 all_gather_bytes of a few dozen bytes.
  g[CollectiveKind::kAllGatherBytes] = {3, 0, false};
  return g;
}

/// The world: forward_backward's per-step agreement (one all-gather of each rank's batch shapes,
/// data rank and counted targets, a few dozen bytes: no closed form for the bytes).
Formula world_formula() {
  Formula g;
  g[CollectiveKind::kAllGatherBytes] = {1, 0, false};
  return g;
}

const std::vector<std::pair<CollectiveKind, const char*>>& kinds() {
  static const std::vector<std::pair<CollectiveKind, const char*>> k{
      {CollectiveKind::kAllGather, "all_gather"},         {CollectiveKind::kReduceScatter, "reduce_scatter"},
      {CollectiveKind::kAllReduce, "all_reduce"},         {CollectiveKind::kBroadcast, "broadcast"},
      {CollectiveKind::kAllGatherList, "all_gather_list"}, {CollectiveKind::kAllGatherBytes, "all_gather_bytes"},
      {CollectiveKind::kBarrier, "barrier"},              {CollectiveKind::kAllToAll, "all_to_all"},
      {CollectiveKind::kSend, "send"},                    {CollectiveKind::kRecv, "recv"}};
  return k;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/// Element-wise reduction of `v` over the bench communicator.
std::vector<double> reduce_all(const std::vector<double>& v, Communicator& comm, c10d::ReduceOp op) {
  at::Tensor t = at::tensor(v, at::kDouble);
  comm.all_reduce(t, op).wait();
  return std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
}

/// A group's measured counts per step next to this rank's formula; `matches`: on every rank the
/// measured calls and bytes equal the formula's (bytes only where a closed form exists).
struct GroupResult {
  std::string name;
  int size = 1;
  double calls[fsdp::comm::kNumCollectiveKinds]{}, bytes[fsdp::comm::kNumCollectiveKinds]{};
  Formula formula;
  bool matches = true, same_on_all_ranks = true;
};

GroupResult measure_group(const std::string& name, const Communicator& group, const Counts& counts, const Formula& f,
                          int64_t steps, Communicator& bench) {
  GroupResult g;
  g.name = name;
  g.size = group.size();
  g.formula = f;
  std::vector<double> v;
  double mismatch = 0;
  for (const auto& [kind, kname] : kinds()) {
    const int k = static_cast<int>(kind);
    const double calls = static_cast<double>(counts.calls[k]) / static_cast<double>(steps);
    const double bytes = static_cast<double>(counts.bytes[k]) / static_cast<double>(steps);
    v.push_back(calls);
    v.push_back(bytes);
    const KindCount& fk = f[kind];
    if (calls != static_cast<double>(fk.calls) || (fk.known && bytes != static_cast<double>(fk.bytes))) mismatch = 1;
  }
  const auto hi = reduce_all(v, bench, c10d::ReduceOp::MAX);
  const auto lo = reduce_all(v, bench, c10d::ReduceOp::MIN);
  g.matches = reduce_all({mismatch}, bench, c10d::ReduceOp::MAX)[0] == 0;
  for (size_t k = 0; k < kinds().size(); ++k) {
    g.calls[k] = v[2 * k];
    g.bytes[k] = v[2 * k + 1];
    if (hi[2 * k] != lo[2 * k] || hi[2 * k + 1] != lo[2 * k + 1]) g.same_on_all_ranks = false;
  }
  return g;
}

void write_group(JsonWriter& w, const GroupResult& g) {
  w.key(g.name).begin_object();
  w.member("size", static_cast<int64_t>(g.size));
  w.member("same_on_all_ranks", g.same_on_all_ranks);
  w.member("every_rank_matches_formula", g.matches);
  w.key("per_step").begin_object();
  for (size_t k = 0; k < kinds().size(); ++k) {
    const KindCount& fk = g.formula[kinds()[k].first];
    if (g.calls[k] == 0 && fk.calls == 0) continue;
    w.key(kinds()[k].second).begin_object();
    w.member("calls", g.calls[k]).member("bytes", g.bytes[k]);
    w.member("formula_calls", fk.calls);
    if (fk.known) w.member("formula_bytes", fk.bytes);
    else w.key("formula_bytes").raw("null");
    w.end_object();
  }
  w.end_object();
  w.end_object();
}

/// The units of this rank's part: its decoder layers' and the root.
std::vector<fsdp::FSDPModule> layer_units_of(const fsdp::parallel::ParallelModel& model, bool* first, bool* last,
                                             int64_t* layers) {
  std::vector<fsdp::FSDPModule> units;
  TORCH_CHECK(model.parts().size() == 1, "llama_bench: one stage chunk per rank expected");
  auto llama = std::dynamic_pointer_cast<fsdp::models::LlamaForCausalLMImpl>(model.parts().front().module);
  TORCH_CHECK(llama, "llama_bench: the part is not a LlamaForCausalLM");
  *first = llama->is_first_stage();
  *last = llama->is_last_stage();
  const auto list = llama->layer_list();
  *layers = static_cast<int64_t>(list.size());
  for (const auto& layer : list) {
    auto u = fsdp::fsdp_module_of(*layer.ptr());
    if (u) units.push_back(*u);
  }
  return units;
}

// ---------------------------------------------------------------------------------------------
// Memory

struct MemoryResult {
  int64_t step_peak = 0, held = 0;
  std::vector<int64_t> peaks;
};

MemoryResult measure_memory(const Layout& l, const Flags& f, const fsdp::models::LlamaConfig& config,
                            const Data& data, const std::shared_ptr<Communicator>& world) {
  auto& alloc = fsdp::bench::CountingAllocator::install();
  MemoryResult m;
  alloc.mark();
  {
    auto r = make_run(l, f, config, data, world);
    for (int64_t i = 0; i < 5; ++i) {
      const bool measure = i >= 2;
      if (measure) alloc.reset_peak();
      train_step(*r, i, false);
      if (measure) {
        m.peaks.push_back(alloc.peak_since_mark());
        m.step_peak = std::max(m.step_peak, m.peaks.back());
        m.held = alloc.current_since_mark();
      }
    }
  }
  return m;
}

// ---------------------------------------------------------------------------------------------

int run(const Flags& f) {
  at::set_num_threads(static_cast<int>(f.threads));
  auto pg = fsdp::comm::init_process_group();
  const std::shared_ptr<Communicator>& world = pg.comm;
  // The benchmark's own barriers and reductions, apart from the job's communicators.
  const auto bench_mesh = fsdp::comm::DeviceMesh::create(*world, {world->size()}, {"bench"});
  Communicator& bench = *bench_mesh->group("bench");
  const bool root = world->rank() == 0;
  const auto config = fsdp::models::read_llama_config(f.init + "/hf", f.vocab_multiple);
  Data data;
  {
    const auto file = fsdp::load_safetensors(f.init + "/tokens.safetensors");
    const at::Tensor* t = file.find("tokens");
    TORCH_CHECK(t != nullptr && t->dim() == 3, "llama_bench: ", f.init, "/tokens.safetensors has no 'tokens' "
                "[batches, global batch, seq + 1]");
    data.tokens = t->to(at::kLong).contiguous();
    data.batches = t->size(0);
    data.global_batch = t->size(1);
    data.seq = t->size(2) - 1;
  }
  const auto layouts = parse_layouts(f.layouts, world->size());

  std::vector<std::unique_ptr<Run>> runs;
  for (const auto& l : layouts) runs.push_back(make_run(l, f, config, data, world));
  if (root) {
    std::fprintf(stderr, "[llama_bench] %d ranks, Llama %lld layers, hidden %lld, %lld heads (%lld kv), intermediate "
                 "%lld, vocab %lld (padded %lld), seq %lld, global batch %lld; layouts %s; %lld warm-up + %lld "
                 "measured steps each\n", world->size(), (long long)config.num_hidden_layers(),
                 (long long)config.hidden_size(), (long long)config.num_attention_heads(), (long long)config.kv_heads(),
                 (long long)config.intermediate_size(), (long long)config.vocab_size(),
                 (long long)config.padded_vocab_size(), (long long)data.seq, (long long)data.global_batch,
                 f.layouts.c_str(), (long long)f.warmup, (long long)f.steps);
  }
  // Timing, the layouts step by step in turn.
  double busy0 = 0, own0 = 0, wall = 0;
  const double load_before = load1();
  Clock::time_point w0;
  for (int64_t i = 0; i < f.warmup + f.steps; ++i) {
    if (i == f.warmup) {
      bench.barrier();
      busy0 = machine_busy_seconds();
      own0 = process_cpu_seconds();
      w0 = Clock::now();
    }
    for (size_t k = 0; k < runs.size(); ++k) {
      Run& r = *runs[(k + static_cast<size_t>(i)) % runs.size()];
      bench.barrier();
      const at::Tensor loss = train_step(r, i, i >= f.warmup);
      const double global = r.model->global_loss(loss);
      if (i >= f.warmup) r.global_losses.push_back(global);
    }
  }
  bench.barrier();
  wall = seconds(w0, Clock::now());
  const double busy = machine_busy_seconds() - busy0;
  const double own = reduce_all({process_cpu_seconds() - own0}, bench, c10d::ReduceOp::SUM)[0];
  const double load_after = load1();

  struct Row {
    double step_ms, fb_ms, opt_ms, cpu_ms, tokens_per_step;
    std::vector<double> steps_ms, losses;
    std::vector<GroupResult> groups;
  };
  std::vector<Row> rows;
  for (auto& r : runs) {
    Row row;
    bool first = false, last = false;
    int64_t layers = 0;
    const auto units = layer_units_of(*r->model, &first, &last, &layers);
    const std::vector<Formula> formulas{tp_formula(*r, config, data.seq, first, last, layers),
                                        dp_formula(*r, units, r->model->roots().front()),
                                        pp_formula(*r, config, data.seq), world_formula()};
    for (size_t g = 0; g < r->groups.size(); ++g) {
      row.groups.push_back(measure_group(r->groups[g].first, *r->groups[g].second, r->counts[g], formulas[g], f.steps,
                                         bench));
    }
    const auto step = reduce_all(r->step_s, bench, c10d::ReduceOp::MAX);
    row.step_ms = 1e3 * median(step);
    row.fb_ms = 1e3 * median(reduce_all(r->fb_s, bench, c10d::ReduceOp::MAX));
    row.opt_ms = 1e3 * median(reduce_all(r->opt_s, bench, c10d::ReduceOp::MAX));
    row.cpu_ms = 1e3 * median(reduce_all(r->cpu_s, bench, c10d::ReduceOp::MAX));
    for (double s : step) row.steps_ms.push_back(1e3 * s);
    row.losses = r->global_losses;
    row.tokens_per_step = static_cast<double>(data.global_batch * data.seq);
    rows.push_back(std::move(row));
  }
  runs.clear();
  std::vector<std::vector<double>> peaks(layouts.size());
  std::vector<MemoryResult> memory(layouts.size());
  if (f.memory) {
    for (size_t k = 0; k < layouts.size(); ++k) {
      if (root) std::fprintf(stderr, "[llama_bench] memory: %s\n", layouts[k].name.c_str());
      memory[k] = measure_memory(layouts[k], f, config, data, world);
      std::vector<double> mine(static_cast<size_t>(world->size()), 0.0);
      mine[static_cast<size_t>(world->rank())] = static_cast<double>(memory[k].step_peak);
      peaks[k] = reduce_all(mine, bench, c10d::ReduceOp::SUM);
    }
  }

  JsonWriter w;
  w.begin_object();
  w.member("program", "llama_bench").member("world_size", static_cast<int64_t>(world->size()));
  w.member("threads", static_cast<int64_t>(at::get_num_threads()));
  w.key("config").begin_object();
  w.member("layers", config.num_hidden_layers()).member("hidden", config.hidden_size());
  w.member("heads", config.num_attention_heads()).member("kv_heads", config.kv_heads());
  w.member("intermediate", config.intermediate_size()).member("vocab", config.vocab_size());
  w.member("padded_vocab", config.padded_vocab_size()).member("parameters", config.num_parameters());
  w.member("seq", data.seq).member("global_batch", data.global_batch);
  w.member("warmup", f.warmup).member("steps", f.steps).member("lr", f.lr).member("weight_decay", f.weight_decay);
  w.member("pp_reshard_after_forward", f.pp_reshard_after_forward);
  w.end_object();
  w.key("machine").begin_object();
  w.member("cores", static_cast<int64_t>(sysconf(_SC_NPROCESSORS_ONLN)));
  w.member("load1_before", load_before).member("load1_after", load_after);
  w.member("timing_wall_s", wall).member("ranks_cpu_s", own).member("machine_busy_cpu_s", busy);
  w.member("other_processes_cores", (busy - own) / wall);
  w.end_object();
  w.key("layouts").begin_array();
  for (size_t k = 0; k < layouts.size(); ++k) {
    const Layout& l = layouts[k];
    const Row& row = rows[k];
    w.begin_object();
    w.member("name", l.name).member("pp", static_cast<int64_t>(l.pp)).member("dp", static_cast<int64_t>(l.dp));
    w.member("tp", static_cast<int64_t>(l.tp));
    w.member("microbatches", static_cast<int64_t>(l.pp > 1 ? f.microbatches : 1));
    w.member("batch_per_data_rank", data.global_batch / l.dp);
    w.member("tokens_per_step", row.tokens_per_step);
    w.member("step_ms", row.step_ms).member("forward_backward_ms", row.fb_ms).member("optimizer_ms", row.opt_ms);
    w.member("cpu_ms", row.cpu_ms);
    w.member("tokens_per_s_per_rank", row.tokens_per_step / (row.step_ms / 1e3) / world->size());
    w.key("steps_ms").array(row.steps_ms);
    w.key("global_losses").array(row.losses);
    if (f.memory) {
      std::vector<int64_t> p;
      for (double x : peaks[k]) p.push_back(static_cast<int64_t>(x));
      w.key("step_peak_bytes_per_rank").array(p);
      w.member("step_peak_bytes_max", *std::max_element(p.begin(), p.end()));
      w.key("step_peaks_rank0").array(memory[k].peaks);
      w.member("held_between_steps_bytes_rank0", memory[k].held);
    }
    w.key("comm").begin_object();
    for (const auto& g : row.groups) write_group(w, g);
    w.end_object();
    w.end_object();
  }
  w.end_array();
  w.end_object();

  if (root) {
    std::ofstream out(f.out);
    TORCH_CHECK(out, "llama_bench: cannot write ", f.out);
    out << w.str() << "\n";
    std::fprintf(stderr, "[llama_bench] ");
    for (size_t k = 0; k < layouts.size(); ++k) {
      std::fprintf(stderr, "%s %.1f ms (forward_backward %.1f, optimizer %.1f), last loss %.6f; ",
                   layouts[k].name.c_str(), rows[k].step_ms, rows[k].fb_ms, rows[k].opt_ms,
                   rows[k].losses.empty() ? 0.0 : rows[k].losses.back());
    }
    std::fprintf(stderr, "wrote %s\n", f.out.c_str());
  }
  bench.barrier();
  fsdp::comm::destroy_process_group();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Flags flags;
  try {
    flags = parse_flags(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llama_bench: %s\n", e.what());
    return 2;
  }
  try {
    return run(flags);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llama_bench: error: %s\n", e.what());
    return 1;
  }
}
