// The guards' building blocks without the public API: findings exchanged across rank threads (each
// rank gets the same lines), LibTorch containers refused, and parameters hidden outside their
// unit's forward.
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "fsdp_cpp/fsdp/forward_errors.h"
#include "fsdp_cpp/fsdp/guard_support.h"
#include "fsdp_cpp/fsdp/root_context.h"
#include "fsdp_cpp/fsdp/sharded_use_guard.h"
#include "fsdp_cpp/tests/fsdp/engine_units.h"
#include "fsdp_cpp/tests/testing/thread_backend.h"

// Last: LibTorch's c10/util/Logging.h defines its own CHECK, and the last definition wins.
#include <catch2/catch.hpp>

namespace {

using Catch::Matchers::Contains;
using fsdp::testing::Failures;

std::string error_message(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.msg();
  }
  return "";
}

void require_none(Failures& f) {
  for (const auto& s : f.list) FAIL_CHECK(s);
  CHECK(f.list.empty());
}

}  // namespace

TEST_CASE("exchange_findings gives every rank the same lines, per rank that found something, capped",
          "[fsdp][guards]") {
  std::vector<std::string> messages(3);
  fsdp::testing::run_ranks_as_threads(3, [&](fsdp::comm::Communicator& comm) {
    auto module = std::make_shared<torch::nn::Module>();
    auto root = fsdp::testing::make_unit(*module, "<root>", fsdp::testing::borrow(comm));
    fsdp::RootContext context(*root, {root.get()}, {});
    std::vector<std::string> mine;
    if (comm.rank() == 1) mine = {"'a.weight' (x)", "'b.weight' (y)"};
    if (comm.rank() == 2) {
      for (int i = 0; i < 10; ++i) mine.push_back("p" + std::to_string(i));
    }
    messages[static_cast<size_t>(comm.rank())] = fsdp::guard::exchange_findings(context, mine, "test");
  });
  static_assert(fsdp::guard::kMaxListed == 8);
  const std::string expected =
      "\n  rank 1: 'a.weight' (x); 'b.weight' (y)"
      "\n  rank 2: p0; p1; p2; p3; p4; p5; p6; p7; and 2 more";
  CHECK(messages[0] == expected);
  CHECK(messages[1] == expected);
  CHECK(messages[2] == expected);
}

TEST_CASE("exchange_findings is empty when no rank found anything", "[fsdp][guards]") {
  std::vector<std::string> messages(2, "unset");
  fsdp::testing::run_ranks_as_threads(2, [&](fsdp::comm::Communicator& comm) {
    auto module = std::make_shared<torch::nn::Module>();
    auto root = fsdp::testing::make_unit(*module, "<root>", fsdp::testing::borrow(comm));
    fsdp::RootContext context(*root, {root.get()}, {});
    messages[static_cast<size_t>(comm.rank())] = fsdp::guard::exchange_findings(context, {}, "test");
  });
  CHECK(messages[0].empty());
  CHECK(messages[1].empty());
}

TEST_CASE("LibTorch's containers are refused, naming the container and what to use", "[fsdp][guards]") {
  torch::nn::Sequential sequential(torch::nn::Linear(2, 2));
  torch::nn::ModuleList list(torch::nn::Linear(2, 2));
  torch::nn::Linear linear(2, 2);
  const std::string seq = error_message([&] { fsdp::check_modules_can_run_hooks({sequential.ptr().get()}); });
  CHECK_THAT(seq, Contains("is LibTorch's torch::nn::Sequential, which cannot run forward hooks"));
  CHECK_THAT(seq, Contains("use fsdp::contract::Sequential"));
  const std::string lst = error_message([&] { fsdp::check_modules_can_run_hooks({list.ptr().get()}); });
  CHECK_THAT(lst, Contains("is LibTorch's torch::nn::ModuleList, which has no forward"));
  CHECK(error_message([&] { fsdp::check_modules_can_run_hooks({linear.ptr().get(), nullptr}); }).empty());
}

TEST_CASE("hide_params hides a sharded unit's parameters, not an unsharded one's; show_params gives them back",
          "[fsdp][guards]") {
  Failures f;
  fsdp::testing::run_ranks_as_threads(2, [&](fsdp::comm::Communicator& comm) {
    const int r = comm.rank();
    auto module = std::make_shared<fsdp::testing::Leaf>(8);
    auto unit = fsdp::testing::make_unit(*module, "u", fsdp::testing::borrow(comm));
    const at::Tensor& w = module->weight;
    const at::Tensor shard = w.detach().clone();  // this rank's 4 elements
    f.check(shard.numel() == 4, "a 4-element shard", r);
    fsdp::hide_params(*unit);
    f.check(w.numel() == 0 && unit->hidden_params().size() == 1, "hidden", r);
    fsdp::show_params(*unit);
    f.check(w.equal(shard) && unit->hidden_params().empty(), "shown", r);
    unit->unshard();
    fsdp::hide_params(*unit);  // full views: a use outside the forward computes correctly
    f.check(w.numel() == 8 && unit->hidden_params().empty(), "unsharded: not hidden", r);
    f.check(w.equal(at::arange(8, at::kFloat)), "full values", r);
    unit->reshard();

    fsdp::RootContext context(*unit, {unit.get()}, {});
    f.check(fsdp::hides_params_outside_forward(context), "hides until the graph check ran", r);
    context.iteration_state().mark_sharded_use_checked();
    f.check(!fsdp::hides_params_outside_forward(context), "not after", r);
  });
  require_none(f);
}
