#include "fsdp_cpp/fsdp/lazy_init.h"

#include <ATen/record_function.h>
#include <algorithm>
#include <optional>
#include <sstream>

#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include "fsdp_cpp/contract/module_fqn.h"
#include "fsdp_cpp/contract/module_state.h"
#include "fsdp_cpp/fsdp/fsdp_state.h"
#include "fsdp_cpp/fsdp/root_context.h"
#include "fsdp_cpp/fsdp/tied_parameters.h"
#include "fsdp_cpp/fsdp/unit_tree.h"

namespace fsdp::runtime {
namespace {

// [Note: units on a subset of the root's ranks] A unit inside a root uses the root's communicator,
// or one whose ranks (Communicator::world_ranks) are a subset of the root's, with the same
// replicate ranks under HSDP: expert parallelism shards an expert over the data-parallel ranks that
// hold it (torchtitan's dp_shard_mod_ep mesh) while the root's other ranks hold other experts in
// its place. Every rank of the root then holds such a unit at the same place of the tree (the same
// number of local experts), so the root's checks compare positions, not names; the unit's own
// divergence checks run over its own communicator (RootContext::check_ranks_agree(unit, ...)),
// clip_grad_norm_ sums its gradients over the root's communicator (each element is held by one
// of the root's ranks' shards), and its gradient divide factor is the caller's to set (the
// data-parallel degree of the job: the expert's gradient already sums the tokens of the whole
// expert-parallel group). A communicator whose ranks cannot be compared, or are not a subset (a
// forgotten data-parallel group, the world where the root uses one tp slice of it), is refused.
bool subset_of(const comm::Communicator& inner, const comm::Communicator& outer) {
  const auto in = inner.world_ranks(), out = outer.world_ranks();
  if (!in || !out) return false;
  for (int r : *in) {
    if (std::find(out->begin(), out->end(), r) == out->end()) return false;
  }
  return true;
}

bool same_ranks(const std::shared_ptr<comm::Communicator>& a, const std::shared_ptr<comm::Communicator>& b) {
  if (a == b) return true;
  const int size_a = a ? a->size() : 1, size_b = b ? b->size() : 1;
  if (size_a == 1 && size_b == 1) return true;
  if (!a || !b) return false;
  const auto ra = a->world_ranks(), rb = b->world_ranks();
  return ra && rb && *ra == *rb;
}

void check_unit_communicator(const FSDPState& unit, const torch::nn::Module& module, const FSDPState& root,
                             const contract::ModuleStateRegistry& registry) {
  const auto& own = unit.config().comm;
  const auto& root_comm = root.config().comm;
  if (own == root_comm) return;
  auto ranks = [](const std::shared_ptr<comm::Communicator>& c) {
    std::ostringstream out;
    const auto r = c ? c->world_ranks() : std::nullopt;
    if (!r) return std::string("unknown world ranks");
    out << "world ranks";
    for (int x : *r) out << ' ' << x;
    return out.str();
  };
  TORCH_CHECK(own && root_comm && subset_of(*own, *root_comm) && same_ranks(unit.config().replicate, root.config().replicate),
              "fully_shard: unit ", registry.describe(module), " uses another communicator than its root (",
              ranks(own), " against the root's ", ranks(root_comm), "); a unit inside a root must use the root's "
              "communicator, or one over a subset of its ranks with the same replicate ranks (expert parallel: [Note: "
              "units on a subset of the root's ranks] in fsdp/lazy_init.cc)");
}

// Whether the module at `inner` is strictly inside the module at `outer` (FQNs from the root).
bool contains_module(const std::string& outer, const std::string& inner) {
  if (inner == outer) return false;
  return outer.empty() || (inner.size() > outer.size() && inner.compare(0, outer.size(), outer) == 0 &&
                           inner[outer.size()] == '.');
}

}  // namespace

void lazy_init(FSDPState& state) {
  RECORD_USER_SCOPE("FSDP::lazy_init");
  auto& registry = contract::ModuleStateRegistry::global();
  for (const auto& other : registry.modules_with(kFullyShardApi)) {
    if (other.get() == &state.module()) continue;
    if (contract::find_module_fqn(*other, state.module()).has_value()) {
      TORCH_CHECK(false, "fully_shard: module ", registry.describe(state.module()),
                  " ran its forward before its root ", registry.describe(*other),
                  " did: the root's first forward initialises every unit inside it. Call the "
                  "root module (the outermost one fully_shard was applied to) first.");
    }
  }
  // [Note: meta-device models] in docs/architecture.md: no meta tensor may reach a forward.
  for (torch::nn::Module* module : state.modules()) {
    auto check = [&](const std::string& kind, const std::string& name, const at::Tensor& t) {
      TORCH_CHECK(!t.defined() || !t.is_meta(), "fully_shard: ", kind, " '", name, "' of ",
                  registry.describe(*module), " is still on the meta device at the root's first forward: "
                  "apply fully_shard to a module that contains it, or materialize it with "
                  "fsdp::materialize_module");
    };
    for (const auto& item : module->named_parameters(/*recurse=*/true)) check("parameter", item.key(), item.value());
    for (const auto& item : module->named_buffers(/*recurse=*/true)) check("buffer", item.key(), item.value());
  }
  UnitModuleFqns unit_fqns;
  std::vector<FSDPState*> states;
  for (const auto& unit : units_in_tree(state.module())) {
    check_unit_communicator(*unit.state, *unit.module, state, registry);
    auto& names = unit_fqns[unit.state.get()];
    if (names.empty()) states.push_back(unit.state.get());  // siblings: one unit, several modules
    names.push_back(unit.fqn);
  }
  UnitAncestors ancestors;
  for (FSDPState* unit : states) {
    auto& above = ancestors[unit];
    for (FSDPState* other : states) {
      if (other == unit) continue;
      bool contains = false;
      for (const auto& outer : unit_fqns[other]) {
        for (const auto& inner : unit_fqns[unit]) contains |= contains_module(outer, inner);
      }
      if (contains) above.push_back(other);
    }
  }
  auto context = std::make_shared<RootContext>(state, std::move(states), std::move(ancestors));
  for (FSDPState* unit : context->states()) {
    unit->set_root_context(context);
    std::string name;
    for (const auto& n : unit_fqns[unit]) name += (name.empty() ? "" : "+") + (n.empty() ? std::string("<root>") : n);
    unit->set_fqn(name);
  }
  place_tied_parameters(*context, unit_fqns);
}

}  // namespace fsdp::runtime
