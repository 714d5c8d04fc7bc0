#pragma once
// What the last step() of a flat optimizer did (tests and benchmarks read it).

#include <cstdint>

namespace fsdp::optim {

struct FlatStepStats {
  int64_t flat_runs = 0;      // runs of several parameters stepped as one tensor
  int64_t flat_params = 0;    // parameters in those runs
  int64_t single_params = 0;  // parameters stepped on their own (torch::optim's way)
  int64_t adopted = 0;        // state buffers allocated for runs ([Note: flat state])
};

}  // namespace fsdp::optim
