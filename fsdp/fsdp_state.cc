#include "fsdp_cpp/fsdp/fsdp_state.h"

#include <sstream>

#include <algorithm>
#include <cmath>

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include "fsdp_cpp/contract/module_state.h"
#include "fsdp_cpp/fsdp/root_context.h"

namespace fsdp {

const char* to_string(TrainingState state) {
  switch (state) {
    case TrainingState::kIdle: return "idle";
    case TrainingState::kForward: return "forward";
    case TrainingState::kPreBackward: return "pre-backward";
    case TrainingState::kPostBackward: return "post-backward";
  }
  return "?";
}

FlatParamHandleOptions FSDPConfig::handle_options() const {
  FlatParamHandleOptions handle;
  handle.shard = shard();
  handle.device = device;
  handle.replicate = replicate;
  handle.post_forward_group = post_forward_group;
  handle.reduce_group = reduce_group;
  handle.param_dtype = options.mixed_precision().param_dtype();
  handle.reduce_dtype = options.mixed_precision().reduce_dtype();
  handle.offload_to_cpu = options.offload_to_cpu();
  handle.meta_values = meta_values;
  handle.all_gather_codec = options.all_gather_codec();
  handle.reduce_codec = options.reduce_codec();
  return handle;
}

FSDPState::FSDPState(std::vector<torch::nn::Module*> modules, std::string fqn, FSDPConfig config,
                     std::vector<std::unique_ptr<FlatParamHandle>> handles)
    : modules_(std::move(modules)), fqn_(std::move(fqn)), config_(std::move(config)),
      handles_(std::move(handles)) {
  TORCH_CHECK(!modules_.empty(), "fully_shard: a unit needs at least one module");
  for (const auto& h : handles_) {
    for (const auto& p : h->params()) managed_.insert(p.param.unsafeGetTensorImpl());
  }
  refresh_controls_hash();
}

std::vector<std::unique_ptr<FlatParamHandle>> FSDPState::make_handles(
    const std::vector<FlatParamHandle::OrigParam>& params, const FSDPConfig& config,
    const std::string& fqn) {
  // Before any FlatParameter is made. [Note: communication codecs] in fsdp/comm_codec.h.
  check_codecs_fit_strategy(config.options, fqn);  // fully_shard checked it already, before any change
  std::vector<std::pair<std::pair<c10::ScalarType, bool>, std::vector<FlatParamHandle::OrigParam>>> groups;
  for (const auto& p : params) {
    const auto key = std::make_pair(p.param.scalar_type(), p.param.requires_grad());
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == key; });
    if (it == groups.end()) {
      groups.push_back({key, {}});
      it = groups.end() - 1;
    }
    it->second.push_back(p);
  }
  const FlatParamHandleOptions options = config.handle_options();
  std::vector<std::unique_ptr<FlatParamHandle>> handles;
  for (auto& group : groups) {
    handles.push_back(std::make_unique<FlatParamHandle>(group.second, config.comm, fqn, options));
  }
  return handles;
}

void FSDPState::rebuild_handles(const std::vector<FlatParamHandle::OrigParam>& params) {
  handles_ = make_handles(params, config_, fqn_);
  for (auto& h : handles_) {
    h->set_gradient_divide_factor(gradient_divide_factor_);
    h->set_requires_all_reduce(requires_all_reduce_);
  }
  managed_.clear();
  for (const auto& h : handles_) {
    for (const auto& p : h->params()) managed_.insert(p.param.unsafeGetTensorImpl());
  }
}

void FSDPState::set_ignored(std::vector<at::Tensor> params, std::vector<at::Tensor> buffers) {
  ignored_params_ = std::move(params);
  ignored_buffers_ = std::move(buffers);
  ignored_.clear();
  for (const auto& p : ignored_params_) ignored_.insert(p.unsafeGetTensorImpl());
}

bool FSDPState::ignores(const at::Tensor& param) const { return ignored_.count(param.unsafeGetTensorImpl()) > 0; }

std::vector<FlatParamHandle::OrigParam> FSDPState::params() const {
  std::vector<FlatParamHandle::OrigParam> all;
  for (const auto& h : handles_) all.insert(all.end(), h->params().begin(), h->params().end());
  return all;
}

void FSDPState::set_fqn(std::string fqn) {
  fqn_ = std::move(fqn);
  for (auto& h : handles_) h->set_unit_fqn(fqn_);
}

bool FSDPState::manages(const at::Tensor& param) const {
  return managed_.count(param.unsafeGetTensorImpl()) > 0;
}

void FSDPState::set_gradient_divide_factor(std::optional<double> factor) {
  TORCH_CHECK(!factor || (std::isfinite(*factor) && *factor > 0.0),
              "FSDPModule::set_gradient_divide_factor: unit '", fqn_, "' got the factor ", *factor,
              "; expected a finite number > 0 (1.0: the sum over the data-parallel ranks, undivided)");
  gradient_divide_factor_ = factor;
  refresh_controls_hash();
  for (auto& h : handles_) h->set_gradient_divide_factor(factor);
}

void FSDPState::set_requires_all_reduce(bool all_reduce) {
  requires_all_reduce_ = all_reduce;
  refresh_controls_hash();
  for (auto& h : handles_) h->set_requires_all_reduce(all_reduce);
}

void FSDPState::divide_passthrough_gradients() const {
  if (!gradient_divide_factor_ || *gradient_divide_factor_ == 1.0) return;
  c10::NoGradGuard no_grad;
  for (const auto& h : handles_) {
    if (!h->requires_grad()) continue;
    for (const auto& p : h->params()) {
      if (p.param.grad().defined()) p.param.mutable_grad().div_(*gradient_divide_factor_);
    }
  }
}

bool FSDPState::is_root() const { return root_context_ && root_context_->root() == this; }

void FSDPState::unshard() {
  start_unshard();
  for (auto& h : handles_) h->unshard();
}

void FSDPState::reshard(bool after_forward) {
  for (auto& h : handles_) h->reshard(after_forward);
}

void FSDPState::start_unshard() {
  for (auto& h : handles_) h->start_unshard();
}

void FSDPState::use_unsharded_views_without_data() {
  for (auto& h : handles_) h->use_unsharded_views_without_data();
}

std::string FSDPState::controls_string() const {
  std::ostringstream s;
  s.precision(17);  // factors that differ in the last bit differ here too
  s << std::boolalpha << "requires_gradient_sync " << requires_gradient_sync_ << ", gradient_divide_factor ";
  if (gradient_divide_factor_) {
    s << *gradient_divide_factor_;
  } else {
    s << "default";
  }
  s << ", requires_all_reduce " << requires_all_reduce_ << ", unshard_in_backward " << unshard_in_backward_
    << ", reshard_after_backward " << reshard_after_backward_ << ", is_last_backward " << is_last_backward_;
  // The codecs decide which collectives the unit issues too ([Note: communication codecs]).
  s << ", all_gather_codec " << codec_name(config_.options.all_gather_codec()) << ", reduce_codec "
    << codec_name(config_.options.reduce_codec());
  s << ", accumulated gradients discarded by zero_grad " << gradient_discards_ << " times";
  return s.str();
}

void FSDPState::refresh_controls_hash() {
  // FNV-1a, 62 bits (see controls_hash).
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : controls_string()) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  controls_hash_ = static_cast<int64_t>(h >> 2);
}

bool FSDPState::unshard_in_flight() const {
  for (const auto& h : handles_) {
    if (h->unshard_in_flight()) return true;
  }
  return false;
}

std::string FSDPState::serialization_veto(const torch::nn::Module& module) const {
  for (const auto& item : module.named_parameters()) {
    if (!manages(item.value())) continue;
    auto& registry = contract::ModuleStateRegistry::global();
    return "module " + registry.describe(module) + " has parameters managed by fully_shard unit " +
           registry.describe(this->module()) + " (e.g. '" + item.key() +
           "'), which hold this rank's shard of their values (a 1-D slice), not the values: LibTorch's module "
           "serialization would save the shards as if they were the parameters, or replace the tensors "
           "fully_shard manages. Expected a module no fully_shard unit manages; save the model with "
           "fsdp::dcp::save (load with fsdp::dcp::load), or torch::save fsdp::full_state_dict(root) (load it "
           "with fsdp::load_full_state_dict)";
  }
  return "";
}

bool FSDPState::is_unsharded() const {
  for (const auto& h : handles_) {
    if (h->is_sharded_strategy() && !h->is_unsharded()) return false;
  }
  return true;
}

}  // namespace fsdp
