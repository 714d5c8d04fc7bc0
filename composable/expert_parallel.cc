#include "fsdp_cpp/composable/expert_parallel.h"

#include <sstream>
#include <utility>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>

#include "fsdp_cpp/comm/issuing_api.h"

namespace fsdp::ep {
namespace {

constexpr const char* kApi = "fsdp::ep::ExpertParallel";

int64_t total(const std::vector<int64_t>& v) {
  int64_t n = 0;
  for (int64_t x : v) n += x;
  return n;
}

at::Tensor exchange_rows(const at::Tensor& input, const std::vector<int64_t>& output_splits,
                         const std::vector<int64_t>& input_splits, comm::Communicator& group, const std::string& tag) {
  const at::Tensor in = input.contiguous();
  std::vector<int64_t> shape = in.sizes().vec();
  shape[0] = total(output_splits);
  at::Tensor out = at::empty(shape, in.options());
  if (group.size() == 1) {
    out.copy_(in);
    return out;
  }
  group.all_to_all(out, in, output_splits, input_splits, tag).wait();
  return out;
}

class AllToAllRows : public torch::autograd::Function<AllToAllRows> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            std::vector<int64_t> output_splits, std::vector<int64_t> input_splits,
                            std::shared_ptr<comm::Communicator> group, std::string tag) {
    at::Tensor out = exchange_rows(input, output_splits, input_splits, *group, tag);
    ctx->saved_data["out"] = c10::IValue(output_splits);
    ctx->saved_data["in"] = c10::IValue(input_splits);
    ctx->saved_data["tag"] = tag;
    // The group outlives the graph through the model holding it; kept as a raw pointer here.
    ctx->saved_data["group"] = reinterpret_cast<int64_t>(group.get());
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto out_splits = ctx->saved_data["out"].toIntVector();
    const auto in_splits = ctx->saved_data["in"].toIntVector();
    auto* group = reinterpret_cast<comm::Communicator*>(ctx->saved_data["group"].toInt());
    const std::string tag = ctx->saved_data["tag"].toStringRef() + " (backward)";
    comm::IssuingApi issuing(kApi);
    at::Tensor g = grads[0].defined() ? grads[0] : at::Tensor();
    TORCH_CHECK(g.defined(), kApi, ": all_to_all_rows backward got no gradient");
    return {exchange_rows(g, in_splits, out_splits, *group, tag), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

at::Tensor all_to_all_rows(const at::Tensor& input, const std::vector<int64_t>& output_splits,
                           const std::vector<int64_t>& input_splits,
                           const std::shared_ptr<comm::Communicator>& group, const std::string& tag) {
  TORCH_CHECK(group != nullptr, "fsdp::ep::all_to_all_rows: expected a group, found none");
  return AllToAllRows::apply(input, output_splits, input_splits, group, tag);
}

ExpertParallel::ExpertParallel(std::shared_ptr<comm::Communicator> group, int64_t num_experts, std::string name)
    : group_(std::move(group)), num_experts_(num_experts), name_(std::move(name)) {
  TORCH_CHECK(group_ != nullptr, kApi, " (", name_, "): expected an expert-parallel group, found none");
  const int64_t ep = group_->size();
  TORCH_CHECK(num_experts_ > 0 && num_experts_ % ep == 0, kApi, " (", name_, "): num_experts (", num_experts_,
              ") must be divisible by the expert-parallel size ", ep, ": each ep rank holds num_experts / ep of them");
  local_count_ = num_experts_ / ep;
  local_begin_ = group_->rank() * local_count_;
}

// [Note: expert-parallel dispatch] in the header.
Routed ExpertParallel::dispatch(const at::Tensor& tokens, const at::Tensor& expert_ids) const {
  comm::IssuingApi issuing(kApi);
  const int64_t ep = group_->size(), n = local_count_;
  Routed r;
  // This rank's error, if any, travels in the counts exchange (every rank throws it there, with
  // the same text): per destination, its experts' counts, then a flag (1: shapes, 2: ids out of
  // range) and the ids' range.
  int64_t flag = 0, lo = 0, hi = 0;
  if (!(tokens.dim() == 2 && expert_ids.dim() == 2 && expert_ids.size(0) == tokens.size(0) &&
        expert_ids.scalar_type() == at::kLong)) {
    flag = 1;
  } else if (expert_ids.numel() > 0) {
    lo = expert_ids.min().item<int64_t>();
    hi = expert_ids.max().item<int64_t>();
    if (lo < 0 || hi >= num_experts_) flag = 2;
  }
  at::Tensor counts = at::zeros({ep, n + 3}, at::kLong);
  at::Tensor flat_ids;
  if (flag == 0) {
    r.tokens = tokens.size(0);
    r.top_k = expert_ids.size(1);
    flat_ids = expert_ids.reshape({-1});
    counts.narrow(1, 0, n).copy_(at::bincount(flat_ids, {}, num_experts_).view({ep, n}));
  }
  counts.select(1, n).fill_(flag);
  counts.select(1, n + 1).fill_(lo);
  counts.select(1, n + 2).fill_(hi);
  at::Tensor received = at::empty_like(counts);
  if (ep == 1) {
    received.copy_(counts);
  } else {
    at::Tensor send = counts.to(group_->device()), recv = at::empty_like(send);
    group_->all_to_all_single(recv, send, name_ + " expert counts").wait();
    received.copy_(recv.cpu());
  }
  const at::Tensor flags = received.select(1, n);
  if (flags.max().item<int64_t>() > 0) {
    const int64_t bad = flags.nonzero().min().item<int64_t>();
    std::ostringstream m;
    if (received[bad][n].item<int64_t>() == 1) {
      m << "gave tokens and expert ids of the wrong shapes";
    } else {
      m << "routed tokens to expert ids in [" << received[bad][n + 1].item<int64_t>() << ", "
        << received[bad][n + 2].item<int64_t>() << "]";
    }
    TORCH_CHECK(false, kApi, " (", name_, "): refused on every rank of the expert-parallel group: ep rank ", bad, " ",
                m.str(), "; expected int64 expert ids in [0, ", num_experts_, ") of shape [tokens, k] for tokens "
                "[tokens, hidden]");
  }
  const at::Tensor recv_counts = received.narrow(1, 0, n).contiguous();  // [source rank, local expert]
  const at::Tensor send_per_rank = counts.narrow(1, 0, n).sum(1);
  r.send_splits.assign(send_per_rank.data_ptr<int64_t>(), send_per_rank.data_ptr<int64_t>() + ep);
  const at::Tensor recv_per_rank = recv_counts.sum(1);
  r.recv_splits.assign(recv_per_rank.data_ptr<int64_t>(), recv_per_rank.data_ptr<int64_t>() + ep);
  const at::Tensor per_expert = recv_counts.sum(0);
  r.rows_per_local_expert.assign(per_expert.data_ptr<int64_t>(), per_expert.data_ptr<int64_t>() + n);

  // Pairs sorted by expert (stable: (token, slot) order within an expert), rows gathered.
  r.order = std::get<1>(at::sort(flat_ids, /*stable=*/true, /*dim=*/0, /*descending=*/false));
  const at::Tensor send_rows = tokens.index_select(0, at::div(r.order, r.top_k, "floor"));
  const at::Tensor got = all_to_all_rows(send_rows, r.recv_splits, r.send_splits, group_, name_ + " dispatch");

  // Received rows come by source rank, each source's by expert; regroup by local expert.
  std::vector<int64_t> regroup;
  regroup.reserve(static_cast<size_t>(got.size(0)));
  const int64_t* c = recv_counts.data_ptr<int64_t>();
  std::vector<int64_t> source_start(ep, 0);
  for (int64_t s = 1; s < ep; ++s) source_start[s] = source_start[s - 1] + r.recv_splits[s - 1];
  for (int64_t e = 0; e < n; ++e) {
    for (int64_t s = 0; s < ep; ++s) {
      int64_t start = source_start[s];
      for (int64_t e2 = 0; e2 < e; ++e2) start += c[s * n + e2];
      for (int64_t i = 0; i < c[s * n + e]; ++i) regroup.push_back(start + i);
    }
  }
  r.regroup = at::tensor(regroup, at::kLong);
  r.rows = got.index_select(0, r.regroup);
  return r;
}

at::Tensor ExpertParallel::combine(const at::Tensor& expert_rows, const Routed& routed) const {
  comm::IssuingApi issuing(kApi);
  TORCH_CHECK(expert_rows.dim() == 2 && expert_rows.size(0) == routed.rows.size(0), kApi, " (", name_,
              "): combine expected the experts' outputs for the ", routed.rows.size(0), " rows dispatched, as [rows, "
              "features], found ", expert_rows.sizes());
  // Back into source-rank order, back to the sources, then unsorted into (token, slot) order.
  const at::Tensor by_source = expert_rows.index_select(0, at::argsort(routed.regroup));
  const at::Tensor back = all_to_all_rows(by_source, routed.send_splits, routed.recv_splits, group_, name_ + " combine");
  const at::Tensor pairs = back.index_select(0, at::argsort(routed.order));
  return pairs.view({routed.tokens, routed.top_k, expert_rows.size(1)});
}

AllToAllBytes all_to_all_bytes(const Routed& routed, int ep_rank, int64_t row_bytes) {
  AllToAllBytes b;
  const int64_t sent = total(routed.send_splits), received = total(routed.recv_splits);
  b.counted = (sent + received) * row_bytes;
  const int64_t self_out = routed.send_splits.at(static_cast<size_t>(ep_rank));
  const int64_t self_in = routed.recv_splits.at(static_cast<size_t>(ep_rank));
  b.off_rank = (sent - self_out + received - self_in) * row_bytes;
  return b;
}

}  // namespace fsdp::ep
