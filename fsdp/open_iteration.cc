#include "fsdp_cpp/fsdp/open_iteration.h"

#include <c10/util/Exception.h>

#include "fsdp_cpp/fsdp/backward.h"
#include "fsdp_cpp/fsdp/fsdp_state.h"
#include "fsdp_cpp/fsdp/root_context.h"

namespace fsdp::runtime {
namespace {

std::string root_name(const RootContext& context) {
  const std::string& fqn = context.root()->fqn();
  return fqn.empty() ? "<root>" : fqn;
}

}  // namespace

void check_no_step_in_open_iteration(RootContext& context, const std::string& event) {
  if (!context.shards_written_since_pass_within_iteration()) return;
  const int passes = context.iteration_state().passes_within_iteration();
  discard_iteration(context);  // local: nothing is in flight between passes
  TORCH_CHECK(false, "fully_shard: root '", root_name(context), "': ", event, " would continue an iteration "
              "left open by FSDPModule::set_is_last_backward(false) (", passes, passes == 1 ? " backward pass" :
              " backward passes", " ended without ending it, and a graph of its forwards is still live), but the "
              "parameters' shards were written since (an optimizer step?): the earlier forwards' graphs would be "
              "backpropagated through other parameters than they used. Expected the step's last backward to end "
              "the iteration: call root.set_is_last_backward(true) before it (pipeline schedules do), or abandon "
              "the step's remaining backward passes with root.zero_grad() before optimizer.step(). The iteration "
              "was discarded; the next forward begins a new one");
}

std::string open_iteration_error(const RootContext& context) {
  if (!context.iteration_left_open()) return "";
  return "root '" + root_name(context) + "' is in the middle of an iteration: " +
         std::to_string(context.iteration_state().passes_within_iteration()) +
         " backward pass(es) ended without ending it (FSDPModule::set_is_last_backward(false) on the root) "
         "and a graph of its forwards is still live, so more backward passes of this step are expected and the "
         "gradients are not the step's yet. Expected the step's last backward to end the iteration: call "
         "root.set_is_last_backward(true) before it (pipeline schedules do); to abandon the step instead, call "
         "root.zero_grad()";
}

}  // namespace fsdp::runtime
