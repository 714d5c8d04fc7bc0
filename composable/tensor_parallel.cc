#include "fsdp_cpp/composable/tensor_parallel.h"

#include <cstdlib>
#include <cstring>

#include <algorithm>
#include <atomic>
#include <map>
#include <optional>
#include <sstream>
#include <unordered_set>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "fsdp_cpp/comm/agreement.h"
#include "fsdp_cpp/composable/tensor_placement.h"
#include "fsdp_cpp/composable/tp_collectives.h"
#include "fsdp_cpp/contract/contract.h"
#include "fsdp_cpp/contract/forward_hooks.h"
#include "fsdp_cpp/contract/module_state.h"
#include "fsdp_cpp/contract/shape_text.h"
#include "fsdp_cpp/init/meta_init.h"
#include "fsdp_cpp/storage/crc32c.h"

namespace fsdp {
namespace {

constexpr const char* kApi = "parallelize_module";

std::string style_name(const ParallelStyle& style) {
  switch (style.index()) {
    case 0: return "ColwiseParallel";
    case 1: return "RowwiseParallel";
    case 2: return "SequenceParallel";
    case 3: return "PrepareModuleInput";
    default: return "PrepareModuleOutput";
  }
}

bool places_parameters(const ParallelStyle& style) { return style.index() <= 2; }

std::vector<std::string> split_fqn(const std::string& fqn) {
  std::vector<std::string> parts;
  if (fqn.empty()) return parts;
  std::string part;
  std::istringstream in(fqn);
  while (std::getline(in, part, '.')) parts.push_back(part);
  return parts;
}

bool matches(const std::string& pattern, const std::string& fqn) {
  const auto p = split_fqn(pattern), f = split_fqn(fqn);
  if (p.size() != f.size()) return false;
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] != "*" && p[i] != f[i]) return false;
  }
  return true;
}

// What one module gets: its styles in plan order.
struct Target {
  std::string fqn;
  std::shared_ptr<torch::nn::Module> module;
  std::vector<ParallelStyle> styles;
};

// How a parameter is placed.
struct PlannedParam {
  at::Tensor param;
  TensorPlacement placement;
};

// [Note: bypassed tensor-parallel modules] A tensor-parallel module called as
// `module->forward(x)` (its holder bypassed) runs LibTorch's forward on this rank's piece without
// the style's collectives: a wrong output and wrong gradients, silently. LibTorch gives no way to
// refuse the call itself: `forward` is not virtual and the module reads its parameters as plain
// tensors (no hook runs when an op reads a tensor; the dispatcher's only per-tensor interception,
// a dispatch key on the parameter, would tax every operation on it, the optimizer's included). So
// the refusal comes at the first backward pass: each style's wrapper counts the calls that build a
// graph (gradients enabled: an ordinary training forward, or activation checkpointing's recompute,
// not its discarding first pass), and a post-accumulate-grad hook on each parameter the module placed (kept by
// fully_shard's set_data) throws a c10::Error naming
// parallelize_module, the FQN and the holder when a gradient reaches the parameter while the
// module has never been called through its holder with gradients on. Exactly what is detected:
// every module whose parameters receive a gradient before any call through the holder, in the
// backward pass of that graph (on every rank that bypassed it). Not detected: a bypassed call
// under no-grad (evaluation: nothing reaches a hook), and a bypassed call after the module was
// called through its holder at least once (the count is then positive). Cost: one relaxed atomic
// increment per graph-building call, one atomic load per parameter per backward pass.
struct StyledCalls {
  std::atomic<int64_t> graph_calls{0};
};

struct TensorParallelState final : contract::ApiState {
  std::vector<std::string> styles;
  std::shared_ptr<StyledCalls> calls;
  std::unordered_set<const void*> placed;  // the parameters placed (by TensorImpl)
  // [Note: managed parameters]: the parameters this module's styles placed (tensor_placement).
  bool manages(const at::Tensor& param) const override { return placed.count(param.unsafeGetTensorImpl()) > 0; }
};

std::string where(const Target& t) { return "parallelize_module: module '" + t.fqn + "'"; }

const char* type_name(const torch::nn::Module& m) {
  if (dynamic_cast<const torch::nn::LinearImpl*>(&m)) return "Linear";
  if (dynamic_cast<const torch::nn::EmbeddingImpl*>(&m)) return "Embedding";
  return nullptr;
}

int64_t normalize(int64_t dim, int64_t ndim) { return dim < 0 ? dim + ndim : dim; }

// Parameters to place for one module's parameter-placing style; throws on what does not fit.
std::vector<PlannedParam> plan_parameters(const Target& t, const ParallelStyle& style,
                                          const std::shared_ptr<comm::Communicator>& group,
                                          const std::string& mesh_dim) {
  const int n = group->size();
  auto* linear = dynamic_cast<torch::nn::LinearImpl*>(t.module.get());
  auto* embedding = dynamic_cast<torch::nn::EmbeddingImpl*>(t.module.get());
  std::vector<PlannedParam> out;
  auto place = [&](const at::Tensor& p, int64_t dim, int64_t chunks, const char* what) {
    TensorPlacement placement;
    placement.group = group;
    placement.mesh_dim = mesh_dim;
    placement.dim = dim;
    placement.chunks = chunks;
    placement.global_shape = p.sizes().vec();
    if (dim >= 0) {
      const int64_t size = p.size(dim);
      TORCH_CHECK(size % (chunks * n) == 0, where(t), " (", type_name(*t.module), " ", contract::shape_string(p.sizes()),
                  "): ", style_name(style), " splits ", what, " (dimension ", dim, " of size ", size,
                  chunks > 1 ? ", " + std::to_string(chunks) + " blocks of " + std::to_string(size / chunks) : std::string(),
                  ") over ", mesh_dim, "=", n, "; expected a multiple of ", chunks * n, ", found ", size);
    }
    out.push_back({p, placement});
  };
  if (std::holds_alternative<ColwiseParallel>(style)) {
    const auto& s = std::get<ColwiseParallel>(style);
    TORCH_CHECK(linear || embedding, where(t), ": ColwiseParallel supports Linear and Embedding modules; found ",
                t.module->name());
    TORCH_CHECK(s.chunks() >= 1, where(t), ": ColwiseParallel chunks must be at least 1, found ", s.chunks());
    TORCH_CHECK(s.output_layout() == Layout::replicate() || (s.output_layout().is_shard && s.output_layout().dim == -1),
                where(t), ": ColwiseParallel output layout must be Shard(-1) or Replicate; found ",
                s.output_layout().describe());
    TORCH_CHECK(s.chunks() == 1 || s.output_layout().is_shard, where(t), ": ColwiseParallel with ", s.chunks(),
                " blocks keeps its output local (Shard(-1)); a Replicate output would interleave the blocks");
    if (linear) {
      place(linear->weight, 0, s.chunks(), "the output features");
      if (linear->bias.defined()) place(linear->bias, 0, s.chunks(), "the output features");
    } else {
      TORCH_CHECK(s.chunks() == 1, where(t), ": an Embedding has no fused blocks; chunks must be 1, found ", s.chunks());
      TORCH_CHECK(s.input_layout() == Layout::replicate(), where(t), ": an Embedding's input (token ids) must be "
                  "Replicate; found ", s.input_layout().describe());
      place(embedding->weight, 1, 1, "the embedding dimension");
    }
  } else if (std::holds_alternative<RowwiseParallel>(style)) {
    const auto& s = std::get<RowwiseParallel>(style);
    TORCH_CHECK(linear || embedding, where(t), ": RowwiseParallel supports Linear and Embedding modules; found ",
                t.module->name());
    if (linear) {
      TORCH_CHECK(s.input_layout() == Layout::replicate() || (s.input_layout().is_shard && s.input_layout().dim == -1),
                  where(t), ": RowwiseParallel input layout of a Linear must be Shard(-1) or Replicate; found ",
                  s.input_layout().describe());
      place(linear->weight, 1, 1, "the input features");
      if (linear->bias.defined()) place(linear->bias, -1, 1, "");
    } else {
      TORCH_CHECK(s.input_layout() == Layout::replicate(), where(t), ": an Embedding's input (token ids) must be "
                  "Replicate; found ", s.input_layout().describe());
      TORCH_CHECK(!embedding->options.padding_idx().has_value() && !embedding->options.max_norm().has_value(),
                  where(t), ": RowwiseParallel on an Embedding with padding_idx or max_norm is not supported");
      place(embedding->weight, 0, 1, "the vocabulary");
    }
  } else {
    const auto own = t.module->parameters(/*recurse=*/false);
    TORCH_CHECK(own.empty() || dynamic_cast<torch::nn::LayerNormImpl*>(t.module.get()) ||
                    dynamic_cast<PerPositionModule*>(t.module.get()),
                where(t), ": SequenceParallel supports LayerNorm, modules implementing fsdp::PerPositionModule and "
                "modules without parameters of their own (Dropout, activations); found ", t.module->name(), " with ",
                own.size(), " parameters");
    for (auto& p : own) place(p, -1, 1, "");
  }
  return out;
}

// Converts a tensor between layouts where a module boundary is crossed ([Note: tensor-parallel
// gradients]: replicated activations carry whole gradients).
at::Tensor redistribute(const at::Tensor& x, const Layout& from, const Layout& to, const tp::Group& group) {
  if (from.is_shard == to.is_shard && (!from.is_shard || normalize(from.dim, x.dim()) == normalize(to.dim, x.dim()))) {
    return x;
  }
  if (from.is_shard && !to.is_shard) return tp::gather_from_tp(x, from.dim, group);
  if (!from.is_shard && to.is_shard) return tp::split_to_tp(x, to.dim, group);
  TORCH_CHECK(false, "parallelize_module: redistributing from ", from.describe(), " to ", to.describe(),
              " is not supported");
}

at::Tensor first_tensor(const contract::ForwardArgs& args, const std::string& fqn, const char* style) {
  TORCH_CHECK(!args.empty() && args[0].isTensor(), "parallelize_module: module '", fqn, "' (", style,
              ") expected a tensor as its first forward argument");
  return args[0].toTensor();
}

// Replaces a module member tensor by a function of it for the duration of a call.
class SwappedMember {
 public:
  template <typename Fn>
  SwappedMember(at::Tensor& member, Fn&& fn) : member_(member), saved_(member) {
    if (saved_.defined()) member_ = fn(saved_);
  }
  ~SwappedMember() { member_ = saved_; }
  SwappedMember(const SwappedMember&) = delete;
  SwappedMember& operator=(const SwappedMember&) = delete;
  /// The member's own value (what the call does not see).
  const at::Tensor& value() const { return saved_; }

 private:
  at::Tensor& member_;
  at::Tensor saved_;
};

contract::ForwardWrapper make_wrapper(const Target& t, const ParallelStyle& style, const tp::Group& group) {
  const std::string fqn = t.fqn;
  if (std::holds_alternative<ColwiseParallel>(style)) {
    const auto s = std::get<ColwiseParallel>(style);
    return [s, group, fqn](torch::nn::Module&, const contract::ForwardArgs& args, const contract::ForwardFunction& forward) {
      contract::ForwardArgs local = args;
      at::Tensor x = first_tensor(args, fqn, "ColwiseParallel");
      if (at::isFloatingType(x.scalar_type())) {
        x = s.input_layout().is_shard ? tp::all_gather_tp(x, s.input_layout().dim, group) : tp::copy_to_tp(x, group);
      }
      local[0] = x;
      at::Tensor out = forward(local).toTensor();
      if (!s.output_layout().is_shard) out = tp::gather_from_tp(out, -1, group);
      return c10::IValue(out);
    };
  }
  if (std::holds_alternative<RowwiseParallel>(style)) {
    const auto s = std::get<RowwiseParallel>(style);
    return [s, group, fqn](torch::nn::Module& m, const contract::ForwardArgs& args, const contract::ForwardFunction& forward) {
      contract::ForwardArgs local = args;
      at::Tensor x = first_tensor(args, fqn, "RowwiseParallel");
      at::Tensor out;
      if (auto* embedding = dynamic_cast<torch::nn::EmbeddingImpl*>(&m)) {
        const int64_t rows = embedding->weight.size(0);
        const int64_t start = group->rank() * rows;
        at::Tensor outside = (x < start) | (x >= start + rows);
        local[0] = (x - start).masked_fill(outside, 0);
        out = forward(local).toTensor().masked_fill(outside.unsqueeze(-1), 0);
      } else {
        auto& linear = dynamic_cast<torch::nn::LinearImpl&>(m);
        if (!s.input_layout().is_shard) local[0] = tp::split_to_tp(x, -1, group);
        SwappedMember bias(linear.bias, [](const at::Tensor&) { return at::Tensor(); });  // added after the reduction
        out = forward(local).toTensor();
        out = s.output_layout().is_shard ? tp::reduce_scatter_tp(out, s.output_layout().dim, group)
                                         : tp::reduce_from_tp(out, group);
        if (bias.value().defined()) {
          // Sequence-sharded output: each rank's bias gradient covers only its positions, so the
          // whole gradient is the sum over the group.
          out = out + (s.output_layout().is_shard ? tp::copy_to_tp(bias.value(), group) : bias.value());
        }
        return c10::IValue(out);
      }
      out = s.output_layout().is_shard ? tp::reduce_scatter_tp(out, s.output_layout().dim, group)
                                       : tp::reduce_from_tp(out, group);
      return c10::IValue(out);
    };
  }
  if (std::holds_alternative<SequenceParallel>(style)) {
    const auto s = std::get<SequenceParallel>(style);
    return [s, group, fqn](torch::nn::Module& m, const contract::ForwardArgs& args, const contract::ForwardFunction& forward) {
      contract::ForwardArgs local = args;
      if (!s.input_layout().is_shard) {
        local[0] = tp::split_to_tp(first_tensor(args, fqn, "SequenceParallel"), s.sequence_dim(), group);
      }
      if (auto* per_position = dynamic_cast<PerPositionModule*>(&m)) {
        std::vector<std::unique_ptr<SwappedMember>> swapped;
        for (at::Tensor* member : per_position->per_position_parameters()) {
          swapped.push_back(std::make_unique<SwappedMember>(*member, [&](const at::Tensor& p) { return tp::copy_to_tp(p, group); }));
        }
        return forward(local);
      }
      auto* norm = dynamic_cast<torch::nn::LayerNormImpl*>(&m);
      if (norm == nullptr) return forward(local);
      // Each rank normalizes only its positions: the parameters' whole gradient is the sum over
      // the group (copy_to_tp: identity forward, all-reduce backward).
      SwappedMember weight(norm->weight, [&](const at::Tensor& w) { return tp::copy_to_tp(w, group); });
      SwappedMember bias(norm->bias, [&](const at::Tensor& b) { return tp::copy_to_tp(b, group); });
      return forward(local);
    };
  }
  if (std::holds_alternative<PrepareModuleInput>(style)) {
    const auto s = std::get<PrepareModuleInput>(style);
    return [s, group, fqn](torch::nn::Module&, const contract::ForwardArgs& args, const contract::ForwardFunction& forward) {
      contract::ForwardArgs local = args;
      local[0] = redistribute(first_tensor(args, fqn, "PrepareModuleInput"), s.input_layout(),
                              s.desired_input_layout(), group);
      return forward(local);
    };
  }
  const auto s = std::get<PrepareModuleOutput>(style);
  return [s, group, fqn](torch::nn::Module&, const contract::ForwardArgs& args, const contract::ForwardFunction& forward) {
    c10::IValue out = forward(args);
    TORCH_CHECK(out.isTensor(), "parallelize_module: module '", fqn, "' (PrepareModuleOutput) expected a tensor output");
    return c10::IValue(redistribute(out.toTensor(), s.output_layout(), s.desired_output_layout(), group));
  };
}

// [Note: replicated inputs] A style whose input is Replicate assumes every rank of the group holds
// the same tensor; ranks fed different data (seeded by world rank instead of data-parallel rank)
// would train a model no unsharded run computes, silently. The wrapper of such a style compares
// a CRC-32C of its input's bytes over the group at the module's first call (every call with
// FSDP_DEBUG set), one all_gather_bytes of 4 bytes per styled module, and every rank refuses a
// difference with the same error. Every rank of the group makes that first call together (it is
// the same model called alike), so the exchange pairs up.
bool takes_replicated_input(const ParallelStyle& style) {
  if (const auto* s = std::get_if<ColwiseParallel>(&style)) return s->input_layout() == Layout::replicate();
  if (const auto* s = std::get_if<RowwiseParallel>(&style)) return s->input_layout() == Layout::replicate();
  if (const auto* s = std::get_if<SequenceParallel>(&style)) return s->input_layout() == Layout::replicate();
  if (const auto* s = std::get_if<PrepareModuleInput>(&style)) return s->input_layout() == Layout::replicate();
  return false;
}

bool debug_every_call() {
  const char* v = std::getenv("FSDP_DEBUG");
  return v != nullptr && *v != '\0' && std::string(v) != "0";
}

contract::ForwardWrapper checking_replicated_input(contract::ForwardWrapper styled, const tp::Group& group,
                                                   std::string fqn, std::string style) {
  auto checked = std::make_shared<std::atomic<bool>>(false);
  return [styled = std::move(styled), group, fqn = std::move(fqn), style = std::move(style), checked](
             torch::nn::Module& m, const contract::ForwardArgs& args, const contract::ForwardFunction& forward) {
    if (!checked->load(std::memory_order_relaxed) || debug_every_call()) {
      const at::Tensor x = first_tensor(args, fqn, style.c_str()).detach().to(at::kCPU).contiguous();
      const uint32_t crc = storage::crc32c(x.data_ptr(), x.numel() * x.element_size());
      std::vector<uint8_t> mine(sizeof(crc));
      std::memcpy(mine.data(), &crc, sizeof(crc));
      const auto all = group->all_gather_bytes(mine, "parallelize_module: replicated input of " + fqn);
      for (size_t r = 1; r < all.size(); ++r) {
        TORCH_CHECK(all[r] == all[0], "parallelize_module: module '", fqn, "' (", style, ") takes a Replicate input, "
                    "so every rank of its tensor-parallel group must be given the same tensor; rank 0 and rank ", r,
                    " of the group were given different ones. Give the ranks of a tp group the same data (seed it "
                    "by data-parallel rank, not world rank; fsdp::parallel::ParallelMesh::data_rank()) ([Note: "
                    "replicated inputs])");
      }
      checked->store(true, std::memory_order_relaxed);  // a refused first call is checked again
    }
    return styled(m, args, forward);
  };
}

// A style's wrapper that counts its graph-building calls ([Note: bypassed tensor-parallel modules]).
contract::ForwardWrapper counting(contract::ForwardWrapper styled, std::shared_ptr<StyledCalls> calls) {
  return [styled = std::move(styled), calls = std::move(calls)](torch::nn::Module& m, const contract::ForwardArgs& args,
                                                                const contract::ForwardFunction& forward) {
    if (at::GradMode::is_enabled()) calls->graph_calls.fetch_add(1, std::memory_order_relaxed);
    return styled(m, args, forward);
  };
}

// The check on one placed parameter, run by its AccumulateGrad once a gradient reached it ([Note:
// bypassed tensor-parallel modules]). A post-accumulate-grad hook rather than a tensor hook: the
// tensor hooks of a parameter belong to fully_shard's first-iteration gradient guard, and this slot
// is the parameter's own (a hook already there is kept and runs first).
class RefuseBypassedUse final : public torch::autograd::PostAccumulateGradHook {
 public:
  RefuseBypassedUse(std::shared_ptr<StyledCalls> calls, std::string fqn, std::string name, std::string style,
                    std::unique_ptr<torch::autograd::PostAccumulateGradHook> previous)
      : calls_(std::move(calls)), fqn_(std::move(fqn)), name_(std::move(name)), style_(std::move(style)),
        previous_(std::move(previous)) {}

  void operator()(const torch::autograd::Variable& param) override {
    if (previous_) (*previous_)(param);
    if (calls_->graph_calls.load(std::memory_order_relaxed) > 0) return;
    TORCH_CHECK(false, kApi, ": module '", fqn_, "' (", style_, "): its parameter '", name_, "' received a gradient, "
                "but the module was never called through its hook-able holder with gradients enabled, so its "
                "tensor-parallel forward (the collectives around this rank's piece) did not run and the output and "
                "gradients computed from the piece are wrong. Expected calls such as `module(x)` on its holder "
                "(fsdp::contract::Linear, fsdp::contract::Embedding, a FSDP_HOOKABLE_MODULE holder); found the "
                "parameter used without them (`module->forward(x)` bypasses the holder, and so does reading the "
                "piece directly in another module's forward)");
  }

 private:
  std::shared_ptr<StyledCalls> calls_;
  std::string fqn_, name_, style_;
  std::unique_ptr<torch::autograd::PostAccumulateGradHook> previous_;
};

void refuse_gradient_without_styled_call(const at::Tensor& param, const std::string& fqn, const std::string& name,
                                         const std::string& style, const std::shared_ptr<StyledCalls>& calls) {
  std::unique_ptr<torch::autograd::PostAccumulateGradHook> previous;
  if (torch::autograd::impl::get_autograd_meta(param) != nullptr) {
    previous = std::move(torch::autograd::impl::post_acc_grad_hooks(param));
  }
  torch::autograd::impl::set_post_acc_grad_hooks(
      param, std::make_unique<RefuseBypassedUse>(calls, fqn, name, style, std::move(previous)));
}

void check_layout_pair(const Target& t, const Layout& from, const Layout& to) {
  TORCH_CHECK(!(from.is_shard && to.is_shard && from.dim != to.dim), where(t), ": redistributing from ",
              from.describe(), " to ", to.describe(), " is not supported (go through Replicate)");
}

// What one rank's validation found: the error, or the fingerprint of what it would apply (one
// entry per module and style, then per placed parameter: "fqn:Style;" and "fqn:shape placement;").
struct Validation {
  std::optional<std::string> error;
  std::vector<std::string> fingerprint;
};

// [Note: tensor-parallel agreement] Every rank of the tp group validates on its own (no rank
// throws yet), then the ranks agree (comm/agreement.h): first on the validation errors, so that a
// rank whose model lacks a module the plan names makes every rank refuse with that rank's error
// instead of throwing while its peers wait in the exchange; then, all valid, on the fingerprints, so
// that ranks whose plans or models differ refuse naming the first entry where they differ. Nothing
// is changed before both agreements passed.
void check_same_on_group(const Validation& mine, const std::shared_ptr<comm::Communicator>& group) {
  comm::throw_if_any_error({group}, mine.error, kApi);
  if (group->size() == 1) return;
  std::string joined;
  for (const auto& entry : mine.fingerprint) joined += entry + "\n";
  const auto all = group->all_gather_bytes(std::vector<uint8_t>(joined.begin(), joined.end()),
                                           "parallelize_module: plan check");
  std::optional<std::string> differs;
  const std::string first(all[0].begin(), all[0].end());
  if (group->rank() != 0 && joined != first) {
    std::vector<std::string> theirs;
    std::istringstream in(first);
    for (std::string line; std::getline(in, line);) theirs.push_back(line);
    size_t i = 0;
    while (i < mine.fingerprint.size() && i < theirs.size() && mine.fingerprint[i] == theirs[i]) ++i;
    auto show = [](const std::vector<std::string>& v, size_t k) {
      return k < v.size() ? "'" + v[k] + "'" : std::string("nothing more");
    };
    differs = "the ranks of the tensor-parallel group applied different plans or models: this rank would apply " +
              show(mine.fingerprint, i) + " where group rank 0 applies " + show(theirs, i) + " (entry " +
              std::to_string(i + 1) + " of module:style and module:shape placement); every rank of the group must "
              "apply the same plan to the same model";
  }
  comm::throw_if_any_error({group}, differs, kApi);
}
}  // namespace

std::string Layout::describe() const { return is_shard ? "Shard(" + std::to_string(dim) + ")" : "Replicate"; }

std::vector<std::string> match_modules(torch::nn::Module& module, const std::string& pattern) {
  std::vector<std::string> out;
  for (const auto& item : module.named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    if (matches(pattern, item.key())) out.push_back(item.key());
  }
  return out;
}

bool is_tensor_parallel(const torch::nn::Module& module) {
  return contract::ModuleStateRegistry::global().contains(module, kTensorParallelApi);
}

namespace {

// Steps 1-3 of parallelize_module on this rank alone: throws what it finds, changes nothing;
// returns the fingerprint of what would be applied.
std::vector<std::string> validate(torch::nn::Module& module, const std::shared_ptr<comm::Communicator>& group,
                                  const std::string& mesh_dim, const TensorParallelPlan& plan,
                                  contract::ModuleStateRegistry& registry, std::map<std::string, Target>& targets,
                                  std::vector<std::string>& order,
                                  std::map<std::string, std::vector<PlannedParam>>& params) {
  // 1. Refuse a model fully_shard already manages (parameters are flattened shards by then): a
  // unit on the module, around it or inside it ([Note: exclusive APIs], composable/api_names.cc).
  declare_api_exclusions();
  registry.check_exclusions(module, kTensorParallelApi, kApi);

  // 2. Resolve the plan: every entry must match a module.
  const auto named = module.named_modules(/*name_prefix=*/"", /*include_self=*/true);
  for (const auto& [pattern, style] : plan) {
    const auto fqns = match_modules(module, pattern);
    if (fqns.empty()) {
      std::string children;
      for (const auto& item : module.named_children()) children += (children.empty() ? "" : ", ") + item.key();
      TORCH_CHECK(false, kApi, ": the plan entry '", pattern, "' (", style_name(style), ") matches no module; "
                  "expected an FQN relative to the module given (its children: ", children.empty() ? "none" : children,
                  "), '*' matching one component");
    }
    for (const auto& fqn : fqns) {
      auto [it, added] = targets.try_emplace(fqn);
      if (added) {
        it->second.fqn = fqn.empty() ? "<root>" : fqn;
        it->second.module = named[fqn];
        order.push_back(fqn);
      }
      it->second.styles.push_back(style);
    }
  }

  // 3. Validate every target before changing anything.
  std::vector<std::string> fingerprint;
  for (const auto& fqn : order) {
    const Target& t = targets[fqn];
    TORCH_CHECK(!registry.contains(*t.module, kTensorParallelApi), where(t), ": already parallelized; "
                "parallelize_module applies once per module");
    int placing = 0;
    for (const auto& style : t.styles) {
      fingerprint.push_back((fqn.empty() ? "<root>" : fqn) + ":" + style_name(style));
      if (places_parameters(style)) {
        TORCH_CHECK(++placing == 1, where(t), ": at most one of ColwiseParallel, RowwiseParallel and "
                    "SequenceParallel per module; the plan gives it more");
        params[fqn] = plan_parameters(t, style, group, mesh_dim);
      }
      if (std::holds_alternative<PrepareModuleInput>(style)) {
        const auto& s = std::get<PrepareModuleInput>(style);
        check_layout_pair(t, s.input_layout(), s.desired_input_layout());
      }
      if (std::holds_alternative<PrepareModuleOutput>(style)) {
        const auto& s = std::get<PrepareModuleOutput>(style);
        check_layout_pair(t, s.output_layout(), s.desired_output_layout());
      }
    }
    for (const auto& planned : params[fqn]) {
      TORCH_CHECK(!planned.param.is_meta() || has_recorded_init(planned.param), where(t),
                  ": a meta-device parameter of shape ", contract::shape_string(planned.param.sizes()), " whose values "
                  "were not recorded (build the model under fsdp::MetaInitGuard)");
      TORCH_CHECK(!tensor_placement(planned.param), where(t), ": a parameter is already placed by an earlier "
                  "parallelize_module (tied to another parallelized module?)");
      fingerprint.push_back(t.fqn + ":" + contract::shape_string(planned.param.sizes()) + " " +
                            planned.placement.describe());
    }
  }
  return fingerprint;
}

void parallelize(torch::nn::Module& module, const std::shared_ptr<comm::Communicator>& group,
                 const std::string& mesh_dim, const TensorParallelPlan& plan) {
  TORCH_CHECK(group != nullptr, kApi, ": no tensor-parallel group given");
  auto& registry = contract::ModuleStateRegistry::global();
  std::map<std::string, Target> targets;
  std::vector<std::string> order;
  std::map<std::string, std::vector<PlannedParam>> params;
  Validation validation;
  // Steps 1-3 only look at this rank's model: what they find is agreed on before anything changes
  // ([Note: tensor-parallel agreement]).
  try {
    validation.fingerprint = validate(module, group, mesh_dim, plan, registry, targets, order, params);
  } catch (const c10::Error& e) {
    validation.error = e.what_without_backtrace();
  } catch (const std::exception& e) {
    validation.error = e.what();
  }
  check_same_on_group(validation, group);


  // 4. Apply: place the parameters, then the forward wrappers (plan order: first outermost).
  const int rank = group->rank();
  for (const auto& fqn : order) {
    const Target& t = targets[fqn];
    contract::apply_api(kTensorParallelApi, *t.module, [&](torch::nn::Module& m) {
      auto state = std::make_shared<TensorParallelState>();
      for (auto& planned : params[fqn]) {
        at::Tensor p = planned.param;
        if (planned.placement.sharded() && p.is_meta()) {
          // No memory: a meta tensor of the piece's shape whose values are this rank's piece of
          // the recorded ones (fully_shard or materialize_module materializes only it).
          at::Tensor piece = at::empty(planned.placement.local_shape(), p.options().requires_grad(false));
          record_derived_values(piece, p.detach(), [placement = planned.placement, rank](const at::Tensor& whole) {
            return placement.local_piece(whole, rank);
          });
          p.set_data(piece);
        } else if (planned.placement.sharded()) {
          at::NoGradGuard no_grad;
          p.set_data(planned.placement.local_piece(p.detach(), rank));
        }
        set_tensor_placement(p, planned.placement);
        state->placed.insert(p.unsafeGetTensorImpl());
      }
      state->calls = std::make_shared<StyledCalls>();
      for (const auto& style : t.styles) {
        state->styles.push_back(style_name(style));
        if (group->size() > 1) {
          contract::ForwardWrapper styled = make_wrapper(t, style, group);
          if (places_parameters(style)) styled = counting(std::move(styled), state->calls);
          if (takes_replicated_input(style)) {
            styled = checking_replicated_input(std::move(styled), group, t.fqn, style_name(style));
          }
          contract::register_forward_wrapper(m, std::move(styled));
        }
      }
      if (group->size() > 1) {
        std::string style;
        for (const auto& st : t.styles) {
          if (places_parameters(st)) style = style_name(st);
        }
        for (const auto& item : m.named_parameters(/*recurse=*/false)) {
          at::Tensor p = item.value();
          if (state->placed.count(p.unsafeGetTensorImpl()) == 0 || !p.requires_grad()) continue;
          refuse_gradient_without_styled_call(p, t.fqn, item.key(), style, state->calls);
        }
      }
      return state;
    });
  }
}

}  // namespace

void parallelize_module(torch::nn::Module& module, const std::shared_ptr<comm::Communicator>& group,
                        const TensorParallelPlan& plan) {
  parallelize(module, group, "tp", plan);
}

void parallelize_module(torch::nn::Module& module, const comm::DeviceMesh& mesh, const std::string& mesh_dim,
                        const TensorParallelPlan& plan) {
  parallelize(module, mesh.group(mesh_dim), mesh_dim, plan);
}

}  // namespace fsdp
