#include "fsdp_cpp/contract/hookable_module_list.h"

#include <c10/util/Exception.h>

namespace fsdp::contract {

void ModuleListImpl::push_back(AnyHookableModule module) {
  TORCH_CHECK(!pruned_, "fsdp::contract::ModuleList::push_back: the list was pruned by keep_only "
              "(it holds the elements named ", first_name_, " .. ", first_name_ + static_cast<int64_t>(size()) - 1,
              "); its next name may belong to an element kept elsewhere, so it takes no new elements. "
              "Append before keep_only, or use a new list");
  TORCH_CHECK(!module.is_empty(), "fsdp::contract::ModuleList: element ", size(),
              ": expected a module, got an empty one");
  register_module(std::to_string(size()), module.ptr());
  modules_.push_back(std::move(module));
}

void ModuleListImpl::keep_only(int64_t begin, int64_t end) {
  const int64_t held_end = first_name_ + static_cast<int64_t>(modules_.size());
  TORCH_CHECK(begin <= end, "fsdp::contract::ModuleList::keep_only: expected begin <= end, got the "
              "reversed range [", begin, ", ", end, ")");
  TORCH_CHECK(begin >= first_name_ && end <= held_end, "fsdp::contract::ModuleList::keep_only: the "
              "range [", begin, ", ", end, ") of names is not within the names the list holds, [",
              first_name_, ", ", held_end, ")", (pruned_ ? " (the list was pruned before)" : ""));
  if (begin == first_name_ && end == held_end) return;  // keeps everything
  std::vector<AnyHookableModule> kept;
  kept.reserve(static_cast<size_t>(end - begin));
  for (size_t i = 0; i < modules_.size(); ++i) {
    const int64_t name = first_name_ + static_cast<int64_t>(i);
    if (name >= begin && name < end) {
      kept.push_back(modules_[i]);
    } else {
      unregister_module(std::to_string(name));
    }
  }
  modules_ = std::move(kept);
  first_name_ = begin;
  pruned_ = true;
}

std::string ModuleListImpl::name(size_t index) const {
  TORCH_CHECK(index < modules_.size(), "fsdp::contract::ModuleList::name: position ", index,
              " out of range; expected a position below size() = ", modules_.size());
  return std::to_string(first_name_ + static_cast<int64_t>(index));
}

const AnyHookableModule& ModuleListImpl::operator[](size_t index) const {
  TORCH_CHECK(index < modules_.size(), "fsdp::contract::ModuleList: index ", index,
              " out of range; expected an index below size() = ", modules_.size(),
              (pruned_ ? " (indices are positions in the pruned list, not names)" : ""));
  return modules_[index];
}

std::shared_ptr<torch::nn::Module> ModuleListImpl::ptr(size_t index) const {
  return (*this)[index].ptr();
}

std::shared_ptr<torch::nn::Module> ModuleListImpl::clone(
    const std::optional<torch::Device>& device) const {
  auto copy = std::make_shared<ModuleListImpl>();
  for (size_t i = 0; i < modules_.size(); ++i) {
    AnyHookableModule element = modules_[i].clone(device);
    copy->register_module(name(i), element.ptr());
    copy->modules_.push_back(std::move(element));
  }
  copy->first_name_ = first_name_;
  copy->pruned_ = pruned_;
  return copy;
}

}  // namespace fsdp::contract
