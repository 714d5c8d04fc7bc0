#include "fsdp_cpp/composable/activation_checkpoint.h"

#include <algorithm>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_set>
#include <utility>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/record_function.h>
#include <ATen/core/Generator.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/module.h>

#include "fsdp_cpp/contract/contract.h"
#include "fsdp_cpp/contract/forward_values.h"
#include "fsdp_cpp/contract/module_state.h"
#include "fsdp_cpp/contract/recompute_region.h"

namespace fsdp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct ActivationCheckpointState final : contract::ApiState {
  ActivationCheckpointOptions options;
};

// The generators a forward draws from, and their states.
class RngStates {
 public:
  static RngStates capture(const std::vector<at::Device>& cuda_devices) {
    RngStates states;
    states.add(at::detail::getDefaultCPUGenerator());
    for (const auto& device : cuda_devices) states.add(at::globalContext().defaultGenerator(device));
    return states;
  }
  void restore() const {
    for (const auto& [generator, state] : saved_) {
      at::Generator g = generator;
      std::lock_guard<std::mutex> lock(g.mutex());
      g.set_state(state);
    }
  }

 private:
  void add(at::Generator generator) {
    std::lock_guard<std::mutex> lock(generator.mutex());
    saved_.emplace_back(generator, generator.get_state());
  }
  std::vector<std::pair<at::Generator, at::Tensor>> saved_;
};

// Restores the generators' states of the scope's start when it ends (also on an exception).
class RngFork {
 public:
  RngFork(const RngStates& replay, const std::vector<at::Device>& cuda_devices)
      : current_(RngStates::capture(cuda_devices)) {
    replay.restore();
  }
  ~RngFork() { current_.restore(); }
  RngFork(const RngFork&) = delete;
  RngFork& operator=(const RngFork&) = delete;

 private:
  RngStates current_;
};

// What backward needs to run one checkpointed call again. The node's inputs are the call's tensor
// arguments (in contract::for_each_tensor order), then, when none of them needs a gradient, the
// module's trainable parameters (so that the outputs need one and backward reaches the node).
struct Recompute final : torch::CustomClassHolder {
  contract::ForwardFunction forward;
  std::weak_ptr<torch::nn::Module> module;
  std::string module_name;
  contract::ForwardArgs args;  // the arguments, each tensor replaced by an empty placeholder
  std::vector<bool> requires_grad;  // per tensor argument
  size_t num_parameters = 0;        // parameters among the node's inputs, after the arguments
  bool preserve_rng_state = true;
  std::vector<at::Device> cuda_devices;
  std::optional<RngStates> rng;
  c10::IValue output;  // the first forward's output, until the wrapper has rebuilt it
};

contract::ForwardArgs with_tensors(const contract::ForwardArgs& args, const std::vector<at::Tensor>& tensors) {
  contract::ForwardArgs filled;
  filled.reserve(args.size());
  size_t next = 0;
  for (const auto& arg : args) {
    filled.push_back(contract::map_tensors(arg, [&](const at::Tensor&) { return tensors[next++]; }));
  }
  return filled;
}

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  // Runs under no-grad (as every custom function's forward does): nothing is saved but the inputs.
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<Recompute> recompute,
                               at::TensorList inputs) {
    const size_t num_args = recompute->requires_grad.size();
    const std::vector<at::Tensor> arg_tensors(inputs.begin(), inputs.begin() + static_cast<std::ptrdiff_t>(num_args));
    auto module = recompute->module.lock();
    {
      contract::RecomputeRegionGuard region(contract::RecomputePhase::kDiscarding, *module);
      recompute->output = recompute->forward(with_tensors(recompute->args, arg_tensors));
    }
    variable_list outputs;
    contract::for_each_tensor(recompute->output, [&](const at::Tensor& t) { outputs.push_back(t); });
    for (const auto& t : outputs) {
      if (t.defined() && !at::isFloatingType(t.scalar_type()) && !at::isComplexType(t.scalar_type())) {
        ctx->mark_non_differentiable({t});
      }
    }
    ctx->save_for_backward(arg_tensors);
    ctx->saved_data["recompute"] = c10::IValue::make_capsule(recompute);
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto recompute = c10::static_intrusive_pointer_cast<Recompute>(ctx->saved_data["recompute"].toCapsule());
    auto module = recompute->module.lock();
    TORCH_CHECK(module != nullptr, "checkpoint_activations: module ", recompute->module_name,
                " was destroyed before backward reached its checkpointed forward; keep the model "
                "alive until backward has run");
    TORCH_CHECK(!c10::GradMode::is_enabled(), "checkpoint_activations: module ", recompute->module_name,
                " is in a backward with create_graph=true (a double backward); checkpointed "
                "modules support first-order gradients only");
    const variable_list saved = ctx->get_saved_variables();  // refuses a second backward
    std::vector<at::Tensor> detached;
    detached.reserve(saved.size());
    for (size_t i = 0; i < saved.size(); ++i) {
      at::Tensor d = saved[i].detach();
      if (recompute->requires_grad[i]) d.requires_grad_(true);
      detached.push_back(std::move(d));
    }
    RECORD_USER_SCOPE("checkpoint::recompute");
    c10::IValue output;
    {
      std::optional<RngFork> rng;
      if (recompute->rng) rng.emplace(*recompute->rng, recompute->cuda_devices);
      at::AutoGradMode grad_mode(true);
      contract::RecomputeRegionGuard region(contract::RecomputePhase::kRecomputing, *module);
      output = recompute->forward(with_tensors(recompute->args, detached));
    }
    std::vector<at::Tensor> outputs;
    std::vector<at::Tensor> output_grads;
    size_t k = 0;
    contract::for_each_tensor(output, [&](const at::Tensor& t) {
      if (k < grads.size() && t.defined() && t.requires_grad() && grads[k].defined()) {
        outputs.push_back(t);
        output_grads.push_back(grads[k]);
      }
      ++k;
    });
    TORCH_CHECK(k == grads.size(), "checkpoint_activations: the forward of module ", recompute->module_name,
                " returned ", grads.size(), " tensors, but ", k,
                " when recomputed in backward; its forward must compute the same outputs when run "
                "again on the same arguments");
    if (!outputs.empty()) torch::autograd::backward(outputs, output_grads);
    // No gradient for the Recompute argument; the inputs' from the recomputed graph; none for the
    // parameters (the recomputed backward accumulated theirs).
    variable_list result;
    result.reserve(1 + detached.size() + recompute->num_parameters);
    result.emplace_back();
    for (size_t i = 0; i < detached.size(); ++i) {
      result.push_back(recompute->requires_grad[i] ? detached[i].grad() : at::Tensor());
    }
    result.resize(1 + detached.size() + recompute->num_parameters);
    return result;
  }
};

c10::IValue checkpointed_forward(torch::nn::Module& module, const contract::ForwardArgs& args,
                                 const contract::ForwardFunction& forward,
                                 const ActivationCheckpointOptions& options) {
  if (!c10::GradMode::is_enabled()) return forward(args);  // nothing to save in the first place
  auto recompute = c10::make_intrusive<Recompute>();
  recompute->forward = forward;
  recompute->module = module.weak_from_this();
  recompute->module_name = contract::ModuleStateRegistry::global().describe(module);
  std::vector<at::Tensor> inputs;
  const at::Tensor placeholder = at::empty({0});
  for (const auto& arg : args) {
    recompute->args.push_back(contract::map_tensors(arg, [&](const at::Tensor& t) {
      inputs.push_back(t);
      recompute->requires_grad.push_back(t.defined() && t.requires_grad());
      if (t.defined() && t.is_cuda()) {
        auto& devices = recompute->cuda_devices;
        if (std::find(devices.begin(), devices.end(), t.device()) == devices.end()) devices.push_back(t.device());
      }
      return placeholder;  // not undefined: an IValue holding one is None, which no tensor replaces
    }));
  }
  bool any_requires_grad = false;
  for (bool r : recompute->requires_grad) any_requires_grad |= r;
  if (!any_requires_grad) {
    std::unordered_set<const void*> seen;
    for (const auto& p : module.parameters(/*recurse=*/true)) {
      if (p.requires_grad() && seen.insert(p.unsafeGetTensorImpl()).second) {
        inputs.push_back(p);
        ++recompute->num_parameters;
      }
    }
  }
  if (options.preserve_rng_state()) recompute->rng = RngStates::capture(recompute->cuda_devices);
  const variable_list outputs = CheckpointFunction::apply(recompute, at::TensorList(inputs));
  size_t next = 0;
  c10::IValue output = contract::map_tensors(recompute->output, [&](const at::Tensor&) { return outputs[next++]; });
  recompute->output = c10::IValue();
  return output;
}

}  // namespace

void checkpoint_activations(torch::nn::Module& module, const ActivationCheckpointOptions& options) {
  contract::apply_api(kActivationCheckpointApi, module, [&](torch::nn::Module& m) {
    auto state = std::make_shared<ActivationCheckpointState>();
    state->options = options;
    contract::register_forward_wrapper(
        m, [options](torch::nn::Module& mod, const contract::ForwardArgs& args,
                     const contract::ForwardFunction& forward) {
          return checkpointed_forward(mod, args, forward, options);
        });
    return state;
  });
}

std::vector<SelectedModule> checkpoint_activations_tree(torch::nn::Module& root, const WrapPolicy& policy,
                                                        const ActivationCheckpointOptions& options) {
  std::vector<SelectedModule> selected = select_modules(root, policy);
  auto& registry = contract::ModuleStateRegistry::global();
  for (const auto& s : selected) registry.check_not_applied(*s.module, kActivationCheckpointApi);
  for (const auto& s : selected) checkpoint_activations(*s.module, options);
  return selected;
}

bool is_activation_checkpointed(const torch::nn::Module& module) {
  return contract::ModuleStateRegistry::global().contains(module, kActivationCheckpointApi);
}

}  // namespace fsdp
