// Tied-parameter planning and moves on 2 ranks as threads, with units made by hand: a weight
// shared by an embedding and a head stays with the embedding's unit until a unit contains both,
// which takes it over (full values back, the old unit rebuilt without it); a unit that already
// ran forward cannot give it up.
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "fsdp_cpp/contract/module_state.h"
#include "fsdp_cpp/fsdp/fsdp_state.h"
#include "fsdp_cpp/fsdp/root_context.h"
#include "fsdp_cpp/fsdp/tied_parameters.h"
#include "fsdp_cpp/tests/fsdp/engine_units.h"
#include "fsdp_cpp/tests/testing/thread_backend.h"

// Last: LibTorch's c10/util/Logging.h defines its own CHECK, and the last definition wins.
#include <catch2/catch.hpp>

namespace {

using fsdp::testing::Failures;
using fsdp::testing::Leaf;

struct Head : torch::nn::Module {
  explicit Head(const at::Tensor& tied) : weight(register_parameter("weight", tied)) {}
  at::Tensor weight;
};

// emb.weight is head.weight.
struct Model : torch::nn::Module {
  Model()
      : emb(register_module("emb", std::make_shared<Leaf>(8))),
        head(register_module("head", std::make_shared<Head>(emb->weight))) {}
  std::shared_ptr<Leaf> emb;
  std::shared_ptr<Head> head;
};

void require_none(Failures& f) {
  for (const auto& s : f.list) FAIL_CHECK(s);
  CHECK(f.list.empty());
}

}  // namespace

TEST_CASE("a tied parameter stays with its unit until a unit containing every user takes it over",
          "[fsdp][tied]") {
  Failures f;
  std::vector<std::string> errors(2);
  fsdp::testing::run_ranks_as_threads(2, [&](fsdp::comm::Communicator& comm) {
    const int r = comm.rank();
    auto& registry = fsdp::contract::ModuleStateRegistry::global();
    auto model = std::make_shared<Model>();
    const at::Tensor w = model->emb->weight;
    const void* impl = w.unsafeGetTensorImpl();
    f.check(model->head->weight.unsafeGetTensorImpl() == impl, "tied", r);
    auto emb_unit = fsdp::testing::make_unit(*model->emb, "emb", fsdp::testing::borrow(comm));
    registry.insert(*model->emb, fsdp::kFullyShardApi, emb_unit);
    f.check(w.numel() == 4, "sharded by the embedding's unit", r);

    // The head does not contain the embedding: the weight stays where it is.
    const auto head_plan = fsdp::plan_tied_parameters({model->head.get()}, "'head'");
    f.check(head_plan.stay.count(impl) == 1 && head_plan.stay.size() == 1, "stays", r);
    f.check(head_plan.moves.empty(), "no move into the head", r);

    // The model contains both: the weight moves into it.
    const auto plan = fsdp::plan_tied_parameters({model.get()}, "'<root>'");
    f.check(plan.stay.empty(), "nothing stays", r);
    f.check(plan.moves.size() == 1 && plan.moves[0].param == impl && plan.moves[0].from == emb_unit,
            "moves from the embedding's unit", r);

    // Not from a unit that already ran forward.
    emb_unit->set_training_state(fsdp::TrainingState::kForward);
    try {
      fsdp::plan_tied_parameters({model.get()}, "'<root>'");
    } catch (const c10::Error& e) {
      errors[static_cast<size_t>(r)] = e.msg();
    }
    emb_unit->set_training_state(fsdp::TrainingState::kIdle);

    fsdp::take_tied_parameters(plan);  // all-gathers the embedding's unit
    f.check(w.sizes() == at::IntArrayRef({8}) && w.equal(at::arange(8, at::kFloat)), "full values back", r);
    f.check(emb_unit->params().empty() && emb_unit->handles().empty(), "the unit is rebuilt without it", r);
    f.check(!emb_unit->manages(w), "no longer managed", r);
    registry.erase(*model->emb, fsdp::kFullyShardApi);
  });
  require_none(f);
  for (const auto& e : errors) {
    CHECK(e ==
          "fully_shard: module '<root>' is the innermost unit containing every module that uses "
          "parameter 'emb.weight' ('emb', 'head'), so the parameter must move into it from unit "
          "'emb', which already ran forward. Apply fully_shard to every module, the one containing "
          "all modules that use a shared parameter last, before the first forward.");
  }
}

TEST_CASE("lazy initialisation refuses a parameter shared with a unit outside the root's tree",
          "[fsdp][tied]") {
  std::string error;
  bool context_reset = false;
  fsdp::testing::run_ranks_as_threads(1, [&](fsdp::comm::Communicator& comm) {
    auto& registry = fsdp::contract::ModuleStateRegistry::global();
    // fully_shard on the embedding and on the head, not on a module containing both: the head's
    // unit left the weight with the embedding's.
    auto model = std::make_shared<Model>();
    auto emb_unit = fsdp::testing::make_unit(*model->emb, "emb", fsdp::testing::borrow(comm));
    auto head_unit = std::make_shared<fsdp::FSDPState>(std::vector<torch::nn::Module*>{model->head.get()}, "head",
                                                       emb_unit->config(),
                                                       std::vector<std::unique_ptr<fsdp::FlatParamHandle>>{});
    registry.insert(*model->emb, fsdp::kFullyShardApi, emb_unit);
    registry.insert(*model->head, fsdp::kFullyShardApi, head_unit);
    // The embedding's first forward: it is the root of its tree.
    auto context = std::make_shared<fsdp::RootContext>(*emb_unit, std::vector<fsdp::FSDPState*>{emb_unit.get()},
                                                       fsdp::UnitAncestors{});
    emb_unit->set_root_context(context);
    try {
      fsdp::place_tied_parameters(*context, {{emb_unit.get(), {""}}});
    } catch (const c10::Error& e) {
      error = e.msg();
    }
    context_reset = emb_unit->root_context() == nullptr;  // the next forward initialises again
    registry.erase(*model->emb, fsdp::kFullyShardApi);
    registry.erase(*model->head, fsdp::kFullyShardApi);
  });
  using Catch::Matchers::Contains;
  CHECK_THAT(error, Contains("fully_shard: parameter 'weight' of unit "));
  CHECK_THAT(error, Contains("is also registered, as 'weight', by unit "));
  CHECK_THAT(error, Contains("outside that tree: no unit contains every module using the parameter"));
  CHECK_THAT(error, Contains("Apply fully_shard to a module that contains both"));
  CHECK(context_reset);
}
