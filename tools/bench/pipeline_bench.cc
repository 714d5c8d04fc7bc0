// pipeline_bench: pipeline parallelism on the example GPT (untied) on the CPU
// (tools/pipeline_benchmark.sh runs it under mpirun next to tools/bench/pipeline_bench_torch.py).
//
//   mpirun -np P pipeline_bench --mode pipeline --out JSON [--schedules gpipe,1f1b,interleaved_1f1b]
//          [--microbatches 1,2,4,8] [--memory-m 8] [--warmup N] [--steps N] [model flags]
//   mpirun -np 4 pipeline_bench --mode compare --out JSON [--layouts pp2xdp2:1f1b:4,pp2xdp2:gpipe:4,dp4]
//   pipeline_bench --mode compare --layouts local --out JSON      (one process)
//   model flags: --vocab N --context N --d-model N --heads N --layers N --global-batch N --seed N
//
// --mode pipeline: every rank of the world is one pipeline rank (pp = world size). For each
// schedule and microbatch count m (interleaved 1F1B: 2 stages per rank, m a multiple of pp; other
// counts are skipped) the GPT is split into pp (x 2) stages of consecutive blocks
// (pipeline::split_blocks_evenly, GPT::keep_stage; every stage built from the same seed), a
// PipelineSchedule runs `--warmup` + `--steps` steps of the same global batch (--global-batch
// sequences split into m microbatches; no optimizer, gradients set to none between steps, a world
// barrier before each step), and every rank records per measured step its
// PipelineSchedule::last_step_stats() (compute_seconds: wall time inside forwards and backwards;
// wait_seconds: blocked on receives; step_seconds), its process CPU time over the step, and the
// pipeline group's kSend counters. Then (memory) a counting CPU allocator
// (tools/bench/counting_allocator.h) is installed and, for each schedule at m = --memory-m, each
// rank measures the bytes one microbatch's forward leaves held on each of its stages (received
// input + what autograd saves + the output; the last stage: + the loss), and the allocator's peak
// of bytes allocated during a step (allocations made before the step not counted) on a fresh copy.
//
// --mode compare: training steps (zero_grad + forward/backward + AdamW step) of the same model on
// the same global batch in several layouts, stepped in turn (rotating order, a world barrier
// before each step): "ppPxdpD:SCHEDULE:M" (a (pp, dp) DeviceMesh; fully_shard on every block and
// on each stage's root over the dp group, the stages' units handed to the PipelineStage; dp group q
// takes sequences [q B, (q + 1) B), B = global batch / dp), "dpN" (fully_shard on every block and
// the root over the world), "local" (the whole model, plain LibTorch, one process).
//
// Rank 0 writes the JSON (every rank's figures); tools/bench/pipeline_bench_torch.py report prints
// the tables. Machine load: /proc/stat busy seconds minus the ranks' own CPU seconds over each
// measured phase's wall time: the cores other processes used meanwhile.

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
#include <ATen/ops/randn.h>
#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>
#include <torch/optim/adamw.h>
#include <torch/utils.h>

#include "fsdp_cpp/comm/device_mesh.h"
#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/examples/gpt_model.h"
#include "fsdp_cpp/pipeline/schedule.h"
#include "fsdp_cpp/pipeline/schedule_order.h"
#include "fsdp_cpp/pipeline/stage.h"
#include "fsdp_cpp/pipeline/stage_split.h"
#include "fsdp_cpp/tools/bench/counting_allocator.h"
#include "fsdp_cpp/tools/bench/json_writer.h"

namespace {

using Clock = std::chrono::steady_clock;
using fsdp::bench::JsonWriter;
using fsdp::comm::CollectiveKind;
using fsdp::comm::Communicator;
using fsdp::examples::GPT;
using fsdp::pipeline::ScheduleKind;

constexpr const char* kUsage = R"(usage:
  mpirun -np P pipeline_bench --mode pipeline --out JSON [--schedules gpipe,1f1b,interleaved_1f1b]
         [--microbatches 1,2,4,8] [--memory-m 8] [--warmup N] [--steps N] [model flags]
  mpirun -np 4 pipeline_bench --mode compare --out JSON [--layouts pp2xdp2:1f1b:4,pp2xdp2:gpipe:4,dp4]
  pipeline_bench --mode compare --layouts local --out JSON
  model flags: --vocab N --context N --d-model N --heads N --layers N --global-batch N --seed N
               --threads N --lr X
)";

struct Flags {
  std::string mode, out;
  std::string schedules = "gpipe,1f1b,interleaved_1f1b";
  std::string microbatches = "1,2,4,8";
  std::string layouts = "pp2xdp2:1f1b:4,pp2xdp2:gpipe:4,dp4";
  int64_t memory_m = 8, warmup = 2, steps = 10, threads = 1;
  int64_t vocab = 256, context = 64, d_model = 128, heads = 4, layers = 8, global_batch = 8, batches = 4;
  uint64_t seed = 0;
  double lr = 1e-3;
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
    } else if (a == "--mode") f.mode = need(i);
    else if (a == "--out") f.out = need(i);
    else if (a == "--schedules") f.schedules = need(i);
    else if (a == "--microbatches") f.microbatches = need(i);
    else if (a == "--layouts") f.layouts = need(i);
    else if (a == "--memory-m") f.memory_m = std::stoll(need(i));
    else if (a == "--warmup") f.warmup = std::stoll(need(i));
    else if (a == "--steps") f.steps = std::stoll(need(i));
    else if (a == "--threads") f.threads = std::stoll(need(i));
    else if (a == "--vocab") f.vocab = std::stoll(need(i));
    else if (a == "--context") f.context = std::stoll(need(i));
    else if (a == "--d-model") f.d_model = std::stoll(need(i));
    else if (a == "--heads") f.heads = std::stoll(need(i));
    else if (a == "--layers") f.layers = std::stoll(need(i));
    else if (a == "--global-batch") f.global_batch = std::stoll(need(i));
    else if (a == "--seed") f.seed = std::stoull(need(i));
    else if (a == "--lr") f.lr = std::stod(need(i));
    else throw std::invalid_argument("unknown flag '" + a + "'\n" + kUsage);
  }
  if (f.mode != "pipeline" && f.mode != "compare") throw std::invalid_argument(std::string("--mode pipeline|compare\n") + kUsage);
  if (f.out.empty()) throw std::invalid_argument("--out JSON is required");
  if (f.steps < 1) throw std::invalid_argument("--steps must be at least 1");
  return f;
}

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, sep);) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
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

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/// Every rank's `mine` (same length on every rank), concatenated in rank order.
std::vector<double> gather_world(const std::vector<double>& mine, Communicator& world) {
  const size_t n = mine.size();
  std::vector<double> all(n * static_cast<size_t>(world.size()), 0.0);
  std::copy(mine.begin(), mine.end(), all.begin() + static_cast<std::ptrdiff_t>(n * static_cast<size_t>(world.rank())));
  at::Tensor t = at::tensor(all, at::kDouble);
  world.all_reduce(t).wait();
  return std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
}

/// The load other processes put on the machine during a measured phase.
struct Phase {
  double busy0 = 0, own0 = 0, load_before = 0;
  Clock::time_point w0;
  void start() {
    busy0 = machine_busy_seconds();
    own0 = process_cpu_seconds();
    load_before = load1();
    w0 = Clock::now();
  }
  /// Collective: writes wall, own CPU (all ranks), machine busy, other processes' cores.
  void finish(Communicator& world, JsonWriter& w) {
    const double wall = seconds(w0, Clock::now());
    const double busy = machine_busy_seconds() - busy0;
    const auto own = gather_world({process_cpu_seconds() - own0}, world);
    double own_sum = 0;
    for (double x : own) own_sum += x;
    w.key("phase").begin_object();
    w.member("wall_s", wall).member("ranks_cpu_s", own_sum).member("machine_busy_cpu_s", busy);
    w.member("other_processes_cores", (busy - own_sum) / wall);
    w.member("load1_before", load_before).member("load1_after", load1());
    w.end_object();
  }
};

// ---------------------------------------------------------------------------------------------
// The model and its stages

fsdp::examples::GPTConfig gpt_config(const Flags& f) {
  return fsdp::examples::GPTConfig(f.vocab)
      .context_length(f.context)
      .d_model(f.d_model)
      .n_heads(f.heads)
      .n_layers(f.layers)
      .tie_embeddings(false);
}

/// The whole untied GPT built from --seed (every stage is built this way, then pruned).
GPT whole_model(const Flags& f) {
  torch::manual_seed(f.seed);
  return GPT(gpt_config(f));
}

/// Token windows [batches, global batch, context + 1], the same on every rank.
at::Tensor make_tokens(const Flags& f) {
  torch::manual_seed(f.seed + 1);
  return at::randint(0, f.vocab, {f.batches, f.global_batch, f.context + 1}, at::kLong);
}

int64_t bytes_of(const std::vector<at::Tensor>& tensors) {
  int64_t b = 0;
  for (const auto& t : tensors) b += t.numel() * static_cast<int64_t>(t.element_size());
  return b;
}

/// One pipeline: this rank's stages, their schedule, the parameters it updates.
struct Pipe {
  ScheduleKind kind = ScheduleKind::k1F1B;
  int pp = 1, dp = 1, chunks = 1, m = 1;
  std::shared_ptr<fsdp::comm::DeviceMesh> mesh;
  std::vector<GPT> parts;
  std::vector<std::unique_ptr<fsdp::pipeline::PipelineStage>> stages;
  std::unique_ptr<fsdp::pipeline::PipelineSchedule> schedule;
  std::vector<at::Tensor> params;
  std::unique_ptr<torch::optim::AdamW> optim;
  int64_t rows = 0;  // sequences per step of this pipeline (global batch / dp)

  std::string name() const {
    return fsdp::pipeline::schedule_name(kind) + " pp=" + std::to_string(pp) + (dp > 1 ? " dp=" + std::to_string(dp) : "") +
           " m=" + std::to_string(m);
  }
  void zero_grad() {
    for (auto& p : params) p.mutable_grad() = at::Tensor();
  }
  /// One step on window i (rows of this pipeline's dp coordinate).
  void step(const at::Tensor& tokens, int64_t i) {
    const int64_t T = tokens.size(2) - 1;
    const int64_t q = mesh->coordinate("dp");
    const at::Tensor window = tokens[i % tokens.size(0)].narrow(0, q * rows, rows);
    schedule->step(window.narrow(1, 0, T).contiguous(), window.narrow(1, 1, T).contiguous());
  }
};

std::unique_ptr<Pipe> make_pipe(const Flags& f, const Communicator& world, ScheduleKind kind, int pp, int dp, int m,
                                 bool shard, bool with_optimizer) {
  auto pipe = std::make_unique<Pipe>();
  pipe->kind = kind;
  pipe->pp = pp;
  pipe->dp = dp;
  pipe->m = m;
  pipe->chunks = kind == ScheduleKind::kInterleaved1F1B ? 2 : 1;
  pipe->mesh = fsdp::comm::DeviceMesh::create(world, {pp, dp}, {"pp", "dp"});
  TORCH_CHECK(f.global_batch % dp == 0, "pipeline_bench: global batch ", f.global_batch, " not a multiple of dp ", dp);
  pipe->rows = f.global_batch / dp;
  const auto pp_group = pipe->mesh->group("pp");
  const int n_stages = pp * pipe->chunks;
  const auto ranges = fsdp::pipeline::split_blocks_evenly(f.layers, n_stages);
  std::vector<fsdp::pipeline::PipelineStage*> ptrs;
  for (int s : fsdp::pipeline::stages_of_rank(pp_group->rank(), pp, n_stages)) {
    GPT part = whole_model(f);
    part->keep_stage(ranges[static_cast<size_t>(s)], s == 0, s == n_stages - 1);
    auto stage = std::make_unique<fsdp::pipeline::PipelineStage>(
        [part](const at::Tensor& x) mutable { return part(x); }, s, n_stages, pp_group);
    if (shard) {
      const auto opts = fsdp::FullyShardOptions().communicator(pipe->mesh->group("dp"));
      for (auto& block : part->block_list()) fsdp::fully_shard(block, opts);
      stage->set_fsdp_units({fsdp::fully_shard(part, opts)});
    }
    for (const auto& p : part->parameters()) pipe->params.push_back(p);
    pipe->parts.push_back(part);
    ptrs.push_back(stage.get());
    pipe->stages.push_back(std::move(stage));
  }
  pipe->schedule = std::make_unique<fsdp::pipeline::PipelineSchedule>(
      ptrs, fsdp::examples::next_token_loss, fsdp::pipeline::ScheduleOptions().kind(kind).n_microbatches(m));
  if (with_optimizer) {
    pipe->optim = std::make_unique<torch::optim::AdamW>(pipe->params, torch::optim::AdamWOptions(f.lr).weight_decay(0.01));
  }
  return pipe;
}

/// Closed-form bubble: (p - 1) / (m + p - 1), interleaved (p - 1) / (v m + p - 1).
double closed_form_bubble(ScheduleKind kind, int p, int m) {
  const int v = kind == ScheduleKind::kInterleaved1F1B ? 2 : 1;
  return static_cast<double>(p - 1) / static_cast<double>(v * m + p - 1);
}

/// Point-to-point bytes this rank sends per step: per stage it holds, one activation per
/// microbatch to the next stage and one gradient per microbatch to the previous one, where that
/// stage lives on another rank. `mb_bytes`: one microbatch's activation [rows / m, T, D] fp32.
int64_t formula_send_bytes(const Pipe& pipe, int64_t mb_bytes) {
  int64_t b = 0;
  const int me = pipe.mesh->group("pp")->rank();
  for (const auto& st : pipe.stages) {
    const int s = st->stage_index();
    if (!st->is_last() && st->rank_of(s + 1) != me) b += pipe.m * mb_bytes;
    if (!st->is_first() && st->rank_of(s - 1) != me) b += pipe.m * mb_bytes;
  }
  return b;
}

// ---------------------------------------------------------------------------------------------
// --mode pipeline

struct PipelineCase {
  ScheduleKind kind;
  int m;
};

void run_pipeline_mode(const Flags& f, Communicator& world, JsonWriter& w) {
  const int p = world.size();
  const bool root = world.rank() == 0;
  const at::Tensor tokens = make_tokens(f);
  std::vector<PipelineCase> cases;
  std::vector<std::string> skipped;
  for (const auto& s : split(f.schedules, ',')) {
    const ScheduleKind kind = fsdp::pipeline::parse_schedule(s);
    for (const auto& ms : split(f.microbatches, ',')) {
      const int m = std::stoi(ms);
      const int chunks = kind == ScheduleKind::kInterleaved1F1B ? 2 : 1;
      std::string why;
      try {
        fsdp::pipeline::check_schedule(kind, p, p * chunks, m);
        if (f.global_batch % m != 0) why = "the global batch is not a multiple of m";
        if (f.layers < p * chunks) why = "fewer blocks than stages";
      } catch (const c10::Error& e) {
        why = e.what_without_backtrace();
      }
      if (why.empty()) cases.push_back({kind, m});
      else skipped.push_back(s + " m=" + ms + ": " + why.substr(0, why.find('\n')));
    }
  }
  const int64_t mb_unit = f.context * f.d_model * 4;  // one sequence's activation bytes
  w.key("skipped").array(skipped);
  w.key("cases").begin_array();
  for (const auto& c : cases) {
    auto pipe = make_pipe(f, world, c.kind, p, 1, c.m, /*shard=*/false, /*with_optimizer=*/false);
    if (root) std::fprintf(stderr, "[pipeline_bench] timing %s\n", pipe->name().c_str());
    auto pp_group = pipe->mesh->group("pp");
    std::vector<double> compute, wait, step, cpu, own_step;
    int64_t send_bytes_stat = 0, recv_bytes_stat = 0, peak_live = 0, forwards = 0, backwards = 0;
    Phase phase;
    for (int64_t i = 0; i < f.warmup + f.steps; ++i) {
      pipe->zero_grad();
      if (i == f.warmup) {
        pp_group->reset_stats();
        world.barrier();
        phase.start();
      }
      world.barrier();
      const double c0 = process_cpu_seconds();
      const auto t0 = Clock::now();
      pipe->step(tokens, i);
      const auto t1 = Clock::now();
      const double c1 = process_cpu_seconds();
      if (i < f.warmup) continue;
      const auto& st = pipe->schedule->last_step_stats();
      compute.push_back(st.compute_seconds);
      wait.push_back(st.wait_seconds);
      step.push_back(st.step_seconds);
      own_step.push_back(seconds(t0, t1));
      cpu.push_back(c1 - c0);
      send_bytes_stat = st.send_bytes;
      recv_bytes_stat = st.recv_bytes;
      peak_live = st.peak_live_microbatches;
      forwards = st.forwards;
      backwards = st.backwards;
    }
    world.barrier();
    const auto sends = pp_group->stats(CollectiveKind::kSend);
    const auto recvs = pp_group->stats(CollectiveKind::kRecv);
    const int64_t mb_bytes = (f.global_batch / c.m) * mb_unit;
    const auto sim = fsdp::pipeline::simulate_schedule(c.kind, p, p * pipe->chunks, c.m, /*backward_cost=*/2);
    // Every rank's figures.
    const auto all_compute = gather_world(compute, world);
    const auto all_wait = gather_world(wait, world);
    const auto all_step = gather_world(step, world);
    const auto all_own = gather_world(own_step, world);
    const auto all_cpu = gather_world(cpu, world);
    const auto all_counts = gather_world(
        {static_cast<double>(send_bytes_stat), static_cast<double>(recv_bytes_stat),
         static_cast<double>(sends.calls) / static_cast<double>(f.steps), static_cast<double>(sends.bytes) / static_cast<double>(f.steps),
         static_cast<double>(recvs.bytes) / static_cast<double>(f.steps),
         static_cast<double>(formula_send_bytes(*pipe, mb_bytes)), static_cast<double>(peak_live),
         static_cast<double>(forwards), static_cast<double>(backwards)},
        world);
    w.begin_object();
    w.member("schedule", fsdp::pipeline::schedule_name(c.kind)).member("pp", static_cast<int64_t>(p));
    w.member("stages_per_rank", static_cast<int64_t>(pipe->chunks)).member("m", static_cast<int64_t>(c.m));
    w.member("microbatch_rows", f.global_batch / c.m).member("microbatch_activation_bytes", mb_bytes);
    w.member("closed_form_bubble", closed_form_bubble(c.kind, p, c.m));
    w.member("simulated_bubble_backward_cost_2", sim.bubble_fraction).member("simulated_slots", static_cast<int64_t>(sim.slots));
    phase.finish(world, w);
    // Per measured step: bubble = 1 - (sum over ranks of compute) / (p x slowest rank's step).
    std::vector<double> bubble, cpu_bubble;
    const size_t n = static_cast<size_t>(f.steps);
    for (size_t k = 0; k < n; ++k) {
      double busy = 0, cpu_sum = 0, slowest = 0;
      for (int r = 0; r < p; ++r) {
        busy += all_compute[static_cast<size_t>(r) * n + k];
        cpu_sum += all_cpu[static_cast<size_t>(r) * n + k];
        slowest = std::max(slowest, all_step[static_cast<size_t>(r) * n + k]);
      }
      bubble.push_back(1.0 - busy / (static_cast<double>(p) * slowest));
      // The cores' view: process CPU seconds of all ranks over what min(p, cores) cores offered.
      const double cores = std::min<double>(p, static_cast<double>(sysconf(_SC_NPROCESSORS_ONLN)));
      cpu_bubble.push_back(1.0 - cpu_sum / (cores * slowest));
    }
    w.member("measured_bubble", median(bubble)).key("measured_bubble_per_step").array(bubble);
    w.member("cores_idle_fraction", median(cpu_bubble));
    w.key("ranks").begin_array();
    for (int r = 0; r < p; ++r) {
      auto slice = [&](const std::vector<double>& v) {
        return std::vector<double>(v.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(r) * n),
                                   v.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(r + 1) * n));
      };
      const auto rc = slice(all_compute), rw = slice(all_wait), rs = slice(all_step), rcpu = slice(all_cpu);
      std::vector<double> rb;
      for (size_t k = 0; k < n; ++k) rb.push_back(1.0 - rc[k] / rs[k]);
      const double* cnt = &all_counts[static_cast<size_t>(r) * 9];
      w.begin_object();
      w.member("rank", static_cast<int64_t>(r));
      w.member("compute_s", median(rc)).member("wait_s", median(rw)).member("step_s", median(rs));
      w.member("own_step_s", median(slice(all_own))).member("cpu_s", median(rcpu));
      w.member("bubble", median(rb));
      w.member("send_bytes_stats", static_cast<int64_t>(cnt[0])).member("recv_bytes_stats", static_cast<int64_t>(cnt[1]));
      w.member("send_calls_per_step", cnt[2]).member("send_bytes_per_step", cnt[3]).member("recv_bytes_per_step", cnt[4]);
      w.member("formula_send_bytes", static_cast<int64_t>(cnt[5]));
      w.member("peak_live_microbatches", static_cast<int64_t>(cnt[6]));
      w.member("forwards", static_cast<int64_t>(cnt[7])).member("backwards", static_cast<int64_t>(cnt[8]));
      w.end_object();
    }
    w.end_array();
    w.end_object();
  }
  w.end_array();

  // Memory, after the timings (the counting allocator takes a lock per allocation).
  w.key("memory").begin_array();
  if (f.memory_m > 0) {
    auto& alloc = fsdp::bench::CountingAllocator::install();
    for (const auto& s : split(f.schedules, ',')) {
      const ScheduleKind kind = fsdp::pipeline::parse_schedule(s);
      const int m = static_cast<int>(f.memory_m);
      bool listed = false;
      for (const auto& c : cases) listed = listed || (c.kind == kind && c.m == m);
      if (!listed) continue;
      auto pipe = make_pipe(f, world, kind, p, 1, m, false, false);
      if (root) std::fprintf(stderr, "[pipeline_bench] memory %s\n", pipe->name().c_str());
      // Bytes one microbatch's forward leaves held per stage of this rank.
      std::vector<double> held_per_mb, grad_bytes, stage_index;
      const int64_t mb_rows = f.global_batch / m;
      for (size_t k = 0; k < pipe->parts.size(); ++k) {
        auto& part = pipe->parts[k];
        const auto& st = *pipe->stages[k];
        const at::Tensor window = tokens[0].narrow(0, 0, mb_rows);
        alloc.mark();
        {
          at::Tensor input = st.is_first() ? window.narrow(1, 0, f.context).contiguous()
                                           : at::randn({mb_rows, f.context, f.d_model}).requires_grad_(true);
          at::Tensor out = part(input);
          at::Tensor loss;
          if (st.is_last()) loss = fsdp::examples::next_token_loss(out, window.narrow(1, 1, f.context).contiguous());
          held_per_mb.push_back(static_cast<double>(alloc.current_since_mark()));
        }
        std::vector<at::Tensor> ps;
        for (const auto& prm : part->parameters()) ps.push_back(prm);
        grad_bytes.push_back(static_cast<double>(bytes_of(ps)));
        stage_index.push_back(st.stage_index());
      }
      double step_peak = 0, peak_live = 0;
      for (int64_t i = 0; i < 4; ++i) {
        pipe->zero_grad();
        world.barrier();
        alloc.mark();
        pipe->step(tokens, i);
        if (i >= 2) {
          step_peak = std::max(step_peak, static_cast<double>(alloc.peak_since_mark()));
          peak_live = static_cast<double>(pipe->schedule->last_step_stats().peak_live_microbatches);
        }
      }
      double held_sum = 0, grads = 0;
      for (double x : held_per_mb) held_sum += x;
      for (double x : grad_bytes) grads += x;
      const auto all = gather_world({step_peak, grads, peak_live, held_sum}, world);
      // Per stage (for interleaved: the rank's stages in order).
      const size_t chunks = pipe->parts.size();
      std::vector<double> per_stage(3 * chunks);
      for (size_t k = 0; k < chunks; ++k) {
        per_stage[3 * k] = stage_index[k];
        per_stage[3 * k + 1] = held_per_mb[k];
        per_stage[3 * k + 2] = grad_bytes[k];
      }
      const auto all_stages = gather_world(per_stage, world);
      w.begin_object();
      w.member("schedule", s).member("pp", static_cast<int64_t>(p)).member("m", static_cast<int64_t>(m));
      w.member("stages_per_rank", static_cast<int64_t>(chunks));
      w.key("ranks").begin_array();
      for (int r = 0; r < p; ++r) {
        const double* a = &all[static_cast<size_t>(r) * 4];
        w.begin_object();
        w.member("rank", static_cast<int64_t>(r));
        w.member("step_peak_bytes", static_cast<int64_t>(a[0])).member("gradient_bytes", static_cast<int64_t>(a[1]));
        w.member("peak_minus_gradients_bytes", static_cast<int64_t>(a[0] - a[1]));
        w.member("peak_live_microbatches", static_cast<int64_t>(a[2]));
        w.member("held_per_microbatch_bytes", static_cast<int64_t>(a[3]));
        w.key("stages").begin_array();
        for (size_t k = 0; k < chunks; ++k) {
          const double* b = &all_stages[(static_cast<size_t>(r) * chunks + k) * 3];
          w.begin_object();
          w.member("stage", static_cast<int64_t>(b[0])).member("held_per_microbatch_bytes", static_cast<int64_t>(b[1]));
          w.member("gradient_bytes", static_cast<int64_t>(b[2]));
          w.end_object();
        }
        w.end_array();
        w.end_object();
      }
      w.end_array();
      w.end_object();
    }
  }
  w.end_array();
}

// ---------------------------------------------------------------------------------------------
// --mode compare

struct Layout {
  std::string name;
  enum class Kind { kPipe, kDp, kLocal } kind = Kind::kLocal;
  int pp = 1, dp = 1, m = 1;
  ScheduleKind schedule = ScheduleKind::k1F1B;
};

Layout parse_layout(const std::string& text, int world) {
  Layout l;
  l.name = text;
  if (text == "local") {
    TORCH_CHECK(world == 1, "pipeline_bench: layout 'local' runs in one process (the world has ", world, ")");
    return l;
  }
  if (text.rfind("dp", 0) == 0) {
    l.kind = Layout::Kind::kDp;
    l.dp = std::stoi(text.substr(2));
  } else {
    // ppPxdpD:SCHEDULE:M
    const auto parts = split(text, ':');
    TORCH_CHECK(parts.size() == 3 && parts[0].rfind("pp", 0) == 0, "pipeline_bench: layout '", text,
                "': expected ppPxdpD:SCHEDULE:M, dpN or local");
    const auto x = parts[0].find("xdp");
    TORCH_CHECK(x != std::string::npos, "pipeline_bench: layout '", text, "': expected ppPxdpD");
    l.kind = Layout::Kind::kPipe;
    l.pp = std::stoi(parts[0].substr(2, x - 2));
    l.dp = std::stoi(parts[0].substr(x + 3));
    l.schedule = fsdp::pipeline::parse_schedule(parts[1]);
    l.m = std::stoi(parts[2]);
  }
  TORCH_CHECK(l.pp * l.dp == world, "pipeline_bench: layout '", text, "' needs ", l.pp * l.dp, " ranks; the world has ", world);
  return l;
}

struct Trainer {
  Layout layout;
  std::unique_ptr<Pipe> pipe;                  // kPipe
  GPT model{nullptr};                          // kDp, kLocal
  std::unique_ptr<torch::optim::AdamW> optim;  // kDp, kLocal
  int64_t rows = 0, offset = 0;
  std::vector<double> step_s, cpu_s;

  void train_step(const at::Tensor& tokens, int64_t i) {
    if (pipe) {
      pipe->optim->zero_grad();
      pipe->step(tokens, i);
      pipe->optim->step();
      return;
    }
    const int64_t T = tokens.size(2) - 1;
    const at::Tensor window = tokens[i % tokens.size(0)].narrow(0, offset, rows);
    optim->zero_grad();
    at::Tensor loss = fsdp::examples::next_token_loss(model(window.narrow(1, 0, T).contiguous()),
                                                      window.narrow(1, 1, T).contiguous());
    loss.backward();
    optim->step();
  }
};

void run_compare_mode(const Flags& f, Communicator& world, const std::shared_ptr<Communicator>& world_ptr, JsonWriter& w) {
  const bool root = world.rank() == 0;
  const at::Tensor tokens = make_tokens(f);
  std::vector<std::unique_ptr<Trainer>> trainers;
  for (const auto& name : split(f.layouts, ',')) {
    auto t = std::make_unique<Trainer>();
    t->layout = parse_layout(name, world.size());
    if (t->layout.kind == Layout::Kind::kPipe) {
      t->pipe = make_pipe(f, world, t->layout.schedule, t->layout.pp, t->layout.dp, t->layout.m, /*shard=*/t->layout.dp > 1,
                          /*with_optimizer=*/true);
    } else {
      t->model = whole_model(f);
      if (t->layout.kind == Layout::Kind::kDp) {
        const auto opts = fsdp::FullyShardOptions().communicator(world_ptr);
        for (auto& block : t->model->block_list()) fsdp::fully_shard(block, opts);
        fsdp::fully_shard(t->model, opts);
      }
      t->optim = std::make_unique<torch::optim::AdamW>(t->model->parameters(), torch::optim::AdamWOptions(f.lr).weight_decay(0.01));
      TORCH_CHECK(f.global_batch % t->layout.dp == 0, "pipeline_bench: global batch not a multiple of dp");
      t->rows = f.global_batch / t->layout.dp;
      t->offset = world.rank() * t->rows;
      if (t->layout.kind == Layout::Kind::kLocal) t->offset = 0;
    }
    trainers.push_back(std::move(t));
  }
  if (root) std::fprintf(stderr, "[pipeline_bench] compare (%d ranks): %s\n", world.size(), f.layouts.c_str());
  Phase phase;
  for (int64_t i = 0; i < f.warmup + f.steps; ++i) {
    if (i == f.warmup) {
      world.barrier();
      phase.start();
    }
    for (size_t k = 0; k < trainers.size(); ++k) {
      Trainer& t = *trainers[(k + static_cast<size_t>(i)) % trainers.size()];
      world.barrier();
      const double c0 = process_cpu_seconds();
      const auto t0 = Clock::now();
      t.train_step(tokens, i);
      const auto t1 = Clock::now();
      if (i >= f.warmup) {
        t.step_s.push_back(seconds(t0, t1));
        t.cpu_s.push_back(process_cpu_seconds() - c0);
      }
    }
  }
  world.barrier();
  phase.finish(world, w);
  w.key("layouts").begin_array();
  for (auto& t : trainers) {
    const auto all_step = gather_world(t->step_s, world);
    const auto all_cpu = gather_world(t->cpu_s, world);
    const size_t n = t->step_s.size();
    std::vector<double> slowest(n, 0.0), cpu_max(n, 0.0);
    for (int r = 0; r < world.size(); ++r) {
      for (size_t k = 0; k < n; ++k) {
        slowest[k] = std::max(slowest[k], all_step[static_cast<size_t>(r) * n + k]);
        cpu_max[k] = std::max(cpu_max[k], all_cpu[static_cast<size_t>(r) * n + k]);
      }
    }
    w.begin_object();
    w.member("name", t->layout.name).member("world", static_cast<int64_t>(world.size()));
    w.member("pp", static_cast<int64_t>(t->layout.pp)).member("dp", static_cast<int64_t>(t->layout.dp));
    if (t->pipe) {
      w.member("schedule", fsdp::pipeline::schedule_name(t->layout.schedule)).member("m", static_cast<int64_t>(t->layout.m));
    }
    w.member("step_ms", 1e3 * median(slowest)).member("cpu_ms", 1e3 * median(cpu_max));
    std::vector<double> ms;
    for (double s : slowest) ms.push_back(1e3 * s);
    w.key("steps_ms").array(ms);
    w.end_object();
  }
  w.end_array();
}

int run(const Flags& f) {
  at::set_num_threads(static_cast<int>(f.threads));
  auto pg = fsdp::comm::init_process_group();
  Communicator& world = *pg.comm;
  JsonWriter w;
  w.begin_object();
  w.member("program", "pipeline_bench").member("mode", f.mode).member("world_size", static_cast<int64_t>(world.size()));
  w.member("threads", static_cast<int64_t>(at::get_num_threads()));
  w.member("cores", static_cast<int64_t>(sysconf(_SC_NPROCESSORS_ONLN)));
  w.key("config").begin_object();
  w.member("vocab", f.vocab).member("context", f.context).member("d_model", f.d_model).member("heads", f.heads);
  w.member("layers", f.layers).member("global_batch", f.global_batch).member("tie_embeddings", false);
  w.member("warmup", f.warmup).member("steps", f.steps).member("seed", static_cast<int64_t>(f.seed));
  w.end_object();
  if (f.mode == "pipeline") run_pipeline_mode(f, world, w);
  else run_compare_mode(f, world, pg.comm, w);
  w.end_object();
  if (world.rank() == 0) {
    std::ofstream out(f.out);
    TORCH_CHECK(out, "pipeline_bench: cannot write ", f.out);
    out << w.str() << "\n";
    std::fprintf(stderr, "[pipeline_bench] wrote %s\n", f.out.c_str());
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
    std::fprintf(stderr, "pipeline_bench: %s\n", e.what());
    return 2;
  }
  try {
    return run(flags);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pipeline_bench: error: %s\n", e.what());
    return 1;
  }
}
