#pragma once

// Hook-able module holders: `FSDP_HOOKABLE_MODULE(Name)`, used instead of `TORCH_MODULE(Name)`.

#include <utility>

#include <torch/nn/pimpl.h>

#include "fsdp_cpp/contract/forward_hooks.h"
#include "fsdp_cpp/contract/module_state.h"

namespace fsdp::contract {

/// A `torch::nn::ModuleHolder` whose call operator runs the module's forward hooks around
/// `forward` ([Note: forward hooks] in contract/forward_hooks.h). Everything else (construction,
/// `->`, `*`, `ptr()`, `register_module`) is the ModuleHolder's. Declare holders with
/// FSDP_HOOKABLE_MODULE rather than naming this class. Every such holder satisfies HookableHolder
/// (APIs that rely on hooks refuse LibTorch's holders at compile time).
///
///   torch::Tensor y = block(x);          // pre-forward hooks, BlockImpl::forward, post-forward hooks
///   torch::Tensor z = block->forward(x); // bypasses the hooks: unsupported on managed modules
template <typename Contained>
class HookableModuleHolder : public torch::nn::ModuleHolder<Contained>,
                             public HookableHolderIndicator {
 public:
  using torch::nn::ModuleHolder<Contained>::ModuleHolder;

  /// Calls the contained module's `forward(args...)` with its forward hooks around it. The
  /// argument and output types must be forward values ([Note: forward values]).
  ///
  ///   auto y = block(x);
  template <typename... Args>
  auto operator()(Args&&... args)
      -> decltype(run_forward(std::declval<Contained&>(), std::forward<Args>(args)...)) {
    return run_forward(*this->get(), std::forward<Args>(args)...);
  }
};

/// torch::save(holder, ...) of a hook-able holder: LibTorch's operator for module holders, after
/// the serialization veto. Overload resolution picks these operators over LibTorch's (found by
/// argument-dependent lookup, they take the more derived holder class). Not covered: torch::save
/// of `holder.ptr()` or of a LibTorch holder, which reach LibTorch's operators directly.
template <typename Contained>
torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                            const HookableModuleHolder<Contained>& module) {
  check_serializable(*module.ptr(), "torch::save");
  return archive << module.ptr();
}

/// torch::load(holder, ...) of a hook-able holder, after the serialization veto (see operator<<).
template <typename Contained>
torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive,
                                           HookableModuleHolder<Contained>& module) {
  check_serializable(*module.ptr(), "torch::load");
  return archive >> module.ptr();
}

}  // namespace fsdp::contract

/// Like `TORCH_MODULE_IMPL(Name, ImplType)`: defines the holder class `Name` over `ImplType`,
/// whose call operator runs the forward hooks.
///
///   FSDP_HOOKABLE_MODULE_IMPL(Block, MyBlockImpl);
#define FSDP_HOOKABLE_MODULE_IMPL(Name, ImplType)                                       \
  class Name : public ::fsdp::contract::HookableModuleHolder<ImplType> { /* NOLINT */   \
   public:                                                                               \
    using ::fsdp::contract::HookableModuleHolder<ImplType>::HookableModuleHolder;        \
    using Impl TORCH_UNUSED_EXCEPT_CUDA = ImplType;                                      \
  }

/// Opts the module class `Name##Impl` into forward hooks: the one line that replaces
/// `TORCH_MODULE(Name)`. `Name` is then a holder exactly like TORCH_MODULE's, except that
/// `name(args...)` runs the hooks registered on the module around `forward`.
///
///   struct BlockImpl : torch::nn::Module {
///     BlockImpl() { fc = register_module("fc", fsdp::contract::Linear(4, 4)); }
///     torch::Tensor forward(torch::Tensor x) { return fc(x).relu(); }   // fc's hooks run
///     fsdp::contract::Linear fc = nullptr;
///   };
///   FSDP_HOOKABLE_MODULE(Block);   // instead of TORCH_MODULE(Block)
///
///   Block block;
///   torch::Tensor y = block(x);    // Block's hooks run around BlockImpl::forward
///
/// Requirements: forward's argument and output types are forward values ([Note: forward
/// values]). Calling `block->forward(x)` bypasses the hooks and is unsupported once an API
/// manages the module.
#define FSDP_HOOKABLE_MODULE(Name) FSDP_HOOKABLE_MODULE_IMPL(Name, Name##Impl)
