// FlatParamHandle on 1-4 ranks as threads: sharded and unsharded views, freeing the unsharded
// buffer, gradient reduce-scatter (averaged) and accumulation, writeback of replaced data.
#include <mutex>

#include <ATen/ATen.h>

#include "fsdp_cpp/fsdp/flat_param_handle.h"
#include "fsdp_cpp/tests/testing/thread_backend.h"

// Last: LibTorch's c10/util/Logging.h defines its own CHECK, and the last definition wins.
#include <catch2/catch.hpp>

namespace {

using fsdp::FlatParamHandle;

// The same "model" on every rank: three tensors with known values.
std::vector<FlatParamHandle::OrigParam> make_params() {
  std::vector<FlatParamHandle::OrigParam> params;
  params.push_back({"0.weight", at::arange(21, at::kFloat).view({7, 3}).requires_grad_()});
  params.push_back({"1.weight", (at::arange(35, at::kFloat) + 100).view({5, 7}).requires_grad_()});
  params.push_back({"2.weight", (at::arange(25, at::kFloat) + 200).view({5, 5}).requires_grad_()});
  return params;
}

// Collects failures from rank threads; asserted on the main thread.
struct Failures {
  std::mutex m;
  std::vector<std::string> list;
  void check(bool ok, const std::string& what, int rank, int W) {
    if (ok) return;
    std::lock_guard<std::mutex> g(m);
    list.push_back(what + " (rank " + std::to_string(rank) + " of " + std::to_string(W) + ")");
  }
};

void require_none(Failures& f) {
  for (const auto& s : f.list) FAIL_CHECK(s);
  CHECK(f.list.empty());
}

}  // namespace

TEST_CASE("sharded parameters are 1-D views of this rank's slice; unshard restores full values",
          "[fsdp][handle]") {
  for (int W = 1; W <= 4; ++W) {
    Failures f;
    fsdp::testing::run_ranks_as_threads(W, [&](fsdp::comm::Communicator& comm) {
      auto shared = std::shared_ptr<fsdp::comm::Communicator>(&comm, [](auto*) {});
      auto params = make_params();
      std::vector<at::Tensor> full;
      std::vector<const void*> identity;
      for (auto& p : params) {
        full.push_back(p.param.detach().clone());
        identity.push_back(p.param.unsafeGetTensorImpl());
      }
      FlatParamHandle handle(params, shared, "unit");
      const int r = comm.rank();
      for (size_t i = 0; i < params.size(); ++i) {
        const auto s = handle.layout().slice_of(static_cast<int>(i), r);
        const at::Tensor& p = params[i].param;
        // One rank holds the whole FlatParameter: parameters keep their full shapes.
        f.check(W == 1 ? p.sizes() == full[i].sizes() : p.dim() == 1 && p.numel() == s.size(),
                "sharded shape " + params[i].fqn, r, W);
        f.check(p.reshape({-1}).equal(full[i].reshape({-1}).narrow(0, s.param_begin, s.size())),
                "sharded values " + params[i].fqn, r, W);
        f.check(p.is_leaf() && p.requires_grad(), "still a leaf requiring grad", r, W);
      }
      f.check(handle.unsharded_bytes() == 0, "no unsharded storage after construction", r, W);
      handle.unshard();
      for (size_t i = 0; i < params.size(); ++i) {
        f.check(params[i].param.equal(full[i]), "unsharded values " + params[i].fqn, r, W);
        f.check(params[i].param.unsafeGetTensorImpl() == identity[i], "same tensor object", r, W);
      }
      // One rank needs no unsharded copy: the parameters are views of the shard itself.
      f.check(handle.unsharded_bytes() == (W == 1 ? 0 : static_cast<size_t>(handle.layout().padded_numel * 4)),
              "unsharded buffer allocated", r, W);
      handle.reshard();
      f.check(handle.unsharded_bytes() == 0, "unsharded storage freed by reshard", r, W);
      f.check(params[0].param.dim() == (W == 1 ? 2 : 1), "resharded view", r, W);
    });
    INFO("world size " << W);
    require_none(f);
  }
}

TEST_CASE("gradients are reduce-scattered, averaged, and accumulated across backward passes",
          "[fsdp][handle]") {
  for (int W = 1; W <= 4; ++W) {
    Failures f;
    fsdp::testing::run_ranks_as_threads(W, [&](fsdp::comm::Communicator& comm) {
      auto shared = std::shared_ptr<fsdp::comm::Communicator>(&comm, [](auto*) {});
      auto params = make_params();
      FlatParamHandle handle(params, shared, "unit");
      const int r = comm.rank();
      // Rank r's gradient for parameter i is (r + 1) * (i + 1) everywhere: the average is
      // (W + 1) / 2 * (i + 1).
      for (int pass = 1; pass <= 2; ++pass) {
        handle.unshard();
        handle.prepare_gradients_for_backward();
        for (size_t i = 0; i < params.size(); ++i) {
          params[i].param.mutable_grad() = at::full(params[i].param.sizes(), (r + 1) * (i + 1.0));
        }
        handle.reshard();
        handle.reduce_gradients();
        handle.finalize_gradients();
        handle.commit_gradients();  // the end of the backward pass
        for (size_t i = 0; i < params.size(); ++i) {
          const at::Tensor& g = params[i].param.grad();
          const double expected = pass * (W + 1) / 2.0 * (i + 1);
          f.check(g.defined() && g.sizes() == params[i].param.sizes(), "grad shape", r, W);
          f.check(g.numel() == 0 || g.eq(expected).all().item<bool>(),
                  "grad value pass " + std::to_string(pass) + " " + params[i].fqn, r, W);
        }
      }
      // zero_grad without set_to_none zeroes the views in place: the next backward starts at 0.
      for (auto& p : params) p.param.mutable_grad().zero_();
      handle.unshard();
      handle.prepare_gradients_for_backward();
      for (auto& p : params) p.param.mutable_grad() = at::ones(p.param.sizes());
      handle.reshard();
      handle.reduce_gradients();
      handle.finalize_gradients();
      handle.commit_gradients();
      f.check(params[1].param.grad().numel() == 0 || params[1].param.grad().eq(1).all().item<bool>(),
              "zeroed then one backward", r, W);
    });
    INFO("world size " << W);
    require_none(f);
  }
}

TEST_CASE("a parameter that got no gradient contributes zeros", "[fsdp][handle]") {
  Failures f;
  fsdp::testing::run_ranks_as_threads(3, [&](fsdp::comm::Communicator& comm) {
    auto shared = std::shared_ptr<fsdp::comm::Communicator>(&comm, [](auto*) {});
    auto params = make_params();
    FlatParamHandle handle(params, shared, "unit");
    handle.unshard();
    handle.prepare_gradients_for_backward();
    if (comm.rank() == 0) params[2].param.mutable_grad() = at::full({5, 5}, 3.0);
    handle.reshard();
    handle.reduce_gradients();
    handle.finalize_gradients();
    handle.commit_gradients();
    const at::Tensor& g = params[2].param.grad();
    f.check(g.numel() == 0 || g.eq(1.0).all().item<bool>(), "3 / 3 ranks", comm.rank(), 3);
    const at::Tensor& g0 = params[0].param.grad();
    f.check(g0.numel() == 0 || g0.eq(0.0).all().item<bool>(), "zeros", comm.rank(), 3);
  });
  require_none(f);
}

TEST_CASE("data replaced while sharded is written back; a wrong shape is a clear error",
          "[fsdp][handle]") {
  Failures f;
  fsdp::testing::run_ranks_as_threads(2, [&](fsdp::comm::Communicator& comm) {
    auto shared = std::shared_ptr<fsdp::comm::Communicator>(&comm, [](auto*) {});
    auto params = make_params();
    FlatParamHandle handle(params, shared, "blocks.0");
    // Every rank replaces its shard of 1.weight with -1: the full parameter becomes all -1.
    params[1].param.set_data(at::full({params[1].param.numel()}, -1.0));
    handle.unshard();
    f.check(params[1].param.eq(-1).all().item<bool>(), "written back", comm.rank(), 2);
    f.check(params[0].param.equal(at::arange(21, at::kFloat).view({7, 3})), "others unchanged",
            comm.rank(), 2);
    handle.reshard();
    params[2].param.set_data(at::zeros({5, 5}));
    try {
      handle.unshard();
      f.check(false, "expected an error", comm.rank(), 2);
    } catch (const c10::Error& e) {
      const std::string what = e.what();
      f.check(what.find("'2.weight' of unit 'blocks.0' was replaced while sharded") != std::string::npos &&
                  what.find("[5, 5]") != std::string::npos,
              "message: " + what.substr(0, 200), comm.rank(), 2);
    }
  });
  require_none(f);
}

TEST_CASE("gradients replaced while sharded are written back before the next backward",
          "[fsdp][handle]") {
  Failures f;
  fsdp::testing::run_ranks_as_threads(2, [&](fsdp::comm::Communicator& comm) {
    auto shared = std::shared_ptr<fsdp::comm::Communicator>(&comm, [](auto*) {});
    auto params = make_params();
    FlatParamHandle handle(params, shared, "unit");
    // The user sets 1.weight's sharded gradient to 5 on every rank (e.g. a gradient hook).
    params[1].param.mutable_grad() = at::full({params[1].param.numel()}, 5.0);
    handle.unshard();
    handle.prepare_gradients_for_backward();
    for (auto& p : params) p.param.mutable_grad() = at::ones(p.param.sizes());
    handle.reshard();
    handle.reduce_gradients();
    handle.finalize_gradients();
    handle.commit_gradients();
    const at::Tensor& g1 = params[1].param.grad();
    f.check(g1.numel() == 0 || g1.eq(6.0).all().item<bool>(), "5 written back, plus 1", comm.rank(), 2);
    const at::Tensor& g0 = params[0].param.grad();
    f.check(g0.numel() == 0 || g0.eq(1.0).all().item<bool>(), "no earlier gradient", comm.rank(), 2);
    // A gradient of the wrong shape is a clear error.
    params[2].param.mutable_grad() = at::zeros({5, 5});
    try {
      handle.prepare_gradients_for_backward();
      f.check(params[2].param.numel() == 25, "expected an error", comm.rank(), 2);
    } catch (const c10::Error& e) {
      const std::string what = e.what();
      f.check(what.find("the gradient of '2.weight' in unit 'unit' has shape [5, 5]") != std::string::npos,
              "message: " + what.substr(0, 160), comm.rank(), 2);
    }
  });
  require_none(f);
}

TEST_CASE("gradients accumulate in place into the flat buffer; a failed pass restores the earlier ones",
          "[fsdp][handle]") {
  for (int W = 1; W <= 4; ++W) {
    Failures f;
    fsdp::testing::run_ranks_as_threads(W, [&](fsdp::comm::Communicator& comm) {
      auto shared = std::shared_ptr<fsdp::comm::Communicator>(&comm, [](auto*) {});
      auto params = make_params();
      FlatParamHandle handle(params, shared, "unit");
      const int r = comm.rank();
      auto backward = [&](double scale) {  // what AccumulateGrad does: add into a defined .grad
        handle.unshard();
        handle.prepare_gradients_for_backward();
        handle.prepare_gradient_buffer();
        for (size_t i = 0; i < params.size(); ++i) {
          at::Tensor& g = params[i].param.mutable_grad();
          f.check(g.defined() && g.sizes() == params[i].param.sizes() && g.eq(0).all().item<bool>(),
                  "zeroed full-shape buffer view " + params[i].fqn, r, W);
          f.check(handle.gradient_buffer_bytes() == static_cast<size_t>(handle.layout().padded_numel * 4),
                  "one flat buffer", r, W);
          g.add_(at::full(params[i].param.sizes(), scale * (r + 1) * (i + 1.0)));
          g.add_(at::full(params[i].param.sizes(), scale * (r + 1) * (i + 1.0)));  // called twice
        }
        handle.reshard();
        handle.reduce_gradients();
      };
      backward(1.0);
      handle.finalize_gradients();
      handle.commit_gradients();
      f.check(handle.gradient_buffer_bytes() == 0, "buffers freed after the pass", r, W);
      auto values_are = [&](double factor, const std::string& what) {
        for (size_t i = 0; i < params.size(); ++i) {
          const at::Tensor& g = params[i].param.grad();
          f.check(g.defined() && (g.numel() == 0 || g.eq(factor * (W + 1) / 2.0 * (i + 1)).all().item<bool>()),
                  what + " " + params[i].fqn, r, W);
        }
      };
      values_are(2.0, "averaged, in place");
      backward(10.0);  // fails before the end of its pass (reduction issued, not finalized)
      handle.discard_gradients();
      f.check(handle.gradient_buffer_bytes() == 0, "buffers freed after a failed pass", r, W);
      values_are(2.0, "restored after the failed pass");
      backward(1.0);  // the next pass accumulates onto the restored gradients only
      handle.finalize_gradients();
      handle.commit_gradients();
      values_are(4.0, "accumulated without the failed pass");
    });
    INFO("world size " << W);
    require_none(f);
  }
}
