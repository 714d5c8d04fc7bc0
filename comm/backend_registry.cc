#include "fsdp_cpp/comm/backend_registry.h"

#include <map>
#include <mutex>

namespace fsdp::comm {
namespace {

std::mutex& registry_lock() {
  static std::mutex lock;
  return lock;
}

std::map<c10::DeviceType, BackendFactory>& registry() {
  static std::map<c10::DeviceType, BackendFactory> factories;
  return factories;
}

std::map<std::string, GroupSplitter>& splitters() {
  static std::map<std::string, GroupSplitter> registered;
  return registered;
}

}  // namespace

bool register_group_splitter(const char* backend_name, GroupSplitter splitter) {
  std::lock_guard<std::mutex> guard(registry_lock());
  splitters()[backend_name] = splitter;
  return true;
}

GroupSplitter find_group_splitter(const std::string& backend_name) {
  std::lock_guard<std::mutex> guard(registry_lock());
  const auto it = splitters().find(backend_name);
  return it == splitters().end() ? nullptr : it->second;
}

bool register_backend_factory(c10::DeviceType type, const char* /*name*/, BackendFactory factory) {
  std::lock_guard<std::mutex> guard(registry_lock());
  registry()[type] = factory;
  return true;
}

BackendFactory find_backend_factory(c10::DeviceType type) {
  std::lock_guard<std::mutex> guard(registry_lock());
  const auto it = registry().find(type);
  return it == registry().end() ? nullptr : it->second;
}

}  // namespace fsdp::comm
