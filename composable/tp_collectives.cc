#include "fsdp_cpp/composable/tp_collectives.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

namespace fsdp::tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

enum class Op : int64_t { kIdentity, kAllReduce, kAllGather, kReduceScatter, kSplit };

const char* scope_name(Op op) {
  switch (op) {
    case Op::kIdentity: return "tensor_parallel::identity";
    case Op::kAllReduce: return "tensor_parallel::all_reduce";
    case Op::kAllGather: return "tensor_parallel::all_gather";
    case Op::kReduceScatter: return "tensor_parallel::reduce_scatter";
    case Op::kSplit: return "tensor_parallel::split";
  }
  return "tensor_parallel";
}

// Moves `dim` to the front, contiguous: the collectives work on dimension 0.
at::Tensor front(const at::Tensor& x, int64_t dim) { return x.movedim(dim, 0).contiguous(); }

at::Tensor run(Op op, const at::Tensor& x, int64_t dim, comm::Communicator& group) {
  RECORD_FUNCTION(scope_name(op), std::vector<c10::IValue>());
  const int n = group.size();
  const int r = group.rank();
  switch (op) {
    case Op::kIdentity: return x;
    case Op::kAllReduce: {
      at::Tensor out = x.contiguous().clone();
      group.all_reduce(out, c10d::ReduceOp::SUM, "tensor_parallel").wait();
      return out;
    }
    case Op::kAllGather: {
      at::Tensor in = front(x, dim);
      std::vector<int64_t> shape = in.sizes().vec();
      shape[0] *= n;
      at::Tensor out = at::empty(shape, in.options());
      group.all_gather_into_tensor(out, in, "tensor_parallel").wait();
      return out.movedim(0, dim);
    }
    case Op::kReduceScatter: {
      at::Tensor in = front(x, dim);
      TORCH_CHECK(in.size(0) % n == 0, "tensor_parallel: reduce-scatter of dimension ", dim, " of size ",
                  in.size(0), " over a group of ", n, " ranks; expected a multiple of ", n);
      std::vector<int64_t> shape = in.sizes().vec();
      shape[0] /= n;
      at::Tensor out = at::empty(shape, in.options());
      group.reduce_scatter_tensor(out, in, c10d::ReduceOp::SUM, "tensor_parallel").wait();
      return out.movedim(0, dim);
    }
    case Op::kSplit: {
      TORCH_CHECK(x.size(dim) % n == 0, "tensor_parallel: splitting dimension ", dim, " of size ",
                  x.size(dim), " over a group of ", n, " ranks; expected a multiple of ", n);
      const int64_t piece = x.size(dim) / n;
      return x.narrow(dim, r * piece, piece).contiguous();
    }
  }
  return x;
}

struct GroupHolder final : torch::CustomClassHolder {
  explicit GroupHolder(Group g) : group(std::move(g)) {}
  Group group;
};

// One collective forward, another backward.
struct TpFunction : torch::autograd::Function<TpFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x,
                               c10::intrusive_ptr<GroupHolder> holder, int64_t forward_op,
                               int64_t backward_op, int64_t dim) {
    ctx->saved_data["group"] = c10::IValue::make_capsule(holder);
    ctx->saved_data["op"] = backward_op;
    ctx->saved_data["dim"] = dim;
    at::Tensor out = run(static_cast<Op>(forward_op), x, dim, *holder->group);
    // Forward of the identity returns its input: autograd needs a tensor of its own.
    if (out.is_same(x)) out = x.view_as(x);
    ctx->saved_data["sizes"] = out.sizes().vec();
    ctx->saved_data["dtype"] = static_cast<int64_t>(out.scalar_type());
    ctx->saved_data["device"] = out.device().str();
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto holder = c10::static_intrusive_pointer_cast<GroupHolder>(ctx->saved_data["group"].toCapsule());
    const auto op = static_cast<Op>(ctx->saved_data["op"].toInt());
    const int64_t dim = ctx->saved_data["dim"].toInt();
    at::Tensor g = grads[0];
    // An output autograd never needed a gradient for still takes part in the collective: every
    // rank of the group runs the same backward and must issue the same collectives.
    if (!g.defined()) {
      g = at::zeros(ctx->saved_data["sizes"].toIntVector(),
                    at::TensorOptions()
                        .dtype(static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt()))
                        .device(at::Device(ctx->saved_data["device"].toStringRef())));
    }
    return {run(op, g, dim, *holder->group), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor apply(const at::Tensor& x, const Group& group, Op forward_op, Op backward_op, int64_t dim) {
  TORCH_CHECK(group != nullptr, "tensor_parallel: no group given");
  TORCH_CHECK(x.defined(), "tensor_parallel: undefined tensor");
  if (group->size() == 1) return x;
  dim = dim < 0 ? dim + x.dim() : dim;
  TORCH_CHECK(dim >= 0 && dim < std::max<int64_t>(x.dim(), 1), "tensor_parallel: dimension out of range for a ",
              x.dim(), "-d tensor");
  if (!x.requires_grad() || !c10::GradMode::is_enabled()) return run(forward_op, x, dim, *group);
  return TpFunction::apply(x, c10::make_intrusive<GroupHolder>(group), static_cast<int64_t>(forward_op),
                           static_cast<int64_t>(backward_op), dim)[0];
}

}  // namespace

at::Tensor copy_to_tp(const at::Tensor& x, const Group& group) {
  return apply(x, group, Op::kIdentity, Op::kAllReduce, 0);
}

at::Tensor reduce_from_tp(const at::Tensor& x, const Group& group) {
  return apply(x, group, Op::kAllReduce, Op::kIdentity, 0);
}

at::Tensor gather_from_tp(const at::Tensor& x, int64_t dim, const Group& group) {
  return apply(x, group, Op::kAllGather, Op::kSplit, dim);
}

at::Tensor split_to_tp(const at::Tensor& x, int64_t dim, const Group& group) {
  return apply(x, group, Op::kSplit, Op::kAllGather, dim);
}

at::Tensor all_gather_tp(const at::Tensor& x, int64_t dim, const Group& group) {
  return apply(x, group, Op::kAllGather, Op::kReduceScatter, dim);
}

at::Tensor reduce_scatter_tp(const at::Tensor& x, int64_t dim, const Group& group) {
  return apply(x, group, Op::kReduceScatter, Op::kAllGather, dim);
}

}  // namespace fsdp::tp
