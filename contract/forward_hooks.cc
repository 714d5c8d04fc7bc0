#include "fsdp_cpp/contract/forward_hooks.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include <c10/util/Exception.h>
#include <torch/nn/module.h>

namespace fsdp::contract {
namespace detail {

// The process-wide side table of forward hooks ([Note: forward hooks]).
class ForwardHookTable {
 public:
  static ForwardHookTable& instance() {
    // Leaked on purpose: modules may run forward from other static destructors.
    static auto* table = new ForwardHookTable();
    return *table;
  }

  template <typename Hook>
  RemovableHandle add(torch::nn::Module& module, Hook hook, bool prepend, const char* kind) {
    TORCH_CHECK(hook != nullptr, "fsdp::contract::register_", kind,
                ": expected a callable hook, got an empty std::function (module ", module.name(),
                ")");
    std::weak_ptr<torch::nn::Module> weak = module.weak_from_this();
    TORCH_CHECK(!weak.expired(), "fsdp::contract::register_", kind, ": module ", module.name(),
                " is not owned by a std::shared_ptr; expected a module created through its "
                "holder (e.g. `Linear fc(3, 4)`) or std::make_shared, got one on the stack or in "
                "a plain member");
    auto shared_hook = std::make_shared<const Hook>(std::move(hook));

    std::vector<std::shared_ptr<const ForwardHookLists>> graveyard;  // released after unlocking
    std::lock_guard<std::mutex> lock(mutex_);
    Slot& slot = slots_[&module];
    if (slot.module.expired()) {  // new slot, or a stale one of a destroyed module
      graveyard.push_back(std::move(slot.lists));
      slot.module = weak;
    }
    auto lists = slot.lists ? std::make_shared<ForwardHookLists>(*slot.lists)
                            : std::make_shared<ForwardHookLists>();
    const uint64_t id = ++last_id_;
    auto& entries = select(*lists, static_cast<const Hook*>(nullptr));
    using Entry = typename std::remove_reference_t<decltype(entries)>::value_type;
    entries.insert(prepend ? entries.begin() : entries.end(), Entry{id, std::move(shared_hook)});
    graveyard.push_back(std::move(slot.lists));
    slot.lists = std::move(lists);
    prune_locked(graveyard);  // O(hooked modules); registration is rare
    publish_locked();
    return RemovableHandle(&module, id);
  }

  std::shared_ptr<const ForwardHookLists> lookup(const torch::nn::Module& module) {
    if (num_slots_.load(std::memory_order_acquire) == 0) {
      return nullptr;  // the common case of a program without hooks: no lock
    }
    std::shared_ptr<const ForwardHookLists> stale;  // released after unlocking
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = slots_.find(&module);
    if (it == slots_.end()) {
      return nullptr;
    }
    if (it->second.module.expired()) {  // `module` reuses a destroyed module's address
      stale = std::move(it->second.lists);
      slots_.erase(it);
      publish_locked();
      return nullptr;
    }
    return it->second.lists;
  }

  size_t prune() {
    std::vector<std::shared_ptr<const ForwardHookLists>> graveyard;
    std::lock_guard<std::mutex> lock(mutex_);
    const size_t before = slots_.size();
    prune_locked(graveyard);
    publish_locked();
    return before - slots_.size();
  }

  // Removes the hooks of `module` accepted by `should_remove(id)`.
  template <typename Predicate>
  void remove_if(const torch::nn::Module* module, Predicate should_remove) {
    std::vector<std::shared_ptr<const ForwardHookLists>> graveyard;
    std::lock_guard<std::mutex> lock(mutex_);
    remove_if_locked(module, should_remove, graveyard);
    publish_locked();
  }

  void remove_after(uint64_t checkpoint, const std::vector<const torch::nn::Module*>& modules) {
    std::vector<std::shared_ptr<const ForwardHookLists>> graveyard;
    std::lock_guard<std::mutex> lock(mutex_);
    for (const torch::nn::Module* module : modules) {
      remove_if_locked(module, [&](uint64_t id) { return id > checkpoint; }, graveyard);
    }
    publish_locked();
  }

  bool contains(const torch::nn::Module* module, uint64_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = slots_.find(module);
    if (it == slots_.end() || it->second.module.expired() || !it->second.lists) {
      return false;
    }
    const ForwardHookLists& lists = *it->second.lists;
    auto has_id = [id](const auto& entry) { return entry.id == id; };
    return std::any_of(lists.pre.begin(), lists.pre.end(), has_id) ||
           std::any_of(lists.post.begin(), lists.post.end(), has_id) ||
           std::any_of(lists.exception.begin(), lists.exception.end(), has_id) ||
           std::any_of(lists.wrap.begin(), lists.wrap.end(), has_id);
  }

  uint64_t checkpoint() {
    std::lock_guard<std::mutex> lock(mutex_);
    return last_id_;
  }

 private:
  struct Slot {
    std::weak_ptr<torch::nn::Module> module;
    std::shared_ptr<const ForwardHookLists> lists;  // never empty lists: the slot is erased
  };

  static std::vector<ForwardHookLists::PreHookEntry>& select(ForwardHookLists& lists,
                                                             const ForwardPreHook*) {
    return lists.pre;
  }
  static std::vector<ForwardHookLists::HookEntry>& select(ForwardHookLists& lists,
                                                          const ForwardHook*) {
    return lists.post;
  }
  static std::vector<ForwardHookLists::ExceptionHookEntry>& select(ForwardHookLists& lists,
                                                                   const ForwardExceptionHook*) {
    return lists.exception;
  }
  static std::vector<ForwardHookLists::WrapperEntry>& select(ForwardHookLists& lists,
                                                             const ForwardWrapper*) {
    return lists.wrap;
  }

  template <typename Predicate>
  void remove_if_locked(const torch::nn::Module* module, Predicate should_remove,
                        std::vector<std::shared_ptr<const ForwardHookLists>>& graveyard) {
    auto it = slots_.find(module);
    if (it == slots_.end()) {
      return;
    }
    Slot& slot = it->second;
    if (slot.module.expired() || !slot.lists) {
      graveyard.push_back(std::move(slot.lists));
      slots_.erase(it);
      return;
    }
    auto lists = std::make_shared<ForwardHookLists>(*slot.lists);
    auto drop = [&](auto& entries) {
      entries.erase(std::remove_if(entries.begin(), entries.end(),
                                   [&](const auto& entry) { return should_remove(entry.id); }),
                    entries.end());
    };
    drop(lists->pre);
    drop(lists->post);
    drop(lists->exception);
    drop(lists->wrap);
    graveyard.push_back(std::move(slot.lists));
    if (lists->pre.empty() && lists->post.empty() && lists->exception.empty() &&
        lists->wrap.empty()) {
      slots_.erase(it);
    } else {
      slot.lists = std::move(lists);
    }
  }

  void prune_locked(std::vector<std::shared_ptr<const ForwardHookLists>>& graveyard) {
    for (auto it = slots_.begin(); it != slots_.end();) {
      if (it->second.module.expired()) {
        graveyard.push_back(std::move(it->second.lists));
        it = slots_.erase(it);
      } else {
        ++it;
      }
    }
  }

  void publish_locked() { num_slots_.store(slots_.size(), std::memory_order_release); }

  std::mutex mutex_;
  std::unordered_map<const torch::nn::Module*, Slot> slots_;
  std::atomic<size_t> num_slots_{0};
  uint64_t last_id_ = 0;
};

std::shared_ptr<const ForwardHookLists> forward_hooks_of(const torch::nn::Module& module) {
  return ForwardHookTable::instance().lookup(module);
}

void run_forward_pre_hooks(const ForwardHookLists& hooks, torch::nn::Module& module,
                           ForwardArgs& args) {
  const size_t num_args = args.size();
  for (size_t i = 0; i < hooks.pre.size(); ++i) {
    (*hooks.pre[i].hook)(module, args);
    TORCH_CHECK(args.size() == num_args, "fsdp::contract: pre-forward hook #", i, " of module ",
                module.name(), " changed the number of forward arguments: expected ", num_args,
                ", got ", args.size(),
                "; hint: hooks may replace arguments in place but not add or remove them");
  }
}

void run_forward_post_hooks(const ForwardHookLists& hooks, torch::nn::Module& module,
                            const ForwardArgs& args, c10::IValue& output) {
  for (const auto& entry : hooks.post) {
    (*entry.hook)(module, args, output);
  }
}

namespace {
thread_local size_t hooked_depth = 0;
}  // namespace

std::atomic<bool> forward_call_checks_active{false};

namespace {
std::mutex& call_checks_mutex() {
  static auto* mutex = new std::mutex();  // never destroyed: calls may run during static destruction
  return *mutex;
}
std::vector<ForwardCallCheck>& call_checks() {
  static auto* checks = new std::vector<ForwardCallCheck>();
  return *checks;
}
}  // namespace

void run_forward_call_checks(torch::nn::Module& module) {
  std::vector<ForwardCallCheck> checks;
  {
    std::lock_guard<std::mutex> lock(call_checks_mutex());
    checks = call_checks();
  }
  for (ForwardCallCheck check : checks) check(module);
}

HookedForwardScope::HookedForwardScope() { ++hooked_depth; }
HookedForwardScope::~HookedForwardScope() { --hooked_depth; }

ForwardFunction wrap_forward(const ForwardHookLists& hooks, torch::nn::Module& module,
                             ForwardFunction forward) {
  for (auto it = hooks.wrap.rbegin(); it != hooks.wrap.rend(); ++it) {
    forward = [wrapper = it->hook, m = &module, inner = std::move(forward)](const ForwardArgs& args) {
      return (*wrapper)(*m, args, inner);
    };
  }
  return forward;
}

void run_forward_exception_hooks(const ForwardHookLists& hooks, torch::nn::Module& module,
                                 c10::Error& error) {
  for (const auto& entry : hooks.exception) {
    (*entry.hook)(module, error);
  }
}

void throw_forward_value_mismatch(const torch::nn::Module& module, std::string_view what,
                                  size_t index, const char* expected, const c10::IValue& got,
                                  const c10::Error& error) {
  if (what == "output") {
    TORCH_CHECK(false, "fsdp::contract: the output of ", module.name(),
                "::forward after its post-forward hooks: expected a value of type ", expected,
                ", got ", got.tagKind(), " (", error.what_without_backtrace(),
                "); hint: a post-forward hook may replace the output only by a value of the same "
                "type");
  }
  if (what == "requested output") {
    TORCH_CHECK(false, "fsdp::contract: the output of ", module.name(),
                "::forward: expected a value of the requested type ", expected, ", got ",
                got.tagKind(), " (", error.what_without_backtrace(),
                "); hint: name forward's output type in forward<Output>(...)");
  }
  TORCH_CHECK(false, "fsdp::contract: ", what, " ", index, " of ", module.name(),
              "::forward (as passed, after any pre-forward hooks): expected a value of type ",
              expected, ", got ", got.tagKind(), " (", error.what_without_backtrace(),
              "); hint: pass forward's parameter types, and let a pre-forward hook replace an "
              "argument only by a value of the same type");
}

}  // namespace detail

void RemovableHandle::remove() {
  if (module_ == nullptr) {
    return;
  }
  const uint64_t id = id_;
  detail::ForwardHookTable::instance().remove_if(module_, [id](uint64_t other) { return other == id; });
}

bool RemovableHandle::is_registered() const {
  return module_ != nullptr && detail::ForwardHookTable::instance().contains(module_, id_);
}

RemovableHandle register_forward_pre_hook(torch::nn::Module& module, ForwardPreHook hook,
                                          bool prepend) {
  return detail::ForwardHookTable::instance().add(module, std::move(hook), prepend,
                                                  "forward_pre_hook");
}

RemovableHandle register_forward_hook(torch::nn::Module& module, ForwardHook hook, bool prepend) {
  return detail::ForwardHookTable::instance().add(module, std::move(hook), prepend,
                                                  "forward_hook");
}

RemovableHandle register_forward_exception_hook(torch::nn::Module& module,
                                                ForwardExceptionHook hook, bool prepend) {
  return detail::ForwardHookTable::instance().add(module, std::move(hook), prepend,
                                                  "forward_exception_hook");
}

size_t num_forward_pre_hooks(const torch::nn::Module& module) {
  auto hooks = detail::forward_hooks_of(module);
  return hooks ? hooks->pre.size() : 0;
}

size_t num_forward_hooks(const torch::nn::Module& module) {
  auto hooks = detail::forward_hooks_of(module);
  return hooks ? hooks->post.size() : 0;
}

size_t num_forward_exception_hooks(const torch::nn::Module& module) {
  auto hooks = detail::forward_hooks_of(module);
  return hooks ? hooks->exception.size() : 0;
}

RemovableHandle register_forward_wrapper(torch::nn::Module& module, ForwardWrapper wrapper,
                                         bool prepend) {
  return detail::ForwardHookTable::instance().add(module, std::move(wrapper), prepend,
                                                  "forward_wrapper");
}

size_t num_forward_wrappers(const torch::nn::Module& module) {
  auto hooks = detail::forward_hooks_of(module);
  return hooks ? hooks->wrap.size() : 0;
}

void add_forward_call_check(ForwardCallCheck check) {
  TORCH_CHECK(check != nullptr, "fsdp::contract::add_forward_call_check: expected a check, got null");
  {
    std::lock_guard<std::mutex> lock(detail::call_checks_mutex());
    detail::call_checks().push_back(check);
  }
  detail::forward_call_checks_active.store(true);
}

size_t hooked_forward_depth() { return detail::hooked_depth; }

size_t prune_forward_hooks() { return detail::ForwardHookTable::instance().prune(); }

ForwardHookCheckpoint forward_hook_checkpoint() {
  return detail::ForwardHookTable::instance().checkpoint();
}

void remove_forward_hooks_after(ForwardHookCheckpoint checkpoint,
                                const std::vector<const torch::nn::Module*>& modules) {
  detail::ForwardHookTable::instance().remove_after(checkpoint, modules);
}

c10::IValue run_forward_ivalues(torch::nn::Module& module, ForwardArgs args,
                                const ForwardFunction& forward) {
  if (detail::forward_call_checks_active.load(std::memory_order_relaxed)) [[unlikely]] {
    detail::run_forward_call_checks(module);
  }
  std::shared_ptr<const detail::ForwardHookLists> hooks = detail::forward_hooks_of(module);
  if (hooks == nullptr) {
    return forward(args);
  }
  detail::HookedForwardScope depth;
  detail::run_forward_pre_hooks(*hooks, module, args);
  c10::IValue output;
  if (hooks->wrap.empty()) {
    output = detail::call_forward(*hooks, module, [&] { return forward(args); });
  } else {
    const ForwardFunction wrapped = detail::wrap_forward(*hooks, module, forward);
    output = detail::call_forward(*hooks, module, [&] { return wrapped(args); });
  }
  detail::run_forward_post_hooks(*hooks, module, args, output);
  return output;
}

}  // namespace fsdp::contract
