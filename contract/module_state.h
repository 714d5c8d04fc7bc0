#pragma once

// Per-module, per-API state of the composable APIs (the side table that Python keeps in
// `_composable/contract.py`'s module attributes).

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <typeinfo>
#include <unordered_map>
#include <vector>

#include <c10/util/Exception.h>
#include <c10/util/Type.h>

namespace at {
class Tensor;
}  // namespace at

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace fsdp::contract {

/// Base class of the state a composable API keeps for one module (`fully_shard` keeps its
/// `FSDPState` here). An API without state may register a plain `ApiState`.
///
///   struct ReplicateState : fsdp::contract::ApiState { int64_t bucket_bytes = 0; };
class ApiState {
 public:
  virtual ~ApiState() = default;

  /// [Note: serialization veto] Why `module` cannot be written by torch::save nor read by
  /// torch::load now ("" when it can). `module` may be the module of this state, one inside it,
  /// one around it, or an unrelated one. An API that changes what parameters hold (for example to
  /// a per-process part of each value) vetoes the modules whose parameters it manages, since
  /// LibTorch's module serialization would write those parts as if they were the values, and
  /// reading would replace the tensors the API manages. Asked by the archive operators of the
  /// hook-able holders (contract/hookable_module_holder.h) through
  /// ModuleStateRegistry::serialization_veto. Default: no veto.
  virtual std::string serialization_veto(const torch::nn::Module& module) const;

  /// [Note: managed parameters] True when this API has taken charge of `param` (by tensor
  /// identity): fully_shard's unit holds it in a FlatParameter, replicate all-reduces its
  /// gradient, parallelize_module placed a piece of it on this rank. Other APIs ask through
  /// ModuleStateRegistry::applied_in / api_managing instead of reading each other's states, e.g.
  /// replicate leaves the parameters a fully_shard unit inside its module manages to that unit.
  /// Called outside the registry's lock. Default: manages nothing.
  virtual bool manages(const at::Tensor& param) const;
};

/// One application of an API, as the registry's queries return it.
struct AppliedApi {
  std::string api;
  std::shared_ptr<torch::nn::Module> module;
  std::shared_ptr<ApiState> state;
};

/// The first of `applied` whose state manages `param` (ApiState::manages), or nullptr.
///
///   auto units = registry.applied_in(*model, "fully_shard");   // once
///   for (auto& p : model->parameters()) if (find_managing(units, p)) { ... }
const AppliedApi* find_managing(const std::vector<AppliedApi>& applied, const at::Tensor& param);

// [Note: exclusive APIs]
// Which composable APIs exclude each other is declared once, as data, with declare_exclusive:
// "`api` is refused on a module where `existing` is already applied to the module itself, to a
// module around it, or to one inside it", and why. contract::apply_api checks the declarations
// before it runs the API (ModuleStateRegistry::check_exclusions), and an API that does work before
// apply_api (collectives, checks exchanged across ranks) calls check_exclusions first. The error
// names both APIs, the module's FQN and the other module's, then the declared reason:
//   "<api>: module 'blocks.0' (BlockImpl) already has <existing> applied; <why>"
//   "<api>: module 'blocks.0' (BlockImpl) is inside '<root>' (ModelImpl), which <existing> was
//    applied to; <why>"
//   "<api>: module '<root>' (ModelImpl) contains 'blocks.0' (BlockImpl), which <existing> was
//    applied to; <why>"
// The composable APIs' declarations are in composable/api_names.cc.

/// One declared exclusion: `api` is refused where `existing` is already applied (see [Note:
/// exclusive APIs]).
struct Exclusion {
  /// The API being applied.
  std::string api;
  /// The API already applied.
  std::string existing;
  /// Where `existing` refuses `api`, relative to the module `api` is applied to: the module
  /// itself, a module that contains it, a module inside it.
  bool same_module = true;
  bool around = false;
  bool inside = false;
  /// Also refuse `existing` where `api` is already applied (on the same module; `around` and
  /// `inside` swap).
  bool both_orders = false;
  /// Ends the error: what was expected and what to do instead.
  std::string why;
};

/// Declares an exclusion, process-wide. A pair may be declared several times for different places
/// with different reasons; declaring a place again with the same `why` changes nothing, with
/// another `why` it throws (one reason per place).
///
///   fsdp::contract::declare_exclusive({.api = "replicate", .existing = "fully_shard",
///                                      .same_module = true, .both_orders = true,
///                                      .why = "both would reduce its gradients"});
void declare_exclusive(const Exclusion& exclusion);

/// The exclusions that refuse `api` (those whose `api` it is, mirrored ones included), in
/// declaration order.
std::vector<Exclusion> exclusions_of(std::string_view api);

// [Note: module state ownership]
// The registry is a side table keyed by module identity; the module tree and its FQNs never
// change. It holds each module *weakly* (a std::weak_ptr taken from the module's
// enable_shared_from_this) and each state *strongly*:
//  - the registry never keeps a module alive; a destroyed module's entries are invisible to every
//    lookup at once, and their states are destroyed at the next insert() or prune(), or when the
//    registry is destroyed (LibTorch gives no callback when a module dies). A program that
//    destroys a model and wants its states (and the memory they hold) gone at once calls
//    prune();
//  - a module reusing the address of a destroyed one never sees the old states;
//  - a state that holds a std::shared_ptr to its own module (or to an ancestor) keeps that module
//    alive until erase(): states should point at their module with a raw pointer or a weak_ptr.
// Modules must be owned by a std::shared_ptr (every ModuleHolder is) to receive state.

/// The table of composable-API states: per module, per API name, one `ApiState`. Applying an API
/// to a module twice is an error; different APIs may share a module. Thread-safe; states are
/// destroyed outside the registry's lock, so a state's destructor may use the registry.
///
///   auto& registry = fsdp::contract::ModuleStateRegistry::global();
///   registry.insert(*block, "fully_shard", std::make_shared<FSDPState>(...));
///   auto state = registry.get_as<FSDPState>(*block, "fully_shard");   // nullptr if not applied
///   for (auto& module : registry.modules_with("fully_shard")) { ... }
class ModuleStateRegistry {
 public:
  /// A position in the registry's insertion history; see rollback().
  using Checkpoint = uint64_t;

  /// The process-wide registry that `apply_api` uses by default.
  static ModuleStateRegistry& global();

  ModuleStateRegistry() = default;
  ModuleStateRegistry(const ModuleStateRegistry&) = delete;
  ModuleStateRegistry& operator=(const ModuleStateRegistry&) = delete;
  ~ModuleStateRegistry();

  /// Records `state` as the state of `api` for `module`. Throws c10::Error naming the API and the
  /// module's FQN (see describe()) if `api` was already applied to `module`, if `state` is null,
  /// or if `module` is not owned by a std::shared_ptr.
  ///
  ///   registry.insert(*model, "replicate", std::make_shared<ReplicateState>());
  void insert(torch::nn::Module& module, std::string_view api, std::shared_ptr<ApiState> state);

  /// Throws the c10::Error that insert() throws for a second application if `api` was already
  /// applied to `module`: "<api>: module '<fqn>' (<class>) already has <api> applied; ...".
  ///
  ///   registry.check_not_applied(*block, "fully_shard");   // before doing any work
  void check_not_applied(const torch::nn::Module& module, std::string_view api) const;

  /// The state of `api` for `module`, or nullptr when `api` was not applied to it.
  ///
  ///   if (auto state = registry.get(*block, "fully_shard")) { ... }
  std::shared_ptr<ApiState> get(const torch::nn::Module& module, std::string_view api) const;

  /// Like get(), cast to `State`. Throws c10::Error if the state exists but is of another type.
  ///
  ///   std::shared_ptr<FSDPState> state = registry.get_as<FSDPState>(*block, "fully_shard");
  template <typename State>
  std::shared_ptr<State> get_as(const torch::nn::Module& module, std::string_view api) const;

  /// True when `api` was applied to `module`.
  bool contains(const torch::nn::Module& module, std::string_view api) const;

  /// The APIs applied to `module`, in application order.
  ///
  ///   registry.apis_of(*model);   // {"replicate", "fully_shard"}
  std::vector<std::string> apis_of(const torch::nn::Module& module) const;

  /// The live modules that carry `api`, in application order. The returned pointers keep the
  /// modules alive only as long as the caller holds them.
  ///
  ///   for (const auto& module : registry.modules_with("fully_shard")) { ... }
  std::vector<std::shared_ptr<torch::nn::Module>> modules_with(std::string_view api) const;

  /// The APIs applied to `root` or to modules inside its tree (only `api` when not empty), in
  /// application order.
  ///
  ///   for (const auto& unit : registry.applied_in(*model, "fully_shard")) { ... unit.module ... }
  std::vector<AppliedApi> applied_in(const torch::nn::Module& root, std::string_view api = {}) const;

  /// Which API manages `param` ([Note: managed parameters]): the first application in `root`'s
  /// tree (of `api` only when not empty), in application order, whose state manages it; nullopt
  /// when none does. Walks the tree once per call: for many parameters, call applied_in once and
  /// find_managing per parameter.
  ///
  ///   if (auto owner = registry.api_managing(*model, model->head->weight)) {
  ///     owner->api;      // "fully_shard"
  ///     owner->module;   // the unit's module
  ///   }
  std::optional<AppliedApi> api_managing(const torch::nn::Module& root, const at::Tensor& param,
                                         std::string_view api = {}) const;

  /// Throws the c10::Error of [Note: exclusive APIs] when an API declared exclusive with `api`
  /// (declare_exclusive) is applied where it refuses `api` on `module`. `caller` starts the
  /// message (default: `api`), for an API whose public name differs from its registry name.
  ///
  ///   registry.check_exclusions(*block, "fully_shard");   // before doing any work
  void check_exclusions(const torch::nn::Module& module, std::string_view api,
                        std::string_view caller = {}) const;

  /// Removes the state of `api` for `module` (the state is destroyed unless held elsewhere).
  /// Returns false when there was none.
  bool erase(const torch::nn::Module& module, std::string_view api);

  /// Destroys the states of modules that no longer exist. Returns how many states were dropped.
  /// insert() does it as well; call it to release them at a known time.
  ///
  ///   model = nullptr;                                          // destroy the model
  ///   fsdp::contract::ModuleStateRegistry::global().prune();    // and its states
  size_t prune();

  /// The number of (module, API) entries of live modules.
  size_t size() const;

  /// Describes `module` for error messages: its FQN relative to the outermost live module that
  /// carries any API in this registry and contains it (the root, once the root's API is applied),
  /// else "<root>", followed by its class: "'blocks.0' (BlockImpl)".
  std::string describe(const torch::nn::Module& module) const;

  /// The first veto of a live state against serializing `module` (see [Note: serialization
  /// veto]), or "" when none objects.
  std::string serialization_veto(const torch::nn::Module& module) const;

  /// The current position in the insertion history, for rollback().
  Checkpoint checkpoint() const;

  /// Erases the entries inserted after `checkpoint` whose module is one of `modules`. `apply_api`
  /// uses it to undo the entries that a failed API application added inside its module's tree.
  void rollback(Checkpoint checkpoint, const std::vector<const torch::nn::Module*>& modules);

 private:
  struct ApiEntry {
    std::string api;
    std::shared_ptr<ApiState> state;
    uint64_t sequence;  // insertion order, across all modules
  };
  struct ModuleEntry {
    std::weak_ptr<torch::nn::Module> module;
    std::vector<ApiEntry> apis;  // application order
  };
  using Table = std::unordered_map<const torch::nn::Module*, ModuleEntry>;

  // The live entry of `module`, or nullptr (also for a stale entry left by a destroyed module
  // whose address `module` reuses). Caller holds mutex_.
  const ModuleEntry* find_live_locked(const torch::nn::Module& module) const;
  // Moves the states of destroyed modules into `graveyard`. Caller holds mutex_.
  size_t prune_locked(std::vector<std::shared_ptr<ApiState>>& graveyard);
  std::vector<std::shared_ptr<torch::nn::Module>> live_modules() const;

  mutable std::mutex mutex_;
  Table entries_;
  uint64_t last_sequence_ = 0;
};

/// Throws a c10::Error naming `api` when a state of the global registry vetoes serializing
/// `module` ([Note: serialization veto]).
void check_serializable(const torch::nn::Module& module, const char* api);

// ----------------------------------------------------------------------------------------------
// Implementation of the templates.

template <typename State>
std::shared_ptr<State> ModuleStateRegistry::get_as(const torch::nn::Module& module,
                                                   std::string_view api) const {
  std::shared_ptr<ApiState> state = get(module, api);
  if (state == nullptr) {
    return nullptr;
  }
  auto typed = std::dynamic_pointer_cast<State>(state);
  const ApiState& found = *state;
  TORCH_CHECK(typed != nullptr, api, ": module ", describe(module), " carries a state of type ",
              c10::demangle(typeid(found).name()), ", expected ", c10::demangle_type<State>(),
              "; hint: two APIs registered under the same name '", api, "'?");
  return typed;
}

}  // namespace fsdp::contract
