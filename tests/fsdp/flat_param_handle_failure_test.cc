// FlatParamHandle when its all-gather fails (at issue, or when waited for): the unsharded buffer
// grown for it is freed again, the parameters stay views of the shard, and the handle works
// normally once the communicator does.
#include <chrono>
#include <memory>
#include <stdexcept>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "fsdp_cpp/fsdp/flat_param_handle.h"

// Last: LibTorch's c10/util/Logging.h defines its own CHECK, and the last definition wins.
#include <catch2/catch.hpp>

namespace {

using fsdp::FlatParamHandle;

enum class Failure { kNone, kAtIssue, kAtWait };

// An all-gather that completes at once, with the given error when waited for.
class DoneWork final : public c10d::Work {
 public:
  explicit DoneWork(bool fail) : fail_(fail) {}
  bool isCompleted() override { return true; }
  bool wait(std::chrono::milliseconds) override {
    if (fail_) throw std::runtime_error("injected all-gather failure (at wait)");
    return true;
  }

 private:
  bool fail_;
};

// Rank 0 of 2 ranks whose other rank holds a copy of rank 0's shard: all-gathers fill the output
// with the input twice, or fail as `failure` says.
class FlakyBackend final : public c10d::Backend {
 public:
  FlakyBackend() : c10d::Backend(/*rank=*/0, /*size=*/2) {}
  const std::string getBackendName() const override { return "flaky"; }
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions&) override {
    if (failure == Failure::kAtIssue) throw std::runtime_error("injected all-gather failure (at issue)");
    if (failure == Failure::kNone) {
      output.narrow(0, 0, input.numel()).copy_(input);
      output.narrow(0, input.numel(), input.numel()).copy_(input);
    }
    return c10::make_intrusive<DoneWork>(failure == Failure::kAtWait);
  }
  Failure failure = Failure::kNone;
};

std::vector<FlatParamHandle::OrigParam> make_params() {
  std::vector<FlatParamHandle::OrigParam> params;
  params.push_back({"0.weight", at::arange(24, at::kFloat).view({4, 6}).requires_grad_()});
  params.push_back({"0.bias", at::arange(4, at::kFloat).requires_grad_()});
  return params;
}

void check_sharded(const FlatParamHandle& handle, const std::vector<FlatParamHandle::OrigParam>& params) {
  CHECK_FALSE(handle.is_unsharded());
  CHECK_FALSE(handle.unshard_in_flight());
  CHECK(handle.unsharded_bytes() == 0);
  for (size_t i = 0; i < params.size(); ++i) {
    const auto s = handle.layout().slice_of(static_cast<int>(i), 0);
    CHECK(params[i].param.dim() == 1);
    CHECK(params[i].param.numel() == s.size());
  }
}

}  // namespace

TEST_CASE("a failed all-gather frees the unsharded buffer it grew; the handle works on after", "[fsdp][handle]") {
  for (const bool prefetch : {false, true}) {
    for (const Failure failure : {Failure::kAtIssue, Failure::kAtWait}) {
      INFO("prefetch " << prefetch << ", failure " << (failure == Failure::kAtIssue ? "at issue" : "at wait"));
      auto backend = c10::make_intrusive<FlakyBackend>();
      auto comm = std::make_shared<fsdp::comm::Communicator>(backend, at::kCPU);
      auto params = make_params();
      FlatParamHandle handle(params, comm, "unit");
      check_sharded(handle, params);
      backend->failure = failure;
      for (int attempt = 0; attempt < 2; ++attempt) {  // failing again leaks nothing either
        if (prefetch && failure == Failure::kAtIssue) {
          CHECK_THROWS_WITH(handle.start_unshard(), Catch::Contains("injected all-gather failure"));
        } else if (prefetch) {
          handle.start_unshard();  // issued; the error comes at the wait
          CHECK_THROWS_WITH(handle.unshard(), Catch::Contains("injected all-gather failure"));
        } else {
          CHECK_THROWS_WITH(handle.unshard(), Catch::Contains("injected all-gather failure"));
        }
        check_sharded(handle, params);
        handle.reshard();  // nothing to do, nothing to wait for
        check_sharded(handle, params);
      }
      // The communicator works again: the handle unshards (both "ranks" hold rank 0's shard).
      backend->failure = Failure::kNone;
      handle.unshard();
      CHECK(handle.is_unsharded());
      CHECK(handle.unsharded_bytes() == static_cast<size_t>(handle.layout().padded_numel * 4));
      CHECK(params[0].param.sizes() == at::IntArrayRef({4, 6}));
      handle.reshard();
      check_sharded(handle, params);
    }
  }
}
