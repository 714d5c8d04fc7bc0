#include "fsdp_cpp/composable/tensor_placement.h"

#include <mutex>
#include <unordered_map>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "fsdp_cpp/contract/shape_text.h"

namespace fsdp {
namespace {

struct Entry {
  c10::weak_intrusive_ptr<c10::TensorImpl> tensor;
  TensorPlacement placement;
};

struct Table {
  std::mutex mutex;
  std::unordered_map<const c10::TensorImpl*, Entry> entries;
};

Table& table() {
  static Table* t = new Table();  // never destroyed: parameters may outlive static destruction
  return *t;
}

}  // namespace

std::vector<int64_t> TensorPlacement::local_shape() const {
  std::vector<int64_t> shape = global_shape;
  if (sharded()) shape[dim] /= size();
  return shape;
}

std::vector<std::pair<int64_t, int64_t>> TensorPlacement::global_ranges(int rank) const {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  if (!sharded()) {
    ranges.emplace_back(0, global_shape.empty() ? 1 : global_shape[0]);
    return ranges;
  }
  const int64_t block = global_shape[dim] / chunks;
  const int64_t piece = block / size();
  for (int64_t c = 0; c < chunks; ++c) ranges.emplace_back(c * block + rank * piece, c * block + (rank + 1) * piece);
  return ranges;
}

at::Tensor TensorPlacement::local_piece(const at::Tensor& global, int rank) const {
  if (!sharded()) return global.contiguous();
  std::vector<at::Tensor> parts;
  for (const auto& [start, end] : global_ranges(rank)) parts.push_back(global.narrow(dim, start, end - start));
  return at::cat(parts, dim).contiguous();
}

at::Tensor TensorPlacement::assemble(const std::vector<at::Tensor>& pieces) const {
  if (!sharded()) return pieces.at(0);
  std::vector<at::Tensor> blocks;
  for (int64_t c = 0; c < chunks; ++c) {
    std::vector<at::Tensor> parts;
    for (const auto& piece : pieces) {
      const int64_t len = piece.size(dim) / chunks;
      parts.push_back(piece.narrow(dim, c * len, len));
    }
    blocks.push_back(at::cat(parts, dim));
  }
  return at::cat(blocks, dim);
}

std::string TensorPlacement::describe() const {
  std::string over = " over " + mesh_dim + "=" + std::to_string(size()) + ", global " + contract::shape_string(global_shape);
  if (!sharded()) return "Replicate" + over;
  return "Shard(" + std::to_string(dim) + (chunks > 1 ? ", " + std::to_string(chunks) + " blocks" : "") + ")" + over;
}

void set_tensor_placement(const at::Tensor& param, TensorPlacement placement) {
  TORCH_CHECK(param.defined(), "set_tensor_placement: undefined tensor");
  auto& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  // Drop entries of destroyed tensors now and then (their addresses may be reused).
  if (t.entries.size() > 64 && t.entries.size() % 64 == 0) {
    for (auto it = t.entries.begin(); it != t.entries.end();) {
      it = it->second.tensor.expired() ? t.entries.erase(it) : std::next(it);
    }
  }
  t.entries.insert_or_assign(
      param.unsafeGetTensorImpl(),
      Entry{c10::weak_intrusive_ptr<c10::TensorImpl>(param.getIntrusivePtr()), std::move(placement)});
}

std::optional<TensorPlacement> tensor_placement(const at::Tensor& param) {
  if (!param.defined()) return std::nullopt;
  auto& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  auto it = t.entries.find(param.unsafeGetTensorImpl());
  if (it == t.entries.end()) return std::nullopt;
  auto alive = it->second.tensor.lock();
  if (!alive || alive.get() != param.unsafeGetTensorImpl()) {
    t.entries.erase(it);
    return std::nullopt;
  }
  return it->second.placement;
}

void clear_tensor_placement(const at::Tensor& param) {
  if (!param.defined()) return;
  auto& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  t.entries.erase(param.unsafeGetTensorImpl());
}

at::Tensor gather_global(const at::Tensor& local, const TensorPlacement& placement) {
  if (!placement.sharded() || placement.size() == 1) return local;
  const int n = placement.size();
  at::Tensor flat = local.contiguous().reshape({-1});
  at::Tensor out = at::empty({n * flat.numel()}, flat.options());
  placement.group->all_gather_into_tensor(out, flat, "tensor_parallel: gather").wait();
  std::vector<at::Tensor> pieces;
  for (int r = 0; r < n; ++r) pieces.push_back(out.narrow(0, r * flat.numel(), flat.numel()).view(local.sizes()));
  return placement.assemble(pieces);
}

}  // namespace fsdp
