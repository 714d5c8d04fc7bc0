#include "fsdp_cpp/optim/flat_packs.h"

#include <cstring>
#include <utility>

#include <ATen/ops/empty.h>
#include <torch/csrc/autograd/variable.h>

namespace fsdp::optim {
namespace {

bool packs(const ParamRun& run, const std::vector<at::Tensor>& params, int64_t pack_max_numel) {
  return run.packable && pack_max_numel > 0 && run.numel <= pack_max_numel && params[run.members.front()].device().is_cpu();
}

char* bytes_of(const at::Tensor& t) { return static_cast<char*>(t.data_ptr()); }

// Fills the pack's parameter and gradient tensors from its members.
void gather(ParamRun& pack, const std::vector<at::Tensor>& params) {
  const at::Tensor& first = params[pack.members.front()];
  pack.param = at::empty({pack.numel}, first.options());
  pack.grad = at::empty({pack.numel}, first.options());
  const auto item = static_cast<int64_t>(first.element_size());
  for (size_t i = 0; i < pack.members.size(); ++i) {
    const at::Tensor& p = params[pack.members[i]];
    const int64_t n = p.numel();
    if (n == 0) continue;
    std::memcpy(bytes_of(pack.param) + pack.offsets[i] * item, bytes_of(p), n * item);
    std::memcpy(bytes_of(pack.grad) + pack.offsets[i] * item, bytes_of(p.grad()), n * item);
  }
}

}  // namespace

std::vector<ParamRun> plan_runs(const std::vector<at::Tensor>& params, int64_t pack_max_numel,
                                int64_t max_gap_bytes) {
  std::vector<ParamRun> out;
  std::vector<ParamRun> by_dtype;  // the packs, in order of their first member
  for (ParamRun& run : find_runs(params, max_gap_bytes)) {
    if (!packs(run, params, pack_max_numel)) {
      out.push_back(std::move(run));
      continue;
    }
    const auto dtype = params[run.members.front()].scalar_type();
    ParamRun* pack = nullptr;
    for (ParamRun& p : by_dtype) {
      if (params[p.members.front()].scalar_type() == dtype) pack = &p;
    }
    if (pack == nullptr) {
      by_dtype.emplace_back();
      pack = &by_dtype.back();
      pack->gathered = true;
      pack->packable = true;
    }
    for (size_t m : run.members) {
      pack->members.push_back(m);
      pack->offsets.push_back(pack->numel);
      pack->numel += params[m].numel();
    }
  }
  for (ParamRun& pack : by_dtype) {
    gather(pack, params);
    out.push_back(std::move(pack));
  }
  return out;
}

void finish_flat_step(const ParamRun& run, const std::vector<at::Tensor>& params, FlatStepStats& stats) {
  const auto item = static_cast<int64_t>(run.param.element_size());
  for (size_t i = 0; i < run.members.size(); ++i) {
    const at::Tensor& p = params[run.members[i]];
    const int64_t n = p.numel();
    if (run.gathered && n != 0) std::memcpy(bytes_of(p), bytes_of(run.param) + run.offsets[i] * item, n * item);
    torch::autograd::impl::bump_version(p);
  }
  const auto n = static_cast<int64_t>(run.members.size());
  if (run.gathered) {
    ++stats.packs;
    stats.packed_params += n;
  } else {
    ++stats.flat_runs;
    stats.flat_params += n;
  }
}

}  // namespace fsdp::optim
