#include "fsdp/sharded_use_guard.h"

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
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/parameterdict.h>
#include <torch/nn/modules/container/parameterlist.h>
#include <torch/nn/modules/container/sequential.h>

#include "contract/forward_values.h"
#include "contract/module_fqn.h"
#include "contract/module_state.h"
#include "fsdp/fsdp_state.h"
#include "fsdp/root_context.h"

namespace fsdp {
namespace {

// A managed parameter as errors name it.
struct ManagedParam {
  std::string fqn;  // relative to the root
  size_t order = 0;  // position in the root's named_parameters (errors list parameters in it)
  const FSDPState* unit = nullptr;
  std::vector<int64_t> shape;  // unsharded
};

std::string shape_string(at::IntArrayRef shape) {
  std::ostringstream out;
  out << shape;
  return out.str();
}

std::string unit_name(const FSDPState& unit) { return "'" + unit.fqn() + "'"; }

// Every managed parameter of the root's tree, by TensorImpl, with its root-relative FQN (its first
// name in the root's named_parameters; parameters of a sibling root's later modules, which the
// root's first module does not reach, are named by their unit).
std::unordered_map<const void*, ManagedParam> managed_params(const RootContext& context) {
  std::unordered_map<const void*, ManagedParam> params;
  for (const FSDPState* state : context.states) {
    for (const auto& handle : state->handles()) {
      for (size_t i = 0; i < handle->params().size(); ++i) {
        const auto& p = handle->params()[i];
        params[p.param.unsafeGetTensorImpl()] =
            ManagedParam{state->is_root() ? p.fqn : state->fqn() + "." + p.fqn, 0, state,
                         handle->layout().entries[i].shape};
      }
    }
  }
  std::unordered_set<const void*> named;
  for (const auto& item : context.root->module().named_parameters()) {
    const void* impl = item.value().unsafeGetTensorImpl();
    const auto it = params.find(impl);
    if (it != params.end() && named.insert(impl).second) {
      it->second.fqn = item.key();
      it->second.order = named.size() - 1;
    }
  }
  for (auto& [impl, info] : params) {
    if (!named.count(impl)) info.order = named.size();  // unnamed ones last
  }
  return params;
}

bool ran_forward(const RootContext& context, const FSDPState& unit) {
  return std::find(context.forward_order.begin(), context.forward_order.end(), &unit) !=
         context.forward_order.end();
}

// Exchanges `mine` (at most kMaxListed of them, then a count) across the ranks of `context`;
// returns "  rank r: ..." lines for the ranks that found something (empty when none did).
constexpr size_t kMaxListed = 8;
std::string exchange_findings(const RootContext& context, const std::vector<std::string>& mine,
                              const char* what) {
  std::string joined;
  for (size_t i = 0; i < mine.size() && i < kMaxListed; ++i) joined += (i == 0 ? "" : "; ") + mine[i];
  if (mine.size() > kMaxListed) joined += "; and " + std::to_string(mine.size() - kMaxListed) + " more";
  const auto all = context.comm->all_gather_bytes(std::vector<uint8_t>(joined.begin(), joined.end()), what);
  std::ostringstream message;
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty()) continue;
    message << "\n  rank " << r << ": " << std::string(all[r].begin(), all[r].end());
  }
  return message.str();
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// [Note: sharded use guard]

std::vector<std::string> find_params_used_while_sharded(const std::vector<at::Tensor>& outputs,
                                                        const RootContext& context) {
  const auto params = managed_params(context);
  std::vector<std::pair<size_t, std::string>> found;  // (parameter order, line)
  std::unordered_set<const void*> reported;
  std::unordered_set<const torch::autograd::Node*> visited;
  std::vector<torch::autograd::Node*> stack;
  for (const auto& out : outputs) {
    if (out.defined() && out.grad_fn()) stack.push_back(out.grad_fn().get());
  }
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (!visited.insert(node).second) continue;
    if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      const void* impl = acc->variable.unsafeGetTensorImpl();
      const auto it = params.find(impl);
      if (it != params.end()) {
        const auto used_shape = acc->input_metadata(0).shape_as_dim_vector();
        bool same = used_shape.size() == it->second.shape.size();
        for (size_t d = 0; same && d < used_shape.size(); ++d) {
          same = used_shape[d].maybe_as_int() == std::optional<int64_t>(it->second.shape[d]);
        }
        if (!same && reported.insert(impl).second) {
          const FSDPState& unit = *it->second.unit;
          std::ostringstream line;
          line << it->second.fqn << " (used with shape " << used_shape << ", expected "
               << shape_string(it->second.shape) << "; unit " << unit_name(unit)
               << (ran_forward(context, unit) ? ", read outside its forward"
                                              : ", whose pre-forward did not run")
               << ")";
          found.emplace_back(it->second.order, line.str());
        }
      }
      continue;
    }
    for (const auto& edge : node->next_edges()) {
      if (edge.function) stack.push_back(edge.function.get());
    }
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> lines;
  for (auto& [order, line] : found) lines.push_back(std::move(line));
  return lines;
}

void check_no_sharded_use(const std::vector<at::Tensor>& outputs, const RootContext& context) {
  const std::string found =
      exchange_findings(context, find_params_used_while_sharded(outputs, context), "sharded use check");
  TORCH_CHECK(found.empty(),
              "fully_shard: parameters were used in the forward while sharded (their unit's "
              "forward hooks did not run around the use, so they were 1-D views of this rank's "
              "shard, and results would be silently wrong):", found,
              "\nCall managed modules through their hook-able holder (`module(x)`, not "
              "`module->forward(x)`), use fsdp::contract::Sequential instead of "
              "torch::nn::Sequential, and do not read a child unit's parameters from its parent "
              "(make the parent one unit with the child).");
}

// ------------------------------------------------------------------------------------------------
// [Note: refused modules]

void check_modules_can_run_hooks(const std::vector<torch::nn::Module*>& modules) {
  auto& registry = contract::ModuleStateRegistry::global();
  for (torch::nn::Module* module : modules) {
    if (module == nullptr) continue;
    TORCH_CHECK(dynamic_cast<torch::nn::SequentialImpl*>(module) == nullptr, "fully_shard: module ",
                registry.describe(*module),
                " is LibTorch's torch::nn::Sequential, which cannot run forward hooks: no hook-able "
                "holder calls it, and its forward calls its children around their hooks, so a "
                "unit's pre-forward (which unshards its parameters) would never run. Expected a "
                "module called through a hook-able holder; use fsdp::contract::Sequential, which "
                "runs its own hooks and calls each child through its hooks.");
    const char* container = nullptr;
    if (dynamic_cast<torch::nn::ModuleListImpl*>(module)) container = "torch::nn::ModuleList";
    if (dynamic_cast<torch::nn::ModuleDictImpl*>(module)) container = "torch::nn::ModuleDict";
    if (dynamic_cast<torch::nn::ParameterListImpl*>(module)) container = "torch::nn::ParameterList";
    if (dynamic_cast<torch::nn::ParameterDictImpl*>(module)) container = "torch::nn::ParameterDict";
    TORCH_CHECK(container == nullptr, "fully_shard: module ", registry.describe(*module),
                " is LibTorch's ", container,
                ", which has no forward: a unit's pre-forward (which unshards its parameters) "
                "could never run. Expected a module called through a hook-able holder; apply "
                "fully_shard to the modules it holds (e.g. each block), or to the module that "
                "uses them, or make sibling modules one unit with fully_shard({a.get(), b.get()}).");
  }
}

// ------------------------------------------------------------------------------------------------
// [Note: forward errors]

namespace {

constexpr const char* kExplainedMarker = "fully_shard: while running unit ";

// Whether one of `inner`'s modules is strictly inside one of `outer`'s.
bool unit_inside(const FSDPState& outer, const FSDPState& inner) {
  for (const torch::nn::Module* o : outer.modules()) {
    for (const torch::nn::Module* i : inner.modules()) {
      if (o != i && contract::find_module_fqn(*o, *i).has_value()) return true;
    }
  }
  return false;
}

}  // namespace

void explain_forward_error(const FSDPState& unit, c10::Error& error) {
  const RootContext* context = unit.root_context();
  if (context == nullptr) return;
  // fully_shard's own errors (e.g. a forward order that differs across ranks, raised in a unit's
  // pre-forward) say what is wrong already.
  if (error.msg().rfind("fully_shard:", 0) == 0) return;
  for (const auto& line : error.context()) {
    if (line.rfind(kExplainedMarker, 0) == 0) return;  // an inner unit explained it
  }
  std::unordered_map<const void*, std::string> fqns;
  std::vector<std::string> units;
  for (const FSDPState* other : context->states) {
    if (other == &unit || ran_forward(*context, *other) || !unit_inside(unit, *other)) continue;
    // Parameters that are not in the form the unit's forward gives them (on one rank, in full
    // precision, sharded and unsharded parameters look alike and compute correctly).
    std::ostringstream params;
    size_t count = 0;
    for (const auto& handle : other->handles()) {
      for (size_t i = 0; i < handle->params().size(); ++i) {
        const at::Tensor& p = handle->params()[i].param;
        const auto& shape = handle->layout().entries[i].shape;
        if (p.sizes() == at::IntArrayRef(shape) && p.scalar_type() == handle->compute_dtype()) continue;
        if (fqns.empty()) {
          for (const auto& [impl, info] : managed_params(*context)) fqns[impl] = info.fqn;
        }
        if (count++ < 4) {
          params << (count > 1 ? ", " : "") << "'" << fqns[p.unsafeGetTensorImpl()] << "' "
                 << shape_string(shape) << " held as " << p.sizes() << " " << p.scalar_type();
        }
      }
    }
    if (count == 0) continue;
    if (count > 4) params << ", and " << count - 4 << " more";
    units.push_back("unit " + unit_name(*other) + " (" + other->module().name() + "): " +
                    params.str());
  }
  if (units.empty()) return;
  error.add_context(std::string(kExplainedMarker) + unit_name(unit) + ", " +
                    std::to_string(units.size()) +
                    " unit(s) inside it had not run their pre-forward in this iteration, so their "
                    "parameters were not unsharded (expected shape, then what the module held):");
  for (const auto& line : units) error.add_context("  " + line);
  error.add_context(
      "If the error comes from one of these modules (e.g. 'mat2 must be a matrix, got 1-D "
      "tensor'), it was called around its forward hooks: call it through its hook-able holder "
      "(`module(x)`, not `module->forward(x)`; declare its class with FSDP_HOOKABLE_MODULE instead "
      "of TORCH_MODULE), and hold it in fsdp::contract::Sequential or ModuleList rather than "
      "torch::nn::Sequential, ModuleDict or AnyModule.");
}

// ------------------------------------------------------------------------------------------------
// [Note: first-iteration gradient guard]

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
  if (active_guards.load(std::memory_order_relaxed) == 0 || context.root == nullptr) return nullptr;
  return contract::ModuleStateRegistry::global().get_as<FirstIterationGuard>(
      context.root->module(), kFirstIterationGuardApi);
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
  for (const FSDPState* state : context.states) {
    for (const auto& handle : state->handles()) {
      if (!handle->requires_grad()) continue;
      for (size_t i = 0; i < handle->params().size(); ++i) {
        const at::Tensor& p = handle->params()[i].param;
        const ManagedParam& info = params.at(p.unsafeGetTensorImpl());
        torch::autograd::impl::add_hook(
            p, std::make_unique<GradientGuardHook>(guard.findings, state, info,
                                                   handle->is_sharded_strategy()));
      }
    }
  }
  guard.hooks_installed = true;
}

void remove_gradient_hooks(const RootContext& context, const FirstIterationGuard& guard) {
  for (const FSDPState* state : context.states) {
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
    if (!unit.is_root() || context->iterations != 0) return;
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
  for (const FSDPState* state : context.states) forget_grad_accumulators(*state);
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
