#include "fsdp_cpp/composable/tensor_parallel.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <unordered_set>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "fsdp_cpp/composable/tensor_placement.h"
#include "fsdp_cpp/composable/tp_collectives.h"
#include "fsdp_cpp/contract/contract.h"
#include "fsdp_cpp/contract/forward_hooks.h"
#include "fsdp_cpp/contract/module_state.h"
#include "fsdp_cpp/contract/shape_text.h"
#include "fsdp_cpp/init/meta_init.h"

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

struct TensorParallelState final : contract::ApiState {
  std::vector<std::string> styles;
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
    TORCH_CHECK(own.empty() || dynamic_cast<torch::nn::LayerNormImpl*>(t.module.get()), where(t),
                ": SequenceParallel supports LayerNorm and modules without parameters of their own (Dropout, "
                "activations); found ", t.module->name(), " with ", own.size(), " parameters");
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

void check_layout_pair(const Target& t, const Layout& from, const Layout& to) {
  TORCH_CHECK(!(from.is_shard && to.is_shard && from.dim != to.dim), where(t), ": redistributing from ",
              from.describe(), " to ", to.describe(), " is not supported (go through Replicate)");
}

// Fails on every rank of the group when the ranks' plans or models differ.
void check_same_on_group(const std::string& fingerprint, comm::Communicator& group) {
  if (group.size() == 1) return;
  std::vector<uint8_t> bytes(fingerprint.begin(), fingerprint.end());
  auto all = group.all_gather_bytes(bytes, "parallelize_module: plan check");
  for (size_t r = 0; r < all.size(); ++r) {
    TORCH_CHECK(all[r] == all[0], "parallelize_module: the ranks of the tensor-parallel group applied different "
                "plans or models (group rank 0 and group rank ", r, " differ); every rank of the group must "
                "apply the same plan to the same model");
  }
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

void parallelize(torch::nn::Module& module, const std::shared_ptr<comm::Communicator>& group,
                 const std::string& mesh_dim, const TensorParallelPlan& plan) {
  TORCH_CHECK(group != nullptr, kApi, ": no tensor-parallel group given");
  auto& registry = contract::ModuleStateRegistry::global();

  // 1. Refuse a model fully_shard already manages (parameters are flattened shards by then): a
  // unit on the module, around it or inside it ([Note: exclusive APIs], composable/api_names.cc).
  declare_api_exclusions();
  registry.check_exclusions(module, kTensorParallelApi, kApi);

  // 2. Resolve the plan: every entry must match a module.
  std::map<std::string, Target> targets;
  std::vector<std::string> order;
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
  std::map<std::string, std::vector<PlannedParam>> params;
  std::string fingerprint;
  for (const auto& fqn : order) {
    const Target& t = targets[fqn];
    TORCH_CHECK(!registry.contains(*t.module, kTensorParallelApi), where(t), ": already parallelized; "
                "parallelize_module applies once per module");
    int placing = 0;
    for (const auto& style : t.styles) {
      fingerprint += fqn + ":" + style_name(style) + ";";
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
      fingerprint += contract::shape_string(planned.param.sizes()) + planned.placement.describe() + ";";
    }
  }
  check_same_on_group(fingerprint, *group);

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
      for (const auto& style : t.styles) {
        state->styles.push_back(style_name(style));
        if (group->size() > 1) contract::register_forward_wrapper(m, make_wrapper(t, style, group));
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
