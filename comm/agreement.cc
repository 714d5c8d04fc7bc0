#include "fsdp_cpp/comm/agreement.h"

#include <climits>
#include <cstdint>
#include <cstring>
#include <set>
#include <tuple>

#include <c10/util/Exception.h>

namespace fsdp::comm {
namespace {

// One rank's error: its world rank (INT_MAX when unknown, so that known ranks come first), how the
// message names the rank ("rank 3", or "group rank 1" without world ranks) and the error.
using Entry = std::tuple<int, std::string, std::string>;

void put_u32(std::vector<uint8_t>& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

void put_string(std::vector<uint8_t>& out, const std::string& s) {
  put_u32(out, static_cast<uint32_t>(s.size()));
  out.insert(out.end(), s.begin(), s.end());
}

std::vector<uint8_t> encode(const std::set<Entry>& entries) {
  std::vector<uint8_t> out;
  put_u32(out, static_cast<uint32_t>(entries.size()));
  for (const auto& [rank, label, message] : entries) {
    put_u32(out, static_cast<uint32_t>(rank));
    put_string(out, label);
    put_string(out, message);
  }
  return out;
}

struct Reader {
  const std::vector<uint8_t>& bytes;
  size_t at = 0;
  uint32_t u32(const std::string& api) {
    TORCH_CHECK(at + 4 <= bytes.size(), api, ": internal error: a truncated error agreement message");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(bytes[at + i]) << (8 * i);
    at += 4;
    return v;
  }
  std::string string(const std::string& api) {
    const uint32_t n = u32(api);
    TORCH_CHECK(at + n <= bytes.size(), api, ": internal error: a truncated error agreement message");
    std::string s(bytes.begin() + at, bytes.begin() + at + n);
    at += n;
    return s;
  }
};

void decode_into(const std::vector<uint8_t>& bytes, std::set<Entry>& entries, const std::string& api) {
  Reader in{bytes};
  const uint32_t n = in.u32(api);
  for (uint32_t i = 0; i < n; ++i) {
    const int rank = static_cast<int>(in.u32(api));
    std::string label = in.string(api);
    std::string message = in.string(api);
    entries.emplace(rank, std::move(label), std::move(message));
  }
}

}  // namespace

std::optional<std::string> agree_on_error(const std::vector<std::shared_ptr<Communicator>>& groups,
                                          const std::optional<std::string>& local_error, const std::string& api) {
  std::set<Entry> known;
  if (local_error) {
    // How this rank is named: its world rank if a group knows it, else its rank in the first group.
    int world_rank = INT_MAX;
    std::string label;
    for (const auto& g : groups) {
      if (!g) continue;
      if (auto r = g->world_rank()) {
        world_rank = *r;
        label = "rank " + std::to_string(*r);
        break;
      }
      if (label.empty()) label = "group rank " + std::to_string(g->rank());
    }
    if (label.empty()) label = "this rank";
    std::string message = *local_error;
    const std::string prefix = api + ": ";
    if (message.compare(0, prefix.size(), prefix) == 0) message.erase(0, prefix.size());
    known.emplace(world_rank, std::move(label), std::move(message));
  }
  for (const auto& g : groups) {
    if (!g || g->size() == 1) continue;
    const auto gathered = g->all_gather_bytes(encode(known), api + ": error agreement");
    for (const auto& bytes : gathered) decode_into(bytes, known, api);
  }
  if (known.empty()) return std::nullopt;
  const auto& [rank, label, message] = *known.begin();
  std::string out = api + ": " + label + ": " + message;
  if (known.size() > 1) {
    // The other ranks that found errors, at most kListed of them by name.
    constexpr size_t kListed = 8;
    std::string others;
    size_t listed = 0;
    for (auto it = std::next(known.begin()); it != known.end() && listed < kListed; ++it, ++listed) {
      others += (others.empty() ? "" : ", ") + std::get<1>(*it);
    }
    if (known.size() - 1 > listed) others += " and " + std::to_string(known.size() - 1 - listed) + " more";
    out += " (errors were also found on " + others + "; the lowest rank's is shown)";
  }
  return out;
}

void throw_if_any_error(const std::vector<std::shared_ptr<Communicator>>& groups,
                        const std::optional<std::string>& local_error, const std::string& api) {
  if (auto error = agree_on_error(groups, local_error, api)) TORCH_CHECK(false, *error);
}

}  // namespace fsdp::comm
