#pragma once
// What the root unit shares with every unit of its tree once lazily initialised: the list of units,
// this iteration's forward order (which orders backward prefetch and gradient reduction), and the
// per-iteration flags of the runtime.

#include <memory>
#include <vector>

#include "comm/communicator.h"

namespace fsdp {

class FSDPState;

class RootContext {
 public:
  FSDPState* root = nullptr;
  /// Every unit in the root's tree (the root first), in module order.
  std::vector<FSDPState*> states;
  std::shared_ptr<comm::Communicator> comm;

  /// Units in the order their pre-forward first ran this iteration, and in the last one.
  std::vector<FSDPState*> forward_order;
  std::vector<FSDPState*> previous_forward_order;
  /// Units whose all-gathers are in flight, oldest first; never more than max_in_flight.
  std::vector<FSDPState*> unshards_in_flight;
  int max_in_flight = 2;
  /// Gradients are reduce-scattered in reverse forward order on every rank (the collectives then
  /// match across ranks); units before this index (from the back) are done.
  size_t reduced_from_back = 0;

  bool iteration_active = false;   // a forward ran and its backward (if any) has not finished
  bool backward_started = false;   // the first pre-backward of this iteration ran
  bool checked_sharded_use = false;  // the first iteration's autograd graph check ran
  int64_t iterations = 0;
};

}  // namespace fsdp
