#include "fsdp_cpp/fsdp/divergence_check.h"

namespace fsdp {

void DivergenceCheck::begin_iteration(int64_t completed_iterations) {
  enabled_ = completed_iterations == 0 || divergence_debug_enabled();
}

void DivergenceCheck::check(Fingerprint fingerprint, int64_t iteration) const {
  if (!enabled_ || comm_ == nullptr || comm_->size() == 1) return;
  check_ranks_agree(*comm_, std::move(fingerprint), iteration);
}

void DivergenceCheck::check(comm::Communicator& comm, Fingerprint fingerprint, int64_t iteration) const {
  if (!enabled_ || comm.size() == 1) return;
  check_ranks_agree(comm, std::move(fingerprint), iteration);
}

}  // namespace fsdp
