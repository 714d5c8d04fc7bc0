// fsdp::ep::ExpertParallel (composable/expert_parallel.h) over MPI on every world size, against
// the same experts computed locally on the whole job's tokens: every rank builds every rank's
// tokens, routing and experts from one seed, runs dispatch -> its local experts -> combine on its
// own tokens, and compares the pairs' outputs, the tokens' gradients and each local expert's
// weight gradient (summed over the tokens of every rank) with the local computation. Routings:
// random (some experts empty on some ranks), everything to one expert, a rank with no token.
// Also: the counts exchanged and the bytes against all_to_all_bytes' closed form; expert ids out
// of range on one rank refused on every rank with the same error before any row moves, the group
// usable afterwards; num_experts not divisible by ep refused. Tolerance: float32, 1e-5 absolute
// (sums of the same products in another order).
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/composable/expert_parallel.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::comm::CollectiveKind;
using fsdp::testing::error_of;
using fsdp::testing::rank;
using fsdp::testing::same_on_every_rank;
using fsdp::testing::world_size;

constexpr double kTol = 1e-5;
constexpr int64_t kHidden = 6, kOut = 5;

struct Job {
  std::vector<at::Tensor> tokens;  // per rank [N_r, kHidden]
  std::vector<at::Tensor> ids;     // per rank [N_r, k]
  at::Tensor weights;              // [E, kOut, kHidden]: expert e is x @ weights[e].T, then tanh
};

Job make_job(int64_t experts_per_rank, int64_t k, const std::string& routing, uint64_t seed) {
  const int W = world_size();
  const int64_t E = experts_per_rank * W;
  at::manual_seed(seed);
  Job job;
  job.weights = at::randn({E, kOut, kHidden});
  for (int r = 0; r < W; ++r) {
    const int64_t n = routing == "one rank empty" && r == W - 1 ? 0 : 3 + r;
    job.tokens.push_back(at::randn({n, kHidden}));
    at::Tensor ids;
    if (routing == "all to expert 0") {
      ids = at::zeros({n, k}, at::kLong);
    } else {
      // k distinct experts per token among the first E - 1 (the last expert never gets a row).
      ids = at::rand({n, E - 1}).argsort(int64_t{-1}).narrow(1, 0, k).contiguous();
    }
    job.ids.push_back(ids);
  }
  return job;
}

at::Tensor expert(const at::Tensor& w, const at::Tensor& x) { return at::tanh(x.matmul(w.t())); }

void check_close(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  INFO(what << ": got " << got.sizes() << ", want " << want.sizes());
  REQUIRE(got.sizes() == want.sizes());
  if (got.numel() > 0) CHECK((got - want).abs().max().item<double>() <= kTol);
}

void run_case(int64_t experts_per_rank, int64_t k, const std::string& routing) {
  const int W = world_size(), r = rank();
  const Job job = make_job(experts_per_rank, k, routing, 17 + experts_per_rank + k);
  const int64_t E = experts_per_rank * W;
  auto group = fsdp::testing::fresh_comm();
  fsdp::ep::ExpertParallel ep(group, E, "test layer");
  REQUIRE(ep.local_count() == experts_per_rank);
  REQUIRE(ep.local_begin() == r * experts_per_rank);

  // The reference: every rank's pairs computed locally with the full weights.
  const at::Tensor weights = job.weights.clone().requires_grad_(true);
  std::vector<at::Tensor> ref_tokens, ref_pairs;
  for (int s = 0; s < W; ++s) {
    at::Tensor x = job.tokens[s].clone().requires_grad_(true);
    const int64_t n = x.size(0);
    std::vector<at::Tensor> rows;
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t j = 0; j < k; ++j) rows.push_back(expert(weights[job.ids[s][t][j].item<int64_t>()], x[t]));
    }
    ref_tokens.push_back(x);
    ref_pairs.push_back(rows.empty() ? at::zeros({0, k, kOut}) : at::stack(rows).view({n, k, kOut}));
  }
  // A fixed upstream gradient per pair, the same on every rank.
  at::manual_seed(99);
  std::vector<at::Tensor> upstream;
  for (int s = 0; s < W; ++s) upstream.push_back(at::randn({job.tokens[s].size(0), k, kOut}));
  at::Tensor ref_loss = (weights * 0).sum();  // every weight gets a gradient, zeros included
  for (int s = 0; s < W; ++s) ref_loss = ref_loss + (ref_pairs[s] * upstream[s]).sum();
  ref_loss.backward();
  auto grad_of = [](const at::Tensor& t) { return t.grad().defined() ? t.grad() : at::zeros_like(t); };

  // Expert parallel: this rank's tokens, its local experts' weights.
  const at::Tensor local_w =
      job.weights.narrow(0, ep.local_begin(), ep.local_count()).clone().requires_grad_(true);
  const at::Tensor x = job.tokens[r].clone().requires_grad_(true);
  group->reset_stats();
  const fsdp::ep::Routed routed = ep.dispatch(x, job.ids[r]);
  std::vector<at::Tensor> outs;
  int64_t at = 0;
  for (int64_t e = 0; e < ep.local_count(); ++e) {
    outs.push_back(expert(local_w[e], routed.rows.narrow(0, at, routed.rows_per_local_expert[e])));
    at += routed.rows_per_local_expert[e];
  }
  const at::Tensor pairs = ep.combine(at::cat(outs), routed);
  check_close(pairs, ref_pairs[r].detach(), "pairs' outputs");
  ((pairs * upstream[r]).sum() + (local_w * 0).sum() + (x * 0).sum()).backward();
  check_close(grad_of(x), grad_of(ref_tokens[r]), "tokens' gradient");
  check_close(local_w.grad(), weights.grad().narrow(0, ep.local_begin(), ep.local_count()),
              "local experts' weight gradient (every rank's tokens)");

  // Rows per local expert: what every rank routed to them.
  for (int64_t e = 0; e < ep.local_count(); ++e) {
    int64_t want = 0;
    for (int s = 0; s < W; ++s) want += (job.ids[s] == ep.local_begin() + e).sum().item<int64_t>();
    CHECK(routed.rows_per_local_expert[e] == want);
  }
  // Bytes: two row all-to-alls forward and two backward, each counted as its input; the closed
  // form from the routing. One counts exchange.
  if (W > 1) {
    const auto bytes = fsdp::ep::all_to_all_bytes(routed, r, kHidden * 4);
    const int64_t out_bytes = fsdp::ep::all_to_all_bytes(routed, r, kOut * 4).counted;
    const int64_t sent = x.size(0) * k, received = routed.rows.size(0);
    CHECK(bytes.counted == (sent + received) * kHidden * 4);
    // Forward: dispatch sends the tokens' rows (kHidden), combine the experts' outputs (kOut);
    // backward: the combine's gradient (the pairs' kOut rows), then the dispatch's (kHidden rows).
    const int64_t want = sent * kHidden * 4 + received * kOut * 4 + sent * kOut * 4 + received * kHidden * 4;
    CHECK(group->stats(CollectiveKind::kAllToAllV).calls == 4);
    CHECK(group->stats(CollectiveKind::kAllToAllV).bytes == want);
    CHECK(out_bytes == (sent + received) * kOut * 4);
    CHECK(group->stats(CollectiveKind::kAllToAll).calls == 1);
    CHECK(bytes.off_rank <= bytes.counted);
  }
}

}  // namespace

FSDP_RANKS_TEST_CASE("dispatch -> local experts -> combine equals the experts on every rank's tokens", "[ep]") {
  for (int64_t per_rank : {1, 2}) {
    for (int64_t k : {1, 2}) {
      if (per_rank * world_size() - 1 < k) continue;  // k distinct experts among E - 1
      DYNAMIC_SECTION("experts per rank " << per_rank << ", top-" << k) { run_case(per_rank, k, "random"); }
    }
  }
  SECTION("every token to expert 0 (every other expert empty everywhere)") { run_case(2, 1, "all to expert 0"); }
  SECTION("the last rank has no token") { run_case(2, 1, "one rank empty"); }
}

FSDP_RANKS_TEST_CASE("expert ids out of range on one rank: the same error on every rank, the group usable after",
                     "[ep]") {
  const int W = world_size(), r = rank();
  auto group = fsdp::testing::fresh_comm();
  fsdp::ep::ExpertParallel ep(group, 2 * W, "model.layers.3.mlp");
  const at::Tensor x = at::randn({4, kHidden});
  at::Tensor ids = at::zeros({4, 2}, at::kLong);
  if (r == W - 1) ids[1][1] = 2 * W + 5;
  const std::string error = error_of([&] { ep.dispatch(x, ids); });
  CHECK_THAT(error, Contains("fsdp::ep::ExpertParallel (model.layers.3.mlp)") &&
                        Contains("ep rank " + std::to_string(W - 1) + " routed tokens to expert ids in [0, " +
                                 std::to_string(2 * W + 5) + "]") &&
                        Contains("expected int64 expert ids in [0, " + std::to_string(2 * W) + ")"));
  CHECK(same_on_every_rank(error));
  // Wrong shapes: refused alike.
  const std::string shapes = error_of([&] { ep.dispatch(x, r == 0 ? at::zeros({3, 2}, at::kLong) : ids.clamp(0, 1)); });
  CHECK_THAT(shapes, Contains("ep rank 0 gave tokens and expert ids of the wrong shapes"));
  CHECK(same_on_every_rank(shapes));
  // Nothing moved: the group still pairs up.
  const auto routed = ep.dispatch(x, at::zeros({4, 2}, at::kLong));
  CHECK(routed.rows.size(0) == (r == 0 ? 8 * W : 0));
  ep.combine(routed.rows.narrow(1, 0, 3).contiguous(), routed);
}

FSDP_RANKS_TEST_CASE("num_experts not divisible by the ep size is refused, naming both", "[ep]") {
  const int W = world_size();
  if (W == 1) return;  // every count divides by one rank
  auto group = fsdp::testing::fresh_comm();
  CHECK_THAT(error_of([&] { fsdp::ep::ExpertParallel(group, 2 * W + 1, "layer"); }),
             Contains("num_experts (" + std::to_string(2 * W + 1) + ") must be divisible by the expert-parallel size " +
                      std::to_string(W)));
}
