#pragma once
// Building a model without memory: MetaInitGuard, and materializing what it recorded.
//
//   torch::manual_seed(0);
//   std::shared_ptr<GPT> model;
//   {
//     fsdp::MetaInitGuard meta;            // nothing below allocates parameter memory
//     model = std::make_shared<GPT>(config);  // unmodified constructors (torch::nn's and yours)
//   }
//   fsdp::fully_shard_tree(*model, policy);  // each rank allocates and initializes only its shards
//   // or, without sharding:  fsdp::materialize_module(*model, torch::kCPU);
//
// [Note: meta init] Inside the guard every factory function called without an explicit device
// (torch::empty, zeros, ones, randn, arange, ... as module constructors call them) creates a meta
// tensor: shape, strides and dtype, no storage. LibTorch's C++ API has no default-device context
// (Python's `with torch.device("meta")`), so the guard puts the dispatcher's DeferredInit key (the
// one PyTorch reserves for deferred module initialisation) into this thread's dispatch key set; a
// fallback kernel on that key sees every operator call, rewrites an unset `device` argument to
// meta, runs the call below the key, and records it:
//   - a call whose output is a meta tensor with new memory (a factory, or an out-of-place op such
//     as `randn(...) * 0.02` or `arange(n).exp()`) creates a record of that memory: the call, its
//     arguments (tensors among them by reference to their own records, at their current version),
//     and the output's geometry;
//   - a call that writes into recorded memory (in-place init such as `uniform_`, `normal_`,
//     `fill_`, `zero_`, `copy_`, also through views: `weight[padding_idx].fill_(0)`) appends a step
//     to that memory's record.
// Views share their base's memory, so a view needs no record: its geometry over the base is enough.
// Explicit devices are respected (`torch::tensor({...})` and `torch::ones(n, torch::kCUDA)` give
// real tensors), as in Python's device context.
//
// Materializing a meta tensor replays its memory's record on the CPU: the creating call with the
// device set to CPU, then every step in order, each argument that refers to other recorded memory
// replayed up to the version it had when the call was made. Only the tensor asked for (and what it
// was computed from) is ever allocated, so sharded materialization holds one parameter at a time.
//
// Random numbers: meta kernels do not draw from the generator, so the global CPU generator's stream
// cannot be reproduced tensor by tensor. Instead every recorded memory draws from its own CPU
// generator, seeded from (the session's seed, the memory's creation index in the session); a
// session is one outermost guard, and its seed is drawn from the default CPU generator when the
// guard is entered (so `torch::manual_seed(s)` before the guard fixes every value, and two
// models built one after the other differ, as without the guard). The guarantee: the same
// construction under the same seed materializes to bit-identical values however it is
// materialized (whole with materialize_module, or sharded by fully_shard on any number of ranks,
// one unit or one parameter at a time, in any order). The values follow the same distributions as
// without the guard but are not the same numbers as a model built without it; an explicit
// `generator` argument is replaced by the memory's own generator in the same way.
//
// A model built inside a guard must be materialized (fully_shard, materialize_module) before it
// runs: once a guard was used, a call through a hook-able holder (contract/forward_hooks.h) whose
// module tree still holds meta tensors is refused, naming them and the fix ([Note: meta forward
// check] in meta_init.cc; LibTorch's own holders call forward directly and are not checked).
//
// Limits: code that reads values during construction (`.item()`, `data_ptr()`, accessors, ops
// with no meta kernel) fails inside the guard with an error naming the operator. Operations on the
// meta tensors after the guard ends are not recorded: initialize inside the guard (a constructor,
// or a block of init calls under a second guard). The recording keeps a few hundred bytes per
// tensor until clear_meta_init_records().

#include <cstdint>
#include <functional>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

namespace torch::nn {
class Module;
}

namespace fsdp {

/// While alive, factory functions called on this thread without an explicit device create meta
/// tensors and every operation on them is recorded (see [Note: meta init]). Nests; not movable.
class MetaInitGuard {
 public:
  MetaInitGuard();
  ~MetaInitGuard();
  MetaInitGuard(const MetaInitGuard&) = delete;
  MetaInitGuard& operator=(const MetaInitGuard&) = delete;

 private:
  c10::impl::IncludeDispatchKeyGuard include_;
  bool outermost_ = false;
};

/// Whether `tensor` is a meta tensor whose values a MetaInitGuard recorded.
bool has_recorded_init(const at::Tensor& tensor);

/// The values `tensor` (a meta tensor built under a MetaInitGuard) would hold: a new CPU tensor of
/// its shape and dtype, replayed from the record. A c10::Error naming `name` (e.g. the parameter's
/// FQN) when the tensor has no record or a replayed operation fails.
at::Tensor materialize_values(const at::Tensor& tensor, const std::string& name = "tensor");

/// Records that the meta tensor `derived` (which has memory of its own, e.g. at::empty on meta)
/// holds `derive` applied to `source`'s values: materialize_values(derived) replays `source` and
/// returns `derive` of it (of `derived`'s shape and dtype). For APIs that replace a meta parameter
/// by a piece of it (tensor parallelism gives each rank its rows of a fused projection); `source`
/// must have a record (or be derived itself) and is kept alive by this one.
///
///   at::Tensor piece = at::empty({rows / 2, cols}, weight.options());
///   fsdp::record_derived_values(piece, weight, [](const at::Tensor& w) { return w.narrow(0, 0, w.size(0) / 2); });
void record_derived_values(const at::Tensor& derived, const at::Tensor& source,
                           std::function<at::Tensor(const at::Tensor&)> derive);

/// Makes the meta tensor `meta` hold `values` in place: the same tensor object (the module's member,
/// its parameter dict entry, the optimizer's reference all see it), now with `values`' memory,
/// device, shape and strides (as set_data does; fully_shard gives a parameter its 1-D shard view);
/// requires_grad is kept. `values` must be a real tensor of the same dtype.
void adopt_values(const at::Tensor& meta, const at::Tensor& values);

/// A user's initialization of one meta tensor (FSDP1's `param_init_fn`, per tensor): `values` is
/// an uninitialized tensor of the parameter's or buffer's shape and dtype, on the CPU, to fill in
/// place; `fqn` names the tensor (relative to the module given to the API that calls it).
using TensorInitFn = std::function<void(const std::string& fqn, at::Tensor& values)>;

/// Materializes every meta parameter and buffer of `module` (recursively) in full on `device`, in
/// place (see adopt_values): with `init` when given, else from the record. Tensors not on meta are
/// left alone. Errors name the tensor's FQN; tensors done before an error stay materialized.
void materialize_module(torch::nn::Module& module, at::Device device = at::kCPU,
                        const TensorInitFn& init = nullptr);

struct MetaInitStats {
  int64_t records = 0;  // recorded memories (one per tensor created inside a guard, views excluded)
  int64_t steps = 0;    // recorded calls, creating ones included
};
/// What the recording holds now (process-wide).
MetaInitStats meta_init_stats();
/// Forgets every record (process-wide). Meta tensors built before can no longer be materialized.
void clear_meta_init_records();

}  // namespace fsdp
