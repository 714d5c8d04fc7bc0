// The composition root (parallel/parallel_model.h) against the unsharded model, over MPI on 1-4
// ranks: every (dp_replicate, dp_shard, tp, pp) layout the launch allows trains the example GPT
// with dropout 0.1, clipping that binds every step and an abandoned step in the middle; after the
// applied steps every parameter equals the unsharded reference's.
//
// The reference is the same model built whole on one process (its stages, when the layout has a
// pipeline, run one after the other), trained on every data rank's batch with the same seeds: each
// stage forward of (step, data rank, microbatch, stage) seeded with fsdp::parallel::forward_seed
// exactly as the composition root seeds it, so every dropout mask is the same
// ([Note: tensor-parallel RNG]); gradients are those of the mean loss over data ranks and
// microbatches; torch::nn::utils::clip_grad_norm_ on all of them; AdamW.
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/optim/adamw.h>
#include <torch/torch.h>

#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/examples/gpt_model.h"
#include "fsdp_cpp/examples/gpt_model_spec.h"
#include "fsdp_cpp/parallel/parallel_model.h"
#include "fsdp_cpp/parallel/reference.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using fsdp::examples::GPTConfig;
using fsdp::parallel::ModelSpec;
using fsdp::parallel::ParallelDims;

constexpr uint64_t kSeed = 7;
constexpr int64_t kContext = 8;
constexpr double kMaxNorm = 0.05;  // below every step's norm: clipping binds
constexpr double kLr = 1e-3;

GPTConfig config() {
  // Divisible by every tp size up to 4: heads 12, d_model 48, MLP 96, vocabulary 24.
  return GPTConfig(24).context_length(kContext).d_model(48).n_heads(12).n_layers(4).mlp_ratio(2).dropout(0.1).tie_embeddings(
      false);
}

// A loss that throws in microbatch 1 of the step it is armed for (every rank alike): the step is
// abandoned after microbatch 0's backward accumulated its gradients.
struct ThrowingLoss {
  int64_t* armed_calls = nullptr;  // > 0: count down, throw at 0
  at::Tensor operator()(const at::Tensor& logits, const at::Tensor& targets) const {
    if (armed_calls && *armed_calls > 0 && --*armed_calls == 0) throw std::runtime_error("bad microbatch");
    return fsdp::examples::next_token_loss(logits, targets);
  }
};

ModelSpec gpt_spec(int64_t* armed) {
  ModelSpec spec = fsdp::examples::gpt_model_spec(config(), /*init_seed=*/1234);
  spec.loss = ThrowingLoss{armed};
  return spec;
}

// Data rank q's batch of step k: [batch, context] tokens and their next tokens.
std::pair<at::Tensor, at::Tensor> batch_of(int64_t step, int q, int64_t batch) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * step + q);
  const at::Tensor t = at::randint(0, config().vocab_size(), {batch, kContext + 1}, gen, at::kLong);
  return {t.narrow(1, 0, kContext).contiguous(), t.narrow(1, 1, kContext).contiguous()};
}

struct Layout {
  ParallelDims dims;
  int microbatches;
  bool abandon_by_throw;  // pipeline layouts abandon a finished step instead
};

// The steps: 1 applied, 2 abandoned, 3 and 4 applied.
bool applied(int64_t step) { return step != 2; }

fsdp::parallel::ParallelOptions options_of(const Layout& layout) {
  return fsdp::parallel::ParallelOptions().dims(layout.dims).n_microbatches(layout.microbatches).seed(kSeed);
}

// The reference (parallel/reference.h): the whole model on this process; returns each applied
// step's total norm.
std::vector<double> train_reference(const Layout& layout, fsdp::parallel::UnshardedReference& reference) {
  torch::optim::AdamW optim(reference.parameters(), torch::optim::AdamWOptions(kLr));
  const int dp = layout.dims.dp_replicate * layout.dims.dp_shard;
  const int64_t batch = 2 * layout.microbatches;
  std::vector<double> norms;
  for (int64_t step = 1; step <= 4; ++step) {
    if (!applied(step)) continue;
    std::vector<fsdp::parallel::Batch> global;
    for (int q = 0; q < dp; ++q) {
      auto [x, y] = batch_of(step, q, batch);
      global.push_back({x, y});
    }
    reference.forward_backward(step, global);
    norms.push_back(reference.clip_grad_norm_(kMaxNorm));
    optim.step();
    reference.zero_grad();
  }
  return norms;
}

void check_layout(const Layout& layout) {
  INFO("layout " << layout.dims.describe() << ", " << layout.microbatches << " microbatches");
  int64_t armed = 0;
  auto model = fsdp::parallel::parallelize(fsdp::testing::fresh_comm(), gpt_spec(&armed), options_of(layout));
  torch::optim::AdamW optim(model.parameters(), torch::optim::AdamWOptions(kLr));
  const int m = layout.microbatches;
  const int64_t batch = 2 * m;
  std::vector<double> norms;
  for (int64_t step = 1; step <= 4; ++step) {
    auto [x, y] = batch_of(step, model.mesh().data_rank(), batch);
    if (!applied(step)) {
      if (layout.abandon_by_throw) {
        armed = 2;  // the second microbatch's loss throws, after the first one's backward
        CHECK_THROWS_WITH(model.forward_backward(x, y), Catch::Matchers::Contains("bad microbatch"));
      } else {
        model.forward_backward(x, y);
      }
      model.zero_grad();  // abandoned: nothing of it may reach the next update
      continue;
    }
    model.forward_backward(x, y);
    norms.push_back(model.clip_grad_norm_(kMaxNorm));
    optim.step();
    model.zero_grad();
  }
  fsdp::parallel::UnshardedReference reference(gpt_spec(nullptr), options_of(layout));
  const auto ref_norms = train_reference(layout, reference);
  REQUIRE(norms.size() == ref_norms.size());
  for (size_t i = 0; i < norms.size(); ++i) {
    INFO("applied step " << i + 1);
    CHECK(ref_norms[i] > kMaxNorm);
    CHECK(std::abs(norms[i] - ref_norms[i]) <= 1e-4 * ref_norms[i]);
  }
  // This rank's parts against the reference's stages, every FQN.
  for (size_t c = 0; c < model.parts().size(); ++c) {
    const int s = model.stages()[c];
    const auto full = fsdp::full_state_dict(model.roots()[c], fsdp::FullStateDictOptions().rank0_only(false));
    const auto expected = reference.parts()[s].module->named_parameters();
    REQUIRE(full.size() == expected.size());
    for (const auto& item : expected) {
      INFO("stage " << s << " parameter " << item.key());
      REQUIRE(full.contains(item.key()));
      const double diff = (full[item.key()] - item.value()).abs().max().item<double>();
      CHECK(diff < 2e-5);
    }
  }
}

std::vector<Layout> layouts(int w) {
  std::vector<Layout> out;
  auto add = [&](int r, int s, int tp, int pp) {
    out.push_back(Layout{ParallelDims{r, s, tp, pp}, pp > 1 ? std::max(2, pp) : 2, pp == 1});
  };
  add(1, w, 1, 1);  // pure fully_shard
  if (w == 1) return out;
  if (w == 8) {  // //tests/parallel:composition_8_test: the 3-D layouts
    add(2, 2, 2, 1);  // HSDP x tensor parallel
    add(1, 2, 2, 2);  // pipeline x fully_shard x tensor parallel
    add(2, 1, 2, 2);  // pipeline x HSDP replicas x tensor parallel
    return out;
  }
  add(1, 1, w, 1);  // pure tensor parallel
  add(1, 1, 1, w);  // pure pipeline
  add(w, 1, 1, 1);  // HSDP, replicas only
  if (w == 4) {
    add(1, 2, 2, 1);  // fully_shard x tensor parallel
    add(2, 2, 1, 1);  // HSDP
    add(1, 2, 1, 2);  // pipeline x fully_shard
    add(1, 1, 2, 2);  // pipeline x tensor parallel
    add(2, 1, 2, 1);  // HSDP replicas x tensor parallel
  }

  return out;
}

}  // namespace

FSDP_RANKS_TEST_CASE("composition root: every layout trains the unsharded model (dropout, clipping, abandoned step)",
                     "[parallel]") {
  for (const auto& layout : layouts(fsdp::testing::world_size())) check_layout(layout);
}
