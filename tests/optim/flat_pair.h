// Parameters laid out as fully_shard lays out a FlatParameter's shard, for the flat optimizers'
// single-process tests (flat_optimizers_test, flat_optimizers_bf16_test): views of one flat
// storage, each starting at a multiple of 16 bytes (zero padding between them), their gradients
// views of one flat gradient at the same offsets, and the same values as separate tensors for the
// reference optimizer.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include <ATen/ATen.h>

namespace fsdp::optim::testing {

inline int64_t aligned(int64_t n) { return (n + 3) / 4 * 4; }  // 16 bytes of float

inline at::Tensor view_of(const at::Tensor& flat, int64_t offset, c10::IntArrayRef shape) {
  at::Tensor t = at::empty({0}, flat.options());
  std::vector<int64_t> strides(shape.size(), 1);
  for (int64_t d = static_cast<int64_t>(shape.size()) - 2; d >= 0; --d) strides[d] = strides[d + 1] * shape[d + 1];
  t.set_(flat.storage(), offset, shape, strides);
  return t;
}

// Parameters laid out like a FlatParameter's shard, and the same values as separate tensors.
struct Pair {
  std::vector<int64_t> offsets;
  int64_t total = 0;
  at::Tensor flat;                 // the shard
  std::vector<at::Tensor> params;  // views of it
  std::vector<at::Tensor> ref;     // separate tensors

  explicit Pair(const std::vector<std::vector<int64_t>>& shapes, uint64_t seed = 0) {
    for (const auto& s : shapes) {
      offsets.push_back(total);
      int64_t n = 1;
      for (int64_t d : s) n *= d;
      total += aligned(n);
    }
    flat = at::zeros({total});
    auto gen = at::detail::createCPUGenerator(seed + 7);
    for (size_t i = 0; i < shapes.size(); ++i) {
      at::Tensor p = view_of(flat, offsets[i], shapes[i]);
      p.copy_(at::randn(shapes[i], gen));
      p.requires_grad_(true);
      params.push_back(p);
      ref.push_back(p.detach().clone().requires_grad_(true));
    }
  }

  // Gradients for step `it`: one flat gradient (zero padding) for the views, copies for the
  // reference; parameters in `without` get none.
  void set_grads(int it, const std::vector<size_t>& without = {}) {
    at::Tensor g = at::zeros({total});
    auto gen = at::detail::createCPUGenerator(1000 + it);
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor values = at::randn(params[i].sizes(), gen);
      if (std::find(without.begin(), without.end(), i) != without.end()) {
        params[i].mutable_grad() = at::Tensor();
        ref[i].mutable_grad() = at::Tensor();
        continue;
      }
      at::Tensor gi = view_of(g, offsets[i], params[i].sizes());
      gi.copy_(values);
      params[i].mutable_grad() = gi;
      ref[i].mutable_grad() = values.clone();
    }
  }
};

}  // namespace fsdp::optim::testing
