#include "fsdp_cpp/storage/boxes.h"

#include <algorithm>

#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

namespace fsdp::storage {
namespace {

int64_t checked_numel(const std::vector<int64_t>& shape, const char* api) {
  int64_t numel = 1;
  for (size_t d = 0; d < shape.size(); ++d) {
    TORCH_CHECK(shape[d] >= 0, api, ": dimension ", d, " of the shape has negative size ", shape[d]);
    TORCH_CHECK(!__builtin_mul_overflow(numel, shape[d], &numel), api,
                ": the shape's element count overflows int64");
  }
  return numel;
}

// Row-major strides, in elements.
std::vector<int64_t> strides_of(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) strides[d - 1] = strides[d] * shape[d];
  return strides;
}

// Appends the boxes of flat range [begin, end) (non-empty) of the sub-tensor of `shape` made of
// dimensions [dim, ndim) at the leading index `prefix` (one index per dimension before `dim`).
// The sub-tensor's elements at dimensions >= dim + 1 form rows of `inner` elements: a range that
// starts and ends on row boundaries is one box; otherwise it splits into a partial first row
// (recursively), the whole rows in between (one box), and a partial last row (recursively).
void append_boxes(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides, size_t dim,
                  std::vector<int64_t>& prefix, int64_t begin, int64_t end, std::vector<Box>& out) {
  const int64_t inner = strides[dim];
  auto whole_rows = [&](int64_t first_row, int64_t row_count) {
    Box box;
    box.offsets = prefix;
    box.sizes.assign(prefix.size(), 1);
    box.offsets.push_back(first_row);
    box.sizes.push_back(row_count);
    for (size_t d = dim + 1; d < shape.size(); ++d) {
      box.offsets.push_back(0);
      box.sizes.push_back(shape[d]);
    }
    out.push_back(std::move(box));
  };
  auto partial_row = [&](int64_t row, int64_t row_begin, int64_t row_end) {
    prefix.push_back(row);
    append_boxes(shape, strides, dim + 1, prefix, row_begin, row_end, out);
    prefix.pop_back();
  };
  if (begin % inner == 0 && end % inner == 0) {
    whole_rows(begin / inner, (end - begin) / inner);
    return;
  }
  const int64_t first_row = begin / inner;
  const int64_t last_row = (end - 1) / inner;
  if (first_row == last_row) {
    partial_row(first_row, begin - first_row * inner, end - first_row * inner);
    return;
  }
  int64_t middle_begin = first_row;
  if (begin % inner != 0) {
    partial_row(first_row, begin % inner, inner);
    middle_begin = first_row + 1;
  }
  const int64_t middle_end = end % inner != 0 ? last_row : last_row + 1;
  if (middle_end > middle_begin) whole_rows(middle_begin, middle_end - middle_begin);
  if (end % inner != 0) partial_row(last_row, 0, end % inner);
}

}  // namespace

int64_t Box::numel() const {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

std::vector<Box> boxes_of_flat_range(const std::vector<int64_t>& shape, int64_t begin, int64_t end) {
  const int64_t numel = checked_numel(shape, "boxes_of_flat_range");
  TORCH_CHECK(0 <= begin && begin <= end && end <= numel, "boxes_of_flat_range: flat range [", begin,
              ", ", end, ") is not inside the ", numel, " elements of a tensor of shape ", c10::IntArrayRef(shape));
  std::vector<Box> out;
  if (begin == end) return out;
  if (shape.empty()) {
    out.emplace_back();  // the 0-d tensor's only element
    return out;
  }
  std::vector<int64_t> prefix;
  append_boxes(shape, strides_of(shape), 0, prefix, begin, end, out);
  return out;
}

std::vector<Run> runs_of_box(const std::vector<int64_t>& shape, const Box& box, int64_t begin, int64_t end) {
  checked_numel(shape, "runs_of_box");
  const size_t ndim = shape.size();
  TORCH_CHECK(box.offsets.size() == ndim && box.sizes.size() == ndim, "runs_of_box: a box of ",
              box.offsets.size(), " offsets and ", box.sizes.size(), " sizes does not fit a tensor of shape ",
              c10::IntArrayRef(shape));
  for (size_t d = 0; d < ndim; ++d) {
    TORCH_CHECK(box.offsets[d] >= 0 && box.sizes[d] >= 0 && box.offsets[d] + box.sizes[d] <= shape[d],
                "runs_of_box: box (offsets ", c10::IntArrayRef(box.offsets), ", sizes ", c10::IntArrayRef(box.sizes),
                ") does not fit in a tensor of shape ", c10::IntArrayRef(shape), " at dimension ", d);
  }
  TORCH_CHECK(begin <= end, "runs_of_box: flat range [", begin, ", ", end, ") is reversed");
  std::vector<Run> out;
  if (box.numel() == 0 || begin == end) return out;

  const auto strides = strides_of(shape);
  // The trailing dimensions [split, ndim) that the box covers in one contiguous run: every
  // dimension after `split` is spanned whole, `split` itself may be partial.
  size_t split = ndim;
  int64_t run_length = 1;
  while (split > 0) {
    --split;
    run_length *= box.sizes[split];
    if (box.sizes[split] != shape[split]) break;
  }
  int64_t run_count = 1;
  for (size_t d = 0; d < split; ++d) run_count *= box.sizes[d];

  // Flat index (in the whole tensor) of the first element of run `r`; increasing in r.
  auto global_begin_of = [&](int64_t r) {
    int64_t g = 0;
    for (size_t d = split; d-- > 0;) {
      g += (box.offsets[d] + r % box.sizes[d]) * strides[d];
      r /= box.sizes[d];
    }
    for (size_t d = split; d < ndim; ++d) g += box.offsets[d] * strides[d];
    return g;
  };
  // First run ending after `begin` (binary search: runs are sorted and disjoint).
  int64_t lo = 0, hi = run_count;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (global_begin_of(mid) + run_length <= begin) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  for (int64_t r = lo; r < run_count; ++r) {
    const int64_t g = global_begin_of(r);
    if (g >= end) break;
    const int64_t clipped_begin = std::max(g, begin);
    const int64_t clipped_end = std::min(g + run_length, end);
    if (clipped_end <= clipped_begin) continue;
    out.push_back({clipped_begin, r * run_length + (clipped_begin - g), clipped_end - clipped_begin});
  }
  return out;
}

}  // namespace fsdp::storage
