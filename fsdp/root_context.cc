#include "fsdp/root_context.h"

namespace fsdp {

int RootContext::forward_index(const FSDPState* state) const {
  for (size_t i = 0; i < forward_order.size(); ++i) {
    if (forward_order[i] == state) return static_cast<int>(i);
  }
  return -1;
}

}  // namespace fsdp
