#include "fsdp_cpp/fsdp/forward_errors.h"

#include <algorithm>
#include <memory>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/parameterdict.h>
#include <torch/nn/modules/container/parameterlist.h>
#include <torch/nn/modules/container/sequential.h>

#include "fsdp_cpp/contract/forward_values.h"
#include "fsdp_cpp/contract/module_fqn.h"
#include "fsdp_cpp/contract/module_state.h"
#include "fsdp_cpp/contract/shape_text.h"
#include "fsdp_cpp/fsdp/fsdp_state.h"
#include "fsdp_cpp/fsdp/guard_support.h"
#include "fsdp_cpp/fsdp/root_context.h"

namespace fsdp {

using contract::shape_string;
using guard::managed_params;
using guard::ran_forward;
using guard::unit_name;

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
  // pre-forward, or an FSDPModule method refusing to run inside a forward) say what is wrong
  // already.
  if (error.msg().rfind("fully_shard:", 0) == 0 || error.msg().rfind("FSDPModule::", 0) == 0) return;
  for (const auto& line : error.context()) {
    if (line.rfind(kExplainedMarker, 0) == 0) return;  // an inner unit explained it
  }
  std::unordered_map<const void*, std::string> fqns;
  std::vector<std::string> not_run, resharded;  // units whose parameters are not in forward form
  size_t resharded_count = 0;
  constexpr size_t kMaxResharded = 4;
  for (const FSDPState* other : context->states()) {
    if (other == &unit || !unit_inside(unit, *other)) continue;
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
    const std::string line = "unit " + unit_name(*other) + " (" + other->module().name() + "): " + params.str();
    if (!ran_forward(*context, *other)) {
      not_run.push_back(line);
    } else if (resharded_count++ < kMaxResharded) {
      // [Note: forward errors]: its forward ran through its hooks, then the unit was resharded; a
      // method of it called directly afterwards computes on the sharded parameters.
      resharded.push_back(line);
    }
  }
  if (not_run.empty() && resharded.empty()) return;
  if (!not_run.empty()) {
    error.add_context(std::string(kExplainedMarker) + unit_name(unit) + ", " + std::to_string(not_run.size()) +
                      " unit(s) inside it had not run their pre-forward in this iteration, so their "
                      "parameters were not unsharded (expected shape, then what the module held):");
    for (const auto& line : not_run) error.add_context("  " + line);
  }
  if (!resharded.empty()) {
    // One explanation per error: the marker starts it once.
    error.add_context((not_run.empty() ? std::string(kExplainedMarker) + unit_name(unit) + ", " : std::string("Also, ")) +
                      std::to_string(resharded_count) + " unit(s) inside it had run their forward in this iteration and were resharded after it, so "
                      "their parameters were sharded when the error was raised (expected shape, then what the "
                      "module held):");
    for (const auto& line : resharded) error.add_context("  " + line);
    if (resharded_count > resharded.size()) {
      error.add_context("  and " + std::to_string(resharded_count - resharded.size()) + " more unit(s)");
    }
  }
  error.add_context(
      "If the error comes from one of these modules (e.g. 'mat2 must be a matrix, got 1-D "
      "tensor'), it was called around its forward hooks: call its forward through its hook-able holder "
      "(`module(x)`, not `module->forward(x)`; declare its class with FSDP_HOOKABLE_MODULE instead "
      "of TORCH_MODULE), and hold it in fsdp::contract::Sequential or ModuleList rather than "
      "torch::nn::Sequential, ModuleDict or AnyModule. A method other than forward (e.g. "
      "`block->generate(x)`) computes on the unit's sharded parameters when called directly: call it through "
      "fsdp::contract::call_method(block, &BlockImpl::generate, x) (or call_with_hooks), which unshards the "
      "unit around it, or unshard the unit first (FSDPModule::unshard(), reshard() after).");
}

}  // namespace fsdp
