// A CPU job that calls init_process_group, for torchrun_cpu_test.sh: under torchrun it must end
// with the explanation and exit status 1 on every rank, not abort() with a C++ trace.
#include <cstdio>

#include "fsdp_cpp/comm/init.h"

int main() {
  auto pg = fsdp::comm::init_process_group();
  std::printf("rank %d: init_process_group returned on the CPU under torchrun\n", pg.comm->rank());
  return 0;
}
