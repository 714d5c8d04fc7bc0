#include "fsdp_cpp/contract/hooked_call.h"

#include <string>
#include <string_view>

#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include "fsdp_cpp/contract/module_state.h"

namespace fsdp::contract::detail {
namespace {

std::string describe(const torch::nn::Module& module) {
  return ModuleStateRegistry::global().describe(module);
}

// "method <its type>" for call_method, "the callable returning <type>" for call_with_hooks.
std::string describe_callable(std::string_view api, const char* callable) {
  return (api == "call_method" ? "method " : "the callable returning ") + std::string(callable);
}

}  // namespace

void throw_hooked_value_mismatch(const torch::nn::Module& module, const char* api,
                                 const char* callable, std::string_view what, size_t index,
                                 const char* expected, const c10::IValue& got,
                                 const c10::Error& error) {
  if (what == "output") {
    TORCH_CHECK(false, "fsdp::contract::", api, ": the output of ", describe_callable(api, callable),
                " on module ",
                describe(module), " after its post-forward hooks: expected a value of type ",
                expected, ", got ", got.tagKind(), " (", error.what_without_backtrace(),
                "); hint: a post-forward hook may replace the output only by a value of the same "
                "type");
  }
  TORCH_CHECK(false, "fsdp::contract::", api, ": ", what, " ", index, " of ",
              describe_callable(api, callable), " on module ", describe(module),
              " (after the pre-forward hooks): expected a value of type ", expected, ", got ",
              got.tagKind(), " (", error.what_without_backtrace(),
              "); hint: a pre-forward hook may replace an argument only by a value of the same "
              "type");
}

void throw_output_replaced(const torch::nn::Module& module, const char* api,
                           const char* result_type, const c10::IValue& got) {
  TORCH_CHECK(false, "fsdp::contract::", api, ": a post-forward hook of module ", describe(module),
              " replaced the output by a ", got.tagKind(), ", but the call returns ", result_type,
              ", which hooks cannot see (they see None; expected the output left as None); hint: "
              "return a forward value (tensors, tuples and vectors of them, scalars, strings) for "
              "hooks to see and replace it");
}

void throw_call_not_run(const torch::nn::Module& module, const char* api) {
  TORCH_CHECK(false, "fsdp::contract::", api, ": the forward wrappers of module ", describe(module),
              " returned without running the call, whose result is not a forward value: expected "
              "the innermost wrapper to run it once, found no result to return");
}

void throw_callable_expired(const std::weak_ptr<torch::nn::Module>& module) {
  const std::shared_ptr<torch::nn::Module> live = module.lock();
  TORCH_CHECK(false, "fsdp::contract::call_with_hooks: a forward wrapper of module ",
              live ? describe(*live) : std::string("(destroyed)"),
              " ran the callable again after call_with_hooks returned (e.g. activation "
              "checkpointing recomputing it in backward); expected it to run only during the "
              "call, since the callable may refer to the caller's variables; hint: call the "
              "method with fsdp::contract::call_method, which wrappers may run again, or run the "
              "call under c10::NoGradGuard");
}

}  // namespace fsdp::contract::detail
