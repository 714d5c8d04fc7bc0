// The composition root's refusals over MPI on 1-4 ranks: every bad layout, model or batch is
// refused on every rank with the same error, before anything communicates, and a refused step
// leaves the job usable (the next good step trains).
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "fsdp_cpp/examples/gpt_model.h"
#include "fsdp_cpp/examples/gpt_model_spec.h"
#include "fsdp_cpp/parallel/parallel_model.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using Catch::Matchers::Contains;
using fsdp::examples::GPTConfig;
using fsdp::parallel::ModelSpec;
using fsdp::parallel::ParallelDims;
using fsdp::parallel::ParallelOptions;
using fsdp::testing::error_of;

GPTConfig config() { return GPTConfig(24).context_length(8).d_model(24).n_heads(4).n_layers(4).tie_embeddings(false); }

ModelSpec spec_of(const GPTConfig& c) { return fsdp::examples::gpt_model_spec(c, /*init_seed=*/5); }

std::pair<at::Tensor, at::Tensor> batch(int64_t key, int64_t rows) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(key);
  const at::Tensor t = at::randint(0, 24, {rows, 9}, gen, at::kLong);
  return {t.narrow(1, 0, 8).contiguous(), t.narrow(1, 1, 8).contiguous()};
}

// The same text on every rank (collective).
void check_same(const std::string& error) { CHECK(fsdp::testing::same_on_every_rank(error)); }

}  // namespace

FSDP_RANKS_TEST_CASE("parallelize: layouts that do not fit the world are refused on every rank", "[parallel]") {
  const int w = fsdp::testing::world_size();
  // A product other than the world size.
  std::string e = error_of([&] {
    fsdp::parallel::parallelize(fsdp::testing::fresh_comm(), spec_of(config()),
                                ParallelOptions().dims({.dp_shard = w, .tp = 2}));
  });
  CHECK_THAT(e, Contains("ParallelDims: (pp=1, dp_replicate=1, dp_shard=" + std::to_string(w) +
                         ", tp=2) multiply to " + std::to_string(2 * w) + ", expected the world size " +
                         std::to_string(w)));
  check_same(e);
  // More layers needed than the model has: 5 pipeline stages of a 4-block model (on one rank,
  // 5 interleaved chunks).
  e = error_of([&] {
    fsdp::parallel::parallelize(fsdp::testing::fresh_comm(), spec_of(config().n_layers(w)),
                                ParallelOptions().dims({.dp_shard = 1, .pp = w}).stages_per_rank(2).n_microbatches(2 * w)
                                    .schedule(fsdp::pipeline::ScheduleKind::kInterleaved1F1B));
  });
  if (w > 1) {
    CHECK_THAT(e, Contains("expected at least one block per stage"));
  } else {
    CHECK_THAT(e, Contains("stages_per_rank 2 needs pipeline parallelism (pp > 1), found pp = 1"));
  }
  check_same(e);
  // Ranks given different layouts.
  if (w > 1) {
    e = error_of([&] {
      const ParallelDims dims = fsdp::testing::rank() == 0 ? ParallelDims{.dp_shard = 1, .tp = w}
                                                           : ParallelDims{.dp_shard = w, .tp = 1};
      fsdp::parallel::parallelize(fsdp::testing::fresh_comm(), spec_of(config()), ParallelOptions().dims(dims));
    });
    CHECK_THAT(e, Contains("every rank must be given the same ParallelDims"));
    check_same(e);
  }
}

FSDP_RANKS_TEST_CASE("parallelize: cp and ep layouts the world or the model cannot take are refused on every rank",
                     "[parallel]") {
  const int w = fsdp::testing::world_size();
  // ep must divide dp_shard x cp (it borrows from those ranks).
  std::string e = error_of([&] {
    fsdp::parallel::parallelize(fsdp::testing::fresh_comm(), spec_of(config()),
                                ParallelOptions().dims({.dp_shard = w, .ep = w + 1}));
  });
  CHECK_THAT(e, Contains("ep (" + std::to_string(w + 1) + ") must divide dp_shard x cp (" + std::to_string(w) + ")"));
  check_same(e);
  // cp and ep multiply into the world size with the others.
  e = error_of([&] {
    fsdp::parallel::parallelize(fsdp::testing::fresh_comm(), spec_of(config()),
                                ParallelOptions().dims({.dp_shard = w, .cp = 2}));
  });
  CHECK_THAT(e, Contains("cp=2") && Contains("expected the world size " + std::to_string(w)));
  check_same(e);
  // A model without a context-parallel attention or expert routing (the GPT of the examples).
  e = error_of([&] {
    fsdp::parallel::parallelize(fsdp::testing::fresh_comm(), spec_of(config()),
                                ParallelOptions().dims({.dp_shard = 1, .cp = w}));
  });
  if (w > 1) {
    CHECK_THAT(e, Contains("cp = " + std::to_string(w) + " but ModelSpec::context_parallel is empty"));
  } else {
    CHECK(e == fsdp::testing::kNoError);  // cp = 1 needs nothing
  }
  check_same(e);
  if (w > 1) {
    e = error_of([&] {
      fsdp::parallel::parallelize(fsdp::testing::fresh_comm(), spec_of(config()),
                                  ParallelOptions().dims({.dp_shard = w, .ep = w}));
    });
    CHECK_THAT(e, Contains("ep = " + std::to_string(w) + " but ModelSpec::expert_parallel is empty"));
    check_same(e);
  }
}

FSDP_RANKS_TEST_CASE("parallelize: a model the layout cannot take, or a build failing on one rank, is refused on every "
                     "rank", "[parallel]") {
  const int w = fsdp::testing::world_size();
  if (w >= 2 && w <= 4 && 4 % w == 0 && w != 1) {
    // 3 heads cannot split over tp = 2 or 4.
    const std::string e = error_of([&] {
      fsdp::parallel::parallelize(fsdp::testing::fresh_comm(), spec_of(config().n_heads(3)),
                                  ParallelOptions().dims({.dp_shard = 1, .tp = w}));
    });
    CHECK_THAT(e, Contains("parallelize_gpt: the attention heads split over the " + std::to_string(w) +
                           " tensor-parallel ranks; n_heads 3 is not a multiple of it"));
    check_same(e);
  }
  // The last rank's build throws: every rank throws its error, naming the rank.
  ModelSpec spec = spec_of(config());
  const auto build = spec.build;
  spec.build = [build, w](int s, int n) {
    if (fsdp::testing::rank() == w - 1) throw std::runtime_error("this rank's weights are missing");
    return build(s, n);
  };
  const std::string e = error_of([&] {
    fsdp::parallel::parallelize(fsdp::testing::fresh_comm(), spec, ParallelOptions().dims({.dp_shard = -1}));
  });
  CHECK_THAT(e, Contains("rank " + std::to_string(w - 1) + ": this rank's weights are missing"));
  check_same(e);
}

FSDP_RANKS_TEST_CASE("forward_backward: uneven batches, different data in a tp group and batches the microbatches do not "
                     "divide are refused on every rank; the next good step trains", "[parallel]") {
  const int w = fsdp::testing::world_size();
  const int tp = w % 2 == 0 ? 2 : 1;
  auto model = fsdp::parallel::parallelize(fsdp::testing::fresh_comm(), spec_of(config()),
                                           ParallelOptions().dims({.dp_shard = -1, .tp = tp}).n_microbatches(2));
  const int q = model.mesh().data_rank();
  if (model.mesh().data_world() > 1) {
    // Data rank 1 gets 2 rows, the others 4.
    at::Tensor x, y;
    std::tie(x, y) = batch(q, q == 1 ? 2 : 4);
    const std::string e = error_of([&] { model.forward_backward(x, y); });
    CHECK_THAT(e, Contains("the data-parallel replicas were given batches of different shapes"));
    check_same(e);
  }
  if (tp > 1) {
    // Seeded by world rank: the two ranks of a tp group read different data.
    at::Tensor x, y;
    std::tie(x, y) = batch(100 + fsdp::testing::rank(), 4);
    const std::string e = error_of([&] { model.forward_backward(x, y); });
    CHECK_THAT(e, Contains("but were given different inputs; seed the data by data rank"));
    check_same(e);
  }
  {
    at::Tensor x, y;
    std::tie(x, y) = batch(q, 3);  // 3 rows, 2 microbatches
    const std::string e = error_of([&] { model.forward_backward(x, y); });
    CHECK_THAT(e, Contains("the batch of 3 rows is not divisible into 2 microbatches"));
    check_same(e);
  }
  // The job goes on: a good step trains and its loss is finite on every rank.
  at::Tensor x, y;
  std::tie(x, y) = batch(q, 4);
  const at::Tensor loss = model.forward_backward(x, y);
  CHECK(std::isfinite(model.global_loss(loss)));
  CHECK(std::isfinite(model.clip_grad_norm_(1.0)));
}
