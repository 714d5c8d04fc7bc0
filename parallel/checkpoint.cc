#include "fsdp_cpp/parallel/checkpoint.h"

#include <cstdint>
#include <cstring>
#include <set>
#include <vector>

#include <c10/util/Exception.h>

#include "fsdp_cpp/checkpoint/distributed_checkpoint.h"
#include "fsdp_cpp/checkpoint/optimizer_state_dict.h"
#include "fsdp_cpp/checkpoint/state_dict.h"

namespace fsdp::parallel {
namespace {

constexpr const char* kStepsKey = "fsdp.parallel.steps";
constexpr const char* kValuePrefix = "fsdp.parallel.value.";

// Each name and value, each preceded by its length (8 bytes, this machine's order: only ranks of
// one job read it).
std::vector<uint8_t> encode_values(const CheckpointValues& values) {
  std::vector<uint8_t> bytes;
  auto put = [&](const std::string& s) {
    const uint64_t n = s.size();
    const size_t at = bytes.size();
    bytes.resize(at + sizeof(n) + s.size());
    std::memcpy(bytes.data() + at, &n, sizeof(n));
    if (n) std::memcpy(bytes.data() + at + sizeof(n), s.data(), s.size());
  };
  for (const auto& [name, value] : values) {
    put(name);
    put(value);
  }
  return bytes;
}

CheckpointValues decode_values(const std::vector<uint8_t>& bytes) {
  CheckpointValues values;
  size_t at = 0;
  auto get = [&]() {
    uint64_t n = 0;
    TORCH_CHECK(at + sizeof(n) <= bytes.size(), "fsdp::parallel::save_checkpoint: malformed values from a rank");
    std::memcpy(&n, bytes.data() + at, sizeof(n));
    at += sizeof(n);
    TORCH_CHECK(n <= bytes.size() - at, "fsdp::parallel::save_checkpoint: malformed values from a rank");
    std::string s(reinterpret_cast<const char*>(bytes.data() + at), n);
    at += n;
    return s;
  };
  while (at < bytes.size()) {
    std::string name = get();
    values[name] = get();
  }
  return values;
}

std::string shown(const CheckpointValues& values, const std::string& name) {
  const auto it = values.find(name);
  if (it == values.end()) return "absent";
  constexpr size_t kMax = 200;
  return "'" + (it->second.size() > kMax ? it->second.substr(0, kMax) + "...' (" + std::to_string(it->second.size()) + " bytes)"
                                          : it->second + "'");
}

// The same error on every rank when the ranks' values differ (each rank decides from every rank's
// values), or when a name is empty.
void check_values_agree(const ParallelModel& model, const CheckpointValues& values) {
  // model.world() is a comm::Communicator (parallel_model.h).
  const auto gathered = model.world()->all_gather_bytes(encode_values(values), "save_checkpoint values");
  const CheckpointValues first = decode_values(gathered[0]);
  for (size_t r = 1; r < gathered.size(); ++r) {
    if (gathered[r] == gathered[0]) continue;
    const CheckpointValues other = decode_values(gathered[r]);
    std::set<std::string> names;
    for (const auto& item : first) names.insert(item.first);
    for (const auto& item : other) names.insert(item.first);
    for (const auto& name : names) {
      const auto a = first.find(name), b = other.find(name);
      if (a != first.end() && b != other.end() && a->second == b->second) continue;
      TORCH_CHECK(false, "fsdp::parallel::save_checkpoint: the values to save differ between ranks: '", name, "' is ",
                  shown(first, name), " on rank 0 and ", shown(other, name), " on rank ", r,
                  "; every rank passes the same CheckpointValues (nothing was written)");
    }
  }
  TORCH_CHECK(!first.count(""), "fsdp::parallel::save_checkpoint: a value with an empty name (nothing was written)");
}

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

void save_checkpoint(const std::string& dir, const ParallelModel& model, torch::optim::Optimizer& optimizer,
                     const CheckpointValues& values) {
  check_values_agree(model, values);
  dcp::Extra extra;
  extra.values[kStepsKey] = std::to_string(model.steps());
  for (const auto& [name, value] : values) extra.values[kValuePrefix + name] = value;
  dcp::save_state(dir, merged_state(model, optimizer), extra, dcp::SaveOptions().communicator(model.world()));
}

void load_checkpoint(const std::string& dir, ParallelModel& model, torch::optim::Optimizer& optimizer,
                     CheckpointValues* values) {
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
  if (values != nullptr) {
    values->clear();
    const std::string prefix = kValuePrefix;
    for (const auto& [key, value] : extra.values) {
      if (key.compare(0, prefix.size(), prefix) == 0) (*values)[key.substr(prefix.size())] = value;
    }
  }
}

}  // namespace fsdp::parallel
