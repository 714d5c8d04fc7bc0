#pragma once
// Context parallelism: attention over a sequence split across the ranks of a cp group (ring
// attention, as PyTorch's torch.distributed.tensor.experimental.context_parallel computes it).
// Each rank holds a chunk of the sequence of q, k and v; K and V travel around the ring (rank r
// sends to r+1 and receives from r-1, cp-1 hops), and each rank merges the attention of its
// queries over every chunk's keys with log-sum-exp, in float32. The result equals
// at::scaled_dot_product_attention over the whole sequence restricted to this rank's rows, and is
// differentiable w.r.t. q, k and v: the backward runs the ring again, passing the dK/dV
// accumulators around with K/V so that each returns to its owner ([Note: ring attention] in
// context_parallel.cc).
//
//   // Every cp rank: the same full sequence (or its own chunk straight from the data loader).
//   at::Tensor q = fsdp::cp::shard_sequence(q_full, /*dim=*/2, cp.size(), cp.rank());   // [B, H, T/cp, D]
//   at::Tensor k = fsdp::cp::shard_sequence(k_full, 2, cp.size(), cp.rank());           // [B, Hkv, T/cp, D]
//   at::Tensor v = fsdp::cp::shard_sequence(v_full, 2, cp.size(), cp.rank());
//   at::Tensor pos = fsdp::cp::global_positions(q.size(2), cp.size(), cp.rank());        // for RoPE
//   at::Tensor out = fsdp::cp::ring_attention(q, k, v, cp);                              // causal
//   out.backward(grad);   // dq, dk, dv of this rank's chunk
//
// Layouts (over cp ranks, sequence length T):
//   - load-balanced (default; torch's _HeadTailLoadBalancer): the sequence is cut into 2*cp equal
//     pieces; rank r holds pieces r and 2*cp-1-r, concatenated. Under the causal mask every rank
//     then does the same work (an early piece, which sees little, with a late one, which sees much).
//   - contiguous: rank r holds piece r of cp equal pieces (rank cp-1 does cp times rank 0's work
//     under the causal mask; fine for causal=false).
// With one rank both layouts are the whole sequence, of any length: ring_attention is then plain
// attention (no communication).
//
// Masks: causal (over GLOBAL positions) or none. There is no other attention mask (no padding
// mask, no sliding window, no arbitrary attn_mask): a model that needs one cannot use ring
// attention. No dropout.
//
// Communication: only ring_attention communicates (forward and backward), through
// Communicator::send/recv on `cp` with the tags kRingAttentionKvTag and kRingAttentionGradTag
// below (labels "ring_attention k/v" and "ring_attention dk/dv"). Every rank of the group must
// call it the same number of times, in the same order, with the same shapes: the point-to-point
// operations of consecutive calls are matched in issue order (a rank whose shapes differ fails
// with the MPI backend's size-mismatch error on both sides of a hop). The checks of the
// arguments are local and run before anything is sent: ranks called with the same shapes refuse
// the same error together. Do not call ring_attention on one communicator from two threads at
// once, nor run another user of those tags on it concurrently. The communicator must outlive the
// backward pass (the autograd graph holds a reference to it, not ownership).
//
// Activation checkpointing: a recomputed forward runs the ring again (one more forward's bytes,
// ring_attention_bytes_per_rank(..., false)); every rank recomputes the same layers, so the ranks
// stay in step.

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/arg.h>

#include "fsdp_cpp/comm/communicator.h"

namespace fsdp::cp {

/// The point-to-point tags ring_attention uses on its communicator: K/V (in the inputs' dtype)
/// and the dK/dV accumulators (float32; float64 for float64 inputs).
inline constexpr int kRingAttentionKvTag = 20011;
inline constexpr int kRingAttentionGradTag = 20012;

struct RingAttentionOptions {
  /// Causal over GLOBAL positions (a query attends to keys at or before its position in the whole
  /// sequence); false = full attention. No other mask exists.
  TORCH_ARG(bool, causal) = true;
  /// Softmax scale; default 1/sqrt(head_dim).
  TORCH_ARG(std::optional<double>, scale) = std::nullopt;
  /// Head-tail layout (see above); false = contiguous chunks. Must match how the inputs were
  /// sharded (shard_sequence's load_balanced).
  TORCH_ARG(bool, load_balanced) = true;
};

/// Refuses (c10::Error naming `api`, T, cp and what must divide T) a sequence length the layout
/// cannot split: T not divisible by 2*cp (load-balanced) or by cp (contiguous). cp_size 1 accepts
/// any T >= 1 (the whole sequence on one rank). Also refuses cp_size < 1.
void check_sequence_length(int64_t seq_len, int cp_size, bool load_balanced, const std::string& api);

/// This rank's chunk of `x` along `dim` (a new contiguous tensor; differentiable): pieces r and
/// 2*cp-1-r of 2*cp (load-balanced), or piece r of cp (contiguous). Refuses what
/// check_sequence_length refuses, a bad dim and a cp_rank outside [0, cp_size).
at::Tensor shard_sequence(const at::Tensor& x, int64_t dim, int cp_size, int cp_rank, bool load_balanced = true);

/// The inverse: the whole sequence from every rank's chunk, in rank order (chunks[r] is rank r's).
/// The chunks must have equal shapes (and an even length along `dim` when load-balanced over more
/// than one rank). Local: gathering the chunks is the caller's business.
at::Tensor unshard_sequence(const std::vector<at::Tensor>& chunks, int64_t dim, bool load_balanced = true);

/// The global positions (int64, [local_len]) of this rank's chunk elements: what RoPE and position
/// embeddings must use under context parallelism. local_len must be even when load-balanced over
/// more than one rank.
at::Tensor global_positions(int64_t local_len, int cp_size, int cp_rank, bool load_balanced = true);

/// Ring attention over the cp group `cp` (see above).
/// q: [B, H, Tl, D]; k, v: [B, Hkv, Tl, D] with H % Hkv == 0 (grouped-query attention: the ring
/// carries Hkv heads, expanded to H locally, as at::scaled_dot_product_attention's enable_gqa).
/// Each is this rank's chunk in the layout options.load_balanced() names, T = Tl * cp.size().
/// q, k, v: one floating dtype (float32, bfloat16, float16, float64), one device; computed in
/// float32 (float64 stays float64), the result in q's dtype. Non-contiguous inputs are made
/// contiguous. Returns [B, H, Tl, D]. Errors (c10::Error naming "fsdp::cp::ring_attention", before
/// any communication): shapes or dtypes or devices that differ between q, k, v, H not divisible
/// by Hkv, a T the layout refuses.
at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, comm::Communicator& cp,
                          const RingAttentionOptions& options = {});

/// Bytes one rank sends through the ring (Communicator::stats(kSend).bytes): one forward when
/// `backward` is false (K and V, cp-1 hops: (cp-1) * 2 * B*Hkv*Tl*D * sizeof(dtype)); one forward
/// plus its backward when true (the backward adds K and V again over cp-1 hops, and the float32
/// dK/dV accumulators over cp hops, back to their owner: cp * 2 * B*Hkv*Tl*D * 4; 8 for float64
/// inputs). 0 at cp 1. `dtype` is the inputs' dtype.
int64_t ring_attention_bytes_per_rank(int64_t batch, int64_t kv_heads, int64_t local_len, int64_t head_dim,
                                      int cp_size, at::ScalarType dtype, bool backward);

namespace detail {
/// The block kernels off CPU (on CPU ring_attention uses ATen's flash attention for CPU): one
/// block's attention (out, logsumexp over its rows) of q [B, H, Tq, D] over k/v [B, H, Tk, D] in
/// the inputs' dtype, the causal mask aligned top-left (Tq == Tk on the diagonal); and its
/// gradients (dq, dk, dv) given the FINAL out and logsumexp of the rows ([Note: ring attention]).
/// Public for the tests, which compare them with the CPU kernels.
std::pair<at::Tensor, at::Tensor> block_forward_math(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     bool causal, double scale);
std::tuple<at::Tensor, at::Tensor, at::Tensor> block_backward_math(const at::Tensor& dout, const at::Tensor& q,
                                                                   const at::Tensor& k, const at::Tensor& v,
                                                                   const at::Tensor& out, const at::Tensor& lse,
                                                                   bool causal, double scale);
}  // namespace detail

}  // namespace fsdp::cp
