#include "fsdp_cpp/fsdp/backward_reduction_queue.h"

namespace fsdp {

void BackwardReductionQueue::begin_iteration() {
  reduced_from_back_ = 0;
  deferred_.clear();
  awaiting_finalize_ = nullptr;
}

void BackwardReductionQueue::begin_pass(int graph_task) {
  begin_iteration();
  graph_task_ = graph_task;
}

void BackwardReductionQueue::end_pass() {
  awaiting_finalize_ = nullptr;
  graph_task_ = -1;
}

void BackwardReductionQueue::discard() {
  begin_iteration();
  graph_task_ = -1;
}

}  // namespace fsdp
