#include "fsdp_cpp/fsdp/tied_parameters.h"

#include <algorithm>
#include <map>

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include "fsdp_cpp/contract/module_fqn.h"
#include "fsdp_cpp/contract/module_state.h"
#include "fsdp_cpp/fsdp/fsdp_state.h"
#include "fsdp_cpp/fsdp/root_context.h"

namespace fsdp {
namespace {

// Whether the module at `fqn` is `ancestor_fqn` or inside it.
bool within(const std::string& fqn, const std::string& ancestor_fqn) {
  if (ancestor_fqn.empty()) return true;
  return fqn == ancestor_fqn ||
         (fqn.size() > ancestor_fqn.size() && fqn.compare(0, ancestor_fqn.size(), ancestor_fqn) == 0 &&
          fqn[ancestor_fqn.size()] == '.');
}

// One module of a unit's trees, with its FQN: relative to the unit's module, prefixed by "<i>:"
// for the i-th module of a unit of several siblings (as the unit's parameter FQNs are).
struct TreeModule {
  std::string fqn;
  torch::nn::Module* module;
};

std::vector<TreeModule> tree_modules(const std::vector<torch::nn::Module*>& roots) {
  std::vector<TreeModule> modules;
  for (size_t i = 0; i < roots.size(); ++i) {
    const std::string prefix = roots.size() > 1 ? std::to_string(i) + ":" : "";
    modules.push_back({prefix, roots[i]});
    for (const auto& item : roots[i]->named_modules("", /*include_self=*/false)) {
      modules.push_back({prefix + item.key(), item.value().get()});
    }
  }
  return modules;
}

std::string display(const std::string& fqn) { return contract::display_fqn(fqn); }

// The modules of a unit's trees, and, per parameter (TensorImpl*), the modules registering it.
struct UnitTrees {
  std::vector<TreeModule> modules;
  std::unordered_set<const torch::nn::Module*> contains;
  std::unordered_map<const void*, std::vector<const TreeModule*>> registrants;

  explicit UnitTrees(const std::vector<torch::nn::Module*>& roots) : modules(tree_modules(roots)) {
    for (const auto& m : modules) {
      contains.insert(m.module);
      for (const auto& p : m.module->named_parameters(/*recurse=*/false)) {
        registrants[p.value().unsafeGetTensorImpl()].push_back(&m);
      }
    }
  }
  const std::vector<const TreeModule*>& registrants_of(const void* impl) const {
    static const std::vector<const TreeModule*> none;
    const auto it = registrants.find(impl);
    return it == registrants.end() ? none : it->second;
  }
};

// Every live unit (distinct states) and the parameters each manages.
std::unordered_map<const void*, std::shared_ptr<FSDPState>> managing_units() {
  auto& registry = contract::ModuleStateRegistry::global();
  std::unordered_map<const void*, std::shared_ptr<FSDPState>> owners;
  for (const auto& module : registry.modules_with(kFullyShardApi)) {
    auto state = registry.get_as<FSDPState>(*module, kFullyShardApi);
    if (!state) continue;
    for (const auto& p : state->params()) owners.emplace(p.param.unsafeGetTensorImpl(), state);
  }
  return owners;
}

// `handle`'s gradients as one padded flat tensor of full gradients (zeros where a parameter holds
// none): this rank's sharded gradients put in place, all-gathered when sharded (collective).
at::Tensor gather_gradients(const FlatParamHandle& handle, const FSDPConfig& config) {
  comm::Communicator& comm = *config.comm;
  const bool sharded = handle.is_sharded_strategy();
  const int rank = sharded ? comm.rank() : 0;
  const auto& layout = handle.layout();
  at::Tensor shard = at::zeros({layout.shard_numel()}, handle.local_shard().options());
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < handle.params().size(); ++i) {
    const at::Tensor& g = handle.params()[i].param.grad();
    const auto s = layout.slice_of(static_cast<int>(i), rank);
    if (g.defined() && s.size() > 0) shard.narrow(0, s.shard_offset, s.size()).copy_(g.reshape({-1}));
  }
  if (!sharded) return shard;
  const at::Device device = config.device;
  at::Tensor source = shard.to(device);
  at::Tensor full = at::empty({layout.padded_numel}, source.options());
  comm.all_gather_into_tensor(full, source, handle.unit_fqn() + " (tied parameter moving out)").wait();
  return full.to(shard.device());
}

// Which of `handle`'s parameters hold a gradient on some rank of the handle's group. Each rank's
// `.grad` is its own (set by the user, or left from a backward on some ranks only), while the
// gradients are gathered in one collective that every rank must issue or none: the ranks agree
// first (an all-reduce, issued by every rank whenever the gradients would be all-gathered), and
// every rank then holds the same full gradients (zeros in the slices of ranks that held none).
std::vector<bool> grads_on_some_rank(const FlatParamHandle& handle, const FSDPConfig& config) {
  const auto& params = handle.params();
  std::vector<bool> has(params.size(), false);
  for (size_t i = 0; i < params.size(); ++i) has[i] = params[i].param.grad().defined();
  if (!handle.is_sharded_strategy()) return has;  // nothing gathered: no collective to match
  at::Tensor flags = at::zeros({static_cast<int64_t>(params.size())}, at::TensorOptions().dtype(at::kInt));
  for (size_t i = 0; i < params.size(); ++i) flags[static_cast<int64_t>(i)] = has[i] ? 1 : 0;
  at::Tensor agreed = flags.to(config.comm->device());
  config.comm->all_reduce(agreed, c10d::ReduceOp::MAX, handle.unit_fqn() + " (tied parameter gradients)").wait();
  agreed = agreed.cpu();
  for (size_t i = 0; i < params.size(); ++i) has[i] = agreed[static_cast<int64_t>(i)].item<int>() != 0;
  return has;
}

}  // namespace

TiedParameterPlan plan_tied_parameters(const std::vector<torch::nn::Module*>& modules,
                                       const std::string& unit_fqn) {
  TiedParameterPlan plan;
  const auto owners = managing_units();
  if (owners.empty()) return plan;
  const UnitTrees mine(modules);
  std::map<const FSDPState*, std::unique_ptr<UnitTrees>> theirs;
  std::unordered_set<const void*> decided;
  for (const auto& m : mine.modules) {
    for (const auto& item : m.module->named_parameters(/*recurse=*/false)) {
      const void* impl = item.value().unsafeGetTensorImpl();
      if (!decided.insert(impl).second) continue;
      const auto owner_it = owners.find(impl);
      if (owner_it == owners.end()) continue;  // nobody manages it yet: this unit takes it
      const std::shared_ptr<FSDPState>& owner = owner_it->second;
      auto& owner_trees = theirs[owner.get()];
      if (!owner_trees) owner_trees = std::make_unique<UnitTrees>(owner->modules());
      const auto& here = mine.registrants_of(impl);
      const auto& there = owner_trees->registrants_of(impl);
      const bool owner_contains_mine = std::all_of(here.begin(), here.end(), [&](const TreeModule* r) {
        return owner_trees->contains.count(r->module) > 0;
      });
      const bool mine_contains_owners = std::all_of(there.begin(), there.end(), [&](const TreeModule* r) {
        return mine.contains.count(r->module) > 0;
      });
      // The owner is the innermost unit containing every registrant so far, or only a unit around
      // both this one and the owner can own it: it stays.
      if (owner_contains_mine || !mine_contains_owners) {
        plan.stay.insert(impl);
        continue;
      }
      const std::string name = contract::join_fqn(m.fqn, item.key());
      std::string users;
      for (const TreeModule* r : here) users += (users.empty() ? "'" : ", '") + display(r->fqn) + "'";
      // The unit giving the parameter up, by its FQN in this unit's trees where it is inside them.
      std::string from = owner->fqn();
      for (const auto& t : mine.modules) {
        if (t.module == &owner->module()) {
          from = "'" + display(t.fqn) + "'";
          break;
        }
      }
      bool unsharded = owner->unshard_in_flight();
      for (const auto& h : owner->handles()) unsharded |= h->is_unsharded();
      TORCH_CHECK(owner->root_context() == nullptr && owner->training_state() == TrainingState::kIdle,
                  "fully_shard: module ", unit_fqn, " is the innermost unit containing every module "
                  "that uses parameter '", name, "' (", users, "), so the parameter must move into it "
                  "from unit ", from, ", which already ran forward. Apply fully_shard to every "
                  "module, the one containing all modules that use a shared parameter last, before "
                  "the first forward.");
      TORCH_CHECK(!unsharded, "fully_shard: module ", unit_fqn, " is the innermost unit containing "
                  "every module that uses parameter '", name, "' (", users, "), so the parameter must "
                  "move into it from unit ", from, ", which is unsharded. Call reshard() on "
                  "that unit before this fully_shard.");
      for (const auto& h : owner->handles()) {
        TORCH_CHECK(h->accumulated_grad_bytes() == 0, "fully_shard: module ", unit_fqn,
                    " must take parameter '", name, "' over from unit ", from,
                    ", which holds gradients accumulated without sync; finish the accumulation "
                    "(a backward with sync) before this fully_shard.");
        for (const auto& p : h->params()) {
          const at::Tensor& g = p.param.grad();
          TORCH_CHECK(!g.defined() || g.sizes() == p.param.sizes(), "fully_shard: module ", unit_fqn,
                      " must take parameter '", name, "' over from unit ", from,
                      ", whose parameter '", p.fqn, "' has a gradient of shape ", g.sizes(),
                      "; expected this rank's shard of it, of shape ", p.param.sizes());
        }
      }
      plan.moves.push_back({impl, owner});
    }
  }
  return plan;
}

void take_tied_parameters(const TiedParameterPlan& plan) {
  // The units parameters leave, in the order of their first move (the same on every rank: the
  // all-gathers below pair up across ranks).
  std::vector<std::shared_ptr<FSDPState>> sources;
  std::unordered_set<const void*> moving;
  for (const auto& move : plan.moves) {
    moving.insert(move.param);
    if (std::find(sources.begin(), sources.end(), move.from) == sources.end()) sources.push_back(move.from);
  }
  for (const auto& unit : sources) {
    struct Full {
      at::Tensor value;
      at::Tensor grad;
    };
    std::unordered_map<const void*, Full> full;
    for (const auto& h : unit->handles()) {
      // Full precision: the shards, never the unsharded (param_dtype) buffer.
      const at::Tensor flat = h->gather_full_precision();
      const std::vector<bool> has_grad = grads_on_some_rank(*h, unit->config());
      const bool any_grad = std::find(has_grad.begin(), has_grad.end(), true) != has_grad.end();
      const at::Tensor flat_grad = any_grad ? gather_gradients(*h, unit->config()) : at::Tensor();
      for (size_t i = 0; i < h->params().size(); ++i) {
        const auto& e = h->layout().entries[i];
        const at::Tensor& param = h->params()[i].param;
        Full f;
        f.value = flat.narrow(0, e.offset, e.numel).view(e.shape).clone();
        if (has_grad[i]) f.grad = flat_grad.narrow(0, e.offset, e.numel).view(e.shape).clone();
        full.emplace(param.unsafeGetTensorImpl(), std::move(f));
      }
    }
    std::vector<FlatParamHandle::OrigParam> keep;
    for (const auto& p : unit->params()) {
      Full& f = full.at(p.param.unsafeGetTensorImpl());
      {
        c10::NoGradGuard no_grad;
        p.param.set_data(f.value);
      }
      p.param.mutable_grad() = f.grad;
      if (!moving.count(p.param.unsafeGetTensorImpl())) keep.push_back(p);
    }
    unit->rebuild_handles(keep);
  }
}

void place_tied_parameters(RootContext& context, const UnitModuleFqns& unit_fqns) {
  auto& registry = contract::ModuleStateRegistry::global();
  torch::nn::Module& root = context.root()->module();
  const std::string root_name = registry.describe(root);
  auto fail = [&](const std::string& message) {
    // Lazy initialisation fails as a whole: the next forward initialises (and checks) again.
    for (FSDPState* unit : context.states()) unit->set_root_context(nullptr);
    TORCH_CHECK(false, message);
  };
  std::unordered_map<const void*, FSDPState*> owner;
  for (FSDPState* unit : context.states()) {
    for (const auto& p : unit->params()) owner[p.param.unsafeGetTensorImpl()] = unit;
  }
  struct Use {
    std::string module_fqn;
    const torch::nn::Module* module;
    std::string param_fqn;
  };
  std::vector<const void*> order;
  std::unordered_map<const void*, std::vector<Use>> uses;
  std::unordered_set<const torch::nn::Module*> in_tree;
  for (const auto& item : root.named_modules("", /*include_self=*/true)) {
    in_tree.insert(item.value().get());
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false)) {
      const void* impl = p.value().unsafeGetTensorImpl();
      auto& u = uses[impl];
      if (u.empty()) order.push_back(impl);
      u.push_back({item.key(), item.value().get(), contract::join_fqn(item.key(), p.key())});
    }
  }
  // A parameter of this tree shared with a module of another unit's tree outside it.
  auto refuse_shared = [&](const Use& here, const std::string& there_fqn, const std::string& there_param,
                           const std::string& there_unit) {
    const std::string here_desc =
        here.module_fqn.empty() ? "unit " + root_name
                                : "module '" + here.module_fqn + "' in the tree of the root unit " + root_name;
    const std::string there_desc =
        there_fqn.empty() ? "unit " + there_unit : "module '" + there_fqn + "' of unit " + there_unit;
    fail("fully_shard: parameter '" + here.param_fqn + "' of " + here_desc + " is also registered, as '" +
         there_param + "', by " + there_desc + ", outside that tree: no unit contains every module "
         "using the parameter, so one of them would compute on it while the other has resharded it. "
         "Apply fully_shard to a module that contains both " + root_name + " and " + there_unit +
         " (e.g. their common parent, the model), after fully_shard on them: the parameter then "
         "moves into that unit.");
  };
  std::unordered_map<const void*, std::shared_ptr<FSDPState>> all_owners;  // filled when needed
  for (const void* impl : order) {
    const auto& u = uses.at(impl);
    const auto it = owner.find(impl);
    if (it == owner.end()) {
      if (all_owners.empty()) all_owners = managing_units();
      const auto outside = all_owners.find(impl);
      if (outside == all_owners.end()) continue;  // managed by no unit (registered after fully_shard)
      const FSDPState& unit = *outside->second;
      std::string there_fqn, there_param = "?";
      for (const auto& m : tree_modules(unit.modules())) {
        for (const auto& p : m.module->named_parameters(/*recurse=*/false)) {
          if (p.value().unsafeGetTensorImpl() == impl && there_param == "?") {
            there_fqn = m.fqn;
            there_param = contract::join_fqn(m.fqn, p.key());
          }
        }
      }
      refuse_shared(u.front(), there_fqn, there_param, registry.describe(unit.module()));
    }
    FSDPState* unit = it->second;
    for (const auto& use : u) {
      const auto& names = unit_fqns.at(unit);
      const bool contained = std::any_of(names.begin(), names.end(),
                                         [&](const std::string& m) { return within(use.module_fqn, m); });
      if (contained) continue;
      std::string users;
      for (const auto& other : u) users += (users.empty() ? "'" : ", '") + display(other.module_fqn) + "'";
      fail("fully_shard: parameter '" + u.front().param_fqn + "' is used by modules " + users +
           " in the tree of the root unit " + root_name + ", but managed by unit '" + unit->fqn() +
           "', which does not contain '" + display(use.module_fqn) + "': one of them would compute "
           "on it while the other has resharded it. Apply fully_shard to a module that contains all "
           "of them (e.g. their common parent), after fully_shard on the units inside it, and "
           "register shared parameters before fully_shard: the parameter then moves into that "
           "unit.");
    }
  }
  // Parameters of this tree also registered by modules of other units' trees outside it.
  for (const auto& other : registry.modules_with(kFullyShardApi)) {
    if (in_tree.count(other.get())) continue;
    const std::string other_name = registry.describe(*other);
    for (const auto& m : tree_modules({other.get()})) {
      if (in_tree.count(m.module)) continue;
      for (const auto& p : m.module->named_parameters(/*recurse=*/false)) {
        const void* impl = p.value().unsafeGetTensorImpl();
        const auto here = uses.find(impl);
        if (!owner.count(impl) || here == uses.end()) continue;
        refuse_shared(here->second.front(), m.fqn, contract::join_fqn(m.fqn, p.key()), other_name);
      }
    }
  }
}

std::vector<RegisteredParameter> registered_parameters(torch::nn::Module& root) {
  std::vector<RegisteredParameter> registered;
  std::unordered_map<const void*, size_t> index;
  for (const auto& item : root.named_modules("", /*include_self=*/true)) {
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false)) {
      const auto [it, first] = index.emplace(p.value().unsafeGetTensorImpl(), registered.size());
      if (first) registered.push_back({p.value(), {}});
      registered[it->second].uses.push_back({item.key(), contract::join_fqn(item.key(), p.key())});
    }
  }
  return registered;
}

const ParameterUse* use_outside_unit(const std::vector<ParameterUse>& uses,
                                     const std::vector<std::string>& unit_module_fqns) {
  for (const auto& use : uses) {
    const bool contained = std::any_of(unit_module_fqns.begin(), unit_module_fqns.end(),
                                       [&](const std::string& m) { return within(use.module_fqn, m); });
    if (!contained) return &use;
  }
  return nullptr;
}

}  // namespace fsdp
