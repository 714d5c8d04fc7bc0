#include "fsdp_cpp/fsdp/unit_iteration.h"

#include <algorithm>

#include <ATen/SequenceNumber.h>


namespace fsdp {

void UnitIteration::reset() {
  calls_.clear();
  post_forwards_ = 0;
  reduced_ = false;
  pass_reach_ = PassReach::kEveryRank;
}

size_t UnitIteration::begin_call(bool grad_enabled, bool* first) {
  *first = calls_.empty();
  calls_.push_back({});
  calls_.back().grad_enabled = grad_enabled;
  calls_.back().first_node = at::sequence_number::peek();
  return calls_.size() - 1;
}

void UnitIteration::set_post_backward_visible(size_t call) { calls_.at(call).post_backward_visible = true; }

void UnitIteration::end_call(bool outputs_need_grad,
                             const std::vector<c10::intrusive_ptr<torch::autograd::Node>>& nodes) {
  if (calls_.empty()) return;
  Call& call = calls_.back();
  call.outputs_need_grad = outputs_need_grad && call.grad_enabled;
  call.nodes.clear();
  for (const auto& node : nodes) call.nodes.emplace_back(node);
}

bool UnitIteration::last_module_ran(size_t modules) { return ++post_forwards_ % modules == 0; }

bool UnitIteration::live(const Call& call) const {
  if (!call.outputs_need_grad) return false;
  if (call.reached || call.nodes.empty()) return true;
  return std::any_of(call.nodes.begin(), call.nodes.end(), [](const auto& n) { return !n.expired(); });
}

bool UnitIteration::may_get_gradients() const {
  return std::any_of(calls_.begin(), calls_.end(), [&](const Call& c) { return live(c); });
}

void UnitIteration::begin_backward_pass() {
  for (auto& c : calls_) c.running = c.done = c.reached = false;
  reduced_ = false;
  pass_reach_ = PassReach::kEveryRank;
}

bool UnitIteration::reached_in_pass(const std::function<bool(torch::autograd::Node*)>& runs_in_pass) const {
  return std::any_of(calls_.begin(), calls_.end(), [&](const Call& c) {
    if (!live(c)) return false;
    if (c.reached || c.nodes.empty()) return true;
    return std::any_of(c.nodes.begin(), c.nodes.end(), [&](const auto& weak) {
      const auto node = weak.lock();
      return node && runs_in_pass(node.get());
    });
  });
}

void UnitIteration::call_pre_backward(size_t call) {
  if (call >= calls_.size()) return;
  calls_[call].reached = true;
  if (!calls_[call].done) calls_[call].running = true;
}

void UnitIteration::call_post_backward(size_t call) {
  if (call >= calls_.size()) return;
  calls_[call].running = false;
  calls_[call].done = true;
}

bool UnitIteration::backward_running() const {
  return std::any_of(calls_.begin(), calls_.end(), [](const Call& c) { return c.running; });
}

bool UnitIteration::completes_at_end_of_backward() const {
  return std::any_of(calls_.begin(), calls_.end(),
                     [&](const Call& c) { return live(c) && !c.post_backward_visible; });
}

bool UnitIteration::backward_complete() const {
  return std::all_of(calls_.begin(), calls_.end(), [&](const Call& c) {
    return !live(c) || (c.post_backward_visible && c.done);
  });
}

bool UnitIteration::backward_complete(const std::function<bool(torch::autograd::Node*)>& runs_in_pass) const {
  return std::all_of(calls_.begin(), calls_.end(), [&](const Call& c) {
    if (!live(c) || (c.post_backward_visible && c.done)) return true;
    if (c.reached || c.nodes.empty()) return false;
    return std::none_of(c.nodes.begin(), c.nodes.end(), [&](const auto& weak) {
      const auto node = weak.lock();
      return node && runs_in_pass(node.get());
    });
  });
}

}  // namespace fsdp
