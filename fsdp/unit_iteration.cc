#include "fsdp/unit_iteration.h"

#include <algorithm>


namespace fsdp {

void UnitIteration::reset() {
  calls_.clear();
  post_forwards_ = 0;
  reduced_ = false;
}

size_t UnitIteration::begin_call(bool grad_enabled, bool* first) {
  *first = calls_.empty();
  calls_.push_back({});
  calls_.back().grad_enabled = grad_enabled;
  return calls_.size() - 1;
}

void UnitIteration::set_post_backward_visible(size_t call) { calls_.at(call).post_backward_visible = true; }

void UnitIteration::end_call(bool outputs_need_grad, const c10::intrusive_ptr<torch::autograd::Node>& output_node) {
  if (calls_.empty()) return;
  Call& call = calls_.back();
  call.outputs_need_grad = outputs_need_grad && call.grad_enabled;
  call.output_node = output_node;
  call.has_output_node = output_node.defined();
}

bool UnitIteration::last_module_ran(size_t modules) { return ++post_forwards_ % modules == 0; }

bool UnitIteration::live(const Call& call) const {
  return call.outputs_need_grad && (!call.has_output_node || !call.output_node.expired());
}

bool UnitIteration::may_get_gradients() const {
  return std::any_of(calls_.begin(), calls_.end(), [&](const Call& c) { return live(c); });
}

void UnitIteration::begin_backward_pass() {
  for (auto& c : calls_) c.running = c.done = false;
  reduced_ = false;
}

void UnitIteration::call_pre_backward(size_t call) {
  if (call < calls_.size() && !calls_[call].done) calls_[call].running = true;
}

void UnitIteration::call_post_backward(size_t call) {
  if (call >= calls_.size()) return;
  calls_[call].running = false;
  calls_[call].done = true;
}

bool UnitIteration::backward_running() const {
  return std::any_of(calls_.begin(), calls_.end(), [](const Call& c) { return c.running; });
}

bool UnitIteration::backward_complete() const {
  return std::all_of(calls_.begin(), calls_.end(), [&](const Call& c) {
    return !live(c) || (c.post_backward_visible && c.done);
  });
}

}  // namespace fsdp
