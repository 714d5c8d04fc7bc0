#include "checkpoint/local_shard.h"

namespace fsdp {

int64_t LocalShard::global_numel() const {
  int64_t numel = 1;  // a 0-d value (an optimizer step, a hyperparameter) has one element
  for (const int64_t size : global_shape) numel *= size;
  return numel;
}

}  // namespace fsdp
