#include "fsdp/device_streams.h"

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
