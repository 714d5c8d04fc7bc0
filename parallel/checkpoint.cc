#include "fsdp_cpp/parallel/checkpoint.h"

#include <vector>

#include <c10/util/Exception.h>

#include "fsdp_cpp/checkpoint/distributed_checkpoint.h"
#include "fsdp_cpp/checkpoint/optimizer_state_dict.h"
#include "fsdp_cpp/checkpoint/state_dict.h"

namespace fsdp::parallel {
namespace {

constexpr const char* kStepsKey = "fsdp.parallel.steps";

// Every chunk's model state, then its optimizer state: views of the live tensors.
ShardedStateDict merged_state(const ParallelModel& model, torch::optim::Optimizer& optimizer) {
  ShardedStateDict merged;
  for (const auto& root : model.roots()) {
    for (auto& entry : sharded_state_dict(root)) merged.push_back(std::move(entry));
    for (auto& entry : sharded_optimizer_state_dict(root, optimizer)) merged.push_back(std::move(entry));
  }
  return merged;
}

}  // namespace

void save_checkpoint(const std::string& dir, const ParallelModel& model, torch::optim::Optimizer& optimizer) {
  dcp::Extra extra;
  extra.values[kStepsKey] = std::to_string(model.steps());
  dcp::save_state(dir, merged_state(model, optimizer), extra, dcp::SaveOptions().communicator(model.world()));
}

void load_checkpoint(const std::string& dir, ParallelModel& model, torch::optim::Optimizer& optimizer) {
  // The optimizer's dicts are kept per chunk: where it has no state yet their tensors are fresh,
  // and load_sharded_optimizer_state_dict installs them once filled.
  ShardedStateDict merged;
  std::vector<ShardedStateDict> optimizer_states;
  for (const auto& root : model.roots()) {
    for (auto& entry : sharded_state_dict(root)) merged.push_back(std::move(entry));
    optimizer_states.push_back(sharded_optimizer_state_dict(root, optimizer));
    for (const auto& entry : optimizer_states.back()) merged.push_back(entry);
  }
  dcp::Extra extra;
  dcp::load_state(dir, merged, &extra, dcp::LoadOptions().communicator(model.world()));
  for (size_t c = 0; c < model.roots().size(); ++c) {
    load_sharded_optimizer_state_dict(model.roots()[c], optimizer, optimizer_states[c]);
  }
  const auto it = extra.values.find(kStepsKey);
  TORCH_CHECK(it != extra.values.end(), "fsdp::parallel::load_checkpoint: ", dir, " has no '", kStepsKey,
              "' value; expected a checkpoint written by fsdp::parallel::save_checkpoint");
  model.set_steps(std::stoll(it->second));
}

}  // namespace fsdp::parallel
