#include "fsdp_cpp/contract/hookable_module_list.h"

namespace fsdp::contract {

void ModuleListImpl::push_back(AnyHookableModule module) {
  TORCH_CHECK(!module.is_empty(), "fsdp::contract::ModuleList: element ", size(),
              ": expected a module, got an empty one");
  register_module(std::to_string(size()), module.ptr());
  modules_.push_back(std::move(module));
}

const AnyHookableModule& ModuleListImpl::operator[](size_t index) const {
  TORCH_CHECK(index < modules_.size(), "fsdp::contract::ModuleList: index ", index,
              " out of range; expected an index below size() = ", modules_.size());
  return modules_[index];
}

std::shared_ptr<torch::nn::Module> ModuleListImpl::ptr(size_t index) const {
  return (*this)[index].ptr();
}

std::shared_ptr<torch::nn::Module> ModuleListImpl::clone(
    const std::optional<torch::Device>& device) const {
  auto copy = std::make_shared<ModuleListImpl>();
  for (const AnyHookableModule& module : modules_) {
    copy->push_back(module.clone(device));
  }
  return copy;
}

}  // namespace fsdp::contract
