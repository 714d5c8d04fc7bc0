// The C++ Qwen3-MoE (models/moe.h) against Hugging Face transformers at one parallel layout:
//   moe_parity_main HF_DIR REFERENCE OUT DP_REPLICATE DP_SHARD TP PP MICROBATCHES LOSS_PARALLEL VOCAB_MULTIPLE
//                   [ac] [ep=N]
// loads HF_DIR (tests/models/moe_reference.py make) into the job, then checks against REFERENCE,
// for the split k = data ranks x microbatches of the batch ([Note: auxiliary loss in the training
// loss] in models/moe_parallel.h: the reference computed each k's loss):
//   - at pp = 1, logits of the loaded model on this data rank's rows (with loss parallel, each tp
//     rank's vocabulary columns), and the auxiliary loss of those rows (transformers'
//     load_balancing_loss_func);
//   - the routing of the step's last forward (its last microbatch) in every sparse layer this rank
//     holds: top-k expert ids equal and weights within kRoutingTol, token by token; the experts that
//     got no row on this rank are printed, and their count over the job;
//   - the loss of one step (cross-entropy + router_aux_loss_coef x aux; label padding -100, uneven
//     over rows and data ranks) and every parameter's gradient (the change of one SGD step, lr 1,
//     undone after);
//   - every parameter and buffer after 3 AdamW steps (lr 1e-2, weight decay 0.1, eps 1e-6; with sigmoid
//     scoring, update_moe_router_bias after each) and, at pp = 1, the logits;
// ("ac": with activation checkpointing, the spec's policy; "ep=N": the experts split over N
// expert-parallel ranks taken from dp_shard, tokens dispatched by all-to-all.) Then exports the trained model to OUT/export (and its logits to OUT/logits.safetensors), which
// moe_reference.py check loads in transformers. Exit 1 with the worst differences on a mismatch.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

#include <torch/torch.h>

#include "fsdp_cpp/checkpoint/full_state_dict_files.h"
#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/models/moe.h"
#include "fsdp_cpp/models/moe_checkpoint.h"
#include "fsdp_cpp/models/moe_parallel.h"
#include "fsdp_cpp/parallel/parallel_model.h"
#include "fsdp_cpp/storage/safetensors.h"

namespace {

// As llama_parity_main's, except after training: AdamW divides each update by |gradient| + eps,
// so the many small expert gradients carry their rounding into the parameters more than a dense
// model's (and the trained logits follow them).
constexpr double kLogitsTol = 2e-5, kLossTol = 1e-5, kGradTol = 2e-6, kRoutingTol = 1e-6, kAuxTol = 1e-6;
constexpr double kTrainedTol = 5e-5, kTrainedLogitsTol = 1e-4;
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

// Every parameter and buffer of this rank's parts, whole (full_state_dict on every rank of each part).
std::map<std::string, at::Tensor> full_state(const fsdp::parallel::ParallelModel& model) {
  std::map<std::string, at::Tensor> out;
  for (const auto& root : model.roots()) {
    for (const auto& item : fsdp::full_state_dict(root, fsdp::FullStateDictOptions().rank0_only(false))) {
      out[item.key()] = item.value().clone();
    }
  }
  return out;
}

std::shared_ptr<fsdp::models::MoeForCausalLMImpl> moe_of(const fsdp::parallel::ModelPart& part) {
  return std::dynamic_pointer_cast<fsdp::models::MoeForCausalLMImpl>(part.module);
}

}  // namespace

int main(int argc, char** argv) {
  bool ac = false, usage = argc < 11;
  int ep = 1;
  for (int i = 11; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "ac") {
      ac = true;
    } else if (flag.rfind("ep=", 0) == 0) {
      ep = std::atoi(flag.c_str() + 3);
    } else {
      usage = true;
    }
  }
  if (usage) {
    std::fprintf(stderr, "usage: %s HF_DIR REFERENCE OUT DP_REPLICATE DP_SHARD TP PP MICROBATCHES LOSS_PARALLEL "
                 "VOCAB_MULTIPLE [ac] [ep=N]\n", argv[0]);
    return 2;
  }
  const std::string hf_dir = argv[1], out = argv[3];
  const fsdp::parallel::ParallelDims dims{.dp_replicate = std::atoi(argv[4]), .dp_shard = std::atoi(argv[5]),
                                          .tp = std::atoi(argv[6]), .pp = std::atoi(argv[7]), .ep = ep};
  const int microbatches = std::atoi(argv[8]);
  const bool loss_parallel = std::atoi(argv[9]) != 0;
  auto pg = fsdp::comm::init_process_group();
  const int rank = pg.comm->rank();
  const auto config = fsdp::models::read_moe_config(hf_dir, std::atoi(argv[10]));
  const auto ref = fsdp::load_safetensors(argv[2]);
  auto spec = fsdp::models::moe_model_spec(config, /*init_seed=*/7,
                                           fsdp::models::MoeParallel().loss_parallel(loss_parallel));
  auto model = fsdp::parallel::parallelize(
      pg.comm, spec,
      fsdp::parallel::ParallelOptions().dims(dims).n_microbatches(microbatches).checkpoint_activations(ac));
  fsdp::models::load_moe_hf(model, config, hf_dir);
  const auto& mesh = model.mesh();
  const int64_t batch = ref["input_ids"].size(0), time = ref["input_ids"].size(1);
  const int64_t rows = batch / mesh.data_world();
  const at::Tensor inputs = ref["input_ids"].narrow(0, mesh.data_rank() * rows, rows);
  const at::Tensor labels = ref["labels"].narrow(0, mesh.data_rank() * rows, rows);
  const int64_t vocab = config.vocab_size(), n_experts = config.num_experts();
  const int tp = mesh.dims().tp, tp_rank = mesh.tp_rank();
  const std::string k = "k" + std::to_string(mesh.data_world() * microbatches);
  auto reference = [&](const std::string& key) {
    const at::Tensor* t = ref.find(key);
    TORCH_CHECK(t != nullptr, "the reference has no '", key, "' (splits of the batch: 1 .. 4)");
    return *t;
  };
  if (rank == 0) std::printf("%s; the batch in %s chunks (data ranks x microbatches)\n", model.describe().c_str(), k.c_str() + 1);

  // This rank's logits against transformers' (its rows; its vocabulary columns with loss parallel).
  auto check_logits = [&](const std::string& what, const at::Tensor& want_all, bool aux, double tol) {
    if (dims.pp != 1) return;
    at::Tensor got, stats;
    {
      torch::NoGradGuard no_grad;
      got = model.parts().front().forward(inputs);
    }
    if (config.has_aux_loss()) std::tie(got, stats) = fsdp::models::split_router_stats(got, time, n_experts);
    if (aux) {
      const at::Tensor mine = fsdp::models::moe_aux_loss(stats, config, rows * time);
      const at::Tensor want = reference("aux.k" + std::to_string(mesh.data_world()))[mesh.data_rank()];
      expect_close("auxiliary loss of this data rank's rows", mine, want, kAuxTol, rank);
      if (rank == 0) {
        std::printf("auxiliary loss (load_balancing_loss_func) of data rank 0's rows: %.7f, transformers %.7f\n",
                    mine.item<double>(), want.item<double>());
      }
    }
    at::Tensor want = want_all.narrow(0, mesh.data_rank() * rows, rows);
    if (loss_parallel && tp > 1) {
      const int64_t width = got.size(-1), begin = tp_rank * width;
      const int64_t real = std::max<int64_t>(0, std::min(width, vocab - begin));
      expect_close(what + " (padding columns)", got.narrow(-1, real, width - real),
                   at::zeros({rows, got.size(1), width - real}), 0.0, rank);
      got = got.narrow(-1, 0, real);
      want = want.narrow(-1, std::min(begin, vocab), real);
    }
    double worst = 0.0;
    expect_close(what, got, want, tol, rank, &worst);
    if (rank == 0) std::printf("%s: max difference %.3g\n", what.c_str(), worst);
  };
  check_logits("logits of the loaded model", reference("logits"), true, kLogitsTol);

  // One step: the loss, the routing of its last forward, every gradient.
  const auto before = full_state(model);
  at::Tensor loss = model.forward_backward(inputs, labels);
  const double global = model.global_loss(loss);
  expect_close("loss", at::tensor({global}), reference("loss." + k).to(at::kDouble), kLossTol, rank);
  if (rank == 0) std::printf("loss (cross-entropy + coef x aux) %.7f, transformers %.7f\n", global,
                             reference("loss." + k).item<double>());

  const int64_t mb_rows = rows / microbatches;
  const int64_t first_token = (mesh.data_rank() * rows + (microbatches - 1) * mb_rows) * time;
  int64_t empty_calls = 0, routed_tokens = 0;
  for (const auto& part : model.parts()) {
    for (const auto& routing : moe_of(part)->last_routing()) {
      // Ids ascending per token, the weights in the same order (the reference's layout).
      const at::Tensor order = routing.expert_ids.argsort(/*dim=*/int64_t{-1}, /*descending=*/false);
      const at::Tensor ids = routing.expert_ids.gather(-1, order), weights = routing.weights.gather(-1, order);
      const std::string layer = std::to_string(routing.layer);
      const at::Tensor want_ids = reference("routing.ids." + layer).narrow(0, first_token, mb_rows * time);
      const at::Tensor want_weights = reference("routing.weights." + layer).narrow(0, first_token, mb_rows * time);
      if (ids.sizes() != want_ids.sizes() || !ids.equal(want_ids)) {
        const int64_t differ = ids.sizes() == want_ids.sizes() ? (ids != want_ids).any(-1).sum().item<int64_t>() : -1;
        std::printf("rank %d: layer %s: top-%ld expert ids differ from transformers' for %ld of %ld tokens\n", rank,
                    layer.c_str(), static_cast<long>(config.num_experts_per_tok()), static_cast<long>(differ),
                    static_cast<long>(want_ids.size(0)));
        ++failures;
      } else {
        expect_close("routing weights of layer " + layer, weights, want_weights, kRoutingTol, rank);
      }
      routed_tokens += ids.size(0);
      std::string empty;
      for (int64_t e = 0; e < n_experts; ++e) {
        if (routing.rows_per_expert[e] == 0) {
          empty += " " + std::to_string(e);
          ++empty_calls;
        }
      }
      if (!empty.empty()) {
        std::printf("rank %d (data rank %d, tp rank %d): layer %s: expert(s)%s got no row (called with an empty "
                    "batch)\n", rank, mesh.data_rank(), tp_rank, layer.c_str(), empty.c_str());
      }
    }
  }
  {
    at::Tensor counts = at::tensor({empty_calls, routed_tokens}, at::kLong);
    pg.comm->all_reduce(counts, c10d::ReduceOp::SUM, "moe_parity").wait();
    if (rank == 0) {
      std::printf("routing of the step's last forward: %ld token-layers checked over the job, ids equal and weights "
                  "within %.0e unless reported; empty expert calls over the job: %ld\n",
                  static_cast<long>(counts[1].item<int64_t>()), kRoutingTol, static_cast<long>(counts[0].item<int64_t>()));
    }
  }

  const auto params = model.parameters();
  {
    torch::optim::SGD sgd(params, torch::optim::SGDOptions(1.0));
    sgd.step();
  }
  double worst_grad = 0.0;
  int64_t checked = 0;
  for (const auto& [key, after] : full_state(model)) {
    const at::Tensor* want = ref.find("grad." + k + "." + key);
    if (want == nullptr) {
      if (key.size() < 23 || key.substr(key.size() - 23) != "e_score_correction_bias") {
        std::printf("rank %d: no reference gradient for '%s'\n", rank, key.c_str());
        ++failures;
      }
      continue;  // a buffer
    }
    at::Tensor grad = before.at(key) - after;
    if (grad.size(0) > vocab && (key == "model.embed_tokens.weight" || key == "lm_head.weight")) {
      expect_close(key + " gradient of the padding rows", grad.narrow(0, vocab, grad.size(0) - vocab),
                   at::zeros({grad.size(0) - vocab, grad.size(1)}), 0.0, rank);
      grad = grad.narrow(0, 0, vocab);
    }
    expect_close("gradient of " + key, grad, *want, kGradTol, rank, &worst_grad);
    ++checked;
  }
  {
    torch::NoGradGuard no_grad;
    for (const auto& p : params) {
      if (p.grad().defined()) p.add_(p.grad());  // the SGD step undone
    }
  }
  if (rank == 0) std::printf("gradients of %ld tensors: max difference %.3g\n", static_cast<long>(checked), worst_grad);

  // Three AdamW steps on the same batch, the first with the gradients above; the routers' bias
  // follows each step's loads (sigmoid scoring).
  torch::optim::AdamW adamw(params, torch::optim::AdamWOptions(1e-2).weight_decay(0.1).eps(1e-6));
  for (int step = 0; step < 3; ++step) {
    if (step > 0) {
      model.zero_grad();
      model.forward_backward(inputs, labels);
    }
    adamw.step();
    fsdp::models::update_moe_router_bias(model);
  }
  model.zero_grad();
  double worst_trained = 0.0;
  for (const auto& [key, value] : full_state(model)) {
    at::Tensor v = value;
    if (v.size(0) > vocab && (key == "model.embed_tokens.weight" || key == "lm_head.weight")) v = v.narrow(0, 0, vocab);
    expect_close("trained " + key, v, reference("trained." + k + "." + key), kTrainedTol, rank, &worst_trained);
  }
  if (rank == 0) std::printf("parameters and buffers after 3 AdamW steps: max difference %.3g\n", worst_trained);
  check_logits("logits after 3 AdamW steps", reference("trained_logits." + k), false, kTrainedLogitsTol);

  fsdp::models::export_moe_hf(model, config, out + "/export");
  if (dims.pp == 1 && !(loss_parallel && tp > 1) && dims.dp() == 1) {
    torch::NoGradGuard no_grad;
    at::Tensor logits = model.parts().front().forward(inputs);
    if (config.has_aux_loss()) logits = fsdp::models::split_router_stats(logits, time, n_experts).first;
    if (rank == 0) fsdp::storage::write_safetensors(out + "/logits.safetensors", {{"logits", logits.contiguous()}});
  }
  int any = failures;
  {
    at::Tensor f = at::full({1}, failures, at::kLong);
    pg.comm->all_reduce(f, c10d::ReduceOp::SUM, "moe_parity").wait();
    any = static_cast<int>(f.item<int64_t>());
  }
  if (rank == 0) std::printf("%s: %s\n", model.describe().c_str(), any ? "MISMATCH" : "equal to transformers");
  return any ? 1 : 0;
}
