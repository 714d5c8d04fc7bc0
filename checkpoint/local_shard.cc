#include "fsdp_cpp/checkpoint/local_shard.h"

#include <algorithm>

#include <c10/util/Exception.h>

namespace fsdp {
namespace {

int64_t product(const std::vector<int64_t>& shape) {
  int64_t numel = 1;
  for (const int64_t size : shape) numel *= size;
  return numel;
}

std::vector<int64_t> strides_of(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (int64_t d = static_cast<int64_t>(shape.size()) - 2; d >= 0; --d) strides[d] = strides[d + 1] * shape[d + 1];
  return strides;
}

int64_t flat_index(const std::vector<int64_t>& offsets, const std::vector<int64_t>& strides) {
  int64_t index = 0;
  for (size_t d = 0; d < offsets.size(); ++d) index += offsets[d] * strides[d];
  return index;
}

// A box of the piece (offsets in piece coordinates) and the same box in global coordinates.
struct BoxPair {
  storage::Box whole;  // the unsplit box of the flat range that holds it (piece coordinates)
  storage::Box local;
  storage::Box global;
};

// The piece's boxes of the shard's flat range, split at the piece's ranges, in flat order.
std::vector<BoxPair> box_pairs(const LocalShard& shard) {
  std::vector<BoxPair> out;
  const int64_t begin = shard.flat_offset;
  const int64_t end = begin + shard.local.numel();
  if (begin == end) return out;
  const std::vector<int64_t> piece_shape = shard.piece_shape();
  for (const storage::Box& b : storage::boxes_of_flat_range(piece_shape, begin, end)) {
    if (!shard.piece) {
      out.push_back({b, b, b});
      continue;
    }
    const int64_t d = shard.piece->dim;
    const int64_t lo = b.offsets[d], hi = b.offsets[d] + b.sizes[d];
    int64_t start = 0;  // the range's first index along `d` of the piece
    for (const auto& [g_begin, g_end] : shard.piece->ranges) {
      const int64_t len = g_end - g_begin;
      const int64_t s = std::max(lo, start), e = std::min(hi, start + len);
      if (s < e) {
        BoxPair pair{b, b, b};
        pair.local.offsets[d] = s;
        pair.local.sizes[d] = e - s;
        pair.global.offsets[d] = g_begin + (s - start);
        pair.global.sizes[d] = e - s;
        out.push_back(std::move(pair));
      }
      start += len;
    }
  }
  return out;
}

}  // namespace

int64_t LocalShard::global_numel() const { return product(global_shape); }

std::vector<int64_t> LocalShard::piece_shape() const {
  std::vector<int64_t> shape = global_shape;
  if (!piece) return shape;
  TORCH_CHECK(piece->dim >= 0 && piece->dim < static_cast<int64_t>(shape.size()), "LocalShard: the piece's dimension ",
              piece->dim, " is outside the global shape's ", shape.size(), " dimensions");
  int64_t total = 0;
  for (const auto& [b, e] : piece->ranges) {
    TORCH_CHECK(0 <= b && b <= e && e <= shape[piece->dim], "LocalShard: the piece's range [", b, ", ", e,
                ") of dimension ", piece->dim, " is outside the global size ", shape[piece->dim]);
    total += e - b;
  }
  shape[piece->dim] = total;
  return shape;
}

int64_t LocalShard::piece_numel() const { return product(piece_shape()); }

std::vector<GlobalBox> global_boxes(const LocalShard& shard) {
  std::vector<GlobalBox> out;
  const std::vector<int64_t> piece_strides = strides_of(shard.piece_shape());
  for (auto& pair : box_pairs(shard)) {
    // The unsplit box's elements are contiguous in the piece's flat order; the part is a slice.
    const int64_t first = flat_index(pair.whole.offsets, piece_strides);
    at::Tensor data = shard.local.narrow(0, first - shard.flat_offset, pair.whole.numel()).view(pair.whole.sizes);
    if (shard.piece) {
      const int64_t d = shard.piece->dim;
      data = data.narrow(d, pair.local.offsets[d] - pair.whole.offsets[d], pair.local.sizes[d]);
    }
    out.push_back({std::move(pair.global), std::move(data)});
  }
  return out;
}

std::vector<GlobalRun> global_runs(const LocalShard& shard) {
  std::vector<GlobalRun> runs;
  const int64_t n = shard.local.numel();
  if (n == 0) return runs;
  if (!shard.piece) {
    runs.push_back({shard.flat_offset, 0, n});
    return runs;
  }
  const std::vector<int64_t> piece_strides = strides_of(shard.piece_shape());
  const std::vector<int64_t> global_strides = strides_of(shard.global_shape);
  for (const BoxPair& pair : box_pairs(shard)) {
    const auto& sizes = pair.local.sizes;
    const size_t nd = sizes.size();
    const int64_t row = nd == 0 ? 1 : sizes[nd - 1];
    if (row == 0) continue;
    // Every index of the box's leading dimensions (all but the last), row-major.
    std::vector<int64_t> index(nd == 0 ? 0 : nd - 1, 0);
    while (true) {
      std::vector<int64_t> lo = pair.local.offsets, go = pair.global.offsets;
      for (size_t i = 0; i < index.size(); ++i) {
        lo[i] += index[i];
        go[i] += index[i];
      }
      const int64_t l = flat_index(lo, piece_strides) - shard.flat_offset;
      const int64_t g = flat_index(go, global_strides);
      if (!runs.empty() && runs.back().global_begin + runs.back().length == g &&
          runs.back().local_begin + runs.back().length == l) {
        runs.back().length += row;
      } else {
        runs.push_back({g, l, row});
      }
      int64_t i = static_cast<int64_t>(index.size()) - 1;
      for (; i >= 0; --i) {
        if (++index[i] < sizes[i]) break;
        index[i] = 0;
      }
      if (i < 0) break;
    }
  }
  return runs;
}

}  // namespace fsdp
