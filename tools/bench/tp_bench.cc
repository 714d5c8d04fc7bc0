// tp_bench: tensor parallelism x fully_shard on the example GPT (tools/tp_benchmark.sh runs it
// under `mpirun -np 4` next to PyTorch's FSDP2 + DTensor, tools/bench/torch_tp_bench.py).
//
//   tp_bench --write-init FILE [--vocab N --context N --d-model N --heads N --layers N
//            --global-batch N --batches N --seed N]        weights and data for both sides
//   mpirun -np 4 tp_bench --init FILE --out JSON [--layouts 4x1,2x2,2x2+sp,1x4,1x4+sp]
//            [--warmup N] [--steps N] [--memory 0|1] [--threads N]
//
// A layout "DPxTP" is a (dp, tp) DeviceMesh of the world: examples::parallelize_gpt over
// mesh->group("tp") (not applied when tp = 1: plain fully_shard), then fully_shard on every block
// and the root over mesh->group("dp"). "+sp" adds sequence parallelism and loss parallel (the
// vocabulary-parallel cross-entropy), "+lp" loss parallel alone. Every layout trains on the same
// global batch (--global-batch sequences per step): dp group q takes sequences [q B, (q + 1) B),
// B = global batch / dp, and the ranks of one tp group see the same B sequences.
//
// Timing: the layouts train step by step in turn (the order rotates every step, so none always
// follows the same one), a world barrier before each step; a step is zero_grad (set to none) +
// forward + loss + backward + AdamW step; its time is the slowest rank's. The communicators of
// the tp and dp groups count calls and bytes per collective kind (comm/communicator.h: the full
// payload per call: the output of an all-gather, the input of a reduce-scatter, the tensor of an
// all-reduce) over the measured steps; they are printed per step against the closed forms of
// tp_formula() and fsdp_formula() below. Memory (--memory 1, after the timings): a counting CPU
// allocator (tools/bench/counting_allocator.h) is installed, and each layout is built anew and
// trained 2 warm-up + 3 measured steps; the step peak is the allocator's peak of live bytes over
// a whole step (reset right before the forward, read after optimizer.step() and zero_grad()),
// counting only allocations made since that copy of the model began to be built, per rank.
// Rank 0 prints a table and writes the JSON.

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <exception>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/optim/adamw.h>
#include <torch/utils.h>

#include "fsdp_cpp/comm/device_mesh.h"
#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/fully_shard_internal.h"
#include "fsdp_cpp/examples/gpt_model.h"
#include "fsdp_cpp/examples/gpt_tensor_parallel.h"
#include "fsdp_cpp/tools/bench/bench_models.h"
#include "fsdp_cpp/tools/bench/counting_allocator.h"
#include "fsdp_cpp/tools/bench/json_writer.h"

namespace {

using Clock = std::chrono::steady_clock;
using fsdp::bench::JsonWriter;
using fsdp::bench::TensorMap;
using fsdp::comm::CollectiveKind;
using fsdp::comm::Communicator;

constexpr const char* kUsage = R"(usage:
  tp_bench --write-init FILE [--vocab N] [--context N] [--d-model N] [--heads N] [--layers N]
           [--global-batch N] [--batches N] [--seed N]
  mpirun -np 4 tp_bench --init FILE --out JSON [--layouts 4x1,2x2,2x2+sp,1x4,1x4+sp]
           [--warmup N] [--steps N] [--memory 0|1] [--threads N] [--lr X]
)";

struct Flags {
  std::string write_init, init, out;
  std::string layouts = "4x1,2x2,2x2+sp,1x4,1x4+sp";
  int64_t warmup = 3, steps = 12, threads = 1;
  bool memory = true;
  double lr = 1e-3;
  // --write-init
  int64_t vocab = 512, context = 64, d_model = 256, heads = 8, layers = 4, global_batch = 8,
          batches = 4;
  uint64_t seed = 0;
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
    } else if (a == "--write-init") f.write_init = need(i);
    else if (a == "--init") f.init = need(i);
    else if (a == "--out") f.out = need(i);
    else if (a == "--layouts") f.layouts = need(i);
    else if (a == "--warmup") f.warmup = std::stoll(need(i));
    else if (a == "--steps") f.steps = std::stoll(need(i));
    else if (a == "--threads") f.threads = std::stoll(need(i));
    else if (a == "--memory") f.memory = std::stoi(need(i)) != 0;
    else if (a == "--lr") f.lr = std::stod(need(i));
    else if (a == "--vocab") f.vocab = std::stoll(need(i));
    else if (a == "--context") f.context = std::stoll(need(i));
    else if (a == "--d-model") f.d_model = std::stoll(need(i));
    else if (a == "--heads") f.heads = std::stoll(need(i));
    else if (a == "--layers") f.layers = std::stoll(need(i));
    else if (a == "--global-batch") f.global_batch = std::stoll(need(i));
    else if (a == "--batches") f.batches = std::stoll(need(i));
    else if (a == "--seed") f.seed = std::stoull(need(i));
    else throw std::invalid_argument("unknown flag '" + a + "'\n" + kUsage);
  }
  if (f.write_init.empty() && (f.init.empty() || f.out.empty())) {
    throw std::invalid_argument(std::string("give --write-init FILE, or --init FILE and --out JSON\n") + kUsage);
  }
  if (f.steps < 1) throw std::invalid_argument("--steps must be at least 1");
  return f;
}

void write_init(const Flags& f) {
  torch::manual_seed(f.seed);
  auto config = fsdp::examples::GPTConfig(f.vocab)
                    .context_length(f.context)
                    .d_model(f.d_model)
                    .n_heads(f.heads)
                    .n_layers(f.layers);
  fsdp::examples::GPT gpt(config);
  TensorMap t;
  fsdp::bench::store_parameters(*gpt, t, "gpt.");
  t["gpt.config"] = at::tensor(std::vector<int64_t>{f.vocab, f.context, f.d_model, f.heads, f.layers,
                                                    config.mlp_ratio(), f.global_batch});
  t["gpt.tokens"] = at::randint(0, f.vocab, {f.batches, f.global_batch, f.context + 1}, at::kLong);
  fsdp::bench::save_tensor_file(f.write_init, t);
  std::printf("wrote %s (%zu tensors)\n", f.write_init.c_str(), t.size());
}

// ---------------------------------------------------------------------------------------------
// Layouts, models

struct Layout {
  int dp = 1, tp = 1;
  bool sp = false, lp = false;
  std::string name;
};

std::vector<Layout> parse_layouts(const std::string& text, int world) {
  std::vector<Layout> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    if (item.empty()) continue;
    Layout l;
    l.name = item;
    const auto x = item.find('x');
    TORCH_CHECK(x != std::string::npos, "tp_bench: layout '", item, "': expected DPxTP[+sp][+lp]");
    l.dp = std::stoi(item.substr(0, x));
    std::string rest = item.substr(x + 1);
    const auto plus = rest.find('+');
    l.tp = std::stoi(rest.substr(0, plus));
    if (plus != std::string::npos) {
      std::stringstream opts(rest.substr(plus + 1));
      for (std::string o; std::getline(opts, o, '+');) {
        if (o == "sp") l.sp = l.lp = true;  // sequence parallel comes with loss parallel here
        else if (o == "lp") l.lp = true;
        else TORCH_CHECK(false, "tp_bench: layout '", item, "': unknown option '", o, "' (sp, lp)");
      }
    }
    TORCH_CHECK(l.dp * l.tp == world, "tp_bench: layout '", item, "' needs ", l.dp * l.tp,
                " ranks; the world has ", world);
    TORCH_CHECK(l.tp > 1 || (!l.sp && !l.lp), "tp_bench: layout '", item, "': +sp/+lp need tp > 1");
    out.push_back(l);
  }
  return out;
}

int64_t cfg(const TensorMap& t, int64_t i) { return t.at("gpt.config").data_ptr<int64_t>()[i]; }

struct Dims {
  int64_t vocab, context, d, heads, layers, ratio, global_batch;
};

Dims dims_of(const TensorMap& t) {
  return Dims{cfg(t, 0), cfg(t, 1), cfg(t, 2), cfg(t, 3), cfg(t, 4), cfg(t, 5), cfg(t, 6)};
}

/// One layout's model under training.
struct Run {
  Layout layout;
  std::shared_ptr<fsdp::comm::DeviceMesh> mesh;
  fsdp::examples::GPT model{nullptr};
  fsdp::examples::GptLossFunction loss_fn;
  std::vector<fsdp::FSDPModule> units;  // the root last
  std::unique_ptr<torch::optim::AdamW> optim;
  at::Tensor tokens;  // [batches, B, T + 1]: this dp group's sequences
  int64_t batch = 0;  // sequences per step per dp group
  std::vector<double> step_s, fwd_s, bwd_s, opt_s, cpu_s, losses;
};

std::unique_ptr<Run> make_run(const Layout& l, const TensorMap& t, const Communicator& world, double lr) {
  const Dims d = dims_of(t);
  auto run = std::make_unique<Run>();
  run->layout = l;
  run->mesh = fsdp::comm::DeviceMesh::create(world, {l.dp, l.tp}, {"dp", "tp"});
  auto config = fsdp::examples::GPTConfig(d.vocab)
                    .context_length(d.context)
                    .d_model(d.d)
                    .n_heads(d.heads)
                    .n_layers(d.layers)
                    .mlp_ratio(d.ratio);
  run->model = fsdp::examples::GPT(config);
  fsdp::bench::load_parameters(*run->model, t, "gpt.");
  if (l.tp > 1) {
    run->loss_fn = fsdp::examples::parallelize_gpt(
        run->model, run->mesh->group("tp"),
        fsdp::examples::GptTensorParallel().sequence_parallel(l.sp).loss_parallel(l.lp));
  } else {
    run->loss_fn = fsdp::examples::next_token_loss;
  }
  const auto options = fsdp::FullyShardOptions().communicator(run->mesh->group("dp"));
  for (auto& block : run->model->block_list()) run->units.push_back(fsdp::fully_shard(block, options));
  run->units.push_back(fsdp::fully_shard(run->model, options));
  run->optim = std::make_unique<torch::optim::AdamW>(run->model->parameters(),
                                                     torch::optim::AdamWOptions(lr).weight_decay(0.01));
  TORCH_CHECK(d.global_batch % l.dp == 0, "tp_bench: the global batch ", d.global_batch,
              " is not a multiple of dp = ", l.dp);
  run->batch = d.global_batch / l.dp;
  const int64_t q = run->mesh->coordinate("dp");
  run->tokens = t.at("gpt.tokens").narrow(1, q * run->batch, run->batch);
  return run;
}

double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

/// Busy and steal seconds of the whole machine (all CPUs) from /proc/stat.
struct MachineCpu {
  double busy = 0, steal = 0;
};
MachineCpu machine_cpu() {
  std::ifstream in("/proc/stat");
  std::string cpu;
  int64_t user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
  in >> cpu >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal;
  const double hz = static_cast<double>(sysconf(_SC_CLK_TCK));
  return MachineCpu{static_cast<double>(user + nice + system + irq + softirq) / hz, static_cast<double>(steal) / hz};
}

double load1() {
  double l = -1;
  std::ifstream("/proc/loadavg") >> l;
  return l;
}

/// One training step on batch i: zero_grad, forward + loss, backward, AdamW step.
void train_step(Run& r, int64_t i, bool timed) {
  const at::Tensor window = r.tokens[i % r.tokens.size(0)];
  const int64_t T = window.size(1) - 1;
  const double c0 = process_cpu_seconds();
  const auto t0 = Clock::now();
  r.optim->zero_grad();
  at::Tensor loss = r.loss_fn(r.model(window.narrow(1, 0, T)), window.narrow(1, 1, T));
  const auto t1 = Clock::now();
  loss.backward();
  const auto t2 = Clock::now();
  r.optim->step();
  const auto t3 = Clock::now();
  if (!timed) return;
  r.fwd_s.push_back(seconds(t0, t1));
  r.bwd_s.push_back(seconds(t1, t2));
  r.opt_s.push_back(seconds(t2, t3));
  r.step_s.push_back(seconds(t0, t3));
  r.cpu_s.push_back(process_cpu_seconds() - c0);
  r.losses.push_back(loss.item<double>());
}

// ---------------------------------------------------------------------------------------------
// Closed forms: calls and bytes (comm/communicator.h's convention) per training step, per kind.

struct KindCount {
  int64_t calls = 0, bytes = 0;
};
struct GroupCounts {
  KindCount all_gather, reduce_scatter, all_reduce;
};

/// The tp group's collectives per step, from composable/tensor_parallel.cc's wrappers,
/// composable/tp_collectives.cc, composable/loss_parallel.cc and examples/gpt_tensor_parallel.cc's
/// output layer. fp32 activations (4 bytes); B sequences of T positions per dp group, width D,
/// vocabulary V, L blocks:
///  without sequence parallelism, per step:
///   all-reduce: forward tok_emb (RowwiseParallel, output Replicate) + 2 per block (attn.proj,
///     mlp.proj: reduce_from_tp); backward 2 per block (attn.qkv and mlp.fc inputs: copy_to_tp) +
///     the output layer's input (copy_to_tp): (4L + 2) calls of B T D elements each.
///   all-gather: the logits [B, T, V] (gather_from_tp), unless loss parallel: 1 call, B T V.
///  with sequence parallelism (Shard(1) residual stream):
///   all-gather: forward the attn.qkv and mlp.fc inputs (all_gather_tp) + the output layer's input,
///     backward the attn.proj and mlp.proj outputs' gradients (reduce_scatter_tp's backward) +
///     tok_emb's: (4L + 2) x B T D; + pos_emb's gradient (PrepareModuleOutput Replicate ->
///     Shard(0): split forward, all-gather backward): T D; + the logits unless loss parallel.
///   reduce-scatter: the same pairs the other way: (4L + 2) x B T D.
///   all-reduce (backward): the gradients of the sequence-parallel LayerNorms' weight and bias
///     (ln1, ln2 per block, ln_f: copy_to_tp) and of the row-parallel biases (attn.proj, mlp.proj):
///     (6L + 2) calls of D elements.
///  loss parallel: 3 all-reduces of B T fp32 values in forward (row max, sum of exponentials,
///   target logit), none in backward.
GroupCounts tp_formula(const Dims& d, const Layout& l, int64_t B) {
  GroupCounts g;
  if (l.tp == 1) return g;
  const int64_t e = 4, L = d.layers, T = d.context, D = d.d, V = d.vocab;
  const int64_t btd = B * T * D * e;
  if (!l.sp) {
    g.all_reduce = {4 * L + 2, (4 * L + 2) * btd};
  } else {
    g.all_gather = {4 * L + 3, (4 * L + 2) * btd + T * D * e};
    g.reduce_scatter = {4 * L + 2, (4 * L + 2) * btd};
    g.all_reduce = {6 * L + 2, (6 * L + 2) * D * e};
  }
  if (!l.lp) {
    g.all_gather.calls += 1;
    g.all_gather.bytes += B * T * V * e;
  } else {
    g.all_reduce.calls += 3;
    g.all_reduce.bytes += 3 * B * T * 4;
  }
  return g;
}

/// The dp group's collectives per step (fully_shard, FULL_SHARD defaults), from the FlatParameters'
/// layouts: per handle that shards (more than one rank), padded_numel x element size, all-gathered
/// twice (forward, and again in backward after resharding) for a block's unit and once for the root
/// (it stays unsharded from its forward to the end of its backward), reduce-scattered once.
GroupCounts fsdp_formula(const std::vector<fsdp::FSDPModule>& units) {
  GroupCounts g;
  for (size_t u = 0; u < units.size(); ++u) {
    const bool root = u + 1 == units.size();
    for (const auto& h : fsdp::detail::handles_of(units[u])) {
      const auto& layout = h->layout();
      if (!h->is_sharded_strategy() || layout.world_size <= 1) continue;
      const int64_t calls = root ? 1 : 2;
      g.all_gather.calls += calls;
      g.all_gather.bytes += calls * layout.padded_numel * static_cast<int64_t>(c10::elementSize(h->compute_dtype()));
      if (h->requires_grad()) {
        g.reduce_scatter.calls += 1;
        g.reduce_scatter.bytes += layout.padded_numel * static_cast<int64_t>(c10::elementSize(h->reduce_dtype()));
      }
    }
  }
  return g;
}

const std::vector<std::pair<CollectiveKind, const char*>>& kinds() {
  static const std::vector<std::pair<CollectiveKind, const char*>> k{
      {CollectiveKind::kAllGather, "all_gather"},       {CollectiveKind::kReduceScatter, "reduce_scatter"},
      {CollectiveKind::kAllReduce, "all_reduce"},       {CollectiveKind::kBroadcast, "broadcast"},
      {CollectiveKind::kAllGatherList, "all_gather_list"}, {CollectiveKind::kAllGatherBytes, "all_gather_bytes"},
      {CollectiveKind::kBarrier, "barrier"}};
  return k;
}

KindCount formula_of(const GroupCounts& g, CollectiveKind k) {
  if (k == CollectiveKind::kAllGather) return g.all_gather;
  if (k == CollectiveKind::kReduceScatter) return g.reduce_scatter;
  if (k == CollectiveKind::kAllReduce) return g.all_reduce;
  return {};
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/// Element-wise max (or sum) of `v` over the world.
std::vector<double> reduce_world(const std::vector<double>& v, Communicator& world, c10d::ReduceOp op) {
  at::Tensor t = at::tensor(v, at::kDouble);
  world.all_reduce(t, op).wait();
  return std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
}

/// Per-step calls and bytes of every kind on `group`, with the closed form: writes the JSON and
/// checks every rank counted the same (min == max over the world).
struct Measured {
  double calls[fsdp::comm::kNumCollectiveKinds]{}, bytes[fsdp::comm::kNumCollectiveKinds]{};
  bool same_on_all_ranks = true;
};
Measured measure_group(const Communicator& group, int64_t steps, Communicator& world) {
  std::vector<double> v;
  for (const auto& [kind, name] : kinds()) {
    const auto s = group.stats(kind);
    v.push_back(static_cast<double>(s.calls) / static_cast<double>(steps));
    v.push_back(static_cast<double>(s.bytes) / static_cast<double>(steps));
  }
  const auto hi = reduce_world(v, world, c10d::ReduceOp::MAX);
  const auto lo = reduce_world(v, world, c10d::ReduceOp::MIN);
  Measured m;
  for (size_t k = 0; k < kinds().size(); ++k) {
    m.calls[k] = v[2 * k];
    m.bytes[k] = v[2 * k + 1];
    // Groups differ (every tp group is a different set of ranks) but count the same by symmetry.
    if (hi[2 * k] != lo[2 * k] || hi[2 * k + 1] != lo[2 * k + 1]) m.same_on_all_ranks = false;
  }
  return m;
}

void write_group(JsonWriter& w, const std::string& name, int size, const Measured& m, const GroupCounts& f) {
  w.key(name).begin_object();
  w.member("size", static_cast<int64_t>(size));
  w.member("same_on_all_ranks", m.same_on_all_ranks);
  w.key("per_step").begin_object();
  for (size_t k = 0; k < kinds().size(); ++k) {
    const KindCount fk = formula_of(f, kinds()[k].first);
    if (m.calls[k] == 0 && fk.calls == 0) continue;
    w.key(kinds()[k].second).begin_object();
    w.member("calls", m.calls[k]).member("bytes", m.bytes[k]);
    w.member("formula_calls", fk.calls).member("formula_bytes", fk.bytes);
    w.member("ratio", fk.bytes ? m.bytes[k] / static_cast<double>(fk.bytes) : (m.bytes[k] == 0 ? 1.0 : -1.0));
    w.end_object();
  }
  w.end_object();
  w.end_object();
}

// ---------------------------------------------------------------------------------------------
// Memory

struct MemoryResult {
  int64_t step_peak = 0, forward_peak = 0, backward_peak = 0, held = 0;
};

MemoryResult measure_memory(const Layout& l, const TensorMap& t, Communicator& world, double lr) {
  auto& alloc = fsdp::bench::CountingAllocator::install();
  MemoryResult m;
  alloc.mark();
  {
    auto r = make_run(l, t, world, lr);
    auto step = [&](int64_t i, bool measure) {
      const at::Tensor window = r->tokens[i % r->tokens.size(0)];
      const int64_t T = window.size(1) - 1;
      if (measure) alloc.reset_peak();
      {
        at::Tensor loss = r->loss_fn(r->model(window.narrow(1, 0, T)), window.narrow(1, 1, T));
        if (measure) m.forward_peak = std::max(m.forward_peak, alloc.peak_since_mark());
        loss.backward();
      }
      if (measure) m.backward_peak = std::max(m.backward_peak, alloc.peak_since_mark());
      r->optim->step();
      r->optim->zero_grad();
      if (measure) {
        m.step_peak = std::max(m.step_peak, alloc.peak_since_mark());
        m.held = alloc.current_since_mark();
      }
    };
    r->optim->zero_grad();
    for (int64_t i = 0; i < 2; ++i) step(i, false);
    for (int64_t i = 2; i < 5; ++i) step(i, true);
  }
  return m;
}

// ---------------------------------------------------------------------------------------------

std::string fmt_bytes(double b) {
  char buf[64];
  if (b >= 1024.0 * 1024.0) std::snprintf(buf, sizeof buf, "%.2f MiB", b / (1024.0 * 1024.0));
  else if (b >= 1024.0) std::snprintf(buf, sizeof buf, "%.1f KiB", b / 1024.0);
  else std::snprintf(buf, sizeof buf, "%.0f B", b);
  return buf;
}

int run(const Flags& f) {
  at::set_num_threads(static_cast<int>(f.threads));
  if (!f.write_init.empty()) {
    write_init(f);
    return 0;
  }
  auto pg = fsdp::comm::init_process_group();
  Communicator& world = *pg.comm;
  const bool root = world.rank() == 0;
  const TensorMap tensors = fsdp::bench::load_tensor_file(f.init);
  const Dims d = dims_of(tensors);
  const auto layouts = parse_layouts(f.layouts, world.size());

  std::vector<std::unique_ptr<Run>> runs;
  for (const auto& l : layouts) runs.push_back(make_run(l, tensors, world, f.lr));
  if (root) {
    std::fprintf(stderr, "[tp_bench] %d ranks, GPT vocab %lld context %lld d_model %lld heads %lld layers %lld, "
                 "global batch %lld; layouts %s; %lld warm-up + %lld measured steps each\n", world.size(),
                 (long long)d.vocab, (long long)d.context, (long long)d.d, (long long)d.heads,
                 (long long)d.layers, (long long)d.global_batch, f.layouts.c_str(), (long long)f.warmup,
                 (long long)f.steps);
  }
  // Timing, the layouts step by step in turn.
  MachineCpu cpu0{}, cpu1{};
  double own0 = 0, load_before = load1(), wall = 0;
  Clock::time_point w0;
  for (int64_t i = 0; i < f.warmup + f.steps; ++i) {
    if (i == f.warmup) {
      for (auto& r : runs) {
        r->mesh->group("tp")->reset_stats();
        r->mesh->group("dp")->reset_stats();
      }
      world.barrier();
      cpu0 = machine_cpu();
      own0 = process_cpu_seconds();
      w0 = Clock::now();
    }
    for (size_t k = 0; k < runs.size(); ++k) {
      Run& r = *runs[(k + static_cast<size_t>(i)) % runs.size()];
      world.barrier();
      train_step(r, i, i >= f.warmup);
    }
  }
  world.barrier();
  wall = seconds(w0, Clock::now());
  cpu1 = machine_cpu();
  const double own = reduce_world({process_cpu_seconds() - own0}, world, c10d::ReduceOp::SUM)[0];
  const double load_after = load1();

  JsonWriter w;
  w.begin_object();
  w.member("program", "tp_bench").member("world_size", static_cast<int64_t>(world.size()));
  w.member("threads", static_cast<int64_t>(at::get_num_threads()));
  w.key("config").begin_object();
  w.member("vocab", d.vocab).member("context", d.context).member("d_model", d.d).member("heads", d.heads);
  w.member("layers", d.layers).member("mlp_ratio", d.ratio).member("global_batch", d.global_batch);
  w.member("warmup", f.warmup).member("steps", f.steps).member("qkv", "fused (ColwiseParallel chunks(3))");
  w.end_object();
  // Machine load during the measured steps: CPU seconds the whole machine was busy (/proc/stat)
  // minus the ranks' own process CPU, over the wall time: cores others used on average.
  const double others = (cpu1.busy - cpu0.busy - own) / wall;
  w.key("machine").begin_object();
  w.member("cores", static_cast<int64_t>(sysconf(_SC_NPROCESSORS_ONLN)));
  w.member("load1_before", load_before).member("load1_after", load_after);
  w.member("timing_wall_s", wall).member("ranks_cpu_s", own).member("machine_busy_cpu_s", cpu1.busy - cpu0.busy);
  w.member("other_processes_cores", others).member("steal_cores", (cpu1.steal - cpu0.steal) / wall);
  w.end_object();

  std::vector<MemoryResult> memory(runs.size());
  std::vector<std::vector<double>> peaks(runs.size());
  // Measure the collectives and the step times before anything else communicates.
  struct Row {
    double step_ms, fwd_ms, bwd_ms, opt_ms, cpu_ms;
    Measured tp, dp;
    GroupCounts tpf, dpf;
    std::vector<double> steps_ms, losses;
  };
  std::vector<Row> rows;
  for (auto& r : runs) {
    Row row;
    row.tp = measure_group(*r->mesh->group("tp"), f.steps, world);
    row.dp = measure_group(*r->mesh->group("dp"), f.steps, world);
    row.tpf = tp_formula(d, r->layout, r->batch);
    row.dpf = fsdp_formula(r->units);
    const auto step = reduce_world(r->step_s, world, c10d::ReduceOp::MAX);
    row.step_ms = 1e3 * median(step);
    row.fwd_ms = 1e3 * median(reduce_world(r->fwd_s, world, c10d::ReduceOp::MAX));
    row.bwd_ms = 1e3 * median(reduce_world(r->bwd_s, world, c10d::ReduceOp::MAX));
    row.opt_ms = 1e3 * median(reduce_world(r->opt_s, world, c10d::ReduceOp::MAX));
    row.cpu_ms = 1e3 * median(reduce_world(r->cpu_s, world, c10d::ReduceOp::MAX));
    for (double s : step) row.steps_ms.push_back(1e3 * s);
    row.losses = r->losses;
    rows.push_back(std::move(row));
  }
  runs.clear();
  if (f.memory) {
    for (size_t k = 0; k < layouts.size(); ++k) {
      if (root) std::fprintf(stderr, "[tp_bench] memory: %s\n", layouts[k].name.c_str());
      memory[k] = measure_memory(layouts[k], tensors, world, f.lr);
      std::vector<double> mine(static_cast<size_t>(world.size()), 0.0);
      mine[static_cast<size_t>(world.rank())] = static_cast<double>(memory[k].step_peak);
      peaks[k] = reduce_world(mine, world, c10d::ReduceOp::SUM);
    }
  }

  w.key("layouts").begin_array();
  for (size_t k = 0; k < layouts.size(); ++k) {
    const Layout& l = layouts[k];
    const Row& row = rows[k];
    w.begin_object();
    w.member("name", l.name).member("dp", static_cast<int64_t>(l.dp)).member("tp", static_cast<int64_t>(l.tp));
    w.member("sequence_parallel", l.sp).member("loss_parallel", l.lp);
    w.member("batch_per_dp_group", d.global_batch / l.dp);
    w.member("step_ms", row.step_ms).member("forward_ms", row.fwd_ms).member("backward_ms", row.bwd_ms);
    w.member("optimizer_ms", row.opt_ms).member("cpu_ms", row.cpu_ms);
    w.key("steps_ms").array(row.steps_ms);
    w.key("losses_rank0").array(row.losses);
    if (f.memory) {
      std::vector<int64_t> p;
      for (double x : peaks[k]) p.push_back(static_cast<int64_t>(x));
      w.key("step_peak_bytes_per_rank").array(p);
      w.member("step_peak_bytes_max", static_cast<int64_t>(*std::max_element(peaks[k].begin(), peaks[k].end())));
      w.member("forward_peak_bytes_rank0", memory[k].forward_peak);
      w.member("backward_peak_bytes_rank0", memory[k].backward_peak);
      w.member("held_between_steps_bytes_rank0", memory[k].held);
    }
    w.key("comm").begin_object();
    write_group(w, "tp", l.tp, row.tp, row.tpf);
    write_group(w, "dp", l.dp, row.dp, row.dpf);
    w.end_object();
    w.end_object();
  }
  w.end_array();
  w.end_object();

  if (root) {
    std::ofstream out(f.out);
    TORCH_CHECK(out, "tp_bench: cannot write ", f.out);
    out << w.str() << "\n";
    std::printf("\n== tp_bench: %d ranks, GPT d_model %lld, %lld layers, %lld heads, vocab %lld, context %lld, "
                "global batch %lld (median of %lld steps, slowest rank) ==\n", world.size(), (long long)d.d,
                (long long)d.layers, (long long)d.heads, (long long)d.vocab, (long long)d.context,
                (long long)d.global_batch, (long long)f.steps);
    std::printf("%-10s %9s %8s %8s %8s %8s %12s %8s\n", "layout", "step ms", "fwd", "bwd", "optim", "cpu ms",
                "peak/rank", "vs 4x1");
    const double base = f.memory && !peaks.empty() ? *std::max_element(peaks[0].begin(), peaks[0].end()) : 0;
    for (size_t k = 0; k < layouts.size(); ++k) {
      const double pk = f.memory ? *std::max_element(peaks[k].begin(), peaks[k].end()) : 0;
      std::printf("%-10s %9.1f %8.1f %8.1f %8.1f %8.1f %12s %8.3f\n", layouts[k].name.c_str(), rows[k].step_ms,
                  rows[k].fwd_ms, rows[k].bwd_ms, rows[k].opt_ms, rows[k].cpu_ms, fmt_bytes(pk).c_str(),
                  base > 0 ? pk / base : 0.0);
    }
    std::printf("\ncollectives per step (payload bytes per call summed, comm/communicator.h) vs the closed form:\n");
    std::printf("%-10s %-5s %-15s %7s %7s %14s %14s %8s\n", "layout", "group", "kind", "calls", "formula", "bytes",
                "formula", "ratio");
    for (size_t k = 0; k < layouts.size(); ++k) {
      for (int g = 0; g < 2; ++g) {
        const Measured& m = g == 0 ? rows[k].tp : rows[k].dp;
        const GroupCounts& fc = g == 0 ? rows[k].tpf : rows[k].dpf;
        for (size_t i = 0; i < kinds().size(); ++i) {
          const KindCount fk = formula_of(fc, kinds()[i].first);
          if (m.calls[i] == 0 && fk.calls == 0) continue;
          std::printf("%-10s %-5s %-15s %7.1f %7lld %14.0f %14lld %8.4f%s\n", layouts[k].name.c_str(),
                      g == 0 ? "tp" : "dp", kinds()[i].second, m.calls[i], (long long)fk.calls, m.bytes[i],
                      (long long)fk.bytes, fk.bytes ? m.bytes[i] / static_cast<double>(fk.bytes) : 0.0,
                      m.same_on_all_ranks ? "" : "  (ranks differ)");
        }
      }
    }
    std::printf("\nother processes used %.2f cores on average during the timed steps (machine busy %.1f s - "
                "ranks %.1f s, over %.1f s); load average %.2f before, %.2f after\n", others,
                cpu1.busy - cpu0.busy, own, wall, load_before, load_after);
    std::fprintf(stderr, "[tp_bench] wrote %s\n", f.out.c_str());
  }
  world.barrier();
  fsdp::comm::destroy_process_group();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Flags flags;
  try {
    flags = parse_flags(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tp_bench: %s\n", e.what());
    return 2;
  }
  try {
    return run(flags);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tp_bench: error: %s\n", e.what());
    return 1;
  }
}
