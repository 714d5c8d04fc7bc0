#include "fsdp_cpp/contract/forward_values.h"

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/core/Dict.h>
#include <torch/types.h>

#include "fsdp_cpp/tests/testing/errors.h"

// Catch2 last: c10/util/Logging.h defines a CHECK macro of its own, and the last definition wins.
#include <catch2/catch.hpp>

namespace {

using fsdp::testing::error_of;
using fsdp::contract::for_each_tensor;
using fsdp::contract::from_forward_ivalue;
using fsdp::contract::map_tensors;
using fsdp::contract::stored_forward_value_t;
using fsdp::contract::to_forward_ivalue;

}  // namespace

TEST_CASE("stored types follow the table of [Note: forward values]") {
  STATIC_REQUIRE(std::is_same_v<stored_forward_value_t<int>, int64_t>);
  STATIC_REQUIRE(std::is_same_v<stored_forward_value_t<const float&>, double>);
  STATIC_REQUIRE(std::is_same_v<stored_forward_value_t<const char*>, std::string>);
  STATIC_REQUIRE(std::is_same_v<stored_forward_value_t<c10::IntArrayRef>, std::vector<int64_t>>);
  STATIC_REQUIRE(std::is_same_v<stored_forward_value_t<std::tuple<torch::Tensor, int>>,
                                std::tuple<torch::Tensor, int64_t>>);
  STATIC_REQUIRE(std::is_same_v<stored_forward_value_t<std::optional<unsigned>>,
                                std::optional<int64_t>>);
  STATIC_REQUIRE(fsdp::contract::ForwardValue<std::vector<std::optional<torch::Tensor>>>);
  STATIC_REQUIRE_FALSE(fsdp::contract::ForwardValue<std::vector<void*>>);
}

TEST_CASE("a tensor keeps its identity through the IValue round trip") {
  torch::Tensor x = torch::randn({2, 3});
  c10::IValue boxed = to_forward_ivalue(x);
  REQUIRE(boxed.isTensor());
  CHECK(from_forward_ivalue<torch::Tensor>(boxed, "x").is_same(x));

  torch::Tensor undefined;
  c10::IValue boxed_undefined = to_forward_ivalue(undefined);
  REQUIRE(boxed_undefined.isTensor());
  CHECK_FALSE(from_forward_ivalue<torch::Tensor>(boxed_undefined, "u").defined());
}

TEST_CASE("scalars and strings cross as Int, Double, Bool and String") {
  CHECK(to_forward_ivalue(3).toInt() == 3);
  CHECK(to_forward_ivalue(size_t{7}).toInt() == 7);
  CHECK(to_forward_ivalue(0.5f).toDouble() == 0.5);
  CHECK(to_forward_ivalue(true).toBool());
  CHECK(to_forward_ivalue("mode").toStringRef() == "mode");
  CHECK(to_forward_ivalue(std::string_view("view")).toStringRef() == "view");
  CHECK(from_forward_ivalue<int64_t>(c10::IValue(int64_t{4}), "n") == 4);
  CHECK(from_forward_ivalue<std::string>(c10::IValue("s"), "s") == "s");
}

TEST_CASE("optionals, sequences and tuples keep their structure") {
  CHECK(to_forward_ivalue(std::optional<torch::Tensor>()).isNone());
  torch::Tensor x = torch::ones({2});
  c10::IValue some = to_forward_ivalue(std::optional<torch::Tensor>(x));
  CHECK(from_forward_ivalue<std::optional<torch::Tensor>>(some, "o")->is_same(x));

  std::vector<int64_t> sizes{2, 3};
  c10::IValue int_list = to_forward_ivalue(c10::IntArrayRef(sizes));
  CHECK(int_list.isIntList());
  CHECK(from_forward_ivalue<std::vector<int64_t>>(int_list, "sizes") == sizes);

  torch::Tensor y = torch::zeros({1});
  c10::IValue tensor_list = to_forward_ivalue(std::vector<torch::Tensor>{x, y});
  CHECK(tensor_list.isTensorList());
  auto tensors = from_forward_ivalue<std::vector<torch::Tensor>>(tensor_list, "list");
  REQUIRE(tensors.size() == 2);
  CHECK(tensors[1].is_same(y));

  c10::IValue tuple = to_forward_ivalue(std::make_tuple(x, 5, std::string("k")));
  REQUIRE(tuple.isTuple());
  REQUIRE(tuple.toTupleRef().elements().size() == 3);
  auto [t, n, s] =
      from_forward_ivalue<std::tuple<torch::Tensor, int64_t, std::string>>(tuple, "tuple");
  CHECK(t.is_same(x));
  CHECK(n == 5);
  CHECK(s == "k");
}

TEST_CASE("from_forward_ivalue names the context, the expected type and what it got") {
  const std::string message =
      error_of([] { from_forward_ivalue<torch::Tensor>(c10::IValue(1.5), "argument 0 of M"); });
  CHECK_THAT(message, Catch::StartsWith("argument 0 of M: expected a value of type at::Tensor"));
  CHECK_THAT(message, Catch::Contains("got Double"));

  const std::string tuple_message = error_of([] {
    from_forward_ivalue<std::tuple<torch::Tensor, torch::Tensor>>(
        c10::IValue(std::make_tuple(torch::ones({1}))), "output");
  });
  CHECK_THAT(tuple_message, Catch::Contains("got Tuple"));
}

TEST_CASE("for_each_tensor visits every defined tensor in nested values, in order") {
  torch::Tensor a = torch::ones({1});
  torch::Tensor b = torch::ones({2});
  torch::Tensor c = torch::ones({3});
  torch::Tensor d = torch::ones({4});
  c10::Dict<std::string, torch::Tensor> dict;
  dict.insert("k", d);
  std::vector<c10::IValue> elements{c10::IValue(a),
                                    c10::IValue(std::vector<torch::Tensor>{b, c}),
                                    c10::IValue(5),
                                    c10::IValue(torch::Tensor()),
                                    c10::IValue(),
                                    c10::IValue(dict)};
  c10::IValue value = c10::ivalue::Tuple::create(std::move(elements));

  std::vector<torch::Tensor> seen;
  for_each_tensor(value, [&](const torch::Tensor& t) { seen.push_back(t); });
  REQUIRE(seen.size() == 4);
  CHECK(seen[0].is_same(a));
  CHECK(seen[1].is_same(b));
  CHECK(seen[2].is_same(c));
  CHECK(seen[3].is_same(d));
}

TEST_CASE("map_tensors replaces tensors and keeps the structure") {
  torch::Tensor a = torch::full({2}, 1.0);
  torch::Tensor b = torch::full({2}, 2.0);
  c10::Dict<std::string, torch::Tensor> dict;
  dict.insert("k", b);
  std::vector<c10::IValue> elements{c10::IValue(a), c10::IValue(std::vector<torch::Tensor>{a, b}),
                                    c10::IValue(7), c10::IValue(torch::Tensor()),
                                    c10::IValue(dict)};
  c10::IValue value = c10::ivalue::Tuple::create(std::move(elements));

  c10::IValue mapped = map_tensors(value, [](const torch::Tensor& t) { return t * 10; });

  REQUIRE(mapped.isTuple());
  const auto& out = mapped.toTupleRef().elements();
  REQUIRE(out.size() == 5);
  CHECK(torch::equal(out[0].toTensor(), torch::full({2}, 10.0)));
  REQUIRE(out[1].isTensorList());
  auto list = out[1].toTensorVector();
  REQUIRE(list.size() == 2);
  CHECK(torch::equal(list[1], torch::full({2}, 20.0)));
  CHECK(out[2].toInt() == 7);
  CHECK_FALSE(out[3].toTensor().defined());
  auto mapped_dict = out[4].toGenericDict();
  CHECK(torch::equal(mapped_dict.at("k").toTensor(), torch::full({2}, 20.0)));
  // The input is untouched.
  CHECK(torch::equal(value.toTupleRef().elements()[0].toTensor(), a));
  CHECK(torch::equal(a, torch::full({2}, 1.0)));
}
