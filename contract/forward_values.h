#pragma once

// How the arguments and the output of a module's `forward` appear to forward hooks.
//
// [Note: forward values]
// Hooks see a forward call's positional arguments as a `ForwardArgs` (std::vector<c10::IValue>)
// and its output as one c10::IValue, so one hook works for any forward signature. A C++ value
// crosses into an IValue and back as its *stored type*:
//
//   C++ type at the call (or in forward's signature)    stored type         IValue tag
//   at::Tensor (also undefined)                         at::Tensor          Tensor
//   bool                                                bool                Bool
//   other integers (int, int64_t, size_t, ...)          int64_t             Int
//   float, double                                       double              Double
//   std::string, std::string_view, const char*          std::string         String
//   at::Scalar                                          at::Scalar          Int/Double/...
//   c10::IValue                                         c10::IValue         (as is)
//   std::optional<T>                                    std::optional<S>    None or S's tag
//   std::vector<T>, c10::ArrayRef<T>                    std::vector<S>      TensorList, IntList,
//                                                                           ..., GenericList
//   std::tuple<T...>                                    std::tuple<S...>    Tuple
//
// A hook may replace a value by another of the same stored type (a tensor by a tensor, a tuple by
// a tuple of the same arity and element types); anything else fails the call with an error naming
// the module and the argument. Any other C++ type fails to compile where a hook-able call path is
// instantiated (static_assert naming the rule). Tensors keep their identity through the round trip.
// Never call IValue::type() on these values: it throws on undefined tensors; use tagKind().

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/ivalue.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <c10/util/Type.h>

namespace fsdp::contract {

/// The positional arguments of one forward call, as hooks see them ([Note: forward values]).
using ForwardArgs = std::vector<c10::IValue>;

/// Maps a C++ type to the type it is stored as inside an IValue ([Note: forward values]).
/// `supported` is false for types hooks cannot see.
template <typename T, typename = void>
struct ForwardValueTraits {
  static constexpr bool supported = false;
};

/// True when values of `T` (cv-ref qualifiers ignored) can cross into hooks.
template <typename T>
concept ForwardValue = ForwardValueTraits<std::decay_t<T>>::supported;

/// The stored type of `T`, e.g. `int64_t` for `int`, `std::vector<int64_t>` for `IntArrayRef`.
template <typename T>
using stored_forward_value_t = typename ForwardValueTraits<std::decay_t<T>>::stored_type;

namespace detail {
template <typename S>
struct SimpleStoredValue {
  static constexpr bool supported = true;
  using stored_type = S;
};
}  // namespace detail

template <>
struct ForwardValueTraits<at::Tensor> : detail::SimpleStoredValue<at::Tensor> {};
template <>
struct ForwardValueTraits<bool> : detail::SimpleStoredValue<bool> {};
template <typename T>
struct ForwardValueTraits<T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>>>
    : detail::SimpleStoredValue<int64_t> {};
template <typename T>
struct ForwardValueTraits<T, std::enable_if_t<std::is_floating_point_v<T>>>
    : detail::SimpleStoredValue<double> {};
template <>
struct ForwardValueTraits<std::string> : detail::SimpleStoredValue<std::string> {};
template <>
struct ForwardValueTraits<std::string_view> : detail::SimpleStoredValue<std::string> {};
template <>
struct ForwardValueTraits<const char*> : detail::SimpleStoredValue<std::string> {};
template <>
struct ForwardValueTraits<char*> : detail::SimpleStoredValue<std::string> {};
template <>
struct ForwardValueTraits<at::Scalar> : detail::SimpleStoredValue<at::Scalar> {};
template <>
struct ForwardValueTraits<c10::IValue> : detail::SimpleStoredValue<c10::IValue> {};

template <typename T>
struct ForwardValueTraits<std::optional<T>, std::enable_if_t<ForwardValue<T>>>
    : detail::SimpleStoredValue<std::optional<stored_forward_value_t<T>>> {};
template <typename T>
struct ForwardValueTraits<std::vector<T>, std::enable_if_t<ForwardValue<T>>>
    : detail::SimpleStoredValue<std::vector<stored_forward_value_t<T>>> {};
template <typename T>
struct ForwardValueTraits<c10::ArrayRef<T>, std::enable_if_t<ForwardValue<T>>>
    : detail::SimpleStoredValue<std::vector<stored_forward_value_t<T>>> {};
template <typename... T>
struct ForwardValueTraits<std::tuple<T...>, std::enable_if_t<(ForwardValue<T> && ...)>>
    : detail::SimpleStoredValue<std::tuple<stored_forward_value_t<T>...>> {};

namespace detail {

template <typename T>
struct IsOptional : std::false_type {};
template <typename T>
struct IsOptional<std::optional<T>> : std::true_type {};
template <typename T>
struct IsSequence : std::false_type {};
template <typename T>
struct IsSequence<std::vector<T>> : std::true_type {};
template <typename T>
struct IsSequence<c10::ArrayRef<T>> : std::true_type {};
template <typename T>
struct IsTuple : std::false_type {};
template <typename... T>
struct IsTuple<std::tuple<T...>> : std::true_type {};

// Converts a C++ value to its stored type (recursively through optionals, sequences, tuples).
template <typename T>
stored_forward_value_t<T> to_stored(const T& value) {
  using V = std::decay_t<T>;
  using S = stored_forward_value_t<T>;
  if constexpr (IsOptional<V>::value) {
    return value.has_value() ? S(to_stored(*value)) : S();
  } else if constexpr (IsSequence<V>::value) {
    S stored;
    stored.reserve(value.size());
    for (const auto& element : value) {
      stored.push_back(to_stored(element));
    }
    return stored;
  } else if constexpr (IsTuple<V>::value) {
    return std::apply([](const auto&... element) { return S(to_stored(element)...); }, value);
  } else {
    return S(value);
  }
}

// Converts a stored value back to a C++ type `T` that owns its data (`int` from int64_t,
// std::vector<int> from std::vector<int64_t>, ...). View types (ArrayRef, string_view, const
// char*) are not outputs: bind them to the stored value instead.
template <typename T, typename S>
T from_stored(S&& stored) {
  using V = std::remove_cvref_t<S>;
  if constexpr (std::is_same_v<T, V>) {
    return std::forward<S>(stored);
  } else if constexpr (IsOptional<T>::value) {
    return stored.has_value() ? T(from_stored<typename T::value_type>(std::move(*stored))) : T();
  } else if constexpr (IsSequence<T>::value) {
    T out;
    out.reserve(stored.size());
    for (auto& element : stored) {
      out.push_back(from_stored<typename T::value_type>(std::move(element)));
    }
    return out;
  } else if constexpr (IsTuple<T>::value) {
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return T(from_stored<std::tuple_element_t<I, T>>(std::move(std::get<I>(stored)))...);
    }(std::make_index_sequence<std::tuple_size_v<T>>{});
  } else {
    static_assert(std::is_constructible_v<T, V&&>,
                  "fsdp::contract: cannot convert a stored forward value back to this type "
                  "([Note: forward values] in contract/forward_values.h)");
    return T(std::move(stored));
  }
}

// Throws "<context>: expected a value of type <expected>, got <tag> (<error>); hint: ...".
[[noreturn]] void throw_forward_ivalue_mismatch(std::string_view context, const char* expected,
                                                const c10::IValue& got, const c10::Error& error);

}  // namespace detail

/// Converts a forward argument or output to the IValue that hooks see.
///
///   ForwardArgs args{to_forward_ivalue(x), to_forward_ivalue(2), to_forward_ivalue(true)};
template <typename T>
c10::IValue to_forward_ivalue(const T& value) {
  static_assert(ForwardValue<T>,
                "fsdp::contract: this type cannot cross into forward hooks; forward's arguments "
                "and output must be tensors, bool, integers, floats, strings, at::Scalar, "
                "c10::IValue, or optionals, vectors, ArrayRefs and tuples of these "
                "([Note: forward values] in contract/forward_values.h)");
  return c10::IValue(detail::to_stored(value));
}

/// Converts an IValue back to the stored type `S` (see stored_forward_value_t). On a mismatch
/// throws c10::Error: "<context>: expected <S>, got <tag>". `context` names the value, e.g.
/// "fsdp::contract: argument 0 of BlockImpl::forward after its pre-forward hooks".
///
///   auto x = from_forward_ivalue<at::Tensor>(args[0], "argument 0");
template <typename S>
S from_forward_ivalue(c10::IValue value, std::string_view context) {
  try {
    return c10::IValue(value).to<S>();
  } catch (const c10::Error& error) {
    detail::throw_forward_ivalue_mismatch(context, c10::demangle_type<S>(), value, error);
  }
}

/// Calls `fn` on every defined tensor inside `value` (tensors, and tensors nested in tuples,
/// lists, dicts and optionals), in order. Other values and undefined tensors are skipped.
/// An FSDP post-forward hook uses it to register pre-backward hooks on a module's outputs.
///
///   for_each_tensor(output, [&](const at::Tensor& t) { if (t.requires_grad()) ...; });
void for_each_tensor(const c10::IValue& value, const std::function<void(const at::Tensor&)>& fn);

/// Returns `value` with every defined tensor `t` inside it replaced by `fn(t)`, keeping the
/// structure (tuples stay tuples of the same arity, lists keep their element type, dict keys are
/// kept). Used to cast floating-point forward inputs for mixed precision, or to route outputs
/// through an autograd function.
///
///   args[0] = map_tensors(args[0], [](const at::Tensor& t) { return t.to(at::kBFloat16); });
c10::IValue map_tensors(const c10::IValue& value,
                        const std::function<at::Tensor(const at::Tensor&)>& fn);

}  // namespace fsdp::contract
