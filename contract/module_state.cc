#include "contract/module_state.h"

#include <algorithm>
#include <unordered_set>
#include <utility>

#include <torch/nn/module.h>

#include "contract/module_fqn.h"

namespace fsdp::contract {

ModuleStateRegistry& ModuleStateRegistry::global() {
  // Leaked on purpose: states may be looked up from other static destructors.
  static auto* registry = new ModuleStateRegistry();
  return *registry;
}

ModuleStateRegistry::~ModuleStateRegistry() = default;

std::string ApiState::serialization_veto(const torch::nn::Module& /*module*/) const { return {}; }

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
