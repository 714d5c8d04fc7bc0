// A C interface to the counting allocator (counting_allocator.h) for Python benchmarks: built as a
// shared library (//tools/bench:libcounting_allocator_capi.so) against the same LibTorch as the
// project's Python torch, loaded with ctypes into a Python process, it installs the same counting
// allocator over torch's CPU allocator there, so both sides of a benchmark measure memory with one
// instrument (tools/bench/torch_llama_bench.py).
//
//   lib = ctypes.CDLL(path); lib.fsdp_counting_install()
//   lib.fsdp_counting_mark(); ...build the model...
//   lib.fsdp_counting_reset_peak(); ...a step...; lib.fsdp_counting_peak_since_mark()

#include <cstdint>

#include "fsdp_cpp/tools/bench/counting_allocator.h"

extern "C" {

/// Installs the counting allocator over the CPU allocator (once; later calls do nothing).
void fsdp_counting_install() { fsdp::bench::CountingAllocator::install(); }
/// CountingAllocator::mark(), reset_peak(), and the figures (bytes).
void fsdp_counting_mark() { fsdp::bench::CountingAllocator::install().mark(); }
void fsdp_counting_reset_peak() { fsdp::bench::CountingAllocator::install().reset_peak(); }
int64_t fsdp_counting_current_since_mark() { return fsdp::bench::CountingAllocator::install().current_since_mark(); }
int64_t fsdp_counting_peak_since_mark() { return fsdp::bench::CountingAllocator::install().peak_since_mark(); }
int64_t fsdp_counting_current() { return fsdp::bench::CountingAllocator::install().current(); }

}  // extern "C"
