#include "fsdp_cpp/composable/tp_random.h"

#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace fsdp::tp {

at::Tensor dropout(const at::Tensor& x, double p, bool training, std::optional<int64_t> sharded_dim,
                   const Group& group) {
  TORCH_CHECK(p >= 0.0 && p < 1.0, "fsdp::tp::dropout: expected a probability in [0, 1), found ", p);
  if (!training || p == 0.0) return x;
  TORCH_CHECK(!sharded_dim || (*sharded_dim >= -x.dim() && *sharded_dim < x.dim()),
              "fsdp::tp::dropout: sharded dimension ", *sharded_dim, " is out of range for a tensor of shape ",
              x.sizes());
  const int64_t n = group ? group->size() : 1;
  if (!sharded_dim || n == 1) return at::dropout(x, p, /*train=*/true);
  const int64_t d = *sharded_dim < 0 ? *sharded_dim + x.dim() : *sharded_dim;
  std::vector<int64_t> whole(x.sizes().begin(), x.sizes().end());
  const int64_t local = whole[d];
  whole[d] = local * n;
  // As at::dropout draws (an empty tensor of the input's options, bernoulli_(1 - p), divided by
  // 1 - p), over the whole shape.
  at::Tensor mask = at::empty(whole, x.options()).bernoulli_(1.0 - p);
  mask = mask.narrow(d, group->rank() * local, local);
  return x * mask.div_(1.0 - p);
}

}  // namespace fsdp::tp
