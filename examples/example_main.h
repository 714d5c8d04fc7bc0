#pragma once
// What the example programs share around their training loops:
//   - example_main: flags parsed (usage on error, exit 2), intra-op threads set, the process group
//     initialised, the program run; an error is printed once, without backtrace (exit 1);
//   - unsharded_difference: the same training unsharded on one process (parallel/reference.h) and
//     the largest difference of its per-step losses from the job's, printed with "match" (< 1e-3)
//     or "MISMATCH".
//
//   int main(int argc, char** argv) {
//     return fsdp::examples::example_main<Flags>("train_x", kUsage, argc, argv, parse_flags, run);
//   }

#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/optim/adamw.h>

#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/parallel/reference.h"

namespace fsdp::examples {

template <typename Flags, typename Parse, typename Run>
int example_main(const char* name, const char* usage, int argc, char** argv, Parse parse, Run run) {
  Flags f;
  try {
    f = parse(argc, argv);
  } catch (const std::exception& e) {
    if (std::string(e.what()) != "help") std::fprintf(stderr, "%s: %s\n", name, e.what());
    std::fputs(usage, stderr);
    return 2;
  }
  at::set_num_threads(static_cast<int>(f.threads));
  try {
    const auto group = comm::init_process_group();
    return run(f, group);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s: %s\n", name, e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", name, e.what());
  }
  return 1;
}

/// Trains `reference` for losses.size() steps (AdamW with `optim`, clipping at `clip` when
/// positive, then `after_step` if given) on `global_batch(step)` (one batch per data rank, steps
/// from 1), prints the comparison with the job's per-step `losses` (`what` says what the runs
/// share) and returns 0 on a match, 1 otherwise.
inline int unsharded_difference(parallel::UnshardedReference& reference, const torch::optim::AdamWOptions& optim,
                                double clip, const std::vector<double>& losses, const char* what,
                                const std::function<std::vector<parallel::Batch>(int64_t step)>& global_batch,
                                const std::function<void(parallel::UnshardedReference&)>& after_step = {}) {
  torch::optim::AdamW ref_optim(reference.parameters(), optim);
  double worst = 0;
  const auto steps = static_cast<int64_t>(losses.size());
  for (int64_t step = 1; step <= steps; ++step) {
    const double loss = reference.forward_backward(step, global_batch(step)).item<double>();
    if (clip > 0) reference.clip_grad_norm_(clip);
    ref_optim.step();
    if (after_step) after_step(reference);
    reference.zero_grad();
    worst = std::max(worst, std::abs(loss - losses[step - 1]));
  }
  std::printf("\nfinal loss %.6f; the same training unsharded on one process (%s): largest |difference| over the "
              "%" PRId64 " steps' losses %.2e: %s\n",
              losses.back(), what, steps, worst, worst < 1e-3 ? "match" : "MISMATCH");
  return worst < 1e-3 ? 0 : 1;
}

}  // namespace fsdp::examples
