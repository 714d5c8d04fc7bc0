#include "fsdp_cpp/checkpoint/optimizer_state_dict.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <sstream>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "fsdp_cpp/checkpoint/state_dict_support.h"
#include "fsdp_cpp/composable/fully_shard_internal.h"
#include "fsdp_cpp/fsdp/unit_tree.h"

namespace fsdp {
namespace {

using Dict = torch::OrderedDict<std::string, at::Tensor>;
using state_dict_detail::ExpectedValue;
using state_dict_detail::LoadGroup;

enum class Kind { kAdam, kAdamW, kSGD };

Kind kind_of(torch::optim::Optimizer& optim, const char* api) {
  if (dynamic_cast<torch::optim::AdamW*>(&optim) != nullptr) return Kind::kAdamW;
  if (dynamic_cast<torch::optim::Adam*>(&optim) != nullptr) return Kind::kAdam;
  if (dynamic_cast<torch::optim::SGD*>(&optim) != nullptr) return Kind::kSGD;
  TORCH_CHECK(false, api, ": supports torch::optim::Adam, AdamW and SGD; got another optimizer (its per-parameter "
              "state is not known to the FQN-keyed state dicts)");
}

bool has_step(Kind kind) { return kind != Kind::kSGD; }

// The hyperparameters of a group, in key order, and their shapes.
const std::vector<std::string>& hyperparameter_names(Kind kind) {
  static const std::vector<std::string> adam{"lr", "betas", "eps", "weight_decay", "amsgrad"};
  static const std::vector<std::string> sgd{"lr", "momentum", "dampening", "weight_decay", "nesterov"};
  return kind == Kind::kSGD ? sgd : adam;
}

std::vector<int64_t> hyperparameter_shape(const std::string& name) {
  return name == "betas" ? std::vector<int64_t>{2} : std::vector<int64_t>{};
}

at::Tensor scalar(double v) { return at::full({}, v, at::TensorOptions().dtype(at::kDouble)); }

template <typename Options>
at::Tensor adam_hyperparameter(const Options& o, const std::string& name) {
  if (name == "lr") return scalar(o.lr());
  if (name == "betas") return at::tensor({std::get<0>(o.betas()), std::get<1>(o.betas())}, at::kDouble);
  if (name == "eps") return scalar(o.eps());
  if (name == "weight_decay") return scalar(o.weight_decay());
  return scalar(o.amsgrad() ? 1.0 : 0.0);
}

template <typename Options>
void set_adam_hyperparameter(Options& o, const std::string& name, const at::Tensor& v) {
  const at::Tensor d = v.to(at::kDouble).cpu().reshape({-1});
  if (name == "lr") o.lr(d[0].item<double>());
  if (name == "betas") o.betas(std::make_tuple(d[0].item<double>(), d[1].item<double>()));
  if (name == "eps") o.eps(d[0].item<double>());
  if (name == "weight_decay") o.weight_decay(d[0].item<double>());
  if (name == "amsgrad") o.amsgrad(d[0].item<double>() != 0);
}

at::Tensor hyperparameter(Kind kind, const torch::optim::OptimizerOptions& options, const std::string& name) {
  switch (kind) {
    case Kind::kAdam: return adam_hyperparameter(static_cast<const torch::optim::AdamOptions&>(options), name);
    case Kind::kAdamW: return adam_hyperparameter(static_cast<const torch::optim::AdamWOptions&>(options), name);
    case Kind::kSGD: break;
  }
  const auto& o = static_cast<const torch::optim::SGDOptions&>(options);
  if (name == "lr") return scalar(o.lr());
  if (name == "momentum") return scalar(o.momentum());
  if (name == "dampening") return scalar(o.dampening());
  if (name == "weight_decay") return scalar(o.weight_decay());
  return scalar(o.nesterov() ? 1.0 : 0.0);
}

void set_hyperparameter(Kind kind, torch::optim::OptimizerOptions& options, const std::string& name,
                        const at::Tensor& value) {
  switch (kind) {
    case Kind::kAdam: return set_adam_hyperparameter(static_cast<torch::optim::AdamOptions&>(options), name, value);
    case Kind::kAdamW: return set_adam_hyperparameter(static_cast<torch::optim::AdamWOptions&>(options), name, value);
    case Kind::kSGD: break;
  }
  auto& o = static_cast<torch::optim::SGDOptions&>(options);
  const double d = value.to(at::kDouble).cpu().reshape({-1})[0].item<double>();
  if (name == "lr") o.lr(d);
  if (name == "momentum") o.momentum(d);
  if (name == "dampening") o.dampening(d);
  if (name == "weight_decay") o.weight_decay(d);
  if (name == "nesterov") o.nesterov(d != 0);
}

// The state tensors LibTorch keeps per parameter of a group with these options.
std::vector<std::string> state_names(Kind kind, const torch::optim::OptimizerOptions& options) {
  switch (kind) {
    case Kind::kAdam:
      if (static_cast<const torch::optim::AdamOptions&>(options).amsgrad()) return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
      return {"exp_avg", "exp_avg_sq"};
    case Kind::kAdamW:
      if (static_cast<const torch::optim::AdamWOptions&>(options).amsgrad()) return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
      return {"exp_avg", "exp_avg_sq"};
    case Kind::kSGD:
      if (static_cast<const torch::optim::SGDOptions&>(options).momentum() != 0) return {"momentum_buffer"};
      return {};
  }
  return {};
}

template <typename State>
at::Tensor adam_tensor(const State& s, const std::string& name) {
  if (name == "exp_avg") return s.exp_avg();
  if (name == "exp_avg_sq") return s.exp_avg_sq();
  return s.max_exp_avg_sq();
}

template <typename State>
void set_adam_tensor(State& s, const std::string& name, at::Tensor t) {
  if (name == "exp_avg") s.exp_avg(std::move(t));
  else if (name == "exp_avg_sq") s.exp_avg_sq(std::move(t));
  else s.max_exp_avg_sq(std::move(t));
}

// One parameter the optimizer holds, with its place in the model and in the optimizer.
struct Held {
  const ParameterPlacement* placement;
  size_t group;
};

// Accesses LibTorch's per-parameter state of one optimizer.
class StateAccess {
 public:
  StateAccess(torch::optim::Optimizer& optim, Kind kind) : optim_(optim), kind_(kind) {}

  torch::optim::OptimizerParamState* find(const at::Tensor& param) const {
    const auto it = optim_.state().find(param.unsafeGetTensorImpl());
    return it == optim_.state().end() ? nullptr : it->second.get();
  }

  // The named state tensor of `param`, undefined when it has none.
  at::Tensor tensor(const at::Tensor& param, const std::string& name) const {
    auto* s = find(param);
    if (s == nullptr) return {};
    switch (kind_) {
      case Kind::kAdam: return adam_tensor(static_cast<torch::optim::AdamParamState&>(*s), name);
      case Kind::kAdamW: return adam_tensor(static_cast<torch::optim::AdamWParamState&>(*s), name);
      case Kind::kSGD: return static_cast<torch::optim::SGDParamState&>(*s).momentum_buffer();
    }
    return {};
  }

  int64_t step(const at::Tensor& param) const {
    auto* s = find(param);
    if (s == nullptr) return 0;
    switch (kind_) {
      case Kind::kAdam: return static_cast<torch::optim::AdamParamState&>(*s).step();
      case Kind::kAdamW: return static_cast<torch::optim::AdamWParamState&>(*s).step();
      case Kind::kSGD: return 0;
    }
    return 0;
  }

  // The named state tensor of `param`, created (zeros of `shape`, with the state object at step 0
  // when there was none) if missing.
  at::Tensor ensure(const at::Tensor& param, const std::string& name, at::IntArrayRef shape,
                    const at::TensorOptions& options) {
    auto& slot = optim_.state()[param.unsafeGetTensorImpl()];
    if (!slot) {
      switch (kind_) {
        case Kind::kAdam: slot = std::make_unique<torch::optim::AdamParamState>(); break;
        case Kind::kAdamW: slot = std::make_unique<torch::optim::AdamWParamState>(); break;
        case Kind::kSGD: slot = std::make_unique<torch::optim::SGDParamState>(); break;
      }
    }
    at::Tensor t = tensor(param, name);
    if (t.defined()) return t;
    t = at::zeros(shape, options);
    switch (kind_) {
      case Kind::kAdam: set_adam_tensor(static_cast<torch::optim::AdamParamState&>(*slot), name, t); break;
      case Kind::kAdamW: set_adam_tensor(static_cast<torch::optim::AdamWParamState&>(*slot), name, t); break;
      case Kind::kSGD: static_cast<torch::optim::SGDParamState&>(*slot).momentum_buffer(t); break;
    }
    return t;
  }

  void set_step(const at::Tensor& param, int64_t step) {
    auto& slot = optim_.state()[param.unsafeGetTensorImpl()];
    if (!slot) slot = kind_ == Kind::kAdam ? std::unique_ptr<torch::optim::OptimizerParamState>(
                                                 std::make_unique<torch::optim::AdamParamState>())
                                           : std::make_unique<torch::optim::AdamWParamState>();
    if (kind_ == Kind::kAdam) static_cast<torch::optim::AdamParamState&>(*slot).step(step);
    if (kind_ == Kind::kAdamW) static_cast<torch::optim::AdamWParamState&>(*slot).step(step);
  }

 private:
  torch::optim::Optimizer& optim_;
  Kind kind_;
};

// The parameters of `root`'s model that `optim` holds, in named_parameters order (every FQN).
std::vector<Held> held_parameters(const std::vector<ParameterPlacement>& placements, torch::optim::Optimizer& optim) {
  std::unordered_map<const void*, size_t> group_of;
  for (size_t g = 0; g < optim.param_groups().size(); ++g) {
    for (const auto& p : optim.param_groups()[g].params()) group_of.emplace(p.unsafeGetTensorImpl(), g);
  }
  std::vector<Held> held;
  for (const auto& p : placements) {
    const auto it = group_of.find(p.param.unsafeGetTensorImpl());
    if (it != group_of.end()) held.push_back({&p, it->second});
  }
  return held;
}

// The shape and options of a parameter's state tensors while sharded.
std::vector<int64_t> state_shape(const ParameterPlacement& p) {
  return p.sliced ? std::vector<int64_t>{p.local_numel} : p.piece_shape;
}

at::TensorOptions state_options(const ParameterPlacement& p) {
  return p.handle != nullptr ? p.handle->local_shard().options() : p.param.options();
}

std::string state_key(const std::string& fqn, const std::string& name) { return "state." + fqn + "." + name; }
std::string group_key(const std::string& fqn, const std::string& name) { return "param_groups." + fqn + "." + name; }

// A hyperparameter's value: "0.01", or "[0.9, 0.999]".
std::string describe(const at::Tensor& t) {
  const at::Tensor d = t.to(at::kDouble).cpu().reshape({-1});
  std::ostringstream out;
  if (t.dim() == 0) {
    out << d[0].item<double>();
    return out.str();
  }
  out << "[";
  for (int64_t i = 0; i < d.numel(); ++i) out << (i ? ", " : "") << d[i].item<double>();
  out << "]";
  return out.str();
}

// Every parameter of a group must carry the group's hyperparameters; amsgrad (which decides the
// state tensors) cannot change. `lookup` gives a key's value in the dict being loaded.
std::string check_hyperparameters(Kind kind, torch::optim::Optimizer& optim, const std::vector<Held>& held,
                                  const std::function<at::Tensor(const std::string&)>& lookup) {
  std::map<size_t, const Held*> first_of_group;
  for (const auto& h : held) {
    first_of_group.emplace(h.group, &h);
    const Held& first = *first_of_group.at(h.group);
    for (const auto& name : hyperparameter_names(kind)) {
      const std::string key = group_key(h.placement->fqn, name);
      const at::Tensor value = lookup(key).to(at::kDouble).cpu();
      if (&first != &h) {
        const std::string first_key = group_key(first.placement->fqn, name);
        const at::Tensor first_value = lookup(first_key).to(at::kDouble).cpu();
        if (!at::equal(value, first_value)) {
          return "'" + key + "' is " + describe(value) + " but '" + first_key + "' is " + describe(first_value) +
                 ", and both parameters are in optimizer parameter group " + std::to_string(h.group) +
                 " (the parameters of a group share its hyperparameters)";
        }
      }
      if (name == "amsgrad") {
        const at::Tensor current = hyperparameter(kind, optim.param_groups()[h.group].options(), name);
        if (!at::equal(value.reshape({}), current)) {
          return "'" + key + "' is " + describe(value) + " but the optimizer's group " + std::to_string(h.group) +
                 " has amsgrad " + describe(current) + " (amsgrad decides the state tensors: build the optimizer "
                 "with the checkpoint's amsgrad)";
        }
      }
    }
  }
  return {};
}

}  // namespace

ShardedStateDict sharded_optimizer_state_dict(const FSDPModule& root, torch::optim::Optimizer& optim) {
  constexpr const char* api = "fsdp::sharded_optimizer_state_dict";
  const Kind kind = kind_of(optim, api);
  const auto placements = parameter_placements(root);
  const auto held = held_parameters(placements, optim);
  const StateAccess access(optim, kind);
  const bool writer = writes_replicated(root);
  // A tied parameter's FQNs share one fresh tensor per state name.
  std::map<std::pair<const void*, std::string>, at::Tensor> fresh;
  ShardedStateDict state;
  for (const auto& h : held) {
    const ParameterPlacement& p = *h.placement;
    if (has_step(kind)) {
      state.emplace_back(state_key(p.fqn, "step"),
                         LocalShard{at::full({1}, static_cast<double>(access.step(p.param)), at::kFloat), {}, 0,
                                    p.unit ? writes_replicated(root, *p.unit) : writer});
    }
    for (const auto& name : state_names(kind, optim.param_groups()[h.group].options())) {
      at::Tensor t = access.tensor(p.param, name);
      at::Tensor local;
      if (t.defined()) {
        TORCH_CHECK(t.numel() == p.local_numel && t.is_contiguous(), api, ": the optimizer state '", name,
                    "' of parameter '", p.fqn, "' has shape ", t.sizes(), " but this rank holds ", p.local_numel,
                    " elements of the parameter (shape ", at::IntArrayRef(state_shape(p)),
                    "); was the optimizer stepped while the model was unsharded, or built before fully_shard "
                    "over other tensors?");
        local = t.view({-1});
      } else {
        auto& f = fresh[{p.param.unsafeGetTensorImpl(), name}];
        if (!f.defined()) f = at::zeros({p.local_numel}, state_options(p));
        local = f;
      }
      state.emplace_back(state_key(p.fqn, name), LocalShard{local, p.global_shape, p.flat_offset, p.write, p.piece()});
    }
  }
  for (const auto& h : held) {
    for (const auto& name : hyperparameter_names(kind)) {
      const at::Tensor value = hyperparameter(kind, optim.param_groups()[h.group].options(), name);
      state.emplace_back(group_key(h.placement->fqn, name),
                         LocalShard{value.reshape({-1}), hyperparameter_shape(name), 0,
                                    h.placement->unit ? writes_replicated(root, *h.placement->unit) : writer});
    }
  }
  return state;
}

void load_sharded_optimizer_state_dict(const FSDPModule& root, torch::optim::Optimizer& optim,
                                       const ShardedStateDict& state) {
  constexpr const char* api = "fsdp::load_sharded_optimizer_state_dict";
  const Kind kind = kind_of(optim, api);
  const auto placements = parameter_placements(root);
  const auto held = held_parameters(placements, optim);
  std::unordered_map<std::string, const LocalShard*> by_key;
  for (const auto& [key, shard] : state) {
    TORCH_CHECK(by_key.emplace(key, &shard).second, api, ": key '", key, "' appears twice in the state dict");
  }

  // Validate everything first.
  struct Expected {
    std::string key;
    std::vector<int64_t> global_shape;
    int64_t local_numel;
  };
  std::vector<Expected> expected;
  for (const auto& h : held) {
    const ParameterPlacement& p = *h.placement;
    if (has_step(kind)) expected.push_back({state_key(p.fqn, "step"), {}, 1});
    for (const auto& name : state_names(kind, optim.param_groups()[h.group].options())) {
      expected.push_back({state_key(p.fqn, name), p.global_shape, p.local_numel});
    }
  }
  for (const auto& h : held) {
    for (const auto& name : hyperparameter_names(kind)) {
      const auto shape = hyperparameter_shape(name);
      expected.push_back({group_key(h.placement->fqn, name), shape, name == "betas" ? 2 : 1});
    }
  }
  std::vector<std::string> missing, problems;
  std::unordered_set<std::string> known;
  for (const auto& e : expected) {
    known.insert(e.key);
    const auto it = by_key.find(e.key);
    if (it == by_key.end()) {
      missing.push_back("'" + e.key + "'");
      continue;
    }
    const LocalShard& s = *it->second;
    std::ostringstream problem;
    if (!s.local.defined()) {
      problem << "'" << e.key << "' has no local tensor";
    } else if (s.global_shape != e.global_shape || s.local.numel() != e.local_numel) {
      problem << "'" << e.key << "' has global shape " << at::IntArrayRef(s.global_shape) << " and "
              << s.local.numel() << " local elements but this rank's optimizer state has global shape "
              << at::IntArrayRef(e.global_shape) << " and " << e.local_numel << " local elements";
    }
    if (!problem.str().empty()) problems.push_back(problem.str());
  }
  std::vector<std::string> unexpected;
  for (const auto& [key, shard] : state) {
    if (!known.count(key)) unexpected.push_back("'" + key + "'");
  }
  std::string message;
  auto add = [&](const std::string& part) { message += (message.empty() ? "" : "; ") + part; };
  auto join = [](const std::vector<std::string>& keys) {
    std::string out;
    for (size_t i = 0; i < keys.size(); ++i) out += (i ? ", " : "") + keys[i];
    return out;
  };
  auto count = [](size_t n) { return std::to_string(n) + (n == 1 ? " key " : " keys "); };
  if (!missing.empty()) add("missing " + count(missing.size()) + join(missing));
  if (!unexpected.empty()) add("unexpected " + count(unexpected.size()) + join(unexpected) + " (not in the model's optimizer)");
  for (const auto& p : problems) add(p);
  if (message.empty()) {
    message = check_hyperparameters(kind, optim, held, [&](const std::string& key) {
      const LocalShard& s = *by_key.at(key);
      return s.local.reshape(s.global_shape);
    });
  }
  TORCH_CHECK(message.empty(), api, ": ", message, ". Nothing was loaded");

  // Then modify.
  c10::NoGradGuard no_grad;
  StateAccess access(optim, kind);
  std::unordered_set<const void*> loaded;
  for (const auto& h : held) {
    const ParameterPlacement& p = *h.placement;
    if (!loaded.insert(p.param.unsafeGetTensorImpl()).second) continue;  // a tied parameter's second FQN
    for (const auto& name : state_names(kind, optim.param_groups()[h.group].options())) {
      const at::Tensor& local = by_key.at(state_key(p.fqn, name))->local;
      at::Tensor live = access.ensure(p.param, name, state_shape(p), state_options(p)).view({-1});
      const bool same = live.numel() == 0 || (live.data_ptr() == local.data_ptr() && local.is_contiguous());
      if (!same) live.copy_(local);
    }
    if (has_step(kind)) {
      const double step = by_key.at(state_key(p.fqn, "step"))->local.to(at::kDouble).item<double>();
      access.set_step(p.param, static_cast<int64_t>(std::llround(step)));
    }
  }
  std::unordered_set<size_t> groups_done;
  for (const auto& h : held) {
    if (!groups_done.insert(h.group).second) continue;
    for (const auto& name : hyperparameter_names(kind)) {
      set_hyperparameter(kind, optim.param_groups()[h.group].options(), name,
                         by_key.at(group_key(h.placement->fqn, name))->local);
    }
  }
}

torch::OrderedDict<std::string, at::Tensor> full_optimizer_state_dict(const FSDPModule& root,
                                                                      torch::optim::Optimizer& optim,
                                                                      const FullStateDictOptions& options) {
  constexpr const char* api = "fsdp::full_optimizer_state_dict";
  const Kind kind = kind_of(optim, api);
  const auto placements = parameter_placements(root);
  const auto held = held_parameters(placements, optim);
  const StateAccess access(optim, kind);
  const auto& root_config = detail::state_of(root).config();
  const bool keep = !options.rank0_only() || writes_replicated(root);
  auto finish = [&](at::Tensor t) { return options.offload_to_cpu() ? t.cpu().clone() : t.clone(); };
  // A tensor-parallel parameter's state is gathered over its TP group on every rank of it.
  auto global_of = [](const ParameterPlacement& p, const at::Tensor& piece) {
    return p.tp ? gather_global(piece, *p.tp) : piece;
  };
  c10::NoGradGuard no_grad;

  // Full values per (parameter, state name).
  std::map<std::pair<const void*, std::string>, at::Tensor> values;
  std::unordered_map<const FlatParamHandle*, std::vector<const Held*>> held_by_handle;
  std::vector<const FlatParamHandle*> handle_order;
  for (const auto& h : held) {
    const ParameterPlacement& p = *h.placement;
    if (p.alias) continue;
    if (p.handle == nullptr || !p.sliced) {
      for (const auto& name : state_names(kind, optim.param_groups()[h.group].options())) {
        const at::Tensor t = access.tensor(p.param, name);
        const bool keep_here = p.unit ? !options.rank0_only() || writes_replicated(root, *p.unit) : keep;
        if (!keep_here && !p.tp) continue;
        // In the parameter's dtype (the top of optimizer_state_dict.h), as the sharded handles'
        // shards below are assembled: bfloat16 moments (fsdp::optim's FlatAdamOptions) give the
        // same full dict on one rank as on several.
        const at::Tensor full = global_of(p, t.defined() ? t.reshape(p.piece_shape).to(state_options(p).dtype())
                                                         : at::zeros(p.piece_shape, state_options(p)));
        if (keep_here) values[{p.param.unsafeGetTensorImpl(), name}] = finish(full);
      }
      continue;
    }
    auto& list = held_by_handle[p.handle];
    if (list.empty()) handle_order.push_back(p.handle);
    list.push_back(&h);
  }
  // Sharded handles: per state name, this rank's flat shard, all-gathered; in the order of the
  // model's units (the same on every rank).
  for (const auto& unit : distinct_units_in_tree(root.module())) {
    for (const auto& handle_ptr : unit->handles()) {
      const FlatParamHandle* handle = handle_ptr.get();
      const auto it = held_by_handle.find(handle);
      if (it == held_by_handle.end()) continue;
      const auto& comm = unit->config().comm;
      std::vector<std::string> names;
      for (const Held* h : it->second) {
        for (const auto& name : state_names(kind, optim.param_groups()[h->group].options())) {
          if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
        }
      }
      const FlatParamLayout& layout = handle->layout();
      for (const auto& name : names) {
        at::Tensor shard = at::zeros({layout.shard_numel()}, handle->local_shard().options().device(comm->device()));
        for (const Held* h : it->second) {
          const at::Tensor t = access.tensor(h->placement->param, name);
          if (t.defined() && h->placement->local_numel > 0) {
            shard.narrow(0, h->placement->slice.shard_offset, h->placement->local_numel).copy_(t.reshape({-1}));
          }
        }
        at::Tensor full = at::empty({layout.padded_numel}, shard.options());
        comm->all_gather_into_tensor(full, shard, "optimizer_state_dict").wait();
        const bool keep_unit = !options.rank0_only() || writes_replicated(root, *unit);
        for (const Held* h : it->second) {
          if (!keep_unit && !h->placement->tp) continue;
          const auto& e = layout.entries[h->placement->entry];
          const at::Tensor value = global_of(*h->placement, full.narrow(0, e.offset, e.numel).view(e.shape));
          if (keep_unit) values[{h->placement->param.unsafeGetTensorImpl(), name}] = finish(value);
        }
      }
    }
  }
  // Steps: the largest over the ranks (a rank that holds none of a parameter may never step it).
  at::Tensor steps;
  if (has_step(kind) && !held.empty()) {
    std::vector<double> local;
    for (const auto& h : held) local.push_back(static_cast<double>(access.step(h.placement->param)));
    steps = at::tensor(local, at::kDouble).to(root_config.comm->device());
    root_config.comm->all_reduce(steps, c10d::ReduceOp::MAX, "optimizer_state_dict").wait();
    if (root_config.replicate) root_config.replicate->all_reduce(steps, c10d::ReduceOp::MAX).wait();
    if (const auto tp = tensor_parallel_group(root.module())) tp->all_reduce(steps, c10d::ReduceOp::MAX).wait();
    steps = steps.cpu();
  }
  // What this rank keeps: with rank0_only the root's writer, and for experts on a subset of the
  // root's ranks each one's own first rank ([Note: units on a subset of the root's ranks]).
  auto kept = [&](const ParameterPlacement& p) {
    return p.unit ? !options.rank0_only() || writes_replicated(root, *p.unit) : keep;
  };
  Dict state;
  for (size_t i = 0; i < held.size(); ++i) {
    const ParameterPlacement& p = *held[i].placement;
    if (!kept(p)) continue;
    if (has_step(kind)) state.insert(state_key(p.fqn, "step"), steps[static_cast<int64_t>(i)].to(at::kFloat).clone());
    for (const auto& name : state_names(kind, optim.param_groups()[held[i].group].options())) {
      state.insert(state_key(p.fqn, name), values.at({p.param.unsafeGetTensorImpl(), name}));
    }
  }
  for (const auto& h : held) {
    if (!kept(*h.placement)) continue;
    for (const auto& name : hyperparameter_names(kind)) {
      state.insert(group_key(h.placement->fqn, name), hyperparameter(kind, optim.param_groups()[h.group].options(), name));
    }
  }
  return state;
}

void load_full_optimizer_state_dict(const FSDPModule& root, torch::optim::Optimizer& optim,
                                    const torch::OrderedDict<std::string, at::Tensor>& state,
                                    const LoadFullStateDictOptions& options) {
  constexpr const char* api = "fsdp::load_full_optimizer_state_dict";
  const Kind kind = kind_of(optim, api);
  const auto placements = parameter_placements(root);
  const auto held = held_parameters(placements, optim);
  auto access = std::make_shared<StateAccess>(optim, kind);
  std::vector<LoadGroup> groups;
  std::vector<ExpectedValue> also_expected;
  std::map<std::pair<const FlatParamHandle*, std::string>, size_t> group_of;  // (handle, state name)
  std::unordered_set<size_t> optimizer_groups_done;
  for (const auto& h : held) {
    const ParameterPlacement& p = *h.placement;
    const auto dtype = state_options(p).dtype().toScalarType();
    const auto names = state_names(kind, optim.param_groups()[h.group].options());
    if (p.alias) {
      if (has_step(kind)) also_expected.push_back({state_key(p.fqn, "step"), {}, at::kFloat});
      for (const auto& name : names) also_expected.push_back({state_key(p.fqn, name), p.global_shape, dtype});
      for (const auto& name : hyperparameter_names(kind)) {
        also_expected.push_back({group_key(p.fqn, name), hyperparameter_shape(name), at::kDouble});
      }
      continue;
    }
    const at::Tensor param = p.param;
    const auto shape = state_shape(p);
    const auto tensor_options = state_options(p);
    if (has_step(kind)) {
      LoadGroup g;
      g.values.push_back({state_key(p.fqn, "step"), {}, at::kFloat});
      g.sink = [access, param](size_t, const at::Tensor& v) {
        access->set_step(param, static_cast<int64_t>(std::llround(v.to(at::kDouble).cpu().item<double>())));
      };
      groups.push_back(std::move(g));
    }
    for (const auto& name : names) {
      ExpectedValue value{state_key(p.fqn, name), p.global_shape, dtype, p.tp};
      if (p.handle == nullptr || !p.sliced) {
        LoadGroup g;
        g.values.push_back(std::move(value));
        g.sink = [access, param, name, shape, tensor_options](size_t, const at::Tensor& v) {
          access->ensure(param, name, shape, tensor_options).copy_(v.reshape(shape));
        };
        groups.push_back(std::move(g));
        continue;
      }
      auto [it, inserted] = group_of.emplace(std::make_pair(p.handle, name), groups.size());
      if (inserted) {
        LoadGroup g;
        g.handle = p.handle;
        g.comm = p.unit->config().comm;
        groups.push_back(std::move(g));
      }
      LoadGroup& g = groups[it->second];
      g.entries.push_back(p.entry);
      g.values.push_back(std::move(value));
    }
    // Hyperparameters: loaded from the group's first parameter, checked for all.
    const bool first_of_group = optimizer_groups_done.insert(h.group).second;
    for (const auto& name : hyperparameter_names(kind)) {
      ExpectedValue value{group_key(p.fqn, name), hyperparameter_shape(name), at::kDouble};
      if (!first_of_group) {
        also_expected.push_back(std::move(value));
        continue;
      }
      LoadGroup g;
      g.values.push_back(std::move(value));
      const size_t group_index = h.group;
      g.sink = [&optim, kind, group_index, name](size_t, const at::Tensor& v) {
        set_hyperparameter(kind, optim.param_groups()[group_index].options(), name, v);
      };
      groups.push_back(std::move(g));
    }
  }
  // Sinks of FlatParameter groups: each slice into its parameter's (maybe new) state tensor.
  std::unordered_map<const void*, const ParameterPlacement*> placement_of;
  for (const auto& h : held) {
    if (!h.placement->alias) placement_of[h.placement->param.unsafeGetTensorImpl()] = h.placement;
  }
  for (const auto& [handle_and_name, index] : group_of) {
    LoadGroup& g = groups[index];
    std::vector<const ParameterPlacement*> targets;
    for (const int entry : g.entries) {
      targets.push_back(placement_of.at(g.handle->params()[entry].param.unsafeGetTensorImpl()));
    }
    const std::string name = handle_and_name.second;
    g.sink = [access, targets, name](size_t i, const at::Tensor& elements) {
      const ParameterPlacement& p = *targets[i];
      access->ensure(p.param, name, state_shape(p), state_options(p)).view({-1}).copy_(elements);
    };
  }
  const auto extra_check = [&](const Dict& dict) {
    return check_hyperparameters(kind, optim, held, [&](const std::string& key) { return *dict.find(key); });
  };
  // The key order of full_optimizer_state_dict.
  std::vector<std::string> key_order;
  for (const auto& h : held) {
    if (has_step(kind)) key_order.push_back(state_key(h.placement->fqn, "step"));
    for (const auto& name : state_names(kind, optim.param_groups()[h.group].options())) {
      key_order.push_back(state_key(h.placement->fqn, name));
    }
  }
  for (const auto& h : held) {
    for (const auto& name : hyperparameter_names(kind)) key_order.push_back(group_key(h.placement->fqn, name));
  }
  state_dict_detail::load_full_groups(root, api, groups, also_expected, state, options, key_order, extra_check);
}

}  // namespace fsdp
