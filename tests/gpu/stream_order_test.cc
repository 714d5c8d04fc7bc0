// [Note: streams] (fsdp/device_streams.h) checked without a GPU: UnshardOrder's decisions on
// scripted timelines, and the runtime's real call sequence (root pre-forward, all-gather issues,
// hand-offs to compute, reshards, end of backward) driving it through a recording DeviceStreams
// registered for the CPU. The recorder runs everything inline (so training stays exact, checked
// against an unsharded copy) but holds resharded memory as CudaStreams does
// and records, per all-gather issue, whether the unshard stream would wait for the compute stream
// and which held buffers it would free first.
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <vector>

#include <torch/torch.h>

#include "fsdp_cpp/fsdp/device_streams.h"
#include "fsdp_cpp/fsdp/flat_param_handle.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/tests/composable/test_models.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using fsdp::UnshardOrder;
using fsdp::testing::world;

bool contains(const std::vector<uint64_t>& ids, uint64_t id) {
  return std::find(ids.begin(), ids.end(), id) != ids.end();
}

class RecordingStreams final : public fsdp::DeviceStreams {
 public:
  struct Issue {
    bool wait_for_compute;
    bool input_written;
    // Frees a buffer resharded after the compute stream last received an all-gather's result: the
    // all-gather would then wait for the compute it is meant to overlap.
    bool frees_running;
    size_t held_after;
  };

  void begin_iteration() override {
    order.begin_iteration();
    ++begins;
  }
  void end_iteration() override {
    for (uint64_t id : order.end_iteration()) held.erase(id);
    ++ends;
  }
  void on_unshard_stream(const std::function<void()>& issue, bool input_written) override {
    const UnshardOrder::Issue r = order.issue(input_written);
    bool frees_running = false;
    for (uint64_t id : r.free) frees_running |= released_at.at(id) == handoffs;
    for (uint64_t id : r.free) held.erase(id);
    if (r.wait_for_compute) held.clear();
    issues.push_back({r.wait_for_compute, input_written, frees_running, held.size()});
    issue();
  }
  void hand_unshard_to_compute(const std::function<void()>& wait) override {
    wait();
    order.handed_to_compute();
    ++handoffs;
  }
  void release_after_compute(c10::DataPtr memory) override {
    if (!memory) return;
    const uint64_t id = ++next_id;
    ++releases;
    released_at[id] = handoffs;
    if (order.hold(id)) held.emplace(id, std::move(memory));
  }
  bool asynchronous() const override { return true; }

  void reset() {
    issues.clear();
    begins = ends = handoffs = releases = 0;
  }

  UnshardOrder order;
  std::map<uint64_t, c10::DataPtr> held;
  std::vector<Issue> issues;
  std::map<uint64_t, int> released_at;  // hand-offs counted when each buffer was released
  uint64_t next_id = 0;
  int begins = 0, ends = 0, handoffs = 0, releases = 0;
};

std::shared_ptr<RecordingStreams>& recorder() {
  static auto streams = std::make_shared<RecordingStreams>();
  return streams;
}

std::shared_ptr<fsdp::DeviceStreams> recording_factory(at::Device) { return recorder(); }

// Every handle made after this on the CPU uses the recorder.
RecordingStreams& use_recorder() {
  static const bool registered = fsdp::register_device_streams(c10::DeviceType::CPU, &recording_factory);
  (void)registered;
  recorder()->reset();
  return *recorder();
}

}  // namespace

FSDP_RANKS_TEST_CASE("UnshardOrder: without prefetch, unit k+1's all-gather waits neither for the compute stream nor for unit k", "[streams]") {
  UnshardOrder order;
  order.begin_iteration();
  for (uint64_t unit = 1; unit <= 5; ++unit) {
    const auto issue = order.issue(false);
    CHECK(issue.wait_for_compute == (unit == 1));  // once per iteration: the optimizer's writes
    CHECK_FALSE(contains(issue.free, unit - 1));   // unit k's buffer is still held...
    if (unit >= 3) CHECK(issue.free == std::vector<uint64_t>{unit - 2});  // ...unit k-1's is freed
    CHECK(order.held() <= 1);
    order.handed_to_compute();  // unit's forward reads its buffer
    CHECK(order.hold(unit));    // resharded after forward
  }
  CHECK(order.end_iteration() == std::vector<uint64_t>{4, 5});  // the last two units' buffers
  CHECK(order.held() == 0);
}

FSDP_RANKS_TEST_CASE("UnshardOrder: with prefetch or in backward, buffers are freed before the next all-gather", "[streams]") {
  UnshardOrder order;
  order.begin_iteration();
  CHECK(order.issue(false).wait_for_compute);  // unit 1
  order.handed_to_compute();                   // unit 1 used
  CHECK(order.issue(false).free.empty());      // unit 2 prefetched
  CHECK(order.hold(1));                        // unit 1 resharded
  order.handed_to_compute();                   // unit 2 used
  const auto issue = order.issue(false);       // unit 3 prefetched while unit 2 runs
  CHECK_FALSE(issue.wait_for_compute);
  CHECK(issue.free == std::vector<uint64_t>{1});  // unit 1 ran before unit 2: nothing to overlap
  CHECK(order.held() == 0);
}

FSDP_RANKS_TEST_CASE("UnshardOrder: the unshard stream waits for compute outside an iteration, when the shard was written, and when serialized", "[streams]") {
  UnshardOrder order;
  CHECK(order.issue(false).wait_for_compute);  // e.g. summon_full_params after an optimizer step
  CHECK_FALSE(order.hold(7));                  // nothing to overlap: freed at once
  order.begin_iteration();
  CHECK(order.issue(false).wait_for_compute);
  CHECK_FALSE(order.issue(false).wait_for_compute);
  CHECK(order.issue(true).wait_for_compute);  // written since gathered
  order.set_serialized(true);
  CHECK(order.issue(false).wait_for_compute);
  CHECK(order.hold(8));
  order.set_serialized(false);
  order.end_iteration();
  CHECK(order.issue(false).wait_for_compute);
}

namespace {

// Trains a sharded MlpStack next to an unsharded copy (every rank on the same batches, so the
// averaged gradients are the local ones) with the recorder, checks the losses agree, then checks
// what the runtime's call sequence made the streams do.
void check_runtime_order(const fsdp::FullyShardOptions& shard_options, bool forward_prefetch) {
  RecordingStreams& rec = use_recorder();
  const int iterations = 3;
  auto comm = std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
  const auto options = fsdp::FullyShardOptions(shard_options).communicator(comm).forward_prefetch(forward_prefetch);
  auto make = [] {
    torch::manual_seed(0);
    return fsdp::testing::MlpStack(6, 8, 16, 3, 3);
  };
  fsdp::testing::MlpStack model = make(), reference = make();
  for (size_t i = 0; i < 3; ++i) fsdp::fully_shard(model->block(i), options);
  fsdp::fully_shard(model, options);
  torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD reference_optim(reference->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < iterations; ++step) {
    torch::manual_seed(100 + step);
    const at::Tensor x = torch::randn({4, 6});
    const at::Tensor loss = model(x).pow(2).mean();
    loss.backward();
    optim.step();
    optim.zero_grad();
    const at::Tensor reference_loss = reference(x).pow(2).mean();
    reference_loss.backward();
    reference_optim.step();
    reference_optim.zero_grad();
    CHECK(std::abs(loss.item<double>() - reference_loss.item<double>()) <= 1e-5 * (1 + std::abs(reference_loss.item<double>())));
  }
  if (world().size() == 1) {  // one rank: nothing is all-gathered
    CHECK(rec.issues.empty());
    return;
  }
  REQUIRE(!rec.issues.empty());
  CHECK(rec.begins >= iterations);  // at every root pre-forward
  CHECK(rec.ends >= iterations);    // at the end of every backward
  int waits = 0;
  for (const auto& issue : rec.issues) {
    waits += issue.wait_for_compute ? 1 : 0;
    CHECK_FALSE(issue.input_written);  // nothing writes a shard inside an iteration
    // A buffer resharded since the compute stream last received an all-gather is never freed for
    // the next one (it would wait for the compute it should overlap); memory stays bounded.
    if (!issue.wait_for_compute) CHECK_FALSE(issue.frees_running);
    CHECK(issue.held_after <= 2);
  }
  // Once per iteration (the first all-gather after the root's pre-forward), however many units.
  CHECK(waits <= rec.begins);
  CHECK(static_cast<int>(rec.issues.size()) > 2 * waits);
  CHECK(rec.releases > 0);
  CHECK(rec.held.empty());  // all freed by the end of the last iteration
}

}  // namespace

FSDP_RANKS_TEST_CASE("runtime order: one wait for compute per iteration, held buffers bounded and freed (FULL_SHARD)", "[streams]") {
  check_runtime_order(fsdp::FullyShardOptions(), /*forward_prefetch=*/false);
}

FSDP_RANKS_TEST_CASE("runtime order: the same with forward prefetch and with SHARD_GRAD_OP", "[streams]") {
  check_runtime_order(fsdp::FullyShardOptions(), /*forward_prefetch=*/true);
  check_runtime_order(fsdp::FullyShardOptions().strategy(fsdp::ShardingStrategy::kShardGradOp), false);
}

FSDP_RANKS_TEST_CASE("a shard written inside an iteration makes its next all-gather wait for compute", "[streams]") {
  RecordingStreams& rec = use_recorder();
  auto comm = std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
  torch::manual_seed(0);
  at::Tensor w = at::randn({5, 3}).requires_grad_(true);
  at::Tensor b = at::randn({5}).requires_grad_(true);
  const at::Tensor full_w = w.detach().clone();
  fsdp::FlatParamHandle handle({{"w", w}, {"b", b}}, comm, "unit");
  if (world().size() == 1) {  // runs as NO_SHARD: no all-gather
    handle.begin_iteration();
    handle.unshard();
    CHECK(rec.issues.empty());
    CHECK(at::equal(w.detach(), full_w));
    return;
  }
  handle.begin_iteration();
  handle.unshard();
  handle.reshard();
  handle.unshard();  // unchanged: no wait
  handle.reshard();
  {
    torch::NoGradGuard no_grad;
    w.mul_(2);  // as an optimizer writes through the sharded parameter
  }
  handle.unshard();
  REQUIRE(rec.issues.size() == 3);
  CHECK(rec.issues[0].wait_for_compute);  // first of the iteration
  CHECK_FALSE(rec.issues[1].wait_for_compute);
  CHECK_FALSE(rec.issues[1].input_written);
  CHECK(rec.issues[2].input_written);
  CHECK(rec.issues[2].wait_for_compute);
  CHECK(w.sizes() == at::IntArrayRef({5, 3}));
  CHECK(at::allclose(w.detach(), full_w * 2));  // gathered after the write, the memory was reused safely
  handle.reshard();
  handle.end_iteration();
  CHECK(rec.held.empty());
  CHECK(handle.unsharded_bytes() == 0);
}
