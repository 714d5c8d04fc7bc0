#include "fsdp_cpp/composable/summon_full_params.h"

#include <algorithm>
#include <exception>
#include <optional>
#include <string>

#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include "fsdp_cpp/comm/agreement.h"
#include "fsdp_cpp/composable/fully_shard_internal.h"
#include "fsdp_cpp/fsdp/root_context.h"
#include "fsdp_cpp/fsdp/runtime.h"
#include "fsdp_cpp/fsdp/unit_tree.h"

namespace fsdp {
namespace {

constexpr const char* kApi = "fsdp::SummonFullParams";

const char* describe_phase(const RootContext& context) {
  if (context.iteration_state().in_root_forward()) return "inside a forward";
  switch (context.iteration_state().phase()) {
    case IterationPhase::kIdle: return "idle";
    case IterationPhase::kForward: return "after a forward whose backward has not run yet";
    case IterationPhase::kBackward: return "inside a backward";
  }
  return "?";
}

// The unit, and with `recurse` every unit inside its modules, each once, outermost first.
std::vector<std::shared_ptr<FSDPState>> units_of(const FSDPModule& unit, bool recurse) {
  std::vector<std::shared_ptr<FSDPState>> units;
  for (torch::nn::Module* module : unit.modules()) {
    for (auto& state : distinct_units_in_tree(*module)) {
      if (!recurse && state.get() != &detail::state_of(unit)) continue;
      if (std::find(units.begin(), units.end(), state) == units.end()) units.push_back(state);
    }
  }
  return units;
}

// The rank whose slices a handle holds (0 without sharding).
int shard_rank(const FSDPState& unit, const FlatParamHandle& handle) {
  return handle.is_sharded_strategy() ? unit.config().comm->rank() : 0;
}

// A tensor of `shape` over `flat`'s elements from `offset` that autograd does not track as a view
// (so `grad.detach_()`, as optimizers' zero_grad calls it, works on it).
at::Tensor storage_slice(const at::Tensor& flat, int64_t offset, const std::vector<int64_t>& shape) {
  at::Tensor slice = at::empty({0}, flat.options());
  std::vector<int64_t> strides(shape.size(), 1);
  for (int64_t d = static_cast<int64_t>(shape.size()) - 2; d >= 0; --d) strides[d] = strides[d + 1] * shape[d + 1];
  slice.set_(flat.storage(), flat.storage_offset() + offset, shape, strides);
  return slice;
}

// This rank's sharded gradient of `handle` as one 1-D tensor [shard_numel] in the parameters'
// dtype (zeros where a parameter's `.grad` is unset), or undefined when no `.grad` is set.
at::Tensor local_sharded_grad(const FSDPState& unit, const FlatParamHandle& handle) {
  bool any = false;
  for (const auto& p : handle.params()) any |= p.param.grad().defined();
  if (!any) return {};
  if (at::Tensor g = handle.sharded_grad(); g.defined()) return g;
  const int rank = shard_rank(unit, handle);
  at::Tensor flat = at::zeros({handle.layout().shard_numel()}, handle.local_shard().options());
  for (size_t i = 0; i < handle.params().size(); ++i) {
    const at::Tensor& g = handle.params()[i].param.grad();
    const auto slice = handle.layout().slice_of(static_cast<int>(i), rank);
    if (!g.defined() || slice.size() == 0) continue;
    TORCH_CHECK(g.numel() == slice.size(), kApi, ": the gradient of '", handle.params()[i].fqn,
                "' in unit '", unit.fqn(), "' has ", g.numel(),
                " elements; expected this rank's shard of it, of ", slice.size(), " elements");
    flat.narrow(0, slice.shard_offset, slice.size()).copy_(g.reshape({-1}));
  }
  return flat;
}

}  // namespace

SummonFullParams::SummonFullParams(const FSDPModule& unit, SummonFullParamsOptions options)
    : options_(options), fqn_(unit.fqn()) {
  const auto units = units_of(unit, options_.recurse());
  TORCH_CHECK(!(options_.rank0_only() && options_.writeback()), kApi, ": unit '", unit.fqn(),
              "': expected writeback(false) with rank0_only(true), got writeback(true). Ranks other "
              "than 0 hold no full parameters to write back; summon with writeback on every rank, "
              "or with rank0_only and writeback(false)");
  for (const auto& state : units) {
    if (RootContext* context = state->root_context()) {
      // One rule on every world size ([Note: iteration phases], kept on one rank too): refused
      // while a backward can still run through a forward (it would compute with the values the
      // forward saw, and reduce into shards the scope is editing); a forward whose graph was
      // dropped ends its iteration here, as a forward under NoGradGuard does at once.
      const bool backward_pending = runtime::settle_forward_phase(*context);
      TORCH_CHECK(!context->iteration_state().in_root_forward() &&
                      context->iteration_state().phase() != IterationPhase::kBackward && !backward_pending,
                  kApi, ": unit '", state->fqn(), "' is ", describe_phase(*context),
                  "; expected to be entered outside forward and backward. Summon the full "
                  "parameters before the forward or after its backward (a forward under "
                  "torch::NoGradGuard, or one whose outputs were all dropped, ends its iteration)");
    }
    TORCH_CHECK(state->training_state() == TrainingState::kIdle, kApi, ": unit '", state->fqn(),
                "' is in training state '", to_string(state->training_state()),
                "'; expected 'idle' (outside forward and backward)");
    TORCH_CHECK(!state->full_params_summoned(), kApi, ": unit '", state->fqn(),
                "' already has its full parameters summoned by an enclosing scope; expected a "
                "unit that is not summoned (nesting scopes on the same unit is not supported: "
                "leave the outer scope first, or use its full parameters)");
  }

  // Gather everything first: an error here (or in a collective) leaves the model as it was.
  c10::NoGradGuard no_grad;
  for (const auto& state : units) {
    const auto& comm = state->config().comm;
    const bool materialize = !options_.rank0_only() || comm->rank() == 0;
    Unit summoned{state, {}};
    // Gradients: a FlatParameter shows them when any rank has some (one agreement per unit).
    std::vector<at::Tensor> sharded_grads(state->handles().size());
    std::vector<bool> show_grads(state->handles().size(), false);
    if (options_.with_grads()) {
      std::vector<float> flags(state->handles().size(), 0.0f);
      for (size_t k = 0; k < state->handles().size(); ++k) {
        const FlatParamHandle& h = *state->handles()[k];
        if (!h.requires_grad()) continue;
        sharded_grads[k] = local_sharded_grad(*state, h);
        if (sharded_grads[k].defined() || h.accumulated_grad().defined()) flags[k] = 1.0f;
      }
      at::Tensor any = at::tensor(flags);
      if (comm->size() > 1) {
        any = any.to(comm->device());
        comm->all_reduce(any, c10d::ReduceOp::MAX, state->fqn() + " (summon gradients)").wait();
        any = any.cpu();
      }
      for (size_t k = 0; k < show_grads.size(); ++k) show_grads[k] = any[k].item<float>() > 0.0f;
    }
    for (size_t k = 0; k < state->handles().size(); ++k) {
      FlatParamHandle& h = *state->handles()[k];
      Handle entry;
      entry.handle = &h;
      entry.was_unsharded = h.is_unsharded();
      for (const auto& p : h.params()) {
        entry.data.push_back(p.param.data());
        entry.grads.push_back(p.param.grad());
      }
      // Full precision: the shards themselves, all-gathered (every rank takes part).
      at::Tensor full = h.gather_full_precision();
      if (show_grads[k]) {
        const int64_t shard_numel = h.layout().shard_numel();
        at::Tensor source = sharded_grads[k].defined()
                                ? sharded_grads[k].to(comm->device())
                                : at::zeros({shard_numel}, h.local_shard().options().device(comm->device()));
        at::Tensor grad;
        if (h.is_sharded_strategy()) {
          grad = at::empty({h.layout().padded_numel}, source.options());
          comm->all_gather_into_tensor(grad, source, state->fqn() + " (summon gradients)").wait();
        } else {
          grad = source.clone();
        }
        if (const at::Tensor& local = h.accumulated_grad(); local.defined()) {
          grad.add_(local.to(grad.device(), grad.scalar_type()));
        }
        if (materialize) {
          entry.full_grad = grad.to(options_.offload_to_cpu() ? at::Device(at::kCPU) : h.local_shard().device());
        }
      }
      if (materialize) {
        // Without sharding the "gathered" tensor is the shard itself: copy it unless edits are
        // to land in it directly (writeback, not offloaded).
        const bool is_shard = full.is_same(h.local_shard());
        if (options_.offload_to_cpu()) {
          full = full.to(at::kCPU, full.scalar_type(), /*non_blocking=*/false, /*copy=*/is_shard);
        } else if (is_shard && !options_.writeback()) {
          full = full.clone();
        }
        entry.full = full;
      }
      summoned.handles.push_back(std::move(entry));
    }
    units_.push_back(std::move(summoned));
  }

  // Point the parameters at their full values (nothing below throws).
  for (Unit& u : units_) {
    for (Handle& entry : u.handles) {
      const FlatParamHandle& h = *entry.handle;
      for (size_t i = 0; i < h.params().size(); ++i) {
        const auto& e = h.layout().entries[i];
        at::Tensor param = h.params()[i].param;
        if (entry.full.defined()) param.set_data(entry.full.narrow(0, e.offset, e.numel).view(e.shape));
        if (entry.full_grad.defined()) param.mutable_grad() = storage_slice(entry.full_grad, e.offset, e.shape);
      }
    }
    u.state->set_full_params_summoned(true);
  }
}

SummonFullParams::~SummonFullParams() {
  try {
    leave(/*by_exception=*/std::uncaught_exceptions() > uncaught_exceptions_);
  } catch (const std::exception& error) {
    try {
      TORCH_WARN(kApi, ": leaving the scope failed (the parameters are restored, edits may not be "
                 "written back): ", error.what());
    } catch (...) {  // warnings turned into errors: a destructor must not throw
    }
  }
}

void SummonFullParams::exit() { leave(/*by_exception=*/false); }

// "\n  rank r: <problem>" for every rank of the scope's communicators that reported one, the same
// string on every rank: one all_gather_bytes per distinct communicator, in unit order.
std::string SummonFullParams::agree_on_problems(const std::string& mine) const {
  // Over every communicator of the units ([Note: error agreement] in comm/agreement.h): every rank
  // gets the same problem (the lowest rank's, naming the others), or none.
  std::vector<std::shared_ptr<comm::Communicator>> comms;
  for (const Unit& u : units_) {
    const auto& comm = u.state->config().comm;
    // Groups of one rank too: they communicate nothing but name this rank ("group rank 0").
    if (std::find(comms.begin(), comms.end(), comm) == comms.end()) comms.push_back(comm);
  }
  const auto agreed = comm::agree_on_error(comms, mine.empty() ? std::nullopt : std::optional<std::string>(mine), kApi);
  if (!agreed) return "";
  // "<kApi>: rank R: <problem>...": the message below names the API once.
  const std::string prefix = std::string(kApi) + ": ";
  return "\n  " + (agreed->compare(0, prefix.size(), prefix) == 0 ? agreed->substr(prefix.size()) : *agreed);
}

void SummonFullParams::leave(bool by_exception) {
  if (exited_) return;
  exited_ = true;
  c10::NoGradGuard no_grad;
  // This rank's reason not to write back: it leaves by an exception, or a full parameter was
  // replaced by a tensor of another shape (checked for every one before any is written).
  std::string problem;
  if (by_exception) {
    problem = "left the scope by an exception (see that rank's error)";
  } else if (options_.writeback()) {
    for (const Unit& u : units_) {
      for (const Handle& entry : u.handles) {
        if (!entry.full.defined()) continue;
        const FlatParamHandle& h = *entry.handle;
        for (size_t i = 0; i < h.params().size() && problem.empty(); ++i) {
          const at::Tensor& p = h.params()[i].param;
          const auto& shape = h.layout().entries[i].shape;
          if (p.sizes() == at::IntArrayRef(shape)) continue;
          problem = c10::str("parameter '", u.state->is_root() ? "" : u.state->fqn() + ".", h.params()[i].fqn,
                             "' of unit '", u.state->fqn(), "' was replaced inside the scope by a tensor of shape ",
                             p.sizes(), "; expected its full shape ", at::IntArrayRef(shape));
        }
      }
    }
  }
  // [Note: summon exit] Whether to write back, and so whether to re-unshard the units that were
  // unsharded before the scope (all-gathers), is decided from what every rank reports (in-place
  // edits of a FlatParameter without sharding land in it directly and are not undone): with
  // writeback every rank leaving the scope (by an exception too: the destructor) exchanges its
  // problem (comm::agree_on_error over the units' communicators: [Note: error agreement]), so all
  // of them write back, gather and fail alike. Without writeback leaving issues
  // no collective at all. A rank whose exception skipped a collective the others still run inside
  // the scope cannot be matched by anything: the exchange then fails with the collective's error.
  std::string problems;
  std::exception_ptr exchange_failed;
  if (options_.writeback()) {
    try {
      problems = agree_on_problems(problem);
    } catch (...) {
      exchange_failed = std::current_exception();
    }
  }
  const bool write = options_.writeback() && problems.empty() && !exchange_failed;
  for (Unit& u : units_) {
    for (Handle& entry : u.handles) {
      FlatParamHandle& h = *entry.handle;
      const int rank = shard_rank(*u.state, h);
      for (size_t i = 0; i < h.params().size(); ++i) {
        at::Tensor param = h.params()[i].param;
        if (write && entry.full.defined()) {
          const auto slice = h.layout().slice_of(static_cast<int>(i), rank);
          at::Tensor shard = h.local_shard().narrow(0, slice.shard_offset, slice.size());
          const at::Tensor value = param.detach().reshape({-1}).narrow(0, slice.param_begin, slice.size());
          // Without sharding and offload the full parameter is the shard itself: nothing to copy.
          if (slice.size() > 0 && value.data_ptr() != shard.data_ptr()) shard.copy_(value);
        }
        param.set_data(entry.data[i]);
        param.mutable_grad() = entry.grads[i];
      }
      entry.full = at::Tensor();
      entry.full_grad = at::Tensor();
    }
    u.state->set_full_params_summoned(false);
  }
  // A FlatParameter that was unsharded before the scope gets its unsharded views again, from the
  // shards just written (collective, in the same order on every rank). Without writing, its
  // unsharded views (restored above) still hold the values from before the scope.
  if (write) {
    for (Unit& u : units_) {
      for (Handle& entry : u.handles) {
        if (!entry.was_unsharded) continue;
        entry.handle->reshard();
        entry.handle->unshard();
      }
    }
  }
  if (exchange_failed) std::rethrow_exception(exchange_failed);
  if (by_exception) return;  // this rank's own exception is on its way
  TORCH_CHECK(problems.empty(), kApi, ": leaving the scope of unit '", fqn_, "': nothing was written back "
              "on any rank, and the parameters are restored as they were before the scope (without sharding, "
              "as on one rank, the full parameters are the replicas themselves: in-place edits stay), "
              "because:", problems,
              "\nEdit full parameters in place, or replace them with tensors of their full shape; every rank "
              "must leave the scope the same way (an exception inside it on one rank only stops the writeback "
              "everywhere)");
}

std::vector<int64_t> unsharded_shape(torch::nn::Module& model, const at::Tensor& param) {
  const void* impl = param.unsafeGetTensorImpl();
  for (const auto& unit : distinct_units_in_tree(model)) {
    if (!unit->manages(param)) continue;
    for (const auto& h : unit->handles()) {
      for (size_t i = 0; i < h->params().size(); ++i) {
        if (h->params()[i].param.unsafeGetTensorImpl() == impl) return h->layout().entries[i].shape;
      }
    }
  }
  return param.sizes().vec();
}

std::vector<int64_t> unsharded_shape(const FSDPModule& root, const at::Tensor& param) {
  for (torch::nn::Module* module : root.modules()) {
    for (const auto& unit : distinct_units_in_tree(*module)) {
      if (unit->manages(param)) return unsharded_shape(*module, param);
    }
  }
  return param.sizes().vec();
}

}  // namespace fsdp
