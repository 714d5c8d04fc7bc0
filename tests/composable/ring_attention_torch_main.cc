// fsdp::cp::ring_attention against PyTorch's own ring attention (tests/composable/
// torch_ring_attention.py: torch's _templated_ring_attention and its backward over Gloo, 2
// processes, sharded by torch's _HeadTailLoadBalancer) on the same inputs, at cp = 2 under mpirun:
// per variant (head-tail causal, contiguous causal, contiguous full attention) this rank's chunk of
// q/k/v/dout equals torch's exactly (the same layout), and the output and q/k/v gradients agree
// within float32 tolerance (rtol 1e-5, atol 1e-5). Prints the largest differences.
// usage: mpirun -np 2 ring_attention_torch_main TORCH_OUT_DIR
#include <cstdio>
#include <string>

#include <ATen/ATen.h>

#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/composable/context_parallel.h"
#include "fsdp_cpp/storage/safetensors.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s TORCH_OUT_DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  auto pg = fsdp::comm::init_process_group();
  auto& comm = *pg.comm;
  const int rank = comm.rank(), cp = comm.size();
  int failures = 0;
  {
    fsdp::storage::SafetensorsFile inputs(dir + "/inputs.safetensors");
    fsdp::storage::SafetensorsFile torch_out(dir + "/rank" + std::to_string(rank) + ".safetensors");
    auto in = [&](const std::string& key) { return inputs.read_tensor(inputs.header().at(key)); };
    auto theirs = [&](const std::string& key) { return torch_out.read_tensor(torch_out.header().at(key)); };
    struct Variant {
      const char* name;
      bool balanced, causal;
    };
    for (const Variant& var : {Variant{"balanced_causal", true, true}, Variant{"contiguous_causal", false, true},
                               Variant{"contiguous_full", false, false}}) {
      const std::string p = std::string(var.name) + ".";
      auto shard = [&](const std::string& key) {
        return fsdp::cp::shard_sequence(in(key), 2, cp, rank, var.balanced);
      };
      at::Tensor q = shard("q"), k = shard("k"), v = shard("v"), dout = shard("dout");
      // The same layout as torch's load balancer (or plain chunks).
      for (auto [key, mine] : {std::pair<const char*, at::Tensor>{"q", q}, {"k", k}, {"v", v}, {"dout", dout}}) {
        if (!at::equal(mine, theirs(p + key))) {
          std::printf("rank %d %s: our shard of %s differs from torch's\n", rank, var.name, key);
          ++failures;
        }
      }
      q.requires_grad_();
      k.requires_grad_();
      v.requires_grad_();
      at::Tensor out = fsdp::cp::ring_attention(
          q, k, v, comm, fsdp::cp::RingAttentionOptions().causal(var.causal).load_balanced(var.balanced));
      out.backward(dout);
      for (auto [key, mine] : {std::pair<const char*, at::Tensor>{"out", out.detach()}, {"dq", q.grad()},
                               {"dk", k.grad()}, {"dv", v.grad()}}) {
        const at::Tensor want = theirs(p + key);
        const double err = (mine - want).abs().max().item<double>();
        const bool ok = mine.sizes() == want.sizes() && at::allclose(mine, want, 1e-5, 1e-5);
        std::printf("rank %d %-17s %-4s max |ours - torch| = %.3g %s\n", rank, var.name, key, err,
                    ok ? "ok" : "MISMATCH");
        failures += ok ? 0 : 1;
      }
    }
  }
  fsdp::comm::destroy_process_group();
  return failures == 0 ? 0 : 1;
}
