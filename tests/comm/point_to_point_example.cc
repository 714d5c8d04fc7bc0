#include "fsdp_cpp/comm/init.h"                      // target //comm:init

#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>

int main() {
  auto pg = fsdp::comm::init_process_group();
  auto& comm = *pg.comm;
  bool ok = true;
  if (comm.size() > 1) {  // one rank has no peer: a send to itself is a c10::Error
    const int next = (comm.rank() + 1) % comm.size();
    const int previous = (comm.rank() + comm.size() - 1) % comm.size();
    at::Tensor activations = at::arange(8, at::kFloat).view({2, 4}) + comm.rank();
    at::Tensor received = at::empty({2, 4});
    auto recv = comm.recv(received, previous, /*tag=*/0, "activations");  // issue recvs first
    auto send = comm.send(activations, next, /*tag=*/0, "activations");
    send.wait();  // returns once `next` received it (or throws: other dtype or element count)
    recv.wait();
    ok = received.equal(at::arange(8, at::kFloat).view({2, 4}) + previous);
    ok = ok && comm.stats(fsdp::comm::CollectiveKind::kSend).bytes == 32;  // {calls 1, bytes 32}
  }
  fsdp::comm::destroy_process_group();
  return ok ? 0 : 1;
}
