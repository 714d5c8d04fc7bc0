#include "fsdp_cpp/composable/replicate.h"

#include <algorithm>
#include <unordered_set>
#include <utility>

#include <ATen/record_function.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/contract/contract.h"
#include "fsdp_cpp/contract/module_fqn.h"
#include "fsdp_cpp/contract/module_state.h"
#include "fsdp_cpp/fsdp/fsdp_state.h"  // kFullyShardApi

namespace fsdp {

// [Note: replicate buckets]
// replicate follows DDP's Reducer. At the module's first forward the replicated parameters (the
// trainable ones no fully_shard unit inside manages) are assigned to buckets: in reverse
// registration order (backward produces the last parameters' gradients first), one open bucket
// per (dtype, device), closed once it holds bucket_cap_mb; buckets are then ordered by their first
// parameter. Each bucket owns one flat buffer: its gradients, then one "has a gradient" flag per
// parameter (so that one all-reduce also tells every rank which parameters got no gradient on any
// rank: their `.grad` stays undefined, as in local training, instead of becoming zeros that an
// optimizer would step on).
//
// A backward pass with sync starts at the first gradient reaching the module's outputs (or the
// first parameter gradient, whichever comes first), which queues the end-of-backward callback.
// Each parameter's AccumulateGrad post-hook copies its accumulated `.grad` into its bucket slot;
// the bucket whose last gradient arrived is all-reduced at once, provided every bucket before it
// was issued (collectives pair up by order, so every rank issues the buckets in the same order);
// otherwise it waits for them. The callback issues the buckets not issued yet (a parameter without
// gradient on this rank contributes zeros, or its accumulated `.grad` if it has one), waits for all
// of them, divides by the world size and writes the averages into `.grad` (in place when defined).
// Averaging the accumulated `.grad` is DDP's semantics: local accumulation without sync gives the
// gradient of the whole accumulated batch, and a `.grad` kept from an earlier synced step (equal on
// every rank) stays what it was plus the new average.

namespace {

// The parameters a gradient-ready hook reports to; one per replicated parameter.
class GradientReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  GradientReadyHook(ReplicateState* state, size_t index) : state_(state), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& inputs) override;

 private:
  ReplicateState* state_;  // the state removes this hook before it is destroyed
  size_t index_;
};

}  // namespace

class ReplicateState final : public contract::ApiState,
                             public std::enable_shared_from_this<ReplicateState> {
 public:
  ReplicateState(torch::nn::Module& module, std::shared_ptr<comm::Communicator> comm,
                 int64_t bucket_cap_bytes)
      : module_(&module), comm_(std::move(comm)), bucket_cap_bytes_(bucket_cap_bytes) {}

  ~ReplicateState() override {
    for (auto& p : params_) {
      if (p.accumulator) p.accumulator->del_post_hook(p.hook_key);
    }
  }

  torch::nn::Module& module() const { return *module_; }
  const std::vector<ReplicateBucket>& bucket_layout() const { return layout_; }
  std::vector<std::string> replicated_fqns() const {
    std::vector<std::string> fqns;
    for (const auto& p : params_) fqns.push_back(p.fqn);
    return fqns;
  }
  const ReplicateStats& stats() const { return stats_; }
  bool requires_gradient_sync = true;

  /// [Note: managed parameters]: the replicated parameters, decided at the module's first forward
  /// (none before it).
  bool manages(const at::Tensor& param) const override {
    return managed_.count(param.unsafeGetTensorImpl()) > 0;
  }

  void pre_forward() {
    auto& registry = contract::ModuleStateRegistry::global();
    if (!initialized_) {
      lazy_init();
    } else if (registry.checkpoint() != registry_checkpoint_) {
      check_still_replicated();
    }
    // A backward pass that threw never ran its end: start clean (every rank threw at the same
    // point, so the collectives issued match).
    if (pass_active_ && torch::autograd::get_current_graph_task_id() == -1) discard_pass();
  }

  void post_forward(const c10::IValue& output) {
    if (!c10::GradMode::is_enabled()) return;
    std::weak_ptr<ReplicateState> weak = weak_from_this();
    contract::for_each_tensor(output, [&](const at::Tensor& t) {
      if (!t.requires_grad()) return;
      t.register_hook([weak](const at::TensorBase&) {
        if (auto state = weak.lock()) state->begin_pass();
      });
    });
  }

  void on_gradient_ready(size_t index);

 private:
  struct Param {
    std::string fqn;
    at::Tensor param;
    size_t bucket = 0;
    size_t index_in_bucket = 0;
    int64_t offset = 0;  // of its gradient in the bucket's buffer
    c10::intrusive_ptr<torch::autograd::Node> accumulator;  // held: autograd caches it weakly
    uintptr_t hook_key = 0;
    bool ready = false;  // this pass: its gradient is in the bucket
  };
  struct Bucket {
    std::vector<size_t> params;  // indices into params_
    int64_t numel = 0;
    at::Tensor buffer;  // 1-D: numel gradient elements, then one flag per parameter
    size_t pending = 0;
    bool issued = false;
    comm::PendingCollective work;
  };

  void lazy_init();
  void check_still_replicated();
  void begin_pass();
  void issue_ready_buckets();
  void issue(size_t b, bool during_backward);
  void end_of_backward();
  void discard_pass();
  std::string describe_param(const Param& p) const {
    return "parameter '" + p.fqn + "' of module " +
           contract::ModuleStateRegistry::global().describe(*module_);
  }

  torch::nn::Module* module_;  // the registry keeps this state only while the module lives
  std::shared_ptr<comm::Communicator> comm_;
  int64_t bucket_cap_bytes_;
  bool initialized_ = false;
  contract::ModuleStateRegistry::Checkpoint registry_checkpoint_ = 0;
  std::vector<Param> params_;
  std::unordered_set<const void*> managed_;  // params_' TensorImpls
  std::vector<Bucket> buckets_;
  std::vector<ReplicateBucket> layout_;
  ReplicateStats stats_;

  // The backward pass in progress.
  bool pass_active_ = false;
  bool pass_syncs_ = false;
  size_t next_to_issue_ = 0;
};

namespace {

torch::autograd::variable_list GradientReadyHook::operator()(
    const torch::autograd::variable_list& outputs, const torch::autograd::variable_list& inputs) {
  // An accumulator reached without a gradient (an edge an autograd function returns none for,
  // e.g. activation checkpointing's edges to the parameters it recomputes) accumulates nothing.
  if (inputs.empty() || !inputs[0].defined()) return outputs;
  state_->on_gradient_ready(index_);
  return outputs;
}

// fully_shard on the module itself, or on a module around it; replicate around or inside it
// ([Note: exclusive APIs]; the reasons are in composable/api_names.cc).
void check_composition(const torch::nn::Module& module) {
  declare_api_exclusions();
  contract::ModuleStateRegistry::global().check_exclusions(module, kReplicateApi);
}

// The fully_shard applications in `module`'s tree: the parameters they manage ([Note: managed
// parameters]) are sharded and reduced by their unit, so replicate leaves them alone.
std::vector<contract::AppliedApi> units_in(const torch::nn::Module& module) {
  return contract::ModuleStateRegistry::global().applied_in(module, kFullyShardApi);
}

// Rank 0's values everywhere: one broadcast per (dtype, device) over the flattened tensors.
void broadcast_from_rank0(const std::vector<at::Tensor>& tensors, comm::Communicator& comm) {
  c10::NoGradGuard no_grad;
  std::vector<bool> done(tensors.size(), false);
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (done[i]) continue;
    std::vector<size_t> group;
    for (size_t j = i; j < tensors.size(); ++j) {
      if (!done[j] && tensors[j].scalar_type() == tensors[i].scalar_type() &&
          tensors[j].device() == tensors[i].device()) {
        group.push_back(j);
        done[j] = true;
      }
    }
    std::vector<at::Tensor> flat_parts;
    for (size_t j : group) flat_parts.push_back(tensors[j].detach().reshape({-1}));
    at::Tensor flat = at::cat(flat_parts);
    comm.broadcast(flat, 0, "replicate: sync_module_states").wait();
    int64_t offset = 0;
    for (size_t j : group) {
      at::Tensor t = tensors[j].detach();
      t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

}  // namespace

void ReplicateState::lazy_init() {
  auto& registry = contract::ModuleStateRegistry::global();
  check_composition(*module_);
  const auto units = units_in(*module_);
  std::unordered_set<const void*> seen;
  for (const auto& item : module_->named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    if (!p.requires_grad() || !seen.insert(p.unsafeGetTensorImpl()).second) continue;
    if (contract::find_managing(units, p) != nullptr) continue;
    TORCH_CHECK(at::isFloatingType(p.scalar_type()), "replicate: parameter '", item.key(),
                "' of module ", registry.describe(*module_),
                " requires grad; expected a floating-point dtype, found ", p.scalar_type());
    TORCH_CHECK(p.device().type() == comm_->device().type(), "replicate: parameter '", item.key(),
                "' of module ", registry.describe(*module_), " is on ", p.device(),
                "; expected the communicator's device type (", comm_->device(),
                "). Move the model there before its first forward");
    Param param;
    param.fqn = item.key();
    param.param = p;
    params_.push_back(std::move(param));
    managed_.insert(p.unsafeGetTensorImpl());
  }

  // Buckets: reverse registration order, one open bucket per (dtype, device).
  struct Open {
    c10::ScalarType dtype;
    at::Device device;
    std::vector<size_t> params;
    int64_t bytes = 0;
  };
  std::vector<Open> open;
  std::vector<std::vector<size_t>> closed;
  for (size_t k = params_.size(); k-- > 0;) {
    const at::Tensor& p = params_[k].param;
    auto it = std::find_if(open.begin(), open.end(), [&](const Open& o) {
      return o.dtype == p.scalar_type() && o.device == p.device();
    });
    if (it == open.end()) {
      open.push_back(Open{p.scalar_type(), p.device(), {}, 0});
      it = open.end() - 1;
    }
    it->params.push_back(k);
    it->bytes += p.numel() * static_cast<int64_t>(p.element_size());
    if (it->bytes >= bucket_cap_bytes_) {
      closed.push_back(std::move(it->params));
      open.erase(it);
    }
  }
  for (auto& o : open) closed.push_back(std::move(o.params));
  // Ordered by their first parameter in reverse registration order (its index, descending).
  std::sort(closed.begin(), closed.end(),
            [](const auto& a, const auto& b) { return a.front() > b.front(); });

  for (size_t b = 0; b < closed.size(); ++b) {
    Bucket bucket;
    ReplicateBucket info;
    const at::Tensor& first = params_[closed[b].front()].param;
    info.dtype = first.scalar_type();
    info.device = first.device();
    for (size_t k : closed[b]) {
      Param& p = params_[k];
      p.bucket = b;
      p.index_in_bucket = bucket.params.size();
      p.offset = bucket.numel;
      bucket.params.push_back(k);
      bucket.numel += p.param.numel();
      info.fqns.push_back(p.fqn);
    }
    info.numel = bucket.numel;
    bucket.buffer = at::zeros({bucket.numel + static_cast<int64_t>(bucket.params.size())},
                              first.options().requires_grad(false));
    buckets_.push_back(std::move(bucket));
    layout_.push_back(std::move(info));
  }

  for (size_t k = 0; k < params_.size(); ++k) {
    Param& p = params_[k];
    p.accumulator = torch::autograd::impl::grad_accumulator(p.param);
    TORCH_CHECK(p.accumulator, "replicate: ", describe_param(p),
                " has no gradient accumulator; expected a leaf tensor that requires grad");
    p.hook_key = p.accumulator->add_post_hook(std::make_unique<GradientReadyHook>(this, k));
  }
  initialized_ = true;
  registry_checkpoint_ = registry.checkpoint();
}

// fully_shard applied inside the module after replicate's first forward must not take over a
// replicated parameter (both would reduce its gradient).
void ReplicateState::check_still_replicated() {
  auto& registry = contract::ModuleStateRegistry::global();
  check_composition(*module_);
  const auto units = units_in(*module_);
  for (const auto& p : params_) {
    const contract::AppliedApi* owner = contract::find_managing(units, p.param);
    TORCH_CHECK(owner == nullptr, "replicate: ", describe_param(p),
                " is replicated since the module's first forward, but fully_shard unit ",
                owner == nullptr ? std::string() : registry.describe(*owner->module),
                " applied later manages it; expected fully_shard on submodules to be applied before the "
                "first forward of the replicated module");
  }
  registry_checkpoint_ = registry.checkpoint();
}

void ReplicateState::begin_pass() {
  if (pass_active_) return;
  pass_active_ = true;
  pass_syncs_ = requires_gradient_sync && !buckets_.empty();
  if (pass_syncs_) {
    for (auto& p : params_) p.ready = false;
    for (auto& b : buckets_) {
      b.pending = b.params.size();
      b.issued = false;
    }
    next_to_issue_ = 0;
  }
  std::weak_ptr<ReplicateState> weak = weak_from_this();
  torch::autograd::Engine::get_default_engine().queue_callback([weak] {
    if (auto state = weak.lock()) state->end_of_backward();
  });
}

void ReplicateState::on_gradient_ready(size_t index) {
  begin_pass();
  if (!pass_syncs_) return;  // accumulating locally
  Param& p = params_[index];
  TORCH_CHECK(!p.ready, "replicate: ", describe_param(p),
              " got its gradient twice in one backward pass; expected one gradient per parameter "
              "per pass (its bucket may already be all-reduced). Do not run a backward inside "
              "another one over the replicated module");
  p.ready = true;
  Bucket& bucket = buckets_[p.bucket];
  const at::Tensor& grad = p.param.grad();
  c10::NoGradGuard no_grad;
  at::Tensor slot = bucket.buffer.narrow(0, p.offset, p.param.numel());
  at::Tensor flag = bucket.buffer.narrow(0, bucket.numel + static_cast<int64_t>(p.index_in_bucket), 1);
  if (grad.defined()) {
    TORCH_CHECK(grad.layout() == c10::kStrided, "replicate: ", describe_param(p),
                " got a sparse gradient; expected dense gradients (e.g. an Embedding without "
                "sparse=true)");
    slot.view(grad.sizes()).copy_(grad);
    flag.fill_(1);
  } else {
    slot.zero_();
    flag.zero_();
  }
  if (--bucket.pending == 0) issue_ready_buckets();
}

void ReplicateState::issue_ready_buckets() {
  while (next_to_issue_ < buckets_.size() && buckets_[next_to_issue_].pending == 0) {
    issue(next_to_issue_, /*during_backward=*/true);
    ++next_to_issue_;
  }
}

void ReplicateState::issue(size_t b, bool during_backward) {
  RECORD_USER_SCOPE("replicate::all_reduce");
  Bucket& bucket = buckets_[b];
  bucket.work = comm_->all_reduce(bucket.buffer, c10d::ReduceOp::SUM, "replicate bucket " + std::to_string(b));
  bucket.issued = true;
  ++(during_backward ? stats_.buckets_issued_during_backward : stats_.buckets_issued_at_end_of_backward);
}

void ReplicateState::end_of_backward() {
  RECORD_USER_SCOPE("replicate::post_backward_final_callback");
  if (!pass_active_) return;
  pass_active_ = false;
  if (!pass_syncs_) return;
  c10::NoGradGuard no_grad;
  // Every rank issues every bucket, in order: parameters without a gradient in this pass
  // contribute what they accumulated before it, or zeros.
  for (; next_to_issue_ < buckets_.size(); ++next_to_issue_) {
    Bucket& bucket = buckets_[next_to_issue_];
    for (size_t k : bucket.params) {
      Param& p = params_[k];
      if (p.ready) continue;
      at::Tensor slot = bucket.buffer.narrow(0, p.offset, p.param.numel());
      at::Tensor flag = bucket.buffer.narrow(0, bucket.numel + static_cast<int64_t>(p.index_in_bucket), 1);
      const at::Tensor& grad = p.param.grad();
      if (grad.defined()) {
        slot.view(grad.sizes()).copy_(grad);
        flag.fill_(1);
      } else {
        slot.zero_();
        flag.zero_();
      }
    }
    bucket.pending = 0;
    issue(next_to_issue_, /*during_backward=*/false);
  }
  const double world = static_cast<double>(comm_->size());
  for (auto& bucket : buckets_) {
    bucket.work.wait();
    bucket.buffer.narrow(0, 0, bucket.numel).div_(world);
    const at::Tensor flags =
        bucket.buffer.narrow(0, bucket.numel, static_cast<int64_t>(bucket.params.size())).to(at::kCPU, at::kFloat);
    const float* used = flags.data_ptr<float>();
    for (size_t i = 0; i < bucket.params.size(); ++i) {
      Param& p = params_[bucket.params[i]];
      if (used[i] == 0.0f) continue;  // no rank has a gradient for it: .grad stays undefined
      const at::Tensor average = bucket.buffer.narrow(0, p.offset, p.param.numel()).view(p.param.sizes());
      at::Tensor& grad = p.param.mutable_grad();
      if (!grad.defined()) grad = at::empty_like(p.param);
      grad.copy_(average);
    }
  }
  ++stats_.synced_backward_passes;
}

void ReplicateState::discard_pass() {
  for (auto& bucket : buckets_) {
    if (bucket.issued) bucket.work.wait();
    bucket.issued = false;
  }
  pass_active_ = false;
}

void ReplicateModule::set_requires_gradient_sync(bool sync) { state_->requires_gradient_sync = sync; }
bool ReplicateModule::requires_gradient_sync() const { return state_->requires_gradient_sync; }
torch::nn::Module& ReplicateModule::module() const { return state_->module(); }
const std::vector<ReplicateBucket>& ReplicateModule::buckets() const { return state_->bucket_layout(); }
std::vector<std::string> ReplicateModule::replicated_parameter_fqns() const { return state_->replicated_fqns(); }
ReplicateStats ReplicateModule::stats() const { return state_->stats(); }

ReplicateModule replicate(torch::nn::Module& module, const ReplicateOptions& options) {
  auto& registry = contract::ModuleStateRegistry::global();
  // Every check before anything changes: errors leave the model as it was.
  registry.check_not_applied(module, kReplicateApi);
  check_composition(module);
  TORCH_CHECK(options.bucket_cap_mb() > 0, "replicate: module ", registry.describe(module),
              ": expected bucket_cap_mb > 0, got ", options.bucket_cap_mb());
  std::shared_ptr<comm::Communicator> comm = options.communicator();
  if (!comm) comm = comm::default_process_group().comm;
  const auto bucket_cap_bytes = std::max<int64_t>(1, static_cast<int64_t>(options.bucket_cap_mb() * 1024.0 * 1024.0));

  TORCH_CHECK(!module.weak_from_this().expired(), "replicate: module ", registry.describe(module),
              " is not owned by a std::shared_ptr; expected a module created through its holder "
              "(e.g. `Model model(...)`) or std::make_shared, got one on the stack or in a plain "
              "member");
  // Parameters a fully_shard unit manages are sharded (each rank holds a different slice): left
  // to their unit. The others (replicated now, or sharded by a unit applied later) must live
  // where the communicator works.
  const auto units = units_in(module);
  std::vector<at::Tensor> states;
  std::unordered_set<const void*> seen;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    if (contract::find_managing(units, p) != nullptr || !seen.insert(p.unsafeGetTensorImpl()).second) continue;
    TORCH_CHECK(p.device().type() == comm->device().type(), "replicate: parameter '", item.key(),
                "' of module ", registry.describe(module), " is on ", p.device(),
                "; expected the communicator's device type (", comm->device(),
                "). Move the model there before replicate");
    states.push_back(p);
  }
  for (const auto& b : module.buffers(/*recurse=*/true)) {
    if (seen.insert(b.unsafeGetTensorImpl()).second && b.device().type() == comm->device().type()) {
      states.push_back(b);
    }
  }
  if (options.sync_module_states() && !states.empty()) broadcast_from_rank0(states, *comm);

  auto state = contract::apply_api(kReplicateApi, module, [&](torch::nn::Module& m) {
    auto s = std::make_shared<ReplicateState>(m, comm, bucket_cap_bytes);
    ReplicateState* raw = s.get();  // owned by the registry for the module's lifetime
    contract::register_forward_pre_hook(m, [raw](torch::nn::Module&, contract::ForwardArgs&) { raw->pre_forward(); });
    contract::register_forward_hook(
        m, [raw](torch::nn::Module&, const contract::ForwardArgs&, c10::IValue& output) { raw->post_forward(output); });
    return s;
  });
  return ReplicateModule(std::move(state));
}

std::optional<ReplicateModule> replicate_module_of(const torch::nn::Module& module) {
  auto state = contract::ModuleStateRegistry::global().get_as<ReplicateState>(module, kReplicateApi);
  if (!state) return std::nullopt;
  return ReplicateModule(std::move(state));
}

}  // namespace fsdp
