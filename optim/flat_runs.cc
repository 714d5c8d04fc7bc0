#include "fsdp_cpp/optim/flat_runs.h"

#include <utility>

#include <c10/core/TensorImpl.h>
#include <c10/util/intrusive_ptr.h>

namespace fsdp::optim {
namespace {

const c10::StorageImpl* storage_of(const at::Tensor& t) { return t.storage().unsafeGetStorageImpl(); }

// Whether `p` (with its gradient `g`) can be a member of a run at all.
bool can_join(const at::Tensor& p, const at::Tensor& g) {
  return p.layout() == c10::kStrided && g.layout() == c10::kStrided && p.has_storage() && g.has_storage() &&
         p.is_contiguous() && g.is_contiguous() && g.scalar_type() == p.scalar_type() &&
         g.device() == p.device() && storage_of(p) != storage_of(g);
}

// Whether `p` directly follows `q` (the previous member) in a run that starts with `first`.
bool follows(const at::Tensor& q, const at::Tensor& p, const at::Tensor& first, int64_t max_gap_bytes) {
  if (p.scalar_type() != q.scalar_type() || p.device() != q.device() || storage_of(p) != storage_of(q)) {
    return false;
  }
  const int64_t gap = p.storage_offset() - (q.storage_offset() + q.numel());
  if (gap < 0 || gap * static_cast<int64_t>(p.element_size()) > max_gap_bytes) return false;
  const at::Tensor& g = p.grad();
  const at::Tensor& g0 = first.grad();
  return storage_of(g) == storage_of(g0) &&
         g.storage_offset() - g0.storage_offset() == p.storage_offset() - first.storage_offset();
}

void close_run(ParamRun& run, const std::vector<at::Tensor>& params, std::vector<ParamRun>& runs) {
  if (run.members.empty()) return;
  const at::Tensor& first = params[run.members.front()];
  const at::Tensor& last = params[run.members.back()];
  if (run.flat()) {
    run.numel = last.storage_offset() + last.numel() - first.storage_offset();
    run.param = storage_view(first, first.storage_offset(), {run.numel});
    run.grad = storage_view(first.grad(), first.grad().storage_offset(), {run.numel});
  } else {
    run.numel = first.numel();
    run.param = first;
    run.grad = first.grad();
  }
  runs.push_back(std::move(run));
  run = ParamRun();
}

}  // namespace

at::Tensor storage_view(const at::Tensor& base, int64_t offset, c10::IntArrayRef sizes) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(base.storage()), base.key_set(), base.dtype());
  std::vector<int64_t> strides(sizes.size(), 1);
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 2; d >= 0; --d) strides[d] = strides[d + 1] * sizes[d + 1];
  impl->set_sizes_and_strides(sizes, strides, offset);
  return at::Tensor(std::move(impl));
}

std::vector<ParamRun> find_runs(const std::vector<at::Tensor>& params, int64_t max_gap_bytes) {
  std::vector<ParamRun> runs;
  ParamRun run;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    const bool joinable = can_join(p, g);
    if (p.numel() == 0 || !joinable) {
      // Alone; an empty parameter holds no element, so it does not split the run around it.
      if (p.numel() != 0) close_run(run, params, runs);
      ParamRun single;
      single.packable = joinable;
      single.members.push_back(i);
      single.offsets.push_back(0);
      close_run(single, params, runs);
      continue;
    }
    if (!run.members.empty()) {
      const at::Tensor& first = params[run.members.front()];
      if (!follows(params[run.members.back()], p, first, max_gap_bytes)) close_run(run, params, runs);
    }
    const int64_t offset = run.members.empty() ? 0 : p.storage_offset() - params[run.members.front()].storage_offset();
    run.members.push_back(i);
    run.offsets.push_back(offset);
    run.packable = true;
  }
  close_run(run, params, runs);
  return runs;
}

RunSegment run_segment(const ParamRun& run, const std::vector<at::Tensor>& params, size_t first, size_t last) {
  RunSegment s;
  s.first = first;
  s.last = last;
  s.offset = run.offsets[first];
  s.numel = run.offsets[last] + params[run.members[last]].numel() - s.offset;
  return s;
}

at::Tensor segment_view(const at::Tensor& flat, const ParamRun& run, const RunSegment& segment) {
  if (segment.offset == 0 && segment.numel == run.numel) return flat;
  return storage_view(flat, flat.storage_offset() + segment.offset, {segment.numel});
}

}  // namespace fsdp::optim
