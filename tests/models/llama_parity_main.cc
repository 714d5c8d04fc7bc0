// The C++ Llama (models/llama.h) against Hugging Face transformers at one parallel layout:
//   llama_parity_main HF_DIR REFERENCE OUT DP_REPLICATE DP_SHARD TP PP MICROBATCHES LOSS_PARALLEL VOCAB_MULTIPLE
//                     [ac] [sp] [cp=N]
// ("ac": activation checkpointing on every decoder layer; "sp": sequence parallelism; "cp=N": each
// sequence split over N context-parallel ranks, ring attention; the logits compared on this cp
// rank's tokens)
// loads HF_DIR (a transformers save_pretrained folder) into the job, then checks against
// REFERENCE (tests/models/hf_reference.py make):
//   - logits of the loaded model on this data rank's rows (pp = 1; with loss parallel, each tp
//     rank's vocabulary columns);
//   - the loss of one step (label padding -100, uneven over rows and data ranks) and every
//     parameter's gradient (read as the change of one SGD step with lr 1, undone after);
//   - every parameter after 3 AdamW steps (lr 1e-2, weight decay 0.1) and, at pp = 1, the logits;
// then exports the trained model to OUT/export (and its logits to OUT/logits.safetensors), which
// hf_reference.py check loads in transformers. Exit 1 with the worst differences on a mismatch.
#include <cstdio>
#include <cstdlib>
#include <string>

#include <torch/torch.h>

#include "fsdp_cpp/checkpoint/full_state_dict_files.h"
#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/composable/context_parallel.h"
#include "fsdp_cpp/models/hf_checkpoint.h"
#include "fsdp_cpp/models/llama.h"
#include "fsdp_cpp/models/llama_parallel.h"
#include "fsdp_cpp/parallel/parallel_model.h"
#include "fsdp_cpp/storage/safetensors.h"

namespace {

// After training, as moe_parity_main's: AdamW divides each update by sqrt(v) + 1e-8, so elements
// with gradients near 1e-6 carry the gradients' rounding (6e-8 here at every layout) into the
// parameters: 1.9e-5 at dp=4 and 2.7e-5 at cp=3 on the 24-token batch, 5e-6 and less elsewhere.
constexpr double kLogitsTol = 2e-5, kLossTol = 1e-5, kGradTol = 2e-6, kTrainedTol = 5e-5;
int failures = 0;

void expect_close(const std::string& what, const at::Tensor& got, const at::Tensor& want, double tol, int rank,
                  double* worst = nullptr) {
  if (got.sizes() != want.sizes()) {
    std::printf("rank %d: %s: shape %s, expected %s\n", rank, what.c_str(), c10::str(got.sizes()).c_str(),
                c10::str(want.sizes()).c_str());
    ++failures;
    return;
  }
  const double err = got.numel() == 0 ? 0.0 : (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>();
  if (worst) *worst = std::max(*worst, err);
  if (!(err <= tol)) {
    std::printf("rank %d: %s: max |C++ - transformers| = %.3g > %.1g\n", rank, what.c_str(), err, tol);
    ++failures;
  }
}

// Every parameter of this rank's parts, whole (full_state_dict on every rank of each part).
std::map<std::string, at::Tensor> full_parameters(const fsdp::parallel::ParallelModel& model) {
  std::map<std::string, at::Tensor> out;
  for (const auto& root : model.roots()) {
    for (const auto& item : fsdp::full_state_dict(root, fsdp::FullStateDictOptions().rank0_only(false))) {
      out[item.key()] = item.value().clone();
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  bool ac = false, sp = false, bad = argc < 11;
  int cp = 1;
  for (int i = 11; i < argc; ++i) {
    const std::string flag = argv[i];
    ac = ac || flag == "ac";
    sp = sp || flag == "sp";
    if (flag.rfind("cp=", 0) == 0) cp = std::atoi(flag.c_str() + 3);
    bad = bad || (flag != "ac" && flag != "sp" && flag.rfind("cp=", 0) != 0);
  }
  if (bad) {
    std::fprintf(stderr, "usage: %s HF_DIR REFERENCE OUT DP_REPLICATE DP_SHARD TP PP MICROBATCHES LOSS_PARALLEL "
                 "VOCAB_MULTIPLE [ac] [sp] [cp=N]\n", argv[0]);
    return 2;
  }
  const std::string hf_dir = argv[1], out = argv[3];
  const fsdp::parallel::ParallelDims dims{.dp_replicate = std::atoi(argv[4]), .dp_shard = std::atoi(argv[5]),
                                          .tp = std::atoi(argv[6]), .pp = std::atoi(argv[7]), .cp = cp};
  const int microbatches = std::atoi(argv[8]);
  const bool loss_parallel = std::atoi(argv[9]) != 0;
  auto pg = fsdp::comm::init_process_group();
  const int rank = pg.comm->rank();
  const auto config = fsdp::models::read_llama_config(hf_dir, std::atoi(argv[10]));
  const auto ref = fsdp::load_safetensors(argv[2]);
  auto spec = fsdp::models::llama_model_spec(config, /*init_seed=*/7,
                                             fsdp::models::LlamaParallel().loss_parallel(loss_parallel).sequence_parallel(sp));
  auto model = fsdp::parallel::parallelize(
      pg.comm, spec, fsdp::parallel::ParallelOptions().dims(dims).n_microbatches(microbatches).checkpoint_activations(ac));
  fsdp::models::load_llama_hf(model, config, hf_dir);
  const auto& mesh = model.mesh();
  const int64_t rows = ref["input_ids"].size(0) / mesh.data_world();
  const at::Tensor inputs = ref["input_ids"].narrow(0, mesh.data_rank() * rows, rows);
  const at::Tensor labels = ref["labels"].narrow(0, mesh.data_rank() * rows, rows);
  const bool last = model.stages().back() == model.n_stages() - 1;
  const int64_t vocab = config.vocab_size();
  const int tp = mesh.dims().tp, tp_rank = mesh.tp_rank();

  // This rank's logits against transformers' (its rows; its vocabulary columns with loss parallel).
  auto check_logits = [&](const std::string& what, const at::Tensor& want_all) {
    // (A length cp cannot split is forward_backward's to refuse, on every rank.)
    if (dims.pp != 1 || inputs.size(1) % (2 * cp) != 0) return;
    at::Tensor got;
    {
      torch::NoGradGuard no_grad;
      got = model.parts().front().forward(cp > 1 ? fsdp::cp::shard_sequence(inputs, 1, cp, mesh.cp_rank()) : inputs);
    }
    at::Tensor want = want_all.narrow(0, mesh.data_rank() * rows, rows);
    if (cp > 1) want = fsdp::cp::shard_sequence(want, 1, cp, mesh.cp_rank());
    if (loss_parallel && tp > 1) {
      const int64_t width = got.size(-1), begin = tp_rank * width;
      const int64_t real = std::max<int64_t>(0, std::min(width, vocab - begin));
      // Padding columns are the zero rows' logits.
      expect_close(what + " (padding columns)", got.narrow(-1, real, width - real),
                   at::zeros({rows, got.size(1), width - real}), 0.0, rank);
      got = got.narrow(-1, 0, real);
      want = want.narrow(-1, std::min(begin, vocab), real);
    }
    double worst = 0.0;
    expect_close(what, got, want, kLogitsTol, rank, &worst);
    if (rank == 0) std::printf("%s: max difference %.3g\n", what.c_str(), worst);
  };
  check_logits("logits of the loaded model", ref["logits"]);

  // One step: the loss and every gradient.
  const auto before = full_parameters(model);
  at::Tensor loss = model.forward_backward(inputs, labels);
  const double global = model.global_loss(loss);
  expect_close("loss", at::tensor({global}), ref["loss"].to(at::kDouble), kLossTol, rank);
  if (rank == 0) std::printf("loss %.7f, transformers %.7f\n", global, ref["loss"].item<double>());
  const auto params = model.parameters();
  {
    torch::optim::SGD sgd(params, torch::optim::SGDOptions(1.0));
    sgd.step();
  }
  double worst_grad = 0.0;
  for (const auto& [key, after] : full_parameters(model)) {
    at::Tensor grad = before.at(key) - after;
    if (grad.size(0) > vocab && (key == "model.embed_tokens.weight" || key == "lm_head.weight")) {
      expect_close(key + " gradient of the padding rows", grad.narrow(0, vocab, grad.size(0) - vocab),
                   at::zeros({grad.size(0) - vocab, grad.size(1)}), 0.0, rank);
      grad = grad.narrow(0, 0, vocab);
    }
    expect_close("gradient of " + key, grad, ref["grad." + key], kGradTol, rank, &worst_grad);
  }
  {
    torch::NoGradGuard no_grad;
    for (const auto& p : params) {
      if (p.grad().defined()) p.add_(p.grad());  // the SGD step undone
    }
  }
  if (rank == 0) std::printf("gradients: max difference %.3g\n", worst_grad);

  // Three AdamW steps on the same batch, the first with the gradients above.
  torch::optim::AdamW adamw(params, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  for (int step = 0; step < 3; ++step) {
    if (step > 0) {
      model.zero_grad();
      model.forward_backward(inputs, labels);
    }
    adamw.step();
  }
  model.zero_grad();
  double worst_trained = 0.0;
  for (const auto& [key, value] : full_parameters(model)) {
    at::Tensor v = value;
    if (v.size(0) > vocab && (key == "model.embed_tokens.weight" || key == "lm_head.weight")) v = v.narrow(0, 0, vocab);
    expect_close("trained " + key, v, ref["trained." + key], kTrainedTol, rank, &worst_trained);
  }
  if (rank == 0) std::printf("parameters after 3 AdamW steps: max difference %.3g\n", worst_trained);
  check_logits("logits after 3 AdamW steps", ref["trained_logits"]);

  fsdp::models::export_llama_hf(model, config, out + "/export");
  if (dims.pp == 1 && !(loss_parallel && tp > 1) && dims.dp() == 1 && cp == 1) {
    torch::NoGradGuard no_grad;
    const at::Tensor logits = model.parts().front().forward(inputs);
    if (rank == 0) fsdp::storage::write_safetensors(out + "/logits.safetensors", {{"logits", logits}});
  }
  (void)last;
  int any = failures;
  {
    at::Tensor f = at::full({1}, failures, at::kLong);
    pg.comm->all_reduce(f, c10d::ReduceOp::SUM, "llama_parity").wait();
    any = static_cast<int>(f.item<int64_t>());
  }
  if (rank == 0) std::printf("%s: %s\n", model.describe().c_str(), any ? "MISMATCH" : "equal to transformers");
  return any ? 1 : 0;
}
