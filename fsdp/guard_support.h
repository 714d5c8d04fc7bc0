#pragma once
// What the guards against computing on sharded parameters share (fsdp/sharded_use_guard.h,
// fsdp/forward_errors.h, fsdp/gradient_guard.h): managed parameters as their errors name them, and
// the exchange of findings across ranks. Internal to fsdp/.

#include <cstddef>
#include <string>
#include <unordered_map>
#include <vector>

namespace fsdp {

class FSDPState;
class RootContext;

namespace guard {

// A managed parameter as errors name it.
struct ManagedParam {
  std::string fqn;  // relative to the root
  size_t order = 0;  // position in the root's named_parameters (errors list parameters in it)
  const FSDPState* unit = nullptr;
  std::vector<int64_t> shape;  // unsharded
};

/// 'fqn' of the unit, quoted.
std::string unit_name(const FSDPState& unit);
/// Every managed parameter of the root's tree, by TensorImpl, with its root-relative FQN (its first
/// name in the root's named_parameters; parameters of a sibling root's later modules, which the
/// root's first module does not reach, are named by their unit).
std::unordered_map<const void*, ManagedParam> managed_params(const RootContext& context);
/// Whether `unit` ran its pre-forward in this iteration.
bool ran_forward(const RootContext& context, const FSDPState& unit);

/// Exchanges `mine` (at most kMaxListed of them, then a count) across the ranks of `context`;
/// returns "  rank r: ..." lines for the ranks that found something (empty when none did).
constexpr size_t kMaxListed = 8;
std::string exchange_findings(const RootContext& context, const std::vector<std::string>& mine,
                              const char* what);

}  // namespace guard
}  // namespace fsdp
