#include "fsdp_cpp/fsdp/gradient_guard.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include "fsdp_cpp/contract/forward_values.h"
#include "fsdp_cpp/contract/module_fqn.h"
#include "fsdp_cpp/contract/module_state.h"
#include "fsdp_cpp/contract/shape_text.h"
#include "fsdp_cpp/fsdp/fsdp_state.h"
#include "fsdp_cpp/fsdp/guard_support.h"
#include "fsdp_cpp/fsdp/root_context.h"

namespace fsdp {

using contract::shape_string;
using guard::exchange_findings;
using guard::managed_params;
using guard::ManagedParam;
using guard::unit_name;

namespace {

// Guards not finished yet, across all models: once 0, the forward-path entry points return after
// one atomic load.
std::atomic<int> active_guards{0};

struct Findings {
  std::mutex mutex;
  std::vector<std::pair<size_t, std::string>> lines;  // (parameter order, line)
  std::unordered_set<std::string> fqns;

  void add(size_t order, const std::string& fqn, const std::string& line) {
    std::lock_guard<std::mutex> lock(mutex);
    if (fqns.insert(fqn).second) lines.emplace_back(order, line);
  }

  // In the root's parameter order.
  std::vector<std::string> sorted() {
    std::lock_guard<std::mutex> lock(mutex);
    std::sort(lines.begin(), lines.end());
    std::vector<std::string> out;
    for (const auto& [order, line] : lines) out.push_back(line);
    return out;
  }
};

// Runs before AccumulateGrad of one managed parameter, with the incoming gradient. A gradient of
// another shape than the unsharded one is always wrong. A full-shape gradient arriving while the
// unit is not in its backward is wrong only where the sharded and unsharded forms differ (a
// sharded strategy on several ranks): without sharding the parameter's sharded form is its full
// form, and the runtime keeps such a gradient (it sets it aside before backward and adds it back).
class GradientGuardHook final : public torch::autograd::FunctionPreHook {
 public:
  GradientGuardHook(std::shared_ptr<Findings> findings, const FSDPState* unit,
                    const ManagedParam& param, bool sharded)
      : findings_(std::move(findings)), unit_(unit), fqn_(param.fqn), order_(param.order),
        shape_(param.shape), sharded_(sharded) {}

  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (grads.empty() || !grads[0].defined()) return grads;
    const at::Tensor& grad = grads[0];
    const bool full_shape = grad.sizes() == at::IntArrayRef(shape_);
    const bool in_backward = unit_->training_state() == TrainingState::kPreBackward;
    if (full_shape && (in_backward || !sharded_)) return grads;
    std::ostringstream line;
    line << "'" << fqn_ << "' (unit " << unit_name(*unit_) << ": ";
    if (!full_shape) {
      line << "a gradient of shape " << grad.sizes() << ", expected " << shape_string(shape_) << ")";
    } else {
      line << "a gradient of shape " << grad.sizes()
           << " while the unit was not in its backward)";
    }
    findings_->add(order_, fqn_, line.str());
    return {at::Tensor()};  // dropped: AccumulateGrad ignores an undefined gradient
  }

  const Findings* findings() const { return findings_.get(); }

 private:
  std::shared_ptr<Findings> findings_;
  const FSDPState* unit_;
  std::string fqn_;
  size_t order_;
  std::vector<int64_t> shape_;
  bool sharded_;
};

class FirstIterationGuard final : public contract::ApiState {
 public:
  FirstIterationGuard() { active_guards.fetch_add(1); }
  ~FirstIterationGuard() override {
    if (!finished) active_guards.fetch_sub(1);
  }

  void finish() {
    if (finished) return;
    finished = true;
    active_guards.fetch_sub(1);
  }

  std::shared_ptr<Findings> findings = std::make_shared<Findings>();
  bool hooks_installed = false;
  bool finished = false;
};

std::shared_ptr<FirstIterationGuard> guard_of(const RootContext& context) {
  if (active_guards.load(std::memory_order_relaxed) == 0 || context.root() == nullptr) return nullptr;
  return contract::ModuleStateRegistry::global().get_as<FirstIterationGuard>(
      context.root()->module(), kFirstIterationGuardApi);
}

// Each later use of the unit's parameters gets its own AccumulateGrad, recording the shape used.
void forget_grad_accumulators(const FSDPState& unit) {
  for (const auto& handle : unit.handles()) {
    if (!handle->requires_grad()) continue;
    for (const auto& p : handle->params()) {
      torch::autograd::impl::set_grad_accumulator(
          p.param, c10::weak_intrusive_ptr<torch::autograd::Node>(
                       c10::intrusive_ptr<torch::autograd::Node>()));
    }
  }
}

void install_gradient_hooks(const RootContext& context, FirstIterationGuard& guard) {
  const auto params = managed_params(context);
  for (const FSDPState* state : context.states()) {
    for (const auto& handle : state->handles()) {
      if (!handle->requires_grad()) continue;
      for (size_t i = 0; i < handle->params().size(); ++i) {
        const at::Tensor& p = handle->params()[i].param;
        const ManagedParam& info = params.at(p.unsafeGetTensorImpl());
        // Appended after the hooks the user registered (Tensor::register_hook): impl::add_hook
        // asserts that the parameter has none. Only ours are removed afterwards.
        torch::autograd::impl::hooks(p).push_back(std::make_unique<GradientGuardHook>(
            guard.findings, state, info, handle->is_sharded_strategy()));
      }
    }
  }
  guard.hooks_installed = true;
}

void remove_gradient_hooks(const RootContext& context, const FirstIterationGuard& guard) {
  for (const FSDPState* state : context.states()) {
    for (const auto& handle : state->handles()) {
      for (const auto& p : handle->params()) {
        if (!p.param.requires_grad()) continue;
        auto& hooks = torch::autograd::impl::hooks(p.param);
        hooks.erase(std::remove_if(hooks.begin(), hooks.end(),
                                   [&](const std::unique_ptr<torch::autograd::FunctionPreHook>& h) {
                                     const auto* ours = dynamic_cast<const GradientGuardHook*>(h.get());
                                     return ours != nullptr && ours->findings() == guard.findings.get();
                                   }),
                    hooks.end());
      }
    }
  }
}

}  // namespace

void guard_after_pre_forward(FSDPState& unit) {
  if (active_guards.load(std::memory_order_relaxed) == 0 && !unit.is_root()) return;
  RootContext* context = unit.root_context();
  if (context == nullptr) return;
  std::shared_ptr<FirstIterationGuard> guard = guard_of(*context);
  if (guard == nullptr) {
    // Created once, in the root's pre-forward of the first iteration.
    if (!unit.is_root() || context->iteration_state().iterations() != 0) return;
    auto& registry = contract::ModuleStateRegistry::global();
    if (registry.contains(unit.module(), kFirstIterationGuardApi)) return;  // finished
    guard = std::make_shared<FirstIterationGuard>();
    registry.insert(unit.module(), kFirstIterationGuardApi, guard);
  }
  if (guard->finished) return;
  if (!guard->hooks_installed && unit.is_root()) install_gradient_hooks(*context, *guard);
  forget_grad_accumulators(unit);
}

void guard_after_post_forward(FSDPState& unit, const c10::IValue& output) {
  if (active_guards.load(std::memory_order_relaxed) == 0) return;
  RootContext* context = unit.root_context();
  if (context == nullptr) return;
  std::shared_ptr<FirstIterationGuard> guard = guard_of(*context);
  if (guard == nullptr || guard->finished) return;
  forget_grad_accumulators(unit);
  if (!unit.is_root() || !guard->hooks_installed) return;
  // The check runs at the end of the backward through the root's outputs: the first output
  // gradient queues it, after the runtime's own end-of-backward callback (queued by the runtime's
  // hooks, which run before this one).
  // Queued once per backward pass through this forward's outputs.
  std::weak_ptr<FirstIterationGuard> weak = guard;
  auto queued = std::make_shared<bool>(false);
  contract::for_each_tensor(output, [&](const at::Tensor& t) {
    if (!t.requires_grad()) return;
    t.register_hook([weak, context, queued](const at::TensorBase&) {
      auto guard = weak.lock();
      if (guard == nullptr || guard->finished || *queued) return;
      *queued = true;
      torch::autograd::Engine::get_default_engine().queue_callback([weak, context, queued] {
        *queued = false;
        if (weak.lock() != nullptr) check_first_iteration_gradients(*context);
      });
    });
  });
}

void check_first_iteration_gradients(RootContext& context) {
  std::shared_ptr<FirstIterationGuard> guard = guard_of(context);
  if (guard == nullptr || guard->finished || !guard->hooks_installed) return;
  const std::vector<std::string> mine = guard->findings->sorted();
  // Removed before the collective check, so that a failure leaves nothing installed. The
  // accumulators the guarded uses created (a graph kept alive, e.g. a stored loss, keeps them
  // cached on the parameters) are forgotten: the next forward creates its own.
  remove_gradient_hooks(context, *guard);
  for (const FSDPState* state : context.states()) forget_grad_accumulators(*state);
  guard->finish();
  const std::string found = exchange_findings(context, mine, "first-iteration gradient check");
  TORCH_CHECK(found.empty(),
              "fully_shard: in the first iteration, parameters got gradients from outside their "
              "unit's forward (e.g. a penalty such as an L2 term over model->parameters() "
              "computed after the forward, or a parameter read while its unit was resharded): "
              "outside its unit's forward a managed parameter is a 1-D view of this rank's shard, "
              "so such a computation sees only part of it, and its gradient cannot be reduced with "
              "the unit's. Expected gradients of the unsharded shape, arriving during the unit's "
              "backward; found (these gradients were dropped):",
              found,
              "\nCompute such terms inside a unit's forward, on its unsharded parameters (for an L2 "
              "penalty, use the optimizer's weight_decay), call managed modules through their "
              "hook-able holders, and use FullyShardOptions::mixed_precision instead of "
              "module->to(dtype).");
}

bool first_iteration_guard_active(const RootContext& context) {
  auto guard = guard_of(context);
  return guard != nullptr && !guard->finished;
}

}  // namespace fsdp
