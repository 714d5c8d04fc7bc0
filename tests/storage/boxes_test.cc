// [Note: boxes]: flat ranges <-> boxes and runs, against brute force over every range of several
// shapes (0-d, 1-d, 2-d, 3-d and 4-d with size-1 dimensions).
#include "fsdp_cpp/storage/boxes.h"

#include <algorithm>
#include <climits>
#include <string>

// Last: LibTorch's c10/util/Logging.h defines its own CHECK, and the last definition wins.
#include <catch2/catch.hpp>

using fsdp::storage::Box;
using fsdp::storage::boxes_of_flat_range;
using fsdp::storage::Run;
using fsdp::storage::runs_of_box;

namespace {

using Shape = std::vector<int64_t>;

int64_t numel_of(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Shape multi_index(const Shape& shape, int64_t flat) {
  Shape index(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    index[d] = flat % shape[d];
    flat /= shape[d];
  }
  return index;
}

int64_t flat_index(const Shape& shape, const Shape& index) {
  int64_t flat = 0;
  for (size_t d = 0; d < shape.size(); ++d) flat = flat * shape[d] + index[d];
  return flat;
}

// Flat indices of a box's elements in the box's own row-major order, by enumeration.
std::vector<int64_t> elements_of(const Shape& shape, const Box& box) {
  std::vector<int64_t> out;
  for (int64_t local = 0; local < box.numel(); ++local) {
    Shape index = multi_index(box.sizes, local);
    for (size_t d = 0; d < shape.size(); ++d) index[d] += box.offsets[d];
    out.push_back(flat_index(shape, index));
  }
  return out;
}

// Whether flat range [begin, end) is exactly the set of elements of some box: its bounding box
// holds as many elements as the range.
bool range_is_box(const Shape& shape, int64_t begin, int64_t end) {
  Shape lo = multi_index(shape, begin), hi = lo;
  for (int64_t f = begin; f < end; ++f) {
    const Shape index = multi_index(shape, f);
    for (size_t d = 0; d < shape.size(); ++d) {
      lo[d] = std::min(lo[d], index[d]);
      hi[d] = std::max(hi[d], index[d]);
    }
  }
  int64_t volume = 1;
  for (size_t d = 0; d < shape.size(); ++d) volume *= hi[d] - lo[d] + 1;
  return volume == end - begin;
}

// Fewest boxes that tile [begin, end) in flat order (each box a contiguous piece), by dynamic
// programming over every split point.
int fewest_boxes(const Shape& shape, int64_t begin, int64_t end) {
  std::vector<int> best(static_cast<size_t>(end - begin + 1), INT_MAX);
  best[0] = 0;
  for (int64_t i = begin + 1; i <= end; ++i) {
    for (int64_t j = begin; j < i; ++j) {
      if (best[j - begin] != INT_MAX && range_is_box(shape, j, i)) {
        best[i - begin] = std::min(best[i - begin], best[j - begin] + 1);
      }
    }
  }
  return best[end - begin];
}

std::string describe(const Shape& shape, int64_t begin, int64_t end) {
  std::string s = "shape [";
  for (size_t d = 0; d < shape.size(); ++d) s += (d ? ", " : "") + std::to_string(shape[d]);
  return s + "] range [" + std::to_string(begin) + ", " + std::to_string(end) + ")";
}

const std::vector<Shape> kShapes = {{7}, {4, 5}, {1, 6}, {6, 1}, {2, 3, 4}, {3, 1, 4}, {2, 1, 3, 2}};

}  // namespace

TEST_CASE("the example of the note: [4, 5], elements [7, 18)", "[storage][boxes]") {
  const auto boxes = boxes_of_flat_range({4, 5}, 7, 18);
  REQUIRE(boxes.size() == 3);
  CHECK(boxes[0] == Box{{1, 2}, {1, 3}});
  CHECK(boxes[1] == Box{{2, 0}, {1, 5}});
  CHECK(boxes[2] == Box{{3, 0}, {1, 3}});
}

TEST_CASE("every flat range splits into the fewest boxes, in flat order", "[storage][boxes]") {
  for (const auto& shape : kShapes) {
    const int64_t n = numel_of(shape);
    for (int64_t begin = 0; begin <= n; ++begin) {
      for (int64_t end = begin; end <= n; ++end) {
        INFO(describe(shape, begin, end));
        const auto boxes = boxes_of_flat_range(shape, begin, end);
        // Concatenated in order, the boxes' elements are exactly begin, begin + 1, ..., end - 1.
        std::vector<int64_t> covered;
        for (const auto& box : boxes) {
          REQUIRE(box.offsets.size() == shape.size());
          REQUIRE(box.sizes.size() == shape.size());
          for (size_t d = 0; d < shape.size(); ++d) {
            REQUIRE(box.sizes[d] >= 1);
            REQUIRE(box.offsets[d] + box.sizes[d] <= shape[d]);
          }
          const auto elements = elements_of(shape, box);
          covered.insert(covered.end(), elements.begin(), elements.end());
        }
        std::vector<int64_t> expected(static_cast<size_t>(end - begin));
        for (int64_t i = begin; i < end; ++i) expected[i - begin] = i;
        REQUIRE(covered == expected);
        CHECK(static_cast<int64_t>(boxes.size()) <= std::max<int64_t>(0, 2 * static_cast<int64_t>(shape.size()) - 1));
        CHECK(static_cast<int>(boxes.size()) == (begin == end ? 0 : fewest_boxes(shape, begin, end)));
      }
    }
  }
}

TEST_CASE("a 0-d tensor's only element is one empty box; empty ranges give none", "[storage][boxes]") {
  const auto boxes = boxes_of_flat_range({}, 0, 1);
  REQUIRE(boxes.size() == 1);
  CHECK(boxes[0].offsets.empty());
  CHECK(boxes[0].sizes.empty());
  CHECK(boxes[0].numel() == 1);
  CHECK(boxes_of_flat_range({}, 0, 0).empty());
  CHECK(boxes_of_flat_range({}, 1, 1).empty());
  CHECK(boxes_of_flat_range({3, 0, 2}, 0, 0).empty());
  CHECK(boxes_of_flat_range({4, 5}, 9, 9).empty());

  const auto runs = runs_of_box({}, boxes[0], 0, 1);
  REQUIRE(runs.size() == 1);
  CHECK(runs[0] == Run{0, 0, 1});
  CHECK(runs_of_box({}, boxes[0], 0, 0).empty());
  CHECK(runs_of_box({}, boxes[0], 1, 5).empty());
}

TEST_CASE("runs of every box of small shapes, clipped to every range, against enumeration", "[storage][boxes]") {
  for (const auto& shape : {Shape{5}, Shape{3, 4}, Shape{2, 3, 2}, Shape{3, 1, 2}, Shape{1, 4, 1}}) {
    const int64_t n = numel_of(shape);
    // Every box of the shape: all offsets and sizes.
    std::vector<Box> boxes{{Shape(shape.size(), 0), Shape(shape.size(), 1)}};
    for (size_t d = 0; d < shape.size(); ++d) {
      std::vector<Box> grown;
      for (const auto& b : boxes) {
        for (int64_t o = 0; o < shape[d]; ++o) {
          for (int64_t s = 1; o + s <= shape[d]; ++s) {
            Box g = b;
            g.offsets[d] = o;
            g.sizes[d] = s;
            grown.push_back(g);
          }
        }
      }
      boxes = std::move(grown);
    }
    for (const auto& box : boxes) {
      const auto elements = elements_of(shape, box);  // local index -> global index
      for (int64_t begin = 0; begin <= n; ++begin) {
        for (int64_t end = begin; end <= n; ++end) {
          const auto runs = runs_of_box(shape, box, begin, end);
          // Expected: the box's elements inside [begin, end), grouped into maximal runs where both
          // the global and the local index step by one.
          std::vector<Run> expected;
          for (int64_t local = 0; local < static_cast<int64_t>(elements.size()); ++local) {
            const int64_t g = elements[local];
            if (g < begin || g >= end) continue;
            if (!expected.empty() && expected.back().global_begin + expected.back().length == g &&
                expected.back().local_begin + expected.back().length == local) {
              ++expected.back().length;
            } else {
              expected.push_back({g, local, 1});
            }
          }
          INFO(describe(shape, begin, end) << " box offsets[0] " << box.offsets[0] << " sizes[0] " << box.sizes[0]);
          REQUIRE(runs == expected);
        }
      }
    }
  }
}

TEST_CASE("a box spanning the trailing dimensions is one run per leading index", "[storage][boxes]") {
  // Shape [3, 4, 5]: rows 1..2 of dimension 1 in every slab, whole last dimension.
  const Box box{{0, 1, 0}, {3, 2, 5}};
  const auto runs = runs_of_box({3, 4, 5}, box, 0, 60);
  REQUIRE(runs.size() == 3);
  CHECK(runs[0] == Run{5, 0, 10});
  CHECK(runs[1] == Run{25, 10, 10});
  CHECK(runs[2] == Run{45, 20, 10});
  // A box of whole trailing dimensions at a leading offset is one run.
  CHECK(runs_of_box({3, 4, 5}, Box{{1, 0, 0}, {2, 4, 5}}, 0, 60) == std::vector<Run>{{20, 0, 40}});
  // Clipping inside a large box finds the runs without scanning the others.
  const auto clipped = runs_of_box({100000, 8}, Box{{0, 2}, {100000, 3}}, 8 * 70000 + 3, 8 * 70001 + 1);
  CHECK(clipped == std::vector<Run>{{8 * 70000 + 3, 3 * 70000 + 1, 2}});
}

TEST_CASE("boxes and runs refuse ranges and boxes outside the tensor", "[storage][boxes]") {
  using Catch::Matchers::Contains;
  REQUIRE_THROWS_WITH(boxes_of_flat_range({4, 5}, 3, 21),
                      Contains("boxes_of_flat_range") && Contains("[3, 21)") && Contains("20 elements"));
  REQUIRE_THROWS_WITH(boxes_of_flat_range({4, 5}, 5, 4), Contains("[5, 4)"));
  REQUIRE_THROWS_WITH(boxes_of_flat_range({4, -1}, 0, 0), Contains("negative size"));
  REQUIRE_THROWS_WITH(runs_of_box({4, 5}, Box{{3, 0}, {2, 5}}, 0, 20),
                      Contains("runs_of_box") && Contains("does not fit") && Contains("dimension 0"));
  REQUIRE_THROWS_WITH(runs_of_box({4, 5}, Box{{0}, {4}}, 0, 20), Contains("1 offsets"));
}
