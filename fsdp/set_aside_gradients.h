#pragma once
// SetAsideGradients: the gradients parameters held when a backward pass began, set aside so the
// pass can be undone if it throws ([Note: passthrough backward] in fsdp/backward.cc).
//
// Invariant: between set_aside() and add_back() or restore(), each parameter set aside holds only
// what the pass computed; both end the pass and forget what was set aside.

#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace fsdp {

class SetAsideGradients {
 public:
  bool empty() const { return saved_.empty(); }
  /// Forgets what was set aside without touching the parameters.
  void clear() { saved_.clear(); }
  /// Keeps the gradient `param` holds (possibly none) and clears it.
  void set_aside(const at::Tensor& param);
  /// The pass ended: adds the kept gradients to what the pass computed (the kept one alone where
  /// the pass computed none).
  void add_back();
  /// The pass threw: gives the parameters back exactly what they held.
  void restore();

 private:
  std::vector<std::pair<at::Tensor, at::Tensor>> saved_;  // (parameter, its gradient then)
};

}  // namespace fsdp
