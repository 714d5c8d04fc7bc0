#include "fsdp_cpp/contract/module_state.h"

#include <functional>
#include <string>
#include <thread>

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include "fsdp_cpp/tests/contract/fixtures.h"
#include "fsdp_cpp/tests/testing/errors.h"

// Catch2 last: c10/util/Logging.h defines a CHECK macro of its own, and the last definition wins.
#include <catch2/catch.hpp>

namespace {

using fsdp::testing::error_of;
using fsdp::contract::fixtures::Block;
using fsdp::contract::fixtures::BlockImpl;
using Model = fsdp::contract::fixtures::TwoBlocks;
using fsdp::contract::ApiState;
using fsdp::contract::ModuleStateRegistry;

struct CountingState : ApiState {
  explicit CountingState(int* destroyed) : destroyed_(destroyed) {}
  ~CountingState() override { ++*destroyed_; }
  int* destroyed_;
};

struct OtherState : ApiState {};

}  // namespace

TEST_CASE("insert records a state that get returns, per module and per API") {
  ModuleStateRegistry registry;
  Model model;
  auto state = std::make_shared<OtherState>();
  registry.insert(*model->block0, "fully_shard", state);

  CHECK(registry.get(*model->block0, "fully_shard") == state);
  CHECK(registry.contains(*model->block0, "fully_shard"));
  CHECK(registry.get(*model->block0, "replicate") == nullptr);
  CHECK(registry.get(*model->block1, "fully_shard") == nullptr);
  CHECK(registry.get(*model, "fully_shard") == nullptr);
  CHECK(registry.size() == 1);
}

TEST_CASE("get_as returns the typed state and rejects a state of another class") {
  int destroyed = 0;  // outlives the registry, whose states count into it when destroyed
  ModuleStateRegistry registry;
  Block block;
  auto state = std::make_shared<CountingState>(&destroyed);
  registry.insert(*block, "fully_shard", state);

  CHECK(registry.get_as<CountingState>(*block, "fully_shard") == state);
  CHECK(registry.get_as<CountingState>(*block, "replicate") == nullptr);
  const std::string message =
      error_of([&] { registry.get_as<OtherState>(*block, "fully_shard"); });
  CHECK_THAT(message, Catch::Contains("CountingState"));
  CHECK_THAT(message, Catch::Contains("OtherState"));
  CHECK_THAT(message, Catch::Contains("fully_shard"));
}

TEST_CASE("applying the same API twice fails naming the API and the module's FQN") {
  ModuleStateRegistry registry;
  Model model;
  auto first = std::make_shared<OtherState>();
  registry.insert(*model->block1, "fully_shard", first);
  registry.insert(*model, "fully_shard", std::make_shared<OtherState>());

  const std::string message = error_of(
      [&] { registry.insert(*model->block1, "fully_shard", std::make_shared<OtherState>()); });
  CHECK_THAT(message, Catch::StartsWith("fully_shard: module 'block1'"));
  CHECK_THAT(message, Catch::Contains("already has fully_shard applied"));
  CHECK(registry.get(*model->block1, "fully_shard") == first);

  const std::string root_message = error_of(
      [&] { registry.insert(*model, "fully_shard", std::make_shared<OtherState>()); });
  CHECK_THAT(root_message, Catch::StartsWith("fully_shard: module '<root>'"));
  CHECK(registry.size() == 2);
}

TEST_CASE("check_not_applied throws only for an API already applied") {
  ModuleStateRegistry registry;
  Block block;
  CHECK_NOTHROW(registry.check_not_applied(*block, "fully_shard"));
  registry.insert(*block, "fully_shard", std::make_shared<OtherState>());
  CHECK_THAT(error_of([&] { registry.check_not_applied(*block, "fully_shard"); }),
             Catch::Contains("already has fully_shard applied"));
  CHECK_NOTHROW(registry.check_not_applied(*block, "replicate"));
}

TEST_CASE("different APIs may share a module") {
  ModuleStateRegistry registry;
  Block block;
  auto replicate = std::make_shared<OtherState>();
  auto shard = std::make_shared<OtherState>();
  registry.insert(*block, "replicate", replicate);
  registry.insert(*block, "fully_shard", shard);

  CHECK(registry.get(*block, "replicate") == replicate);
  CHECK(registry.get(*block, "fully_shard") == shard);
  CHECK(registry.apis_of(*block) == std::vector<std::string>{"replicate", "fully_shard"});
  CHECK(registry.size() == 2);
}

TEST_CASE("modules_with lists the live modules carrying an API in application order") {
  ModuleStateRegistry registry;
  Model model;
  registry.insert(*model->block1, "fully_shard", std::make_shared<OtherState>());
  registry.insert(*model->block0, "replicate", std::make_shared<OtherState>());
  registry.insert(*model->block0, "fully_shard", std::make_shared<OtherState>());
  registry.insert(*model, "fully_shard", std::make_shared<OtherState>());

  const auto modules = registry.modules_with("fully_shard");
  REQUIRE(modules.size() == 3);
  CHECK(modules[0].get() == model->block1.get());
  CHECK(modules[1].get() == model->block0.get());
  CHECK(modules[2].get() == model.get());
  const auto replicated = registry.modules_with("replicate");
  REQUIRE(replicated.size() == 1);
  CHECK(replicated[0].get() == model->block0.get());
  CHECK(registry.modules_with("checkpoint").empty());
}

TEST_CASE("erase removes one API's state and destroys it") {
  int destroyed = 0;  // outlives the registry, whose states count into it when destroyed
  ModuleStateRegistry registry;
  Block block;
  registry.insert(*block, "fully_shard", std::make_shared<CountingState>(&destroyed));
  registry.insert(*block, "replicate", std::make_shared<OtherState>());

  CHECK(registry.erase(*block, "fully_shard"));
  CHECK(destroyed == 1);
  CHECK_FALSE(registry.contains(*block, "fully_shard"));
  CHECK(registry.contains(*block, "replicate"));
  CHECK_FALSE(registry.erase(*block, "fully_shard"));
  // After erase the API may be applied again.
  CHECK_NOTHROW(registry.insert(*block, "fully_shard", std::make_shared<OtherState>()));
}

TEST_CASE("the registry holds modules weakly and drops their states at prune") {
  int destroyed = 0;  // outlives the registry, whose states count into it when destroyed
  ModuleStateRegistry registry;
  Block block;
  std::weak_ptr<BlockImpl> weak = block.ptr();
  registry.insert(*block, "fully_shard", std::make_shared<CountingState>(&destroyed));

  block = nullptr;  // the last owner goes away
  CHECK(weak.expired());
  CHECK(registry.modules_with("fully_shard").empty());
  CHECK(registry.size() == 0);
  CHECK(destroyed == 0);  // released lazily ...
  CHECK(registry.prune() == 1);
  CHECK(destroyed == 1);  // ... at prune()

  // A new module (possibly at the same address) never sees the old state.
  Block fresh;
  CHECK(registry.get(*fresh, "fully_shard") == nullptr);
  CHECK_NOTHROW(registry.insert(*fresh, "fully_shard", std::make_shared<OtherState>()));
}

TEST_CASE("insert rejects a module not owned by a shared_ptr, a null state, an empty API") {
  ModuleStateRegistry registry;
  BlockImpl on_stack;
  CHECK_THAT(error_of([&] {
               registry.insert(on_stack, "fully_shard", std::make_shared<OtherState>());
             }),
             Catch::Contains("is not owned by a std::shared_ptr"));
  Block block;
  CHECK_THAT(error_of([&] { registry.insert(*block, "fully_shard", nullptr); }),
             Catch::Contains("got nullptr"));
  CHECK_THAT(error_of([&] { registry.insert(*block, "", std::make_shared<OtherState>()); }),
             Catch::Contains("non-empty API name"));
  CHECK(registry.size() == 0);
}

TEST_CASE("rollback erases only the entries inserted after the checkpoint in the given modules") {
  ModuleStateRegistry registry;
  Model model;
  registry.insert(*model->block0, "fully_shard", std::make_shared<OtherState>());
  const auto checkpoint = registry.checkpoint();
  registry.insert(*model->block0, "replicate", std::make_shared<OtherState>());
  registry.insert(*model->block1, "fully_shard", std::make_shared<OtherState>());
  Block outside;
  registry.insert(*outside, "fully_shard", std::make_shared<OtherState>());

  registry.rollback(checkpoint, {model.get(), model->block0.get(), model->block1.get()});

  CHECK(registry.contains(*model->block0, "fully_shard"));   // before the checkpoint
  CHECK_FALSE(registry.contains(*model->block0, "replicate"));
  CHECK_FALSE(registry.contains(*model->block1, "fully_shard"));
  CHECK(registry.contains(*outside, "fully_shard"));        // not in the given modules
}

TEST_CASE("describe names the FQN relative to the outermost module that carries an API") {
  ModuleStateRegistry registry;
  Model model;
  CHECK_THAT(registry.describe(*model->block1->fc), Catch::StartsWith("'<root>' ("));
  registry.insert(*model->block1, "fully_shard", std::make_shared<OtherState>());
  CHECK_THAT(registry.describe(*model->block1->fc), Catch::StartsWith("'fc' ("));
  registry.insert(*model, "fully_shard", std::make_shared<OtherState>());
  CHECK_THAT(registry.describe(*model->block1->fc), Catch::StartsWith("'block1.fc' ("));
  CHECK_THAT(registry.describe(*model->block1->fc), Catch::Contains("LinearImpl"));
}

TEST_CASE("a state's destructor may use the registry (states die outside its lock)") {
  ModuleStateRegistry registry;
  Block block;
  bool saw_itself_gone = false;
  struct ReentrantState : ApiState {
    ReentrantState(ModuleStateRegistry* registry, torch::nn::Module* module, bool* flag)
        : registry_(registry), module_(module), flag_(flag) {}
    ~ReentrantState() override { *flag_ = !registry_->contains(*module_, "fully_shard"); }
    ModuleStateRegistry* registry_;
    torch::nn::Module* module_;
    bool* flag_;
  };
  registry.insert(*block, "fully_shard",
                  std::make_shared<ReentrantState>(&registry, block.get(), &saw_itself_gone));
  CHECK(registry.erase(*block, "fully_shard"));
  CHECK(saw_itself_gone);
}

TEST_CASE("the global registry is one process-wide instance") {
  CHECK(&ModuleStateRegistry::global() == &ModuleStateRegistry::global());
}

TEST_CASE("threads apply state to their own modules concurrently") {
  // Catch2 is not thread-safe: collect in the threads, assert on the main thread.
  constexpr int kThreads = 4;
  constexpr int kModules = 50;
  ModuleStateRegistry registry;
  std::vector<std::vector<Block>> blocks(kThreads);
  std::vector<int> found(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([t, &registry, &blocks, &found] {
      for (int i = 0; i < kModules; ++i) {
        blocks[t].push_back(Block());
        registry.insert(*blocks[t].back(), "fully_shard", std::make_shared<OtherState>());
      }
      for (const Block& block : blocks[t]) {
        found[t] += registry.contains(*block, "fully_shard") ? 1 : 0;
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) {
    CHECK(found[t] == kModules);
  }
  CHECK(registry.size() == static_cast<size_t>(kThreads * kModules));
  CHECK(registry.modules_with("fully_shard").size() == static_cast<size_t>(kThreads * kModules));
}

namespace {

using fsdp::contract::AppliedApi;
using fsdp::contract::Exclusion;

// Manages the parameters it is given, by tensor identity.
struct ManagingState : ApiState {
  explicit ManagingState(std::vector<at::Tensor> params) : params_(std::move(params)) {}
  bool manages(const at::Tensor& param) const override {
    for (const auto& p : params_) {
      if (p.is_same(param)) return true;
    }
    return false;
  }
  std::vector<at::Tensor> params_;
};

std::vector<std::string> apis(const std::vector<AppliedApi>& applied) {
  std::vector<std::string> out;
  for (const auto& a : applied) out.push_back(a.api);
  return out;
}

constexpr const char* kBlock = "(fsdp::contract::fixtures::BlockImpl)";
constexpr const char* kModel = "(fsdp::contract::fixtures::TwoBlocksImpl)";

}  // namespace

TEST_CASE("applied_in lists the APIs of a module tree; api_managing names the API managing a parameter") {
  ModuleStateRegistry registry;
  Model model;
  Model other;
  const at::Tensor w0 = model->block0->fc->weight;
  const at::Tensor w1 = model->block1->fc->weight;
  CHECK_FALSE(ApiState().manages(w0));  // the default: manages nothing

  registry.insert(*model->block1, "shard", std::make_shared<ManagingState>(std::vector<at::Tensor>{w1}));
  registry.insert(*model, "replicate", std::make_shared<ManagingState>(std::vector<at::Tensor>{w0, w1}));
  registry.insert(*model->block0, "plain", std::make_shared<ApiState>());
  registry.insert(*other, "shard", std::make_shared<ManagingState>(std::vector<at::Tensor>{other->block0->fc->weight}));

  // In application order, the module itself included; only its tree.
  const auto all = registry.applied_in(*model);
  CHECK(apis(all) == std::vector<std::string>{"shard", "replicate", "plain"});
  REQUIRE(all.size() == 3);
  CHECK(all[0].module.get() == model->block1.get());
  CHECK(all[1].module.get() == model.get());
  CHECK(all[2].module.get() == model->block0.get());
  CHECK(all[1].state == registry.get(*model, "replicate"));
  CHECK(apis(registry.applied_in(*model, "shard")) == std::vector<std::string>{"shard"});
  CHECK(apis(registry.applied_in(*model->block0)) == std::vector<std::string>{"plain"});
  CHECK(registry.applied_in(*model->block0->fc).empty());
  CHECK(registry.applied_in(*other).size() == 1);
  CHECK(registry.applied_in(*other)[0].module.get() == other.get());

  // The first API, in application order, whose state manages the parameter.
  auto owner = registry.api_managing(*model, w1);
  REQUIRE(owner.has_value());
  CHECK(owner->api == "shard");
  CHECK(owner->module.get() == model->block1.get());
  owner = registry.api_managing(*model, w1, "replicate");
  REQUIRE(owner.has_value());
  CHECK(owner->api == "replicate");
  CHECK(owner->module.get() == model.get());
  owner = registry.api_managing(*model, w0);
  REQUIRE(owner.has_value());
  CHECK(owner->api == "replicate");
  CHECK_FALSE(registry.api_managing(*model, w0, "shard").has_value());
  CHECK_FALSE(registry.api_managing(*model->block0, w0).has_value());  // "plain" manages nothing
  CHECK_FALSE(registry.api_managing(*model, model->block0->fc->bias).has_value());
  CHECK_FALSE(registry.api_managing(*model, other->block0->fc->weight).has_value());  // not in the tree

  const AppliedApi* found = fsdp::contract::find_managing(all, w1);
  REQUIRE(found != nullptr);
  CHECK(found == &all[0]);
  CHECK(fsdp::contract::find_managing(all, model->block1->fc->bias) == nullptr);

  // A destroyed module's APIs are gone from the queries.
  other = nullptr;
  CHECK(registry.applied_in(*model).size() == 3);
}

TEST_CASE("declare_exclusive records exclusions, mirrored in both orders, and refuses conflicting reasons") {
  fsdp::contract::declare_exclusive({.api = "excl.a",
                                     .existing = "excl.b",
                                     .same_module = true,
                                     .both_orders = true,
                                     .why = "a and b never share a module"});
  fsdp::contract::declare_exclusive({.api = "excl.a",
                                     .existing = "excl.b",
                                     .same_module = false,
                                     .around = true,
                                     .both_orders = true,
                                     .why = "expected a outside every b"});
  // Again, identically: nothing changes.
  fsdp::contract::declare_exclusive({.api = "excl.a",
                                     .existing = "excl.b",
                                     .same_module = true,
                                     .both_orders = true,
                                     .why = "a and b never share a module"});

  const auto a = fsdp::contract::exclusions_of("excl.a");
  REQUIRE(a.size() == 2);
  CHECK(a[0].existing == "excl.b");
  CHECK((a[0].same_module && !a[0].around && !a[0].inside && !a[0].both_orders));
  CHECK(a[0].why == "a and b never share a module");
  CHECK(a[1].existing == "excl.b");
  CHECK((!a[1].same_module && a[1].around && !a[1].inside));
  CHECK(a[1].why == "expected a outside every b");
  const auto b = fsdp::contract::exclusions_of("excl.b");
  REQUIRE(b.size() == 2);
  CHECK(b[0].existing == "excl.a");
  CHECK((b[0].same_module && !b[0].around && !b[0].inside));
  CHECK(b[1].existing == "excl.a");
  CHECK((!b[1].same_module && !b[1].around && b[1].inside));  // around, seen from the other side
  CHECK(fsdp::contract::exclusions_of("excl.none").empty());

  CHECK(error_of([] {
          fsdp::contract::declare_exclusive(
              {.api = "excl.a", .existing = "excl.b", .same_module = true, .why = "another reason"});
        }) == "fsdp::contract::declare_exclusive: 'excl.a' where 'excl.b' is applied was declared exclusive "
              "twice at the same place with different reasons (\"a and b never share a module\" and \"another "
              "reason\"); expected one reason per place");
  CHECK(error_of([] {
          fsdp::contract::declare_exclusive({.api = "excl.a", .existing = "excl.a", .why = "itself"});
        }).find("'excl.a' on the same module as itself is refused by every API already") != std::string::npos);
  CHECK(error_of([] {
          fsdp::contract::declare_exclusive({.api = "excl.a", .existing = "excl.c", .same_module = false, .why = "x"});
        }).find("expected at least one place") != std::string::npos);
  CHECK(error_of([] { fsdp::contract::declare_exclusive({.api = "excl.a", .existing = "excl.c"}); })
            .find("expected a reason") != std::string::npos);
  CHECK(fsdp::contract::exclusions_of("excl.a").size() == 2);  // the refused declarations left nothing
}

TEST_CASE("check_exclusions refuses an API where an exclusive one is applied: same module, around, inside") {
  fsdp::contract::declare_exclusive({.api = "excl.d",
                                     .existing = "excl.e",
                                     .same_module = true,
                                     .around = true,
                                     .both_orders = true,
                                     .why = "expected d and e apart"});
  fsdp::contract::declare_exclusive({.api = "excl.f",
                                     .existing = "excl.f",
                                     .same_module = false,
                                     .around = true,
                                     .inside = true,
                                     .why = "expected one f per tree"});
  ModuleStateRegistry registry;
  Model model;
  registry.insert(*model, "excl.root", std::make_shared<ApiState>());  // names modules from the root
  registry.insert(*model->block0, "excl.e", std::make_shared<ApiState>());

  // On the module itself.
  CHECK(error_of([&] { registry.check_exclusions(*model->block0, "excl.d"); }) ==
        std::string("excl.d: module 'block0' ") + kBlock + " already has excl.e applied; expected d and e apart");
  // The caller's name starts the message.
  CHECK(error_of([&] { registry.check_exclusions(*model->block0, "excl.d", "apply_d"); }) ==
        std::string("apply_d: module 'block0' ") + kBlock + " already has excl.e applied; expected d and e apart");
  // Inside a module that has excl.e.
  CHECK(error_of([&] { registry.check_exclusions(*model->block0->fc, "excl.d"); }) ==
        std::string("excl.d: module 'block0.fc' (torch::nn::LinearImpl) is inside 'block0' ") + kBlock +
            ", which excl.e was applied to; expected d and e apart");
  // Mirrored: excl.e around a module that has excl.d.
  registry.insert(*model->block1->fc, "excl.d", std::make_shared<ApiState>());
  CHECK(error_of([&] { registry.check_exclusions(*model->block1, "excl.e"); }) ==
        std::string("excl.e: module 'block1' ") + kBlock +
            " contains 'fc' (torch::nn::LinearImpl), which excl.d was applied to; expected d and e apart");
  // Allowed: d around e (not declared), e beside d, an API without exclusions.
  CHECK(error_of([&] { registry.check_exclusions(*model, "excl.d"); }) == fsdp::testing::kNoError);
  CHECK(error_of([&] { registry.check_exclusions(*model->block0->fc, "excl.e"); }) == fsdp::testing::kNoError);
  CHECK(error_of([&] { registry.check_exclusions(*model->block0, "excl.none"); }) == fsdp::testing::kNoError);

  // An API excluding itself around and inside: never on the module itself (check_not_applied's job).
  registry.insert(*model->block1, "excl.f", std::make_shared<ApiState>());
  CHECK(error_of([&] { registry.check_exclusions(*model, "excl.f"); }) ==
        std::string("excl.f: module '<root>' ") + kModel + " contains 'block1' " + kBlock +
            ", which excl.f was applied to; expected one f per tree");
  CHECK(error_of([&] { registry.check_exclusions(*model->block1->fc, "excl.f"); }) ==
        std::string("excl.f: module 'block1.fc' (torch::nn::LinearImpl) is inside 'block1' ") + kBlock +
            ", which excl.f was applied to; expected one f per tree");
  CHECK(error_of([&] { registry.check_exclusions(*model->block1, "excl.f"); }) == fsdp::testing::kNoError);
  CHECK(error_of([&] { registry.check_exclusions(*model->block0, "excl.f"); }) == fsdp::testing::kNoError);
}
