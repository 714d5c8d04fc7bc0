#include "fsdp_cpp/contract/hookable_sequential.h"

namespace fsdp::contract {

void SequentialImpl::push_back(AnyHookableModule module) {
  push_back(std::to_string(size()), std::move(module));
}

void SequentialImpl::push_back(std::string name, AnyHookableModule module) {
  TORCH_CHECK(!module.is_empty(), "fsdp::contract::Sequential: child '", name,
              "': expected a module, got an empty one");
  TORCH_CHECK(module.is_callable(), "fsdp::contract::Sequential: child '", name, "' (",
              module.ptr()->name(),
              ") cannot be called: expected one plain forward or a forward_ivalues member; "
              "hint: hold it in a ModuleList instead");
  register_module(name, module.ptr());
  names_.push_back(std::move(name));
  modules_.push_back(std::move(module));
}

c10::IValue SequentialImpl::forward_ivalues(const ForwardArgs& args) {
  TORCH_CHECK(!is_empty(), "fsdp::contract::Sequential: cannot run forward with no children; "
              "hint: push_back() modules first");
  c10::IValue value;
  for (size_t i = 0; i < modules_.size(); ++i) {
    try {
      value = i == 0 ? modules_[i].forward_ivalues(args)
                     : modules_[i].forward_ivalues(ForwardArgs{std::move(value)});
    } catch (c10::Error& error) {
      error.add_context("while running child '" + names_[i] + "' (" + modules_[i].ptr()->name() +
                        ") of fsdp::contract::Sequential");
      throw;
    }
  }
  return value;
}

const AnyHookableModule& SequentialImpl::operator[](size_t index) const {
  TORCH_CHECK(index < modules_.size(), "fsdp::contract::Sequential: index ", index,
              " out of range; expected an index below size() = ", modules_.size());
  return modules_[index];
}

std::shared_ptr<torch::nn::Module> SequentialImpl::ptr(size_t index) const {
  return (*this)[index].ptr();
}

std::shared_ptr<torch::nn::Module> SequentialImpl::clone(
    const std::optional<torch::Device>& device) const {
  auto copy = std::make_shared<SequentialImpl>();
  for (size_t i = 0; i < modules_.size(); ++i) {
    copy->push_back(names_[i], modules_[i].clone(device));
  }
  return copy;
}

}  // namespace fsdp::contract
