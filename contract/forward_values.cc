#include "fsdp_cpp/contract/forward_values.h"

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>

namespace fsdp::contract {

namespace detail {

void throw_forward_ivalue_mismatch(std::string_view context, const char* expected,
                                   const c10::IValue& got, const c10::Error& error) {
  TORCH_CHECK(false, context, ": expected a value of type ", expected, ", got ", got.tagKind(),
              " (", error.what_without_backtrace(),
              "); hint: a forward hook may replace a value only by one of the same type");
}

}  // namespace detail

void for_each_tensor(const c10::IValue& value, const std::function<void(const at::Tensor&)>& fn) {
  if (value.isTensor()) {
    const at::Tensor& tensor = value.toTensor();
    if (tensor.defined()) {
      fn(tensor);
    }
  } else if (value.isTuple()) {
    for (const c10::IValue& element : value.toTupleRef().elements()) {
      for_each_tensor(element, fn);
    }
  } else if (value.isList()) {
    for (const c10::IValue& element : value.toListRef()) {
      for_each_tensor(element, fn);
    }
  } else if (value.isGenericDict()) {
    for (const auto& item : value.toGenericDict()) {
      for_each_tensor(item.value(), fn);
    }
  }
}

c10::IValue map_tensors(const c10::IValue& value,
                        const std::function<at::Tensor(const at::Tensor&)>& fn) {
  if (value.isTensor()) {
    const at::Tensor& tensor = value.toTensor();
    return tensor.defined() ? c10::IValue(fn(tensor)) : value;
  }
  if (value.isTuple()) {
    std::vector<c10::IValue> elements;
    elements.reserve(value.toTupleRef().elements().size());
    for (const c10::IValue& element : value.toTupleRef().elements()) {
      elements.push_back(map_tensors(element, fn));
    }
    return c10::ivalue::Tuple::create(std::move(elements));
  }
  if (value.isList()) {
    c10::impl::GenericList in = value.toList();
    c10::impl::GenericList out(in.elementType());
    out.reserve(in.size());
    for (const c10::IValue& element : value.toListRef()) {
      out.push_back(map_tensors(element, fn));
    }
    return out;
  }
  if (value.isGenericDict()) {
    c10::impl::GenericDict in = value.toGenericDict();
    c10::impl::GenericDict out(in.keyType(), in.valueType());
    out.reserve(in.size());
    for (const auto& item : in) {
      out.insert(item.key(), map_tensors(item.value(), fn));
    }
    return out;
  }
  return value;
}

}  // namespace fsdp::contract
