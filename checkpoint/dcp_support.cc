#include "dcp_support.h"

#include <cstdio>
#include <filesystem>

#include <c10/util/Exception.h>

#include "fsdp_cpp/comm/init.h"

namespace fsdp::dcp::detail {

namespace fs = std::filesystem;

std::shared_ptr<comm::Communicator> communicator_or_default(const std::shared_ptr<comm::Communicator>& given,
                                                            const char* api) {
  if (given) return given;
  TORCH_CHECK(comm::is_initialized(), api,
              ": no communicator was given and there is no default process group; pass "
              "options.communicator(...) or call fsdp::comm::init_process_group() first");
  return comm::default_process_group().comm;
}

std::string error_text(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) return c10->what_without_backtrace();
  return e.what();
}

std::vector<uint8_t> to_bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string from_bytes(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

// Every rank passes its error ("" when it succeeded); every rank throws the lowest failing rank's
// error, naming that rank, so all of them fail the same way.
void agree_on_success(comm::Communicator& comm, const std::string& error, const char* api, const char* stage) {
  const auto all = comm.all_gather_bytes(to_bytes(error), std::string(api) + " " + stage);
  const std::string prefix = std::string(api) + ": ";
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty()) continue;
    std::string message = from_bytes(all[r]);
    if (message.starts_with(prefix)) message = message.substr(prefix.size());
    TORCH_CHECK(false, api, " failed on rank ", r, " of ", all.size(), " (", stage, "): ", message);
  }
}

std::string five_digits(int64_t value) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%05lld", static_cast<long long>(value));
  return buf;
}

std::string shard_file_name(int rank, int index, int count) {
  return "shard-" + five_digits(rank + 1) + "-model-" + five_digits(index + 1) + "-of-" + five_digits(count) + kSuffix;
}

std::string join_path(const std::string& dir, const std::string& name) { return (fs::path(dir) / name).string(); }

// "a/b/" -> "a/b", so the temporary sibling of a folder is beside it whatever the spelling.
std::string normalized(const std::string& dir) {
  std::string out = fs::path(dir).lexically_normal().string();
  while (out.size() > 1 && out.back() == '/') out.pop_back();
  return out;
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

}  // namespace fsdp::dcp::detail
