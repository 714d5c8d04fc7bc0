// How much of the all-gather time fully_shard hides under compute on one GPU ([Note: streams] in
// fsdp/device_streams.h), and the step time against plain LibTorch. tools/gpu_check.sh runs it.
//
// One GPU cannot run NCCL across ranks, so the collectives go through an emulated link: a
// c10d::Backend of `--world` identical ranks (this process is rank 0) that behaves towards streams
// as ProcessGroupNCCL does: each collective runs on the link's own stream after it waited for the
// issuing stream, and wait() makes the current stream wait for its end event. Its cost is a spin
// kernel as long as a ring collective takes at `--link-gbps` of bus bandwidth ((W-1)/W of the
// gathered bytes), plus the real copies. Every all-gather's time is taken with CUDA events on the
// link stream. The exposed all-gather time of a configuration is its step time with all-gathers
// charged minus its step time with a free link; hidden = 1 - exposed / all-gather time.
// Orderings compared: "serialized" (every all-gather waits for the compute stream: the order before
// FSDP2's, DeviceStreams::set_serialized), "FSDP2" (the default), and FSDP2 with forward prefetch.
// All orderings must give the same losses (a stream race would change them); the emulated values
// are not the model's real parameters (every rank holds rank 0's shard), so losses are compared
// between orderings, not with the unsharded model.
//
//   bazel build -c opt //tests/gpu:overlap_check && bazel-bin/tests/gpu/overlap_check --world 8
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/optim/adamw.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/comm/nccl_backend.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/examples/gpt_model.h"
#include "fsdp_cpp/fsdp/device_streams.h"

namespace {

using Clock = std::chrono::steady_clock;
using Event = c10::cuda::CUDAEvent;

struct Flags {
  int world = 8;
  double link_gbps = 50;
  int64_t d_model = 1024, layers = 8, heads = 16, seq = 512, batch = 8;
  int warmup = 3, steps = 8;
};

// What the emulated link charges and the times it measured.
struct Link {
  int world = 8;
  double bytes_per_ms = 50e6;
  double cycles_per_ms = 1e6;
  bool charge_all_gather = true;
  bool charge_reduce = true;
  c10::DeviceIndex device = 0;
  c10::cuda::CUDAStream stream = c10::cuda::getStreamFromPool(false, 0);
  std::mutex mutex;
  std::vector<std::pair<std::unique_ptr<Event>, std::unique_ptr<Event>>> all_gathers;

  // Sum of the measured all-gather durations (synchronizes), and forget them.
  double take_all_gather_ms() {
    std::lock_guard<std::mutex> lock(mutex);
    double ms = 0;
    for (auto& [start, end] : all_gathers) {
      end->synchronize();
      ms += start->elapsed_time(*end);
    }
    all_gathers.clear();
    return ms;
  }
};

class LinkWork final : public c10d::Work {
 public:
  LinkWork(std::shared_ptr<Event> end, c10::DeviceIndex device) : end_(std::move(end)), device_(device) {}
  bool isCompleted() override { return end_->query(); }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds) override {
    end_->block(c10::cuda::getCurrentCUDAStream(device_));  // as ProcessGroupNCCL: no host wait
    return true;
  }
  void synchronize() override { end_->block(c10::cuda::getCurrentCUDAStream(device_)); }

 private:
  std::shared_ptr<Event> end_;
  c10::DeviceIndex device_;
};

// `world` identical ranks, of which this process is rank 0 (see the top of the file).
class EmulatedLinkBackend final : public c10d::Backend {
 public:
  explicit EmulatedLinkBackend(std::shared_ptr<Link> link) : Backend(0, link->world), link_(std::move(link)) {}
  const std::string getBackendName() const override { return "emulated-link"; }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& = {}) override {
    const double bytes = output.nbytes() * (link_->world - 1.0) / link_->world;
    return run({output, input}, link_->charge_all_gather ? bytes : 0, /*timed=*/true, [&] {
      output.view({link_->world, -1}).copy_(input.reshape({1, -1}).expand({link_->world, input.numel()}));
    });
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& = {}) override {
    const double bytes = input.nbytes() * (link_->world - 1.0) / link_->world;
    return run({output, input}, link_->charge_reduce ? bytes : 0, false, [&] {
      output.copy_(input.view({link_->world, -1}).select(0, 0)).mul_(link_->world);  // SUM of equals
    });
  }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts = {}) override {
    double bytes = 0;
    for (const auto& t : tensors) bytes += 2.0 * t.nbytes() * (link_->world - 1.0) / link_->world;
    return run(tensors, link_->charge_reduce ? bytes : 0, false, [&] {
      if (opts.reduceOp == c10d::ReduceOp::SUM) {
        for (auto& t : tensors) t.mul_(link_->world);
      }
    });
  }
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& = {}) override {
    return run(tensors, 0, false, [] {});
  }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& = {}) override {
    std::vector<at::Tensor> used = inputs;
    for (auto& list : outputs) used.insert(used.end(), list.begin(), list.end());
    return run(used, 0, false, [&] {
      for (size_t i = 0; i < outputs.size(); ++i) {
        for (auto& out : outputs[i]) out.copy_(inputs[i]);
      }
    });
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& = {}) override { return run({}, 0, false, [] {}); }

 private:
  template <typename Body>
  c10::intrusive_ptr<c10d::Work> run(const std::vector<at::Tensor>& tensors, double bytes, bool timed, Body body) {
    c10::cuda::CUDAGuard device_guard(link_->device);
    const c10::cuda::CUDAStream issuing = c10::cuda::getCurrentCUDAStream(link_->device);
    Event ready;
    ready.record(issuing);
    ready.block(link_->stream);  // as NCCL's stream waits for the current one at issue
    std::unique_ptr<Event> start, end;
    {
      c10::cuda::CUDAStreamGuard guard(link_->stream);
      if (timed) {
        start = std::make_unique<Event>(cudaEventDefault);
        start->record(link_->stream);
      }
      if (bytes > 0) at::cuda::sleep(static_cast<int64_t>(bytes / link_->bytes_per_ms * link_->cycles_per_ms));
      body();
      if (timed) {
        end = std::make_unique<Event>(cudaEventDefault);
        end->record(link_->stream);
      }
    }
    for (const auto& t : tensors) {  // allocator safety as ProcessGroupNCCL's record_stream
      if (t.defined() && t.is_cuda() && t.storage().data_ptr()) {
        c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), link_->stream);
      }
    }
    auto done = std::make_shared<Event>();
    done->record(link_->stream);
    if (timed) {
      std::lock_guard<std::mutex> lock(link_->mutex);
      link_->all_gathers.emplace_back(std::move(start), std::move(end));
    }
    return c10::make_intrusive<LinkWork>(std::move(done), link_->device);
  }

  std::shared_ptr<Link> link_;
};

struct Run {
  double step_ms = 0;        // median over the measured steps
  double all_gather_ms = 0;  // per step, on the link stream
  int64_t peak_bytes = 0;
  std::vector<double> losses;
};

at::Tensor tokens(int64_t step, int salt, const Flags& f, at::Device device) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(1000 * salt + step));
  return at::randint(65, {f.batch, f.seq}, gen).to(device);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Trains the GPT; sharded over the emulated link with `options` unless `options` is null.
Run train(const Flags& f, const fsdp::FullyShardOptions* options, Link* link, at::Device device) {
  const auto config = fsdp::examples::GPTConfig(65).context_length(f.seq).d_model(f.d_model)
                          .n_heads(f.heads).n_layers(f.layers);
  torch::manual_seed(0);
  fsdp::examples::GPT model(config);
  if (options != nullptr) {
    for (auto& block : model->block_list()) fsdp::fully_shard(block, *options);
    fsdp::fully_shard(model, *options);
  } else {
    model->to(device);
  }
  torch::optim::AdamW optim(model->parameters(), torch::optim::AdamWOptions(1e-4));
  c10::cuda::device_synchronize();
  c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
  Run r;
  std::vector<double> times;
  double all_gather_ms = 0;
  for (int step = 0; step < f.warmup + f.steps; ++step) {
    const at::Tensor input = tokens(step, 1, f, device), target = tokens(step, 2, f, device);
    c10::cuda::device_synchronize();
    if (link != nullptr) link->take_all_gather_ms();
    const auto t0 = Clock::now();
    at::Tensor loss = fsdp::examples::next_token_loss(model(input), target);
    loss.backward();
    optim.step();
    optim.zero_grad();
    c10::cuda::device_synchronize();
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    r.losses.push_back(loss.item<double>());
    if (step < f.warmup) continue;
    times.push_back(ms);
    if (link != nullptr) all_gather_ms += link->take_all_gather_ms();
  }
  r.step_ms = median(times);
  r.all_gather_ms = all_gather_ms / f.steps;
  r.peak_bytes = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index())
                     .allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)]
                     .peak;
  return r;
}

// GPU cycles per millisecond of the spin kernel (at::cuda::sleep), measured.
double calibrate_cycles_per_ms(c10::DeviceIndex device) {
  const int64_t cycles = 20'000'000;
  at::cuda::sleep(cycles);  // warm up
  Event start(cudaEventDefault), end(cudaEventDefault);
  const auto stream = c10::cuda::getCurrentCUDAStream(device);
  start.record(stream);
  at::cuda::sleep(cycles);
  end.record(stream);
  end.synchronize();
  return cycles / static_cast<double>(start.elapsed_time(end));
}

Flags parse(int argc, char** argv) {
  Flags f;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string name = argv[i];
    const char* v = argv[i + 1];
    if (name == "--world") f.world = std::atoi(v);
    else if (name == "--link-gbps") f.link_gbps = std::atof(v);
    else if (name == "--d-model") f.d_model = std::atoll(v);
    else if (name == "--layers") f.layers = std::atoll(v);
    else if (name == "--heads") f.heads = std::atoll(v);
    else if (name == "--seq") f.seq = std::atoll(v);
    else if (name == "--batch") f.batch = std::atoll(v);
    else if (name == "--warmup") f.warmup = std::atoi(v);
    else if (name == "--steps") f.steps = std::atoi(v);
    else {
      std::fprintf(stderr, "overlap_check: unknown flag %s (--world --link-gbps --d-model --layers "
                   "--heads --seq --batch --warmup --steps)\n", name.c_str());
      std::exit(2);
    }
  }
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  const Flags f = parse(argc, argv);
  if (!fsdp::comm::cuda_device_available()) {
    std::printf("overlap_check: no CUDA device visible: the overlap was not measured\n");
    return 0;
  }
  const at::Device device(at::kCUDA, 0);
  c10::cuda::set_device(0);
  auto link = std::make_shared<Link>();
  link->world = f.world;
  link->bytes_per_ms = f.link_gbps * 1e6;
  link->cycles_per_ms = calibrate_cycles_per_ms(0);
  auto comm = std::make_shared<fsdp::comm::Communicator>(c10::make_intrusive<EmulatedLinkBackend>(link), device);
  auto streams = fsdp::device_streams_for(device);
  std::printf("overlap_check: %s, GPT d_model %lld, %lld layers, seq %lld, batch %lld; emulated link: "
              "%d ranks at %.0f GB/s bus bandwidth (spin kernel %.0f cycles/ms); %d warm-up + %d "
              "measured steps; CUDA streams %s\n",
              device.str().c_str(), static_cast<long long>(f.d_model), static_cast<long long>(f.layers),
              static_cast<long long>(f.seq), static_cast<long long>(f.batch), f.world, f.link_gbps,
              link->cycles_per_ms, f.warmup, f.steps, streams->asynchronous() ? "on" : "OFF");

  const Run plain = train(f, nullptr, nullptr, device);
  struct Ordering {
    std::string name;
    bool serialized;
    bool forward_prefetch;
  };
  const std::vector<Ordering> orderings = {
      {"serialized (before)", true, false}, {"FSDP2 order", false, false}, {"FSDP2 order + fwd prefetch", false, true}};
  std::printf("\n%-28s %9s %9s %9s %9s %9s %8s %8s %13s\n", "ordering", "step ms", "free ms", "AG-only",
              "AG ms", "exposed", "hidden", "vs plain", "peak CUDA B");
  std::printf("%-28s %9.2f %9s %9s %9s %9s %8s %8s %13lld\n", "plain LibTorch (unsharded)", plain.step_ms,
              "-", "-", "-", "-", "-", "1.00", static_cast<long long>(plain.peak_bytes));
  std::vector<double> reference_losses;
  double worst = 0;
  for (const auto& o : orderings) {
    streams->set_serialized(o.serialized);
    const auto options = fsdp::FullyShardOptions().device(device).communicator(comm).forward_prefetch(o.forward_prefetch);
    auto charge = [&](bool all_gather, bool reduce) {
      link->charge_all_gather = all_gather;
      link->charge_reduce = reduce;
      return train(f, &options, link.get(), device);
    };
    const Run free_link = charge(false, false);
    const Run all_gather_only = charge(true, false);
    const Run both = charge(true, true);
    const double exposed = std::max(0.0, all_gather_only.step_ms - free_link.step_ms);
    const double hidden = all_gather_only.all_gather_ms > 0
                              ? std::clamp(1.0 - exposed / all_gather_only.all_gather_ms, 0.0, 1.0) : 0.0;
    std::printf("%-28s %9.2f %9.2f %9.2f %9.2f %9.2f %7.1f%% %8.2f %13lld\n", o.name.c_str(), both.step_ms,
                free_link.step_ms, all_gather_only.step_ms, all_gather_only.all_gather_ms, exposed, 100 * hidden,
                both.step_ms / plain.step_ms, static_cast<long long>(both.peak_bytes));
    for (const Run* r : {&free_link, &all_gather_only, &both}) {
      if (reference_losses.empty()) reference_losses = r->losses;
      for (size_t i = 0; i < r->losses.size(); ++i) {
        worst = std::max(worst, std::abs(r->losses[i] - reference_losses[i]) / std::abs(reference_losses[i]));
      }
    }
  }
  streams->set_serialized(false);
  std::printf("\nstep ms: all-gathers and reduce-scatters charged; free ms: free link; AG-only: only "
              "all-gathers charged; AG ms: all-gather time per step on the link stream; exposed = "
              "AG-only - free; hidden = 1 - exposed / AG ms.\n");
  const bool same = worst <= 1e-4;
  std::printf("losses across orderings and link costs: max relative difference %.2e (%s)\n", worst,
              same ? "same: no stream race seen" : "DIFFERENT: a stream race?");
  std::printf("\n%d passed, %d failed\n", same ? 1 : 0, same ? 0 : 1);
  return same ? 0 : 1;
}
