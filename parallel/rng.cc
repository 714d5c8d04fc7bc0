#include "fsdp_cpp/parallel/rng.h"

#include <torch/utils.h>

namespace fsdp::parallel {
namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

uint64_t forward_seed(uint64_t seed, int64_t step, int64_t data_rank, int64_t microbatch, int64_t stage) {
  uint64_t h = splitmix64(seed);
  for (int64_t v : {step, data_rank, microbatch, stage}) h = splitmix64(h ^ static_cast<uint64_t>(v));
  // torch::manual_seed's CPU generator takes the seed whole; keep it positive for printing.
  return h >> 1;
}

void seed_forward(uint64_t seed, int64_t step, int64_t data_rank, int64_t microbatch, int64_t stage) {
  torch::manual_seed(forward_seed(seed, step, data_rank, microbatch, stage));
}

}  // namespace fsdp::parallel
