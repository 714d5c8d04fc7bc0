#pragma once
// HiddenParams: the parameters of one unit hidden behind an empty placeholder ([Note: hidden
// parameters] in fsdp/sharded_use_guard.h), each with the data it held.
//
// Invariant: each parameter is hidden at most once (its data is the placeholder while hidden), and
// show_all() gives back the data only to parameters still holding their placeholder: anything else
// gave the parameter new data since, which stays.

#include <vector>

#include <ATen/core/Tensor.h>

namespace fsdp {

class HiddenParams {
 public:
  bool empty() const { return hidden_.empty(); }
  size_t size() const { return hidden_.size(); }
  /// Whether `param` is hidden.
  bool hides(const at::Tensor& param) const;
  /// Replaces `param`'s data by an empty placeholder (shape [0], its own dtype and device), keeping
  /// what it held. No-op for a parameter hidden already.
  void hide(const at::Tensor& param);
  /// Gives the hidden parameters back what they held and forgets them.
  void show_all();

 private:
  struct Hidden {
    at::Tensor param, data, placeholder;
  };
  std::vector<Hidden> hidden_;
};

}  // namespace fsdp
