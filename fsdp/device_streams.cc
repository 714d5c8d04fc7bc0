#include "fsdp_cpp/fsdp/device_streams.h"

#include <map>
#include <mutex>

namespace fsdp {
namespace {

std::mutex& registry_lock() {
  static std::mutex lock;
  return lock;
}

std::map<c10::DeviceType, DeviceStreamsFactory>& registry() {
  static std::map<c10::DeviceType, DeviceStreamsFactory> factories;
  return factories;
}

}  // namespace

void DeviceStreams::release_storage(c10::StorageImpl& storage) {
  if (storage.nbytes() == 0 && !storage.data_ptr()) return;
  c10::DataPtr memory = storage.set_data_ptr(c10::DataPtr(nullptr, storage.device()));
  storage.set_nbytes(0);
  release_after_compute(std::move(memory));
}

void UnshardOrder::begin_iteration() {
  in_iteration_ = true;
  wait_for_compute_ = true;
}

std::vector<uint64_t> UnshardOrder::end_iteration() {
  in_iteration_ = false;
  std::vector<uint64_t> free;
  for (const Held& h : held_) free.push_back(h.id);
  held_.clear();
  return free;
}

UnshardOrder::Issue UnshardOrder::issue(bool input_written) {
  Issue result;
  result.wait_for_compute = serialized_ || !in_iteration_ || wait_for_compute_ || input_written;
  wait_for_compute_ = false;
  // Waiting for the compute stream covers every held buffer's event. Otherwise only buffers
  // released before the compute stream last received an all-gather's result are freed: they belong
  // to units whose compute this all-gather is not meant to overlap (waiting for them costs nothing
  // that matters), while the buffer just resharded (the unit running on the GPU now) is kept.
  size_t n = 0;
  while (n < held_.size() && (result.wait_for_compute || held_[n].handoffs < handoffs_)) {
    result.free.push_back(held_[n].id);
    ++n;
  }
  held_.erase(held_.begin(), held_.begin() + static_cast<std::ptrdiff_t>(n));
  return result;
}

bool UnshardOrder::hold(uint64_t id) {
  if (!in_iteration_) return false;
  held_.push_back({id, handoffs_});
  return true;
}

bool register_device_streams(c10::DeviceType type, DeviceStreamsFactory factory) {
  std::lock_guard<std::mutex> guard(registry_lock());
  registry()[type] = factory;
  return true;
}

std::shared_ptr<DeviceStreams> device_streams_for(at::Device device) {
  DeviceStreamsFactory factory = nullptr;
  {
    std::lock_guard<std::mutex> guard(registry_lock());
    const auto it = registry().find(device.type());
    if (it != registry().end()) factory = it->second;
  }
  if (factory != nullptr) return factory(device);
  static auto inline_streams = std::make_shared<DeviceStreams>();
  return inline_streams;
}

}  // namespace fsdp
