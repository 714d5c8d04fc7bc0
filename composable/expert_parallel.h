#pragma once
// Expert parallelism: the experts of a mixture-of-experts layer split over an `ep` group, each
// token's rows sent to the ranks holding its experts and the results brought back, through
// all-to-alls of sizes known only after routing (torchtitan's ExpertParallel, DeepSpeed-MoE).
//
//   fsdp::ep::ExpertParallel ep(mesh.ep(), /*num_experts=*/8, "model.layers.0.mlp");
//   // ep.local_begin() .. + ep.local_count(): the experts this rank holds (8 / ep of them)
//   auto routed = ep.dispatch(tokens, expert_ids);        // tokens [N, H], expert_ids [N, k]
//   std::vector<at::Tensor> outs;
//   int64_t at = 0;
//   for (int64_t e = 0; e < ep.local_count(); ++e) {      // every local expert, empty batches included
//     outs.push_back(expert[e](routed.rows.narrow(0, at, routed.rows_per_local_expert[e])));
//     at += routed.rows_per_local_expert[e];
//   }
//   at::Tensor pairs = ep.combine(at::cat(outs), routed);  // [N, k, H]: each (token, slot)'s output
//   at::Tensor y = (pairs * weights.unsqueeze(-1)).sum(1);
//
// [Note: expert-parallel dispatch] dispatch sorts the (token, slot) pairs by expert (stable), so
// the rows for rank j are contiguous (experts j * n .. j * n + n - 1, n = num_experts / ep), and
// issues two all-to-alls on the ep group: the pair counts per expert (plus an error flag: a rank
// whose router chose an expert id outside [0, num_experts) says so there, so every rank of the
// group throws the same error before any row moves), then the rows (Communicator::all_to_all,
// splits from the counts). The received rows, ordered by source rank then expert, are regrouped
// by local expert. combine runs the inverse: rows back into source order, the reverse all-to-all,
// the pairs unsorted. Both all-to-alls of rows are autograd functions whose backward is the
// reverse all-to-all, so gradients reach the router's weights and the tokens on their own rank,
// and each expert's gradient sums the tokens of every rank of the group. Dropless: no capacity
// factor, no token is dropped (torchtitan's default); a rank receives as many rows as were routed
// to its experts. Bytes per layer and step (forward): each of the two row all-to-alls sends this
// rank's N*k pairs' rows less those routed to its own experts; backward the same again.
//
// Every rank of the ep group must call dispatch and combine the same number of times in the same
// order (one MoE layer after another): they are collectives over the group.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "fsdp_cpp/comm/communicator.h"

namespace fsdp::ep {

/// all_to_all of rows with autograd: the rows of `input` go to the ranks by `input_splits`, the
/// result holds `output_splits[i]` rows from rank i; the backward sends the gradient back the
/// reverse way. `output_splits` must be what the peers send (Communicator::exchange_splits).
at::Tensor all_to_all_rows(const at::Tensor& input, const std::vector<int64_t>& output_splits,
                           const std::vector<int64_t>& input_splits,
                           const std::shared_ptr<comm::Communicator>& group, const std::string& tag);

/// What dispatch returns, and combine needs.
struct Routed {
  /// The rows this rank's experts compute: local expert 0's rows (from rank 0, rank 1, ...), then
  /// expert 1's, ...
  at::Tensor rows;
  std::vector<int64_t> rows_per_local_expert;
  /// Pair rows sent to / received from each rank.
  std::vector<int64_t> send_splits, recv_splits;
  at::Tensor order;     // [N * k]: the pairs sorted by expert
  at::Tensor regroup;   // [M]: received rows (by source rank) -> by local expert
  int64_t tokens = 0, top_k = 0;
};

class ExpertParallel {
 public:
  /// `group`: the ep group (its size must divide num_experts, a c10::Error naming `name`
  /// otherwise); `name` labels the collectives (e.g. the MoE layer's FQN).
  ExpertParallel(std::shared_ptr<comm::Communicator> group, int64_t num_experts, std::string name);

  int64_t num_experts() const { return num_experts_; }
  int64_t local_begin() const { return local_begin_; }
  int64_t local_count() const { return local_count_; }
  const std::shared_ptr<comm::Communicator>& group() const { return group_; }

  /// Collective over the group: `tokens` [N, H], `expert_ids` [N, k] (int64, global expert ids).
  /// An id outside [0, num_experts) on any rank is the same c10::Error on every rank, before any
  /// row moves.
  Routed dispatch(const at::Tensor& tokens, const at::Tensor& expert_ids) const;
  /// Collective over the group: `expert_rows` [M, H'] (the experts' outputs for routed.rows, in
  /// its order) -> [N, k, H']: each pair's output on the rank that holds its token.
  at::Tensor combine(const at::Tensor& expert_rows, const Routed& routed) const;

 private:
  std::shared_ptr<comm::Communicator> group_;
  int64_t num_experts_;
  int64_t local_begin_ = 0;
  int64_t local_count_ = 0;
  std::string name_;
};

/// The bytes of one MoE layer's row all-to-alls in the forward (dispatch and combine), from the
/// routing measured: `counted`, what Communicator::stats counts (the inputs: N*k rows out, then
/// the M rows received back), and `off_rank`, what leaves the rank (rows a rank routes to its own
/// experts stay). The backward moves as many again. Rows of `row_bytes` bytes.
struct AllToAllBytes {
  int64_t counted = 0;
  int64_t off_rank = 0;
};
AllToAllBytes all_to_all_bytes(const Routed& routed, int ep_rank, int64_t row_bytes);

}  // namespace fsdp::ep
