#pragma once

// apply_api: the composable contract (Python's `torch.distributed._composable.contract`), which
// every composable API (fully_shard, replicate, ...) goes through.

#include <concepts>
#include <functional>
#include <memory>
#include <string_view>
#include <type_traits>

#include "fsdp_cpp/contract/module_state.h"

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace fsdp::contract {

/// The type-erased form of the function a composable API runs on its module.
using ApiFunction = std::function<std::shared_ptr<ApiState>(torch::nn::Module& module)>;

namespace detail {
template <typename T>
struct ApiStatePointer : std::false_type {};
template <typename State>
struct ApiStatePointer<std::shared_ptr<State>> : std::is_base_of<ApiState, State> {};

std::shared_ptr<ApiState> apply_api_erased(std::string_view api, torch::nn::Module& module,
                                           const ApiFunction& fn, ModuleStateRegistry& registry);
}  // namespace detail

/// Applies the composable API `api` to `module` under the contract:
///  1. fails if `api` was already applied to `module` (the error names the API and the
///     module's FQN), or if an API declared exclusive with it is applied to `module`, around it
///     or inside it ([Note: exclusive APIs] in module_state.h), before `fn` runs;
///  2. snapshots the FQNs of the module's parameters, buffers and submodules (fqn_snapshot.h);
///  3. runs `fn(module)`, which sets the API up (registers hooks, builds its state) and returns
///     the module's state, a std::shared_ptr to an ApiState subclass (not null);
///  4. fails if any FQN changed, or their order ("cannot modify FQNs");
///  5. records the state in `registry` under (module, api) and returns it.
/// On failure (fn's own exceptions included) the error propagates and nothing is recorded for
/// (module, api); the forward hooks and registry entries that `fn` added inside the module's tree
/// are removed again. Structural changes cannot be undone (LibTorch cannot unregister a
/// parameter): the error names them. The module must be owned by a std::shared_ptr. Apply APIs
/// to one module tree from one thread at a time.
///
///   std::shared_ptr<FSDPState> state =
///       fsdp::contract::apply_api("fully_shard", *block, [&](torch::nn::Module& m) {
///         auto state = std::make_shared<FSDPState>(m, options);
///         state->register_forward_hooks();
///         return state;
///       });
template <typename Fn>
  requires std::invocable<Fn&, torch::nn::Module&>
auto apply_api(std::string_view api, torch::nn::Module& module, Fn&& fn,
               ModuleStateRegistry& registry = ModuleStateRegistry::global())
    -> std::invoke_result_t<Fn&, torch::nn::Module&> {
  using Result = std::invoke_result_t<Fn&, torch::nn::Module&>;
  static_assert(detail::ApiStatePointer<Result>::value,
                "fsdp::contract::apply_api: fn must return std::shared_ptr<S> where S derives "
                "from fsdp::contract::ApiState");
  std::shared_ptr<ApiState> state = detail::apply_api_erased(
      api, module, [&fn](torch::nn::Module& m) -> std::shared_ptr<ApiState> { return fn(m); },
      registry);
  return std::static_pointer_cast<typename Result::element_type>(std::move(state));
}

}  // namespace fsdp::contract
