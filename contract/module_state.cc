#include "fsdp_cpp/contract/module_state.h"

#include <algorithm>
#include <unordered_set>
#include <utility>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "fsdp_cpp/contract/module_fqn.h"

namespace fsdp::contract {

ModuleStateRegistry& ModuleStateRegistry::global() {
  // Leaked on purpose: states may be looked up from other static destructors.
  static auto* registry = new ModuleStateRegistry();
  return *registry;
}

ModuleStateRegistry::~ModuleStateRegistry() = default;

std::string ApiState::serialization_veto(const torch::nn::Module& /*module*/) const { return {}; }

bool ApiState::manages(const at::Tensor& /*param*/) const { return false; }

const AppliedApi* find_managing(const std::vector<AppliedApi>& applied, const at::Tensor& param) {
  for (const auto& a : applied) {
    if (a.state->manages(param)) return &a;
  }
  return nullptr;
}

namespace {

// The declared exclusions, each stored in the direction it refuses (a both_orders declaration is
// stored twice). Leaked on purpose, as the global registry.
struct ExclusionTable {
  std::mutex mutex;
  std::vector<Exclusion> rules;
};

ExclusionTable& exclusion_table() {
  static auto* table = new ExclusionTable();
  return *table;
}

// Adds `rule` (both_orders already expanded): merged into an earlier declaration of its pair with
// the same reason, refused when a place of it already has another reason. Caller holds the table's
// mutex.
void add_exclusion_locked(std::vector<Exclusion>& rules, Exclusion rule) {
  rule.both_orders = false;
  Exclusion* same_reason = nullptr;
  for (auto& earlier : rules) {
    if (earlier.api != rule.api || earlier.existing != rule.existing) continue;
    if (earlier.why == rule.why) {
      same_reason = &earlier;
      continue;
    }
    const bool overlap = (earlier.same_module && rule.same_module) || (earlier.around && rule.around) ||
                         (earlier.inside && rule.inside);
    TORCH_CHECK(!overlap, "fsdp::contract::declare_exclusive: '", rule.api, "' where '", rule.existing,
                "' is applied was declared exclusive twice at the same place with different reasons (\"",
                earlier.why, "\" and \"", rule.why, "\"); expected one reason per place");
  }
  if (same_reason != nullptr) {
    same_reason->same_module |= rule.same_module;
    same_reason->around |= rule.around;
    same_reason->inside |= rule.inside;
    return;
  }
  rules.push_back(std::move(rule));
}

}  // namespace

void declare_exclusive(const Exclusion& exclusion) {
  TORCH_CHECK(!exclusion.api.empty() && !exclusion.existing.empty(),
              "fsdp::contract::declare_exclusive: expected two non-empty API names, got '", exclusion.api,
              "' and '", exclusion.existing, "'");
  TORCH_CHECK(exclusion.same_module || exclusion.around || exclusion.inside,
              "fsdp::contract::declare_exclusive: '", exclusion.api, "' and '", exclusion.existing,
              "': expected at least one place (same_module, around, inside), got none");
  TORCH_CHECK(exclusion.api != exclusion.existing || !exclusion.same_module,
              "fsdp::contract::declare_exclusive: '", exclusion.api, "' on the same module as itself is "
              "refused by every API already (ModuleStateRegistry::check_not_applied); declare only around "
              "or inside");
  TORCH_CHECK(!exclusion.why.empty(), "fsdp::contract::declare_exclusive: '", exclusion.api, "' and '",
              exclusion.existing, "': expected a reason (why) for the error, got none");
  ExclusionTable& table = exclusion_table();
  std::lock_guard<std::mutex> lock(table.mutex);
  std::vector<Exclusion> rules = table.rules;  // all or nothing: a refused mirror adds nothing either
  add_exclusion_locked(rules, exclusion);
  if (exclusion.both_orders) {
    Exclusion mirrored = exclusion;
    std::swap(mirrored.api, mirrored.existing);
    std::swap(mirrored.around, mirrored.inside);
    add_exclusion_locked(rules, std::move(mirrored));
  }
  table.rules = std::move(rules);
}

std::vector<Exclusion> exclusions_of(std::string_view api) {
  ExclusionTable& table = exclusion_table();
  std::lock_guard<std::mutex> lock(table.mutex);
  std::vector<Exclusion> out;
  for (const auto& rule : table.rules) {
    if (rule.api == api) out.push_back(rule);
  }
  return out;
}

void check_serializable(const torch::nn::Module& module, const char* api) {
  const std::string veto = ModuleStateRegistry::global().serialization_veto(module);
  TORCH_CHECK(veto.empty(), api, ": ", veto);
}

std::string ModuleStateRegistry::serialization_veto(const torch::nn::Module& module) const {
  std::vector<std::pair<uint64_t, std::shared_ptr<ApiState>>> states;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [key, entry] : entries_) {
      if (entry.module.expired()) continue;
      for (const auto& e : entry.apis) states.emplace_back(e.sequence, e.state);
    }
  }
  // In application order, so the same state answers first on every call; asked outside the lock
  // (a veto may describe modules through the registry).
  std::sort(states.begin(), states.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  for (const auto& [sequence, state] : states) {
    std::string veto = state->serialization_veto(module);
    if (!veto.empty()) return veto;
  }
  return {};
}

const ModuleStateRegistry::ModuleEntry* ModuleStateRegistry::find_live_locked(
    const torch::nn::Module& module) const {
  auto it = entries_.find(&module);
  if (it == entries_.end() || it->second.module.expired()) {
    return nullptr;
  }
  return &it->second;
}

size_t ModuleStateRegistry::prune_locked(std::vector<std::shared_ptr<ApiState>>& graveyard) {
  size_t dropped = 0;
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (it->second.module.expired()) {
      for (auto& entry : it->second.apis) {
        graveyard.push_back(std::move(entry.state));
        ++dropped;
      }
      it = entries_.erase(it);
    } else {
      ++it;
    }
  }
  return dropped;
}

void ModuleStateRegistry::insert(torch::nn::Module& module, std::string_view api,
                                 std::shared_ptr<ApiState> state) {
  TORCH_CHECK(!api.empty(), "ModuleStateRegistry::insert: expected a non-empty API name");
  TORCH_CHECK(state != nullptr, api, ": module ", describe(module),
              ": expected a state object, got nullptr; hint: an API without state registers "
              "std::make_shared<fsdp::contract::ApiState>()");
  std::weak_ptr<torch::nn::Module> weak = module.weak_from_this();
  TORCH_CHECK(!weak.expired(), api, ": module ", describe(module),
              " is not owned by a std::shared_ptr; expected a module created through its holder "
              "(e.g. `Block block(...)`) or std::make_shared, got one on the stack or in a "
              "plain member");
  check_not_applied(module, api);

  std::vector<std::shared_ptr<ApiState>> graveyard;  // destroyed after the lock is released
  std::lock_guard<std::mutex> lock(mutex_);
  ModuleEntry& entry = entries_[&module];
  if (entry.module.expired()) {  // new entry, or a stale one of a destroyed module
    for (auto& stale : entry.apis) {
      graveyard.push_back(std::move(stale.state));
    }
    entry.apis.clear();
    entry.module = weak;
  }
  const bool duplicate = std::any_of(entry.apis.begin(), entry.apis.end(),
                                     [&](const ApiEntry& e) { return e.api == api; });
  // Only a concurrent insert of the same (module, api) gets here.
  TORCH_CHECK(!duplicate, api, ": ", api, " was applied to module '", module.name(),
              "' twice at the same time; expected at most one application");
  entry.apis.push_back(ApiEntry{std::string(api), std::move(state), ++last_sequence_});
  prune_locked(graveyard);  // O(modules with state); applying an API is rare
}

void ModuleStateRegistry::check_not_applied(const torch::nn::Module& module,
                                            std::string_view api) const {
  if (contains(module, api)) {
    TORCH_CHECK(false, api, ": module ", describe(module), " already has ", api,
                " applied; expected each composable API to be applied to a module at most once, "
                "got a second application. Hint: apply ", api,
                " once per unit, bottom-up, and to the root last");
  }
}

std::shared_ptr<ApiState> ModuleStateRegistry::get(const torch::nn::Module& module,
                                                   std::string_view api) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const ModuleEntry* entry = find_live_locked(module);
  if (entry == nullptr) {
    return nullptr;
  }
  for (const auto& e : entry->apis) {
    if (e.api == api) {
      return e.state;
    }
  }
  return nullptr;
}

bool ModuleStateRegistry::contains(const torch::nn::Module& module, std::string_view api) const {
  return get(module, api) != nullptr;
}

std::vector<std::string> ModuleStateRegistry::apis_of(const torch::nn::Module& module) const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::string> apis;
  if (const ModuleEntry* entry = find_live_locked(module)) {
    for (const auto& e : entry->apis) {
      apis.push_back(e.api);
    }
  }
  return apis;
}

std::vector<std::shared_ptr<torch::nn::Module>> ModuleStateRegistry::modules_with(
    std::string_view api) const {
  std::vector<std::pair<uint64_t, std::shared_ptr<torch::nn::Module>>> found;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [key, entry] : entries_) {
      std::shared_ptr<torch::nn::Module> module = entry.module.lock();
      if (module == nullptr) {
        continue;
      }
      for (const auto& e : entry.apis) {
        if (e.api == api) {
          found.emplace_back(e.sequence, std::move(module));
          break;
        }
      }
    }
  }
  std::sort(found.begin(), found.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  modules.reserve(found.size());
  for (auto& item : found) {
    modules.push_back(std::move(item.second));
  }
  return modules;
}

std::vector<AppliedApi> ModuleStateRegistry::applied_in(const torch::nn::Module& root,
                                                        std::string_view api) const {
  std::unordered_set<const torch::nn::Module*> tree{&root};
  for (const auto& item : root.named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    tree.insert(item.value().get());
  }
  std::vector<std::pair<uint64_t, AppliedApi>> found;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [key, entry] : entries_) {
      if (tree.count(key) == 0) continue;
      std::shared_ptr<torch::nn::Module> module = entry.module.lock();
      if (module == nullptr) continue;
      for (const auto& e : entry.apis) {
        if (api.empty() || e.api == api) found.emplace_back(e.sequence, AppliedApi{e.api, module, e.state});
      }
    }
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<AppliedApi> applied;
  applied.reserve(found.size());
  for (auto& item : found) applied.push_back(std::move(item.second));
  return applied;
}

std::optional<AppliedApi> ModuleStateRegistry::api_managing(const torch::nn::Module& root,
                                                            const at::Tensor& param,
                                                            std::string_view api) const {
  const std::vector<AppliedApi> applied = applied_in(root, api);
  if (const AppliedApi* owner = find_managing(applied, param)) return *owner;
  return std::nullopt;
}

void ModuleStateRegistry::check_exclusions(const torch::nn::Module& module, std::string_view api,
                                           std::string_view caller) const {
  const std::vector<Exclusion> rules = exclusions_of(api);
  const std::string_view who = caller.empty() ? api : caller;
  for (const auto& rule : rules) {
    if (rule.same_module && contains(module, rule.existing)) {
      TORCH_CHECK(false, who, ": module ", describe(module), " already has ", rule.existing, " applied; ",
                  rule.why);
    }
    if (!rule.around && !rule.inside) continue;
    for (const auto& other : modules_with(rule.existing)) {
      if (other.get() == &module) continue;
      if (rule.around && find_module_fqn(*other, module).has_value()) {
        TORCH_CHECK(false, who, ": module ", describe(module), " is inside ", describe(*other), ", which ",
                    rule.existing, " was applied to; ", rule.why);
      }
      if (rule.inside) {
        // Named from `module`: nothing around `other` may carry an API yet.
        const std::optional<std::string> inner = find_module_fqn(module, *other);
        TORCH_CHECK(!inner.has_value(), who, ": module ", describe(module), " contains ",
                    describe_module(inner.value_or(""), *other), ", which ", rule.existing, " was applied to; ",
                    rule.why);
      }
    }
  }
}

bool ModuleStateRegistry::erase(const torch::nn::Module& module, std::string_view api) {
  std::vector<std::shared_ptr<ApiState>> graveyard;
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = entries_.find(&module);
  if (it == entries_.end()) {
    return false;
  }
  ModuleEntry& entry = it->second;
  if (entry.module.expired()) {  // stale: the module asked about is not the one recorded
    return false;
  }
  auto found = std::find_if(entry.apis.begin(), entry.apis.end(),
                            [&](const ApiEntry& e) { return e.api == api; });
  if (found == entry.apis.end()) {
    return false;
  }
  graveyard.push_back(std::move(found->state));
  entry.apis.erase(found);
  if (entry.apis.empty()) {
    entries_.erase(it);
  }
  return true;
}

size_t ModuleStateRegistry::prune() {
  std::vector<std::shared_ptr<ApiState>> graveyard;
  std::lock_guard<std::mutex> lock(mutex_);
  return prune_locked(graveyard);
}

size_t ModuleStateRegistry::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t count = 0;
  for (const auto& [key, entry] : entries_) {
    if (!entry.module.expired()) {
      count += entry.apis.size();
    }
  }
  return count;
}

std::vector<std::shared_ptr<torch::nn::Module>> ModuleStateRegistry::live_modules() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  for (const auto& [key, entry] : entries_) {
    if (auto module = entry.module.lock()) {
      modules.push_back(std::move(module));
    }
  }
  return modules;
}

std::string ModuleStateRegistry::describe(const torch::nn::Module& module) const {
  // The outermost registered ancestor gives the longest FQN. Runs on error paths only.
  std::string best;
  for (const auto& candidate : live_modules()) {
    std::optional<std::string> fqn = find_module_fqn(*candidate, module);
    if (fqn && fqn->size() > best.size()) {
      best = std::move(*fqn);
    }
  }
  return describe_module(best, module);
}

ModuleStateRegistry::Checkpoint ModuleStateRegistry::checkpoint() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return last_sequence_;
}

void ModuleStateRegistry::rollback(Checkpoint checkpoint,
                                   const std::vector<const torch::nn::Module*>& modules) {
  const std::unordered_set<const torch::nn::Module*> targets(modules.begin(), modules.end());
  std::vector<std::shared_ptr<ApiState>> graveyard;
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (targets.count(it->first) != 0) {
      auto& apis = it->second.apis;
      for (auto e = apis.begin(); e != apis.end();) {
        if (e->sequence > checkpoint) {
          graveyard.push_back(std::move(e->state));
          e = apis.erase(e);
        } else {
          ++e;
        }
      }
      if (apis.empty()) {
        it = entries_.erase(it);
        continue;
      }
    }
    ++it;
  }
}

}  // namespace fsdp::contract
