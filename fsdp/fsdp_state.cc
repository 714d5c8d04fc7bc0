#include "fsdp/fsdp_state.h"

#include "fsdp/root_context.h"

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

FSDPState::FSDPState(torch::nn::Module& module, std::string fqn, FSDPConfig config,
                     std::vector<std::unique_ptr<FlatParamHandle>> handles)
    : module_(&module), fqn_(std::move(fqn)), config_(std::move(config)), handles_(std::move(handles)) {
  for (const auto& h : handles_) {
    for (const auto& p : h->params()) managed_.insert(p.param.unsafeGetTensorImpl());
  }
}

void FSDPState::set_fqn(std::string fqn) {
  fqn_ = std::move(fqn);
  for (auto& h : handles_) h->set_unit_fqn(fqn_);
}

bool FSDPState::manages(const at::Tensor& param) const {
  return managed_.count(param.unsafeGetTensorImpl()) > 0;
}

bool FSDPState::is_root() const { return root_context_ && root_context_->root == this; }

void FSDPState::unshard() {
  start_unshard();
  for (auto& h : handles_) h->unshard();
}

void FSDPState::reshard() {
  for (auto& h : handles_) h->reshard();
}

void FSDPState::start_unshard() {
  for (auto& h : handles_) h->start_unshard();
}

}  // namespace fsdp
