#pragma once
// Engine units built by hand for the engine's unit tests (no fully_shard): an FSDPState over a
// module's parameters with the options a test varies, and a collector of failures seen on rank
// threads (Catch2 assertions are not thread-safe: assert on the main thread).

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/fsdp/fsdp_state.h"

namespace fsdp::testing {

/// A module with one parameter "weight" holding 0, 1, ..., numel - 1 (the same on every rank).
struct Leaf : torch::nn::Module {
  explicit Leaf(int64_t numel) : weight(register_parameter("weight", at::arange(numel, at::kFloat))) {}
  at::Tensor weight;
};

/// `comm` without ownership (run_ranks_as_threads owns it).
inline std::shared_ptr<comm::Communicator> borrow(comm::Communicator& comm) {
  return std::shared_ptr<comm::Communicator>(&comm, [](comm::Communicator*) {});
}

struct UnitOptions {
  bool reshard_after_forward = true;  // false: SHARD_GRAD_OP
  bool shard = true;                  // false: NO_SHARD
  int max_unshards_in_flight = 2;
};

/// One unit over every parameter of `module`, not registered anywhere.
inline std::shared_ptr<FSDPState> make_unit(torch::nn::Module& module, const std::string& fqn,
                                            std::shared_ptr<comm::Communicator> comm,
                                            UnitOptions options = {}) {
  FSDPConfig config;
  config.comm = std::move(comm);
  config.options.strategy(!options.shard                 ? ShardingStrategy::kNoShard
                          : options.reshard_after_forward ? ShardingStrategy::kFullShard
                                                          : ShardingStrategy::kShardGradOp);
  config.options.max_unshards_in_flight(options.max_unshards_in_flight);
  std::vector<FlatParamHandle::OrigParam> params;
  for (const auto& item : module.named_parameters()) params.push_back({item.key(), item.value()});
  auto handles = FSDPState::make_handles(params, config, fqn);
  return std::make_shared<FSDPState>(std::vector<torch::nn::Module*>{&module}, fqn, std::move(config),
                                     std::move(handles));
}

/// Failures seen on rank threads, asserted on the main thread (see require_none in each test).
struct Failures {
  std::mutex m;
  std::vector<std::string> list;
  void check(bool ok, const std::string& what, int rank) {
    if (ok) return;
    std::lock_guard<std::mutex> g(m);
    list.push_back(what + " (rank " + std::to_string(rank) + ")");
  }
};

}  // namespace fsdp::testing
