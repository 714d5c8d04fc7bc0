// Ring attention (composable/context_parallel.h) over MPI on every world size (cp = world size):
// every rank builds the same full q/k/v and upstream gradient (fixed seeds), shards them, runs
// ring_attention and its backward, and compares its output and q/k/v gradients with
// at::scaled_dot_product_attention on the whole sequence (computed in float64 from the same
// values), sharded the same way: both layouts (head-tail and contiguous), causal and full
// attention, GQA (Hkv 2 of H 4) and H = Hkv, T = 2*cp*k for k = 1, 2, 3 (T = 12 at cp = 3),
// an explicit scale, non-contiguous inputs, no-grad calls, float64 and bfloat16 inputs. Also:
// the layout helpers (shard/unshard round trip, global_positions), refusals before any send,
// the bytes sent against ring_attention_bytes_per_rank, and the off-CPU block kernels against
// ATen's CPU flash kernels.
// Tolerances: float32 rtol 1e-5 / atol 1e-5 (output and gradients, values O(1)); float64 rtol
// 1e-10 / atol 1e-10; bfloat16 rtol 2e-2 / atol 2e-2 (the reference computed from the same
// bf16-rounded inputs; the result is rounded to bf16 once).
#include <cmath>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/composable/context_parallel.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::cp::RingAttentionOptions;
using fsdp::testing::error_of;
using fsdp::testing::fresh_comm;
using fsdp::testing::rank;
using fsdp::testing::same_on_every_rank;
using fsdp::testing::world_size;

constexpr double kF32Rtol = 1e-5, kF32Atol = 1e-5;
constexpr double kF64Rtol = 1e-10, kF64Atol = 1e-10;
constexpr double kBf16Rtol = 2e-2, kBf16Atol = 2e-2;

struct Case {
  int64_t B = 2, H = 4, Hkv = 2, T = 8, D = 16;
  bool causal = true, balanced = true;
  std::optional<double> scale;
  at::ScalarType dtype = at::kFloat;
  bool non_contiguous = false;
  std::string name() const {
    return c10::str("B=", B, " H=", H, " Hkv=", Hkv, " T=", T, " D=", D, " causal=", causal, " balanced=", balanced,
                    " dtype=", dtype, scale ? c10::str(" scale=", *scale) : std::string(),
                    non_contiguous ? " non-contiguous" : "");
  }
};

struct Full {
  at::Tensor q, k, v, grad;  // the whole sequence, float64
};

Full make_full(const Case& c, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  Full f;
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  f.q = at::randn({c.B, c.H, c.T, c.D}, gen, opts);
  f.k = at::randn({c.B, c.Hkv, c.T, c.D}, gen, opts);
  f.v = at::randn({c.B, c.Hkv, c.T, c.D}, gen, opts);
  f.grad = at::randn({c.B, c.H, c.T, c.D}, gen, opts);
  // The values the ring sees (bf16 rounding included), so that the reference starts from them.
  f.q = f.q.to(c.dtype).to(at::kDouble);
  f.k = f.k.to(c.dtype).to(at::kDouble);
  f.v = f.v.to(c.dtype).to(at::kDouble);
  f.grad = f.grad.to(c.dtype).to(at::kDouble);
  return f;
}

struct Result {
  at::Tensor out, dq, dk, dv;
};

// at::scaled_dot_product_attention on the whole sequence in float64.
Result reference(const Full& f, const Case& c) {
  at::Tensor q = f.q.clone().requires_grad_(), k = f.k.clone().requires_grad_(), v = f.v.clone().requires_grad_();
  at::Tensor out = at::scaled_dot_product_attention(q, k, v, {}, 0.0, c.causal, c.scale, /*enable_gqa=*/c.Hkv != c.H);
  out.backward(f.grad);
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

Result shard(const Result& r, const Case& c) {
  const int n = world_size(), me = rank();
  auto s = [&](const at::Tensor& t) { return fsdp::cp::shard_sequence(t, 2, n, me, c.balanced); };
  return {s(r.out), s(r.dq), s(r.dk), s(r.dv)};
}

// A non-contiguous tensor with x's values ([B, T, H, D] transposed back).
at::Tensor non_contiguous(const at::Tensor& x) { return x.transpose(1, 2).contiguous().transpose(1, 2); }

Result ring(const Full& f, const Case& c, fsdp::comm::Communicator& comm) {
  const int n = world_size(), me = rank();
  auto s = [&](const at::Tensor& t) {
    at::Tensor local = fsdp::cp::shard_sequence(t, 2, n, me, c.balanced).to(c.dtype);
    return c.non_contiguous ? non_contiguous(local) : local;
  };
  at::Tensor q = s(f.q).requires_grad_(), k = s(f.k).requires_grad_(), v = s(f.v).requires_grad_();
  if (c.non_contiguous) REQUIRE_FALSE(q.is_contiguous());
  at::Tensor out = fsdp::cp::ring_attention(q, k, v, comm,
                                            RingAttentionOptions().causal(c.causal).scale(c.scale).load_balanced(c.balanced));
  REQUIRE(out.scalar_type() == c.dtype);
  REQUIRE(out.sizes() == q.sizes());
  out.backward(s(f.grad));
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

void check_close(const Result& got, const Result& want, double rtol, double atol, const std::string& what) {
  INFO(what);
  const at::Tensor* g[] = {&got.out, &got.dq, &got.dk, &got.dv};
  const at::Tensor* w[] = {&want.out, &want.dq, &want.dk, &want.dv};
  const char* names[] = {"out", "dq", "dk", "dv"};
  for (int i = 0; i < 4; ++i) {
    INFO(names[i] << ": max abs error " << (g[i]->to(at::kDouble) - *w[i]).abs().max().item<double>());
    REQUIRE(g[i]->defined());
    CHECK(g[i]->sizes() == w[i]->sizes());
    CHECK(at::allclose(g[i]->to(at::kDouble), *w[i], rtol, atol));
  }
}

void run_case(const Case& c, uint64_t seed) {
  auto comm = fresh_comm();
  const Full f = make_full(c, seed);
  const Result want = shard(reference(f, c), c);
  const Result got = ring(f, c, *comm);
  const bool f64 = c.dtype == at::kDouble, bf16 = c.dtype == at::kBFloat16;
  check_close(got, want, f64 ? kF64Rtol : bf16 ? kBf16Rtol : kF32Rtol, f64 ? kF64Atol : bf16 ? kBf16Atol : kF32Atol,
              c.name());
}

FSDP_RANKS_TEST_CASE("ring attention equals SDPA on the whole sequence: layouts, masks, GQA, lengths",
                     "[cp][ring_attention]") {
  const int n = world_size();
  uint64_t seed = 100;
  for (int64_t k : {1, 2, 3}) {
    for (int64_t hkv : {2, 4}) {
      for (bool balanced : {true, false}) {
        for (bool causal : {true, false}) {
          Case c;
          c.T = 2 * n * k;
          c.Hkv = hkv;
          c.balanced = balanced;
          c.causal = causal;
          run_case(c, seed++);
        }
      }
    }
  }
}

FSDP_RANKS_TEST_CASE("ring attention: T = 12 at cp = 3, explicit scale, non-contiguous inputs, float64",
                     "[cp][ring_attention]") {
  const int n = world_size();
  Case c;
  c.T = n == 3 ? 12 : 4 * n;
  run_case(c, 7);
  c.scale = 0.3;
  run_case(c, 8);
  c.scale.reset();
  c.non_contiguous = true;
  run_case(c, 9);
  c.non_contiguous = false;
  c.dtype = at::kDouble;
  run_case(c, 10);
  c.balanced = false;
  c.Hkv = 1;
  run_case(c, 11);
  // Contiguous chunks of odd length (T = 3*cp): only the head-tail layout needs 2*cp | T.
  Case odd;
  odd.balanced = false;
  odd.T = 3 * n;
  run_case(odd, 12);
}

FSDP_RANKS_TEST_CASE("ring attention: bfloat16 inputs within bfloat16 tolerance, computed in float32",
                     "[cp][ring_attention]") {
  const int n = world_size();
  for (bool balanced : {true, false}) {
    Case c;
    c.T = 4 * n;
    c.dtype = at::kBFloat16;
    c.balanced = balanced;
    run_case(c, 20 + balanced);
  }
}

FSDP_RANKS_TEST_CASE("ring attention without grad equals the forward with grad", "[cp][ring_attention]") {
  const int n = world_size(), me = rank();
  auto comm = fresh_comm();
  Case c;
  c.T = 4 * n;
  const Full f = make_full(c, 30);
  auto s = [&](const at::Tensor& t) { return fsdp::cp::shard_sequence(t, 2, n, me).to(at::kFloat); };
  at::Tensor plain;
  {
    at::NoGradGuard no_grad;
    plain = fsdp::cp::ring_attention(s(f.q).requires_grad_(), s(f.k), s(f.v), *comm);
  }
  CHECK_FALSE(plain.requires_grad());
  at::Tensor with_grad = fsdp::cp::ring_attention(s(f.q).requires_grad_(), s(f.k), s(f.v), *comm);
  CHECK(with_grad.requires_grad());
  CHECK(at::equal(plain, with_grad.detach()));
}

FSDP_RANKS_TEST_CASE("sequence layouts: shard/unshard round trip, global positions, torch's head-tail order",
                     "[cp][layout]") {
  for (int cp : {1, 2, 3, 4}) {
    for (bool balanced : {true, false}) {
      const int64_t T = 2 * cp * 3;
      at::Tensor x = at::arange(2 * T * 3, at::kLong).reshape({2, T, 3});
      std::vector<at::Tensor> chunks;
      for (int r = 0; r < cp; ++r) {
        at::Tensor chunk = fsdp::cp::shard_sequence(x, 1, cp, r, balanced);
        CHECK(chunk.size(1) == T / cp);
        at::Tensor pos = fsdp::cp::global_positions(T / cp, cp, r, balanced);
        CHECK(pos.scalar_type() == at::kLong);
        CHECK(at::equal(pos, fsdp::cp::shard_sequence(at::arange(T, at::kLong), 0, cp, r, balanced)));
        CHECK(at::equal(chunk, x.index_select(1, pos)));
        chunks.push_back(chunk);
      }
      CHECK(at::equal(fsdp::cp::unshard_sequence(chunks, 1, balanced), x));
      CHECK(at::equal(fsdp::cp::unshard_sequence(chunks, -2, balanced), x));
    }
  }
  // torch's _HeadTailLoadBalancer at cp = 2, T = 8: rank 0 holds [0, 1, 6, 7], rank 1 [2, 3, 4, 5].
  CHECK(at::equal(fsdp::cp::global_positions(4, 2, 0), at::tensor({0, 1, 6, 7}, at::kLong)));
  CHECK(at::equal(fsdp::cp::global_positions(4, 2, 1), at::tensor({2, 3, 4, 5}, at::kLong)));
  CHECK(at::equal(fsdp::cp::global_positions(4, 2, 1, false), at::tensor({4, 5, 6, 7}, at::kLong)));
  // One rank: the whole sequence, any length.
  CHECK(at::equal(fsdp::cp::global_positions(5, 1, 0), at::arange(5, at::kLong)));
  // shard_sequence is differentiable.
  at::Tensor w = at::ones({8}, at::kDouble).requires_grad_();
  fsdp::cp::shard_sequence(w, 0, 2, 1).mul(at::arange(1, 5, at::kDouble)).sum().backward();
  CHECK(at::equal(w.grad(), at::tensor({0., 0., 1., 2., 3., 4., 0., 0.}, at::kDouble)));
}

FSDP_RANKS_TEST_CASE("layout refusals name the API, T, cp and what must divide T", "[cp][layout]") {
  using fsdp::cp::check_sequence_length;
  const std::string e = error_of([] { check_sequence_length(10, 3, true, "my_api"); });
  CHECK_THAT(e, Contains("my_api") && Contains("T = 10") && Contains("cp = 3") && Contains("2 * cp = 6"));
  CHECK_THAT(error_of([] { check_sequence_length(10, 3, false, "my_api"); }),
             Contains("my_api") && Contains("T = 10") && Contains("contiguous") && Contains("cp = 3 must divide T"));
  CHECK(error_of([] { check_sequence_length(9, 3, false, "a"); }) == fsdp::testing::kNoError);
  CHECK(error_of([] { check_sequence_length(7, 1, true, "a"); }) == fsdp::testing::kNoError);
  CHECK_THAT(error_of([] { check_sequence_length(8, 0, true, "a"); }), Contains("at least 1"));
  CHECK_THAT(error_of([] { fsdp::cp::shard_sequence(at::zeros({2, 10}), 1, 3, 0); }),
             Contains("fsdp::cp::shard_sequence") && Contains("T = 10"));
  CHECK_THAT(error_of([] { fsdp::cp::shard_sequence(at::zeros({2, 12}), 1, 3, 3); }),
             Contains("fsdp::cp::shard_sequence") && Contains("cp_rank 3"));
  CHECK_THAT(error_of([] { fsdp::cp::shard_sequence(at::zeros({2, 12}), 2, 3, 0); }), Contains("out of range"));
  CHECK_THAT(error_of([] { fsdp::cp::unshard_sequence({at::zeros({3}), at::zeros({3})}, 0); }),
             Contains("fsdp::cp::unshard_sequence") && Contains("even"));
  CHECK_THAT(error_of([] { fsdp::cp::unshard_sequence({at::zeros({4}), at::zeros({2})}, 0); }),
             Contains("same shape"));
  CHECK_THAT(error_of([] { fsdp::cp::global_positions(3, 2, 0); }), Contains("fsdp::cp::global_positions"));
}

FSDP_RANKS_TEST_CASE("ring attention refuses bad inputs on every rank before sending anything",
                     "[cp][ring_attention]") {
  const int n = world_size();
  auto comm = fresh_comm();
  comm->reset_stats();
  auto q = [](int64_t h, int64_t t, at::ScalarType d = at::kFloat) {
    return at::ones({2, h, t, 16}, at::TensorOptions().dtype(d));
  };
  // A local length of 3 is a T = 3*cp the head-tail layout cannot split over cp > 1 ranks.
  const std::string odd = error_of([&] { fsdp::cp::ring_attention(q(4, 3), q(2, 3), q(2, 3), *comm); });
  if (n == 1) {
    CHECK(odd == fsdp::testing::kNoError);  // one rank: plain attention of any length
  } else {
    CHECK_THAT(odd, Contains("fsdp::cp::ring_attention") && Contains(c10::str("T = ", 3 * n)) &&
                        Contains(c10::str("cp = ", n)) && Contains(c10::str("2 * cp = ", 2 * n)));
  }
  CHECK(same_on_every_rank(odd));
  CHECK_THAT(error_of([&] { fsdp::cp::ring_attention(q(3, 4), q(2, 4), q(2, 4), *comm); }),
             Contains("fsdp::cp::ring_attention") && Contains("multiple of the key/value heads"));
  CHECK_THAT(error_of([&] { fsdp::cp::ring_attention(q(4, 4), q(2, 4, at::kDouble), q(2, 4), *comm); }),
             Contains("fsdp::cp::ring_attention") && Contains("one dtype"));
  CHECK_THAT(error_of([&] { fsdp::cp::ring_attention(q(4, 4), q(2, 4), q(4, 4), *comm); }),
             Contains("k and v must have one shape"));
  CHECK_THAT(error_of([&] { fsdp::cp::ring_attention(q(4, 4), q(2, 2), q(2, 2), *comm); }),
             Contains("must agree in B, T_local and D"));
  CHECK_THAT(error_of([&] { fsdp::cp::ring_attention(q(4, 4).flatten(0, 1), q(2, 4), q(2, 4), *comm); }),
             Contains("4-d"));
  CHECK_THAT(error_of([&] {
               fsdp::cp::ring_attention(q(4, 4, at::kLong), q(2, 4, at::kLong), q(2, 4, at::kLong), *comm);
             }),
             Contains("floating point"));
  // Nothing was sent (the one-rank call above communicates nothing either).
  CHECK(comm->stats(fsdp::comm::CollectiveKind::kSend).calls == 0);
  CHECK(comm->stats(fsdp::comm::CollectiveKind::kRecv).calls == 0);
}

FSDP_RANKS_TEST_CASE("bytes sent equal ring_attention_bytes_per_rank", "[cp][ring_attention]") {
  const int n = world_size(), me = rank();
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    auto comm = fresh_comm();
    const int64_t B = 2, H = 4, Hkv = 2, Tl = 6, D = 16;
    auto make = [&](int64_t h) { return at::randn({B, h, Tl, D}).to(dtype).requires_grad_(); };
    at::Tensor q = make(H), k = make(Hkv), v = make(Hkv);
    comm->reset_stats();
    at::Tensor out = fsdp::cp::ring_attention(q, k, v, *comm);
    const auto forward = comm->stats(fsdp::comm::CollectiveKind::kSend);
    CHECK(forward.bytes == fsdp::cp::ring_attention_bytes_per_rank(B, Hkv, Tl, D, n, dtype, false));
    CHECK(forward.calls == n - 1);
    out.backward(at::ones_like(out));
    const auto step = comm->stats(fsdp::comm::CollectiveKind::kSend);
    CHECK(step.bytes == fsdp::cp::ring_attention_bytes_per_rank(B, Hkv, Tl, D, n, dtype, true));
    CHECK(step.calls == (n == 1 ? 0 : 2 * (n - 1) + n));
    CHECK(comm->stats(fsdp::comm::CollectiveKind::kRecv).bytes == step.bytes);
    (void)me;
  }
  // The closed form itself: K and V of 2*1*8*64 elements... at cp = 4 in bf16.
  const int64_t kv = 2 * 1 * 8 * 1024 * 64;
  CHECK(fsdp::cp::ring_attention_bytes_per_rank(1, 8, 1024, 64, 4, at::kBFloat16, false) == 3 * kv * 2);
  CHECK(fsdp::cp::ring_attention_bytes_per_rank(1, 8, 1024, 64, 4, at::kBFloat16, true) == 2 * 3 * kv * 2 + 4 * kv * 4);
  CHECK(fsdp::cp::ring_attention_bytes_per_rank(1, 8, 1024, 64, 1, at::kFloat, true) == 0);
}

FSDP_RANKS_TEST_CASE("the off-CPU block kernels equal ATen's CPU flash attention kernels", "[cp][kernels]") {
  auto gen = at::detail::createCPUGenerator(40);
  for (bool causal : {true, false}) {
    for (int64_t tk : {5, 7}) {
      if (causal && tk != 5) continue;  // the diagonal block is square
      at::Tensor q = at::randn({2, 3, 5, 8}, gen), k = at::randn({2, 3, tk, 8}, gen), v = at::randn({2, 3, tk, 8}, gen);
      at::Tensor dout = at::randn({2, 3, 5, 8}, gen);
      auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, std::nullopt, 0.4);
      auto [mout, mlse] = fsdp::cp::detail::block_forward_math(q, k, v, causal, 0.4);
      CHECK(at::allclose(mout, out, kF32Rtol, kF32Atol));
      CHECK(at::allclose(mlse, lse, kF32Rtol, kF32Atol));
      auto [dq, dk, dv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                                std::nullopt, 0.4);
      auto [mdq, mdk, mdv] = fsdp::cp::detail::block_backward_math(dout, q, k, v, out.contiguous(), lse, causal, 0.4);
      CHECK(at::allclose(mdq, dq, kF32Rtol, kF32Atol));
      CHECK(at::allclose(mdk, dk, kF32Rtol, kF32Atol));
      CHECK(at::allclose(mdv, dv, kF32Rtol, kF32Atol));
    }
  }
}

}  // namespace
