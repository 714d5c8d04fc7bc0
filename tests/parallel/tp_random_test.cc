// fsdp::tp::dropout over MPI on 1-4 ranks (the ranks as one tensor-parallel group): replicated
// activations draw the same mask on every rank; sharded ones draw distinct pieces that together
// are at::dropout's mask of the whole tensor with the same generator state, and the generators
// stay in lockstep ([Note: tensor-parallel RNG]).
#include <vector>

#include <ATen/ATen.h>
#include <torch/torch.h>

#include "fsdp_cpp/composable/tp_random.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

at::Tensor gather(const at::Tensor& piece, int64_t dim) {
  auto& world = fsdp::testing::world();
  std::vector<at::Tensor> all(world.size());
  for (auto& t : all) t = at::empty_like(piece);
  world.all_gather(all, piece.contiguous()).wait();
  return at::cat(all, dim);
}

}  // namespace

FSDP_RANKS_TEST_CASE("tp::dropout: replicated masks equal, sharded pieces form the whole tensor's mask", "[tp]") {
  auto group = fsdp::testing::fresh_comm();
  const int n = group->size(), r = group->rank();
  const double p = 0.25;
  // The whole tensor and what each rank holds of it along dimension 1.
  torch::manual_seed(3);  // the same whole tensor on every rank
  const at::Tensor whole = at::rand({3, 4 * n, 5}) + 1.0;
  const at::Tensor piece = whole.narrow(1, r * 4, 4).contiguous();

  torch::manual_seed(11);
  const at::Tensor expected = at::dropout(whole, p, /*train=*/true);
  const double after_expected = at::rand({1}).item<double>();

  torch::manual_seed(11);
  const at::Tensor sharded = fsdp::tp::dropout(piece, p, true, /*sharded_dim=*/1, group);
  const double after_sharded = at::rand({1}).item<double>();
  // Together the pieces are the unsharded mask; the generator advanced as at::dropout's did.
  CHECK(gather(sharded, 1).equal(expected));
  CHECK(after_sharded == after_expected);
  if (n > 1) {
    // Distinct masks on the pieces (the same mask on every piece would be a correlated dropout).
    const at::Tensor kept = sharded.ne(0).to(at::kFloat);
    const at::Tensor all = gather(kept, 1);
    CHECK_FALSE(all.narrow(1, 0, 4).equal(all.narrow(1, 4, 4)));
  }

  torch::manual_seed(11);
  const at::Tensor replicated = fsdp::tp::dropout(whole, p, true, std::nullopt, group);
  // Every rank drew the same mask, which is at::dropout's.
  CHECK(replicated.equal(expected));
  CHECK(gather(replicated.unsqueeze(0), 0).eq(replicated.unsqueeze(0)).all().item<bool>());

  // Identity out of training and at p = 0; bad arguments named.
  CHECK(fsdp::tp::dropout(piece, p, false, 1, group).equal(piece));
  CHECK(fsdp::tp::dropout(piece, 0.0, true, 1, group).equal(piece));
  CHECK_THAT(fsdp::testing::error_of([&] { fsdp::tp::dropout(piece, 1.0, true, 1, group); }),
             Catch::Matchers::Contains("fsdp::tp::dropout: expected a probability in [0, 1), found 1"));
  CHECK_THAT(fsdp::testing::error_of([&] { fsdp::tp::dropout(piece, p, true, 3, group); }),
             Catch::Matchers::Contains("sharded dimension 3 is out of range"));
}
