#pragma once
// The optimizer state of a run ([Note: flat runs]) as one flat tensor per state name.
//
// [Note: flat state] torch::optim keeps per-parameter state (AdamWParamState::exp_avg, ...,
// SGDParamState::momentum_buffer) in Optimizer::state(), keyed by the parameter's TensorImpl; the
// state dicts (checkpoint/optimizer_state_dict.h), fsdp::dcp and save/load read and replace those
// tensors. The flat optimizers keep them, as they are, but make each member's tensor a view (the
// parameter's shape, contiguous) of one buffer per state name that spans the run exactly as the
// run's data do (same offsets, zeros in the padding), and step the buffer. A buffer is reused as
// long as every member's tensor is still its view at the member's offset and the buffer spans
// exactly the run; otherwise (the first step, a state tensor that a load or the user replaced, a
// run whose members changed) a new buffer is allocated and each member's current values are
// copied into it (adopted), after which the members' tensors are views of it again. So state
// dicts see per-parameter tensors with PyTorch's keys, writes into them (a sharded load copies
// into the live views) reach the buffer, and replacements are taken over at the next step.
// The buffer has the parameters' dtype, or the one the optimizer asks for (bfloat16 moments:
// [Note: bfloat16 moments] in optim/adam_family_step.h); a member's tensor of another dtype (a
// float32 state loaded into a bfloat16-state optimizer, or the reverse) is not a view of it, so it
// is adopted, converted by copy_ (float32 -> bfloat16 rounds to nearest, ties to even;
// bfloat16 -> float32 is exact).

#include <cstdint>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>

#include "fsdp_cpp/optim/flat_runs.h"

namespace fsdp::optim {

/// The flat buffer of one state name of `run` (a run of several members; `params` the group's
/// parameters): reused when every `slots[i]` (member i's state tensor) is its view, else newly
/// allocated with zeros, each defined slot's values copied to its member's place (a slot must
/// have its parameter's numel) and every slot re-pointed at its view. `adopted` counts the new
/// buffers. The buffer's dtype: `dtype`, else the parameters'.
at::Tensor flat_state(const ParamRun& run, const std::vector<at::Tensor>& params,
                      const std::vector<at::Tensor*>& slots, int64_t& adopted,
                      std::optional<c10::ScalarType> dtype = std::nullopt);

}  // namespace fsdp::optim
