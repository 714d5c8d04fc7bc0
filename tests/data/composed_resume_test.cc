// A composed job (parallel/parallel_model.h) training on the shipped token file
// (examples/data/corpus.tokens) through TokenDataset, saved mid-epoch with the dataset's state as a
// checkpoint value (parallel/checkpoint.h) and resumed by a new job at another layout (another
// number of data ranks too), over MPI on 1-4 ranks: the resumed job reads exactly the batches the
// uninterrupted job would have read, and its parameters equal the unsharded reference trained on
// the uninterrupted stream. Each step's global batch is 12 windows of the stream, split over the
// data ranks (12 / data ranks each).
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>
#include <torch/torch.h>

#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/data/token_dataset.h"
#include "fsdp_cpp/examples/gpt_model.h"
#include "fsdp_cpp/examples/gpt_model_spec.h"
#include "fsdp_cpp/parallel/checkpoint.h"
#include "fsdp_cpp/parallel/parallel_model.h"
#include "fsdp_cpp/parallel/reference.h"
#include "fsdp_cpp/tests/testing/multi_rank.h"

namespace {

using fsdp::data::TokenDataset;
using fsdp::data::TokenDatasetOptions;
using fsdp::data::TokenFile;
using fsdp::parallel::ParallelDims;
using fsdp::parallel::ParallelOptions;

constexpr int64_t kSeqLen = 8;
constexpr int64_t kGlobalRows = 12;  // every data-rank count of 1-4 divides it
constexpr uint64_t kDataSeed = 3;
constexpr double kMaxNorm = 0.05;

// The shipped file, from the test's runfiles (the working directory of the MPI ranks).
std::string corpus_tokens() {
  const std::string relative = "examples/data/corpus.tokens";
  if (const char* srcdir = std::getenv("TEST_SRCDIR")) {
    const std::string path = std::string(srcdir) + "/fsdp_cpp/" + relative;
    if (FILE* f = std::fopen(path.c_str(), "rb")) {
      std::fclose(f);
      return path;
    }
  }
  return relative;
}

// No dropout: the two layouts cut the model into different stages, whose forward seeds differ.
fsdp::parallel::ModelSpec spec(int64_t vocab) {
  return fsdp::examples::gpt_model_spec(
      fsdp::examples::GPTConfig(vocab).context_length(kSeqLen).d_model(48).n_heads(12).n_layers(4).tie_embeddings(false),
      /*init_seed=*/21);
}

ParallelOptions options(const ParallelDims& dims) { return ParallelOptions().dims(dims).n_microbatches(std::max(1, dims.pp)); }

torch::optim::AdamWOptions adamw() { return torch::optim::AdamWOptions(1e-3).weight_decay(0.1); }

TokenDataset dataset_of(const std::shared_ptr<const TokenFile>& file, const fsdp::parallel::ParallelModel& model) {
  return TokenDataset(file, TokenDatasetOptions(kSeqLen)
                                .seed(kDataSeed)
                                .data_rank(model.mesh().data_rank())
                                .data_size(model.mesh().data_world()));
}

// Trains `steps` steps on the dataset's batches; returns the inputs read.
std::vector<at::Tensor> train(fsdp::parallel::ParallelModel& model, torch::optim::Optimizer& optim, TokenDataset& data,
                              int steps) {
  std::vector<at::Tensor> read;
  for (int i = 0; i < steps; ++i) {
    const auto batch = data.next_batch(kGlobalRows / model.mesh().data_world());
    read.push_back(batch.inputs);
    model.forward_backward(batch.inputs, batch.targets);
    model.clip_grad_norm_(kMaxNorm);
    optim.step();
    model.zero_grad();
  }
  return read;
}

}  // namespace

FSDP_RANKS_TEST_CASE("a composed job resumed mid-epoch from its checkpoint reads the uninterrupted job's batches",
                     "[parallel][data]") {
  const int w = fsdp::testing::world_size();
  // Layout A, then B: the data ranks change (1 -> 1, 2 -> 1, 3 -> 1, 2 -> 4) with the layout.
  ParallelDims a{.dp_shard = w}, b{.dp_shard = w};
  if (w == 2) b = {.dp_shard = 1, .tp = 2};
  if (w == 3) b = {.dp_shard = 1, .pp = 3};
  if (w == 4) a = {.dp_shard = 2, .tp = 2};
  auto file = std::make_shared<const TokenFile>(corpus_tokens(), fsdp::data::TokenFileOptions{.check_tokens = true});
  REQUIRE(file->vocab_size() == 512);
  const std::string dir = fsdp::testing::shared_tmpdir() + "/composed_data_ckpt";
  {
    auto model = fsdp::parallel::parallelize(fsdp::testing::fresh_comm(), spec(file->vocab_size()), options(a));
    torch::optim::AdamW optim(model.parameters(), adamw());
    TokenDataset data = dataset_of(file, model);
    train(model, optim, data, 2);
    REQUIRE(data.epoch() == 0);  // mid-epoch: 24 of the file's windows read
    REQUIRE(data.position() == 2 * kGlobalRows);
    REQUIRE(data.num_windows() > 3 * kGlobalRows);
    fsdp::parallel::save_checkpoint(dir, model, optim, {{"data", data.state().to_string()}, {"run", "resume-test"}});
  }
  auto model = fsdp::parallel::parallelize(fsdp::testing::fresh_comm(), spec(file->vocab_size()), options(b));
  torch::optim::AdamW optim(model.parameters(), adamw());
  fsdp::parallel::CheckpointValues values{{"stale", "x"}};
  fsdp::parallel::load_checkpoint(dir, model, optim, &values);
  CHECK(model.steps() == 2);
  REQUIRE(values.size() == 2);
  CHECK(values.at("run") == "resume-test");
  TokenDataset data = dataset_of(file, model);
  data.load_state(values.at("data"));
  const auto read = train(model, optim, data, 2);

  // The uninterrupted stream, one global batch per step, and the reference trained on it.
  TokenDataset stream(file, TokenDatasetOptions(kSeqLen).seed(kDataSeed));
  const int dp_b = b.dp();
  const int64_t rows = kGlobalRows / dp_b;
  fsdp::parallel::UnshardedReference reference(spec(file->vocab_size()), options(b));
  torch::optim::AdamW ref_optim(reference.parameters(), adamw());
  for (int64_t step = 1; step <= 4; ++step) {
    const auto global = stream.next_batch(kGlobalRows);
    std::vector<fsdp::parallel::Batch> split;
    for (int q = 0; q < dp_b; ++q) {
      split.push_back({global.inputs.narrow(0, q * rows, rows), global.targets.narrow(0, q * rows, rows)});
    }
    if (step > 2) {
      // What this rank read after the resume is its data rank's slice of the uninterrupted step.
      CHECK(read[step - 3].equal(split[model.mesh().data_rank()].inputs));
    }
    reference.forward_backward(step, split);
    reference.clip_grad_norm_(kMaxNorm);
    ref_optim.step();
    reference.zero_grad();
  }
  CHECK(data.state() == stream.state());
  for (size_t c = 0; c < model.parts().size(); ++c) {
    const auto full = fsdp::full_state_dict(model.roots()[c], fsdp::FullStateDictOptions().rank0_only(false));
    const auto expected = reference.parts()[model.stages()[c]].module->named_parameters();
    REQUIRE(full.size() == expected.size());
    for (const auto& item : expected) {
      INFO("parameter " << item.key());
      REQUIRE(full.contains(item.key()));
      CHECK((full[item.key()] - item.value()).abs().max().item<double>() < 2e-5);
    }
  }
}
