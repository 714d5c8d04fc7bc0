#pragma once
// RegisterPostBackward: an identity autograd function applied to a unit's forward inputs that
// require grad. Its backward runs once the gradients with respect to those inputs are complete,
// which is after the unit's whole backward, including every gradient accumulation into its
// parameters (AccumulateGrad nodes run first among ready nodes). That is the unit's post-backward
// point. A unit whose inputs need no gradient (e.g. token ids) is finished by the end-of-backward
// callback instead.

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace fsdp {

using PostBackwardCallback = void (*)(void* arg, int64_t tag);

/// Returns `inputs` routed through the function; `callback(arg, tag)` runs in its backward. `arg`
/// must outlive the autograd graph (it is the unit's FSDPState, which lives as long as the module).
std::vector<at::Tensor> register_post_backward(std::vector<at::Tensor> inputs,
                                               PostBackwardCallback callback, void* arg, int64_t tag);

}  // namespace fsdp
