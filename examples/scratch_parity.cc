// Temporary: how chaotic is the training trajectory? Two unsharded references that differ only in
// floating-point summation order (concatenated batch vs per-rank losses / W), single process.
#include <cstdio>
#include <ATen/Parallel.h>
#include <ATen/ops/cat.h>
#include <torch/optim/adamw.h>
#include <torch/utils.h>
#include "examples/char_corpus.h"
#include "examples/gpt_model.h"
using namespace fsdp::examples;
int main(int argc, char** argv) {
  at::set_num_threads(1);
  int steps = std::atoi(argv[1]); double lr = std::atof(argv[2]);
  auto corpus = CharCorpus::embedded();
  auto config = GPTConfig(corpus.tokenizer().vocab_size()).context_length(64).d_model(128).n_heads(4).n_layers(4);
  torch::manual_seed(0); GPT a(config);
  torch::manual_seed(0); GPT b(config);
  torch::optim::AdamW oa(a->parameters(), torch::optim::AdamWOptions(lr).weight_decay(0.01));
  torch::optim::AdamW ob(b->parameters(), torch::optim::AdamWOptions(lr).weight_decay(0.01));
  for (int s = 1; s <= steps; ++s) {
    auto b0 = corpus.sample_batch({0, s, 0}, 16, 64), b1 = corpus.sample_batch({0, s, 1}, 16, 64);
    auto la = next_token_loss(a(at::cat({b0.inputs, b1.inputs})), at::cat({b0.targets, b1.targets}));
    la.backward(); oa.step(); oa.zero_grad();
    auto l0 = next_token_loss(b(b0.inputs), b0.targets), l1 = next_token_loss(b(b1.inputs), b1.targets);
    (l0 / 2).backward(); (l1 / 2).backward(); ob.step(); ob.zero_grad();
    double x = la.item<double>(), y = (l0.item<double>() + l1.item<double>()) / 2;
    if (s % 5 == 0 || s < 5) std::printf("%d %.6f %.6f %.2e\n", s, x, y, std::abs(x - y) / x);
  }
}
