#pragma once
// A CPU allocator that counts bytes: it wraps the allocator LibTorch had installed for the CPU and
// keeps the current and peak bytes of live allocations made through it, and the size of each.
//
//   auto& alloc = fsdp::bench::CountingAllocator::install();   // before the tensors to count
//   int64_t before = alloc.current();
//   at::Tensor t = at::empty({1024});                           // 4096 more bytes
//   alloc.current() - before;                                   // 4096
//
// Marks: `mark()` starts counting anew the allocations made from then on: current_since_mark()
// is the live bytes of allocations made after the last mark (allocations older than it, freed or
// not in between, do not count), peak_since_mark() its peak since the last reset_peak(). This
// attributes bytes to one training run even when memory of an earlier run is released during it.
// fresh_at_peak(): of peak_since_mark(), the bytes of allocations made since the last
// reset_peak() (the rest was allocated before it and still live at the peak).
//
// Watched storages: `watch(storages)` names StorageImpls (e.g. FlatParameters' unsharded buffers,
// which keep their StorageImpl while their memory is freed and re-grown); after every allocation
// and every free the allocator adds up the live bytes currently backing them and keeps the peak of
// that sum (watched_peak()), and the sum at the moment peak_since_mark() was reached
// (watched_at_peak()). Only allocations made after install() are counted: the bytes of storages
// requested through LibTorch's CPU allocator (what a library allocates with its own malloc, e.g.
// BLAS or MPI scratch space, is not).

#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <c10/core/Allocator.h>
#include <c10/core/StorageImpl.h>

namespace fsdp::bench {

class CountingAllocator final : public c10::Allocator {
 public:
  /// Installs the counting allocator for the CPU (once; later calls return it).
  static CountingAllocator& install();

  c10::DataPtr allocate(size_t nbytes) override;
  void copy_data(void* dest, const void* src, std::size_t count) const override;

  int64_t current() const;
  int64_t peak() const;
  /// Starts a new mark: from now on current_since_mark() counts only allocations made after it
  /// (and peak_since_mark() restarts from 0).
  void mark();
  int64_t current_since_mark() const;
  int64_t peak_since_mark() const;
  /// Sets the peaks (overall, since the mark, the watched peak, and the watched bytes at the peak)
  /// to the current values, and starts counting fresh allocations.
  void reset_peak();
  /// The live bytes, at the moment peak_since_mark() was reached, of allocations made since the
  /// last reset_peak().
  int64_t fresh_at_peak() const;
  /// Number of allocations made through this allocator.
  int64_t allocations() const;
  /// The bytes of the live allocation starting at `data` (0 when none made here is live there).
  int64_t live_bytes(const void* data) const;

  /// The storages whose live bytes watched_current()/watched_peak() add up.
  void watch(std::vector<const c10::StorageImpl*> storages);
  int64_t watched_current() const;
  int64_t watched_peak() const;
  /// The watched storages' live bytes when peak_since_mark() was reached.
  int64_t watched_at_peak() const;

 private:
  explicit CountingAllocator(c10::Allocator* wrapped) : wrapped_(wrapped) {}
  struct Context;
  static void release(void* ctx);
  void update_watched_locked();

  c10::Allocator* wrapped_;
  mutable std::mutex mutex_;
  std::unordered_map<const void*, int64_t> live_;  // data pointer -> bytes
  int64_t current_ = 0;
  int64_t peak_ = 0;
  // Every allocation has a serial number (allocations_ when it was made); the mark and the last
  // reset_peak() are serial numbers too.
  int64_t mark_serial_ = 0;
  int64_t mark_current_ = 0;
  int64_t mark_peak_ = 0;
  int64_t fresh_serial_ = 0;
  int64_t fresh_current_ = 0;
  int64_t fresh_at_peak_ = 0;
  int64_t allocations_ = 0;
  std::vector<const c10::StorageImpl*> watched_;
  int64_t watched_current_ = 0;
  int64_t watched_peak_ = 0;
  int64_t watched_at_peak_ = 0;
};

}  // namespace fsdp::bench
