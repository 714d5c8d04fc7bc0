#pragma once
// Modules and hook helpers that several tests of contract/ use.

#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include "fsdp_cpp/contract/forward_values.h"

namespace fsdp::contract::fixtures {

/// What hooks append to, in call order.
using Log = std::vector<std::string>;

/// One Linear(2, 2) registered as "fc"; forward is fc's.
struct BlockImpl : torch::nn::Module {
  BlockImpl() { fc = register_module("fc", torch::nn::Linear(2, 2)); }
  torch::Tensor forward(torch::Tensor x) { return fc(x); }
  torch::nn::Linear fc = nullptr;
};
TORCH_MODULE(Block);

/// Two Blocks registered as "block0" and "block1" (no forward: the tests call the blocks).
struct TwoBlocksImpl : torch::nn::Module {
  TwoBlocksImpl() {
    block0 = register_module("block0", Block());
    block1 = register_module("block1", Block());
  }
  Block block0 = nullptr;
  Block block1 = nullptr;
};
TORCH_MODULE(TwoBlocks);

/// A forward pre-hook that appends `name` to `log`.
inline auto log_pre(Log& log, std::string name) {
  return [&log, name](torch::nn::Module&, ForwardArgs&) { log.push_back(name); };
}

/// A forward hook that appends `name` to `log`.
inline auto log_post(Log& log, std::string name) {
  return [&log, name](torch::nn::Module&, const ForwardArgs&, c10::IValue&) {
    log.push_back(name);
  };
}

}  // namespace fsdp::contract::fixtures
