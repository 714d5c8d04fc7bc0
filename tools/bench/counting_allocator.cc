#include "fsdp_cpp/tools/bench/counting_allocator.h"

#include <algorithm>
#include <utility>

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

namespace fsdp::bench {

// What the DataPtr handed out owns: the wrapped allocator's DataPtr and the byte count.
struct CountingAllocator::Context {
  CountingAllocator* owner;
  c10::DataPtr inner;
  int64_t nbytes;
  int64_t serial;
};

CountingAllocator& CountingAllocator::install() {
  static CountingAllocator* instance = [] {
    auto* alloc = new CountingAllocator(c10::GetAllocator(c10::DeviceType::CPU));
    // The highest priority, so that nothing registered later replaces it.
    c10::SetAllocator(c10::DeviceType::CPU, alloc, /*priority=*/255);
    TORCH_CHECK(c10::GetAllocator(c10::DeviceType::CPU) == alloc,
                "CountingAllocator: c10::SetAllocator did not install the counting allocator");
    return alloc;
  }();
  return *instance;
}

c10::DataPtr CountingAllocator::allocate(size_t nbytes) {
  c10::DataPtr inner = wrapped_->allocate(nbytes);
  void* data = inner.get();
  const c10::Device device = inner.device();
  auto* ctx = new Context{this, std::move(inner), static_cast<int64_t>(nbytes), 0};
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ctx->serial = allocations_++;  // >= mark_serial_ and fresh_serial_
    if (data != nullptr) live_[data] = ctx->nbytes;
    current_ += ctx->nbytes;
    mark_current_ += ctx->nbytes;
    fresh_current_ += ctx->nbytes;
    update_watched_locked();
    peak_ = std::max(peak_, current_);
    if (mark_current_ > mark_peak_) {
      mark_peak_ = mark_current_;
      watched_at_peak_ = watched_current_;
      fresh_at_peak_ = fresh_current_;
    }
  }
  return c10::DataPtr(data, ctx, &CountingAllocator::release, device);
}

void CountingAllocator::release(void* ptr) {
  auto* ctx = static_cast<Context*>(ptr);
  CountingAllocator* self = ctx->owner;
  {
    std::lock_guard<std::mutex> lock(self->mutex_);
    if (ctx->inner.get() != nullptr) self->live_.erase(ctx->inner.get());
    self->current_ -= ctx->nbytes;
    if (ctx->serial >= self->mark_serial_) self->mark_current_ -= ctx->nbytes;
    if (ctx->serial >= self->fresh_serial_) self->fresh_current_ -= ctx->nbytes;
  }
  delete ctx;  // frees through the wrapped allocator's deleter
  std::lock_guard<std::mutex> lock(self->mutex_);
  self->update_watched_locked();
}

void CountingAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  wrapped_->copy_data(dest, src, count);
}

void CountingAllocator::update_watched_locked() {
  if (watched_.empty()) {
    watched_current_ = 0;
    return;
  }
  int64_t sum = 0;
  for (const c10::StorageImpl* s : watched_) {
    const void* data = s->data_ptr().get();
    if (data == nullptr) continue;
    auto it = live_.find(data);
    if (it != live_.end()) sum += it->second;
  }
  watched_current_ = sum;
  watched_peak_ = std::max(watched_peak_, sum);
}

int64_t CountingAllocator::current() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return current_;
}

int64_t CountingAllocator::peak() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return peak_;
}

void CountingAllocator::mark() {
  std::lock_guard<std::mutex> lock(mutex_);
  mark_serial_ = allocations_;
  mark_current_ = 0;
  mark_peak_ = 0;
}

int64_t CountingAllocator::current_since_mark() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return mark_current_;
}

int64_t CountingAllocator::peak_since_mark() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return mark_peak_;
}

void CountingAllocator::reset_peak() {
  std::lock_guard<std::mutex> lock(mutex_);
  peak_ = current_;
  mark_peak_ = mark_current_;
  fresh_serial_ = allocations_;
  fresh_current_ = 0;
  fresh_at_peak_ = 0;
  update_watched_locked();
  watched_peak_ = watched_current_;
  watched_at_peak_ = watched_current_;
}

int64_t CountingAllocator::fresh_at_peak() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return fresh_at_peak_;
}

int64_t CountingAllocator::allocations() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return allocations_;
}

int64_t CountingAllocator::live_bytes(const void* data) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(data);
  return it == live_.end() ? 0 : it->second;
}

void CountingAllocator::watch(std::vector<const c10::StorageImpl*> storages) {
  std::lock_guard<std::mutex> lock(mutex_);
  watched_ = std::move(storages);
  watched_peak_ = 0;
  update_watched_locked();
}

int64_t CountingAllocator::watched_current() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return watched_current_;
}

int64_t CountingAllocator::watched_peak() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return watched_peak_;
}

int64_t CountingAllocator::watched_at_peak() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return watched_at_peak_;
}

}  // namespace fsdp::bench
