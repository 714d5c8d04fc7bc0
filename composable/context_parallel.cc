#include "fsdp_cpp/composable/context_parallel.h"

#include <cmath>
#include <limits>
#include <optional>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include "fsdp_cpp/comm/issuing_api.h"

// [Note: ring attention]
// Layout. The sequence is cut into equal pieces; a rank's chunk is one piece (contiguous) or two,
// pieces r and 2cp-1-r (head-tail). Each rank keeps its queries and passes its K/V chunk (one
// message, K and V stacked, in the inputs' dtype) to rank r+1 while receiving rank r-1's: at step
// i (0 .. cp-1) rank r holds the K/V chunk of rank s = r - i (mod cp). The send and recv of the
// next chunk are posted before the step's blocks are computed and waited after them, so the
// transfer overlaps the compute.
//
// Blocks and skipping. For every pair (query piece a, key piece b) with global piece indices
// ga, gb: causal=false computes the whole block; under the causal mask a block with gb < ga is
// computed whole (every key precedes every query), gb == ga (the diagonal, same length and
// alignment) with the causal mask, and gb > ga is skipped (every key follows every query). With
// the head-tail layout this gives every rank the same work: step 0 computes two diagonal blocks
// and one whole block; at a later step, for s < r, the rank's head piece r and tail piece 2cp-1-r
// both see s's head piece only (two whole blocks: 2cp-1-s > 2cp-1-r and 2cp-1-s > r); for s > r
// only the tail piece computes, against both of s's pieces (two whole blocks). The contiguous
// layout computes the diagonal at step 0, one whole block for s < r, and nothing for s > r.
//
// Merge (forward). A block gives out_b = softmax(S_b) V_b and lse_b = logsumexp of its rows of
// S_b = scale Q K_b^T (masked entries -inf). The running (out, lse) of a query piece merges with
//   lse' = logaddexp(lse, lse_b),   out' = exp(lse - lse') out + exp(lse_b - lse') out_b,
// in float32 (float64 for float64 inputs), whatever the inputs' dtype; the first block of each
// query piece (its diagonal under the causal mask, step 0) starts the accumulator, so lse is
// finite from the start (every query sees at least its own key). At the end lse is the logsumexp
// of the query's whole row and out its attention output.
//
// Backward. With the final out and lse, each block's gradients are exact block contributions:
// P_b = exp(S_b - lse), dV_b = P_b^T dO, dP_b = dO V_b^T, dS_b = P_b (dP_b - rowsum(dO * out)),
// dQ += scale dS_b K_b, dK_b = scale dS_b^T Q. dQ accumulates locally. dK/dV belong to the K/V
// chunk's owner: each rank adds its contributions for the chunk it holds to that chunk's
// accumulator (float32, stacked dK/dV) and passes the accumulator on with the K/V; the ring is the
// same as the forward's (K/V cp-1 hops), and the accumulators make cp hops, the last one home. The
// accumulator a rank receives is not needed until after its next step's blocks, so its transfer
// overlaps that compute too: each step's contributions go to a fresh buffer to which the received
// accumulator is added afterwards. The blocks skipped in forward are skipped in backward.
//
// Block kernels: on CPU, ATen's flash attention for CPU (_scaled_dot_product_flash_attention_for_cpu
// and its backward, which take an explicit out/logsumexp as above: memory O(block) per step);
// elsewhere the same formulas with matmuls (detail::block_forward_math / block_backward_math).
// With one rank (cp = 1) the forward and backward are one kernel call each on the whole chunk, with
// no K/V buffer or accumulators. Grouped-query attention: the ring carries Hkv heads; the blocks expand K/V to H heads (head h
// uses kv head h / (H/Hkv), as SDPA's enable_gqa) and sum dK/dV over each group before they
// enter the accumulator.

namespace fsdp::cp {
namespace {

constexpr const char* kApi = "fsdp::cp::ring_attention";

enum class BlockMask { kSkip, kFull, kCausal };

struct Layout {
  int cp = 1;
  bool balanced = true;
  int64_t local_len = 0;

  // Pieces per rank: two head-tail pieces over more than one rank, else one.
  int pieces() const { return balanced && cp > 1 ? 2 : 1; }
  int64_t piece_len() const { return local_len / pieces(); }
  int64_t global_piece(int owner, int j) const { return j == 0 ? owner : 2 * cp - 1 - owner; }
};

BlockMask mask_of(const Layout& layout, bool causal, int q_rank, int a, int kv_rank, int b) {
  if (!causal) return BlockMask::kFull;
  const int64_t ga = layout.global_piece(q_rank, a), gb = layout.global_piece(kv_rank, b);
  if (gb < ga) return BlockMask::kFull;
  if (gb == ga) return BlockMask::kCausal;
  return BlockMask::kSkip;
}

// Repeats each of the Hkv heads H/Hkv times (head h <- kv head h / group), as SDPA's enable_gqa.
at::Tensor expand_heads(const at::Tensor& x, int64_t group) {
  if (group == 1) return x;
  const auto s = x.sizes();
  return x.unsqueeze(2).expand({s[0], s[1], group, s[2], s[3]}).reshape({s[0], s[1] * group, s[2], s[3]});
}

// The inverse for gradients: the sum over each group of expanded heads.
at::Tensor reduce_heads(const at::Tensor& x, int64_t group) {
  if (group == 1) return x;
  const auto s = x.sizes();
  return x.reshape({s[0], s[1] / group, group, s[2], s[3]}).sum(2);
}

std::pair<at::Tensor, at::Tensor> block_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                bool causal, double scale) {
  if (q.device().is_cpu()) {
    auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, std::nullopt, scale);
    return {out.contiguous(), lse.contiguous()};
  }
  return detail::block_forward_math(q, k, v, causal, scale);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> block_backward(const at::Tensor& dout, const at::Tensor& q,
                                                              const at::Tensor& k, const at::Tensor& v,
                                                              const at::Tensor& out, const at::Tensor& lse,
                                                              bool causal, double scale) {
  if (q.device().is_cpu()) {
    return at::_scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                    std::nullopt, scale);
  }
  return detail::block_backward_math(dout, q, k, v, out, lse, causal, scale);
}

at::ScalarType compute_dtype(at::ScalarType dtype) {
  return dtype == at::kDouble ? at::kDouble : at::kFloat;
}

struct Ring {
  comm::Communicator& comm;
  int next, prev;
  explicit Ring(comm::Communicator& c)
      : comm(c), next((c.rank() + 1) % c.size()), prev((c.rank() - 1 + c.size()) % c.size()) {}

  // Posts the send of `out_buffer` to the next rank and the recv of the previous rank's into a
  // new buffer like it; returns the pending pair and the buffer.
  struct Hop {
    comm::PendingCollective send, recv;
    at::Tensor sent, received;
    void wait() {
      send.wait();
      recv.wait();
    }
  };
  Hop post(const at::Tensor& out_buffer, int tag, const char* label) {
    Hop hop;
    hop.sent = out_buffer;
    hop.received = at::empty_like(out_buffer);
    hop.send = comm.send(out_buffer, next, tag, label);
    hop.recv = comm.recv(hop.received, prev, tag, label);
    return hop;
  }
};

struct CommHolder final : torch::CustomClassHolder {
  explicit CommHolder(comm::Communicator* c) : comm(c) {}
  comm::Communicator* comm;
};

struct Checked {
  int64_t group = 1;  // H / Hkv
  double scale = 1.0;
  Layout layout;
};

Checked check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int cp_size,
                     const RingAttentionOptions& options) {
  TORCH_CHECK(q.defined() && k.defined() && v.defined(), kApi, ": q, k and v must be defined tensors");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, kApi,
              ": q, k and v must be 4-d [B, H, T_local, D] / [B, Hkv, T_local, D]; got q ", q.sizes(), ", k ",
              k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), kApi,
              ": q, k and v must have one dtype; got q ", q.scalar_type(), ", k ", k.scalar_type(), ", v ",
              v.scalar_type());
  TORCH_CHECK(at::isFloatingType(q.scalar_type()), kApi, ": q, k and v must be floating point; got ",
              q.scalar_type());
  TORCH_CHECK(q.device() == k.device() && q.device() == v.device(), kApi,
              ": q, k and v must be on one device; got q on ", q.device(), ", k on ", k.device(), ", v on ",
              v.device());
  TORCH_CHECK(k.sizes() == v.sizes(), kApi, ": k and v must have one shape; got k ", k.sizes(), ", v ",
              v.sizes());
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(3) == k.size(3), kApi,
              ": q [B, H, T_local, D] and k/v [B, Hkv, T_local, D] must agree in B, T_local and D; got q ",
              q.sizes(), ", k/v ", k.sizes());
  TORCH_CHECK(k.size(1) >= 1 && q.size(1) % k.size(1) == 0, kApi, ": the query heads H (", q.size(1),
              ") must be a multiple of the key/value heads Hkv (", k.size(1), ") (grouped-query attention)");
  TORCH_CHECK(q.size(2) >= 1 && q.size(3) >= 1, kApi, ": empty sequence or head dimension: q ", q.sizes());
  check_sequence_length(q.size(2) * cp_size, cp_size, options.load_balanced(), kApi);
  Checked c;
  c.group = q.size(1) / k.size(1);
  c.scale = options.scale().has_value() ? *options.scale() : 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  c.layout.cp = cp_size;
  c.layout.balanced = options.load_balanced();
  c.layout.local_len = q.size(2);
  return c;
}

// Forward: (out in the inputs' dtype, lse [B, H, Tl] in the compute dtype).
std::pair<at::Tensor, at::Tensor> ring_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               comm::Communicator& comm, const Checked& c, bool causal) {
  RECORD_FUNCTION("context_parallel::ring_attention_forward", std::vector<c10::IValue>());
  const Layout& L = c.layout;
  const int r = comm.rank(), cp = comm.size();
  const at::ScalarType cd = compute_dtype(q.scalar_type());
  const int np = L.pieces();
  const int64_t P = L.piece_len();
  const at::Tensor qc = q.to(cd).contiguous();
  std::vector<at::Tensor> out(np), lse(np);
  if (cp == 1) {  // plain attention: one block, no K/V buffer
    auto [o, l] = block_forward(qc, expand_heads(k.to(cd), c.group), expand_heads(v.to(cd), c.group), causal, c.scale);
    return {o.to(q.scalar_type()).contiguous(), l};
  }
  Ring ring(comm);
  at::Tensor kv = at::stack({k, v}).contiguous();  // [2, B, Hkv, Tl, D], the inputs' dtype
  for (int i = 0; i < cp; ++i) {
    const int s = (r - i + cp) % cp;
    std::optional<Ring::Hop> hop;
    if (i + 1 < cp) hop = ring.post(kv, kRingAttentionKvTag, "ring_attention k/v");
    const at::Tensor kvc = kv.to(cd);
    for (int a = 0; a < np; ++a) {
      for (int b = 0; b < np; ++b) {
        const BlockMask m = mask_of(L, causal, r, a, s, b);
        if (m == BlockMask::kSkip) continue;
        at::Tensor qa = qc.narrow(2, a * P, P);
        at::Tensor kb = expand_heads(kvc[0].narrow(2, b * P, P), c.group);
        at::Tensor vb = expand_heads(kvc[1].narrow(2, b * P, P), c.group);
        auto [ob, lb] = block_forward(qa, kb, vb, m == BlockMask::kCausal, c.scale);
        if (!out[a].defined()) {
          out[a] = ob;
          lse[a] = lb;
        } else {
          at::Tensor merged = at::logaddexp(lse[a], lb);
          out[a] = out[a] * (lse[a] - merged).exp().unsqueeze(-1) + ob * (lb - merged).exp().unsqueeze(-1);
          lse[a] = merged;
        }
      }
    }
    if (hop) {
      hop->wait();
      kv = hop->received;
    }
  }
  for (int a = 0; a < np; ++a) {
    TORCH_INTERNAL_ASSERT(out[a].defined(), kApi, ": query piece ", a, " attended to no key");
  }
  at::Tensor o = np == 1 ? out[0] : at::cat(out, 2);
  at::Tensor l = np == 1 ? lse[0] : at::cat(lse, 2);
  return {o.to(q.scalar_type()).contiguous(), l.contiguous()};
}

// Backward: (dq, dk, dv) in the inputs' dtype.
std::tuple<at::Tensor, at::Tensor, at::Tensor> ring_backward(const at::Tensor& dout, const at::Tensor& q,
                                                             const at::Tensor& k, const at::Tensor& v,
                                                             const at::Tensor& out, const at::Tensor& lse,
                                                             comm::Communicator& comm, const Checked& c,
                                                             bool causal) {
  RECORD_FUNCTION("context_parallel::ring_attention_backward", std::vector<c10::IValue>());
  const Layout& L = c.layout;
  const int r = comm.rank(), cp = comm.size();
  const at::ScalarType cd = compute_dtype(q.scalar_type());
  const int np = L.pieces();
  const int64_t P = L.piece_len();
  const at::Tensor qc = q.to(cd).contiguous();
  const at::Tensor doc = dout.to(cd).contiguous();
  const at::Tensor oc = out.to(cd).contiguous();
  if (cp == 1) {  // plain attention: one block, no accumulators
    auto [dq1, dk1, dv1] = block_backward(doc, qc, expand_heads(k.to(cd), c.group), expand_heads(v.to(cd), c.group),
                                          oc, lse, causal, c.scale);
    return {dq1.to(q.scalar_type()), reduce_heads(dk1, c.group).to(k.scalar_type()),
            reduce_heads(dv1, c.group).to(v.scalar_type())};
  }
  at::Tensor dq = at::zeros_like(qc);
  Ring ring(comm);
  at::Tensor kv = at::stack({k, v}).contiguous();
  std::optional<Ring::Hop> grad_hop;  // the accumulator in flight towards this rank
  at::Tensor acc;                     // [2, B, Hkv, Tl, D] dK/dV of the chunk held, compute dtype
  for (int i = 0; i < cp; ++i) {
    const int s = (r - i + cp) % cp;
    std::optional<Ring::Hop> hop;
    if (i + 1 < cp) hop = ring.post(kv, kRingAttentionKvTag, "ring_attention k/v");
    const at::Tensor kvc = kv.to(cd);
    at::Tensor contrib = at::zeros(kv.sizes(), kv.options().dtype(cd));
    for (int a = 0; a < np; ++a) {
      for (int b = 0; b < np; ++b) {
        const BlockMask m = mask_of(L, causal, r, a, s, b);
        if (m == BlockMask::kSkip) continue;
        at::Tensor kb = expand_heads(kvc[0].narrow(2, b * P, P), c.group);
        at::Tensor vb = expand_heads(kvc[1].narrow(2, b * P, P), c.group);
        auto [dqb, dkb, dvb] =
            block_backward(doc.narrow(2, a * P, P), qc.narrow(2, a * P, P), kb, vb, oc.narrow(2, a * P, P),
                           lse.narrow(2, a * P, P), m == BlockMask::kCausal, c.scale);
        dq.narrow(2, a * P, P).add_(dqb);
        contrib[0].narrow(2, b * P, P).add_(reduce_heads(dkb, c.group));
        contrib[1].narrow(2, b * P, P).add_(reduce_heads(dvb, c.group));
      }
    }
    // The accumulator of chunk s arrived from rank r-1 during the blocks (none at step 0).
    if (grad_hop) {
      grad_hop->wait();
      contrib.add_(grad_hop->received);
      grad_hop.reset();
    }
    acc = contrib;
    if (hop) {
      hop->wait();
      kv = hop->received;
    }
    if (cp > 1) grad_hop = ring.post(acc, kRingAttentionGradTag, "ring_attention dk/dv");
  }
  if (grad_hop) {
    grad_hop->wait();
    acc = grad_hop->received;  // this rank's own chunk's dK/dV, home after cp hops
  }
  return {dq.to(q.scalar_type()), acc[0].to(k.scalar_type()), acc[1].to(v.scalar_type())};
}

struct RingAttentionFunction : torch::autograd::Function<RingAttentionFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                                                const at::Tensor& k, const at::Tensor& v,
                                                c10::intrusive_ptr<CommHolder> holder, bool causal, bool balanced,
                                                double scale, int64_t group) {
    Checked c;
    c.group = group;
    c.scale = scale;
    c.layout.cp = holder->comm->size();
    c.layout.balanced = balanced;
    c.layout.local_len = q.size(2);
    auto [out, lse] = ring_forward(q, k, v, *holder->comm, c, causal);
    ctx->saved_data["comm"] = c10::IValue::make_capsule(holder);
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["balanced"] = balanced;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["group"] = group;
    ctx->save_for_backward({q, k, v, out, lse});
    return {out};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto holder = c10::static_intrusive_pointer_cast<CommHolder>(ctx->saved_data["comm"].toCapsule());
    comm::IssuingApi api("fsdp::cp::ring_attention (backward)");
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    Checked c;
    c.group = ctx->saved_data["group"].toInt();
    c.scale = ctx->saved_data["scale"].toDouble();
    c.layout.cp = holder->comm->size();
    c.layout.balanced = ctx->saved_data["balanced"].toBool();
    c.layout.local_len = q.size(2);
    // Every rank of the ring runs this backward, whether or not autograd needed this output's
    // gradient here: an undefined gradient is zero.
    at::Tensor g = grads[0].defined() ? grads[0] : at::zeros_like(out);
    auto [dq, dk, dv] = ring_backward(g, q, k, v, out, lse, *holder->comm, c, ctx->saved_data["causal"].toBool());
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

int64_t element_size(at::ScalarType dtype) { return static_cast<int64_t>(c10::elementSize(dtype)); }

}  // namespace

namespace detail {

std::pair<at::Tensor, at::Tensor> block_forward_math(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     bool causal, double scale) {
  at::Tensor s = at::matmul(q, k.transpose(-2, -1)) * scale;
  if (causal) {
    s = s.masked_fill(at::ones({q.size(2), k.size(2)}, q.options().dtype(at::kBool)).triu(1),
                      -std::numeric_limits<double>::infinity());
  }
  at::Tensor lse = at::logsumexp(s, -1);
  at::Tensor p = (s - lse.unsqueeze(-1)).exp();
  return {at::matmul(p, v).contiguous(), lse.contiguous()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> block_backward_math(const at::Tensor& dout, const at::Tensor& q,
                                                                   const at::Tensor& k, const at::Tensor& v,
                                                                   const at::Tensor& out, const at::Tensor& lse,
                                                                   bool causal, double scale) {
  at::Tensor s = at::matmul(q, k.transpose(-2, -1)) * scale;
  if (causal) {
    s = s.masked_fill(at::ones({q.size(2), k.size(2)}, q.options().dtype(at::kBool)).triu(1),
                      -std::numeric_limits<double>::infinity());
  }
  at::Tensor p = (s - lse.unsqueeze(-1)).exp();
  at::Tensor dv = at::matmul(p.transpose(-2, -1), dout);
  at::Tensor dp = at::matmul(dout, v.transpose(-2, -1));
  at::Tensor ds = p * (dp - (dout * out).sum(-1, /*keepdim=*/true));
  at::Tensor dq = at::matmul(ds, k) * scale;
  at::Tensor dk = at::matmul(ds.transpose(-2, -1), q) * scale;
  return {dq, dk, dv};
}

}  // namespace detail

void check_sequence_length(int64_t seq_len, int cp_size, bool load_balanced, const std::string& api) {
  TORCH_CHECK(cp_size >= 1, api, ": the context-parallel size must be at least 1; got ", cp_size);
  TORCH_CHECK(seq_len >= 1, api, ": the sequence length must be at least 1; got ", seq_len);
  if (cp_size == 1) return;
  if (load_balanced) {
    TORCH_CHECK(seq_len % (2 * cp_size) == 0, api, ": sequence length T = ", seq_len,
                " cannot be split over cp = ", cp_size,
                " ranks with the load-balanced (head-tail) layout: 2 * cp = ", 2 * cp_size,
                " must divide T (T is cut into 2 * cp equal pieces; pad the sequence to a multiple of ",
                2 * cp_size, ")");
  } else {
    TORCH_CHECK(seq_len % cp_size == 0, api, ": sequence length T = ", seq_len, " cannot be split over cp = ",
                cp_size, " ranks with the contiguous layout: cp = ", cp_size,
                " must divide T (pad the sequence to a multiple of ", cp_size, ")");
  }
}

at::Tensor shard_sequence(const at::Tensor& x, int64_t dim, int cp_size, int cp_rank, bool load_balanced) {
  const char* api = "fsdp::cp::shard_sequence";
  TORCH_CHECK(x.defined() && x.dim() >= 1, api, ": expected a tensor with at least one dimension");
  const int64_t d = dim < 0 ? dim + x.dim() : dim;
  TORCH_CHECK(d >= 0 && d < x.dim(), api, ": dim ", dim, " is out of range for a ", x.dim(), "-d tensor");
  TORCH_CHECK(cp_rank >= 0 && cp_rank < cp_size, api, ": cp_rank ", cp_rank, " is outside [0, ", cp_size, ")");
  const int64_t T = x.size(d);
  check_sequence_length(T, cp_size, load_balanced, api);
  if (cp_size == 1) return x.clone(at::MemoryFormat::Contiguous);
  if (!load_balanced) {
    const int64_t n = T / cp_size;
    return x.narrow(d, cp_rank * n, n).clone(at::MemoryFormat::Contiguous);
  }
  const int64_t P = T / (2 * cp_size);
  return at::cat({x.narrow(d, cp_rank * P, P), x.narrow(d, (2 * cp_size - 1 - cp_rank) * P, P)}, d).contiguous();
}

at::Tensor unshard_sequence(const std::vector<at::Tensor>& chunks, int64_t dim, bool load_balanced) {
  const char* api = "fsdp::cp::unshard_sequence";
  TORCH_CHECK(!chunks.empty(), api, ": no chunks given");
  const int cp = static_cast<int>(chunks.size());
  const at::Tensor& first = chunks[0];
  TORCH_CHECK(first.defined() && first.dim() >= 1, api, ": expected tensors with at least one dimension");
  const int64_t d = dim < 0 ? dim + first.dim() : dim;
  TORCH_CHECK(d >= 0 && d < first.dim(), api, ": dim ", dim, " is out of range for a ", first.dim(), "-d tensor");
  for (int r = 0; r < cp; ++r) {
    TORCH_CHECK(chunks[r].defined() && chunks[r].sizes() == first.sizes(), api,
                ": every rank's chunk must have the same shape; chunk 0 is ", first.sizes(), ", chunk ", r, " is ",
                chunks[r].defined() ? c10::str(chunks[r].sizes()) : std::string("undefined"));
  }
  const int64_t L = first.size(d);
  if (cp == 1) return first.clone(at::MemoryFormat::Contiguous);
  if (!load_balanced) return at::cat(chunks, d);
  TORCH_CHECK(L % 2 == 0, api, ": a load-balanced (head-tail) chunk holds two equal pieces, so its length along dim ",
              d, " must be even; got ", L, " (sequence length T = ", L * cp, ", cp = ", cp,
              ": 2 * cp = ", 2 * cp, " must divide T)");
  const int64_t P = L / 2;
  std::vector<at::Tensor> pieces(2 * cp);
  for (int r = 0; r < cp; ++r) {
    pieces[r] = chunks[r].narrow(d, 0, P);
    pieces[2 * cp - 1 - r] = chunks[r].narrow(d, P, P);
  }
  return at::cat(pieces, d);
}

at::Tensor global_positions(int64_t local_len, int cp_size, int cp_rank, bool load_balanced) {
  const char* api = "fsdp::cp::global_positions";
  TORCH_CHECK(cp_rank >= 0 && cp_rank < cp_size, api, ": cp_rank ", cp_rank, " is outside [0, ", cp_size, ")");
  TORCH_CHECK(local_len >= 1, api, ": local_len must be at least 1; got ", local_len);
  check_sequence_length(local_len * cp_size, cp_size, load_balanced, api);
  const auto opts = at::TensorOptions().dtype(at::kLong);
  if (cp_size == 1 || !load_balanced) return at::arange(cp_rank * local_len, (cp_rank + 1) * local_len, opts);
  const int64_t P = local_len / 2;
  return at::cat({at::arange(cp_rank * P, (cp_rank + 1) * P, opts),
                  at::arange((2 * cp_size - 1 - cp_rank) * P, (2 * cp_size - cp_rank) * P, opts)});
}

at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, comm::Communicator& cp,
                          const RingAttentionOptions& options) {
  comm::IssuingApi api(kApi);
  const Checked c = check_inputs(q, k, v, cp.size(), options);
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const bool needs_grad =
      c10::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad());
  if (!needs_grad) return ring_forward(qc, kc, vc, cp, c, options.causal()).first;
  return RingAttentionFunction::apply(qc, kc, vc, c10::make_intrusive<CommHolder>(&cp), options.causal(),
                                      options.load_balanced(), c.scale, c.group)[0];
}

int64_t ring_attention_bytes_per_rank(int64_t batch, int64_t kv_heads, int64_t local_len, int64_t head_dim,
                                      int cp_size, at::ScalarType dtype, bool backward) {
  TORCH_CHECK(cp_size >= 1, "fsdp::cp::ring_attention_bytes_per_rank: cp_size must be at least 1; got ", cp_size);
  if (cp_size == 1) return 0;
  const int64_t elems = 2 * batch * kv_heads * local_len * head_dim;  // K and V, or dK and dV
  const int64_t forward = (cp_size - 1) * elems * element_size(dtype);
  if (!backward) return forward;
  return 2 * forward + cp_size * elems * element_size(compute_dtype(dtype));
}

}  // namespace fsdp::cp
