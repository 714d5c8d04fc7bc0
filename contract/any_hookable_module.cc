#include "fsdp_cpp/contract/any_hookable_module.h"

namespace fsdp::contract {

c10::IValue AnyHookableModule::forward_ivalues(const ForwardArgs& args) const {
  TORCH_CHECK(!is_empty(),
              "fsdp::contract::AnyHookableModule: cannot call forward on an empty module");
  TORCH_CHECK(is_callable(), "fsdp::contract: module ", module_->name(),
              " cannot be called through its hooks: expected one non-template, non-overloaded, "
              "non-const forward whose argument and output types are forward values, or a "
              "`c10::IValue forward_ivalues(const ForwardArgs&)` member; got neither");
  // A copy of this holder: forward wrappers may keep the function to run forward again later.
  return run_forward_ivalues(*module_, args,
                             [self = *this](const ForwardArgs& a) { return self.invoke_(self, a); });
}

const std::shared_ptr<torch::nn::Module>& AnyHookableModule::ptr() const {
  TORCH_CHECK(!is_empty(), "fsdp::contract::AnyHookableModule: no module held (empty)");
  return module_;
}

AnyHookableModule AnyHookableModule::clone(const std::optional<torch::Device>& device) const {
  TORCH_CHECK(!is_empty(), "fsdp::contract::AnyHookableModule: cannot clone an empty module");
  return clone_(*this, device);
}

}  // namespace fsdp::contract
