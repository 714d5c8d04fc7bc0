// vocab_parallel_cross_entropy (composable/loss_parallel.h) over MPI on every world size, against
// at::cross_entropy_loss of the gathered logits with the padding columns removed: ignore_index
// (some rows, every row, an index inside the vocabulary), a padded vocabulary (padding on the last
// rank only, or spanning ranks so that a rank holds only padding), the reductions mean / sum /
// none, bad targets and vocabulary sizes refused, and the default options bit-identical to the
// original unmasked algorithm. Tolerances (float32): loss rtol 1e-5 / atol 1e-6, gradient
// atol 1e-6 / rtol 1e-5; the padding columns' gradient and ignored rows' gradient exactly 0.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/composable/loss_parallel.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::testing::error_of;
using fsdp::testing::rank;
using fsdp::testing::same_on_every_rank;
using fsdp::testing::world;
using fsdp::testing::world_size;
using Options = fsdp::tp::VocabParallelCrossEntropyOptions;

constexpr double kLossRtol = 1e-5, kLossAtol = 1e-6;
constexpr double kGradRtol = 1e-5, kGradAtol = 1e-6;

at::Tensor ids(std::vector<int64_t> values) { return at::tensor(values, at::kLong); }

std::shared_ptr<fsdp::comm::Communicator> group() {
  return std::make_shared<fsdp::comm::Communicator>(world().backend(), at::kCPU);
}

int64_t reduction_of(const Options::reduction_t& r) {
  if (std::holds_alternative<torch::enumtype::kSum>(r)) return at::Reduction::Sum;
  if (std::holds_alternative<torch::enumtype::kNone>(r)) return at::Reduction::None;
  return at::Reduction::Mean;
}

const char* name_of(const Options::reduction_t& r) {
  switch (reduction_of(r)) {
    case at::Reduction::Sum: return "sum";
    case at::Reduction::None: return "none";
    default: return "mean";
  }
}

struct Compared {
  at::Tensor loss, expected;
  at::Tensor grad, expected_grad;  // this rank's columns
};

// The loss and this rank's logits' gradient, and the reference's: at::cross_entropy_loss on the
// first `vocab` columns of the gathered logits (the padding columns' gradient 0). The backward
// seeds d loss with `seed` (a scalar, or one value per row with kNone).
Compared compare(const at::Tensor& logits, const at::Tensor& targets, const Options& options, int64_t local) {
  const int64_t columns = logits.size(1);
  const int64_t vocab = options.vocab_size() == -1 ? columns : options.vocab_size();
  const int64_t red = reduction_of(options.reduction());
  at::Tensor seed = red == at::Reduction::None ? at::linspace(0.5, 2.0, logits.size(0)) : at::full({}, 1.5);
  at::Tensor real = logits.narrow(1, 0, vocab).clone().requires_grad_();
  Compared c;
  c.expected = at::cross_entropy_loss(real, targets, {}, red, options.ignore_index());
  c.expected.backward(seed);
  c.expected_grad = at::zeros_like(logits);
  c.expected_grad.narrow(1, 0, vocab).copy_(real.grad());
  c.expected_grad = c.expected_grad.narrow(1, rank() * local, local);
  at::Tensor mine = logits.narrow(1, rank() * local, local).clone().requires_grad_();
  c.loss = fsdp::tp::vocab_parallel_cross_entropy(mine, targets, group(), options);
  c.loss.backward(seed);
  c.grad = mine.grad();
  return c;
}

void check(const Compared& c) {
  CHECK(c.loss.sizes() == c.expected.sizes());
  CHECK(at::allclose(c.loss.detach(), c.expected.detach(), kLossRtol, kLossAtol, /*equal_nan=*/true));
  CHECK(at::allclose(c.grad, c.expected_grad, kGradRtol, kGradAtol));
}

// Random logits [rows, n x local] (scaled: some rows peaked), the same on every rank.
at::Tensor logits_of(int64_t rows, int64_t local, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  return at::randn({rows, local * world_size()}, gen).mul(3);
}

FSDP_RANKS_TEST_CASE("loss parallel: ignore_index, every reduction, equals cross_entropy", "[tp][loss_parallel]") {
  const int64_t local = 4, columns = local * world_size();
  auto gen = at::detail::createCPUGenerator(21);
  const at::Tensor logits = logits_of(9, local, 5);
  at::Tensor targets = at::randint(columns, {9}, gen);
  targets.index_put_({ids({1, 4, 5})}, -100);
  for (const Options::reduction_t red : {Options::reduction_t(torch::kMean), Options::reduction_t(torch::kSum),
                                         Options::reduction_t(torch::kNone)}) {
    INFO("reduction " << name_of(red));
    const Compared c = compare(logits, targets, Options().reduction(red), local);
    check(c);
    // Ignored rows: no gradient, and no loss with kNone.
    for (int64_t row : {1, 4, 5}) CHECK(c.grad[row].equal(at::zeros({local})));
    if (reduction_of(red) == at::Reduction::None) {
      CHECK(c.loss.detach().index({ids({1, 4, 5})}).eq(0).all().item<bool>());
    }
    // An ignore_index that is also a vocabulary id (here id 2: rows targeting 2 are ignored).
    at::Tensor with_two = targets.clamp_min(0);  // (-100 is now an id outside the vocabulary)
    with_two.index_put_({ids({0, 7})}, 2);
    check(compare(logits, with_two, Options().reduction(red).ignore_index(2), local));
  }
  // The sum is the mean times the rows that count (a caller normalising by its own token count).
  const at::Tensor mean = compare(logits, targets, Options(), local).loss;
  const at::Tensor sum = compare(logits, targets, Options().reduction(torch::kSum), local).loss;
  CHECK(at::allclose(sum.detach(), mean.detach() * 6, kLossRtol, kLossAtol));
}

FSDP_RANKS_TEST_CASE("loss parallel: every row ignored gives NaN (mean) or 0 (sum) and zero gradients",
                     "[tp][loss_parallel]") {
  const int64_t local = 3;
  const at::Tensor logits = logits_of(5, local, 6);
  const at::Tensor targets = at::full({5}, int64_t{-100}, at::kLong);
  for (const Options::reduction_t red : {Options::reduction_t(torch::kMean), Options::reduction_t(torch::kSum),
                                         Options::reduction_t(torch::kNone)}) {
    INFO("reduction " << name_of(red));
    const Compared c = compare(logits, targets, Options().reduction(red), local);
    check(c);
    if (reduction_of(red) == at::Reduction::Mean) {
      CHECK(std::isnan(c.loss.item<float>()));
      CHECK(std::isnan(c.expected.item<float>()));  // PyTorch's value too
    } else {
      CHECK(c.loss.detach().eq(0).all().item<bool>());
    }
    CHECK(c.grad.equal(at::zeros({5, local})));
  }
  // Padded too, with a custom ignore_index.
  check(compare(logits, at::full({5}, int64_t{7}, at::kLong), Options().ignore_index(7).vocab_size(1), local));
}

FSDP_RANKS_TEST_CASE("loss parallel: a padded vocabulary leaves the padding out of the softmax",
                     "[tp][loss_parallel]") {
  const int n = world_size(), r = rank();
  for (const int64_t local : {3, 4}) {
    const int64_t columns = local * n;
    // Down to two ranks' worth of padding: on 3-4 ranks (e.g. 10 of 12 columns at n = 3, local 4:
    // the last rank; 7 of 12 at n = 4, local 3: across ranks 2 and 3, rank 3 holding only padding).
    for (int64_t vocab = std::max<int64_t>(1, columns - 2 * local); vocab <= columns; ++vocab) {
      INFO("local " << local << ", vocab " << vocab << " of " << columns << " columns");
      at::Tensor logits = logits_of(8, local, 7 + vocab);
      // Large values in the padding: they would dominate the softmax if counted.
      logits.narrow(1, vocab, columns - vocab).fill_(40);
      auto gen = at::detail::createCPUGenerator(100 + vocab);
      at::Tensor targets = at::randint(vocab, {8}, gen);
      targets[0] = vocab - 1;  // the last real id
      targets[3] = -100;
      for (const Options::reduction_t red : {Options::reduction_t(torch::kMean), Options::reduction_t(torch::kSum),
                                             Options::reduction_t(torch::kNone)}) {
        INFO("reduction " << name_of(red));
        const Compared c = compare(logits, targets, Options().vocab_size(vocab).reduction(red), local);
        check(c);
        // The padding columns of this rank: gradient exactly 0.
        const int64_t real = std::clamp<int64_t>(vocab - r * local, 0, local);
        CHECK(c.grad.narrow(1, real, local - real).eq(0).all().item<bool>());
        CHECK(c.grad[3].eq(0).all().item<bool>());
      }
    }
  }
  // vocab_size == the columns is the unpadded loss, bit for bit.
  const at::Tensor logits = logits_of(6, 2, 8);
  const at::Tensor targets = at::randint(2 * n, {6}, at::detail::createCPUGenerator(9));
  const at::Tensor local_logits = logits.narrow(1, 2 * r, 2).contiguous();
  CHECK(fsdp::tp::vocab_parallel_cross_entropy(local_logits, targets, group(), Options().vocab_size(2 * n))
            .equal(fsdp::tp::vocab_parallel_cross_entropy(local_logits, targets, group())));
}

// The original algorithm (before the options), forward and backward written out: the default
// options must give exactly its values when no row is ignored.
std::pair<at::Tensor, at::Tensor> original(const at::Tensor& logits, const at::Tensor& targets) {
  fsdp::comm::Communicator& g = world();
  auto all_reduce = [&](at::Tensor t, c10d::ReduceOp op) {
    if (g.size() > 1) g.all_reduce(t, op, "test").wait();
    return t;
  };
  const int64_t local_vocab = logits.size(1), start = g.rank() * local_vocab;
  at::Tensor x = logits.to(at::kFloat);
  at::Tensor max = all_reduce(std::get<0>(x.max(1)).contiguous(), c10d::ReduceOp::MAX);
  at::Tensor shifted = x - max.unsqueeze(1);
  at::Tensor exp = shifted.exp();
  at::Tensor sum_exp = all_reduce(exp.sum(1), c10d::ReduceOp::SUM);
  at::Tensor mine = (targets >= start) & (targets < start + local_vocab);
  at::Tensor local_ids = (targets - start).clamp(0, local_vocab - 1);
  at::Tensor target_logit = shifted.gather(1, local_ids.unsqueeze(1)).squeeze(1) * mine.to(shifted.dtype());
  target_logit = all_reduce(target_logit.contiguous(), c10d::ReduceOp::SUM);
  at::Tensor loss = (sum_exp.log() - target_logit).mean();
  at::Tensor grad = (exp / sum_exp.unsqueeze(1)).clone();
  grad.scatter_add_(1, local_ids.unsqueeze(1), -mine.to(grad.dtype()).unsqueeze(1));
  grad.mul_(at::ones({}) / static_cast<double>(logits.size(0)));
  return {loss, grad};
}

FSDP_RANKS_TEST_CASE("loss parallel: the default options are the original algorithm, bit for bit",
                     "[tp][loss_parallel]") {
  const int n = world_size(), r = rank();
  for (uint64_t seed : {1, 2, 3}) {
    INFO("seed " << seed);
    const at::Tensor logits = logits_of(11, 5, seed);
    const at::Tensor targets = at::randint(5 * n, {11}, at::detail::createCPUGenerator(seed + 50));
    const at::Tensor local_logits = logits.narrow(1, 5 * r, 5).contiguous();
    const auto [loss, grad] = original(local_logits, targets);
    for (bool with_options : {false, true}) {
      at::Tensor mine = local_logits.clone().requires_grad_();
      at::Tensor got = with_options ? fsdp::tp::vocab_parallel_cross_entropy(mine, targets, group(), Options())
                                    : fsdp::tp::vocab_parallel_cross_entropy(mine, targets, group());
      got.backward();
      CHECK(got.detach().equal(loss));
      CHECK(mine.grad().equal(grad));
    }
  }
}

FSDP_RANKS_TEST_CASE("loss parallel: bad targets and vocabulary sizes are refused, naming them",
                     "[tp][loss_parallel]") {
  const int n = world_size(), r = rank();
  const int64_t local = 4, columns = 4 * n;
  const at::Tensor logits = logits_of(4, local, 9).narrow(1, local * r, local).contiguous();
  auto error = [&](const at::Tensor& targets, const Options& options) {
    const std::string e = error_of([&] { fsdp::tp::vocab_parallel_cross_entropy(logits, targets, group(), options); });
    CHECK(same_on_every_rank(e));
    return e;
  };
  const std::string C = std::to_string(columns);
  // Beyond the columns (as before).
  CHECK_THAT(error(ids({0, 1, columns, columns + 3}), Options()),
             Contains("target ids must be in [0, " + C + ")") && Contains("found [0, " + std::to_string(columns + 3) +
                                                                      "]: " + C + ", " + std::to_string(columns + 3)));
  // In the padding.
  const int64_t vocab = columns - 2;
  CHECK_THAT(error(ids({0, vocab + 1, -100, 1}), Options().vocab_size(vocab)),
             Contains("target ids must be in [0, " + std::to_string(vocab) + ")") &&
                 Contains("columns [" + std::to_string(vocab) + ", " + C + ") are padding") &&
                 Contains(": " + std::to_string(vocab + 1)));
  // Negative ids other than ignore_index; ignore_index itself is fine.
  CHECK_THAT(error(ids({-1, 0, -100, 2}), Options()),
             Contains("or equal ignore_index -100") && Contains("found [-1, 2]: -1"));
  CHECK_THAT(error(ids({-100, 0, 1, 2}), Options().ignore_index(-1)), Contains("found [-100, 2]: -100"));
  // vocab_size beyond the columns, or not positive.
  CHECK_THAT(error(ids({0, 1, 2, 3}), Options().vocab_size(columns + 1)),
             Contains("vocab_size must be in [1, " + C + "]") && Contains("got " + std::to_string(columns + 1)));
  CHECK_THAT(error(ids({0, 1, 2, 3}), Options().vocab_size(0)), Contains("vocab_size must be in [1, "));
}

}  // namespace
