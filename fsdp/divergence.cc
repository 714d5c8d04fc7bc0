#include "fsdp_cpp/comm/flight_recorder.h"
#include "fsdp_cpp/fsdp/divergence.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <sstream>

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include "fsdp_cpp/contract/shape_text.h"

namespace fsdp {
namespace {

void put_string(std::vector<uint8_t>& out, const std::string& s) {
  const uint32_t n = static_cast<uint32_t>(s.size());
  const auto* p = reinterpret_cast<const uint8_t*>(&n);
  out.insert(out.end(), p, p + sizeof(n));
  out.insert(out.end(), s.begin(), s.end());
}

std::string get_string(const std::vector<uint8_t>& in, size_t& pos) {
  uint32_t n = 0;
  TORCH_CHECK(pos + sizeof(n) <= in.size(), "fully_shard: malformed divergence-check fingerprint");
  std::memcpy(&n, in.data() + pos, sizeof(n));
  pos += sizeof(n);
  TORCH_CHECK(pos + n <= in.size(), "fully_shard: malformed divergence-check fingerprint");
  std::string s(in.begin() + static_cast<std::ptrdiff_t>(pos), in.begin() + static_cast<std::ptrdiff_t>(pos + n));
  pos += n;
  return s;
}

std::string rank_list(const std::vector<int>& ranks) {
  std::ostringstream s;
  s << (ranks.size() == 1 ? "rank " : "ranks ");
  for (size_t i = 0; i < ranks.size(); ++i) s << (i ? "," : "") << ranks[i];
  return s.str();
}

const std::string* field_of(const Fingerprint& f, const std::string& name) {
  for (const auto& [n, v] : f.fields) {
    if (n == name) return &v;
  }
  return nullptr;
}

bool is_forward_event(const std::string& event) {
  return event.rfind("ran ", 0) == 0 || event == "finished its forward";
}

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

}  // namespace

Fingerprint& Fingerprint::add(std::string name, std::string value) {
  fields.emplace_back(std::move(name), std::move(value));
  return *this;
}

std::vector<uint8_t> Fingerprint::serialize() const {
  std::vector<uint8_t> out;
  put_string(out, event);
  for (const auto& [name, value] : fields) {
    put_string(out, name);
    put_string(out, value);
  }
  return out;
}

Fingerprint Fingerprint::deserialize(const std::vector<uint8_t>& bytes) {
  Fingerprint f;
  size_t pos = 0;
  f.event = get_string(bytes, pos);
  while (pos < bytes.size()) {
    std::string name = get_string(bytes, pos);
    std::string value = get_string(bytes, pos);
    f.fields.emplace_back(std::move(name), std::move(value));
  }
  return f;
}

bool divergence_debug_enabled() {
  const char* env = std::getenv("FSDP_DEBUG");
  return env != nullptr && std::strcmp(env, "1") == 0;
}

void add_all_gather_fields(Fingerprint& f, const std::vector<std::unique_ptr<FlatParamHandle>>& handles,
                           bool needs_all_gather) {
  std::vector<std::string> gathers;
  std::ostringstream params;
  bool first_param = true;
  for (const auto& handle : handles) {
    const FlatParamLayout& layout = handle->layout();
    for (const auto& entry : layout.entries) {
      params << (first_param ? "" : ", ") << entry.fqn << " " << contract::shape_string(entry.shape);
      first_param = false;
    }
    params << " (" << c10::toString(handle->compute_dtype()) << ")";
    first_param = false;
    if (needs_all_gather && handle->is_sharded_strategy()) {
      std::ostringstream g;
      g << layout.shard_numel() << " elements of " << c10::toString(handle->compute_dtype()) << " per rank";
      // [Note: communication codecs] in fsdp/comm_codec.h: the world all-gather, not the one
      // inside the post-forward group.
      const auto& codec = handle->all_gather_codec();
      if (codec && !handle->has_post_forward_shard()) {
        g << ", encoded by " << codec->name() << " as " << codec->encoded_bytes(layout.shard_numel()) << " bytes";
      }
      gathers.push_back(g.str());
    }
  }
  std::ostringstream all_gather;
  for (size_t i = 0; i < gathers.size(); ++i) all_gather << (i ? " + " : "") << gathers[i];
  f.add("all-gather", gathers.empty() ? "none" : all_gather.str());
  f.add("parameters", params.str());
}

void add_reduction_fields(Fingerprint& f, const std::vector<std::unique_ptr<FlatParamHandle>>& handles,
                          bool sync) {
  std::ostringstream reduction;
  bool any = false;
  for (const auto& handle : handles) {
    if (!handle->requires_grad()) continue;
    if (any) reduction << " + ";
    any = true;
    if (!sync) {
      reduction << "none (gradients accumulate unsharded)";
      continue;
    }
    if (handle->reduces_encoded()) {  // [Note: quantized gradient reduction] in fsdp/flat_param_grad.h
      reduction << "all-to-all of " << handle->layout().world_size << " x "
                << handle->encoded_reduce_bytes() << " bytes encoded by "
                << handle->reduce_codec()->name() << " from " << handle->layout().padded_numel << " elements of "
                << c10::toString(handle->reduce_dtype());
      continue;
    }
    reduction << (handle->is_sharded_strategy() ? "reduce-scatter of " : "all-reduce of ")
              << handle->layout().padded_numel << " elements of " << c10::toString(handle->reduce_dtype());
  }
  f.add("gradient reduction", any ? reduction.str() : "none (no trainable parameters)");
  f.add("gradient sync", sync ? "on" : "off");
}

void check_ranks_agree(comm::Communicator& comm, Fingerprint local, int64_t iteration) {
  local.add("iteration", std::to_string(iteration));
  local.add("collectives issued", std::to_string(comm.sequence_number()));
  const auto all = comm.all_gather_bytes(local.serialize(), "divergence check");
  std::vector<Fingerprint> fingerprints;
  fingerprints.reserve(all.size());
  for (const auto& bytes : all) fingerprints.push_back(Fingerprint::deserialize(bytes));
  const std::string message = describe_divergence(fingerprints);
  if (!message.empty()) comm::flight_recorder::dump("fsdp divergence check: " + message);
  TORCH_CHECK(message.empty(), message);
}

std::string describe_divergence(const std::vector<Fingerprint>& fingerprints) {
  if (fingerprints.empty()) return "";
  bool all_same = true;
  for (const auto& f : fingerprints) all_same &= f == fingerprints.front();
  if (all_same) return "";

  // Groups of ranks with the same fingerprint, in order of their lowest rank.
  std::vector<std::vector<int>> groups;
  for (int r = 0; r < static_cast<int>(fingerprints.size()); ++r) {
    bool placed = false;
    for (auto& g : groups) {
      if (fingerprints[static_cast<size_t>(g.front())] == fingerprints[static_cast<size_t>(r)]) {
        g.push_back(r);
        placed = true;
        break;
      }
    }
    if (!placed) groups.push_back({r});
  }

  // Fields whose value (or presence) differs across ranks, in order of first appearance.
  std::vector<std::string> names;
  for (const auto& f : fingerprints) {
    for (const auto& [name, value] : f.fields) {
      if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
    }
  }
  std::vector<std::string> differing;
  for (const auto& name : names) {
    const std::string* first = field_of(fingerprints.front(), name);
    bool differs = false;
    for (const auto& f : fingerprints) {
      const std::string* v = field_of(f, name);
      differs |= (v == nullptr) != (first == nullptr) || (v && first && *v != *first);
    }
    if (differs) differing.push_back(name);
  }
  bool events_differ = false;
  bool all_forward = true;
  for (const auto& f : fingerprints) {
    events_differ |= f.event != fingerprints.front().event;
    all_forward &= is_forward_event(f.event);
  }
  const bool forward_order = events_differ && all_forward;
  const auto is_differing = [&](const std::string& name) {
    return std::find(differing.begin(), differing.end(), name) != differing.end();
  };

  std::ostringstream m;
  m << (forward_order ? "fully_shard: the forward order differs across ranks"
                      : "fully_shard: ranks diverged before a collective");
  if (!is_differing("iteration")) {
    if (const std::string* it = field_of(fingerprints.front(), "iteration")) m << " in iteration " << *it;
  }
  m << ": ";
  for (size_t g = 0; g < groups.size(); ++g) {
    const Fingerprint& f = fingerprints[static_cast<size_t>(groups[g].front())];
    m << (g ? "; " : "") << rank_list(groups[g]) << (groups[g].size() == 1 ? " has {" : " have {") << f.event;
    for (const auto& name : differing) {
      if (const std::string* v = field_of(f, name)) m << "; " << name << ": " << *v;
    }
    m << "}";
  }
  for (size_t r = 0; r < fingerprints.size(); ++r) m << "\n  rank " << r << ": " << fingerprints[r].event;

  m << "\n";
  if (forward_order) {
    m << "Every rank must run the same units in the same order (their collectives pair up by order).";
  } else if (events_differ) {
    m << "Every rank must run the same forward and backward passes over the same units: a rank that "
         "skips a backward, runs an extra forward, or goes on after an error the others did not "
         "raise pairs its collectives with the wrong ones.";
  }
  for (const auto& name : differing) {
    if (events_differ) break;
    if (starts_with(name, "all-gather") || name == "parameters") {
      m << "The unit's parameters differ across ranks (shapes, dtypes or count): build and shard the "
           "same model on every rank.";
      break;
    }
    if (name == "gradient sync" || name == "gradient reduction") {
      m << "set_requires_gradient_sync was called with different values on different ranks: call it "
           "with the same value on every rank.";
      break;
    }
    if (name == "iteration") {
      m << "The ranks are in different iterations: every rank must run the same forward and backward "
           "passes.";
      break;
    }
    if (name == "collectives issued") {
      m << "The ranks issued different numbers of collectives on this communicator before this point "
           "(a rank skipped or added one).";
      break;
    }
  }
  m << " (fully_shard checks this in the first iteration; FSDP_DEBUG=1 checks every iteration.)";
  return m.str();
}

}  // namespace fsdp
